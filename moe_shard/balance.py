"""Load balance: the load per expert, the auxiliary losses, and the aux-loss-free bias update.

Which loss the layer adds (`aux["load_balance_loss"]`, the router table's `balance_loss`):

  * softmax top-k: `load_balancing_loss`, Switch/GShard's, over all the tokens of the call;
  * sigmoid top-k: `sequence_balance_loss`, DeepSeek-V3's sequence-wise loss, over each
    sequence of the batch (scores normalized per token, as sigmoid scores do not sum to 1);
  * expert choice: none (0.0): every expert takes exactly its capacity by construction.

All of them count the experts the router *selected* (`experts_TK`, including the effect of
a selection bias, before any capacity drop) and are 1.0 when that selection is balanced.

Aux-loss-free balancing (DeepSeek-V3, arXiv:2412.19437 sec. 2.1.2): a per-expert bias added
to the scores for selection only, moved after each step against the load with
`update_router_bias`. It is state, not a trained weight: exclude `router_bias` from the
optimizer (docs/guides/routers.md).
"""

from __future__ import annotations

import dataclasses
import numbers
from collections.abc import Mapping
from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from moe_shard import _checks

if TYPE_CHECKING:  # both modules import this one
  from moe_shard.params import MoEParams
  from moe_shard.routing import Routing


def expert_load(
  experts_TK: Int[Array, "T K"] | Int[Array, " T"], num_experts: int
) -> Int[Array, " E"]:
  """Counts the (token, slot) items routed to each expert; ids outside [0, E) are not counted.

  Args:
    experts_TK: int[T, K] (or int[T]) expert ids.
    num_experts: E.

  Returns:
    i32[E] items per expert.
  """
  ids = jnp.ravel(experts_TK)
  # A one-hot sum, not a scatter: it partitions over sharded ids on any mesh. one_hot of an
  # id outside [0, E) is all zeros.
  return jnp.sum(jax.nn.one_hot(ids, num_experts, dtype=jnp.int32), axis=0)


def load_balancing_loss(routing: Routing) -> Float[Array, ""]:
  """Returns the Switch/GShard load-balancing loss `E * sum_e f_e * P_e`.

  `f_e` is the fraction of the T*K (token, slot) items routed to expert e and `P_e` the mean
  router probability of expert e. It is 1.0 when routing is perfectly balanced and E when
  every token goes to one expert with probability 1. Gradients flow through `P_e` only.

  Args:
    routing: a `Routing` from `top_k_routing` (softmax scores).

  Returns:
    f32[] the loss.
  """
  E = routing.probs_TE.shape[1]
  f_E = expert_load(routing.experts_TK, E).astype(jnp.float32) / routing.experts_TK.size
  P_E = jnp.mean(routing.probs_TE.astype(jnp.float32), axis=0)
  return E * jnp.sum(jax.lax.stop_gradient(f_E) * P_E)


def sequence_balance_loss(routing: Routing, seq_len: int) -> Float[Array, ""]:
  """Returns DeepSeek-V3's sequence-wise balance loss, averaged over the sequences.

  For each sequence of S tokens (the T tokens are T / S sequences, one after another):

      f_e = E / (K * S) * (tokens of the sequence that selected e)
      P_e = mean over the sequence of s_e / sum_j s_j        (the token's normalized scores)
      loss = sum_e f_e * P_e

  1.0 when every sequence is balanced. Gradients flow through `P_e` only. Meant for sigmoid
  scores (any non-negative scores work). Multiply by a small coefficient (DeepSeek-V3 used
  1e-4, alongside the bias update).

  Args:
    routing: a `Routing` over T tokens.
    seq_len: S, a Python int dividing T.

  Returns:
    f32[] the loss.

  Raises:
    ValueError: S does not divide T.
  """
  T, E = routing.probs_TE.shape
  K = routing.experts_TK.shape[1]
  S = _checks.int_in_range("sequence_balance_loss", "seq_len", seq_len, 1, T)
  _checks.divisible("sequence_balance_loss", "tokens", T, "seq_len", S)
  ids_BI = routing.experts_TK.reshape(T // S, S * K)  # I = S*K items of one sequence
  count_BE = jnp.sum(jax.nn.one_hot(ids_BI, E, dtype=jnp.int32), axis=1)
  f_BE = (E / (K * S)) * count_BE.astype(jnp.float32)
  s_TE = routing.probs_TE.astype(jnp.float32)
  s_TE = s_TE / jnp.maximum(jnp.sum(s_TE, axis=-1, keepdims=True), jnp.finfo(jnp.float32).tiny)
  P_BE = jnp.mean(s_TE.reshape(T // S, S, E), axis=1)
  return jnp.mean(jnp.sum(jax.lax.stop_gradient(f_BE) * P_BE, axis=-1))


def router_z_loss(logits_TE: Float[Array, "T E"]) -> Float[Array, ""]:
  """Returns the router z-loss `mean_t logsumexp(logits_TE[t])^2` (ST-MoE), in float32.

  Args:
    logits_TE: f[T, E] router logits.

  Returns:
    f32[] the loss.
  """
  logits_TE = _checks.float_array("router_z_loss", "logits_TE", logits_TE, ndim=2)
  z_T = jax.nn.logsumexp(logits_TE.astype(jnp.float32), axis=-1)
  return jnp.mean(jnp.square(z_T))


def update_router_bias(
  params: MoEParams, aux: Mapping[str, Array], rate: float | Float[Array, ""]
) -> MoEParams:
  """Returns `params` with the selection bias moved against the load (aux-loss-free balance).

      router_bias -= rate * sign(load - mean(load))        load = aux["expert_load"]

  An overloaded expert's bias falls and an underloaded one's rises, by `rate` per call
  (DeepSeek-V3's bias update speed gamma, 1e-3 there). Call it after each training step with
  that step's `aux`; for stacked layers (params and aux with a leading layer axis, e.g. from
  `lax.scan`) each layer moves by its own load. `aux["expert_load"]` counts the items each
  expert computed (after any capacity drop). Works under `jax.jit`.

  Args:
    params: `MoEParams` built with `MoEConfig(bias_balancing=True)`: `router_bias` f32[E]
      (or f32[L, E] stacked).
    aux: the `aux` dict of `moe_layer`, or any dict with `expert_load`: int[E] ([L, E]).
    rate: the step, a real >= 0 or a f32[] scalar (e.g. from a schedule).

  Returns:
    `MoEParams`, `router_bias` updated (float32), every other leaf the same object.

  Raises:
    ValueError: params has no router_bias, or its shape differs from the load's.
    TypeError: rate is not a real number or scalar array.
  """
  fn = "update_router_bias"
  bias = getattr(params, "router_bias", None)
  if bias is None:
    raise ValueError(
      f"{fn}: params.router_bias must be an array (got None): build the "
      f"params with MoEConfig(bias_balancing=True)"
    )
  if not isinstance(aux, dict) or "expert_load" not in aux:
    raise ValueError(
      f"{fn}: aux must be a dict with 'expert_load', the aux of moe_layer "
      f"(got {type(aux).__name__})"
    )
  load = jnp.asarray(aux["expert_load"]).astype(jnp.float32)
  if load.shape != tuple(bias.shape):
    raise ValueError(
      f"{fn}: aux['expert_load'] must have the shape of params.router_bias "
      f"{tuple(bias.shape)} (got {load.shape})"
    )
  if isinstance(rate, numbers.Real) and not isinstance(rate, bool):
    rate = _checks.real_field(fn, "rate", rate, positive=False)
  elif getattr(rate, "shape", None) != ():
    raise TypeError(f"{fn}: rate must be a real number or a scalar array (got {rate!r})")
  sign = jnp.sign(load - jnp.mean(load, axis=-1, keepdims=True))
  return dataclasses.replace(params, router_bias=bias.astype(jnp.float32) - rate * sign)
