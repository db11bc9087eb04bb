"""An independent NumPy float64 oracle for MoE outputs and their gradients.

    y[t] = sum_j weights[t, j] * expert(w[experts[t, j]], x[t])

A plain Python loop over tokens t and slots j, in float64, sharing no computation with
`moe_shard` (its dataclasses only hold the gradients of an FFN pytree):

  * a bare array `w_EDF` is one matrix per expert, `expert(w_DF, x_D) = x_D @ w_DF`;
  * a `SwiGLU(gate_EDF, up_EDF, down_EFD)` (or anything with those attributes) is
    `expert = (silu(x @ gate) * (x @ up)) @ down`;
  * a dataclass with one leaf `w_EDD` (`cases.TiedFFN`) is `expert = tanh(x @ w) @ w`,
    one leaf in two matmuls.

An expert id outside [0, E) contributes zero. The gradients of `sum(y * ct)` are written
out by hand (no autodiff); `tests/test_oracle.py` checks them against finite differences.
"""

from __future__ import annotations

import dataclasses

import numpy as np

import moe_shard as ms


def f64(a):
  """Returns `a` (any array, including bfloat16) as a float64 NumPy array."""
  return np.asarray(a).astype(np.float64)


def _sigmoid(z):
  return 0.5 * (1.0 + np.tanh(0.5 * z))  # no overflow for large |z|


def _leaves(w):
  """Returns ("linear", (w_EDF,)), ("swiglu", (gate_EDF, up_EDF, down_EFD)) or ("tied",
  (w_EDD,)) in float64."""
  if hasattr(w, "w_EDD"):
    return "tied", (f64(w.w_EDD),)
  if hasattr(w, "gate_EDF"):
    return "swiglu", (f64(w.gate_EDF), f64(w.up_EDF), f64(w.down_EFD))
  if hasattr(w, "w_EDF"):  # ms.Linear
    return "linear", (f64(w.w_EDF),)
  return "linear", (f64(w),)


def _routing(experts, weights):
  """Returns experts_TK: int64[T, K] and weights_TK: f64[T, K] (ones when weights is None)."""
  experts = np.asarray(experts).astype(np.int64)
  T = experts.shape[0]
  experts_TK = experts.reshape(T, -1)
  weights_TK = (
    np.ones(experts_TK.shape) if weights is None else f64(weights).reshape(experts_TK.shape)
  )
  return experts_TK, weights_TK


def moe(x, w, experts, weights=None):
  """Returns y: f64[T, F] (f64[T, D] for SwiGLU) by a loop over tokens and slots.

  Args:
    x: f[T, D] tokens.
    w: f[E, D, F], `ms.Linear` or `ms.SwiGLU`.
    experts: int[T] or int[T, K] expert ids; ids outside [0, E) contribute zero.
    weights: f[T, K] (the shape of `experts`) or None for ones (default).
  """
  kind, leaves = _leaves(w)
  x_TD = f64(x)
  experts_TK, weights_TK = _routing(experts, weights)
  T, K = experts_TK.shape
  E = leaves[0].shape[0]
  y = np.zeros((T, leaves[-1].shape[-1]))
  for t in range(T):
    for j in range(K):
      e = experts_TK[t, j]
      if not 0 <= e < E:
        continue
      if kind == "linear":
        (w_EDF,) = leaves
        out = x_TD[t] @ w_EDF[e]
      elif kind == "tied":
        (w_EDD,) = leaves
        out = np.tanh(x_TD[t] @ w_EDD[e]) @ w_EDD[e]
      else:
        gate_EDF, up_EDF, down_EFD = leaves
        g = x_TD[t] @ gate_EDF[e]
        out = (g * _sigmoid(g) * (x_TD[t] @ up_EDF[e])) @ down_EFD[e]
      y[t] += weights_TK[t, j] * out
  return y


def moe_grads(x, w, experts, weights, ct):
  """Returns the gradients of `sum(moe(x, w, experts, weights) * ct)`, by hand.

  Args:
    x, w, experts, weights: as in `moe` (weights may be None).
    ct: f[T, F] cotangent of the output.

  Returns:
    (dx: f64[T, D], dw: the structure of `w` with float64 leaves, dweights: f64 of the shape
    of `experts`, or None when weights is None).
  """
  kind, leaves = _leaves(w)
  x_TD = f64(x)
  ct_TF = f64(ct)
  experts_TK, weights_TK = _routing(experts, weights)
  T, K = experts_TK.shape
  E = leaves[0].shape[0]
  dx_TD = np.zeros_like(x_TD)
  dleaves = [np.zeros_like(leaf) for leaf in leaves]
  dweights_TK = np.zeros(experts_TK.shape)
  for t in range(T):
    for j in range(K):
      e = experts_TK[t, j]
      if not 0 <= e < E:
        continue
      a = weights_TK[t, j]
      dout = a * ct_TF[t]
      if kind == "linear":
        (w_EDF,) = leaves
        out = x_TD[t] @ w_EDF[e]
        dx_TD[t] += w_EDF[e] @ dout
        dleaves[0][e] += np.outer(x_TD[t], dout)
      elif kind == "tied":
        (w_EDD,) = leaves
        h = np.tanh(x_TD[t] @ w_EDD[e])
        out = h @ w_EDD[e]
        dz = (w_EDD[e] @ dout) * (1.0 - h * h)
        dx_TD[t] += w_EDD[e] @ dz
        dleaves[0][e] += np.outer(x_TD[t], dz) + np.outer(h, dout)
      else:
        gate_EDF, up_EDF, down_EFD = leaves
        g = x_TD[t] @ gate_EDF[e]
        u = x_TD[t] @ up_EDF[e]
        s = _sigmoid(g)
        h = g * s * u
        out = h @ down_EFD[e]
        dh = down_EFD[e] @ dout
        dg = dh * u * s * (1.0 + g * (1.0 - s))  # silu'(g) = s (1 + g (1 - s))
        du = dh * g * s
        dx_TD[t] += gate_EDF[e] @ dg + up_EDF[e] @ du
        dleaves[0][e] += np.outer(x_TD[t], dg)
        dleaves[1][e] += np.outer(x_TD[t], du)
        dleaves[2][e] += np.outer(h, dout)
      dweights_TK[t, j] = out @ ct_TF[t]
  if kind == "tied":
    dw = dataclasses.replace(w, w_EDD=dleaves[0])
  elif hasattr(w, "gate_EDF"):
    dw = ms.SwiGLU(*dleaves)
  elif hasattr(w, "w_EDF"):
    dw = ms.Linear(*dleaves)
  else:
    dw = dleaves[0]
  dweights = None if weights is None else dweights_TK.reshape(np.shape(weights))
  return dx_TD, dw, dweights
