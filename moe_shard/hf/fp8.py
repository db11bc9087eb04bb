"""Block-FP8, the format of DeepSeek-V3/R1's and Qwen3-FP8's weights, both ways.

config.json has `quantization_config = {"quant_method": "fp8", "weight_block_size": [bo, bi],
...}` ([128, 128] in the releases), and each quantized `nn.Linear` weight `w` is two tensors:

    w:                 f8e4m3[out, in]
    w_scale_inv:       f32[ceil(out / bo), ceil(in / bi)]   one scale per bo x bi block

    value[o, i] = f32(w[o, i]) * w_scale_inv[o // bo, i // bi]

`quantize` is the inverse with the stored scales: each value divided by its block's scale
(in float32), rounded to the nearest e4m3 value; a quotient up to one e4m3 step (32) past
e4m3's largest value 448 saturates to +-448, since rounding `code * scale` to the load's
dtype can carry a 448 code a little past it (real releases set scale = amax / 448, so
nearly every block holds one). What comes back bit for bit: every code `dequantize` gives
in float32 or bfloat16 (all 254 finite codes, -0 included, for any normal float32 scale:
the load's rounding moves a value by at most 2^-9 of itself, far less than half an e4m3
step), so a checkpoint loaded as floats and saved unchanged is the same bytes. Not bit for
bit: the NaN codes (0x7F, 0xFF), which come back as NaN but raise here; and float16, where
`code * scale` below float16's normal range (6.1e-5) loses bits.
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


# e4m3's step between its two largest values (416, 448): quotients up to 448 + this
# saturate to 448.
E4M3_TOP_STEP = 32.0


def quantize(name, values, scale_inv, block):
  """Returns f8e4m3[out, in] codes of `values` with the given block scales, nearest-even;
  quotients in (448, 480] saturate to 448 (module docstring).

  Raises:
    ValueError: a value that is not finite, or whose quotient by its block's scale is more
      than one e4m3 step beyond 448, naming the tensor: it does not fit the stored scales.
  """
  v = np.asarray(values, np.float32)
  q = v / _expand(np.asarray(scale_inv, np.float32), block, v.shape)
  if not np.all(np.isfinite(q)):
    raise ValueError(
      f"save_moe_layers: tensor {name!r} holds a value that is not finite (NaN or Inf); "
      f"block-FP8 codes are finite numbers"
    )
  worst = float(np.max(np.abs(q))) if q.size else 0.0
  if worst > E4M3_MAX + E4M3_TOP_STEP:
    raise ValueError(
      f"save_moe_layers: tensor {name!r} has a value of {worst} times its block's scale "
      f"(weight_scale_inv), beyond FP8 e4m3's {E4M3_MAX} by more than one step "
      f"({E4M3_TOP_STEP}): block-FP8 tensors are written with the stored scales; save to a "
      f"checkpoint without quantization_config, or rescale"
    )
  return np.clip(q, -E4M3_MAX, E4M3_MAX).astype(E4M3)
