"""An independent NumPy float64 oracle for MoE outputs and their gradients.

    y[t] = sum_j weights[t, j] * expert(w[experts[t, j]], x[t])

A plain Python loop over tokens t and slots j, in float64, sharing no computation with
`moe_shard` (its FFN dataclasses are only read, by class name and field name). Each leaf
that is None (a bias that is off) is left out; b terms below are then 0:

  * a bare array `w_EDF`, or `Linear(w_EDF, b_EF)`: `expert = x @ w + b`;
  * `GeluMLP(up_EDF, down_EFD, up_b_EF, down_b_ED)`: `gelu(x @ up + ub) @ down + db`, with
    the exact GELU `z * Phi(z)`;
  * the gated FFNs `SwiGLU`, `GeGLU`, `ClampedSwiGLU` (gate_EDF, up_EDF, down_EFD and
    gate_b_EF, up_b_EF, down_b_ED): `h(x @ gate + gb, x @ up + ub) @ down + db` with
    `h(g, u)` = `silu(g) * u`, `gelu(g) * u`, and gpt-oss's
    `(clip(u, -limit, limit) + 1) * min(g, limit) * sigmoid(alpha * min(g, limit))`;
  * a dataclass with one leaf `w_EDD` (`cases.TiedFFN`) is `expert = tanh(x @ w) @ w`,
    one leaf in two matmuls.

An expert id outside [0, E) contributes zero. The gradients of `sum(y * ct)` are written
out by hand (no autodiff); `tests/test_oracle.py` checks them against finite differences.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np


def f64(a):
  """Returns `a` (any array, including bfloat16) as a float64 NumPy array."""
  return np.asarray(a).astype(np.float64)


def _sigmoid(z):
  return 0.5 * (1.0 + np.tanh(0.5 * z))  # no overflow for large |z|


_erf = np.vectorize(math.erf, otypes=[np.float64])


def _gelu(z):
  return 0.5 * z * (1.0 + _erf(z / math.sqrt(2.0)))


def _gelu_grad(z):
  return 0.5 * (1.0 + _erf(z / math.sqrt(2.0))) + z * np.exp(-0.5 * z * z) / math.sqrt(2 * math.pi)


# The gated FFNs' h(g, u), with dh/dg and dh/du (elementwise), by class name.
def _silu_glu(g, u, ffn):
  s = _sigmoid(g)
  return g * s * u, u * s * (1.0 + g * (1.0 - s)), g * s  # silu'(g) = s (1 + g (1 - s))


def _gelu_glu(g, u, ffn):
  return _gelu(g) * u, _gelu_grad(g) * u, _gelu(g)


def _clamped_glu(g, u, ffn):
  a, lim = ffn.alpha, ffn.limit
  gc, uc = np.minimum(g, lim), np.clip(u, -lim, lim)
  s = _sigmoid(a * gc)
  dh_dgc = (uc + 1.0) * (s + a * gc * s * (1.0 - s))
  return (uc + 1.0) * gc * s, dh_dgc * (g < lim), gc * s * (np.abs(u) < lim)


GATED = {"SwiGLU": _silu_glu, "GeGLU": _gelu_glu, "ClampedSwiGLU": _clamped_glu}
KINDS = {"Linear": "linear", "GeluMLP": "gelu", "TiedFFN": "tied", **{k: "gated" for k in GATED}}


def _leaves(w):
  """Returns (kind, {field name: f64 leaf}) without the leaves that are None."""
  if not dataclasses.is_dataclass(w):
    return "linear", {"w_EDF": f64(w)}
  name = type(w).__name__
  if name not in KINDS:
    raise ValueError(f"oracle: no model of the FFN {name} (known: {tuple(KINDS)})")
  fields = [f.name for f in dataclasses.fields(w) if not f.metadata.get("static")]
  return KINDS[name], {k: f64(getattr(w, k)) for k in fields if getattr(w, k) is not None}


def _item(kind, lv, e, x_D, w):
  """Expert e on one token: (out, back), back(dout) -> (dx_D, {leaf: gradient of slice e})."""
  outer = np.outer

  def b(name):
    return lv[name][e] if name in lv else 0.0

  if kind == "linear":
    W = lv["w_EDF"][e]
    out = x_D @ W + b("b_EF")
    return out, lambda dout: (W @ dout, {"w_EDF": outer(x_D, dout), "b_EF": dout})
  if kind == "tied":
    W = lv["w_EDD"][e]
    h = np.tanh(x_D @ W)

    def back_tied(dout):
      dz = (W @ dout) * (1.0 - h * h)
      return W @ dz, {"w_EDD": outer(x_D, dz) + outer(h, dout)}

    return h @ W, back_tied
  up, down = lv["up_EDF"][e], lv["down_EFD"][e]
  u = x_D @ up + b("up_b_EF")
  if kind == "gelu":
    h = _gelu(u)

    def back_gelu(dout):
      du = (down @ dout) * _gelu_grad(u)
      grads = {"up_EDF": outer(x_D, du), "up_b_EF": du}
      return up @ du, {**grads, "down_EFD": outer(h, dout), "down_b_ED": dout}

    return h @ down + b("down_b_ED"), back_gelu
  gate = lv["gate_EDF"][e]
  g = x_D @ gate + b("gate_b_EF")
  h, dh_dg, dh_du = GATED[type(w).__name__](g, u, w)

  def back_gated(dout):
    dh = down @ dout
    dg, du = dh * dh_dg, dh * dh_du
    grads = {"gate_EDF": outer(x_D, dg), "gate_b_EF": dg, "up_EDF": outer(x_D, du), "up_b_EF": du}
    return gate @ dg + up @ du, {**grads, "down_EFD": outer(h, dout), "down_b_ED": dout}

  return h @ down + b("down_b_ED"), back_gated


def _routing(experts, weights):
  """Returns experts_TK: int64[T, K] and weights_TK: f64[T, K] (ones when weights is None)."""
  experts = np.asarray(experts).astype(np.int64)
  T = experts.shape[0]
  experts_TK = experts.reshape(T, -1)
  weights_TK = (
    np.ones(experts_TK.shape) if weights is None else f64(weights).reshape(experts_TK.shape)
  )
  return experts_TK, weights_TK


def _out_dim(kind, lv):
  return lv[{"linear": "w_EDF", "tied": "w_EDD"}.get(kind, "down_EFD")].shape[-1]


def moe(x, w, experts, weights=None):
  """Returns y: f64[T, F] (f64[T, D] for the FFNs with a down matrix) by a loop over tokens
  and slots.

  Args:
    x: f[T, D] tokens.
    w: f[E, D, F] or an FFN dataclass of the kinds above.
    experts: int[T] or int[T, K] expert ids; ids outside [0, E) contribute zero.
    weights: f[T, K] (the shape of `experts`) or None for ones (default).
  """
  kind, lv = _leaves(w)
  x_TD = f64(x)
  experts_TK, weights_TK = _routing(experts, weights)
  T, K = experts_TK.shape
  E = next(iter(lv.values())).shape[0]
  y = np.zeros((T, _out_dim(kind, lv)))
  for t in range(T):
    for j in range(K):
      e = experts_TK[t, j]
      if 0 <= e < E:
        y[t] += weights_TK[t, j] * _item(kind, lv, e, x_TD[t], w)[0]
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
  kind, lv = _leaves(w)
  x_TD = f64(x)
  ct_TF = f64(ct)
  experts_TK, weights_TK = _routing(experts, weights)
  T, K = experts_TK.shape
  E = next(iter(lv.values())).shape[0]
  dx_TD = np.zeros_like(x_TD)
  dlv = {k: np.zeros_like(v) for k, v in lv.items()}
  dweights_TK = np.zeros(experts_TK.shape)
  for t in range(T):
    for j in range(K):
      e = experts_TK[t, j]
      if not 0 <= e < E:
        continue
      out, back = _item(kind, lv, e, x_TD[t], w)
      dx, dleaf = back(weights_TK[t, j] * ct_TF[t])
      dx_TD[t] += dx
      for k in dlv:
        dlv[k][e] += dleaf[k]
      dweights_TK[t, j] = out @ ct_TF[t]
  dw = dataclasses.replace(w, **dlv) if dataclasses.is_dataclass(w) else dlv["w_EDF"]
  dweights = None if weights is None else dweights_TK.reshape(np.shape(weights))
  return dx_TD, dw, dweights
