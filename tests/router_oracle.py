"""An independent NumPy float64 oracle for the routers and their balance losses.

Plain loops over tokens (and experts), sharing no code with `moe_shard`. The tie rule is
written out as a sort key: the higher score first, then the lower index (expert, group or
token), which is how `lax.top_k` orders equal values.
"""

from __future__ import annotations

import numpy as np


def f64(a):
  return np.asarray(a).astype(np.float64)


def scores(logits_TE, score_func):
  """softmax over experts, or the elementwise sigmoid, in float64."""
  z = f64(logits_TE)
  if score_func == "softmax":
    e = np.exp(z - z.max(axis=1, keepdims=True))
    return e / e.sum(axis=1, keepdims=True)
  assert score_func == "sigmoid", score_func
  return 0.5 * (1.0 + np.tanh(0.5 * z))


def top_k(
  logits_TE,
  k,
  *,
  normalize=True,
  score_func="softmax",
  num_groups=1,
  top_k_groups=None,
  bias_E=None,
  scaling=1.0,
  normalize_p=1.0,
):
  """Returns (weights f64[T, k], experts int64[T, k], scores f64[T, E]).

  With `normalize`, each token's k weights are divided by their p-norm, p = `normalize_p`
  (DBRX: `weights / torch.norm(weights, p=p, dim=-1, keepdim=True)`).
  """
  s_TE = scores(logits_TE, score_func)
  T, E = s_TE.shape
  sel_TE = s_TE + (0.0 if bias_E is None else f64(bias_E)[None, :])
  M = E // num_groups
  kept = num_groups if top_k_groups is None else top_k_groups
  experts = np.zeros((T, k), np.int64)
  for t in range(T):
    members = [range(g * M, (g + 1) * M) for g in range(num_groups)]
    group_score = [sum(sorted((sel_TE[t, e] for e in m), reverse=True)[:2]) for m in members]
    groups = sorted(range(num_groups), key=lambda g: (-group_score[g], g))[:kept]
    candidates = [e for g in groups for e in members[g]]
    experts[t] = sorted(candidates, key=lambda e: (-sel_TE[t, e], e))[:k]
  weights = np.take_along_axis(s_TE, experts, axis=1)
  if normalize:
    norm = np.sum(np.abs(weights) ** normalize_p, axis=1, keepdims=True) ** (1 / normalize_p)
    weights = weights / norm
  return weights * scaling, experts, s_TE


def expert_choice(logits_TE, capacity):
  """Returns (weights f64[T, E], experts int64[T, E] with -1 for not chosen, probs f64[T, E])."""
  p_TE = scores(logits_TE, "softmax")
  T, E = p_TE.shape
  experts = np.full((T, E), -1, np.int64)
  weights = np.zeros((T, E))
  for e in range(E):
    for t in sorted(range(T), key=lambda t: (-p_TE[t, e], t))[:capacity]:
      experts[t, e] = e
      weights[t, e] = p_TE[t, e]
  return weights, experts, p_TE


def in_groups(router, logits_TE, groups, *args, **kwargs):
  """`router` run on each of `groups` runs of consecutive tokens, results concatenated."""
  parts = [router(l, *args, **kwargs) for l in np.split(f64(logits_TE), groups)]
  return tuple(np.concatenate(p) for p in zip(*parts))


def switch_loss(experts_TK, probs_TE):
  """E * sum_e f_e P_e over all tokens (ids outside [0, E) not counted)."""
  E = probs_TE.shape[1]
  ids = np.asarray(experts_TK).ravel()
  f = np.array([np.sum(ids == e) for e in range(E)]) / ids.size
  return E * np.sum(f * f64(probs_TE).mean(axis=0))


def sequence_loss(experts_TK, scores_TE, seq_len):
  """DeepSeek-V3's sequence-wise loss, averaged over the T / S sequences."""
  experts_TK, s_TE = np.asarray(experts_TK), f64(scores_TE)
  T, E = s_TE.shape
  K = experts_TK.shape[1]
  losses = []
  for b in range(T // seq_len):
    rows = slice(b * seq_len, (b + 1) * seq_len)
    count = np.array([np.sum(experts_TK[rows] == e) for e in range(E)])
    f = E / (K * seq_len) * count
    normalized = s_TE[rows] / s_TE[rows].sum(axis=1, keepdims=True)
    losses.append(np.sum(f * normalized.mean(axis=0)))
  return np.mean(losses)


def moe_linear(x_TD, w_EDF, experts_TK, weights_TK):
  """y[t] = sum_j weights[t, j] * x[t] @ w[experts[t, j]]; ids outside [0, E) give zero."""
  x, w = f64(x_TD), f64(w_EDF)
  y = np.zeros((x.shape[0], w.shape[2]))
  for t in range(x.shape[0]):
    for j in range(experts_TK.shape[1]):
      e = int(experts_TK[t, j])
      if 0 <= e < w.shape[0]:
        y[t] += weights_TK[t, j] * (x[t] @ w[e])
  return y
