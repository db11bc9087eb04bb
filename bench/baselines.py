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
  mask_NMKSE = jax.nn.one_hot(experts_TK.reshape(N, M, S, K).transpose(0, 1, 3, 2), E,
                              dtype=jnp.int32)
  # Position of each item in its expert's queue, slot-major (all first choices first).
  pos_NMKSE = jnp.cumsum(mask_NMKSE.reshape(N, M, K * S, E), axis=2).reshape(
      N, M, K, S, E) - 1
  keep_NMKSE = (mask_NMKSE > 0) & (pos_NMKSE < C)
  slot_NMKSEC = jax.nn.one_hot(jnp.where(keep_NMKSE, pos_NMKSE, C), C, dtype=x_TD.dtype)
  dispatch_NMSEC = jnp.sum(slot_NMKSEC, axis=2)
  w_NMKS = weights_TK.reshape(N, M, S, K).transpose(0, 1, 3, 2).astype(x_TD.dtype)
  combine_NMSEC = jnp.einsum("nmks,nmksec->nmsec", w_NMKS, slot_NMKSEC)
  xe_ENMCD = jax.lax.with_sharding_constraint(
      jnp.einsum("nmsec,nmsd->enmcd", dispatch_NMSEC, x_NMSD), by_expert)
  # The expert FFN on every (expert, group, slot) at once: i and o are its input and output
  # widths (D -> F, then F -> D for SwiGLU's down projection).
  ye_ENMCF = ffn(xe_ENMCD, lambda x, w: jnp.einsum("enmci,eio->enmco", x, w.astype(x.dtype)))
  ye_ENMCF = jax.lax.with_sharding_constraint(ye_ENMCF.astype(x_TD.dtype), by_expert)
  y_NMSF = jax.lax.with_sharding_constraint(
      jnp.einsum("nmsec,enmcf->nmsf", combine_NMSEC, ye_ENMCF), groups)
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
    y_TD, dropped = gshard_moe(x_TD, ffn, experts_TK, weights_TK, mesh=mesh,
                               capacity_factor=self.capacity_factor)
    return y_TD, {"dropped_items": dropped}
