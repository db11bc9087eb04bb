"""`MoE`: the MoE layer as an Equinox module (the `equinox` extra: `pip install moe_shard[equinox]`).

    from moe_shard.equinox import MoE
    moe = MoE(cfg, key=jax.random.key(0), mesh=mesh)   # parameters created sharded
    y_BSD, aux = moe(x_BSD)                             # moe_layer(moe.params, x_BSD, cfg, mesh)
    moe = MoE.from_params(cfg, params, mesh=mesh)       # around given MoEParams (a checkpoint)
    moe = moe.replicate_experts(placement)              # slot-major experts (replicas)
    y_BSD, aux = moe(x_BSD, placement=placement)        # served or trained on them

A thin module over `init_moe_params` and `moe_layer`: its one array field is `params`, the
`MoEParams` pytree (arrays already placed with `moe_param_specs`); `cfg` and `mesh` are
static fields. `moe(x_BSD)` takes the whole batch (not one example: no `jax.vmap` needed).

Replicated experts (docs/guides/skew.md): `moe.replicate_experts(placement)` returns the
module with `params` slot-major (`SlotParams`), called as `moe(x_BSD, placement=placement)`
(the placement a jit argument or a constant); every replica trains with its expert's whole
gradient. Its optimizer state moves with it: `ms.move_replicas(opt_state, newer,
previous=placement, mesh=mesh)` (Adam's moments of the module hold `SlotParams` too), and
`moe.replicate_experts(newer, previous=placement)` moves the module. `moe.logical_params(
placement)` gives the logical `MoEParams` back (checkpoints). `SlotParams` carry their
placement in the pytree's structure, so a jitted step compiles once more after a move.

One compile per training run. `optax.adam(...).init(params)` creates its step count with
`jnp.zeros`, and a model's own `jnp.ones` scales are made the same way: outside a mesh
context they sit on one device, while a jitted step returns them replicated on the mesh, so
the second step sees new input shardings and compiles again. Create the model and the
optimizer state inside `with jax.set_mesh(mesh):` (arrays made there are replicated on the
mesh); training may then run inside or outside it.

Importing `moe_shard` does not import Equinox; this module does.
"""

from __future__ import annotations

import equinox as eqx
import jax
from jax.sharding import AbstractMesh, Mesh
from jaxtyping import Array, Float, PRNGKeyArray

from moe_shard.config import MoEConfig, check_config
from moe_shard.layer import moe_layer
from moe_shard.params import MoEParams, _check_params, init_moe_params
from moe_shard.placement import Placement
from moe_shard.replica_rule import StepPlacement
from moe_shard.replicas import SlotParams, logical_params, replicate_experts
from moe_shard.sharding import resolve_mesh

__all__ = ["MoE"]


class MoE(eqx.Module):
  """One MoE layer (router, top-k, dispatch, experts, shared experts) as an Equinox module.

  Args:
    cfg: `MoEConfig`.
    key: a `jax.random` key for the parameters (keyword-only).
    mesh: a `jax.sharding.Mesh` with `cfg.expert_axis` (an `AbstractMesh` under
      `eqx.filter_eval_shape`), or None (default): the mesh in scope (`jax.set_mesh(mesh)`)
      when it has the expert axis, else no mesh. The mesh resolved here is kept and used
      by every call; with none, each call uses the mesh in scope then (as `moe_layer`).

  Attributes:
    params: `MoEParams` (router replicated, experts split over `cfg.expert_axis`), or
      `SlotParams` (slot-major experts, `replicate_experts`).
    cfg, mesh: static.

  Calling it with `x_BSD: f[B, S, D]` (and `placement=`, as `moe_layer` takes it) returns
  `(y_BSD, aux)` as `moe_layer`.
  """

  params: MoEParams
  cfg: MoEConfig = eqx.field(static=True)
  mesh: Mesh | AbstractMesh | None = eqx.field(static=True)

  def __init__(
    self, cfg: MoEConfig, *, key: PRNGKeyArray, mesh: Mesh | AbstractMesh | None = None
  ) -> None:
    fn = "moe_shard.equinox.MoE"
    check_config(fn, cfg)
    self.cfg = cfg
    self.mesh = resolve_mesh(fn, mesh, cfg.expert_axis, cfg.num_experts, required=False)
    self.params = init_moe_params(key, cfg, mesh=self.mesh)

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
      _check_params("moe_shard.equinox.MoE.from_params", params, cfg)
    # The module's structure without drawing its parameters, then the given ones in place.
    module = eqx.filter_eval_shape(cls, cfg, key=jax.random.key(0), mesh=mesh)
    return eqx.tree_at(lambda m: m.params, module, params)

  def __call__(
    self,
    x_BSD: Float[Array, "B S D"],
    placement: Placement | StepPlacement | str | None = None,
  ) -> tuple[Float[Array, "B S D"], dict[str, Array]]:
    """Applies the layer: returns `(y_BSD, aux)` (see `moe_layer`; `placement` as there,
    the one `params` were made for when they are slot-major)."""
    return moe_layer(self.params, x_BSD, self.cfg, mesh=self.mesh, placement=placement)

  def replicate_experts(self, placement: Placement, *, previous: Placement | None = None) -> MoE:
    """The module with its experts slot-major for `placement` (`ms.replicate_experts`;
    `previous`: the placement slot-major params were made for)."""
    cfg = self.cfg
    params = replicate_experts(
      self.params,
      placement,
      mesh=self.mesh,
      previous=previous,
      expert_axis=cfg.expert_axis,
      expert_tensor_axis=cfg.expert_tensor_axis,
      expert_fsdp_axis=cfg.expert_fsdp_axis,
    )
    return eqx.tree_at(lambda m: m.params, self, params)

  def logical_params(self, placement: Placement) -> MoEParams:
    """The logical parameters of slot-major ones (`ms.logical_params`)."""
    cfg = self.cfg
    return logical_params(
      self.params,  # pyright: ignore[reportArgumentType] - refused unless SlotParams
      placement,
      mesh=self.mesh,
      expert_axis=cfg.expert_axis,
      expert_tensor_axis=cfg.expert_tensor_axis,
      expert_fsdp_axis=cfg.expert_fsdp_axis,
    )
