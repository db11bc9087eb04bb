"""MXFP4 (OCP microscaling FP4), the format of gpt-oss's expert weights: dequantization.

A quantized matrix `w` of the checkpoint is two tensors:

    w_blocks: u8[..., N, G, 16]  32 FP4 (e2m1) codes per row of a block, two per byte,
                                 the low nibble first (element 2i), the high nibble second
    w_scales: u8[..., N, G]      one shared exponent per block of 32, biased by 127

    value[..., n, 32 g + 2 i]     = FP4[blocks[..., n, g, i] & 0xF] * 2 ** (scales[..., n, g] - 127)
    value[..., n, 32 g + 2 i + 1] = FP4[blocks[..., n, g, i] >> 4]  * 2 ** (scales[..., n, g] - 127)

giving f[..., N, 32 G]; transformers then swaps the last two axes
(`integrations/mxfp4.py`, `convert_moe_packed_tensors`), which `hf.layouts` does.
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
