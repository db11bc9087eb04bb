"""The MoE layer: router, capacity, dispatch, expert FFN, combine and shared experts.

    y[t] = shared(x[t]) + sum_j G[t, j] * expert(W[B[t, j]], x[t])

`moe_layer` composes the three independent choices of the package, each a named stage:

  * route    (`routing.py`): float32 router logits -> `top_k_routing` -> (weights, experts);
    the auxiliary losses; then, with a capacity, `drop_over_capacity` sets the expert id of
    every item past its expert's capacity to -1.
  * dispatch (`local.py`, `parallel.py`): one of the four implementations, chosen by
    `MoEConfig.impl`. Ids outside [0, E) contribute zero in every one of them, so capacity
    drops give the same result whatever the implementation.
  * experts  (`experts.py`): `SwiGLU` or `Linear`, expert axis first.

Parameters are a `MoEParams` pytree built by `init_moe_params`; with a mesh they are created
already placed: expert weights split over the expert axis, router and shared experts
replicated (`moe_param_specs`).

On a mesh. Tokens are split over every mesh axis. The top-k routing runs per device under
`shard_map` (`route`). `jax.make_mesh` defaults to `AxisType.Explicit`, under which JAX
refuses to guess shardings for sort and scatter: the stages that are plain array programs
(capacity, load statistics, the local implementations) run under `jax.sharding.auto_axes`,
so XLA chooses their shardings; the expert-parallel implementations place their inputs
themselves. The output has the sharding of `x_BSD`. Capacity needs the global token order:
on a mesh XLA all-gathers the T*K int32 expert ids for it (4*K bytes per token, against
D*b for the token itself).
"""

from __future__ import annotations

import dataclasses
import fractions
import functools
import math
import numbers

import einops
import jax
import jax.numpy as jnp
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from moe_shard import _checks, local, parallel
from moe_shard.experts import Linear, SwiGLU
from moe_shard.grouped_matmul import IMPLS as GMM_IMPLS
from moe_shard.routing import (Routing, expert_load, load_balancing_loss, router_z_loss,
                               top_k_routing)

EXPERT_TYPES = ("swiglu", "linear")
IMPLS = ("auto", "masked_scan", "ragged_dot", "all_gather", "all_to_all")
PARALLEL_IMPLS = ("all_gather", "all_to_all")

# --------------------------------------------------------------------------- config


def _config_error(kind, name, rule, value):
  return kind(f"MoEConfig: {name} must be {rule} (got {value!r})")


def _int_field(name, value, lo):
  if isinstance(value, bool) or not isinstance(value, numbers.Integral):
    raise _config_error(TypeError, name, "an int", value)
  if value < lo:
    raise _config_error(ValueError, name, f">= {lo}", value)
  return int(value)


def _real_field(name, value, *, positive):
  if isinstance(value, bool) or not isinstance(value, numbers.Real):
    raise _config_error(TypeError, name, "a real number", value)
  if not math.isfinite(value) or (value <= 0 if positive else value < 0):
    raise _config_error(ValueError, name, "finite and > 0" if positive else
                        "finite and >= 0", value)
  return float(value)


def _dtype_field(name, value):
  try:
    dtype = jnp.dtype(value)
  except TypeError as e:
    raise _config_error(TypeError, name, "a dtype", value) from e
  if not jnp.issubdtype(dtype, jnp.floating):
    raise _config_error(ValueError, name, "a floating-point dtype", value)
  return dtype


@dataclasses.dataclass(frozen=True, kw_only=True)
class MoEConfig:
  """Static description of one MoE layer; frozen and hashable (a `jax.jit` static argument).

  Keyword-only. Every field is checked on construction (also by `dataclasses.replace`);
  dtypes are stored as `jnp.dtype`, a chunk-size pair as a tuple, so equal configs hash
  equally.

  Attributes:
    d_model: D, the width of the tokens.
    d_ff: F, the hidden width of each routed expert. Must equal `d_model` when
      `expert_type` is "linear" (one [D, F] matrix per expert, and the layer returns D).
    num_experts: E routed experts.
    top_k: K experts per token, 1 <= K <= E.
    expert_type: "swiglu" (default; gate, up [E, D, F] and down [E, F, D]) or "linear"
      (w [E, D, D]).
    impl: dispatch implementation: "masked_scan", "ragged_dot", "all_gather", "all_to_all",
      or "auto" (default): "all_to_all" when a mesh is passed whose expert axis has more
      than one device, "ragged_dot" otherwise.
    capacity_factor: None (default) for dropless routing; a real c > 0 caps each expert at
      `ceil(c * T * K / E)` (token, slot) items per call, T the tokens of the call. Items
      past the cap are dropped by token order (see `drop_over_capacity`).
    chunk_size: `chunk_size` of `moe_all_to_all`: None (default), an int, or a pair
      (C_first, C_overflow).
    gmm_impl: grouped-matmul implementation of "ragged_dot", "all_gather" and "all_to_all"
      (`grouped_matmul`'s `impl`): "auto" (default; `lax.ragged_dot` when compiled for TPU,
      the tiled kernel elsewhere), "ragged_dot" or "tiled".
    num_shared_experts: dense SwiGLU experts every token goes through, summed (default 0).
    shared_d_ff: hidden width of each shared expert (default None: `d_ff`).
    normalize_top_k: rescale each token's K weights to sum to 1 (default True).
    load_balance_coef: weight of the load-balancing loss in `aux["aux_loss"]`
      (default 1e-2).
    z_loss_coef: weight of the router z-loss in `aux["aux_loss"]` (default 1e-3).
    param_dtype: dtype of the expert and shared-expert weights (default float32). The router
      is always float32.
    compute_dtype: dtype the tokens and expert weights are cast to for the expert matmuls,
      which accumulate in float32 (default None: the dtype of x).
    expert_axis: mesh axis the experts are split over (default "expert").
  """

  d_model: int
  d_ff: int
  num_experts: int
  top_k: int
  expert_type: str = "swiglu"
  impl: str = "auto"
  capacity_factor: float | None = None
  chunk_size: int | tuple[int, int] | None = None
  gmm_impl: str = "auto"
  num_shared_experts: int = 0
  shared_d_ff: int | None = None
  normalize_top_k: bool = True
  load_balance_coef: float = 1e-2
  z_loss_coef: float = 1e-3
  param_dtype: jnp.dtype = jnp.dtype(jnp.float32)
  compute_dtype: jnp.dtype | None = None
  expert_axis: str = parallel.EXPERT

  def __post_init__(self):
    def put(name, value):
      object.__setattr__(self, name, value)

    for name in ("d_model", "d_ff", "num_experts"):
      put(name, _int_field(name, getattr(self, name), 1))
    put("top_k", _int_field("top_k", self.top_k, 1))
    if self.top_k > self.num_experts:
      raise ValueError(f"MoEConfig: top_k must be <= num_experts ({self.num_experts}) "
                       f"(got {self.top_k})")
    for name, allowed in (("expert_type", EXPERT_TYPES), ("impl", IMPLS),
                          ("gmm_impl", GMM_IMPLS)):
      if getattr(self, name) not in allowed:
        raise _config_error(ValueError, name, f"one of {allowed}", getattr(self, name))
    if self.expert_type == "linear" and self.d_ff != self.d_model:
      raise ValueError(f"MoEConfig: d_ff must equal d_model ({self.d_model}) when "
                       f"expert_type is 'linear', whose experts map D to F (got {self.d_ff})")
    if self.capacity_factor is not None:
      put("capacity_factor", _real_field("capacity_factor", self.capacity_factor,
                                         positive=True))
    put("chunk_size", _chunk_field(self.chunk_size))
    put("num_shared_experts", _int_field("num_shared_experts", self.num_shared_experts, 0))
    if self.shared_d_ff is not None:
      put("shared_d_ff", _int_field("shared_d_ff", self.shared_d_ff, 1))
    if not isinstance(self.normalize_top_k, bool):
      raise _config_error(TypeError, "normalize_top_k", "a bool", self.normalize_top_k)
    for name in ("load_balance_coef", "z_loss_coef"):
      put(name, _real_field(name, getattr(self, name), positive=False))
    put("param_dtype", _dtype_field("param_dtype", self.param_dtype))
    if self.compute_dtype is not None:
      put("compute_dtype", _dtype_field("compute_dtype", self.compute_dtype))
    if not isinstance(self.expert_axis, str) or not self.expert_axis:
      raise _config_error(TypeError, "expert_axis", "a non-empty str", self.expert_axis)

  @property
  def shared_hidden(self):
    """Hidden width of each shared expert: `shared_d_ff`, or `d_ff` when that is None."""
    return self.d_ff if self.shared_d_ff is None else self.shared_d_ff

  def capacity(self, num_tokens):
    """Items each expert takes in a call of `num_tokens` tokens; None when dropless.

    `ceil(capacity_factor * T * K / E)`, computed exactly on the decimal value of
    `capacity_factor` (so 1.1 * 10 is 11, not 12).
    """
    if self.capacity_factor is None:
      return None
    c = fractions.Fraction(repr(self.capacity_factor))
    return math.ceil(c * num_tokens * self.top_k / self.num_experts)


def _chunk_field(chunk_size):
  if chunk_size is None:
    return None
  pair = (chunk_size,) if isinstance(chunk_size, numbers.Integral) else chunk_size
  if not isinstance(pair, (tuple, list)) or len(pair) not in (1, 2):
    raise _config_error(TypeError, "chunk_size", "None, an int or a pair of ints", chunk_size)
  for c in pair:
    if isinstance(c, bool) or not isinstance(c, numbers.Integral):
      raise _config_error(TypeError, "chunk_size", "None, an int or a pair of ints",
                          chunk_size)
    if c < 1:
      raise _config_error(ValueError, "chunk_size", ">= 1 (each entry)", chunk_size)
  return int(pair[0]) if len(pair) == 1 else (int(pair[0]), int(pair[1]))


def _check_config(fn, cfg):
  if not isinstance(cfg, MoEConfig):
    raise TypeError(f"{fn}: cfg must be a MoEConfig (got {type(cfg).__name__})")


# --------------------------------------------------------------------------- parameters


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
  """

  router_DE: jax.Array
  experts: SwiGLU | Linear
  shared: SwiGLU | None


def moe_param_shapes(cfg):
  """Returns the `MoEParams` of `jax.ShapeDtypeStruct`s that `init_moe_params(cfg)` builds.

  Args:
    cfg: `MoEConfig`.

  Returns:
    `MoEParams` whose leaves are `ShapeDtypeStruct`s (no sharding).
  """
  _check_config("moe_param_shapes", cfg)
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
  return MoEParams(jax.ShapeDtypeStruct((D, E), jnp.float32), experts, shared)


def moe_param_specs(cfg):
  """Returns the `PartitionSpec` of every parameter, as a `MoEParams`.

  Expert weights are split over `cfg.expert_axis` on their first (expert) axis; the router
  and the shared experts are replicated. For a stack of layers (a leading layer axis),
  prepend None: `jax.tree.map(lambda s: P(None, *s), specs)`.

  Args:
    cfg: `MoEConfig`.

  Returns:
    `MoEParams` of `PartitionSpec`s.
  """
  _check_config("moe_param_specs", cfg)
  shapes = moe_param_shapes(cfg)
  return MoEParams(
      router_DE=P(),
      experts=jax.tree.map(lambda _: P(cfg.expert_axis), shapes.experts),
      shared=jax.tree.map(lambda _: P(), shapes.shared))


def init_moe_params(key, cfg, mesh=None):
  """Initialises one MoE layer: each matrix normal with variance 1 / fan-in.

  With a mesh, the whole initialisation runs under `jax.jit` with `out_shardings`
  (`moe_param_specs`): every device generates only its own shard, nothing is built on one
  device first. The values do not depend on the mesh (partitionable threefry).

  Args:
    key: a `jax.random` key.
    cfg: `MoEConfig`.
    mesh: None (default; arrays on the default device) or a `jax.sharding.Mesh` with
      `cfg.expert_axis`, whose size must divide `cfg.num_experts`.

  Returns:
    `MoEParams`: router_DE f32[D, E]; experts and shared in `cfg.param_dtype`.

  Raises:
    TypeError: cfg is not a `MoEConfig`, or mesh not a `Mesh`.
    ValueError: the mesh lacks the expert axis, or its size does not divide E.
  """
  fn = "init_moe_params"
  _check_config(fn, cfg)
  if mesh is not None:
    _check_mesh(fn, cfg, mesh)
  # Fields that do not shape the parameters are reset, so that configs differing only in
  # them (e.g. impl) share one compiled init.
  shape_cfg = dataclasses.replace(
      cfg, top_k=1, impl="auto", capacity_factor=None, chunk_size=None, gmm_impl="auto",
      normalize_top_k=True, load_balance_coef=0.0, z_loss_coef=0.0, compute_dtype=None)
  return _initializer(shape_cfg, mesh)(key)


@functools.lru_cache(maxsize=32)
def _initializer(cfg, mesh):
  """The jitted init of one (config, mesh), built once: threefry is slow to compile on CPU."""
  leaves, treedef = jax.tree.flatten(moe_param_shapes(cfg))

  def init(key):
    keys = jax.random.split(key, len(leaves))
    # Every matrix maps its second-to-last axis (the fan-in) to its last.
    return jax.tree.unflatten(treedef, [
        (jax.random.normal(k, s.shape, jnp.float32) / math.sqrt(s.shape[-2])).astype(s.dtype)
        for k, s in zip(keys, leaves)])

  if mesh is None:
    return jax.jit(init)
  return jax.jit(init, out_shardings=jax.tree.map(lambda s: NamedSharding(mesh, s),
                                                  moe_param_specs(cfg)))


def _check_mesh(fn, cfg, mesh):
  if not isinstance(mesh, jax.sharding.Mesh):
    raise TypeError(f"{fn}: mesh must be a jax.sharding.Mesh or None "
                    f"(got {type(mesh).__name__})")
  if cfg.expert_axis not in mesh.axis_names:
    raise ValueError(f"{fn}: mesh must have the expert axis {cfg.expert_axis!r} "
                     f"(got axes {tuple(mesh.axis_names)})")
  _checks.divisible(fn, "num_experts", cfg.num_experts,
                    f"the '{cfg.expert_axis}' axis size", mesh.shape[cfg.expert_axis])


def _check_params(fn, params, cfg):
  """Raises unless `params` has the leaves, shapes and kinds `init_moe_params(cfg)` builds."""
  if not isinstance(params, MoEParams):
    raise TypeError(f"{fn}: params must be a MoEParams from init_moe_params "
                    f"(got {type(params).__name__})")
  want = {jax.tree_util.keystr(p): s
          for p, s in jax.tree_util.tree_leaves_with_path(moe_param_shapes(cfg))}
  got = {jax.tree_util.keystr(p): a
         for p, a in jax.tree_util.tree_leaves_with_path(params)}
  if want.keys() != got.keys():
    missing = [f"params{k}" for k in want if k not in got]
    extra = [f"params{k}" for k in got if k not in want]
    raise ValueError(f"{fn}: params must have the leaves of this MoEConfig "
                     f"(expert_type={cfg.expert_type!r}, num_shared_experts="
                     f"{cfg.num_shared_experts}): missing {missing}, unexpected {extra}")
  for k, s in want.items():
    a = _checks.float_array(fn, f"params{k}", got[k])
    if tuple(a.shape) != s.shape:
      raise ValueError(f"{fn}: params{k} must have shape {s.shape} for this MoEConfig "
                       f"(got {tuple(a.shape)})")


# --------------------------------------------------------------------------- routing stage


def drop_over_capacity(experts_TK, num_experts, capacity):
  """Drops the items past each expert's capacity, earlier tokens first.

  Each expert's queue holds its (token, slot) items in token order, then slot order within
  a token (the row-major order of `experts_TK`). The first `capacity` items of every queue
  are kept; the rest get expert id -1, which every dispatch implementation treats as
  contributing zero. Ids already outside [0, E) stay as they are and are not counted.

  Args:
    experts_TK: i32[T, K] expert ids (all the tokens of the call, in order).
    num_experts: E.
    capacity: items each expert takes (static int >= 0).

  Returns:
    (kept_TK: i32[T, K] ids with dropped items set to -1, dropped_TK: bool[T, K]).
  """
  T, K = experts_TK.shape
  ids_I = experts_TK.reshape(T * K)  # I = T*K items in queue order
  order_I, load_E, valid_I = local.sort_by_expert(ids_I, num_experts)  # stable
  start_E = jnp.cumsum(load_E) - load_E
  rank_I = local.inverse_permutation(order_I)  # sorted position of each item
  pos_I = rank_I - start_E[jnp.where(valid_I, ids_I, 0)]  # position in its expert's queue
  dropped_I = valid_I & (pos_I >= capacity)
  kept_I = jnp.where(dropped_I, -1, ids_I)
  return kept_I.reshape(T, K), dropped_I.reshape(T, K)


def route(logits_TE, cfg, mesh=None):
  """Runs `top_k_routing` on the router logits, token-parallel on a mesh.

  XLA's partitioner all-gathers the input of TopK (every device would route all T tokens),
  so on a mesh whose size divides T the routing runs under `shard_map` over the tokens
  instead: it is per token and needs no communication.

  Args:
    logits_TE: f32[T, E] router logits.
    cfg: `MoEConfig` (top_k, normalize_top_k).
    mesh: None (default) or the layer's mesh.

  Returns:
    `Routing`, split over every mesh axis when on a mesh.
  """
  fn = functools.partial(top_k_routing, k=cfg.top_k, normalize=cfg.normalize_top_k)
  if mesh is None or logits_TE.shape[0] % mesh.size:
    return fn(logits_TE)
  tok = P(tuple(mesh.axis_names))
  return jax.shard_map(fn, mesh=mesh, in_specs=tok, out_specs=Routing(tok, tok, tok))(
      parallel.place(logits_TE, mesh, tok))


def choose_impl(cfg, mesh=None):
  """Resolves `cfg.impl` for a mesh.

  Args:
    cfg: `MoEConfig`.
    mesh: None (default) or a `jax.sharding.Mesh`.

  Returns:
    `cfg.impl` unless it is "auto"; for "auto", "all_to_all" when the mesh's
    `cfg.expert_axis` has more than one device, else "ragged_dot".
  """
  if cfg.impl != "auto":
    return cfg.impl
  if mesh is not None and mesh.shape.get(cfg.expert_axis, 1) > 1:
    return "all_to_all"
  return "ragged_dot"


# --------------------------------------------------------------------------- explicit axes


def _explicit_mesh(ref):
  """The abstract mesh of `ref` and its Explicit axes, or (None, ()) when there are none."""
  mesh = getattr(getattr(jax.typeof(ref), "sharding", None), "mesh", None)
  if mesh is None or not mesh.axis_names:
    return None, ()
  return mesh, tuple(n for n, t in zip(mesh.axis_names, mesh.axis_types)
                     if t == AxisType.Explicit)


def _auto(fn, ref, out_specs):
  """`fn` with the Explicit axes of `ref`'s mesh switched to Auto (XLA picks shardings).

  `out_specs(ref_spec)` gives the `PartitionSpec` pytree of fn's outputs. Without Explicit
  axes, `fn` itself.
  """
  mesh, axes = _explicit_mesh(ref)
  if not axes:
    return fn

  def wrapped(*args):
    with jax.sharding.use_abstract_mesh(mesh):
      out = out_specs(jax.typeof(ref).sharding.spec)
      return jax.sharding.auto_axes(fn, axes=axes, out_sharding=out)(*args)

  return wrapped


def _like(y, ref):
  """Reshards `y` to the sharding of `ref` when both live on an Explicit mesh."""
  mesh, axes = _explicit_mesh(ref)
  if not axes:
    return y
  want = jax.typeof(ref).sharding
  if jax.typeof(y).sharding.spec == want.spec:
    return y
  with jax.sharding.use_abstract_mesh(mesh):
    return jax.sharding.reshard(y, want.spec)


# --------------------------------------------------------------------------- layer


def shared_experts(shared, x_TD):
  """Sums the shared SwiGLU experts over every token: f32[T, D].

  The leaves have the shared-expert axis first (written `e` in the einsums).
  """
  w = jax.tree.map(lambda a: a.astype(x_TD.dtype), shared)
  f32 = dict(preferred_element_type=jnp.float32)
  g_TEF = jnp.einsum("td,edf->tef", x_TD, w.gate_EDF, **f32)
  u_TEF = jnp.einsum("td,edf->tef", x_TD, w.up_EDF, **f32)
  h_TEF = (jax.nn.silu(g_TEF) * u_TEF).astype(x_TD.dtype)
  return jnp.einsum("tef,efd->td", h_TEF, w.down_EFD, **f32)


def _dispatch(impl, x_TD, ffn, experts_TK, weights_TK, cfg, mesh):
  """Runs the chosen implementation; returns (y_TD in x's dtype, rounds: i32[])."""
  if impl == "all_to_all":
    y_TD, stats = parallel.moe_all_to_all(
        x_TD, ffn, experts_TK, weights_TK, mesh=mesh, expert_axis=cfg.expert_axis,
        chunk_size=cfg.chunk_size, return_stats=True, gmm_impl=cfg.gmm_impl)
    return y_TD, stats["rounds"]
  if impl == "all_gather":
    y_TD = parallel.moe_all_gather(x_TD, ffn, experts_TK, weights_TK, mesh=mesh,
                                   expert_axis=cfg.expert_axis, gmm_impl=cfg.gmm_impl)
  else:
    local_fn = (local.moe_masked_scan if impl == "masked_scan" else
                functools.partial(local.moe_ragged_dot, gmm_impl=cfg.gmm_impl))
    y_TD = _auto(local_fn, x_TD, lambda spec: spec)(x_TD, ffn, experts_TK, weights_TK)
  return y_TD, jnp.ones((), jnp.int32)


def moe_layer(params, x_BSD, cfg, mesh=None):
  """Applies one MoE layer: route, (drop over capacity), dispatch, combine, add shared.

      logits_TE = x_TD @ router_DE                      (float32)
      weights_TK, experts_TK = top_k(softmax(logits_TE))
      y[t] = shared(x[t]) + sum_j weights[t, j] * expert(W[experts[t, j]], x[t])

  T = B * S tokens. Works under `jax.jit` (cfg and mesh static), `jax.grad` (w.r.t. params
  and x) and inside `lax.scan` over stacked params.

  Args:
    params: `MoEParams` from `init_moe_params(key, cfg)`.
    x_BSD: f[B, S, D] tokens, D = cfg.d_model; on the mesh or not.
    cfg: `MoEConfig`.
    mesh: None (default) or a `jax.sharding.Mesh` with `cfg.expert_axis`, whose size must
      divide E. Required by the expert-parallel implementations; "auto" picks "all_to_all"
      when the expert axis has more than one device. The local implementations
      ("masked_scan", "ragged_dot") do not split experts: XLA shards them as it likes.

  Returns:
    (y_BSD, aux). y_BSD has the shape, dtype and sharding of x_BSD. aux is a dict:
      aux_loss: f32[] `load_balance_coef * load_balance_loss + z_loss_coef * z_loss`,
        to add to the training loss.
      load_balance_loss: f32[] `load_balancing_loss` of the router's choices (before any
        capacity drop), unweighted; 1.0 when balanced.
      z_loss: f32[] `router_z_loss`, unweighted.
      expert_load: i32[E] (token, slot) items each expert computed (after capacity drops).
      rounds: i32[] dispatch rounds: the all_to_all's rounds (>= 1); always 1 for the other
        implementations, which move every item in one pass.
      dropped_items: i32[] (token, slot) items dropped by the capacity (0 when dropless).
      dropped_tokens: i32[] tokens all of whose K items were dropped (they get the shared
        experts' output only).

  Raises:
    TypeError, ValueError: a bad cfg, mesh, x (rank, dtype, d_model) or params (a leaf
      missing or of the wrong shape, named), at trace time.
  """
  fn = "moe_layer"
  _check_config(fn, cfg)
  x_BSD = _checks.float_array(fn, "x_BSD", x_BSD)
  if x_BSD.ndim != 3 or x_BSD.shape[-1] != cfg.d_model:
    raise ValueError(f"{fn}: x_BSD must have shape [B, S, d_model={cfg.d_model}] "
                     f"(got shape {tuple(x_BSD.shape)})")
  _check_params(fn, params, cfg)
  if mesh is not None:
    _check_mesh(fn, cfg, mesh)
  impl = choose_impl(cfg, mesh)
  if mesh is None and impl in PARALLEL_IMPLS:
    raise ValueError(f"{fn}: impl {impl!r} needs a mesh with the expert axis "
                     f"{cfg.expert_axis!r} (got mesh=None)")
  E, K = cfg.num_experts, cfg.top_k
  compute_dtype = cfg.compute_dtype or x_BSD.dtype

  x_TD = einops.rearrange(x_BSD, "b s d -> (b s) d")
  T = x_TD.shape[0]
  if mesh is not None and _explicit_mesh(x_TD)[0] is None and AxisType.Explicit in \
      mesh.axis_types:  # x is not on the mesh yet: split its tokens over it (if they divide)
    x_TD = parallel.place(x_TD, mesh,
                          P(tuple(mesh.axis_names)) if T % mesh.size == 0 else P())
  with jax.named_scope("route"):
    logits_TE = jnp.einsum("td,de->te", x_TD.astype(jnp.float32),
                           params.router_DE.astype(jnp.float32))
    routing = route(logits_TE, cfg, mesh)
    lb_loss = _auto(load_balancing_loss, routing.experts_TK, lambda _: P())(routing)
    z_loss = router_z_loss(logits_TE)
    experts_TK = routing.experts_TK
    capacity = cfg.capacity(T)
    if capacity is None:
      dropped_TK = jnp.zeros_like(experts_TK, dtype=bool)
    else:
      experts_TK, dropped_TK = _auto(
          functools.partial(drop_over_capacity, num_experts=E, capacity=capacity),
          experts_TK, lambda spec: (spec, spec))(experts_TK)
    load_E = _auto(functools.partial(expert_load, num_experts=E), experts_TK,
                   lambda _: P())(experts_TK)
  with jax.named_scope("dispatch"):
    ffn = jax.tree.map(lambda a: a.astype(compute_dtype), params.experts)
    y_TD, rounds = _dispatch(impl, x_TD.astype(compute_dtype), ffn, experts_TK,
                             routing.weights_TK, cfg, mesh)
    y_TD = _like(y_TD.astype(jnp.float32), x_TD)
  if params.shared is not None:
    with jax.named_scope("shared_experts"):
      y_TD = y_TD + shared_experts(params.shared, x_TD.astype(compute_dtype))
  y_BSD = einops.rearrange(y_TD.astype(x_BSD.dtype), "(b s) d -> b s d", b=x_BSD.shape[0])
  aux = dict(
      aux_loss=cfg.load_balance_coef * lb_loss + cfg.z_loss_coef * z_loss,
      load_balance_loss=lb_loss,
      z_loss=z_loss,
      expert_load=load_E,
      rounds=rounds,
      dropped_items=jnp.sum(dropped_TK, dtype=jnp.int32),
      dropped_tokens=jnp.sum(jnp.all(dropped_TK, axis=1), dtype=jnp.int32),
  )
  return _like(y_BSD, x_BSD), aux
