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


def capacity(tokens_per_group, k, num_experts, capacity_factor):
  """Slots per expert per group: ceil(capacity_factor * S * K / E)."""
  return max(1, math.ceil(capacity_factor * tokens_per_group * k / num_experts))


def gshard_moe(x_TD, ffn, experts_TK, weights_TK, *, mesh, capacity_factor):
  """Capacity-factor MoE with one-hot einsum dispatch and combine.

  Args:
    x_TD: f[T, D] tokens, T divisible by the mesh size (one group per device).
    ffn: `ms.Linear` or `ms.SwiGLU` with the expert axis first.
    experts_TK: i32[T, K] expert ids; weights_TK: f32[T, K] combine weights.
    mesh: the mesh; groups are split over every axis, experts over "expert".
    capacity_factor: c > 0.

  Returns:
    (y_TF in x's dtype, dropped: i32[] (token, slot) items past capacity).
  """
  T, D = x_TD.shape
  K = experts_TK.shape[1]
  E = jax.tree.leaves(ffn)[0].shape[0]
  G = mesh.size
  S = T // G
  C = capacity(S, K, E, capacity_factor)
  groups = NamedSharding(mesh, P(tuple(mesh.axis_names)))
  others = tuple(a for a in mesh.axis_names if a != ms.EXPERT) or None
  by_expert = NamedSharding(mesh, P(ms.EXPERT, others))
  x_GSD = jax.lax.with_sharding_constraint(x_TD.reshape(G, S, D), groups)
  mask_GKSE = jax.nn.one_hot(experts_TK.reshape(G, S, K).transpose(0, 2, 1), E,
                             dtype=jnp.int32)
  # Position of each item in its expert's queue, slot-major (all first choices first).
  pos_GKSE = jnp.cumsum(mask_GKSE.reshape(G, K * S, E), axis=1).reshape(G, K, S, E) - 1
  keep_GKSE = (mask_GKSE > 0) & (pos_GKSE < C)
  slot_GKSEC = jax.nn.one_hot(jnp.where(keep_GKSE, pos_GKSE, C), C, dtype=x_TD.dtype)
  dispatch_GSEC = jnp.sum(slot_GKSEC, axis=1)
  w_GKS = weights_TK.reshape(G, S, K).transpose(0, 2, 1).astype(x_TD.dtype)
  combine_GSEC = jnp.einsum("gks,gksec->gsec", w_GKS, slot_GKSEC)
  xe_EGCD = jax.lax.with_sharding_constraint(
      jnp.einsum("gsec,gsd->egcd", dispatch_GSEC, x_GSD), by_expert)
  if isinstance(ffn, ms.SwiGLU):
    h = jax.nn.silu(jnp.einsum("egcd,edf->egcf", xe_EGCD, ffn.gate_EDF.astype(x_TD.dtype)))
    h = h * jnp.einsum("egcd,edf->egcf", xe_EGCD, ffn.up_EDF.astype(x_TD.dtype))
    ye_EGCF = jnp.einsum("egcf,efd->egcd", h, ffn.down_EFD.astype(x_TD.dtype))
  else:
    ye_EGCF = jnp.einsum("egcd,edf->egcf", xe_EGCD, ffn.w_EDF.astype(x_TD.dtype))
  ye_EGCF = jax.lax.with_sharding_constraint(ye_EGCF, by_expert)
  y_GSF = jax.lax.with_sharding_constraint(
      jnp.einsum("gsec,egcf->gsf", combine_GSEC, ye_EGCF), groups)
  dropped = jnp.sum((mask_GKSE > 0) & ~keep_GKSE, dtype=jnp.int32)
  return y_GSF.reshape(T, -1), dropped


def gshard_layer(params, x_BSD, cfg, mesh, capacity_factor):
  """The layer around `gshard_moe`: router, top-k, aux losses, dispatch; (y_BSD, aux)."""
  B, S, D = x_BSD.shape
  x_TD = x_BSD.reshape(B * S, D)
  logits_TE = jnp.einsum("td,de->te", x_TD.astype(jnp.float32), params.router_DE)
  routing = ms.top_k_routing(logits_TE, cfg.top_k)
  y_TD, dropped = gshard_moe(x_TD, params.experts, routing.experts_TK, routing.weights_TK,
                             mesh=mesh, capacity_factor=capacity_factor)
  aux_loss = (cfg.load_balance_coef * ms.load_balancing_loss(routing)
              + cfg.z_loss_coef * ms.router_z_loss(logits_TE))
  return y_TD.reshape(B, S, -1), dict(aux_loss=aux_loss, dropped_items=dropped,
                                      rounds=jnp.ones((), jnp.int32))
