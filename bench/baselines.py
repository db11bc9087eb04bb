"""GShard-style capacity-factor einsum dispatch: what MoE code looked like before shard_map.

One-hot dispatch and combine tensors, `jax.jit` only; XLA turns the change of sharding of the
dispatched tokens (groups over devices -> experts over devices) into an all-to-all (GShard,
Lepikhin et al. 2020, section 2.2; MaxText's "dense" MoE path). Each group (here: the
tokens of one device) gives every expert C = ceil(capacity_factor * S * K / E) slots,
filled slot-major (every token's first choice before any second choice); items past C are
dropped. Benchmark baseline only: the library itself never drops unless asked.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import moe_shard as ms
from moe_shard import layer as layer_lib


def capacity(tokens_per_group, k, num_experts, capacity_factor):
  """Slots per expert per group: ceil(capacity_factor * S * K / E)."""
  return max(1, math.ceil(capacity_factor * tokens_per_group * k / num_experts))


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
  C = capacity(S, K, E, capacity_factor)
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
  if isinstance(ffn, ms.SwiGLU):
    h = jax.nn.silu(jnp.einsum("enmcd,edf->enmcf", xe_ENMCD,
                               ffn.gate_EDF.astype(x_TD.dtype)))
    h = h * jnp.einsum("enmcd,edf->enmcf", xe_ENMCD, ffn.up_EDF.astype(x_TD.dtype))
    ye_ENMCF = jnp.einsum("enmcf,efd->enmcd", h, ffn.down_EFD.astype(x_TD.dtype))
  else:
    ye_ENMCF = jnp.einsum("enmcd,edf->enmcf", xe_ENMCD, ffn.w_EDF.astype(x_TD.dtype))
  ye_ENMCF = jax.lax.with_sharding_constraint(ye_ENMCF, by_expert)
  y_NMSF = jax.lax.with_sharding_constraint(
      jnp.einsum("nmsec,enmcf->nmsf", combine_NMSEC, ye_ENMCF), groups)
  dropped = jnp.sum((mask_NMKSE > 0) & ~keep_NMKSE, dtype=jnp.int32)
  return y_NMSF.reshape(T, -1), dropped


def gshard_layer(params, x_BSD, cfg, mesh, capacity_factor):
  """The layer around `gshard_moe`: the layer's own routing and aux losses, then the einsum
  dispatch; (y_BSD, aux)."""
  B, S, D = x_BSD.shape
  x_TD = x_BSD.reshape(B * S, D)
  logits_TE = jnp.einsum("td,de->te", x_TD.astype(jnp.float32),
                         params.router_DE.astype(jnp.float32))
  routing = layer_lib.route(logits_TE, cfg, mesh)
  y_TD, dropped = gshard_moe(x_TD, params.experts, routing.experts_TK, routing.weights_TK,
                             mesh=mesh, capacity_factor=capacity_factor)
  aux_loss = (cfg.load_balance_coef * ms.load_balancing_loss(routing)
              + cfg.z_loss_coef * ms.router_z_loss(logits_TE))
  return y_TD.reshape(B, S, -1), dict(aux_loss=aux_loss, dropped_items=dropped,
                                      rounds=jnp.ones((), jnp.int32))
