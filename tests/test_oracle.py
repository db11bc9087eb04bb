"""Checks the float64 oracle itself: hand-derived outputs and finite-difference gradients."""

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


@pytest.mark.parametrize("ffn", ["linear", "swiglu", "tied"])
def test_oracle_grads_match_finite_differences(ffn):
  rng = np.random.default_rng(0)
  T, D, F, E = 4, 3, 2, 4
  x = rng.normal(size=(T, D))
  if ffn == "linear":
    leaves = [rng.normal(size=(E, D, F))]
    make_w = lambda: leaves[0]
  elif ffn == "tied":
    leaves = [rng.normal(size=(E, D, D))]
    make_w = lambda: TiedFFN(leaves[0])
  else:
    leaves = [rng.normal(size=(E, D, F)), rng.normal(size=(E, D, F)), rng.normal(size=(E, F, D))]
    make_w = lambda: ms.SwiGLU(*leaves)
  # Distinct, duplicate and invalid ids; expert 3 gets nothing.
  experts = np.array([[0, 2], [1, 1], [-1, 2], [4, 0]])
  weights = rng.uniform(0.2, 1.0, size=(T, 2))
  ct = rng.normal(size=(T, F if ffn == "linear" else D))

  def loss():
    return float(np.sum(oracle.moe(x, make_w(), experts, weights) * ct))

  dx, dw, dweights = oracle.moe_grads(x, make_w(), experts, weights, ct)
  dw_leaves = {
    "linear": lambda: [dw],
    "tied": lambda: [dw.w_EDD],
    "swiglu": lambda: [dw.gate_EDF, dw.up_EDF, dw.down_EFD],
  }[ffn]()
  tol = dict(rtol=1e-6, atol=1e-8)  # central differences: O(h^2) + roundoff/h ~ 1e-10
  np.testing.assert_allclose(dx, _numerical_grad(loss, x), **tol)
  for leaf, got in zip(leaves, dw_leaves):
    np.testing.assert_allclose(got, _numerical_grad(loss, leaf), **tol)
    np.testing.assert_array_equal(got[3], 0.0)  # the unused expert
  np.testing.assert_allclose(dweights, _numerical_grad(loss, weights), **tol)
  assert dweights[2, 0] == 0.0 and dweights[3, 0] == 0.0  # invalid ids
  assert np.all(dweights[[0, 1, 2], [0, 1, 1]] != 0.0)
