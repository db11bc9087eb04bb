"""The routers against the NumPy float64 oracle (`router_oracle.py`), and their errors.

`top_k_routing` with softmax and sigmoid scores, group-limited selection, a selection bias
and scaling; `expert_choice_routing`; the routing groups; the config fields. The layer
through every dispatch is in `test_router_dispatch.py`.
"""

import dataclasses
import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import router_oracle as oracle
from cases import trace

import moe_shard as ms
from moe_shard.routing import route_in_groups

top_k_routing = jax.jit(
  ms.top_k_routing,
  static_argnums=1,
  static_argnames=(
    "normalize",
    "score_func",
    "num_groups",
    "top_k_groups",
    "scaling",
    "normalize_p",
  ),
)
expert_choice_routing = jax.jit(ms.expert_choice_routing, static_argnums=1)


def normal(T, E, seed, scale=1.0):
  return jnp.asarray(np.random.default_rng(seed).normal(size=(T, E)) * scale, jnp.float32)


def assert_routing_equals_oracle(got, want):
  """Same experts exactly; weights and scores to float32 accuracy."""
  w, experts, s = want
  np.testing.assert_array_equal(got.experts_TK, experts)
  np.testing.assert_allclose(got.weights_TK, w, rtol=2e-6, atol=1e-7)
  np.testing.assert_allclose(got.probs_TE, s, rtol=2e-6, atol=1e-7)
  assert got.weights_TK.dtype == got.probs_TE.dtype == jnp.float32
  assert got.experts_TK.dtype == jnp.int32


# --------------------------------------------------------------------------- top-k

# Ties: logits from {0, 1, 2} give equal scores, exactly, in float32 and float64 alike.
TIES = jnp.asarray(np.random.default_rng(7).integers(0, 3, size=(12, 8)), jnp.float32)

TOP_K_CASES = {
  # name: (logits, k, keyword arguments)
  "softmax": (normal(10, 8, 0), 2, {}),
  "softmax_k1": (normal(10, 8, 1), 1, {}),
  "softmax_unnormalized": (normal(10, 8, 2), 3, dict(normalize=False)),
  # DBRX's moe_normalize_expert_weights: the weights over their p-norm.
  "softmax_p2": (normal(10, 8, 2), 3, dict(normalize_p=2.0)),
  "sigmoid_p3_grouped": (
    normal(10, 8, 4, 2.0),
    2,
    dict(score_func="sigmoid", normalize_p=3.0, num_groups=4, top_k_groups=2, scaling=2.0),
  ),
  "softmax_p2_unnormalized": (normal(10, 8, 2), 3, dict(normalize=False, normalize_p=2.0)),
  "ties": (TIES, 3, {}),
  "ties_grouped": (TIES, 2, dict(num_groups=4, top_k_groups=2)),
  "single_group": (normal(10, 8, 3), 2, dict(num_groups=1, top_k_groups=1)),
  "all_groups_kept": (normal(10, 8, 3), 2, dict(num_groups=4, top_k_groups=4)),
  "sigmoid": (normal(10, 8, 4, 2.0), 2, dict(score_func="sigmoid")),
  "sigmoid_unnormalized": (normal(10, 8, 4, 2.0), 2, dict(score_func="sigmoid", normalize=False)),
  "groups_softmax": (normal(10, 16, 5), 3, dict(num_groups=4, top_k_groups=2)),
  "groups_of_one": (normal(10, 8, 6), 2, dict(num_groups=8, top_k_groups=3)),
  "k_fills_kept_groups": (
    normal(10, 16, 8),
    4,
    dict(num_groups=4, top_k_groups=1, score_func="sigmoid"),
  ),
  "deepseek_like": (
    normal(10, 16, 9, 2.0),
    4,
    dict(
      score_func="sigmoid",
      num_groups=4,
      top_k_groups=2,
      bias_E=np.linspace(-0.3, 0.3, 16, dtype=np.float32),
      scaling=2.5,
    ),
  ),
  "bf16": (
    normal(10, 8, 10, 2.0).astype(jnp.bfloat16),
    2,
    dict(score_func="sigmoid", num_groups=2, top_k_groups=1),
  ),
}


@pytest.mark.parametrize("name", TOP_K_CASES)
def test_top_k_routing_matches_oracle(name):
  logits_TE, k, kwargs = TOP_K_CASES[name]
  got = top_k_routing(logits_TE, k, **kwargs)
  assert_routing_equals_oracle(got, oracle.top_k(logits_TE, k, **kwargs))


def test_top_k_defaults_are_bit_identical_to_softmax_top_k():
  # What `top_k_routing` computed before score functions, groups and bias existed.
  @functools.partial(jax.jit, static_argnums=(1, 2))
  def before(logits_TE, k, normalize):
    probs_TE = jax.nn.softmax(logits_TE.astype(jnp.float32), axis=-1)
    weights_TK, experts_TK = jax.lax.top_k(probs_TE, k)
    if normalize:
      weights_TK = weights_TK / jnp.sum(weights_TK, axis=-1, keepdims=True)
    return weights_TK, experts_TK, probs_TE

  for normalize in (True, False):
    logits_TE = normal(64, 16, 11, 3.0)
    for got in (
      top_k_routing(logits_TE, 4, normalize=normalize),
      top_k_routing(logits_TE, 4, normalize=normalize, normalize_p=1.0),
    ):
      for a, b in zip(
        (got.weights_TK, got.experts_TK, got.probs_TE), before(logits_TE, 4, normalize)
      ):
        np.testing.assert_array_equal(a, b)


def test_normalized_softmax_top_k_is_softmax_over_the_top_k_logits():
  # gpt-oss routes by `softmax(top_k(logits))`: exp(l_i) / sum_top-k exp(l_j), which is the
  # top-k softmax probabilities rescaled to sum to 1 (the partition function cancels).
  logits_TE = np.asarray(normal(16, 8, 20, 3.0), np.float64)
  top_TK = -np.sort(-logits_TE, axis=1)[:, :2]
  want = np.exp(top_TK - top_TK.max(1, keepdims=True))
  want /= want.sum(axis=1, keepdims=True)
  got = top_k_routing(jnp.asarray(logits_TE, jnp.float32), 2)
  np.testing.assert_allclose(got.weights_TK, want, rtol=2e-6, atol=1e-7)


def test_ties_go_to_the_lowest_index():
  # Groups of 2: groups 0, 1 and 2 score the same (identical logits), group 3 less. Keeping
  # 2 groups keeps 0 and 1; experts 0 and 2 then tie on the highest score: both taken,
  # 0 first. Plain top-3 over the row takes 0, 2, 4 (three equal maxima, lowest first).
  logits_TE = jnp.asarray([[1.0, 0.0, 1.0, 0.0, 1.0, 0.0, 0.0, 0.0]])
  r = top_k_routing(logits_TE, 2, num_groups=4, top_k_groups=2)
  np.testing.assert_array_equal(r.experts_TK, [[0, 2]])
  np.testing.assert_array_equal(top_k_routing(logits_TE, 3).experts_TK, [[0, 2, 4]])
  # Expert choice: equal probabilities everywhere; each expert takes the first 2 tokens.
  r = expert_choice_routing(jnp.zeros((4, 3)), 2)
  np.testing.assert_array_equal(r.experts_TK, [[0, 1, 2], [0, 1, 2], [-1] * 3, [-1] * 3])


def test_all_groups_kept_is_plain_top_k():
  logits_TE = normal(10, 8, 3)
  grouped = top_k_routing(logits_TE, 2, num_groups=4, top_k_groups=4)
  plain = top_k_routing(logits_TE, 2)
  for a, b in zip(jax.tree.leaves(grouped), jax.tree.leaves(plain)):
    np.testing.assert_array_equal(a, b)


def test_groups_limit_the_choice():
  # Without the group limit token 0 would take experts 0 and 7, from groups 0 and 3; with
  # one group kept it takes both experts of its best group by top-2 sum (group 1: 4 + 4).
  logits_TE = jnp.asarray([[9.0, -9.0, 4.0, 4.0, 0.0, 0.0, -9.0, 8.0]])
  np.testing.assert_array_equal(top_k_routing(logits_TE, 2).experts_TK, [[0, 7]])
  r = top_k_routing(logits_TE, 2, num_groups=4, top_k_groups=1, score_func="sigmoid")
  np.testing.assert_array_equal(r.experts_TK, [[2, 3]])


@pytest.mark.parametrize("score_func", ["softmax", "sigmoid"])
def test_bias_changes_the_selection_not_the_weights(score_func):
  logits_TE = normal(16, 8, 12)
  plain = top_k_routing(logits_TE, 2, score_func=score_func)
  # A bias that makes expert 5 everyone's first choice and expert 6 everyone's second.
  bias_E = jnp.zeros(8).at[5].set(3.0).at[6].set(1.5)  # scores lie in [0, 1]
  biased = top_k_routing(logits_TE, 2, score_func=score_func, bias_E=bias_E)
  np.testing.assert_array_equal(biased.experts_TK, np.tile([5, 6], (16, 1)))
  assert not np.array_equal(plain.experts_TK, biased.experts_TK)
  np.testing.assert_array_equal(biased.probs_TE, plain.probs_TE)  # the unbiased scores
  s = np.asarray(plain.probs_TE, np.float64)[:, [5, 6]]
  np.testing.assert_allclose(biased.weights_TK, s / s.sum(axis=1, keepdims=True), rtol=1e-6)
  assert_routing_equals_oracle(
    biased, oracle.top_k(logits_TE, 2, score_func=score_func, bias_E=bias_E)
  )

  # No gradient reaches the bias through the selection; the logits get one.
  def loss(logits_TE, bias_E):
    return jnp.sum(
      ms.top_k_routing(logits_TE, 2, score_func=score_func, bias_E=bias_E).weights_TK[:, 0]
    )

  d_logits, d_bias = jax.jit(jax.grad(loss, argnums=(0, 1)))(logits_TE, bias_E)
  np.testing.assert_array_equal(d_bias, 0.0)
  assert float(jnp.abs(d_logits).max()) > 1e-3


def test_sigmoid_scores_that_underflow_give_zero_weights_not_nan():
  r = top_k_routing(jnp.full((2, 4), -200.0), 2, score_func="sigmoid")
  np.testing.assert_array_equal(r.weights_TK, 0.0)


# --------------------------------------------------------------------------- expert choice

EC_CASES = {
  "random": (normal(12, 4, 13), 3),
  "ties": (TIES[:, :4], 5),
  "capacity_is_all_tokens": (normal(6, 4, 14), 6),
  "capacity_one": (normal(6, 8, 15), 1),
  "bf16": (normal(12, 4, 16, 2.0).astype(jnp.bfloat16), 3),
}


@pytest.mark.parametrize("name", EC_CASES)
def test_expert_choice_matches_oracle(name):
  logits_TE, capacity = EC_CASES[name]
  got = expert_choice_routing(logits_TE, capacity)
  assert_routing_equals_oracle(got, oracle.expert_choice(logits_TE, capacity))
  # Every expert takes exactly `capacity` tokens; a token 0 to E of them.
  np.testing.assert_array_equal(ms.expert_load(got.experts_TK, logits_TE.shape[1]), capacity)


def test_expert_choice_router_capacity_per_group():
  # T_group = 6 tokens, top_k 2, E 4: ceil(1.0 * 6 * 2 / 4) = 3 tokens per expert (None
  # means 1.0); 1.5 gives ceil(4.5) = 5; 3.0 would be 9, clamped to the 6 tokens.
  cfg = ms.MoEConfig(d_model=4, d_ff=4, num_experts=4, top_k=2, router="expert_choice")
  logits_TE = normal(6, 4, 17)
  for factor, want in [(None, 3), (1.5, 5), (3.0, 6)]:
    c = dataclasses.replace(cfg, capacity_factor=factor)
    r = ms.ROUTERS["expert_choice"](logits_TE, c)
    np.testing.assert_array_equal(ms.expert_load(r.experts_TK, 4), want)


def test_route_in_groups_equals_routing_each_group():
  cfg = ms.MoEConfig(d_model=4, d_ff=4, num_experts=4, top_k=2, router="expert_choice")
  logits_TE = normal(12, 4, 18)
  got = jax.jit(lambda l: route_in_groups(ms.ROUTERS["expert_choice"], l, cfg, 3))(logits_TE)
  want = oracle.in_groups(oracle.expert_choice, logits_TE, 3, 2)  # ceil(4 * 2 / 4) = 2
  assert_routing_equals_oracle(got, want)
  whole = oracle.expert_choice(logits_TE, 6)
  assert not np.array_equal(want[1], whole[1])  # grouping matters for expert choice


# --------------------------------------------------------------------------- balance losses


def test_sequence_balance_loss_matches_oracle():
  logits_TE = normal(12, 8, 19, 2.0)
  r = top_k_routing(logits_TE, 2, score_func="sigmoid")
  got = jax.jit(ms.sequence_balance_loss, static_argnums=1)(r, 4)
  np.testing.assert_allclose(got, oracle.sequence_loss(r.experts_TK, r.probs_TE, 4), rtol=1e-6)
  # Balanced in every sequence (each expert chosen once per 4 tokens x 2 slots): 1.0.
  experts_TK = np.array([[0, 1], [2, 3], [4, 5], [6, 7]] * 3)
  balanced = ms.Routing(jnp.ones((12, 2)), jnp.asarray(experts_TK, jnp.int32), r.probs_TE)
  np.testing.assert_allclose(ms.sequence_balance_loss(balanced, 4), 1.0, rtol=1e-6)
  np.testing.assert_allclose(
    ms.load_balancing_loss(balanced), oracle.switch_loss(experts_TK, r.probs_TE), rtol=1e-6
  )


# --------------------------------------------------------------------------- errors

TOP_K_ERRORS = [
  (
    dict(score_func="relu"),
    ValueError,
    "top_k_routing: score_func must be one of ('softmax', 'sigmoid') (got 'relu')",
  ),
  (dict(num_groups=3), ValueError, "top_k_routing: E (8) must be divisible by num_groups (3)"),
  (dict(num_groups=0), ValueError, "top_k_routing: num_groups must be in [1, 8] (got 0)"),
  (dict(num_groups=2.0), TypeError, "top_k_routing: num_groups must be an int (got float)"),
  (
    dict(num_groups=4, top_k_groups=0),
    ValueError,
    "top_k_routing: top_k_groups must be in [1, 4] (got 0)",
  ),
  (
    dict(num_groups=4, top_k_groups=5),
    ValueError,
    "top_k_routing: top_k_groups must be in [1, 4] (got 5)",
  ),
  (
    dict(num_groups=4, top_k_groups=1),
    ValueError,
    "top_k_routing: k must be <= top_k_groups * E / num_groups = 2 (got 3)",
  ),
  (
    dict(bias_E=np.zeros(7, np.float32)),
    ValueError,
    "top_k_routing: bias_E must have shape (8,) (got (7,))",
  ),
  (
    dict(bias_E=np.zeros((1, 8), np.float32)),
    ValueError,
    "top_k_routing: bias_E must be 1-D (got shape (1, 8))",
  ),
  (
    dict(bias_E=np.zeros(8, np.int32)),
    TypeError,
    "top_k_routing: bias_E must have a floating-point dtype (got int32)",
  ),
  (dict(scaling=0.0), ValueError, "top_k_routing: scaling must be finite and > 0 (got 0.0)"),
  (dict(scaling="2"), TypeError, "top_k_routing: scaling must be a real number (got '2')"),
  (
    dict(normalize_p=0.5),
    ValueError,
    "top_k_routing: normalize_p must be >= 1, the p of a norm (got 0.5)",
  ),
  (
    dict(normalize_p=float("inf")),
    ValueError,
    "top_k_routing: normalize_p must be finite and > 0 (got inf)",
  ),
  (
    dict(normalize_p="2"),
    TypeError,
    "top_k_routing: normalize_p must be a real number (got '2')",
  ),
]


@pytest.mark.parametrize(
  "kwargs, error, match",
  TOP_K_ERRORS,
  ids=[",".join(f"{k}={v!r}"[:24] for k, v in c[0].items()) for c in TOP_K_ERRORS],
)
def test_top_k_routing_bad_arguments(kwargs, error, match):
  with pytest.raises(error, match="^" + re.escape(match)):
    trace(ms.top_k_routing, np.zeros((5, 8), np.float32), 3, **kwargs)


@pytest.mark.parametrize(
  "capacity, error, match",
  [
    (0, ValueError, "expert_choice_routing: capacity must be in [1, 5] (got 0)"),
    (6, ValueError, "expert_choice_routing: capacity must be in [1, 5] (got 6)"),
    (2.0, TypeError, "expert_choice_routing: capacity must be an int (got float)"),
  ],
)
def test_expert_choice_bad_capacity(capacity, error, match):
  with pytest.raises(error, match="^" + re.escape(match)):
    trace(ms.expert_choice_routing, np.zeros((5, 8), np.float32), capacity)
  with pytest.raises(
    ValueError, match=re.escape("expert_choice_routing: logits_TE must be 2-D (got shape (5,))")
  ):
    trace(ms.expert_choice_routing, np.zeros((5,), np.float32), 1)


def test_sequence_balance_loss_bad_seq_len():
  r = ms.Routing(
    np.ones((6, 2), np.float32), np.zeros((6, 2), np.int32), np.ones((6, 4), np.float32)
  )
  with pytest.raises(
    ValueError,
    match=re.escape("sequence_balance_loss: tokens (6) must be divisible by seq_len (4)"),
  ):
    trace(ms.sequence_balance_loss, r, 4)


CONFIG = dict(d_model=4, d_ff=4, num_experts=8, top_k=2)
BAD_CONFIGS = [
  (
    dict(score_func="tanh"),
    ValueError,
    "MoEConfig: score_func must be one of ('softmax', 'sigmoid') (got 'tanh')",
  ),
  (dict(num_groups=0), ValueError, "MoEConfig: num_groups must be >= 1 (got 0)"),
  (
    dict(num_groups=3),
    ValueError,
    "MoEConfig: num_experts (8) must be divisible by num_groups (3)",
  ),
  (
    dict(num_groups=4, top_k_groups=5),
    ValueError,
    "MoEConfig: top_k_groups must be <= num_groups (4) (got 5)",
  ),
  (dict(num_groups=4, top_k_groups=0), ValueError, "MoEConfig: top_k_groups must be >= 1 (got 0)"),
  (
    dict(num_groups=8, top_k_groups=1),
    ValueError,
    "MoEConfig: top_k must be <= top_k_groups * num_experts / num_groups (1) (got 2)",
  ),
  (
    dict(routed_scaling=-1.0),
    ValueError,
    "MoEConfig: routed_scaling must be finite and > 0 (got -1.0)",
  ),
  (dict(bias_balancing=1), TypeError, "MoEConfig: bias_balancing must be a bool (got 1)"),
  (dict(routing_groups=0), ValueError, "MoEConfig: routing_groups must be >= 1 (got 0)"),
  (
    dict(router="token_choice"),
    ValueError,
    "MoEConfig: router must be one of ('top_k', "
    "'expert_choice') or a callable (got 'token_choice')",
  ),
  (
    dict(router="expert_choice", bias_balancing=True),
    ValueError,
    "MoEConfig: bias_balancing must be False with router 'expert_choice' (a top_k router "
    "field) (got True)",
  ),
  (
    dict(router="expert_choice", score_func="sigmoid"),
    ValueError,
    "MoEConfig: score_func must be 'softmax' with router 'expert_choice' (a top_k router "
    "field) (got 'sigmoid')",
  ),
  (
    dict(router="expert_choice", num_groups=2),
    ValueError,
    "MoEConfig: num_groups must be 1 with router 'expert_choice'",
  ),
  (
    dict(router="expert_choice", normalize_p=2.0),
    ValueError,
    "MoEConfig: normalize_p must be 1.0 with router 'expert_choice'",
  ),
]


@pytest.mark.parametrize(
  "overrides, error, match",
  BAD_CONFIGS,
  ids=[",".join(f"{k}={v!r}" for k, v in c[0].items()) for c in BAD_CONFIGS],
)
def test_config_rejects(overrides, error, match):
  with pytest.raises(error, match="^" + re.escape(match)):
    ms.MoEConfig(**CONFIG, **overrides)


def test_config_defaults_and_deepseek_like():
  cfg = ms.MoEConfig(**CONFIG)
  assert (
    cfg.score_func,
    cfg.num_groups,
    cfg.top_k_groups,
    cfg.routed_scaling,
    cfg.bias_balancing,
    cfg.routing_groups,
  ) == ("softmax", 1, None, 1.0, False, None)
  ds = ms.MoEConfig(
    **CONFIG,
    score_func="sigmoid",
    num_groups=4,
    top_k_groups=2,
    routed_scaling=2.5,
    bias_balancing=True,
  )
  assert hash(ds) == hash(dataclasses.replace(ds))
  assert ms.moe_param_shapes(ds).router_bias == jax.ShapeDtypeStruct((8,), jnp.float32)
  assert ms.moe_param_specs(ds).router_bias == jax.sharding.PartitionSpec(None)
  assert ms.moe_param_shapes(cfg).router_bias is None
  assert ms.moe_param_specs(cfg).router_bias is None


def test_num_routing_groups():
  cfg = ms.MoEConfig(**CONFIG, router="expert_choice")
  mesh = jax.make_mesh((2, 4), (ms.DATA, ms.EXPERT))
  assert ms.num_routing_groups(cfg, 24) == 1
  assert ms.num_routing_groups(cfg, 24, mesh) == 8
  assert ms.num_routing_groups(cfg, 20, mesh) == 1  # tokens do not divide the mesh
  assert ms.num_routing_groups(dataclasses.replace(cfg, routing_groups=3), 24, mesh) == 3
  with pytest.raises(
    ValueError,
    match=re.escape("moe_layer: tokens B*S (20) must be divisible by routing_groups (3)"),
  ):
    ms.num_routing_groups(dataclasses.replace(cfg, routing_groups=3), 20)
