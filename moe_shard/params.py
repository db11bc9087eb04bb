"""Parameters of one MoE layer: the `MoEParams` pytree, its shapes and specs, and init.

Expert weights have the expert axis first and are split over `cfg.expert_axis`; the router,
the shared experts and the router bias are replicated (`moe_param_specs`). With a mesh,
`init_moe_params` creates every array already placed.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from moe_shard import _checks
from moe_shard.config import check_config
from moe_shard.experts import Linear, SwiGLU
from moe_shard.sharding import is_concrete, resolve_mesh, tracing


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class MoEParams:
  """Parameters of one MoE layer, a pytree (stack them on a new axis 0 for `lax.scan`).

  Attributes:
    router_DE: f32[D, E] router weights.
    experts: the routed experts, `SwiGLU(gate_EDF, up_EDF, down_EFD)` or `Linear(w_EDF)`,
      expert axis first.
    shared: the shared experts, `SwiGLU` with the shared-expert axis first
      ([num_shared, D, F_shared] and [num_shared, F_shared, D]), or None when there are none.
    router_bias: f32[E] selection bias of aux-loss-free balancing (`MoEConfig(
      bias_balancing=True)`; zeros at init), or None (default). Not a trained weight: it
      gets no gradient and `balance.update_router_bias` moves it; keep it out of the
      optimizer (README, "Routers").
  """

  router_DE: jax.Array
  experts: SwiGLU | Linear
  shared: SwiGLU | None
  router_bias: jax.Array | None = None


def moe_param_shapes(cfg):
  """Returns the `MoEParams` of `jax.ShapeDtypeStruct`s that `init_moe_params(cfg)` builds.

  Args:
    cfg: `MoEConfig`.

  Returns:
    `MoEParams` whose leaves are `ShapeDtypeStruct`s (no sharding).
  """
  check_config("moe_param_shapes", cfg)
  D, F, E = cfg.d_model, cfg.d_ff, cfg.num_experts
  dt = cfg.param_dtype

  def s(*shape):
    return jax.ShapeDtypeStruct(shape, dt)

  if cfg.expert_type == "swiglu":
    experts = SwiGLU(gate_EDF=s(E, D, F), up_EDF=s(E, D, F), down_EFD=s(E, F, D))
  else:
    experts = Linear(w_EDF=s(E, D, F))
  shared = None
  if cfg.num_shared_experts:
    H, Fs = cfg.num_shared_experts, cfg.shared_hidden
    shared = SwiGLU(gate_EDF=s(H, D, Fs), up_EDF=s(H, D, Fs), down_EFD=s(H, Fs, D))
  bias = jax.ShapeDtypeStruct((E,), jnp.float32) if cfg.bias_balancing else None
  return MoEParams(jax.ShapeDtypeStruct((D, E), jnp.float32), experts, shared, bias)


def moe_param_specs(cfg):
  """Returns the `PartitionSpec` of every parameter, as a `MoEParams`.

  Expert weights are split over `cfg.expert_axis` on their first (expert) axis; the router,
  the shared experts and the router bias are replicated. Each spec has one entry per array
  dimension (`P("expert", None, None)`, `P(None, None)`, `P(None)`), as Flax's partition
  metadata needs. For a stack of layers (a leading layer axis), prepend None:
  `jax.tree.map(lambda s: P(None, *s), specs)`.

  Args:
    cfg: `MoEConfig`.

  Returns:
    `MoEParams` of `PartitionSpec`s.
  """
  check_config("moe_param_specs", cfg)
  shapes = moe_param_shapes(cfg)

  def spec(s, first=None):
    return P(first, *[None] * (len(s.shape) - 1))

  return MoEParams(
    router_DE=spec(shapes.router_DE),
    experts=jax.tree.map(lambda s: spec(s, cfg.expert_axis), shapes.experts),
    shared=jax.tree.map(spec, shapes.shared),
    router_bias=P(None) if cfg.bias_balancing else None,
  )


def init_moe_params(key, cfg, mesh=None):
  """Initialises one MoE layer: each matrix normal with variance 1 / fan-in.

  With a mesh, the whole initialisation runs under `jax.jit` with `out_shardings`
  (`moe_param_specs`): every device generates only its own shard, nothing is built on one
  device first. The values do not depend on the mesh (partitionable threefry), nor on
  `bias_balancing` (the router bias starts at zero).

  Args:
    key: a `jax.random` key.
    cfg: `MoEConfig`.
    mesh: a `jax.sharding.Mesh` with `cfg.expert_axis`, whose size must divide
      `cfg.num_experts`; an `AbstractMesh` under `jax.eval_shape` (shapes and shardings,
      no arrays). None (default): the mesh in scope (`jax.set_mesh(mesh)`) when it has
      the expert axis, else arrays on the default device.

  Returns:
    `MoEParams`: router_DE f32[D, E]; experts and shared in `cfg.param_dtype`; router_bias
    f32[E] zeros with `bias_balancing`, else None.

  Raises:
    TypeError: cfg is not a `MoEConfig`, or mesh not a mesh.
    ValueError: the mesh lacks the expert axis, or its size does not divide E, or an
      `AbstractMesh` outside a trace (no devices to create arrays on).
  """
  fn = "init_moe_params"
  check_config(fn, cfg)
  mesh = resolve_mesh(fn, mesh, cfg.expert_axis, cfg.num_experts, required=False)
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
    num_shared_experts=cfg.num_shared_experts,
    shared_d_ff=cfg.shared_d_ff,
    param_dtype=cfg.param_dtype,
    expert_axis=cfg.expert_axis,
    bias_balancing=cfg.bias_balancing,
  )
  return _initializer(shape_cfg, mesh)(key)


@functools.lru_cache(maxsize=32)
def _initializer(cfg, mesh):
  """The jitted init of one (config, mesh), built once: threefry is slow to compile on CPU."""
  shapes = moe_param_shapes(cfg)
  leaves, treedef = jax.tree.flatten(dataclasses.replace(shapes, router_bias=None))

  def init(key):
    keys = jax.random.split(key, len(leaves))
    # Every matrix maps its second-to-last axis (the fan-in) to its last.
    params = jax.tree.unflatten(
      treedef,
      [
        (jax.random.normal(k, s.shape, jnp.float32) / math.sqrt(s.shape[-2])).astype(s.dtype)
        for k, s in zip(keys, leaves)
      ],
    )
    if shapes.router_bias is None:
      return params
    return dataclasses.replace(params, router_bias=jnp.zeros(shapes.router_bias.shape, jnp.float32))

  if mesh is None:
    return jax.jit(init)
  return jax.jit(
    init, out_shardings=jax.tree.map(lambda s: NamedSharding(mesh, s), moe_param_specs(cfg))
  )


def _check_params(fn, params, cfg):
  """Raises unless `params` has the leaves, shapes and kinds `init_moe_params(cfg)` builds."""
  if not isinstance(params, MoEParams):
    raise TypeError(
      f"{fn}: params must be a MoEParams from init_moe_params (got {type(params).__name__})"
    )
  want = {
    jax.tree_util.keystr(p): s
    for p, s in jax.tree_util.tree_leaves_with_path(moe_param_shapes(cfg))
  }
  got = {jax.tree_util.keystr(p): a for p, a in jax.tree_util.tree_leaves_with_path(params)}
  if want.keys() != got.keys():
    missing = [f"params{k}" for k in want if k not in got]
    extra = [f"params{k}" for k in got if k not in want]
    raise ValueError(
      f"{fn}: params must have the leaves of this MoEConfig "
      f"(expert_type={cfg.expert_type!r}, num_shared_experts="
      f"{cfg.num_shared_experts}"
      f"{', bias_balancing=True' if cfg.bias_balancing else ''}): "
      f"missing {missing}, unexpected {extra}"
    )
  for k, s in want.items():
    a = _checks.float_array(fn, f"params{k}", got[k])
    if tuple(a.shape) != s.shape:
      raise ValueError(
        f"{fn}: params{k} must have shape {s.shape} for this MoEConfig (got {tuple(a.shape)})"
      )
