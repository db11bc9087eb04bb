"""Expert computations: what one expert does to the tokens routed to it.

An expert FFN is a pytree whose every leaf has the expert axis first, plus a `__call__`
that maps tokens to outputs through a `matmul(x_MD, w_E..)` function supplied by the
dispatch strategy. The FFN never indexes experts itself, so the same code runs

  * on grouped tokens: `matmul` is the grouped matmul and the leaves are `[E, ...]`;
  * on one expert: the masked-scan reference passes leaves sliced to `[...]` and a dense
    `matmul`.

A third FFN type is one new dataclass with `d_in`, `d_out` and `__call__`; no dispatch code
changes. A bare `f[E, D, F]` array is accepted wherever an FFN is and means `Linear`.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from moe_shard import _checks
from moe_shard.remat import MOE_EXPERT_GATE, MOE_EXPERT_OUT, MOE_EXPERT_UP


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Linear:
  """One matrix per expert: `y = x @ w_EDF[e]` (the seed problem).

  Attributes:
    w_EDF: f[E, D, F].
  """

  w_EDF: jax.Array

  @property
  def d_in(self):
    return self.w_EDF.shape[-2]

  @property
  def d_out(self):
    return self.w_EDF.shape[-1]

  def __call__(self, x_MD, matmul):
    """Applies the expert to tokens; returns f32[M, F] (named `MOE_EXPERT_OUT`)."""
    return checkpoint_name(matmul(x_MD, self.w_EDF), MOE_EXPERT_OUT)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SwiGLU:
  """Gated FFN `y = (silu(x @ gate) * (x @ up)) @ down` (Shazeer 2020).

  Attributes:
    gate_EDF: f[E, D, F].
    up_EDF: f[E, D, F].
    down_EFD: f[E, F, D].
  """

  gate_EDF: jax.Array
  up_EDF: jax.Array
  down_EFD: jax.Array

  @property
  def d_in(self):
    return self.gate_EDF.shape[-2]

  @property
  def d_out(self):
    return self.down_EFD.shape[-1]

  def check_shapes(self, fn):
    """Raises ValueError unless gate, up are [E, D, F] and down is [E, F, D]."""
    g, u, d = self.gate_EDF.shape, self.up_EDF.shape, self.down_EFD.shape
    if len(g) != 3 or u != g or d != (g[0], g[2], g[1]):
      raise ValueError(
        f"{fn}: SwiGLU needs gate_EDF and up_EDF of one shape [E, D, F] and "
        f"down_EFD of shape [E, F, D] (got gate {g}, up {u}, down {d})"
      )

  def __call__(self, x_MD, matmul):
    """Applies the expert to tokens; returns f32[M, D].

    The two input matmuls are named `MOE_EXPERT_GATE` and `MOE_EXPERT_UP`, the output
    `MOE_EXPERT_OUT` (`remat.py`).
    """
    g_MF = checkpoint_name(matmul(x_MD, self.gate_EDF), MOE_EXPERT_GATE)
    u_MF = checkpoint_name(matmul(x_MD, self.up_EDF), MOE_EXPERT_UP)
    h_MF = jax.nn.silu(g_MF) * u_MF
    return checkpoint_name(matmul(h_MF.astype(x_MD.dtype), self.down_EFD), MOE_EXPERT_OUT)


def as_ffn(fn, w):
  """Returns `w` as an expert FFN and its number of experts, checking every leaf agrees.

  Args:
    fn: name of the calling function, for error messages.
    w: f[E, D, F] array (taken as `Linear`) or an expert-FFN pytree.

  Returns:
    (ffn, E).

  Raises:
    TypeError: `w` is neither a float array nor an FFN with `d_in`, `d_out`, `__call__`.
    ValueError: a 3-D array was expected, or the leaves disagree on E.
  """
  if isinstance(w, (jax.Array, jax.core.Tracer)) or hasattr(w, "__array__"):
    w = Linear(_checks.float_array(fn, "w", w, ndim=3))
  if not callable(w) or not all(hasattr(type(w), a) for a in ("d_in", "d_out")):
    raise TypeError(
      f"{fn}: w must be an f[E, D, F] array or an expert FFN such as SwiGLU "
      f"(got {type(w).__name__})"
    )
  sizes = {}
  for path, leaf in jax.tree_util.tree_leaves_with_path(w):
    name = "w" + jax.tree_util.keystr(path)
    leaf = _checks.float_array(fn, name, leaf)
    if leaf.ndim < 1:
      raise ValueError(f"{fn}: {name} must have the expert axis first (got a scalar)")
    sizes[name] = leaf.shape[0]
  if not sizes:
    raise ValueError(f"{fn}: w must have at least one array leaf (got {w!r})")
  if len(set(sizes.values())) != 1:
    listed = ", ".join(f"{k}: {v}" for k, v in sizes.items())
    raise ValueError(
      f"{fn}: every leaf of w must have the same number of experts on axis 0 (got {listed})"
    )
  if hasattr(w, "check_shapes"):
    w.check_shapes(fn)
  return w, next(iter(sizes.values()))


def dense_matmul(x_MD, w_DF):
  """`x @ w` for one expert's matrix, accumulating in float32; returns f32[M, F]."""
  return jnp.einsum("md,df->mf", x_MD, w_DF.astype(x_MD.dtype), preferred_element_type=jnp.float32)
