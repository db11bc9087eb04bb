"""GShard-style capacity-factor einsum dispatch: what MoE code looked like before shard_map.

One-hot dispatch and combine tensors, `jax.jit` only; XLA turns the change of sharding of the
dispatched tokens (groups over devices -> experts over devices) into an all-to-all (GShard,
Lepikhin et al. 2020, section 2.2; MaxText's "dense" MoE path). Each group (here: the
tokens of one device) gives every expert C = `ms.capacity(capacity_factor, S, K, E)` slots
(the layer's formula, ceil(capacity_factor * S * K / E) computed exactly), filled slot-major
(every token's first choice before any second choice); items past C are dropped. Benchmark
baseline only: the library itself never drops unless asked.

`GShard(capacity_factor)` is a dispatch of the library's table signature, so the layer
runs it with its own router, aux losses and shared experts (`MoEConfig(impl=GShard(1.25))`).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import moe_shard as ms


def gshard_moe(x_TD, ffn, experts_TK, weights_TK, *, mesh, capacity_factor):
  """Capacity-factor MoE with one-hot einsum dispatch and combine.

  Args:
    x_TD: f[T, D] tokens, T divisible by the mesh size; the tokens of device (n, m) of the
      ("expert", "data") mesh form group (n, m).
    ffn: `ms.Linear` or `ms.SwiGLU` with the expert axis first.
    experts_TK: i32[T, K] expert ids; weights_TK: f32[T, K] combine weights.
    mesh: the ("expert", "data") mesh; experts are split over "expert".
    capacity_factor: c > 0.

  Returns:
    (y_TF in x's dtype, dropped: i32[] (token, slot) items past capacity).
  """
  T, D = x_TD.shape
  K = experts_TK.shape[1]
  E = jax.tree.leaves(ffn)[0].shape[0]
  N, M = mesh.shape[ms.EXPERT], mesh.size // mesh.shape[ms.EXPERT]
  S = T // (N * M)
  C = ms.capacity(capacity_factor, S, K, E)
  others = tuple(a for a in mesh.axis_names if a != ms.EXPERT) or None
  groups = NamedSharding(mesh, P(ms.EXPERT, others))  # group (n, m) on device (n, m)
  # Expert e's slots of every group on expert device e; a group's data index stays put, so
  # the resharding is an all-to-all over "expert" only.
  by_expert = NamedSharding(mesh, P(ms.EXPERT, None, others))
  x_NMSD = jax.lax.with_sharding_constraint(x_TD.reshape(N, M, S, D), groups)
  mask_NMKSE = jax.nn.one_hot(
    experts_TK.reshape(N, M, S, K).transpose(0, 1, 3, 2), E, dtype=jnp.int32
  )
  # Position of each item in its expert's queue, slot-major (all first choices first).
  pos_NMKSE = jnp.cumsum(mask_NMKSE.reshape(N, M, K * S, E), axis=2).reshape(N, M, K, S, E) - 1
  keep_NMKSE = (mask_NMKSE > 0) & (pos_NMKSE < C)
  slot_NMKSEC = jax.nn.one_hot(jnp.where(keep_NMKSE, pos_NMKSE, C), C, dtype=x_TD.dtype)
  dispatch_NMSEC = jnp.sum(slot_NMKSEC, axis=2)
  w_NMKS = weights_TK.reshape(N, M, S, K).transpose(0, 1, 3, 2).astype(x_TD.dtype)
  combine_NMSEC = jnp.einsum("nmks,nmksec->nmsec", w_NMKS, slot_NMKSEC)
  xe_ENMCD = jax.lax.with_sharding_constraint(
    jnp.einsum("nmsec,nmsd->enmcd", dispatch_NMSEC, x_NMSD), by_expert
  )
  # The expert FFN on every (expert, group, slot) at once: i and o are its input and output
  # widths (D -> F, then F -> D for SwiGLU's down projection).
  ye_ENMCF = ffn(xe_ENMCD, lambda x, w: jnp.einsum("enmci,eio->enmco", x, w.astype(x.dtype)))
  ye_ENMCF = jax.lax.with_sharding_constraint(ye_ENMCF.astype(x_TD.dtype), by_expert)
  y_NMSF = jax.lax.with_sharding_constraint(
    jnp.einsum("nmsec,enmcf->nmsf", combine_NMSEC, ye_ENMCF), groups
  )
  dropped = jnp.sum((mask_NMKSE > 0) & ~keep_NMKSE, dtype=jnp.int32)
  return y_NMSF.reshape(T, -1), dropped


@dataclasses.dataclass(frozen=True)
class GShard:
  """The GShard baseline as a dispatch: `(x_TD, ffn, experts_TK, weights_TK, *, mesh, cfg)
  -> (y_TD, {"dropped_items": i32[]})`. Frozen, so a `MoEConfig` holding it stays hashable.

  Attributes:
    capacity_factor: c > 0 (default 1.25).
  """

  capacity_factor: float = 1.25

  def __call__(self, x_TD, ffn, experts_TK, weights_TK, *, mesh, cfg):
    del cfg
    y_TD, dropped = gshard_moe(
      x_TD, ffn, experts_TK, weights_TK, mesh=mesh, capacity_factor=self.capacity_factor
    )
    return y_TD, {"dropped_items": dropped}


def _limit_inputs(case):
  """(mesh, the tokens' spec, `put`) of the limit rows: `put(shape, spec, dtype=the case's,
  scale=1.0)` places a seeded normal draw (a ShapeDtypeStruct when the case is abstract)."""
  mesh = case.mesh
  tok = P(tuple(mesh.axis_names))
  dtype = jnp.dtype(case.size.dtype)
  abstract = isinstance(case.args[0], jax.ShapeDtypeStruct) or isinstance(
    getattr(case.args[0], "router_DE", None), jax.ShapeDtypeStruct
  )

  def put(shape, spec, dt=dtype, scale=1.0):
    sharding = NamedSharding(mesh, spec)
    if abstract:
      return jax.ShapeDtypeStruct(shape, dt, sharding=sharding)
    rng = np.random.default_rng(len(shape))
    a = (rng.standard_normal(shape, np.float32) * np.float32(scale)).astype(dt)
    return jax.make_array_from_callback(shape, sharding, lambda index: a[index])

  return mesh, tok, put


def _limit_programs(mesh, tok, per_device, x, dy, ws):
  """The jitted fwd and fwd_bwd of a limit row: `per_device` under shard_map, each device's
  weights its own (a weight of ndim 2 is replicated); fwd_bwd pulls `dy` back."""
  specs = (tok,) + tuple(P() if w.ndim == 2 else tok for w in ws)
  outs = jax.tree.map(lambda _: tok, dy)
  fn = jax.shard_map(per_device, mesh=mesh, in_specs=specs, out_specs=outs)

  def fwd(x, dy, *ws):
    return fn(x, *ws)

  def fwd_bwd(x, dy, *ws):
    y, vjp = jax.vjp(fn, x, *ws)
    return (y, *vjp(dy))

  return {"fwd": jax.jit(fwd), "fwd_bwd": jax.jit(fwd_bwd)}, (x, dy, *ws)


def dense_limit(case):
  """The physical limit of a case: its routed FLOPs as plain dense matmuls on each device.

  Under `shard_map`, each device multiplies its T_dev * K items (the tokens' rows already
  repeated K times) by its own matrices of the case's shapes: one [D, F] matrix at kernel
  level; at layer level the router's [D, E] (float32, as the layer's) on its T_dev tokens
  and a SwiGLU (gate, up [D, F], down [F, D]). No routing, sort or communication (each
  device's weights are its own, so no gradient is summed across devices): what any
  implementation of the case would take if dispatch were free. The benchmark's efficiency
  column is this time over each row's.

  The expert matmuls accumulate in float32 and write the case's dtype, as the layer's own
  do: a float32 result would make the backward's cotangents float32, and every backward
  matmul of a bfloat16 case float32 x float32 (`tests/test_bench.py` reads the program).

  Returns:
    ({"fwd": jitted fn, "fwd_bwd": jitted fn}, args): the programs and their inputs (real
    arrays, or ShapeDtypeStructs when the case is abstract).
  """
  mesh, tok, put = _limit_inputs(case)
  n_dev = mesh.size
  T, D, F, K, E = case.size.T, case.size.D, case.size.F, case.size.K, case.E
  x = put((T * K, D), tok)
  if case.level == "kernel":
    ws = (put((n_dev, D, F), tok, scale=D**-0.5),)
    dy = put((T * K, F), tok)

    def per_device(x_ID, w_1DF):
      return jnp.einsum("id,df->if", x_ID, w_1DF[0], preferred_element_type=x_ID.dtype)
  else:
    ws = (
      put((D, E), P(), jnp.float32, D**-0.5),
      put((n_dev, D, F), tok, scale=D**-0.5),
      put((n_dev, D, F), tok, scale=D**-0.5),
      put((n_dev, F, D), tok, scale=F**-0.5),
    )
    dy = put((T * K, D), tok)

    def per_device(x_ID, router_DE, gate_1DF, up_1DF, down_1FD):
      # The router on the device's T_dev tokens (every K-th row), then one SwiGLU.
      out = dict(preferred_element_type=x_ID.dtype)
      logits_TE = jnp.einsum("td,de->te", x_ID[::K].astype(jnp.float32), router_DE)
      g_IF = jnp.einsum("id,df->if", x_ID, gate_1DF[0], **out).astype(jnp.float32)
      u_IF = jnp.einsum("id,df->if", x_ID, up_1DF[0], **out).astype(jnp.float32)
      h_IF = (jax.nn.silu(g_IF) * u_IF).astype(x_ID.dtype)
      y_ID = jnp.einsum("if,fd->id", h_IF, down_1FD[0], **out)
      return (y_ID.astype(jnp.float32) + jnp.mean(logits_TE)).astype(x_ID.dtype)

  return _limit_programs(mesh, tok, per_device, x, dy, ws)


def matmul_limit(case):
  """The routed FLOPs as bare dense matmuls in the case's dtype: what the matmuls alone take.

  Under `shard_map`, each device runs its share of the routed FLOPs as dense matmuls whose
  inputs and outputs are in the case's dtype (products accumulated in float32 by the
  platform's matmul): at kernel level x_ID @ w_DF; at layer level the router's
  x_TD @ r_DE on its T_dev tokens and the three SwiGLU matmuls, g_IF = x_ID @ gate_DF,
  u_IF = x_ID @ up_DF and y_ID = g_IF @ down_FD, with no elementwise work between them
  (u_IF and the logits are outputs, so none is dead). Its forward executes exactly the
  routed FLOPs and its backward twice them, in matmuls alone; `dense_limit` adds the
  SwiGLU's elementwise and the layer's float32 router.

  Returns:
    ({"fwd": jitted fn, "fwd_bwd": jitted fn}, args), as `dense_limit`.
  """
  mesh, tok, put = _limit_inputs(case)
  n_dev = mesh.size
  T, D, F, K, E = case.size.T, case.size.D, case.size.F, case.size.K, case.E
  x = put((T * K, D), tok)
  if case.level == "kernel":
    ws = (put((n_dev, D, F), tok, scale=D**-0.5),)
    dy = put((T * K, F), tok)

    def per_device(x_ID, w_1DF):
      return x_ID @ w_1DF[0]
  else:
    ws = (
      put((n_dev, D, E), tok, scale=D**-0.5),
      put((n_dev, D, F), tok, scale=D**-0.5),
      put((n_dev, D, F), tok, scale=D**-0.5),
      put((n_dev, F, D), tok, scale=F**-0.5),
    )
    dy = (put((T * K, D), tok), put((T * K, F), tok), put((T, E), tok))

    def per_device(x_ID, router_1DE, gate_1DF, up_1DF, down_1FD):
      g_IF = x_ID @ gate_1DF[0]
      return g_IF @ down_1FD[0], x_ID @ up_1DF[0], x_ID[::K] @ router_1DE[0]

  return _limit_programs(mesh, tok, per_device, x, dy, ws)
