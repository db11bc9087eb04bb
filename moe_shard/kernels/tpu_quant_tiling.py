"""Tile arithmetic and argument checks of the quantized grouped matmul (`tpu_quant.py`).

Pure Python on static sizes, no Pallas: `Layout` (one kernel's format, direction, tiles and
dtypes, and the blocks and decoding chunks they imply), `default_tiling`, `vmem_bytes`, and
`check_args` / `check_tiling`, which raise on bad arguments before the kernel is traced.

The kernel never pads w (a padded copy would be the float-sized copy it avoids), so a tile
along D or F divides the dimension and is the dimension itself or a multiple of the
format's unit: 128 (`LANES`) along F; along D 128 for "int8", `FP8_BLOCK` for "fp8", and
32 * `MXFP4_BLOCK` = 1024 for "mxfp4" (the u8 scales block has d/32 rows, which Mosaic
fetches in whole 32-row tiles). `default_tiling` starts at full width and lowers tiles until
`vmem_bytes` fits the VMEM budget.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax.numpy as jnp

from moe_shard import _checks
from moe_shard.kernels.pallas import round_up
from moe_shard.kernels.tpu_tiling import LANES, MAX_ROW_TILE, ROW_TILE, vmem_budget
from moe_shard.quant import FORMATS, QuantizedArray

DTYPES = (jnp.bfloat16, jnp.float32)  # x's dtypes, as megablox
FP8_BLOCK = 128  # rows and columns of one "fp8" scale
MXFP4_BLOCK = 32  # logical rows of one "mxfp4" scale: 16 packed rows
# Rows of the smallest row tile: a multiple of 16 (a bf16 VMEM tile's rows); at decode sizes
# the row tile is M rounded up to it, so few rows are neither padded nor computed past M.
MIN_ROW_TILE = 16
# Elements of w decoded at a time: the float32 temporaries of one chunk stay a few MiB.
CHUNK_ELEMENTS = 256 * 1024


@dataclasses.dataclass(frozen=True)
class Layout:
  """Static facts of one kernel: the format, the direction, the tiles and the dtypes."""

  fmt: str
  transpose: bool
  tm: int
  tk: int
  tn: int
  tiles_k: int
  w_dtype: Any
  x_dtype: Any
  out_dtype: Any

  @property
  def planes(self):
    """Planes a w block decodes into: the even and odd rows for mxfp4, else one."""
    return 2 if self.fmt == "mxfp4" else 1

  @property
  def d_tile(self):
    return self.tn if self.transpose else self.tk

  @property
  def f_tile(self):
    return self.tk if self.transpose else self.tn

  @property
  def block_rows(self):
    """Rows of the stored values block (packed rows for mxfp4)."""
    return self.d_tile // self.planes

  @property
  def chunk_rows(self):
    """Stored rows decoded at a time: a divisor of `block_rows`, a multiple of 32 (the
    8-bit values' VMEM tile; 128 for fp8's scale blocks, 128 for mxfp4 where it divides,
    so a chunk's 8 scale rows start on a float32 tile) with at most CHUNK_ELEMENTS
    elements where one divides; the whole block if 32 does not divide it."""
    rows = self.block_rows
    unit = FP8_BLOCK if self.fmt == "fp8" else 32
    if self.fmt == "mxfp4" and rows % 128 == 0:
      unit = 128
    if rows % unit:
      return rows
    fits = [r for r in range(unit, rows + 1, unit) if rows % r == 0]
    return max([r for r in fits if r * self.f_tile <= CHUNK_ELEMENTS] or [unit])

  @property
  def static_chunks(self):
    """Whether the chunks are unrolled (offsets known when compiling): for mxfp4 chunks
    whose scale rows (rows / 16) do not start on a float32 tile of 8 rows."""
    return self.fmt == "mxfp4" and (self.chunk_rows // 16) % 8 != 0


def _d_unit(fmt):
  """What a tile along D must be a multiple of (unless it is D itself)."""
  # mxfp4: the u8 scales block has d/32 rows, which Mosaic fetches in whole 32-row tiles.
  return {"int8": LANES, "fp8": FP8_BLOCK, "mxfp4": 32 * MXFP4_BLOCK}[fmt]


def _tile_ok(t, size, unit):
  return size % t == 0 and (t == size or t % unit == 0)


def _tiles_of(size, unit):
  """The tiles allowed along a dimension of `size`: multiples of `unit` dividing it, and
  `size` itself; largest first."""
  return sorted({size} | {t for t in range(unit, size, unit) if size % t == 0}, reverse=True)


def vmem_bytes(fmt, tm, tk, tn, itemsize, *, transpose_rhs=False):
  """VMEM bytes of the kernel's blocks and scratch: x, values, scales and the output
  double-buffered (the output as float32 at worst), the float32 accumulator, the decoded
  block in x's dtype, and the float32 temporaries of one decoded chunk."""
  d, f = (tn, tk) if transpose_rhs else (tk, tn)
  values = d * f // (2 if fmt == "mxfp4" else 1)
  scales = {"int8": 8 * f * 4, "fp8": 0, "mxfp4": max(d // MXFP4_BLOCK, 32) * f}[fmt]
  blocks = 2 * (tm * tk * itemsize + values + scales + tm * tn * 4)
  return blocks + 4 * tm * tn + d * f * itemsize + 6 * 4 * CHUNK_ELEMENTS


def default_tiling(M, D, F, dtype, fmt, *, num_groups=1, transpose_rhs=False, vmem_limit=None):
  """Picks the tiles (tm, tk, tn) for x: dtype[M, K] and w: f[G, D, F] in `fmt`.

  tk tiles the contraction (D forward, F transposed) and tn the output columns (F forward,
  D transposed), as megablox's tiling. Both start at full width and the larger one is
  lowered, to the next allowed tile (`_tiles_of`: a divisor of its dimension, a multiple
  of 128, of 1024 along D for mxfp4), until `vmem_bytes` fits `tpu.vmem_budget(vmem_limit)`.
  Full width decodes each group's block once per column tile (consecutive row tiles of a
  group share it) and reads x once. Rows: tm = 512 if (G - 1) * 512 <= 3M/4, else 256 (each
  group boundary inside a row tile costs one more tile; `tpu.default_tiling`), at most M
  rounded up to `MIN_ROW_TILE` (16): at decode sizes one row tile of all M rows, so x is
  not padded and each w block is read once.

  Args:
    M, D, F: problem sizes (ints); D and F divisible by the format's blocks.
    dtype: x's dtype (its size sets the VMEM use).
    fmt: "int8", "fp8" or "mxfp4".
    num_groups: G (default 1).
    transpose_rhs: tiles for the transposed kernel (default False).
    vmem_limit: the kernel's VMEM limit in bytes (default None: Mosaic's default).

  Returns:
    (tm, tk, tn): ints.
  """
  b = jnp.dtype(dtype).itemsize
  budget = vmem_budget(vmem_limit)
  tm = MAX_ROW_TILE if 4 * (num_groups - 1) * MAX_ROW_TILE <= 3 * M else ROW_TILE
  tm = min(tm, round_up(max(M, 1), MIN_ROW_TILE))
  d_tiles, f_tiles = _tiles_of(D, _d_unit(fmt)), _tiles_of(F, LANES)
  k_tiles, n_tiles = (f_tiles, d_tiles) if transpose_rhs else (d_tiles, f_tiles)
  i = j = 0
  while vmem_bytes(fmt, tm, k_tiles[i], n_tiles[j], b, transpose_rhs=transpose_rhs) > budget:
    if k_tiles[i] >= n_tiles[j] and i + 1 < len(k_tiles):
      i += 1
    elif j + 1 < len(n_tiles):
      j += 1
    elif i + 1 < len(k_tiles):
      i += 1
    else:
      break
  return tm, k_tiles[i], n_tiles[j]


def check_args(fn, x_MK, w, group_sizes_G, transpose_rhs, preferred_element_type):
  """Argument checks; returns (x_MK, group_sizes_G, out_dtype)."""
  x_MK = _checks.float_array(fn, "x_MD", x_MK, ndim=2)
  if x_MK.dtype not in DTYPES:
    names = " or ".join(jnp.dtype(d).name for d in DTYPES)
    raise TypeError(f"{fn}: x_MD must be {names} (got {x_MK.dtype})")
  if not isinstance(w, QuantizedArray):
    raise TypeError(f"{fn}: w must be a QuantizedArray (got {type(w).__name__})")
  if w.fmt not in FORMATS:
    raise ValueError(f"{fn}: w.fmt must be one of {FORMATS} (got {w.fmt!r})")
  if w.values.ndim != 3:
    raise ValueError(f"{fn}: w must stand for a matrix per group [G, D, F] (got {w.shape})")
  G, D, F = w.shape
  K = F if transpose_rhs else D
  if x_MK.shape[1] != K:
    what = "F (transpose_rhs=True)" if transpose_rhs else "D"
    raise ValueError(f"{fn}: x_MD's columns ({x_MK.shape[1]}) must equal w's {what} ({K})")
  group_sizes_G = _checks.int_array(fn, "group_sizes_G", group_sizes_G)
  if group_sizes_G.shape != (G,):
    raise ValueError(
      f"{fn}: group_sizes_G must have shape ({G},), one per group of w "
      f"(got {tuple(group_sizes_G.shape)})"
    )
  out_dtype = jnp.dtype(x_MK.dtype if preferred_element_type is None else preferred_element_type)
  if not jnp.issubdtype(out_dtype, jnp.floating):
    raise TypeError(f"{fn}: preferred_element_type must be a float dtype (got {out_dtype})")
  return x_MK, group_sizes_G, out_dtype


def check_tiling(fn, tiling, fmt, D, F, transpose_rhs):
  if (
    not isinstance(tiling, (tuple, list))
    or len(tiling) != 3
    or not all(isinstance(t, int) and not isinstance(t, bool) and t > 0 for t in tiling)
    or tiling[0] % 8
  ):
    raise ValueError(
      f"{fn}: tiling must be (tm, tk, tn), positive ints, tm a multiple of 8 (got {tiling!r})"
    )
  tm, tk, tn = tiling
  d, f = (tn, tk) if transpose_rhs else (tk, tn)
  for name, t, size, unit in (("D", d, D, _d_unit(fmt)), ("F", f, F, LANES)):
    if not _tile_ok(t, size, unit):
      raise ValueError(
        f"{fn}: the tile along {name} ({t}) must divide {name} ({size}) and be {name} "
        f"itself or a multiple of {unit} for {fmt!r} weights (tiling {tuple(tiling)})"
      )
  return tm, tk, tn
