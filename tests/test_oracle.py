"""Checks the float64 oracle itself: hand-derived outputs and finite-difference gradients."""

import dataclasses
import math

import numpy as np
import oracle
import pytest
from cases import TiedFFN

import moe_shard as ms


def test_linear_matches_hand_derived_values():
  # Expert 0 is the identity, expert 1 twice the identity, expert 2 swaps the two features.
  w_EDF = np.stack([np.eye(2), 2 * np.eye(2), np.eye(2)[::-1]])
  x_TD = np.array([[1.0, 2.0], [3.0, -1.0], [5.0, 7.0]])
  experts_TK = np.array([[0, 1], [2, 2], [-1, 3]])  # a duplicate; two invalid ids (E = 3)
  weights_TK = np.array([[0.25, 0.5], [0.5, 0.25], [1.0, 1.0]])
  want = np.array(
    [
      0.25 * np.array([1.0, 2.0]) + 0.5 * np.array([2.0, 4.0]),
      0.75 * np.array([-1.0, 3.0]),
      [0.0, 0.0],
    ]
  )
  np.testing.assert_array_equal(oracle.moe(x_TD, w_EDF, experts_TK, weights_TK), want)
  # Top-1 int[T] ids and weights=None (ones).
  np.testing.assert_array_equal(
    oracle.moe(x_TD, w_EDF, np.array([1, 0, 5])), [[2.0, 4.0], [3.0, -1.0], [0.0, 0.0]]
  )


def test_swiglu_matches_hand_derived_values():
  # D = F = 1: y = w * silu(x g) * (x u) * d.
  g, u, d, x, a = 0.7, -1.3, 2.0, 1.5, 0.4
  silu = lambda z: z / (1.0 + math.exp(-z))
  ffn = ms.SwiGLU(np.full((2, 1, 1), g), np.full((2, 1, 1), u), np.full((2, 1, 1), d))
  want = a * silu(x * g) * (x * u) * d
  got = oracle.moe(np.array([[x]]), ffn, np.array([[1]]), np.array([[a]]))
  np.testing.assert_allclose(got, [[want]], rtol=1e-15)


def test_biased_ffns_match_hand_derived_values():
  # D = F = 1, one token routed to expert 1 of 2 with weight a; every bias on.
  x, a = 1.5, 0.4
  gelu = lambda z: 0.5 * z * (1.0 + math.erf(z / math.sqrt(2.0)))
  sigmoid = lambda z: 1.0 / (1.0 + math.exp(-z))
  c = lambda v: np.full((2, 1, 1), v)  # a [2, 1, 1] matrix leaf
  b = lambda v: np.full((2, 1), v)  # a [2, 1] bias leaf
  biases = dict(gate_b_EF=b(0.2), up_b_EF=b(0.1), down_b_ED=b(-0.3))
  cases = {
    "linear": (ms.Linear(c(0.7), b(0.2)), 1.5 * 0.7 + 0.2),
    "gelu": (
      ms.GeluMLP(c(0.7), c(2.0), up_b_EF=b(0.2), down_b_ED=b(-0.3)),
      gelu(1.25) * 2.0 - 0.3,
    ),
    "swiglu": (
      ms.SwiGLU(c(0.7), c(-1.3), c(2.0), **biases),
      1.25 * sigmoid(1.25) * (-1.85) * 2.0 - 0.3,
    ),
    "geglu": (ms.GeGLU(c(0.7), c(-1.3), c(2.0), **biases), gelu(1.25) * (-1.85) * 2.0 - 0.3),
    # g = 1.25 clamps to the limit 1.0, u = 2.05 clips to 1.0.
    "clamped_swiglu": (
      ms.ClampedSwiGLU(c(0.7), c(1.3), c(2.0), **biases, alpha=1.702, limit=1.0),
      (1.0 + 1.0) * 1.0 * sigmoid(1.702) * 2.0 - 0.3,
    ),
  }
  for name, (ffn, out) in cases.items():
    got = oracle.moe(np.array([[x]]), ffn, np.array([[1]]), np.array([[a]]))
    np.testing.assert_allclose(got, [[a * out]], rtol=1e-15, err_msg=name)


def test_unknown_ffn_class_is_refused():
  @dataclasses.dataclass
  class Unknown:
    w_EDF: np.ndarray

  with pytest.raises(ValueError, match=r"oracle: no model of the FFN Unknown \(known: "):
    oracle.moe(np.zeros((1, 1)), Unknown(np.zeros((1, 1, 1))), np.zeros((1, 1), int))


def _numerical_grad(f, a, h=1e-6):
  """Central differences of scalar f with respect to every element of array `a`."""
  grad = np.zeros_like(a)
  for i in np.ndindex(a.shape):
    old = a[i]
    a[i] = old + h
    up = f()
    a[i] = old - h
    down = f()
    a[i] = old
    grad[i] = (up - down) / (2 * h)
  return grad


# Each FFN class with (+b) and without its biases; the clamp of "clamped_swiglu" (limit 0.8)
# is active on both sides for some items (pre-activations here have std ~1.7).
FFNS = {
  "linear": ms.Linear,
  "swiglu": ms.SwiGLU,
  "gelu": ms.GeluMLP,
  "geglu": ms.GeGLU,
  "clamped_swiglu": ms.ClampedSwiGLU,
}
GRAD_FFNS = ["array", "tied", *FFNS, *(f"{name}+b" for name in FFNS)]


def _ffn_leaves(ffn, rng, E, D, F):
  """(leaves: {name: f64 array} that the finite differences perturb, make_w, out width)."""
  if ffn == "array":
    leaves = {"w_EDF": rng.normal(size=(E, D, F))}
    return leaves, lambda: leaves["w_EDF"], F
  if ffn == "tied":
    leaves = {"w_EDD": rng.normal(size=(E, D, D))}
    return leaves, lambda: TiedFFN(**leaves), D
  name, bias = ffn.removesuffix("+b"), ffn.endswith("+b")
  cls, sizes = FFNS[name], dict(E=E, D=D, F=F)
  leaves = {}
  for f in dataclasses.fields(cls):
    if f.metadata.get("static") or (f.default is None and not bias):
      continue
    leaves[f.name] = rng.normal(size=[sizes[c] for c in f.name.rsplit("_", 1)[1]])
  static = dict(limit=0.8, alpha=1.3) if name == "clamped_swiglu" else {}
  return leaves, lambda: cls(**leaves, **static), F if name == "linear" else D


@pytest.mark.parametrize("ffn", GRAD_FFNS)
def test_oracle_grads_match_finite_differences(ffn):
  rng = np.random.default_rng(0)
  T, D, F, E = 4, 3, 2, 4
  x = rng.normal(size=(T, D))
  leaves, make_w, out = _ffn_leaves(ffn, rng, E, D, F)
  # Distinct, duplicate and invalid ids; expert 3 gets nothing.
  experts = np.array([[0, 2], [1, 1], [-1, 2], [4, 0]])
  weights = rng.uniform(0.2, 1.0, size=(T, 2))
  ct = rng.normal(size=(T, out))

  def loss():
    return float(np.sum(oracle.moe(x, make_w(), experts, weights) * ct))

  dx, dw, dweights = oracle.moe_grads(x, make_w(), experts, weights, ct)
  dw_leaves = {"w_EDF": dw} if ffn == "array" else {k: getattr(dw, k) for k in leaves}
  assert type(dw) is type(make_w())
  tol = dict(rtol=1e-6, atol=1e-8)  # central differences: O(h^2) + roundoff/h ~ 1e-10
  np.testing.assert_allclose(dx, _numerical_grad(loss, x), **tol)
  for k, leaf in leaves.items():
    np.testing.assert_allclose(dw_leaves[k], _numerical_grad(loss, leaf), **tol, err_msg=k)
    np.testing.assert_array_equal(dw_leaves[k][3], 0.0)  # the unused expert
    assert np.abs(dw_leaves[k]).max() > 1e-3, k
  np.testing.assert_allclose(dweights, _numerical_grad(loss, weights), **tol)
  assert dweights[2, 0] == 0.0 and dweights[3, 0] == 0.0  # invalid ids
  assert np.all(dweights[[0, 1, 2], [0, 1, 1]] != 0.0)


def test_clamped_swiglu_clamps_in_the_gradient_cases():
  """The clamp is exercised by `test_oracle_grads_match_finite_differences`: some gate and
  up pre-activations lie past the limit, so the clamped branches' zero gradients count."""
  rng = np.random.default_rng(0)
  x = rng.normal(size=(4, 3))
  leaves, make_w, _ = _ffn_leaves("clamped_swiglu+b", rng, 4, 3, 2)
  w = make_w()
  g = np.einsum("td,edf->tef", x, leaves["gate_EDF"]) + leaves["gate_b_EF"]
  u = np.einsum("td,edf->tef", x, leaves["up_EDF"]) + leaves["up_b_EF"]
  assert np.any(g > w.limit) and np.any(g < w.limit)
  assert np.any(u > w.limit) and np.any(u < -w.limit) and np.any(np.abs(u) < w.limit)
