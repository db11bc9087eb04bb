"""The local references against the float64 oracle: outputs and gradients, every routing.

Each implementation is jitted once per (implementation, FFN type, dtype, shape) through
`cases.outputs_and_grads`; the named routings share those compiled functions, since a
routing changes values, not shapes.
"""

import functools

import hypothesis
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import oracle
import pytest
from cases import (
  ROUTINGS,
  assert_close,
  assert_tree_close,
  cotangent,
  feasible,
  make_case,
  outputs,
  outputs_and_grads,
)

import moe_shard as ms
from moe_shard import local

# The same callables every time, so `outputs_and_grads` reuses its compiled functions.
IMPLS = {
  "masked_scan": ms.moe_masked_scan,
  "ragged_dot": ms.moe_ragged_dot,  # gmm_impl="auto": the tiled kernel on CPU
}
GMM_IMPLS = {
  "ragged_dot": functools.partial(ms.moe_ragged_dot, gmm_impl="ragged_dot"),
  "tiled": functools.partial(ms.moe_ragged_dot, gmm_impl="tiled"),
}

# T = 13 does not divide into tiles or devices. E = 16 so that "one_device" (experts on
# device 0 of 8) is 2 experts; k_equals_e needs K = E, kept small.
SHAPE = dict(T=13, D=8, F=12, E=16, K=2)
SHAPE_K_EQUALS_E = dict(T=13, D=8, F=12, E=4, K=4)


def shape_for(routing):
  return SHAPE_K_EQUALS_E if routing == "k_equals_e" else SHAPE


def check_against_oracle(fn, case, dtype, seed=0, err_msg=""):
  """Runs `fn` on `case` and compares y, dx, every leaf of dw and dweights with the oracle."""
  x_TD, w, experts, weights = case
  want_y = oracle.moe(x_TD, w, experts, weights)
  ct = cotangent(want_y.shape, dtype, seed)
  y, (dx, dw, dweights) = outputs_and_grads(fn, x_TD, w, experts, weights, ct)
  want_dx, want_dw, want_dweights = oracle.moe_grads(x_TD, w, experts, weights, ct)
  assert y.dtype == x_TD.dtype and y.shape == want_y.shape, (y.dtype, y.shape)
  assert_close(y, want_y, dtype, f"{err_msg} y")
  assert_close(dx, want_dx, dtype, f"{err_msg} dx")
  assert_tree_close(dw, want_dw, dtype, f"{err_msg} dw")
  if weights is None:
    assert dweights is None
  else:
    assert_close(dweights, want_dweights, dtype, f"{err_msg} dweights")
  return y


@pytest.mark.parametrize("routing", ROUTINGS)
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("ffn", ["linear", "swiglu"])
@pytest.mark.parametrize("impl", list(IMPLS))
def test_matches_oracle(impl, ffn, dtype, routing):
  case = make_case(routing, seed=0, dtype=dtype, ffn=ffn, **shape_for(routing))
  check_against_oracle(IMPLS[impl], case, dtype, err_msg=f"{impl}/{ffn}/{routing}")


@pytest.mark.parametrize("routing", ROUTINGS)
def test_gmm_impls_agree(routing):
  # One matrix per expert is enough to compare the grouped matmuls; SwiGLU through the
  # default ("tiled" on CPU) is covered above.
  case = make_case(routing, seed=1, **shape_for(routing))
  ys = {
    name: check_against_oracle(fn, case, jnp.float32, seed=1, err_msg=name)
    for name, fn in GMM_IMPLS.items()
  }
  assert_close(ys["tiled"], ys["ragged_dot"], jnp.float32)


@st.composite
def moe_problems(draw):
  """(routing, T, D, F, E, K, ffn, seed) with tiny, awkward shapes."""
  E = draw(st.integers(1, 16))
  K = draw(st.integers(1, E))
  # Hypothesis favours the first element of sampled_from: start with the awkward sizes.
  T = draw(st.one_of(st.sampled_from([13, 7, 1]), st.integers(1, 40)))
  D = draw(st.sampled_from([3, 8, 1]))
  F = draw(st.sampled_from([5, 16, 1]))
  routing = draw(st.sampled_from([r for r in reversed(ROUTINGS) if feasible(r, E=E, K=K)]))
  ffn = draw(st.sampled_from(["linear", "swiglu"]))
  seed = draw(st.integers(0, 2**16))
  return routing, dict(T=T, D=D, F=F, E=E, K=K), ffn, seed


@hypothesis.settings(max_examples=10)  # each example is a new shape: a new compile (~3 s)
@hypothesis.given(moe_problems())
def test_matches_oracle_property(problem):
  # The fast path gets outputs and gradients, the masked scan (whose gradients the named
  # cases cover) outputs only.
  routing, shape, ffn, seed = problem
  case = make_case(routing, seed=seed, ffn=ffn, **shape)
  check_against_oracle(
    ms.moe_ragged_dot, case, jnp.float32, seed=seed, err_msg=f"ragged_dot {problem}"
  )
  assert_close(
    outputs(ms.moe_masked_scan, *case), oracle.moe(*case), jnp.float32, f"masked_scan {problem}"
  )


@pytest.mark.parametrize("impl, ffn", [("masked_scan", "swiglu"), ("ragged_dot", "linear")])
def test_top1_ids_without_weights(impl, ffn):
  x_TD, w, experts_TK, _ = make_case("uniform", seed=2, ffn=ffn, **dict(SHAPE, K=1))
  experts_T = experts_TK[:, 0]
  y = check_against_oracle(IMPLS[impl], (x_TD, w, experts_T, None), jnp.float32, seed=2)
  assert y.shape[0] == SHAPE["T"]


@pytest.mark.parametrize("impl", list(IMPLS) + [f"gmm={g}" for g in GMM_IMPLS])
def test_invalid_ids_give_exact_zeros(impl):
  fn = IMPLS.get(impl) or GMM_IMPLS[impl.removeprefix("gmm=")]
  x_TD, w, experts_TK, weights_TK = make_case("uniform", seed=3, **SHAPE)
  E = SHAPE["E"]
  # Every id invalid: -1 would wrap to expert E-1, E would be clamped to E-1 by a gather.
  bad = np.array([-1, E, E + 3, -(2**31), 2**31 - 1], np.int32)
  experts_TK = jnp.asarray(np.resize(bad, experts_TK.shape))
  ct = cotangent((SHAPE["T"], SHAPE["F"]), jnp.float32, 3)
  y, (dx, dw, dweights) = outputs_and_grads(fn, x_TD, w, experts_TK, weights_TK, ct)
  for name, got in [("y", y), ("dx", dx), ("dw", dw), ("dweights", dweights)]:
    np.testing.assert_array_equal(got, 0.0, err_msg=name)


@pytest.mark.parametrize("impl", list(IMPLS))
def test_invalid_slot_keeps_the_valid_slots(impl):
  # Token t routed to (e, invalid) gives exactly weights[t, 0] * expert_e(x[t]); comparing
  # with the oracle (which drops the slot) and with the same token routed to (e, e) with
  # weight 0 on slot 1 catches a leak of expert E-1 or 0.
  x_TD, w, experts_TK, weights_TK = make_case("uniform", seed=4, **SHAPE)
  E = SHAPE["E"]
  experts_TK = experts_TK.at[:, 1].set(jnp.where(jnp.arange(SHAPE["T"]) % 2 == 0, -1, E))
  ct = cotangent((SHAPE["T"], SHAPE["F"]), jnp.float32, 4)
  y, _ = outputs_and_grads(IMPLS[impl], x_TD, w, experts_TK, weights_TK, ct)
  assert_close(y, oracle.moe(x_TD, w, experts_TK[:, :1], weights_TK[:, :1]), jnp.float32)
  y_same, _ = outputs_and_grads(
    IMPLS[impl],
    x_TD,
    w,
    experts_TK.at[:, 1].set(experts_TK[:, 0]),
    weights_TK.at[:, 1].set(0.0),
    ct,
  )
  assert_close(y, y_same, jnp.float32)


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
@pytest.mark.parametrize("impl", list(IMPLS) + [f"gmm={g}" for g in GMM_IMPLS])
def test_nonfinite_token_leaves_others_unchanged(impl, bad):
  fn = IMPLS.get(impl) or GMM_IMPLS[impl.removeprefix("gmm=")]
  for routing in ("uniform", "invalid_ids", "one_expert"):
    x_TD, w, experts_TK, weights_TK = make_case(routing, seed=5, **SHAPE)
    ct = cotangent((SHAPE["T"], SHAPE["F"]), jnp.float32, 5)
    clean, _ = outputs_and_grads(fn, x_TD, w, experts_TK, weights_TK, ct)
    for t in (0, 6):  # token 0 of "invalid_ids" has only invalid ids: its output stays 0
      dirty, _ = outputs_and_grads(fn, x_TD.at[t, 1].set(bad), w, experts_TK, weights_TK, ct)
      others = np.arange(SHAPE["T"]) != t
      np.testing.assert_array_equal(dirty[others], clean[others], err_msg=f"{routing} t={t}")
      if routing == "invalid_ids" and t == 0:
        np.testing.assert_array_equal(dirty[0], 0.0)
      else:
        assert not np.all(np.isfinite(dirty[t])), f"{routing}: token {t} lost its {bad}"


@pytest.mark.parametrize(
  "impl",
  [
    *IMPLS,
    "gmm=tiled",
    pytest.param(
      "gmm=ragged_dot",
      marks=pytest.mark.xfail(
        strict=True,
        reason="lax.ragged_dot on CPU is a masked dense product over all groups: "
        "0 * inf = nan reaches every token (a known limitation, documented in docs/guides/semantics.md)",
      ),
    ),
  ],
)
def test_nonfinite_expert_leaves_other_tokens_unchanged(impl):
  fn = IMPLS.get(impl) or GMM_IMPLS[impl.removeprefix("gmm=")]
  x_TD, w, experts_TK, weights_TK = make_case("uniform", seed=6, **SHAPE)
  ct = cotangent((SHAPE["T"], SHAPE["F"]), jnp.float32, 6)
  e = int(experts_TK[0, 0])
  clean, _ = outputs_and_grads(fn, x_TD, w, experts_TK, weights_TK, ct)
  dirty, _ = outputs_and_grads(fn, x_TD, w.at[e].set(jnp.inf), experts_TK, weights_TK, ct)
  routed = np.any(np.asarray(experts_TK) == e, axis=1)
  assert routed.any() and not routed.all()
  np.testing.assert_array_equal(dirty[~routed], clean[~routed])
  assert not np.all(np.isfinite(dirty[routed]))


def test_jit_matches_eager():
  x_TD, w, experts_TK, weights_TK = make_case("duplicate", seed=7, T=5, D=3, F=4, E=3, K=2)
  eager = ms.moe_masked_scan(x_TD, w, experts_TK, weights_TK)
  jitted = jax.jit(ms.moe_masked_scan)(x_TD, w, experts_TK, weights_TK)
  np.testing.assert_allclose(jitted, eager, rtol=1e-6, atol=1e-6)
  assert_close(jitted, oracle.moe(x_TD, w, experts_TK, weights_TK), jnp.float32)


def test_jit_with_keyword_and_default_arguments():
  x_TD, w, experts_TK, _ = make_case("uniform", seed=7, T=5, D=3, F=4, E=3, K=1)
  experts_T = experts_TK[:, 0]
  fn = jax.jit(ms.moe_ragged_dot, static_argnames="gmm_impl")
  got = fn(x_TD, w, experts=experts_T, gmm_impl="tiled")  # weights defaults to None
  assert_close(got, oracle.moe(x_TD, w, experts_T), jnp.float32)


def test_linear_wrapper_equals_bare_array():
  x_TD, w_EDF, experts_TK, weights_TK = make_case("uniform", seed=8, **SHAPE)
  ct = cotangent((SHAPE["T"], SHAPE["F"]), jnp.float32, 8)
  fn = ms.moe_masked_scan
  y, (dx, dw, _) = outputs_and_grads(fn, x_TD, w_EDF, experts_TK, weights_TK, ct)
  y_lin, (dx_lin, dw_lin, _) = outputs_and_grads(
    fn, x_TD, ms.Linear(w_EDF), experts_TK, weights_TK, ct
  )
  np.testing.assert_array_equal(y_lin, y)
  np.testing.assert_array_equal(dx_lin, dx)
  assert isinstance(dw_lin, ms.Linear)
  np.testing.assert_array_equal(dw_lin.w_EDF, dw)


@pytest.mark.parametrize("D", [4096, 4096 + 128, 7168, 9000])
def test_move_rows_of_wide_rows_in_column_chunks(D):
  """Rows wider than `local.ROW_CHUNK` move in column chunks: the same rows, forward and
  backward (a permutation with a row dropped both ways)."""
  assert local.ROW_CHUNK == 4096
  rng = np.random.default_rng(D)
  x_RD = jnp.asarray(rng.normal(size=(5, D)), jnp.float32)
  to_R = jnp.array([3, 0, 5, 1, 2])  # row 2 goes nowhere (5 is out of [0, 4))
  from_S = jnp.array([1, 3, 4, 0])
  want = np.asarray(x_RD)[[1, 3, 4, 0]]
  np.testing.assert_array_equal(local.move_rows(x_RD, to_R, from_S), want)
  dy_SD = jnp.asarray(rng.normal(size=(4, D)), jnp.float32)
  _, vjp = jax.vjp(lambda x: local.move_rows(x, to_R, from_S), x_RD)
  (dx,) = vjp(dy_SD)
  want_dx = np.zeros((5, D), np.float32)
  want_dx[[1, 3, 4, 0]] = np.asarray(dy_SD)
  np.testing.assert_array_equal(dx, want_dx)
