"""Routing: which experts each token goes to, with what weight, and the auxiliary losses.

Router math runs in float32 whatever the dtype of the logits. Nothing here knows about
meshes or dispatch.

`ROUTERS` is the router table: a name maps to a function `(logits_TE, cfg) -> Routing`
(`MoEConfig.router` takes a name from it or such a function). A new router is one function
and one entry. `drop_over_capacity` turns a routing into a capacity-limited one.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from moe_shard import _checks
from moe_shard.local import inverse_permutation, sort_by_expert


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Routing:
  """The result of a router, a pytree that passes through `jax.jit`.

  Attributes:
    weights_TK: f32[T, K] combine weights of each token's experts.
    experts_TK: i32[T, K] expert ids, highest probability first.
    probs_TE: f32[T, E] softmax of the router logits.
  """

  weights_TK: jax.Array
  experts_TK: jax.Array
  probs_TE: jax.Array


def top_k_routing(logits_TE, k, *, normalize=True) -> Routing:
  """Picks the k highest-probability experts for each token.

  Args:
    logits_TE: f[T, E] router logits (any float dtype; the math runs in float32).
    k: experts per token, a Python int with 1 <= k <= E.
    normalize: rescale the k weights of each token to sum to 1 (default True). When False
      the weights are the softmax probabilities themselves.

  Returns:
    Routing(weights_TK: f32[T, K], experts_TK: i32[T, K], probs_TE: f32[T, E]).

  Raises:
    TypeError: `logits_TE` is not a float array or `k` is not an int.
    ValueError: `logits_TE` is not 2-D or `k` is outside [1, E].
  """
  logits_TE = _checks.float_array("top_k_routing", "logits_TE", logits_TE, ndim=2)
  _, E = logits_TE.shape
  _checks.int_in_range("top_k_routing", "k", k, 1, E)
  probs_TE = jax.nn.softmax(logits_TE.astype(jnp.float32), axis=-1)
  weights_TK, experts_TK = jax.lax.top_k(probs_TE, k)
  if normalize:
    weights_TK = weights_TK / jnp.sum(weights_TK, axis=-1, keepdims=True)
  return Routing(weights_TK, experts_TK.astype(jnp.int32), probs_TE)


def expert_load(experts_TK, num_experts):
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


def load_balancing_loss(routing: Routing):
  """Returns the Switch/GShard load-balancing loss `E * sum_e f_e * P_e`.

  `f_e` is the fraction of the T*K (token, slot) items routed to expert e and `P_e` the mean
  router probability of expert e. It is 1.0 when routing is perfectly balanced and E when
  every token goes to one expert with probability 1. Gradients flow through `P_e` only.

  Args:
    routing: a `Routing` from `top_k_routing`.

  Returns:
    f32[] the loss.
  """
  T, E = routing.probs_TE.shape
  f_E = expert_load(routing.experts_TK, E).astype(jnp.float32) / routing.experts_TK.size
  P_E = jnp.mean(routing.probs_TE.astype(jnp.float32), axis=0)
  return E * jnp.sum(jax.lax.stop_gradient(f_E) * P_E)


def router_z_loss(logits_TE):
  """Returns the router z-loss `mean_t logsumexp(logits_TE[t])^2` (ST-MoE), in float32.

  Args:
    logits_TE: f[T, E] router logits.

  Returns:
    f32[] the loss.
  """
  logits_TE = _checks.float_array("router_z_loss", "logits_TE", logits_TE, ndim=2)
  z_T = jax.nn.logsumexp(logits_TE.astype(jnp.float32), axis=-1)
  return jnp.mean(jnp.square(z_T))


def top_k_router(logits_TE, cfg):
  """The "top_k" router: `top_k_routing(logits_TE, cfg.top_k, normalize=cfg.normalize_top_k)`."""
  return top_k_routing(logits_TE, cfg.top_k, normalize=cfg.normalize_top_k)


ROUTERS = {"top_k": top_k_router}


def get_router(router):
  """The router function of a `MoEConfig.router` value (a name of `ROUTERS` or a function)."""
  return ROUTERS[router] if isinstance(router, str) else router


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
  order_I, load_E, valid_I = sort_by_expert(ids_I, num_experts)  # stable
  start_E = jnp.cumsum(load_E) - load_E
  rank_I = inverse_permutation(order_I)  # sorted position of each item
  pos_I = rank_I - start_E[jnp.where(valid_I, ids_I, 0)]  # position in its expert's queue
  dropped_I = valid_I & (pos_I >= capacity)
  kept_I = jnp.where(dropped_I, -1, ids_I)
  return kept_I.reshape(T, K), dropped_I.reshape(T, K)
