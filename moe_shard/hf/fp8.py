"""Block-FP8, the format of DeepSeek-V3/R1's and Qwen3-FP8's weights, both ways.

config.json has `quantization_config = {"quant_method": "fp8", "weight_block_size": [bo, bi],
...}` ([128, 128] in the releases), and each quantized `nn.Linear` weight `w` is two tensors:

    w:                 f8e4m3[out, in]
    w_scale_inv:       f32[ceil(out / bo), ceil(in / bi)]   one scale per bo x bi block

    value[o, i] = f32(w[o, i]) * w_scale_inv[o // bo, i // bi]

`quantize` is the inverse with the stored scales: each value divided by its block's scale,
rounded to the nearest e4m3 value. Every value `dequantize` gives, in float32 or bfloat16,
comes back to its code, so unchanged weights are saved bit for bit.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np

E4M3 = np.dtype(ml_dtypes.float8_e4m3fn)
E4M3_MAX = float(ml_dtypes.finfo(ml_dtypes.float8_e4m3fn).max)  # 448


def _expand(scale_inv, block, shape, row0=0):
  """The [out, in] grid of each element's block scale, from row `row0` of the blocks' rows."""
  bo, bi = block
  return np.repeat(np.repeat(scale_inv, bo, 0), bi, 1)[row0 : row0 + shape[0], : shape[1]]


def check(name, shape, scale_shape, block):
  """Returns why tensor `name` cannot be block-FP8 of this shape, or None."""
  bo, bi = block
  if len(shape) != 2:
    return f"block-FP8 tensor {name!r} must be 2-D [out, in] (got shape {tuple(shape)})"
  want = (-(-shape[0] // bo), -(-shape[1] // bi))
  if tuple(scale_shape) != want:
    return (
      f"tensor {name + '_scale_inv'!r} has shape {tuple(scale_shape)}, but {name!r} "
      f"{tuple(shape)} in blocks of {list(block)} implies {want}"
    )
  return None


def dequantize(w, scale_inv, block, dtype, row0=0):
  """Returns the values of a block-FP8 matrix, f[out, in] in `dtype`.

  Args:
    w: f8e4m3[out, in] (rows of the matrix: `row0` says where they start in scale_inv's
      first block row).
    scale_inv: f32[ceil(out / bo), ceil(in / bi)] (the block rows that cover `w`).
    block: (bo, bi), `quantization_config.weight_block_size`.
    dtype: the NumPy dtype of the result (the product is formed in float32).
    row0: the row of the first block row at which `w` starts (default 0).
  """
  w = np.asarray(w).astype(np.float32)
  scale = _expand(np.asarray(scale_inv, np.float32), block, w.shape, row0)
  return (w * scale).astype(dtype)


def quantize(name, values, scale_inv, block):
  """Returns f8e4m3[out, in] codes of `values` with the given block scales, nearest-even.

  Raises:
    ValueError: a value whose quotient by its block's scale is beyond e4m3's range (+-448)
      or not finite, naming the tensor: it does not fit the stored scales.
  """
  v = np.asarray(values, np.float32)
  q = v / _expand(np.asarray(scale_inv, np.float32), block, v.shape)
  if not np.all(np.abs(q) <= E4M3_MAX):
    raise ValueError(
      f"save_moe_layers: tensor {name!r} has a value of {float(np.nanmax(np.abs(q)))} times "
      f"its block's scale (weight_scale_inv), beyond FP8 e4m3's {E4M3_MAX}: block-FP8 "
      f"tensors are written with the stored scales; save to a checkpoint without "
      f"quantization_config, or rescale"
    )
  return q.astype(E4M3)
