"""Low-rank adapters on the experts, for fine-tuning (which leaves train: `trainable.py`).

    params = add_adapters(params, rank=16, key=key, targets=("gate_EDF", "up_EDF", "down_EFD"))
    merged = merge_adapters(params)                # float matrices, the adapters folded in

An `Adapter` (LoRA, Hu et al. 2021) stands where an expert matrix `w: f[..., I, O]`
(`gate_EDF`, `down_EFD`, a float array or a `QuantizedArray`) would, one low-rank update per
expert:

    w'[e] = w[e] + scale * a_EIR[e] @ b_ERO[e]      scale = alpha / R (default 1)

The matmuls (`matmuls.py`) apply it to the rows of each expert as two more matmuls of the same
kind, `x @ w + scale * (x @ a) @ b` (grouped matmuls on sorted rows, on every dispatch and
backend), so `w'` is never formed and a quantized `w` stays quantized. R is the rank (shape
letter R). `b` starts at zero, so a fresh adapter leaves the layer's output unchanged.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from jaxtyping import Array, Float, PRNGKeyArray

from moe_shard import _checks
from moe_shard.quant import is_quantized
from moe_shard.sharding import auto


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Adapter:
  """An expert matrix with a low-rank update: `w + scale * a @ b` (module docstring).

  Attributes:
    w: the base matrix, f[..., I, O] or a `QuantizedArray` standing for one (frozen).
    a: f[..., I, R], normal with variance 1 / I at init (`add_adapters`).
    b: f[..., R, O], zeros at init.
    scale: alpha / R (static; default 1.0).
  """

  w: Any
  a: Float[Array, "... I R"]
  b: Float[Array, "... R O"]
  scale: float = dataclasses.field(default=1.0, metadata=dict(static=True))

  @property
  def shape(self) -> tuple[int, ...]:
    """The shape [..., I, O] of the matrix it stands for."""
    return tuple(self.w.shape)

  @property
  def ndim(self) -> int:
    return len(self.shape)

  @property
  def dtype(self) -> Any:
    return self.w.dtype

  @property
  def rank(self) -> int:
    return self.a.shape[-1]

  def __getitem__(self, index) -> Adapter:
    """Indexes the leading (non-matrix) axes of w, a and b alike: `ad[e]` is expert e's."""
    return dataclasses.replace(self, w=self.w[index], a=self.a[index], b=self.b[index])

  def expand_prefix(self, p: Any, expand_one: Any) -> Adapter:
    """The value `p` of the matrix (shape letters such as "EDF", or a `PartitionSpec`)
    given to w, a and b: a keeps the matrix's leading and input entries and gets R (no
    axis) for its last; b keeps the leading and output entries, R for its input."""
    if isinstance(p, str):
      pa, pb = p[:-1] + "R", p[:-2] + "R" + p[-1]
    elif isinstance(p, P):
      full = (*p, *[None] * (self.ndim - len(p)))
      pa, pb = P(*full[:-1], None), P(*full[:-2], None, full[-1])
    else:
      pa = pb = p
    return dataclasses.replace(self, w=expand_one(p, self.w), a=pa, b=pb)


def is_adapter(x: Any) -> bool:
  return isinstance(x, Adapter)


# With one group (one local expert), the low-rank part is two dense matmuls
# (`_masked_low_rank`) rather than two grouped matmuls: on CPU each grouped matmul call costs
# a loop over tiles for a few FLOPs, and on TPU a dense dot fuses with its neighbours. With
# more groups the dense form would compute every group's columns for every row (G times the
# low-rank FLOPs): compiled for TPU v5e 2x4 at E=64 (8 groups, R=16), the training step's
# estimate was longer that way than with the grouped matmuls (the figures: the commit that
# chose this; the step as it is: bench/results/tpu_v5e_2x4_adapters.md).
DENSE_LOW_RANK_GROUPS = 1


def apply(matmul: Any, x_MI: Array, w: Adapter) -> Array:
  """`x @ w.w + w.scale * (x @ w.a) @ w.b` through `matmul` (any of `matmuls.py`'s): the
  low-rank part in x's dtype between its two matmuls, summed in float32, returned in the
  dtype of the base product. The rows of a grouped matmul of one group take the dense form
  (`DENSE_LOW_RANK_GROUPS`)."""
  y_MO = matmul(x_MI, w.w)
  sizes_G = getattr(matmul, "group_sizes_G", None)
  if sizes_G is not None and w.a.shape[0] <= DENSE_LOW_RANK_GROUPS:
    low_MO = _masked_low_rank(x_MI, w.a, w.b, sizes_G)
  else:
    h_MR = matmul(x_MI, w.a).astype(x_MI.dtype)
    low_MO = matmul(h_MR, w.b)
  return (y_MO.astype(jnp.float32) + w.scale * low_MO.astype(jnp.float32)).astype(y_MO.dtype)


def _masked_low_rank(x_MI, a_GIR, b_GRO, sizes_G):
  """`(x[m] @ a[g]) @ b[g]` for each row m of group g, zeros past `sum(sizes_G)`: x against
  every group's a at once ([M, I] @ [I, G*R]), each row's other groups zeroed, then against
  every group's b ([M, G*R] @ [G*R, O]): G times the low-rank FLOPs, in two dense dots
  (G = 1 where `apply` takes it)."""
  G = a_GIR.shape[0]
  M = x_MI.shape[0]
  ends_G = jnp.cumsum(sizes_G)
  group_M = jnp.searchsorted(ends_G, jnp.arange(M, dtype=ends_G.dtype), side="right")
  mine_MG = group_M[:, None] == jnp.arange(G, dtype=group_M.dtype)[None, :]
  h_MGR = jnp.einsum(
    "mi,gir->mgr", x_MI, a_GIR.astype(x_MI.dtype), preferred_element_type=jnp.float32
  )
  h_MGR = jnp.where(mine_MG[:, :, None], h_MGR, 0.0).astype(x_MI.dtype)
  return jnp.einsum(
    "mgr,gro->mo", h_MGR, b_GRO.astype(x_MI.dtype), preferred_element_type=jnp.float32
  )


# --------------------------------------------------------------------------- adapters


def _matrix_fields(experts):
  """The matrix fields of an FFN dataclass: names ending in three shape letters."""
  if not dataclasses.is_dataclass(experts) or isinstance(experts, type):
    raise TypeError(
      f"add_adapters: params must be a MoEParams or an expert FFN dataclass such as SwiGLU "
      f"(got {type(experts).__name__})"
    )
  return [
    f.name
    for f in dataclasses.fields(experts)
    if not f.metadata.get("static")
    and len(f.name.rsplit("_", 1)[-1]) == 3
    and "_" in f.name
    and getattr(experts, f.name) is not None
  ]


def add_adapters(
  params: Any,
  *,
  rank: int,
  key: PRNGKeyArray,
  targets: Sequence[str] | None = None,
  alpha: float | None = None,
  dtype: Any = jnp.float32,
) -> Any:
  """Puts a low-rank adapter (LoRA) on each target matrix of the routed experts.

  Each target `w: f[..., I, O]` (float or `QuantizedArray`) becomes `Adapter(w, a, b,
  scale)` with `a: f[..., I, R]` normal with variance 1 / I, `b: f[..., R, O]` zeros (the
  layer's output is unchanged until b trains), one pair per expert (and per layer of a
  stack). a and b are placed like w's leading (expert) axes, replicated over the rest.

  Args:
    params: a `MoEParams` (or a stack of them, leaves [L, ...]), or an expert FFN such as
      `SwiGLU`.
    rank: R, 1 <= R <= min(I, O) of every target.
    key: a `jax.random` key (keyword-only).
    targets: the matrix fields to adapt (default None: every matrix of the FFN, e.g.
      ("gate_EDF", "up_EDF", "down_EFD")).
    alpha: the LoRA alpha: scale = alpha / rank (default None: scale 1).
    dtype: dtype of a and b (default float32; the layer casts them to its compute dtype).

  Returns:
    `params` with each target an `Adapter`.

  Raises:
    TypeError: params holds no FFN dataclass, or rank is not an int.
    ValueError: a target that is not a matrix field of the FFN or already has an adapter,
      or a rank out of range.
  """
  fn = "add_adapters"
  experts = getattr(params, "experts", params)
  fields = _matrix_fields(experts)
  targets = tuple(fields if targets is None else targets)
  for t in targets:
    if t not in fields:
      raise ValueError(
        f"{fn}: targets must be matrix fields of {type(experts).__name__} {tuple(fields)} (got {t!r})"
      )
    if is_adapter(getattr(experts, t)):
      raise ValueError(f"{fn}: experts.{t} already has an adapter; merge_adapters(params) first")
  least = min(min(getattr(experts, t).shape[-2:]) for t in targets) if targets else 1
  rank = _checks.int_in_range(fn, "rank", rank, 1, least)
  scale = 1.0 if alpha is None else _checks.real_field(fn, "alpha", alpha, positive=True) / rank
  keys = jax.random.split(key, max(len(targets), 1))
  new = {}
  for t, k in zip(targets, keys):
    w = getattr(experts, t)
    a, b = _init_pair(k, w, rank, jnp.dtype(dtype))
    new[t] = Adapter(w, a, b, scale)
  adapted = dataclasses.replace(experts, **new)
  return dataclasses.replace(params, experts=adapted) if experts is not params else adapted


def _leading_sharding(w, ndim):
  """NamedSharding of an adapter array: w's entries on its leading axes, none on the last two."""
  arr = w.values if is_quantized(w) else w
  sharding = getattr(arr, "sharding", None)
  if not isinstance(sharding, NamedSharding):
    return None
  spec = (*sharding.spec, *[None] * (ndim - len(sharding.spec)))
  return NamedSharding(sharding.mesh, P(*spec[:-2], None, None))


def _init_pair(key, w, rank, dtype):
  *lead, I, O = w.shape
  sharding = _leading_sharding(w, len(w.shape))

  def init(key):
    a = jax.random.normal(key, (*lead, I, rank), jnp.float32) / math.sqrt(I)
    return a.astype(dtype), jnp.zeros((*lead, rank, O), dtype)

  if sharding is None:
    return jax.jit(init)(key)
  return jax.jit(init, out_shardings=(sharding, sharding))(key)


def merge_adapters(params: Any) -> Any:
  """Folds every `Adapter` into its matrix: `w + scale * a @ b`, a float matrix.

  The product and the sum are formed in float32 (a quantized w dequantized first) and
  cast to w's dtype (a `QuantizedArray`'s logical dtype); the result keeps w's sharding.
  Quantize it again with `quantize_experts` if the model is to stay quantized.

  Args:
    params: any pytree holding `Adapter`s (a `MoEParams`, an FFN).

  Returns:
    the same pytree with float matrices in place of the adapters.
  """
  return jax.tree.map(lambda x: _merge(x) if is_adapter(x) else x, params, is_leaf=is_adapter)


def _merge(ad):
  ref = ad.w.values if is_quantized(ad.w) else ad.w

  def fold(ad):
    w = ad.w.dequantize(jnp.float32) if is_quantized(ad.w) else ad.w.astype(jnp.float32)
    low = jnp.einsum("...ir,...ro->...io", ad.a.astype(jnp.float32), ad.b.astype(jnp.float32))
    return (w + ad.scale * low).astype(ad.dtype)

  return jax.jit(lambda ad: auto(fold, ref, lambda spec: spec)(ad))(ad)
