"""The matmuls a dispatch hands an expert FFN: `matmul(x_MD, w)` and `matmul.add_bias(y, b)`.

An FFN (`experts.py`) never indexes experts itself; the dispatch decides how its matrices
meet the rows:

  * `dense_matmul`: one expert's leaves, without the expert axis (the masked scan);
  * `GroupedMatmul`: rows sorted by expert, the leaves `[G, ...]` (every sorting dispatch);
  * `MaskedMatmul`: one local expert, its rows in any order, padding rows masked.

Each takes a float matrix, a `QuantizedArray` (`quant.py`) or an `Adapter` (`adapters.py`:
a matrix and its low-rank update, applied as `x @ w + scale * (x @ a) @ b` by the same
matmul: three matmuls of the same rows, `adapters.apply`) where it takes `w`. A quantized
matrix is frozen (its gradient is stopped) and is dequantized a piece at a time: per block
or group inside the grouped matmul's backends (`kernels/grouped_matmul.py`, which
`MaskedMatmul` calls with one group of all its rows for FP8 and MXFP4, and for int8 at up to
`KERNEL_ROWS` rows), as the operand of `MaskedMatmul`'s dot for int8 past them (XLA fuses
the decode into it), and one expert's matrix for `dense_matmul`.
Products accumulate in float32.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from moe_shard import adapters, frozen, quant
from moe_shard.kernels.grouped_matmul import grouped_matmul


def as_operand(w: Any, dtype: Any) -> Array:
  """`w` as a dot operand in `dtype`: a float matrix cast, a `QuantizedArray` dequantized
  (its gradient stopped: quantized matrices are frozen)."""
  if quant.is_quantized(w):
    return frozen.stop_gradient(w).dequantize(dtype)
  return w.astype(dtype)


class DenseMatmul:
  """One expert's matmul, for leaves without the expert axis (the masked scan).

  `dense_matmul(x_MD, w_DF)` is `x @ w` accumulating in float32, f32[M, F];
  `dense_matmul.add_bias(y_MF, b_F)` adds b to every row (the masked scan keeps only the
  rows routed to the expert afterwards).
  """

  def __call__(self, x_MD: Float[Array, "M D"], w_DF: Any) -> Float[Array, "M F"]:
    if adapters.is_adapter(w_DF):
      return adapters.apply(self, x_MD, w_DF)
    w_DF = as_operand(w_DF, x_MD.dtype)
    return jnp.einsum("md,df->mf", x_MD, w_DF, preferred_element_type=jnp.float32)

  def add_bias(self, y_MF: Float[Array, "M F"], b_F: Float[Array, " F"]) -> Float[Array, "M F"]:
    return (y_MF.astype(jnp.float32) + b_F.astype(jnp.float32)).astype(y_MF.dtype)


dense_matmul = DenseMatmul()


@dataclasses.dataclass(frozen=True)
class GroupedMatmul:
  """The matmul of rows sorted by expert: `grouped_matmul` with its group sizes bound.

  Attributes:
    group_sizes_G: int[G] rows of each group (expert); rows past their sum are padding.
    impl: `grouped_matmul`'s backend (default "auto").
    out_dtype: dtype of the products (default None: the dtype of x); they accumulate in
      float32.
  """

  group_sizes_G: Int[Array, " G"]
  impl: str = "auto"
  out_dtype: jnp.dtype | None = None

  def __call__(self, x_MD: Float[Array, "M D"], w_GDF: Any) -> Float[Array, "M F"]:
    """`y[m] = x[m] @ w[group of m]`, zeros past `sum(group_sizes_G)`."""
    if adapters.is_adapter(w_GDF):
      return adapters.apply(self, x_MD, w_GDF)
    return grouped_matmul(
      x_MD, w_GDF, self.group_sizes_G, impl=self.impl, preferred_element_type=self.out_dtype
    )

  def add_bias(self, y_MF: Float[Array, "M F"], b_GF: Float[Array, "G F"]) -> Float[Array, "M F"]:
    """`y[m] + b[group of m]`; rows past `sum(group_sizes_G)` stay as they are.

    Each row's group from a binary search of the group ends, its bias row picked by a
    one-hot [M, G] matmul (exact: one nonzero term; a padding row's one-hot is zeros), not
    a gather of M rows: compiled for TPU, XLA charges a row gather several times the bytes
    it moves (`local.move_rows`), which at decode sizes rivals reading the experts'
    weights. The matmul adds 2 * M * G * F FLOPs, G / D of the weight's own.
    """
    M, G = y_MF.shape[0], b_GF.shape[0]
    ends_G = jnp.cumsum(self.group_sizes_G)
    group_M = jnp.searchsorted(ends_G, jnp.arange(M, dtype=ends_G.dtype), side="right")
    onehot_MG = (group_M[:, None] == jnp.arange(G, dtype=group_M.dtype)).astype(b_GF.dtype)
    b_MF = jnp.dot(
      onehot_MG, b_GF, preferred_element_type=jnp.float32, precision=jax.lax.Precision.HIGHEST
    )
    return (y_MF.astype(jnp.float32) + b_MF).astype(y_MF.dtype)


# Formats `MaskedMatmul` decodes through the grouped matmul's kernel rather than as the
# operand of an XLA dot: XLA:TPU fuses int8's decode into the dot (and with it the FFN's
# elementwise ops), but not FP8's bit decoding or MXFP4's nibbles and table
# (bench/results/tpu_v5e_2x4_quant.md).
KERNEL_DECODED = ("fp8", "mxfp4")
# int8 takes the kernel too at up to this many rows (decode): there XLA:TPU prefetches the
# whole s8 matrix into VMEM before its dot (a copy that reads and writes it again), where
# the kernel reads each block of it once from HBM.
KERNEL_ROWS = 512


@dataclasses.dataclass(frozen=True)
class MaskedMatmul:
  """The matmul of one local expert, its rows in any order: `x @ w[0]` on the rows where
  `valid_M`, zeros elsewhere.

  With one group a grouped matmul is a dense one. Masking the rows, instead of sorting the
  padding past the group, leaves the FFN plain matmuls and elementwise ops, which XLA fuses
  (the SwiGLU's elementwise into the matmuls), forward and backward. The padding rows of x
  must be finite (the dispatches' are zeros): their products are computed, then masked.

  Attributes:
    valid_M: bool[M] the rows that hold an item; the others are padding.
    out_dtype: dtype of the products (default None: the dtype of x); they accumulate in
      float32.
  """

  valid_M: Array
  out_dtype: jnp.dtype | None = None

  def __call__(self, x_MD: Float[Array, "M D"], w_GDF: Any) -> Float[Array, "M F"]:
    """`y[m] = x[m] @ w[0]` where `valid_M[m]`, zeros elsewhere."""
    if adapters.is_adapter(w_GDF):
      return adapters.apply(self, x_MD, w_GDF)
    if len(w_GDF.shape) != 3 or w_GDF.shape[0] != 1:
      raise ValueError(f"MaskedMatmul: w_GDF must be [1, D, F] (got {tuple(w_GDF.shape)})")
    out = x_MD.dtype if self.out_dtype is None else self.out_dtype
    if quant.is_quantized(w_GDF) and _kernel_decoded(w_GDF.fmt, x_MD.shape[0]):
      # One group of all M rows through the platform's grouped matmul, which decodes w a
      # block at a time (the TPU kernel in VMEM).
      sizes_G = jnp.full((1,), x_MD.shape[0], jnp.int32)
      y_MF = grouped_matmul(x_MD, w_GDF, sizes_G, preferred_element_type=out)
    else:  # a float w, or int8's decode (a convert and a multiply), which XLA fuses
      y_MF = jnp.dot(x_MD, as_operand(w_GDF[0], x_MD.dtype), preferred_element_type=out)
    return jnp.where(self.valid_M[:, None], y_MF, jnp.zeros((), y_MF.dtype))

  def add_bias(self, y_MF: Float[Array, "M F"], b_GF: Float[Array, "G F"]) -> Float[Array, "M F"]:
    """`y[m] + b[0]` where `valid_M[m]`; padding rows stay as they are."""
    b_MF = jnp.where(self.valid_M[:, None], b_GF[0].astype(jnp.float32), 0.0)
    return (y_MF.astype(jnp.float32) + b_MF).astype(y_MF.dtype)


def _kernel_decoded(fmt: str, rows: int) -> bool:
  """Whether `MaskedMatmul` decodes a quantized w of `fmt` through the grouped matmul's
  kernel for `rows` rows: FP8 and MXFP4 always, int8 at up to `KERNEL_ROWS` rows."""
  return fmt in KERNEL_DECODED or (fmt == "int8" and rows <= KERNEL_ROWS)
