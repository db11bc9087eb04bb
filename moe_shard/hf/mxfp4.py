"""MXFP4 (OCP microscaling FP4), the format of gpt-oss's expert weights, both ways.

A quantized matrix `w` of the checkpoint is two tensors:

    w_blocks: u8[..., N, G, 16]  32 FP4 (e2m1) codes per row of a block, two per byte,
                                 the low nibble first (element 2i), the high nibble second
    w_scales: u8[..., N, G]      one shared exponent per block of 32, biased by 127

    value[..., n, 32 g + 2 i]     = FP4[blocks[..., n, g, i] & 0xF] * 2 ** (scales[..., n, g] - 127)
    value[..., n, 32 g + 2 i + 1] = FP4[blocks[..., n, g, i] >> 4]  * 2 ** (scales[..., n, g] - 127)

giving f[..., N, 32 G]; transformers then swaps the last two axes
(`integrations/mxfp4.py`, `convert_moe_packed_tensors`), which `hf.layouts` does.

`quantize` is the inverse. Given the scales a checkpoint stores, a block whose values are
all FP4 values times its scale (as every value `dequantize` gives is) is encoded exactly, so
saving unchanged weights gives back the same bytes. A block with a value that is not
(a trained weight) gets a fresh scale: the smallest power of two 2^e with max|v| / 2^e <= 6,
and each value v / 2^e rounded to the nearest FP4 value, ties to the even code.
"""

from __future__ import annotations

import numpy as np

# The 16 values of an e2m1 code: sign bit 3, exponent bits 2..1, mantissa bit 0.
FP4_VALUES = np.array(
  [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0],
  np.float32,
)


def dequantize(blocks, scales, dtype):
  """Returns the values of MXFP4 blocks: f[..., N, 32 G] in `dtype`.

  Args:
    blocks: u8[..., N, G, 16] packed FP4 codes, low nibble first.
    scales: u8[..., N, G] block exponents, biased by 127.
    dtype: the NumPy dtype of the result (the values are exact in bfloat16 and float32).

  Returns:
    f[..., N, 32 G] (the checkpoint's [out, in] order; transformers' layout is its transpose).
  """
  blocks = np.asarray(blocks, np.uint8)
  scales = np.asarray(scales, np.uint8)
  if blocks.shape[:-1] != scales.shape:
    raise ValueError(
      f"mxfp4.dequantize: blocks {blocks.shape} and scales {scales.shape} must agree on "
      f"all but the last axis of blocks"
    )
  *lead, G, B = blocks.shape
  codes = np.stack([blocks & 0x0F, blocks >> 4], axis=-1).reshape(*lead, G, 2 * B)
  exp = scales.astype(np.int32) - 127
  values = np.ldexp(FP4_VALUES[codes], exp[..., None])
  return values.reshape(*lead, G * 2 * B).astype(dtype)


# The magnitudes of codes 0..7; code | 8 is the negative.
_MAGNITUDES = FP4_VALUES[:8].astype(np.float64)


def _round_to_fp4(q):
  """The e2m1 codes nearest to q (|q| <= 6), ties to the even code, the sign kept (-0 -> 8)."""
  a = np.abs(q)
  hi = np.clip(np.searchsorted(_MAGNITUDES, a), 1, 7)
  lo = hi - 1
  d_lo, d_hi = a - _MAGNITUDES[lo], _MAGNITUDES[hi] - a
  code = np.where((d_hi < d_lo) | ((d_hi == d_lo) & (hi % 2 == 0)), hi, lo)
  return (code | np.where(np.signbit(q), 8, 0)).astype(np.uint8)


def quantize(values, scales=None):
  """Returns the MXFP4 (blocks, scales) of values f[..., N, 32 G], the inverse of `dequantize`.

  Args:
    values: f[..., N, 32 G], finite, in the checkpoint's [out, in] order.
    scales: u8[..., N, G] block exponents to keep where they fit (default None: fresh ones
      everywhere). A block keeps its given scale s when every value times 2 ** (127 - s) is
      an FP4 value; any other block gets the smallest power of two that brings its max
      magnitude to <= 6, its values rounded to the nearest FP4 value, ties to even.

  Returns:
    (blocks: u8[..., N, G, 16] packed codes, low nibble first; scales: u8[..., N, G]).
  """
  v = np.asarray(values, np.float64)
  *lead, K = v.shape
  if K % 32:
    raise ValueError(f"mxfp4.quantize: the last axis of values must be a multiple of 32 (got {K})")
  if not np.all(np.isfinite(v)):
    raise ValueError("mxfp4.quantize: values must be finite (got inf or nan)")
  v = v.reshape(*lead, K // 32, 32)
  amax = np.abs(v).max(-1)
  fresh = np.ceil(np.log2(np.maximum(amax, np.finfo(np.float64).tiny) / 6.0))
  fresh = np.clip(fresh, -127, 128).astype(np.int32) + 127
  if scales is None:
    s = fresh
  else:
    s = np.asarray(scales, np.int32)
    if s.shape != v.shape[:-1]:
      raise ValueError(
        f"mxfp4.quantize: scales must have shape {v.shape[:-1]} for values {tuple(values.shape)} "
        f"(got {s.shape})"
      )
    q = np.ldexp(v, (127 - s)[..., None])
    fits = np.isin(np.abs(q), _MAGNITUDES).all(-1)
    s = np.where(fits, s, fresh)
  codes = _round_to_fp4(np.ldexp(v, (127 - s)[..., None]))
  blocks = codes[..., 0::2] | (codes[..., 1::2] << 4)
  return blocks.astype(np.uint8), s.astype(np.uint8)
