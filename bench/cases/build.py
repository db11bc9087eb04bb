"""A case: its sizes (`Size`), routing and parameters on a mesh (`make_case`): the host routing
every implementation is checked and accounted against, the placement, and the parameters as
each row holds them (slot-major, with adapters, quantized). `programs.py` builds each
implementation's programs on a case."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import moe_shard as ms
from bench.cases import common

# Bytes of x (float32) past which a compile-only case samples its routing (`sampled_top_k`)
# instead of drawing x on the host.
HOST_DRAW_BYTES = 2**31


@dataclasses.dataclass(frozen=True)
class Size:
  """Problem size: T tokens in all, D, F, K, dtype, and the knobs of the baselines."""

  T: int
  D: int
  F: int
  K: int
  dtype: str = "float32"
  capacity_factor: float = 1.25  # jit_gshard_einsum only
  zipf_s: float = 1.2
  # all_to_all's chunk_size: C, or (C_first, C_overflow) (None: the library's default).
  chunk_size: int | tuple[int, int] | None = None
  # Layer level: MoEConfig.expert_tensor_axis and expert_fsdp_axis (axes of the mesh).
  expert_tensor_axis: str | None = None
  expert_fsdp_axis: str | None = None
  num_shared_experts: int = 0  # layer level: dense SwiGLU experts of width F on every token
  # The routed experts' matrices: None (float, in `dtype`) or "int8", "fp8", "mxfp4".
  weights_format: str | None = None
  adapter_rank: int = 0  # layer level: a LoRA adapter of this rank on every matrix (0: none)
  expert_type: str = "swiglu"  # layer level: MoEConfig.expert_type and expert_bias
  expert_bias: bool = False
  # The layer's router (MoEConfig fields): sigmoid scores, group-limited top-k, scaling.
  score_func: str = "softmax"
  num_groups: int = 1
  top_k_groups: int | None = None
  routed_scaling: float = 1.0
  normalize_top_k: bool = True
  router_logit_bias: bool = False  # a trained router bias (gpt-oss)
  bias_balancing: bool = False  # a selection-only router bias (DeepSeek-V3)
  # Layer level: where the experts' replicas live (`bench.PLACEMENTS`), R redundant slots.
  placement: str = "none"
  replicas: int = 0


@dataclasses.dataclass
class Case:
  """The inputs of one (level, E, routing), shared by every implementation.

  Attributes:
    args: the program arguments (arrays, or ShapeDtypeStructs with shardings).
    experts_TK: np.int32[T, K] the routing, on the host (for trip counts and bounds).
    routed_flops: FLOPs of the routed work, forward (x3 with the backward); at layer level
      the router's, the K experts' of every token and its shared experts'.
    bound_bytes: the cost model's lower bound on bytes sent per device, forward.
    placement: the layer's `placement` argument (`ms.Placement`, `ms.StepPlacement`) or
      None; with "served", args[0] are the slot-major parameters.
    logical_params: the logical parameters when args[0] are slot-major, else None (the
      bound is the problem's, read from them).
  """

  level: str
  E: int
  routing: str
  size: Size
  mesh: jax.sharding.Mesh
  args: tuple
  experts_TK: np.ndarray
  routed_flops: float
  bound_bytes: float
  cfg: ms.MoEConfig
  placement: object = None
  logical_params: object = None


def check_combination(size, E, mesh, level):
  """Raises ValueError, naming the rule, for a size the implementations cannot run."""
  N = mesh.shape[ms.EXPERT]
  if E % N:
    raise ValueError(f"experts ({E}) must be divisible by the expert axis of the mesh ({N})")
  if size.K > E:
    raise ValueError(f"top-k ({size.K}) must be <= experts ({E})")
  if size.T % mesh.size:
    raise ValueError(f"tokens ({size.T}) must be divisible by the mesh size ({mesh.size})")
  for field, axis, dim, n in (
    ("expert_tensor_axis", size.expert_tensor_axis, "d_ff", size.F),
    ("expert_fsdp_axis", size.expert_fsdp_axis, "d_ff", size.F),  # gate and up's last dim
    ("expert_fsdp_axis", size.expert_fsdp_axis, "d_model", size.D),  # down's last dim
  ):
    if axis is None:
      continue
    if level != "layer":
      raise ValueError(f"{field} splits the layer's SwiGLU experts: layer level only")
    if axis not in mesh.axis_names:
      raise ValueError(f"{field} {axis!r} is not an axis of the mesh {tuple(mesh.axis_names)}")
    if n % mesh.shape[axis]:
      raise ValueError(
        f"{dim} ({n}) must be divisible by the {axis} axis of the mesh ({mesh.shape[axis]})"
      )
  if size.weights_format is not None:
    # The matrices' [input, output] shapes: the kernel's one, the layer's gate/up and down.
    shapes = [(size.D, size.F)] + ([(size.F, size.D)] if level == "layer" else [])
    for i, o in shapes:
      for axis, n, block in zip(("input", "output"), (i, o), ms.quant.BLOCKS[size.weights_format]):
        if block is not None and n % block:
          raise ValueError(
            f"weights format {size.weights_format!r} needs the {axis} dimension of every "
            f"[{i}, {o}] expert matrix divisible by its block ({block}); got {n}"
          )
  if size.adapter_rank and (level != "layer" or size.adapter_rank > min(size.D, size.F)):
    raise ValueError(
      f"adapters of rank {size.adapter_rank} go on the layer's [D, F] matrices: layer level, "
      f"rank <= min(D, F) = {min(size.D, size.F)}"
    )
  if level != "layer" and (size.expert_type != "swiglu" or size.expert_bias):
    raise ValueError("expert_type and expert_bias are layer settings: layer level only")
  if size.placement != "none":
    if level != "layer":
      raise ValueError(f"placement {size.placement!r} is a layer setting: layer level only")
    if (E + size.replicas) % N:
      raise ValueError(
        f"experts + replicas ({E} + {size.replicas}) must be divisible by the expert axis of "
        f"the mesh ({N})"
      )
    if size.placement in ("home", "step") and (size.replicas % N or not size.replicas):
      raise ValueError(
        f"placement {size.placement!r} needs replicas, a multiple of the expert axis of the "
        f"mesh ({N}) (got {size.replicas})"
      )
  if level == "layer" and size.D < 2:
    raise ValueError(
      f"d_model must be >= 2 at layer level, where feature 0 carries the "
      f"routing skew (got {size.D})"
    )


def make_case(level, E, routing, size, mesh, *, abstract=False, seed=0):
  """Builds the shared inputs of one case (ShapeDtypeStructs when `abstract`)."""
  check_combination(size, E, mesh, level)
  N = mesh.shape[ms.EXPERT]
  T, D, F, K = size.T, size.D, size.F, size.K
  dtype = jnp.dtype(size.dtype)
  # The kernel level reads the dispatch settings (chunk size, expert axis) from it too.
  cfg = ms.MoEConfig(
    d_model=D,
    d_ff=F,
    num_experts=E,
    top_k=K,
    param_dtype=dtype,
    chunk_size=size.chunk_size,
    score_func=size.score_func,
    num_groups=size.num_groups,
    top_k_groups=size.top_k_groups,
    routed_scaling=size.routed_scaling,
    normalize_top_k=size.normalize_top_k,
    router_logit_bias=size.router_logit_bias,
    bias_balancing=size.bias_balancing,
    expert_tensor_axis=size.expert_tensor_axis,
    expert_fsdp_axis=size.expert_fsdp_axis,
    num_shared_experts=size.num_shared_experts,
    weights_format=size.weights_format,
    expert_type=size.expert_type,
    expert_bias=size.expert_bias,
  )
  tok = NamedSharding(mesh, P(tuple(mesh.axis_names)))
  rng = np.random.default_rng(seed)
  b = dtype.itemsize
  bound = (T // mesh.size) * K * (N - 1) / N * (D + (F if level == "kernel" else D)) * b

  def put(a, sharding, dt=None):
    dt = dt or a.dtype
    if abstract:
      return jax.ShapeDtypeStruct(a.shape, dt, sharding=sharding)
    a = np.asarray(a).astype(dt)  # every process holds it whole and places only its shards
    return jax.make_array_from_callback(a.shape, sharding, lambda index: a[index])

  def draw(*shape, scale=1.0):  # values only for a run; a compile needs just the shape
    if abstract:
      return jax.ShapeDtypeStruct(shape, np.float32)
    return rng.standard_normal(shape, np.float32) * np.float32(scale)

  if level == "kernel":
    experts, weights = common.synthetic_routing(
      routing, T, E, K, num_devices=N, zipf_s=size.zipf_s, seed=seed
    )
    x, w, dy = draw(T, D), draw(E, D, F, scale=1 / np.sqrt(D)), draw(T, F)
    exp = NamedSharding(mesh, P(ms.EXPERT))
    args = (
      put(x, tok, dtype),
      quantized(put(w, exp, dtype), size.weights_format, mesh),
      put(experts, tok),
      put(weights, tok),
      put(dy, tok, dtype),
    )
    return Case(
      level,
      E,
      routing,
      size,
      mesh,
      args,
      experts,
      2.0 * D * F * int(np.sum((experts >= 0) & (experts < E))),
      bound,
      cfg,
    )
  B = mesh.size
  # A compile needs only x's routing: past HOST_DRAW_BYTES it is drawn shard by shard from
  # the distribution of the logits (`sampled_top_k`), and x is never held.
  whole = not abstract or T * D * 4 <= HOST_DRAW_BYTES
  x = rng.standard_normal((B, T // B, D), np.float32) if whole else draw(B, T // B, D)
  if whole:
    x[..., 0] = 1.0  # a constant feature: its router row biases the routing
  router = rng.standard_normal((D, E), np.float32)
  router[1:] = equal_logit_columns(router[1:])
  router[0] = np.clip(
    common.routing_log_popularity(routing, E, K, num_devices=N, zipf_s=size.zipf_s, seed=seed),
    -30,
    30,
  )
  rep = NamedSharding(mesh, P())
  if abstract:
    shapes = ms.moe_param_shapes(cfg)
    specs = ms.moe_param_specs(cfg)
    params = jax.tree.map(
      lambda s, p: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=NamedSharding(mesh, p)),
      shapes,
      specs,
    )
  else:
    params = ms.init_moe_params(jax.random.key(seed), cfg, mesh=mesh)
  params = dataclasses.replace(params, router_DE=put(router, rep, np.float32))
  if size.adapter_rank:
    params = with_adapters(params, size.adapter_rank, dtype, abstract, seed)
  experts = (
    host_top_k(x.reshape(T, D), router, K, dtype, size)
    if whole
    else sampled_top_k(rng, router, B, T // B, K, size)
  )
  placement, logical = make_placement(size, experts, E, N), None
  if size.placement == "served":
    logical, params = params, served_params(params, placement, mesh, abstract)
  args = (params, put(x, tok, dtype), put(draw(B, T // B, D), tok, dtype))
  routed = 2.0 * T * D * E + 3 * 2.0 * D * F * T * (K + size.num_shared_experts)
  # An adapter's two matmuls per expert matrix: (D + F) * R multiply-adds a row, each.
  routed += 3 * 2.0 * (D + F) * size.adapter_rank * T * K
  return Case(level, E, routing, size, mesh, args, experts, routed, bound, cfg, placement, logical)


def make_placement(size, experts_TK, E, N):
  """The layer's placement for `size.placement`, planned from the case's own load (the
  host routing): None, an `ms.Placement` or an `ms.StepPlacement`."""
  kind, R = size.placement, size.replicas
  if kind == "none":
    return None
  if kind == "step":
    return ms.StepPlacement(spare_slots=R // N)
  e = np.asarray(experts_TK).ravel()
  load = np.bincount(e[(e >= 0) & (e < E)], minlength=E)
  return ms.plan_placement(load, E + R, N, keep_home=kind == "home")


def served_params(params, placement, mesh, abstract):
  """`ms.replicate_experts(params, placement)`: slot-major parameters, or their
  ShapeDtypeStructs (each slot split over the expert axis as the experts were)."""
  if not abstract:
    return ms.replicate_experts(params, placement, mesh=mesh)
  S = placement.num_slots

  def slots(a):
    return jax.ShapeDtypeStruct((S,) + a.shape[1:], a.dtype, sharding=a.sharding)

  fields = {f.name: getattr(params, f.name) for f in dataclasses.fields(ms.MoEParams)}
  experts = jax.tree.map(slots, params.experts)
  return ms.ServedParams(**dict(fields, experts=experts))


def with_adapters(params, rank, dtype, abstract, seed):
  """`params` with an adapter of rank `rank` on every routed-expert matrix (`ms.add_adapters`;
  b drawn small instead of zeros, so that nothing is constant), a and b in `dtype`, placed
  like the matrices' expert axis. `abstract`: ShapeDtypeStructs with those shardings."""
  if not abstract:
    ad = ms.add_adapters(params, rank=rank, key=jax.random.key(seed + 1), dtype=dtype)
    experts = ad.experts
    new = {}
    for f in dataclasses.fields(experts):
      a = getattr(experts, f.name)
      if isinstance(a, ms.Adapter):
        b = jax.jit(lambda b: b + 1e-3, out_shardings=a.b.sharding)(a.b)
        new[f.name] = dataclasses.replace(a, b=b)
    return dataclasses.replace(ad, experts=dataclasses.replace(experts, **new))
  experts = params.experts
  new = {}
  for f in dataclasses.fields(experts):
    w = getattr(experts, f.name)
    if w is None or f.metadata.get("static") or len(w.shape) != 3:
      continue
    *lead, I, O = w.shape
    arr = w.values if ms.quant.is_quantized(w) else w
    sharding = NamedSharding(arr.sharding.mesh, P(arr.sharding.spec[0], None, None))
    a = jax.ShapeDtypeStruct((*lead, I, rank), dtype, sharding=sharding)
    b = jax.ShapeDtypeStruct((*lead, rank, O), dtype, sharding=sharding)
    new[f.name] = ms.Adapter(w, a, b)
  return dataclasses.replace(params, experts=dataclasses.replace(experts, **new))


def quantized(w_EDF, fmt, mesh):
  """The kernel's expert matrices in `fmt` (`ms.QuantizedArray`, values and scales split
  over the expert axis as `w_EDF` is), or `w_EDF` itself for float weights (`fmt` None).
  A `ShapeDtypeStruct` gives one of them (nothing computed)."""
  if fmt is None:
    return w_EDF
  shapes = jax.eval_shape(lambda w: ms.quant.quantize(w, fmt), w_EDF)
  shardings = jax.tree.map(lambda p: NamedSharding(mesh, p), ms.quant.expand(P(ms.EXPERT), shapes))
  if isinstance(w_EDF, jax.ShapeDtypeStruct):
    return jax.tree.map(
      lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh), shapes, shardings
    )
  return jax.jit(lambda w: ms.quant.quantize(w, fmt), out_shardings=shardings)(w_EDF)


def equal_logit_columns(w_RE):
  """Router columns under which x ~ N(0, 1) scores every expert alike: w_RE's columns made
  orthonormal (R >= E) or, with fewer rows than experts, of unit norm.

  The logits x @ w of x_TR ~ N(0, 1) have covariance w.T @ w. With orthonormal columns they
  are independent N(0, 1), so with a zero bias every expert is equally likely to be chosen.
  Columns of a Gaussian draw scaled by 1/sqrt(R) have norms spread by about sqrt(2/R), and
  the top-k favours the experts with the widest logits, far more than their norms differ:
  such a "uniform" routing loads its busiest expert well past a uniform draw's busiest, and
  past the receive buffers the dispatches size for uniform routing.

  Args:
    w_RE: float[R, E] a Gaussian draw.

  Returns:
    np.float32[R, E].
  """
  w_RE = np.asarray(w_RE, np.float64)
  if w_RE.shape[0] >= w_RE.shape[1]:
    q_RE, r_EE = np.linalg.qr(w_RE)
    w_RE = q_RE * np.sign(np.diag(r_EE))  # a Haar-distributed orthonormal frame
  else:
    w_RE = w_RE / np.linalg.norm(w_RE, axis=0, keepdims=True)
  return w_RE.astype(np.float32)


def host_top_k(x_TD, router_DE, k, dtype, size=None):
  """The layer's routing of x, computed on the host in NumPy (independently of the library).

  What the compiled program routes: x rounded to its dtype, logits in float32, the k
  largest scores (ties: lowest index first, as `lax.top_k`); with `size`'s router settings,
  sigmoid scores and DeepSeek-V3's group limit (a token keeps the `top_k_groups` groups
  with the largest sum of their top-2 scores). Selection only: the weights do not matter
  to the accounting.
  """
  logits = np.asarray(np.asarray(x_TD).astype(dtype), np.float32) @ np.asarray(router_DE)
  return _select(logits, k, size)


def sampled_top_k(rng, router_DE, num_shards, tokens_per_shard, k, size=None):
  """The routing `host_top_k` gives an x drawn as `make_case` draws it, sampled without x.

  For x_TD ~ N(0, 1) with feature 0 set to 1, the logits are router[0] + x[:, 1:] @ router[1:].
  With router[1:] = Q @ S (reduced QR, Q's columns orthonormal), z = x[:, 1:] @ Q has
  independent N(0, 1) entries, so router[0] + z @ S, z drawn [tokens, min(D - 1, E)], has the
  logits' distribution at E/D of the draws (x's rounding to its dtype aside). Drawn and
  selected one token shard at a time, from `rng` after the router.

  Returns:
    np.int32[num_shards * tokens_per_shard, k], shards in mesh order.
  """
  router_DE = np.asarray(router_DE, np.float32)
  S = np.linalg.qr(router_DE[1:].astype(np.float64), mode="r").astype(np.float32)
  shards = [
    _select(
      router_DE[0] + rng.standard_normal((tokens_per_shard, S.shape[0]), np.float32) @ S, k, size
    )
    for _ in range(num_shards)
  ]
  return np.concatenate(shards)


def _select(logits, k, size):
  """The top-k selection of `host_top_k` on float32 logits [T, E]."""
  if size is not None and size.num_groups > 1:
    G = size.num_groups
    scores = 1 / (1 + np.exp(-logits)) if size.score_func == "sigmoid" else logits
    T, E = scores.shape
    top2 = -np.sort(-scores.reshape(T, G, E // G), axis=2)[:, :, : min(2, E // G)].sum(axis=2)
    kept_TG = np.argsort(-top2, axis=1, kind="stable")[:, : size.top_k_groups or G]
    mask_TG = np.zeros((T, G), bool)
    np.put_along_axis(mask_TG, kept_TG, True, axis=1)
    logits = np.where(np.repeat(mask_TG, E // G, axis=1), logits, -np.inf)
  return np.argsort(-logits, axis=1, kind="stable")[:, :k].astype(np.int32)
