"""Independent NumPy forward of the benchmark's two levels, for the max-error column.

Computed from the host routing (`Case.experts_TK`), in float32 with float64 accumulation of
each expert's matmuls, sharing no code with moe_shard: the error the benchmark reports is
against this, never against another implementation of the library.
"""

from __future__ import annotations

import numpy as np


def _combine(x_TD, experts_TK, weights_TK, kept, expert):
  """y[t] = sum_j kept[t, j] * weights[t, j] * expert(e, x[t]), one expert at a time."""
  T = x_TD.shape[0]
  valid = (experts_TK >= 0) & (experts_TK < expert.num)
  if kept is not None:
    valid &= kept
  y = None
  for e in range(expert.num):
    t_idx, j_idx = np.nonzero(valid & (experts_TK == e))
    if not len(t_idx):
      continue
    out = expert(e, x_TD[t_idx])
    if y is None:
      y = np.zeros((T, out.shape[1]), np.float64)
    np.add.at(y, t_idx, weights_TK[t_idx, j_idx, None] * out)
  return y if y is not None else np.zeros((T, expert.d_out), np.float64)


class _Linear:
  def __init__(self, w_EDF):
    self.w, self.num, self.d_out = np.asarray(w_EDF, np.float64), w_EDF.shape[0], w_EDF.shape[2]

  def __call__(self, e, x_MD):
    return x_MD @ self.w[e]


class _SwiGLU:
  """SwiGLU, or with `clamp` = (alpha, limit) gpt-oss's clamped SwiGLU:
  g = min(x @ gate + gb, limit), u = clip(x @ up + ub, -limit, limit),
  y = ((u + 1) * g * sigmoid(alpha * g)) @ down + db; biases where the FFN has them."""

  def __init__(self, ffn, clamp=None):
    self.g, self.u, self.d = (
      np.asarray(a, np.float64) for a in (ffn.gate_EDF, ffn.up_EDF, ffn.down_EFD)
    )
    self.b = [
      None if b is None else np.asarray(b, np.float64)
      for b in (getattr(ffn, n, None) for n in ("gate_b_EF", "up_b_EF", "down_b_ED"))
    ]
    self.clamp = clamp
    self.num, self.d_out = self.g.shape[0], self.d.shape[2]

  def _bias(self, i, e, y):
    return y if self.b[i] is None else y + self.b[i][e]

  def __call__(self, e, x_MD):
    g, u = self._bias(0, e, x_MD @ self.g[e]), self._bias(1, e, x_MD @ self.u[e])
    if self.clamp is None:
      h = g / (1.0 + np.exp(-g)) * u
    else:
      alpha, limit = self.clamp
      g, u = np.minimum(g, limit), np.clip(u, -limit, limit)
      h = (u + 1.0) * g / (1.0 + np.exp(-alpha * g))
    return self._bias(2, e, h @ self.d[e])


def kernel(x_TD, w_EDF, experts_TK, weights_TK, *, kept=None):
  """The kernel level: one matrix per expert; f32[T, F]."""
  x = np.asarray(x_TD, np.float64)
  y = _combine(
    x,
    np.asarray(experts_TK),
    np.asarray(weights_TK, np.float64),
    kept,
    _Linear(np.asarray(w_EDF, np.float32)),
  )
  return y.astype(np.float32)


def layer(params, x_BSD, cfg, experts_TK, *, kept=None):
  """The layer level: the router's scores (softmax, or sigmoid with `cfg.score_func`) of the
  given experts as weights (normalized over them when `cfg.normalize_top_k`, times
  `cfg.routed_scaling`), SwiGLU experts (gpt-oss's clamped SwiGLU with
  `cfg.expert_type="clamped_swiglu"`, their biases where they have them) and the shared
  experts; f32[B, S, D]. Quantized experts come in as the float values they stand for."""
  B, S, D = x_BSD.shape
  x = np.asarray(x_BSD, np.float64).reshape(B * S, D)
  logits = x @ np.asarray(params.router_DE, np.float64)
  if getattr(cfg, "score_func", "softmax") == "sigmoid":
    probs = 1 / (1 + np.exp(-logits))
  else:
    probs = np.exp(logits - logits.max(axis=1, keepdims=True))
    probs /= probs.sum(axis=1, keepdims=True)
  weights = np.take_along_axis(probs, experts_TK, axis=1)
  if cfg.normalize_top_k:
    weights /= weights.sum(axis=1, keepdims=True)
  weights = weights * getattr(cfg, "routed_scaling", 1.0)
  clamp = None
  if getattr(cfg, "expert_type", "swiglu") == "clamped_swiglu":
    clamp = (cfg.swiglu_alpha, cfg.swiglu_limit)
  y = _combine(x, experts_TK, weights, kept, _SwiGLU(params.experts, clamp))
  if params.shared is not None:
    shared = _SwiGLU(params.shared)
    y = y + sum(shared(e, x) for e in range(shared.num))
  return y.reshape(B, S, D).astype(np.float32)
