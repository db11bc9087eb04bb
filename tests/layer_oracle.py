"""An independent float64 NumPy model of the whole MoE layer, and finite-difference gradients.

    logits_TE = x_TD @ router_DE (+ router_logit_bias_E when params have one)
    probs_TE = softmax(logits_TE)
    experts_TK = the K largest probs of each token (ties: lowest expert id first)
    weights_TK = their probs, divided by their normalize_p-norm when cfg.normalize_top_k
      (p = 1: they sum to 1)
    capacity: each expert keeps its first C = ceil(capacity_factor * T * K / E) (token, slot)
      items in row-major order of experts_TK (token order, then slot order); the rest drop
    y[t] = gate[t] * shared(x[t]) + sum_j kept[t, j] * weights[t, j] * expert_j(x[t])
      expert_j = expert(W[experts[t, j]], .); gate[t] = sigmoid(x[t] @ shared_gate_D)
      when params have one, else 1; with cfg.weights_on "input" the sum is of
      kept[t, j] * expert_j(weights[t, j] * x[t])
    aux_loss = load_balance_coef * E * sum_e f_e * P_e + z_loss_coef * mean_t lse(logits)^2

f_e is the fraction of the T*K items the router chose for e (before any drop), P_e the mean
probability of e. Written from the layer's documented semantics, sharing no code with
`moe_shard`: its dataclasses (`MoEParams`, the expert FFNs) are only read by class and
attribute name (the routed experts' models, with their biases, are `EXPERT_MODELS`: every
class of `ms.EXPERTS`), and gradients come from central differences of `loss` (`fd_grads`), not from
autodiff. The model is piecewise smooth: it is differentiable wherever the top-k choice is
strict, so `fd_grads` asserts that no step can change it (see `routing_margin`).
"""

from __future__ import annotations

import fractions
import math

import jax
import numpy as np


def f64(a):
  """`a` (any array, bfloat16 included) as a float64 NumPy array."""
  return np.asarray(a).astype(np.float64)


def to_f64(tree):
  """Every array leaf of a params pytree (or an array) as float64 NumPy."""
  return jax.tree.map(f64, tree)


def _sigmoid(z):
  return 0.5 * (1.0 + np.tanh(0.5 * z))  # no overflow for large |z|


def _swiglu(x_TD, gate_DF, up_DF, down_FD, spec):
  """`(silu(x @ gate) * (x @ up)) @ down` with einsum `spec` = (in, weights-in, out)."""
  g = np.einsum(spec[0], x_TD, gate_DF)
  u = np.einsum(spec[0], x_TD, up_DF)
  return np.einsum(spec[1], g * _sigmoid(g) * u, down_FD)


def _gelu(z):
  """The exact GELU, z * Phi(z)."""
  return 0.5 * z * (1.0 + np.vectorize(math.erf, otypes=[np.float64])(z / math.sqrt(2.0)))


def _clamped_glu(g, u, ex):
  """gpt-oss: (clip(u, -limit, limit) + 1) * min(g, limit) * sigmoid(alpha * min(g, limit))."""
  g = np.minimum(g, ex.limit)
  return (np.clip(u, -ex.limit, ex.limit) + 1.0) * g * _sigmoid(ex.alpha * g)


# h(g, u) of the gated FFNs, by class name.
GATES = {
  "SwiGLU": lambda g, u, ex: g * _sigmoid(g) * u,
  "GeGLU": lambda g, u, ex: _gelu(g) * u,
  "ClampedSwiGLU": _clamped_glu,
}


def _affine(ex, x_TKI, w, b, experts_TK):
  """Each item through its own expert's matrix `w` ([E, I, O]) and bias `b` (or None)."""
  y_TKO = np.einsum("tki,tkio->tko", x_TKI, getattr(ex, w)[experts_TK])
  bias = getattr(ex, b, None)
  return y_TKO if bias is None else y_TKO + bias[experts_TK]


def _gated(ex, x_TKD, experts_TK):
  g = _affine(ex, x_TKD, "gate_EDF", "gate_b_EF", experts_TK)
  u = _affine(ex, x_TKD, "up_EDF", "up_b_EF", experts_TK)
  h = GATES[type(ex).__name__](g, u, ex)
  return _affine(ex, h, "down_EFD", "down_b_ED", experts_TK)


def _gelu_mlp(ex, x_TKD, experts_TK):
  h = _gelu(_affine(ex, x_TKD, "up_EDF", "up_b_EF", experts_TK))
  return _affine(ex, h, "down_EFD", "down_b_ED", experts_TK)


# Models of the routed experts by class name: (experts, x_TKD, experts_TK) -> f64[T, K, out],
# each (token, slot) item through its own expert. A test adds its own class's model here.
EXPERT_MODELS = {
  "Linear": lambda ex, x, ids: _affine(ex, x, "w_EDF", "b_EF", ids),
  "GeluMLP": _gelu_mlp,
  **{name: _gated for name in GATES},
}


def expert_outputs(ex, x_TKD, experts_TK):
  """`EXPERT_MODELS[type(ex).__name__]`: every item's expert output, f64[T, K, out]."""
  name = type(ex).__name__
  if name not in EXPERT_MODELS:
    raise ValueError(f"layer_oracle: no model of the FFN {name} (known: {tuple(EXPERT_MODELS)})")
  return EXPERT_MODELS[name](ex, x_TKD, experts_TK)


def capacity(capacity_factor, T, K, E):
  """Items each expert takes: ceil(c * T * K / E) on the decimal value of c; None if None."""
  if capacity_factor is None:
    return None
  return math.ceil(fractions.Fraction(repr(capacity_factor)) * T * K / E)


def route(x_TD, router_DE, K, normalize, bias_E=None, p=1.0):
  """Returns (logits_TE, probs_TE, experts_TK, weights_TK) in float64.

  `bias_E` (or None) is added to the logits; `p` is the norm that `normalize` divides by.
  """
  logits_TE = x_TD @ router_DE + (0.0 if bias_E is None else bias_E)
  z_TE = np.exp(logits_TE - logits_TE.max(axis=1, keepdims=True))
  probs_TE = z_TE / z_TE.sum(axis=1, keepdims=True)
  # A stable sort of -p puts equal probabilities in increasing expert id, like lax.top_k.
  experts_TK = np.argsort(-probs_TE, axis=1, kind="stable")[:, :K]
  weights_TK = np.take_along_axis(probs_TE, experts_TK, axis=1)
  if normalize:
    weights_TK = weights_TK / (np.sum(weights_TK**p, axis=1, keepdims=True) ** (1 / p))
  return logits_TE, probs_TE, experts_TK, weights_TK


def routing_margin(x_TD, router_DE, K, bias_E=None):
  """The smallest gap, over tokens, between the K-th and (K+1)-th largest logit (inf if K=E).

  A perturbation that moves every logit by less than half of it cannot change any top-k.
  `bias_E` (or None) is added to the logits.
  """
  logits_TE = f64(x_TD) @ f64(router_DE) + (0.0 if bias_E is None else f64(bias_E))
  if logits_TE.shape[1] == K:
    return np.inf
  s_TE = -np.sort(-logits_TE, axis=1)
  return float(np.min(s_TE[:, K - 1] - s_TE[:, K]))


def drop_mask(experts_TK, E, C):
  """bool[T, K]: items past the first C of their expert's queue (row-major order)."""
  if C is None:
    return np.zeros(experts_TK.shape, bool)
  ids_I = experts_TK.reshape(-1)
  onehot_IE = ids_I[:, None] == np.arange(E)[None, :]
  pos_I = (np.cumsum(onehot_IE, axis=0) - 1)[np.arange(ids_I.size), ids_I]
  return (pos_I >= C).reshape(experts_TK.shape)


def layer(params, x_BSD, cfg):
  """The layer's outputs: (y_BSD: f64[B, S, D], aux: dict of float64 / int values).

  Args:
    params: a `MoEParams`-like object (router_DE, experts, shared) with float64 leaves.
    x_BSD: f[B, S, D] tokens.
    cfg: a `MoEConfig`-like object; reads top_k, num_experts, normalize_top_k,
      normalize_p, weights_on, capacity_factor, load_balance_coef and z_loss_coef.
  """
  params = to_f64(params)
  B, S, D = np.shape(x_BSD)
  x_TD = f64(x_BSD).reshape(B * S, D)
  T, K, E = B * S, cfg.top_k, cfg.num_experts
  bias_E = getattr(params, "router_logit_bias", None)
  logits_TE, probs_TE, experts_TK, weights_TK = route(
    x_TD, f64(params.router_DE), K, cfg.normalize_top_k, bias_E, cfg.normalize_p
  )
  dropped_TK = drop_mask(experts_TK, E, capacity(cfg.capacity_factor, T, K, E))
  kept_TK = np.where(dropped_TK, 0.0, 1.0)
  # Each (token, slot) item's input: the token, or the token times its weight.
  if cfg.weights_on == "input":
    x_TKD, coef_TK = weights_TK[:, :, None] * x_TD[:, None, :], kept_TK
  else:
    x_TKD, coef_TK = np.broadcast_to(x_TD[:, None, :], (T, K, D)), kept_TK * weights_TK
  out_TKD = expert_outputs(params.experts, x_TKD, experts_TK)
  y_TD = np.einsum("tk,tkd->td", coef_TK, out_TKD)
  if params.shared is not None:
    sh = params.shared
    shared_TD = _swiglu(x_TD, sh.gate_EDF, sh.up_EDF, sh.down_EFD, ("td,hdf->thf", "thf,hfd->td"))
    gate_D = getattr(params, "shared_gate_D", None)
    if gate_D is not None:  # one gate on the sum of the shared experts
      shared_TD = shared_TD * _sigmoid(x_TD @ gate_D)[:, None]
    y_TD = y_TD + shared_TD
  f_E = np.bincount(experts_TK.reshape(-1), minlength=E) / (T * K)
  lb = E * np.sum(f_E * probs_TE.mean(axis=0))
  lse_T = np.log(np.sum(np.exp(logits_TE - logits_TE.max(1, keepdims=True)), 1)) + logits_TE.max(1)
  z = np.mean(lse_T**2)
  aux = dict(
    aux_loss=cfg.load_balance_coef * lb + cfg.z_loss_coef * z,
    load_balance_loss=lb,
    z_loss=z,
    expert_load=np.bincount(experts_TK[~dropped_TK], minlength=E),
    dropped_items=int(dropped_TK.sum()),
    dropped_tokens=int(np.all(dropped_TK, axis=1).sum()),
    # Not outputs of the layer: what a test needs to know about the case.
    experts_TK=np.where(dropped_TK, -1, experts_TK),
    margin=routing_margin(x_TD, params.router_DE, K, bias_E),
    probs_TE=probs_TE,
  )
  return y_TD.reshape(B, S, D), aux


def loss(params, x_BSD, ct_BSD, cfg):
  """The scalar `sum(y * ct) + aux_loss` of `layer`, in float64."""
  y_BSD, aux = layer(params, x_BSD, cfg)
  return float(np.sum(y_BSD * f64(ct_BSD)) + aux["aux_loss"])


def fd_grads(params, x_BSD, ct_BSD, cfg, h=1e-6):
  """Central differences of `loss` w.r.t. every parameter leaf and x: (dparams, dx).

  Error O(h^2 * f''') + O(eps * |loss| / h), about 1e-9 here, far below float32's 1e-5.
  The top-k choice must not change under a step: a step of h in x[t, d] moves logits by
  at most h * max|router_DE|, in router_DE[d, e] by at most h * max|x|, in a router logit
  bias by h, so the routing margin must exceed twice that (asserted with a 100x safety
  factor).

  Args:
    params: `MoEParams`-like with float64 NumPy leaves; x_BSD, ct_BSD: float64 arrays.
    cfg: as in `layer`.

  Returns:
    (dparams with the structure of params, dx_BSD), float64.
  """
  params, x_BSD = to_f64(params), f64(x_BSD)
  step_effect = h * max(np.abs(x_BSD).max(), np.abs(params.router_DE).max(), 1.0)
  margin = routing_margin(
    x_BSD.reshape(-1, x_BSD.shape[-1]),
    params.router_DE,
    cfg.top_k,
    getattr(params, "router_logit_bias", None),
  )
  assert margin > 200 * step_effect, (margin, step_effect)
  leaves, treedef = jax.tree.flatten((params, x_BSD))

  def value():
    p, x = jax.tree.unflatten(treedef, leaves)
    return loss(p, x, ct_BSD, cfg)

  grads = []
  for a in leaves:
    g = np.zeros_like(a)
    for i in np.ndindex(a.shape):
      old = a[i]
      a[i] = old + h
      up = value()
      a[i] = old - h
      down = value()
      a[i] = old
      g[i] = (up - down) / (2 * h)
    grads.append(g)
  return jax.tree.unflatten(treedef, grads)
