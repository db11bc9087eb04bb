"""Parameters of one MoE layer: the `MoEParams` pytree, its shapes and specs, and init.

Expert weights have the expert axis first and are split over `cfg.expert_axis`; the router,
the shared experts and the optional vectors (the router biases, the shared gate) are
replicated (`moe_param_specs`). With a mesh, `init_moe_params` creates every array already
placed.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import AbstractMesh, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
from jaxtyping import Array, Float, PRNGKeyArray

from moe_shard import _checks
from moe_shard.adapters import is_adapter
from moe_shard.config import MoEConfig, check_config
from moe_shard.experts import ExpertFFN, SwiGLU
from moe_shard.parallel.common import split_specs
from moe_shard.quant import check_quantized, is_quantized, quantize_experts
from moe_shard.sharding import is_concrete, resolve_mesh, split_axis_size, tracing


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class MoEParams:
  """Parameters of one MoE layer, a pytree (stack them on a new axis 0 for `lax.scan`).

  Attributes:
    router_DE: f32[D, E] router weights.
    experts: the routed experts, an instance of `cfg.expert_class` (e.g.
      `SwiGLU(gate_EDF, up_EDF, down_EFD)`, `Linear(w_EDF)`; with `expert_bias`, their
      bias leaves too), expert axis first.
    shared: the shared experts, `SwiGLU` with the shared-expert axis first
      ([num_shared, D, F_shared] and [num_shared, F_shared, D]), or None when there are none.
    router_bias: f32[E] selection bias of aux-loss-free balancing (`MoEConfig(
      bias_balancing=True)`; zeros at init), or None (default). Not a trained weight: it
      gets no gradient and `balance.update_router_bias` moves it; keep it out of the
      optimizer (docs/guides/routers.md).
    router_logit_bias: f32[E] trained bias added to the router logits (`MoEConfig(
      router_logit_bias=True)`; zeros at init), or None (default).
    shared_gate_D: f32[D] trained gate of the shared experts, whose output is scaled per
      token by `sigmoid(x @ shared_gate_D)` (`MoEConfig(shared_expert_gate=True)`), or None
      (default).
  """

  router_DE: Float[Array, "D E"]
  experts: ExpertFFN
  shared: SwiGLU | None
  router_bias: Float[Array, " E"] | None = None
  router_logit_bias: Float[Array, " E"] | None = None
  shared_gate_D: Float[Array, " D"] | None = None


def moe_param_shapes(cfg: MoEConfig) -> MoEParams:
  """Returns the `MoEParams` of `jax.ShapeDtypeStruct`s that `init_moe_params(cfg)` builds.

  Args:
    cfg: `MoEConfig`.

  Returns:
    `MoEParams` whose leaves are `ShapeDtypeStruct`s (no sharding); with
    `cfg.weights_format`, each routed-expert matrix a `QuantizedArray` of them.
  """
  check_config("moe_param_shapes", cfg)
  D, E = cfg.d_model, cfg.num_experts
  dt = cfg.param_dtype

  # The leaf makers return Any: a ShapeDtypeStruct stands where MoEParams holds an array.
  def s(*shape) -> Any:
    return jax.ShapeDtypeStruct(shape, dt)

  experts = cfg.expert_class.param_shapes(cfg)
  fmt = cfg.weights_format
  if fmt is not None:
    experts = jax.eval_shape(lambda e: quantize_experts(e, fmt), experts)
  shared = None
  if cfg.num_shared_experts:
    H, Fs = cfg.num_shared_experts, cfg.shared_hidden
    shared = SwiGLU(gate_EDF=s(H, D, Fs), up_EDF=s(H, D, Fs), down_EFD=s(H, Fs, D))

  def f32(on, *shape) -> Any:
    return jax.ShapeDtypeStruct(shape, jnp.float32) if on else None

  return MoEParams(
    router_DE=f32(True, D, E),
    experts=experts,
    shared=shared,
    router_bias=f32(cfg.bias_balancing, E),
    router_logit_bias=f32(cfg.router_logit_bias, E),
    shared_gate_D=f32(cfg.shared_expert_gate, D),
  )


def moe_param_specs(cfg: MoEConfig) -> MoEParams:
  """Returns the `PartitionSpec` of every parameter, as a `MoEParams`.

  Expert weights are split over `cfg.expert_axis` on their first (expert) axis; with
  `cfg.expert_tensor_axis`, every F (hidden) dimension of the routed and shared experts is
  split over it (gate and up by columns, down by rows, the input biases); with
  `cfg.expert_fsdp_axis`, the last dimension of each of their matrices (F of gate and up,
  after the tensor axis; D of down): `P("expert", None, ("tensor", "data"))` for a gate,
  `P("expert", "tensor", "data")` for a down. The router, the router biases and the shared
  gate are replicated. Each spec has one entry per array dimension (`P("expert", None,
  None)`, `P(None, None)`, `P(None)`), as Flax's partition metadata needs. For a stack of
  layers (a leading layer axis), prepend None: `jax.tree.map(lambda s: P(None, *s), specs)`.
  With `cfg.weights_format`, a routed-expert matrix's spec is a `QuantizedArray` of two, for
  its values and its scales: the matrix's, with no axis where the scales have one block for
  the whole dimension.

  Args:
    cfg: `MoEConfig`.

  Returns:
    `MoEParams` of `PartitionSpec`s.
  """
  check_config("moe_param_specs", cfg)
  shapes = moe_param_shapes(cfg)

  def spec(s, first=None) -> Any:  # a PartitionSpec where MoEParams holds an array
    return P(first, *[None] * (len(s.shape) - 1))

  tp, fsdp = cfg.expert_tensor_axis, cfg.expert_fsdp_axis
  return MoEParams(
    router_DE=spec(shapes.router_DE),
    experts=split_specs(shapes.experts, cfg.expert_axis, tp, fsdp),
    shared=None if shapes.shared is None else split_specs(shapes.shared, None, tp, fsdp),
    router_bias=jax.tree.map(spec, shapes.router_bias),
    router_logit_bias=jax.tree.map(spec, shapes.router_logit_bias),
    shared_gate_D=jax.tree.map(spec, shapes.shared_gate_D),
  )


def check_split_axes(fn: str, cfg: MoEConfig, mesh: Mesh | AbstractMesh | None) -> None:
  """Raises unless `cfg.expert_tensor_axis` and `cfg.expert_fsdp_axis` are axes of `mesh`
  whose sizes divide what they split: F (`d_ff`, and `shared_d_ff` with shared experts) by
  the tensor axis, D by the FSDP axis, and F by both together where both split it (the last
  dimension of gate and up). Nothing to check without a mesh (nothing is split).
  """
  if mesh is None:
    return
  tp = fsdp = 1
  if cfg.expert_tensor_axis is not None:
    tp = split_axis_size(fn, mesh, "expert_tensor_axis", cfg.expert_tensor_axis)
  if cfg.expert_fsdp_axis is not None:
    fsdp = split_axis_size(fn, mesh, "expert_fsdp_axis", cfg.expert_fsdp_axis)
  names = {
    (True, False): f"the size of expert_tensor_axis {cfg.expert_tensor_axis!r}",
    (False, True): f"the size of expert_fsdp_axis {cfg.expert_fsdp_axis!r}",
    (True, True): f"the sizes of expert_tensor_axis {cfg.expert_tensor_axis!r} times "
    f"expert_fsdp_axis {cfg.expert_fsdp_axis!r}",
  }
  hidden = [("d_ff", cfg.d_ff)] + (
    [("shared_d_ff", cfg.shared_hidden)] if cfg.num_shared_experts else []
  )
  on = (cfg.expert_tensor_axis is not None, cfg.expert_fsdp_axis is not None)
  if any(on):
    for name, n in hidden:
      _checks.divisible(fn, name, n, names[on], tp * fsdp)
  if on[1]:
    _checks.divisible(fn, "d_model", cfg.d_model, names[(False, True)], fsdp)


def init_moe_params(
  key: PRNGKeyArray, cfg: MoEConfig, mesh: Mesh | AbstractMesh | None = None
) -> MoEParams:
  """Initialises one MoE layer: each matrix normal with variance 1 / fan-in.

  With a mesh, the whole initialisation runs under `jax.jit` with `out_shardings`
  (`moe_param_specs`): every device generates only its own shard, nothing is built on one
  device first. The values do not depend on the mesh (partitionable threefry), nor on
  `bias_balancing` and `router_logit_bias` (both biases start at zero) or
  `shared_expert_gate` (the gate has its own key).

  Args:
    key: a `jax.random` key.
    cfg: `MoEConfig`.
    mesh: a `jax.sharding.Mesh` with `cfg.expert_axis`, whose size must divide
      `cfg.num_experts`; an `AbstractMesh` under `jax.eval_shape` (shapes and shardings,
      no arrays). None (default): the mesh in scope (`jax.set_mesh(mesh)`) when it has
      the expert axis, else arrays on the default device.

  Returns:
    `MoEParams`: router_DE f32[D, E]; experts and shared in `cfg.param_dtype` (with
    `cfg.weights_format`, the routed experts' matrices `QuantizedArray`s of the same draws); router_bias
    f32[E] zeros with `bias_balancing`, else None; router_logit_bias f32[E] zeros with
    `router_logit_bias`, else None; shared_gate_D f32[D] normal with variance 1 / D with
    `shared_expert_gate`, else None.

  Raises:
    TypeError: cfg is not a `MoEConfig`, or mesh not a mesh.
    ValueError: the mesh lacks the expert axis, or its size does not divide E, or an
      `AbstractMesh` outside a trace (no devices to create arrays on).
  """
  fn = "init_moe_params"
  check_config(fn, cfg)
  mesh = resolve_mesh(fn, mesh, cfg.expert_axis, cfg.num_experts, required=False)
  check_split_axes(fn, cfg, mesh)
  if mesh is not None and not is_concrete(mesh) and not tracing():
    raise ValueError(
      f"{fn}: mesh must be a concrete jax.sharding.Mesh to create arrays "
      f"(got an AbstractMesh outside jax.eval_shape or jax.jit): pass the "
      f"Mesh, or call under `with jax.set_mesh(mesh):`"
    )
  # Only the fields that shape the parameters, so that configs differing in others (e.g.
  # impl) share one compiled init.
  shape_cfg = type(cfg)(
    d_model=cfg.d_model,
    d_ff=cfg.d_ff,
    num_experts=cfg.num_experts,
    top_k=1,
    expert_type=cfg.expert_type,
    expert_bias=cfg.expert_bias,
    swiglu_alpha=cfg.swiglu_alpha,
    swiglu_limit=cfg.swiglu_limit,
    num_shared_experts=cfg.num_shared_experts,
    shared_d_ff=cfg.shared_d_ff,
    param_dtype=cfg.param_dtype,
    weights_format=cfg.weights_format,
    expert_axis=cfg.expert_axis,
    expert_tensor_axis=cfg.expert_tensor_axis,
    expert_fsdp_axis=cfg.expert_fsdp_axis,
    bias_balancing=cfg.bias_balancing,
    router_logit_bias=cfg.router_logit_bias,
    shared_expert_gate=cfg.shared_expert_gate,
  )
  return _initializer(shape_cfg, mesh)(key)


@functools.lru_cache(maxsize=32)
def _initializer(cfg, mesh):
  """The jitted init of one (config, mesh), built once: threefry is slow to compile on CPU."""
  # The float parameters first (the same values whatever the format), then quantized.
  shapes = moe_param_shapes(dataclasses.replace(cfg, weights_format=None))
  # The matrices share one split of the key; the optional vectors are drawn apart (zeros,
  # or the shared gate from its own key), so turning them on changes no other value.
  vectors = dict(router_bias=None, router_logit_bias=None, shared_gate_D=None)
  leaves, treedef = jax.tree.flatten(dataclasses.replace(shapes, **vectors))

  # The routed experts' leaves of rank 2 are their biases ([E, out]): zeros, drawing no key,
  # so that `expert_bias` changes no other value.
  is_bias = jax.tree.leaves(
    dataclasses.replace(
      jax.tree.map(lambda s: False, shapes),
      **vectors,
      experts=jax.tree.map(lambda s: len(s.shape) == 2, shapes.experts),
    )
  )

  def normal(k, s):  # every matrix maps its second-to-last axis (the fan-in) to its last
    return (jax.random.normal(k, s.shape, jnp.float32) / math.sqrt(s.shape[-2])).astype(s.dtype)

  def init(key):
    keys = iter(jax.random.split(key, len(leaves) - sum(is_bias)))
    params = jax.tree.unflatten(
      treedef,
      [
        jnp.zeros(s.shape, s.dtype) if bias else normal(next(keys), s)
        for s, bias in zip(leaves, is_bias)
      ],
    )
    zeros = lambda s: None if s is None else jnp.zeros(s.shape, jnp.float32)
    gate_D = None
    if shapes.shared_gate_D is not None:  # a Linear(D, 1): variance 1 / D
      (D,) = shapes.shared_gate_D.shape
      gate_D = jax.random.normal(jax.random.fold_in(key, 1), (D,), jnp.float32) / math.sqrt(D)
    if cfg.weights_format is not None:
      params = quantize_experts(params, cfg.weights_format)
    return dataclasses.replace(
      params,
      router_bias=zeros(shapes.router_bias),
      router_logit_bias=zeros(shapes.router_logit_bias),
      shared_gate_D=gate_D,
    )

  if mesh is None:
    return jax.jit(init)
  return jax.jit(
    init, out_shardings=jax.tree.map(lambda s: NamedSharding(mesh, s), moe_param_specs(cfg))
  )


# The boolean MoEConfig fields that each add a leaf to MoEParams.
_OPTIONAL_LEAF_FIELDS = ("expert_bias", "bias_balancing", "router_logit_bias", "shared_expert_gate")


def _check_params(fn, params, cfg):
  """Raises unless `params` has the leaves, shapes and kinds `init_moe_params(cfg)` builds."""
  if not isinstance(params, MoEParams):
    raise TypeError(
      f"{fn}: params must be a MoEParams from init_moe_params (got {type(params).__name__})"
    )
  # Compared as matrices: a QuantizedArray or an Adapter (taken whole) stands where a float
  # matrix may.
  shapes = moe_param_shapes(dataclasses.replace(cfg, weights_format=None))
  matrix = lambda x: is_quantized(x) or is_adapter(x)
  leaves = lambda t: jax.tree_util.tree_leaves_with_path(t, is_leaf=matrix)
  want = {jax.tree_util.keystr(p): s for p, s in leaves(shapes)}
  got = {jax.tree_util.keystr(p): a for p, a in leaves(params)}
  if want.keys() != got.keys():
    missing = [f"params{k}" for k in want if k not in got]
    extra = [f"params{k}" for k in got if k not in want]
    raise ValueError(
      f"{fn}: params must have the leaves of this MoEConfig "
      f"(expert_type={cfg.expert_type!r}, num_shared_experts="
      f"{cfg.num_shared_experts}"
      f"{''.join(f', {k}=True' for k in _OPTIONAL_LEAF_FIELDS if getattr(cfg, k))}): "
      f"missing {missing}, unexpected {extra}"
    )
  if type(params.experts) is not type(shapes.experts):
    raise ValueError(
      f"{fn}: params.experts must be a {type(shapes.experts).__name__} for this MoEConfig "
      f"(expert_type={cfg.expert_type!r}) (got {type(params.experts).__name__})"
    )
  for k, s in want.items():
    a = got[k]
    if is_adapter(a):
      a = _check_adapter(fn, f"params{k}", a)
    if is_quantized(a):
      check_quantized(fn, f"params{k}", a)
      if cfg.weights_format not in (None, a.fmt):
        raise ValueError(
          f"{fn}: params{k} must be quantized as {cfg.weights_format!r} for this MoEConfig "
          f"(got {a.fmt!r})"
        )
    else:
      if cfg.weights_format is not None and len(s.shape) == 3 and k.startswith(".experts"):
        raise ValueError(
          f"{fn}: params{k} must be a QuantizedArray ({cfg.weights_format!r}) for this "
          f"MoEConfig (got a {getattr(a, 'dtype', type(a).__name__)} array): quantize it "
          f"with quantize_experts(params, {cfg.weights_format!r})"
        )
      a = _checks.float_array(fn, f"params{k}", a)
    if tuple(a.shape) != s.shape:
      raise ValueError(
        f"{fn}: params{k} must have shape {s.shape} for this MoEConfig (got {tuple(a.shape)})"
      )
  # Static fields of the FFN (e.g. ClampedSwiGLU's alpha, limit) come from the config.
  for f in dataclasses.fields(shapes.experts) if dataclasses.is_dataclass(shapes.experts) else ():
    want_v, got_v = getattr(shapes.experts, f.name), getattr(params.experts, f.name)
    if f.metadata.get("static") and want_v != got_v:
      raise ValueError(
        f"{fn}: params.experts.{f.name} must be {want_v!r} for this MoEConfig (got {got_v!r})"
      )


def _check_adapter(fn, name, ad):
  """Raises unless an `Adapter`'s a [..., I, R] and b [..., R, O] are float arrays that fit
  its matrix [..., I, O]; returns the matrix."""
  a = _checks.float_array(fn, f"{name}.a", ad.a)
  b = _checks.float_array(fn, f"{name}.b", ad.b)
  *lead, I, O = ad.w.shape
  R = a.shape[-1] if a.ndim else 0
  if tuple(a.shape) != (*lead, I, R) or tuple(b.shape) != (*lead, R, O):
    raise ValueError(
      f"{fn}: {name} is an Adapter of a matrix {tuple(ad.w.shape)}: a must be [..., I, R] "
      f"and b [..., R, O] with the matrix's leading axes (got a {tuple(a.shape)}, b "
      f"{tuple(b.shape)})"
    )
  return ad.w
