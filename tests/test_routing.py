"""Routing: top-k selection, combine weights and the auxiliary losses, against NumPy."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from cases import trace

import moe_shard as ms

# Jitted once: one compile per shape instead of one per primitive in eager mode.
top_k_routing = jax.jit(ms.top_k_routing, static_argnums=1, static_argnames="normalize")
load_balancing_loss = jax.jit(ms.load_balancing_loss)
router_z_loss = jax.jit(ms.router_z_loss)


def _softmax64(logits_TE):
  z = np.asarray(logits_TE).astype(np.float64)
  z = np.exp(z - z.max(axis=-1, keepdims=True))
  return z / z.sum(axis=-1, keepdims=True)


def _distinct_logits(T, E, seed):
  """f32[T, E] logits with no ties: each row a random permutation of 0.5 * range(E)."""
  rng = np.random.default_rng(seed)
  return jnp.asarray(0.5 * np.argsort(rng.random((T, E)), axis=1), jnp.float32)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("k", [1, 3, 6])
def test_top_k_routing_shapes_dtypes_and_choice(k, dtype):
  T, E = 5, 6
  logits_TE = _distinct_logits(T, E, seed=k).astype(dtype)  # 0.5 steps are exact in bf16
  r = top_k_routing(logits_TE, k)
  assert isinstance(r, ms.Routing)
  assert r.weights_TK.shape == (T, k) and r.weights_TK.dtype == jnp.float32
  assert r.experts_TK.shape == (T, k) and r.experts_TK.dtype == jnp.int32
  assert r.probs_TE.shape == (T, E) and r.probs_TE.dtype == jnp.float32
  # Experts are the k largest logits, highest first.
  want_experts = np.argsort(-np.asarray(logits_TE, np.float64), axis=1)[:, :k]
  np.testing.assert_array_equal(r.experts_TK, want_experts)
  probs = _softmax64(logits_TE)
  np.testing.assert_allclose(r.probs_TE, probs, rtol=1e-6, atol=1e-7)
  np.testing.assert_allclose(np.sum(r.weights_TK, axis=1), 1.0, rtol=1e-6)
  picked = np.take_along_axis(probs, want_experts, axis=1)
  np.testing.assert_allclose(r.weights_TK, picked / picked.sum(axis=1, keepdims=True), rtol=1e-6)


def test_top_k_routing_unnormalized_weights_are_the_probabilities():
  logits_TE = _distinct_logits(7, 5, seed=0)
  r = top_k_routing(logits_TE, 2, normalize=False)
  np.testing.assert_array_equal(r.weights_TK, np.take_along_axis(r.probs_TE, r.experts_TK, axis=1))
  np.testing.assert_allclose(
    r.weights_TK, np.take_along_axis(_softmax64(logits_TE), r.experts_TK, axis=1), rtol=1e-6
  )
  assert np.all(np.sum(r.weights_TK, axis=1) < 1.0)


@pytest.mark.parametrize(
  "options",
  [
    {},
    dict(bias_E=np.linspace(-0.1, 0.1, 8)),
    dict(num_groups=4, top_k_groups=2),
    dict(score_func="sigmoid"),
  ],
)
def test_top_k_weights_gradient_is_a_select_not_a_scatter(options):
  """The combine weights reach the scores' gradient through a one-hot select, with no
  scatter in the backward (XLA:TPU's count charges a scatter-add into [T, E] gigabytes),
  and it is the gradient of a gather: d weights[t, k] / d scores[t, e] = [e == experts[t, k]]."""
  logits_TE = _distinct_logits(6, 8, seed=2)
  ct_TK = np.random.default_rng(4).normal(size=(6, 2)).astype(np.float32)
  options = {k: jnp.asarray(v, jnp.float32) if k == "bias_E" else v for k, v in options.items()}
  route = lambda l: ms.top_k_routing(l, 2, normalize=False, **options)
  grad_fn = jax.grad(lambda l: jnp.sum(route(l).weights_TK * ct_TK))
  assert "scatter" not in str(jax.make_jaxpr(grad_fn)(logits_TE))
  experts_TK = np.asarray(route(logits_TE).experts_TK)
  d_scores_TE = np.zeros((6, 8), np.float32)
  np.put_along_axis(d_scores_TE, experts_TK, ct_TK, axis=1)
  if options.get("score_func") == "sigmoid":
    s = 1 / (1 + np.exp(-np.asarray(logits_TE, np.float64)))
    want = d_scores_TE * s * (1 - s)
  else:
    p = _softmax64(logits_TE)
    want = p * (d_scores_TE - np.sum(d_scores_TE * p, axis=1, keepdims=True))
  np.testing.assert_allclose(grad_fn(logits_TE), want, rtol=1e-5, atol=1e-7)


def test_top_k_routing_is_a_pytree_through_jit():
  logits_TE = _distinct_logits(4, 6, seed=1)
  eager = ms.top_k_routing(logits_TE, 2)
  jitted = jax.jit(ms.top_k_routing, static_argnums=1)(logits_TE, 2)
  assert isinstance(jitted, ms.Routing)
  assert len(jax.tree.leaves(jitted)) == 3
  for a, b in zip(jax.tree.leaves(jitted), jax.tree.leaves(eager)):
    np.testing.assert_allclose(a, b, rtol=1e-6)
  # And as an argument.
  loss = jax.jit(ms.load_balancing_loss)(jitted)
  np.testing.assert_allclose(loss, ms.load_balancing_loss(eager), rtol=1e-6)


def test_expert_load_ignores_invalid_ids():
  experts_TK = jnp.array([[0, 2], [2, -1], [4, 2], [1, 0]], jnp.int32)  # E = 4
  np.testing.assert_array_equal(ms.expert_load(experts_TK, 4), [2, 1, 3, 0])
  np.testing.assert_array_equal(ms.expert_load(experts_TK[:, 0], 4), [1, 1, 1, 0])


def _routing(experts_TK, probs_TE):
  probs_TE = jnp.asarray(probs_TE, jnp.float32)
  experts_TK = jnp.asarray(experts_TK, jnp.int32)
  weights_TK = jnp.take_along_axis(probs_TE, experts_TK, axis=1)
  return ms.Routing(weights_TK, experts_TK, probs_TE)


def test_load_balancing_loss_is_one_when_balanced():
  # T = 8 tokens, E = 4, K = 2: every expert gets exactly 4 of the 16 items.
  experts_TK = np.array([[0, 1], [2, 3]] * 4)
  uniform = np.full((8, 4), 0.25)
  assert float(load_balancing_loss(_routing(experts_TK, uniform))) == 1.0
  # f_e = 1/E for all e gives E * sum_e P_e / E = 1 whatever the probabilities.
  skewed = _softmax64(np.random.default_rng(0).normal(size=(8, 4)) * 3)
  np.testing.assert_allclose(load_balancing_loss(_routing(experts_TK, skewed)), 1.0, rtol=1e-6)


def test_load_balancing_loss_is_e_when_all_to_one_expert():
  T, E = 6, 5
  one_hot = np.zeros((T, E))
  one_hot[:, 3] = 1.0
  loss = load_balancing_loss(_routing(np.full((T, 1), 3), one_hot))
  assert float(loss) == E
  # Through the router: logits that put (almost) all the mass on expert 3.
  logits_TE = jnp.asarray(np.where(np.arange(E) == 3, 30.0, 0.0) * np.ones((T, 1)), jnp.float32)
  np.testing.assert_allclose(load_balancing_loss(top_k_routing(logits_TE, 1)), E, rtol=1e-6)


def test_load_balancing_loss_gradient_flows_to_logits():
  T, E, K = 6, 4, 2
  logits_TE = jnp.asarray(np.random.default_rng(1).normal(size=(T, E)), jnp.float32)
  grad = jax.grad(lambda l: load_balancing_loss(top_k_routing(l, K)))(logits_TE)
  # loss = E * sum_e f_e * mean_t p_te with f held constant, so
  # d loss / d logit_ti = E / T * p_ti * (f_i - sum_e f_e p_te).
  r = top_k_routing(logits_TE, K)
  f_E = np.bincount(np.ravel(r.experts_TK), minlength=E) / (T * K)
  p_TE = _softmax64(logits_TE)
  want = E / T * p_TE * (f_E[None, :] - (p_TE @ f_E)[:, None])
  assert np.abs(want).max() > 1e-3
  np.testing.assert_allclose(grad, want, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
def test_router_z_loss_matches_numpy(dtype):
  # Large logits: a naive float32 exp overflows above 88.
  rng = np.random.default_rng(2)
  logits_TE = jnp.asarray(rng.normal(size=(9, 7)) * 4 + 90.0, dtype)
  z = np.asarray(logits_TE).astype(np.float64)
  m = z.max(axis=1)
  lse = m + np.log(np.exp(z - m[:, None]).sum(axis=1))
  got = router_z_loss(logits_TE)
  assert got.dtype == jnp.float32 and got.shape == ()
  np.testing.assert_allclose(got, np.mean(lse**2), rtol=1e-6)
  # d/dlogit_ti mean_t lse_t^2 = 2 lse_t softmax_ti / T
  grad = jax.grad(lambda l: router_z_loss(l))(logits_TE.astype(jnp.float32))
  np.testing.assert_allclose(grad, 2 * lse[:, None] * _softmax64(logits_TE) / 9, rtol=1e-4)


@pytest.mark.parametrize(
  "k, error, match",
  [
    (0, ValueError, "top_k_routing: k must be in [1, 6] (got 0)"),
    (7, ValueError, "top_k_routing: k must be in [1, 6] (got 7)"),
    (-1, ValueError, "top_k_routing: k must be in [1, 6] (got -1)"),
    (2.0, TypeError, "top_k_routing: k must be an int (got float)"),
    (True, TypeError, "top_k_routing: k must be an int (got bool)"),
    (None, TypeError, "top_k_routing: k must be an int (got NoneType)"),
  ],
)
def test_top_k_routing_bad_k(k, error, match):
  logits_TE = jnp.zeros((3, 6), jnp.float32)
  with pytest.raises(error, match=re.escape(match)):
    trace(ms.top_k_routing, logits_TE, k)


@pytest.mark.parametrize(
  "fn, args",
  [
    (ms.top_k_routing, (2,)),
    (ms.router_z_loss, ()),
  ],
  ids=["top_k_routing", "router_z_loss"],
)
@pytest.mark.parametrize(
  "logits, error, match",
  [
    (np.zeros((6,), np.float32), ValueError, "logits_TE must be 2-D (got shape (6,))"),
    (np.zeros((2, 3, 6), np.float32), ValueError, "logits_TE must be 2-D (got shape (2, 3, 6))"),
    (
      np.zeros((3, 6), np.int32),
      TypeError,
      "logits_TE must have a floating-point dtype (got int32)",
    ),
    (np.zeros((3, 6), bool), TypeError, "logits_TE must have a floating-point dtype (got bool)"),
  ],
  ids=["1d", "3d", "int", "bool"],
)
def test_bad_logits(fn, args, logits, error, match):
  with pytest.raises(error, match=re.escape(f"{fn.__name__}: {match}")):
    trace(fn, logits, *args)
