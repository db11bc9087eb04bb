"""What the benchmark compiles: every implementation of one case, on the same sharded inputs.

A case is (level, E, routing) at one size on one mesh:

  * level "kernel": `Out = sum_j G[i,j] * (W[B[i,j]] @ A[i])`, one [D, F] matrix per expert,
    routing drawn by `common.synthetic_routing`.
  * level "layer": `moe_layer` (router + dispatch + SwiGLU experts + combine), the router
    biased so that its top-k follows the same skew (a constant input feature whose router
    row is the log-popularity of each expert).

Implementations: "all_to_all" and "all_gather" (shard_map), and the jit-only versions
"jit_ragged_dot" and "jit_masked_scan" (the local references under `jax.jit` with sharded
inputs on an Auto mesh: XLA inserts the collectives) and "jit_gshard_einsum"
(`baselines.gshard_moe`, capacity-factor one-hot einsums).

Everything here works on real arrays (CPU/GPU/TPU runs) and on `jax.ShapeDtypeStruct`s
with shardings (ahead-of-time compiles for a TPU topology): the routing is known on the
host in both cases, so are the trip counts of the data-dependent loops (`trip_counts`).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import moe_shard as ms
from bench.accounting import loop_trip_counts
from moe_shard import layer as layer_lib
from moe_shard import plan as plan_lib
from moe_shard.parallel import OVERFLOW_SCOPE

from bench import IMPLS, baselines, common

_LAYER_IMPL = {"all_to_all": "all_to_all", "all_gather": "all_gather",
               "jit_ragged_dot": "ragged_dot", "jit_masked_scan": "masked_scan"}


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
  chunk_size: int | None = None  # all_to_all's C_first (None: the library's default)


@dataclasses.dataclass
class Case:
  """The inputs of one (level, E, routing), shared by every implementation.

  Attributes:
    args: the program arguments (arrays, or ShapeDtypeStructs with shardings).
    experts_TK: np.int32[T, K] the routing, on the host (for trip counts and bounds).
    routed_flops: FLOPs of the routed work, forward (x3 with the backward).
    bound_bytes: the cost model's lower bound on bytes sent per device, forward.
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
  cfg: ms.MoEConfig | None = None


def check_combination(size, E, mesh, level):
  """Raises ValueError, naming the rule, for a size the implementations cannot run."""
  N = mesh.shape[ms.EXPERT]
  if E % N:
    raise ValueError(f"experts ({E}) must be divisible by the expert axis of the mesh ({N})")
  if size.K > E:
    raise ValueError(f"top-k ({size.K}) must be <= experts ({E})")
  if size.T % mesh.size:
    raise ValueError(f"tokens ({size.T}) must be divisible by the mesh size ({mesh.size})")
  if level == "layer" and size.D < 2:
    raise ValueError(f"d_model must be >= 2 at layer level, where feature 0 carries the "
                     f"routing skew (got {size.D})")


def make_case(level, E, routing, size, mesh, *, abstract=False, seed=0):
  """Builds the shared inputs of one case (ShapeDtypeStructs when `abstract`)."""
  check_combination(size, E, mesh, level)
  N = mesh.shape[ms.EXPERT]
  T, D, F, K = size.T, size.D, size.F, size.K
  dtype = jnp.dtype(size.dtype)
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
    experts, weights = common.synthetic_routing(routing, T, E, K, num_devices=N,
                                                zipf_s=size.zipf_s, seed=seed)
    x, w, dy = draw(T, D), draw(E, D, F, scale=1 / np.sqrt(D)), draw(T, F)
    exp = NamedSharding(mesh, P(ms.EXPERT))
    args = (put(x, tok, dtype), put(w, exp, dtype), put(experts, tok), put(weights, tok),
            put(dy, tok, dtype))
    return Case(level, E, routing, size, mesh, args, experts,
                2.0 * D * F * int(np.sum((experts >= 0) & (experts < E))), bound)

  cfg = ms.MoEConfig(d_model=D, d_ff=F, num_experts=E, top_k=K, param_dtype=dtype,
                     chunk_size=size.chunk_size)
  B = mesh.size
  x = rng.standard_normal((B, T // B, D), np.float32)
  x[..., 0] = 1.0  # a constant feature: its router row biases the routing
  router = rng.standard_normal((D, E), np.float32) / np.sqrt(D)
  router[0] = np.clip(common.routing_log_popularity(routing, E, K, num_devices=N,
                                                    zipf_s=size.zipf_s, seed=seed), -30, 30)
  rep = NamedSharding(mesh, P())
  if abstract:
    shapes = ms.moe_param_shapes(cfg)
    specs = ms.moe_param_specs(cfg)
    params = jax.tree.map(
        lambda s, p: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=NamedSharding(mesh, p)),
        shapes, specs)
    params = dataclasses.replace(params, router_DE=put(router, rep))
    # What the compiled program routes: x rounded to its dtype, the router in float32.
    logits = np.asarray(x.reshape(T, D).astype(dtype), np.float32) @ router
    experts = np.argsort(-logits, axis=1, kind="stable")[:, :K].astype(np.int32)
  else:
    params = ms.init_moe_params(jax.random.key(seed), cfg, mesh=mesh)
    params = dataclasses.replace(params, router_DE=put(router, rep, np.float32))
    experts = _layer_routing(params, put(x, tok, dtype), cfg, mesh)
  args = (params, put(x, tok, dtype), put(draw(B, T // B, D), tok, dtype))
  routed = 2.0 * T * D * E + 3 * 2.0 * D * F * T * K
  return Case(level, E, routing, size, mesh, args, experts, routed, bound, cfg)


def _layer_routing(params, x_BSD, cfg, mesh):
  """The layer's routing of x, on the host, computed by the layer's own routing code."""

  @jax.jit
  def experts(params, x_BSD):
    x_TD = x_BSD.reshape(-1, x_BSD.shape[-1])
    logits = jnp.einsum("td,de->te", x_TD.astype(jnp.float32),
                        params.router_DE.astype(jnp.float32))
    return layer_lib.route(logits, cfg, mesh).experts_TK

  return np.asarray(multihost_utils.process_allgather(experts(params, x_BSD), tiled=True))


def programs(case, impl):
  """Returns {"fwd": jitted fn, "fwd_bwd": jitted fn} of `impl` on `case`, and a function
  giving (rounds, dropped) from a forward run."""
  mesh = case.mesh
  if case.level == "kernel":
    if impl == "all_to_all":
      fn = functools.partial(ms.moe_all_to_all, mesh=mesh, chunk_size=case.size.chunk_size)
    elif impl == "all_gather":
      fn = functools.partial(ms.moe_all_gather, mesh=mesh)
    elif impl == "jit_ragged_dot":
      fn = ms.moe_ragged_dot
    elif impl == "jit_masked_scan":
      fn = ms.moe_masked_scan
    elif impl == "jit_gshard_einsum":
      fn = functools.partial(_kernel_gshard, mesh=mesh, cf=case.size.capacity_factor)
    else:
      raise ValueError(f"unknown impl {impl!r}; choose from {', '.join(IMPLS)}")

    def fwd(x, w, e, g, dy):
      return fn(x, w, e, g)

    def fwd_bwd(x, w, e, g, dy):
      y, vjp = jax.vjp(lambda x, w, g: fn(x, w, e, g), x, w, g)
      return (y, *vjp(dy))

    return {"fwd": jax.jit(fwd), "fwd_bwd": jax.jit(fwd_bwd)}

  if impl == "jit_gshard_einsum":
    def layer(p, x):
      return baselines.gshard_layer(p, x, case.cfg, mesh, case.size.capacity_factor)
  elif impl in _LAYER_IMPL:
    cfg = dataclasses.replace(case.cfg, impl=_LAYER_IMPL[impl])

    def layer(p, x):
      return ms.moe_layer(p, x, cfg, mesh=mesh)
  else:
    raise ValueError(f"unknown impl {impl!r}; choose from {', '.join(IMPLS)}")

  def fwd(p, x, dy):
    y, aux = layer(p, x)
    return y, aux["aux_loss"], aux["rounds"], aux["dropped_items"]

  def fwd_bwd(p, x, dy):
    def outputs(p, x):
      y, aux = layer(p, x)
      return y, aux["aux_loss"]
    (y, _), vjp = jax.vjp(outputs, p, x)
    return (y, *vjp((dy, jnp.ones((), jnp.float32))))

  return {"fwd": jax.jit(fwd), "fwd_bwd": jax.jit(fwd_bwd)}


def _kernel_gshard(x, w, e, g, *, mesh, cf):
  return baselines.gshard_moe(x, ms.Linear(w_EDF=w), e, g, mesh=mesh, capacity_factor=cf)[0]


def rounds_and_dropped(case, impl):
  """(rounds, dropped items) of `impl` on `case`, from the host routing (no device run)."""
  N = case.mesh.shape[ms.EXPERT]
  T, K = case.size.T, case.size.K
  if impl == "all_to_all":
    load = _device_loads(case)
    chunks = plan_lib.default_chunks(T // case.mesh.size, K, N, case.size.chunk_size)
    queues = load.reshape(load.shape[0], N, -1).sum(axis=2)
    return int(chunks.rounds(int(queues.max()))), 0
  if impl == "jit_gshard_einsum":  # each device's tokens are a group; C slots per expert
    C = baselines.capacity(T // case.mesh.size, K, case.E, case.size.capacity_factor)
    return 1, int(np.maximum(_device_loads(case) - C, 0).sum())
  return 1, 0


def routing_bound_bytes(case):
  """Bytes the busiest device must send, forward, when tokens move to their experts.

  Device d sends D-wide rows of its items bound for other devices' experts and returns
  F_out-wide outputs of the items other devices send to its experts: the least any
  dropless token-moving dispatch of this routing sends from d. Equals `bound_bytes` on
  average under uniform routing; skew raises it.
  """
  mesh = case.mesh
  N = mesh.shape[ms.EXPERT]
  M = mesh.size // N
  L = case.E // N
  f_out = case.size.F if case.level == "kernel" else case.size.D
  load = _device_loads(case).reshape(N, M, N, L).sum(axis=3)  # [e_src, m, e_dst]
  own = np.eye(N, dtype=bool)[:, None, :]
  sent = np.where(own, 0, load).sum(axis=2)  # [e, m] items leaving device (e, m)
  returned = np.where(own, 0, load).sum(axis=0).T  # [e, m] items others send to (e, m)
  b = jnp.dtype(case.size.dtype).itemsize
  return float(np.max(sent * case.size.D + returned * f_out) * b)


def _device_loads(case):
  """int[devices, E]: items each device's tokens route to each expert (token blocks in
  mesh order: the sharding P(all axes))."""
  E = case.E
  n_dev = case.mesh.size
  e = case.experts_TK.reshape(n_dev, -1)
  load = np.zeros((n_dev, E), np.int64)
  for d in range(n_dev):
    valid = e[d][(e[d] >= 0) & (e[d] < E)]
    load[d] = np.bincount(valid, minlength=E)
  return load


def trip_counts(case, impl, on_tpu=False):
  """Per-device {scope path: total iterations} of the data-dependent loops of `impl`.

  Returns a list with one dict per device (mesh order). The grouped matmul's loops exist
  only where its "auto" picks the tiled kernel (not on TPU); their counts then come from
  the group sizes each device's kernel sees, per round for the all_to_all (round 0 outside
  the overflow loop, later rounds inside it).
  """
  mesh = case.mesh
  n_dev = mesh.size
  N = mesh.shape[ms.EXPERT]
  M = n_dev // N  # devices along the other axes; device index = e * M + m
  L = case.E // N
  T, K = case.size.T, case.size.K
  T_dev = T // n_dev
  load = _device_loads(case)  # [devices, E]
  out = [dict() for _ in range(n_dev)]

  def add(d, counts, prefix=""):
    if on_tpu:
      return
    for k, v in counts.items():
      out[d][prefix + k] = out[d].get(prefix + k, 0) + v

  if impl == "all_to_all":
    chunks = plan_lib.default_chunks(T_dev, K, N, case.size.chunk_size)
    queues = load.reshape(n_dev, N, L)  # [source, destination, local expert]
    rounds = int(chunks.rounds(int(queues.sum(axis=2).max())))
    ends = np.cumsum(queues, axis=2)
    starts = ends - queues
    for r in range(rounds):
      lo = 0 if r == 0 else chunks.start(r)
      C = chunks.first if r == 0 else chunks.overflow
      got = np.clip(np.minimum(ends, lo + C) - np.maximum(starts, lo), 0, None)
      for dst in range(n_dev):
        e_dst, m = divmod(dst, M)
        srcs = [e_src * M + m for e_src in range(N)]
        sizes = got[srcs, e_dst].sum(axis=0)
        add(dst, loop_trip_counts(sizes, N * C), "" if r == 0 else OVERFLOW_SCOPE + "/")
    for d in range(n_dev):
      out[d][OVERFLOW_SCOPE] = rounds - 1
      # The loops inside the overflow loop run 0 times when it never runs.
      add(d, dict.fromkeys(loop_trip_counts(np.zeros(L, int), N * chunks.overflow), 0),
          OVERFLOW_SCOPE + "/")
  elif impl == "all_gather":
    for dst in range(n_dev):
      e_dst, m = divmod(dst, M)
      srcs = [e_src * M + m for e_src in range(N)]
      sizes = load[srcs][:, e_dst * L:(e_dst + 1) * L].sum(axis=0)
      add(dst, loop_trip_counts(sizes, N * T_dev * K))
  elif impl == "jit_masked_scan":  # a scan over the E experts
    for d in range(n_dev):
      out[d]["moe_masked_scan"] = case.E
  elif impl == "jit_ragged_dot":
    counts = loop_trip_counts(load.sum(axis=0), T * K)
    for d in range(n_dev):
      add(d, counts)
  return out
