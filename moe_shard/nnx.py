"""`MoE`: the MoE layer as a Flax NNX module (the `flax` extra: `pip install moe_shard[flax]`).

    from moe_shard.nnx import MoE
    moe = MoE(cfg, rngs=nnx.Rngs(0), mesh=mesh)   # parameters created sharded
    y_BSD, aux = moe(x_BSD)                        # moe_layer(moe.moe_params(), x_BSD, cfg, mesh)
    moe = MoE.from_params(cfg, params, mesh=mesh)  # around given MoEParams (a checkpoint)
    moe.replicate_experts(placement, optimizer=opt, model=model)  # slot-major, in place
    y_BSD, aux = moe(x_BSD, placement=placement)   # served or trained on the replicas

A thin module over `init_moe_params` and `moe_layer`: the parameters are the leaves of
`MoEParams`, each an `nnx.Param` (the balancing bias `router_bias` a `RouterBias`, not
trained) carrying its `PartitionSpec` as Flax's `out_sharding` metadata (`moe_param_specs`,
one entry per dimension), so `nnx.get_partition_spec`, `nnx.vmap`/`nnx.scan` with
`transform_metadata={nnx.PARTITION_NAME: ...}` and checkpointing with shardings see what
the arrays are. A quantized expert matrix (`MoEConfig(weights_format=...)`,
`quantize_experts`) holds its values and scales as `Quantized` variables: frozen, outside
`nnx.Param`. State paths mirror `MoEParams`: `router_DE`, `experts.gate_EDF`,
`experts.up_EDF`, `experts.down_EFD` (or `experts.w_EDF`), `shared.*` with shared experts,
and `router_bias`, `router_logit_bias`, `shared_gate_D` when the config has them. `cfg` and
`mesh` are static attributes.

Replicated experts (docs/guides/skew.md): `moe.replicate_experts(placement)` makes the
experts slot-major in place (`SlotParams`; `moe.moe_params()` returns them), and
`moe(x_BSD, placement=placement)` runs on them; every replica trains with its expert's
whole gradient. Given the `nnx.Optimizer` of the model that holds the module
(`optimizer=`, `model=`), the optimizer's state of those experts (Adam's moments) moves
with them; `replicate_experts(newer, previous=placement, ...)` follows a new placement, and
`moe.logical_params(placement)` gives the logical `MoEParams` back.

Importing `moe_shard` does not import Flax; this module does.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
from flax import nnx
from jax.sharding import AbstractMesh, Mesh
from jaxtyping import Array, Float

from moe_shard.config import MoEConfig, check_config
from moe_shard.layer import moe_layer
from moe_shard.params import MoEParams, _check_params, init_moe_params, moe_param_specs
from moe_shard.placement import Placement
from moe_shard.quant import expand, is_quantized
from moe_shard.replica_rule import StepPlacement
from moe_shard.replicas import SlotParams, as_slots, logical_params, replicate_experts
from moe_shard.sharding import resolve_mesh

__all__ = ["MoE", "Quantized", "RouterBias"]


class RouterBias(nnx.Variable):
  """The selection bias of aux-loss-free balancing (`MoEParams.router_bias`): state, not an
  `nnx.Param`. It gets no gradient and `balance.update_router_bias` moves it, so an
  `nnx.Optimizer(..., wrt=nnx.Param)` leaves it alone (no weight decay on it)."""


class Quantized(nnx.Variable):
  """The values or scales of a quantized expert matrix (`quant.QuantizedArray`): frozen
  state, not an `nnx.Param`, so `nnx.grad` and `nnx.Optimizer(..., wrt=nnx.Param)` leave it
  alone while the router, the biases and the shared experts train (adapter-style)."""


# The kind of `nnx.Variable` of each `MoEParams` field; every other field is an `nnx.Param`.
_VARIABLE_KINDS = dict(router_bias=RouterBias)


def _variable(kind, value, spec):
  # The value is already placed (init_moe_params): no eager re-sharding, which would also
  # demand a mesh in scope when there is none.
  return kind(value, out_sharding=spec, eager_sharding=False)


def _is_variable(x):
  return isinstance(x, nnx.Variable)


class MoE(nnx.Module):
  """One MoE layer (router, top-k, dispatch, experts, shared experts) as an NNX module.

  Args:
    cfg: `MoEConfig`.
    rngs: `nnx.Rngs`; the parameters are drawn from `rngs.params()`.
    mesh: a `jax.sharding.Mesh` with `cfg.expert_axis` (an `AbstractMesh` under
      `nnx.eval_shape`), or None (default): the mesh in scope (`jax.set_mesh(mesh)`) when
      it has the expert axis, else no mesh. The mesh resolved here is kept and used by
      every call; with none, each call uses the mesh in scope then (as `moe_layer`).

  Attributes:
    router_DE: `nnx.Param` f32[D, E], replicated.
    experts: `SwiGLU` (or `Linear`) of `nnx.Param`s, expert axis first, split over
      `cfg.expert_axis`.
    shared: `SwiGLU` of `nnx.Param`s for the shared experts (replicated), or None.
    router_bias: `RouterBias` f32[E] with `cfg.bias_balancing` (not an `nnx.Param`), or None.
    router_logit_bias: `nnx.Param` f32[E] with `cfg.router_logit_bias`, or None.
    shared_gate_D: `nnx.Param` f32[D] with `cfg.shared_expert_gate`, or None.
    cfg, mesh: static.
    slot_major: static; whether the experts are slot-major (`replicate_experts`).
    placement_id: static; the fingerprint of the placement slot-major experts were made
      for (`SlotParams.placement_id`), None when logical.

  Calling it with `x_BSD: f[B, S, D]` (and `placement=`, as `moe_layer` takes it) returns
  `(y_BSD, aux)` as `moe_layer`.
  """

  def __init__(
    self, cfg: MoEConfig, *, rngs: nnx.Rngs, mesh: Mesh | AbstractMesh | None = None
  ) -> None:
    fn = "moe_shard.nnx.MoE"
    check_config(fn, cfg)
    self.cfg = cfg
    self.mesh = resolve_mesh(fn, mesh, cfg.expert_axis, cfg.num_experts, required=False)
    self.slot_major = False
    self._set_params(init_moe_params(rngs.params(), cfg, mesh=self.mesh))

  @classmethod
  def from_params(
    cls, cfg: MoEConfig, params: MoEParams, *, mesh: Mesh | AbstractMesh | None = None
  ) -> MoE:
    """Builds the module around given parameters, drawing none (e.g. a loaded checkpoint).

    Args:
      cfg: `MoEConfig`.
      params: `MoEParams` with the leaves and shapes `init_moe_params(cfg)` makes (e.g. from
        `moe_shard.hf.load_moe_layer(path, layer, mesh=mesh)`); the arrays are kept as they
        are placed, not copied or moved.
      mesh: as in `MoE(...)` (default None).

    Raises:
      TypeError, ValueError: `params` does not fit `cfg`.
    """
    if not isinstance(params, SlotParams):  # slot-major ones are checked by the layer
      _check_params("moe_shard.nnx.MoE.from_params", params, cfg)
    # The module's structure without drawing its parameters, then the given ones in place.
    module = nnx.eval_shape(lambda: cls(cfg, rngs=nnx.Rngs(0), mesh=mesh))
    module._set_params(params)
    return module

  def _set_params(self, params):
    # Specs of the matrices, given to a quantized matrix's values and scales alike.
    specs = moe_param_specs(dataclasses.replace(self.cfg, weights_format=None))
    if isinstance(params, SlotParams):  # the same specs: the slot axis splits like E
      specs = as_slots(specs, params)
    specs = expand(specs, params)
    quantized = functools.partial(_variable, Quantized)
    for field in dataclasses.fields(MoEParams):  # one attribute per field, None when off
      make = functools.partial(_variable, _VARIABLE_KINDS.get(field.name, nnx.Param))

      def one(a, spec, make=make):
        if not is_quantized(a):
          return make(a, spec)
        values, scales = quantized(a.values, spec.values), quantized(a.scales, spec.scales)
        return dataclasses.replace(a, values=values, scales=scales)

      value = getattr(params, field.name)
      if value is not None:
        value = jax.tree.map(one, value, getattr(specs, field.name), is_leaf=is_quantized)
      setattr(self, field.name, nnx.data(value))
    self.slot_major = isinstance(params, SlotParams)
    self.placement_id = params.placement_id if self.slot_major else None

  def moe_params(self) -> MoEParams:
    """The parameters as a `MoEParams` of arrays (what `moe_layer` takes); `SlotParams`
    when the experts are slot-major."""
    fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(MoEParams)}
    fields = jax.tree.map(lambda v: v[...], fields, is_leaf=_is_variable)
    if not self.slot_major:
      return MoEParams(**fields)
    return SlotParams(**fields, placement_id=self.placement_id)

  def __call__(
    self,
    x_BSD: Float[Array, "B S D"],
    placement: Placement | StepPlacement | str | None = None,
  ) -> tuple[Float[Array, "B S D"], dict[str, Array]]:
    """Applies the layer: returns `(y_BSD, aux)` (see `moe_layer`; `placement` as there,
    the one the experts were made for when they are slot-major)."""
    return moe_layer(self.moe_params(), x_BSD, self.cfg, mesh=self.mesh, placement=placement)

  def _replicate(self, params, placement, previous):
    cfg = self.cfg
    return replicate_experts(
      params,
      placement,
      previous=previous,
      mesh=self.mesh,
      expert_axis=cfg.expert_axis,
      expert_tensor_axis=cfg.expert_tensor_axis,
      expert_fsdp_axis=cfg.expert_fsdp_axis,
    )

  def replicate_experts(
    self,
    placement: Placement,
    *,
    previous: Placement | None = None,
    optimizer: nnx.Optimizer | None = None,
    model: nnx.Module | None = None,
  ) -> None:
    """Makes the experts slot-major for `placement`, in place (`ms.replicate_experts`).

    Args:
      placement: the one-layer `Placement` to hold the experts on.
      previous: the placement the experts are slot-major for (None, default: they are
        logical).
      optimizer: None (default), or the `nnx.Optimizer` of `model`: its state of this
        module's experts (each `nnx.State` of it, e.g. Adam's mu and nu) moves the same way;
        leaves it holds no state of (quantized matrices: frozen) are skipped.
      model: the module `optimizer` was made for, holding this one (this one itself when
        it is the whole model); needed with `optimizer`: the optimizer's state is found by
        this module's path in it, from the model's root (another module whose path ends
        with the same names is left alone).

    Raises:
      ValueError: `optimizer` without `model`, or a `model` that does not hold this module.
    """
    if optimizer is not None:
      if model is None:
        raise ValueError(
          "MoE.replicate_experts: optimizer= needs model=, the module it was made for "
          "(this MoE itself when it is the whole model; got model=None)"
        )
      path = _path_in(model, self)
      params = self.moe_params()
      paths = self._expert_paths()
      is_path = lambda x: isinstance(x, tuple)
      for group in _expert_states(optimizer.opt_state, path + ("experts",)):
        # The moments in the parameters' place (MoEParams, or SlotParams when slot-major);
        # a leaf the optimizer holds no state of (a quantized matrix, frozen: not an
        # nnx.Param) keeps the parameter's value, moved and dropped.
        own = lambda at, a, g=group: g[at][...] if at in g else a
        values = jax.tree.map(own, paths, params.experts, is_leaf=is_path)
        moved = self._replicate(dataclasses.replace(params, experts=values), placement, previous)
        flat = zip(jax.tree.leaves(paths, is_leaf=is_path), jax.tree.leaves(moved.experts))
        for at, value in flat:
          if at in group:
            group[at].set_value(value)
    self._set_params(self._replicate(self.moe_params(), placement, previous))

  def logical_params(self, placement: Placement) -> MoEParams:
    """The logical parameters of slot-major experts (`ms.logical_params`)."""
    cfg = self.cfg
    return logical_params(
      self.moe_params(),  # pyright: ignore[reportArgumentType] - refused unless SlotParams
      placement,
      mesh=self.mesh,
      expert_axis=cfg.expert_axis,
      expert_tensor_axis=cfg.expert_tensor_axis,
      expert_fsdp_axis=cfg.expert_fsdp_axis,
    )

  def _expert_paths(self):
    """The experts' tree with each leaf its path under `experts` (a tuple of names)."""
    return jax.tree_util.tree_map_with_path(
      lambda path, _: tuple(str(getattr(k, "name", getattr(k, "key", k))) for k in path),
      self.moe_params().experts,
    )


def _path_in(model, module):
  for path, node in nnx.iter_graph(model):
    if node is module:
      return tuple(path)
  raise ValueError("MoE.replicate_experts: model must hold this module (got one that does not)")


def _expert_states(opt_state, prefix):
  """{leaf path under prefix: the optimizer variable} for each state of `opt_state` that
  holds the variables under `prefix` (a model path), e.g. Adam's mu and nu.

  Each `nnx.State` of the optimizer (a tree of the model's variables, paths from the
  model's root) is matched at its root: another module whose path ends with the same names
  (`model.sub.moe` for `model.moe`) is not this one."""
  is_state = lambda x: isinstance(x, nnx.State)
  groups = []
  for state in jax.tree.leaves(opt_state, is_leaf=lambda x: is_state(x) or _is_variable(x)):
    if not is_state(state):
      continue
    group = {}
    for path, var in jax.tree_util.tree_leaves_with_path(state, is_leaf=_is_variable):
      keys = tuple(getattr(k, "key", None) for k in path)
      if keys[: len(prefix)] == prefix:
        group[tuple(str(k) for k in keys[len(prefix) :])] = var
    if group:
      groups.append(group)
  return groups
