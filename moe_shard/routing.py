"""Routing: which experts each token goes to and with what weight; the router table.

Router math runs in float32 whatever the dtype of the logits. Nothing here knows about
meshes or dispatch.

Two routers, each a pure function:

  * `top_k_routing`: each token picks its k experts (softmax or sigmoid scores, optionally
    DeepSeek-V3's group-limited selection and a selection-only bias);
  * `expert_choice_routing`: each expert picks its `capacity` tokens (Zhou et al. 2022), so a
    token gets 0..E experts; "not chosen" is expert id -1, which every dispatch ignores.

Ties go to the lowest index, as `lax.top_k` breaks them: between equal scores the expert
(or, under expert choice, the token; under group-limited routing, the group) with the lower
index is chosen.

`ROUTERS` is the router table: a name maps to a `Router`, a function
`(logits_TE, cfg, *, bias_E=None) -> Routing` with the facts the layer needs beside it (its
balance loss, whether it applies the capacity itself). `MoEConfig.router` takes a name from
it or such a function. A router sees the tokens of one *routing group* (see
`route_groups.num_routing_groups`): for a per-token router such as top-k the grouping changes
nothing; expert choice ranks the tokens of its group. `drop_over_capacity` turns a
routing into a capacity-limited one.
"""

from __future__ import annotations

import dataclasses
import fractions
import math
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int

from moe_shard import _checks
from moe_shard.balance import load_balancing_loss, sequence_balance_loss
from moe_shard.local import inverse_permutation, sort_by_expert

if TYPE_CHECKING:  # config.py imports this module
  from moe_shard.config import MoEConfig

# Score functions of `top_k_routing`: float32 logits -> float32 scores, per token.
SCORE_FUNCS = {
  "softmax": lambda logits_TE: jax.nn.softmax(logits_TE, axis=-1),
  "sigmoid": jax.nn.sigmoid,
}


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Routing:
  """The result of a router, a pytree that passes through `jax.jit`.

  Attributes:
    weights_TK: f32[T, K] combine weights of each token's experts (0 for an id of -1).
    experts_TK: i32[T, K] expert ids: for top-k, highest selection score first; for expert
      choice K = E and slot e holds e if expert e chose the token, else -1.
    probs_TE: f32[T, E] the router's scores, without any selection bias: softmax
      probabilities, or sigmoid scores (which need not sum to 1).
  """

  weights_TK: Float[Array, "T K"]
  experts_TK: Int[Array, "T K"]
  probs_TE: Float[Array, "T E"]


def _pick(a_TE, idx_TK):
  """`a[t, idx[t, k]]` as a one-hot select and a sum over E (exact: one element plus zeros)."""
  hit_TKE = idx_TK[:, :, None] == jnp.arange(a_TE.shape[1], dtype=idx_TK.dtype)
  return jnp.sum(jnp.where(hit_TKE, a_TE[:, None, :], jnp.zeros((), a_TE.dtype)), axis=-1)


# The routers' picks of k scores per token: their values as `lax.top_k` and a gather give
# them, their derivatives through `_pick`, whose transpose is a select. The transpose of a
# gather (and of `lax.top_k`'s values) is a scatter-add of T * K scalars into [T, E]: compiled
# for v5e, the layer's forward+backward at 4096 tokens per chip and E=8 accessed 8.0 GB of
# HBM with it and 3.7 GB without it, by XLA's count (docs/guides/tpu_gpu.md).
@jax.custom_jvp
def _top_k_values(a_TE, idx_TK, values_TK):
  """`values_TK` (`lax.top_k(a_TE, k)`'s, bit for bit), differentiated through `_pick`."""
  return values_TK


@_top_k_values.defjvp
def _top_k_values_jvp(primals, tangents):
  _, idx_TK, values_TK = primals
  return values_TK, _pick(tangents[0], idx_TK)


@jax.custom_jvp
def _take_columns(a_TE, idx_TK):
  return jnp.take_along_axis(a_TE, idx_TK, axis=1)


@_take_columns.defjvp
def _take_columns_jvp(primals, tangents):
  a_TE, idx_TK = primals
  return _take_columns(a_TE, idx_TK), _pick(tangents[0], idx_TK)


def top_k_routing(
  logits_TE: Float[Array, "T E"],
  k: int,
  *,
  normalize: bool = True,
  score_func: str = "softmax",
  num_groups: int = 1,
  top_k_groups: int | None = None,
  bias_E: Float[Array, " E"] | None = None,
  scaling: float = 1.0,
  normalize_p: float = 1.0,
) -> Routing:
  """Picks the k highest-scoring experts for each token.

      scores_TE = score_func(logits_TE)                       (float32)
      select_TE = scores_TE + bias_E                          (selection only)
      group-limited (num_groups G > 1): the E experts form G groups of E / G consecutive ids;
        a token ranks its groups by the sum of the top-2 select scores in each (the top-1
        when a group has one expert) and keeps its `top_k_groups` best (DeepSeek-V3);
      experts_TK = the k largest select scores in the kept groups, highest first;
      weights_TK = scores_TE[experts_TK]  (unbiased), / their p-norm if normalize, * scaling.

  The defaults are softmax top-k with normalized weights. DeepSeek-V3 is
  `score_func="sigmoid", num_groups=8, top_k_groups=4, bias_E=..., scaling=2.5` with k = 8
  of E = 256. The bias changes which experts are chosen, never their weights; it gets no
  gradient through the selection. Ties go to the lowest index (module docstring).

  Args:
    logits_TE: f[T, E] router logits (any float dtype; the math runs in float32).
    k: experts per token, a Python int with 1 <= k <= top_k_groups * E / num_groups.
    normalize: divide the k weights of each token by their `normalize_p`-norm
      `(sum_j |w_j|^p)^(1/p)` (default True; with p = 1 they sum to 1). When False the
      weights are the scores themselves (times scaling).
    score_func: "softmax" (default) or "sigmoid".
    num_groups: G expert groups (default 1: no group limit); must divide E.
    top_k_groups: groups each token keeps, 1 <= top_k_groups <= G (default None: all G).
    bias_E: None (default) or f[E] selection bias, added to the scores for selection only.
    scaling: factor on the combine weights, a real > 0 (default 1.0).
    normalize_p: p of the norm `normalize` divides by, a real >= 1 (default 1.0: the sum;
      DBRX's `moe_normalize_expert_weights`). Ignored when `normalize` is False.

  Returns:
    Routing(weights_TK: f32[T, K], experts_TK: i32[T, K], probs_TE: f32[T, E] the scores).

  Raises:
    TypeError: `logits_TE` or `bias_E` is not a float array, or `k`, `num_groups`,
      `top_k_groups` is not an int.
    ValueError: `logits_TE` is not 2-D, `bias_E` not of shape [E], an unknown `score_func`,
      G does not divide E, `top_k_groups` outside [1, G], `k` outside
      [1, top_k_groups * E / G], `scaling` not finite and > 0, `normalize_p` not finite
      and >= 1.
  """
  fn = "top_k_routing"
  logits_TE = _checks.float_array(fn, "logits_TE", logits_TE, ndim=2)
  E = logits_TE.shape[1]
  _checks.int_in_range(fn, "k", k, 1, E)
  _checks.choice_field(fn, "score_func", score_func, tuple(SCORE_FUNCS))
  G = _checks.int_in_range(fn, "num_groups", num_groups, 1, E)
  _checks.divisible(fn, "E", E, "num_groups", G)
  kept = G if top_k_groups is None else _checks.int_in_range(fn, "top_k_groups", top_k_groups, 1, G)
  if k > kept * (E // G):
    raise ValueError(
      f"{fn}: k must be <= top_k_groups * E / num_groups = {kept * (E // G)} (got {k})"
    )
  if bias_E is not None:
    bias_E = _checks.float_array(fn, "bias_E", bias_E, ndim=1)
    if bias_E.shape != (E,):
      raise ValueError(f"{fn}: bias_E must have shape ({E},) (got {tuple(bias_E.shape)})")
  scaling = _checks.real_field(fn, "scaling", scaling, positive=True)
  normalize_p = check_normalize_p(fn, normalize_p)

  scores_TE = SCORE_FUNCS[score_func](logits_TE.astype(jnp.float32))
  select_TE = scores_TE if bias_E is None else scores_TE + bias_E.astype(jnp.float32)
  if kept < G:
    select_TE = _limit_to_groups(select_TE, G, kept)
  weights_TK, experts_TK = jax.lax.top_k(jax.lax.stop_gradient(select_TE), k)
  weights_TK = _top_k_values(select_TE, experts_TK, weights_TK)
  if bias_E is not None or kept < G:
    weights_TK = _take_columns(scores_TE, experts_TK)
  if normalize:
    # tiny: a token whose k sigmoid scores all underflow gets zero weights, not NaN. A
    # softmax's k largest sum to >= k / E, so there this divides by the norm itself. The
    # scores are >= 0, so for p = 1 the norm is their sum.
    tiny = jnp.finfo(jnp.float32).tiny
    if normalize_p == 1.0:
      norm_T1 = jnp.maximum(jnp.sum(weights_TK, axis=-1, keepdims=True), tiny)
    else:
      power_T1 = jnp.sum(jnp.abs(weights_TK) ** normalize_p, axis=-1, keepdims=True)
      norm_T1 = jnp.maximum(power_T1, tiny) ** (1.0 / normalize_p)
    weights_TK = weights_TK / norm_T1
  if scaling != 1.0:
    weights_TK = weights_TK * scaling
  return Routing(weights_TK, experts_TK.astype(jnp.int32), scores_TE)


def check_normalize_p(fn: str, p: float) -> float:
  """Returns `p` as a float, raising unless it is a finite real >= 1 (a norm's p)."""
  p = _checks.real_field(fn, "normalize_p", p, positive=True)
  if p < 1.0:
    raise ValueError(f"{fn}: normalize_p must be >= 1, the p of a norm (got {p!r})")
  return p


def _limit_to_groups(select_TE, num_groups, kept):
  """`select_TE` with -inf outside each token's `kept` best groups (top-2 sum per group)."""
  T, E = select_TE.shape
  M = E // num_groups  # experts per group
  select_TGM = select_TE.reshape(T, num_groups, M)
  group_TG = jnp.sum(jax.lax.top_k(select_TGM, min(2, M))[0], axis=-1)
  _, groups_TJ = jax.lax.top_k(group_TG, kept)  # J = kept groups
  keep_TG = jnp.any(groups_TJ[:, :, None] == jnp.arange(num_groups), axis=1)
  return jnp.where(keep_TG[:, :, None], select_TGM, -jnp.inf).reshape(T, E)


def expert_choice_routing(logits_TE: Float[Array, "T E"], capacity: int) -> Routing:
  """Lets each expert pick the `capacity` tokens that score it highest (expert choice).

      probs_TE = softmax(logits_TE) over experts             (float32)
      expert e takes the `capacity` tokens t with the largest probs_TE[t, e]
      experts_TE[t, e] = e if e took t, else -1;  weights_TE = probs_TE where taken, else 0

  So every expert computes exactly `capacity` tokens, and a token gets 0 to E experts (0:
  only the shared experts and the residual reach it). Ties go to the lower token index. The
  result depends on which tokens are ranked together: the layer routes each routing group
  on its own (`route_groups.num_routing_groups`).

  Args:
    logits_TE: f[T, E] router logits of the tokens of one group (the math runs in float32).
    capacity: tokens each expert takes, a Python int with 1 <= capacity <= T.

  Returns:
    Routing(weights_TK: f32[T, E], experts_TK: i32[T, E] (-1: not chosen), probs_TE).

  Raises:
    TypeError: `logits_TE` is not a float array or `capacity` is not an int.
    ValueError: `logits_TE` is not 2-D or `capacity` is outside [1, T].
  """
  fn = "expert_choice_routing"
  logits_TE = _checks.float_array(fn, "logits_TE", logits_TE, ndim=2)
  T, E = logits_TE.shape
  C = _checks.int_in_range(fn, "capacity", capacity, 1, T)
  probs_TE = jax.nn.softmax(logits_TE.astype(jnp.float32), axis=-1)
  _, tokens_EC = jax.lax.top_k(probs_TE.T, C)
  experts_EC = jnp.broadcast_to(jnp.arange(E, dtype=jnp.int32)[:, None], (E, C))
  experts_TE = jnp.full((T, E), -1, jnp.int32).at[tokens_EC, experts_EC].set(experts_EC)
  weights_TE = jnp.where(experts_TE >= 0, probs_TE, 0.0)
  return Routing(weights_TE, experts_TE, probs_TE)


def capacity(capacity_factor: float, tokens: int, k: int, num_experts: int) -> int:
  """Returns `ceil(capacity_factor * tokens * k / num_experts)`, the items an expert takes.

  Computed exactly on the decimal value of `capacity_factor` (so 1.1 * 10 is 11, not 12).
  At least 1 whenever tokens >= 1. The layer's capacity (`MoEConfig.capacity`, over the
  tokens of a call), expert choice's (over the tokens of a routing group) and the GShard
  benchmark baseline's (over the tokens of a group) all use it.
  """
  c = fractions.Fraction(repr(float(capacity_factor)))
  return math.ceil(c * tokens * k / num_experts)


# --------------------------------------------------------------------------- router table


def top_k_router(logits_TE, cfg, *, bias_E=None):
  """The "top_k" router: `top_k_routing` with the config's fields (top_k, normalize_top_k,
  normalize_p, score_func, num_groups, top_k_groups, routed_scaling) and the layer's
  selection bias."""
  return top_k_routing(
    logits_TE,
    cfg.top_k,
    normalize=cfg.normalize_top_k,
    score_func=cfg.score_func,
    num_groups=cfg.num_groups,
    top_k_groups=cfg.top_k_groups,
    bias_E=bias_E,
    scaling=cfg.routed_scaling,
    normalize_p=cfg.normalize_p,
  )


def expert_choice_router(logits_TE, cfg):
  """The "expert_choice" router over the tokens of one routing group (T_group of them).

  Capacity `capacity(capacity_factor, T_group, top_k, E)` (capacity_factor None means 1.0),
  at most T_group: on average each token gets `top_k * capacity_factor` experts.
  """
  T, E = logits_TE.shape
  factor = 1.0 if cfg.capacity_factor is None else cfg.capacity_factor
  return expert_choice_routing(logits_TE, min(capacity(factor, T, cfg.top_k, E), T))


def top_k_balance_loss(routing, cfg, seq_len):
  """Softmax: `load_balancing_loss` over the call; sigmoid: `sequence_balance_loss`."""
  if cfg.score_func == "sigmoid":
    return sequence_balance_loss(routing, seq_len)
  return load_balancing_loss(routing)


def batch_balance_loss(routing, cfg, seq_len):
  """`load_balancing_loss` over the call (the default for a user's router)."""
  del cfg, seq_len
  return load_balancing_loss(routing)


def no_balance_loss(routing, cfg, seq_len):
  """0.0: a router balanced by construction."""
  del routing, cfg, seq_len
  return jnp.zeros((), jnp.float32)


@dataclasses.dataclass(frozen=True)
class Router:
  """An entry of the router table; calling it calls `fn`.

  Attributes:
    fn: `(logits_TE, cfg, *, bias_E=None) -> Routing` over the tokens of one routing group.
      `bias_E` (f32[E], no gradient) is passed only when `cfg.bias_balancing`.
    balance_loss: `(routing, cfg, seq_len) -> f32[]`, the layer's `load_balance_loss`
      (default: `load_balancing_loss`).
    applies_capacity: the router applies `cfg.capacity_factor` itself, per routing group,
      and the layer does not drop over capacity (default False).
  """

  fn: Callable[..., Routing]
  balance_loss: Callable[..., Float[Array, ""]] = batch_balance_loss
  applies_capacity: bool = False

  def __call__(self, logits_TE: Float[Array, "T E"], cfg: MoEConfig, **kwargs: Any) -> Routing:
    return self.fn(logits_TE, cfg, **kwargs)


ROUTERS: dict[str, Router] = {
  "top_k": Router(top_k_router, balance_loss=top_k_balance_loss),
  "expert_choice": Router(
    expert_choice_router, balance_loss=no_balance_loss, applies_capacity=True
  ),
}


def get_router(router):
  """The `Router` of a `MoEConfig.router` value (a name of `ROUTERS` or a function)."""
  if isinstance(router, str):
    return ROUTERS[router]
  return router if isinstance(router, Router) else Router(router)


def route_in_groups(router, logits_TE, cfg, groups, **kwargs):
  """Runs `router` on each of `groups` equal runs of consecutive tokens; one Routing of T.

  Args:
    router: a router function `(logits_TE, cfg, **kwargs) -> Routing`.
    logits_TE: f32[T, E], T divisible by `groups`.
    cfg: `MoEConfig`.
    groups: G, a Python int; group g is tokens [g * T / G, (g + 1) * T / G).
    **kwargs: passed to every call (e.g. bias_E).
  """
  if groups == 1:
    return router(logits_TE, cfg, **kwargs)
  T, E = logits_TE.shape
  routing = jax.vmap(lambda l_TE: router(l_TE, cfg, **kwargs))(
    logits_TE.reshape(groups, T // groups, E)
  )
  return jax.tree.map(lambda a: a.reshape(T, *a.shape[2:]), routing)


def drop_over_capacity(
  experts_TK: Int[Array, "T K"], num_experts: int, capacity: int
) -> tuple[Int[Array, "T K"], Bool[Array, "T K"]]:
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
