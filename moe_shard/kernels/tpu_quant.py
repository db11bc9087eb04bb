"""Grouped matmul on quantized weights: a Pallas TPU kernel that dequantizes w block by block.

    y[m]  = x[m]  @ deq(w)[g(m)]     forward,     x: [M, D], y: [M, F]
    dx[m] = dy[m] @ deq(w)[g(m)]^T   transposed,  dy: [M, F], dx: [M, D]
    rows m >= sum(group_sizes) are zeros

for w a `QuantizedArray` standing for f[G, D, F] (`quant.py`). No float copy of w exists in
HBM: each grid step fetches a block of the stored values and the scales of the same region,
decodes them in VMEM in float32 (`deq = f32(decode) * f32(scale)`, cast to `w.dtype`, then to
x's dtype: exactly `w.dequantize(x.dtype)`) and feeds the MXU, accumulating in float32. The
transposed kernel is what the backward of the forward needs (quantized weights are frozen:
there is no dw kernel).

The grid is megablox's (`jax.experimental.pallas.ops.tpu.megablox.gmm`, whose group
metadata it reuses): (output column tiles, active row tiles, contraction tiles), a float32
VMEM accumulator, and a store mask that writes only the rows of the tile's group. The
dequantized block lives in a VMEM scratch and is decoded again only when the w block changes:
with one contraction tile (the default where VMEM allows), consecutive row tiles of a group
share it, so each group's block is decoded once per column tile, not once per row tile.

Per format, the blocks of one w region [d rows, f columns] (d along D, f along F):

    format   values block                  scales block                     scales in
    "int8"   int8[d, f]                    f32[1, f]                        VMEM
    "fp8"    float8_e4m3fn[d, f]           the group's f32[D/128, F/128]    SMEM
    "mxfp4"  u8[d/2, f]                    u8[d/32, f]                      VMEM

  * fp8: d and f are multiples of 128, so each block's scales are whole. They are scalars,
    read from SMEM, each multiplying one 128 x 128 sub-block: a VMEM block of them,
    [d/128, f/128], would have a lane dimension neither a multiple of 128 nor whole. The
    e4m3 codes are decoded from their bits with integer operations (bitcast to uint8 in
    VMEM): exact on every generation, whether or not Mosaic converts float8 itself (and an
    XLA bitcast outside the kernel would copy w).
  * mxfp4: byte row i holds logical rows 2i (low nibble) and 2i + 1 (high nibble), so the
    block decodes into two planes [d/2, f], the even and the odd rows, and the dot is split
    into x_even @ even + x_odd @ odd, x's columns de-interleaved outside the kernel (two
    strided slices of the activations, one XLA pass: Mosaic has no strided store of 16-bit
    rows that would interleave the planes in VMEM). The transposed kernel writes the even
    and odd output columns as two arrays, interleaved outside. Each scale covers 16 packed
    rows; the u8 scales block is converted whole to a float32 scratch, whose 8-row tiles a
    chunk of 128 packed rows can index (Mosaic loads u8 rows in 32-row tiles, and fetches
    whole ones: a D tile is D itself or a multiple of 1024).
  * The block is decoded in chunks of rows (`Layout.chunk_rows`), so the float32
    temporaries stay a few MiB whatever the tiles.

The tile arithmetic (`Layout`, `default_tiling`, `vmem_bytes`) and the argument checks are in
`tpu_quant_tiling.py`; `default_tiling` and `vmem_bytes` are re-exported here. Tiles must
divide D and F (w is never padded). x is padded with zero rows only where M is below one row
tile; above, the last row tile is partial. Every row tile is stored (`_visit_every_tile`),
rows past the groups as zeros, so the result needs no `where` or slice in XLA.
"""

from __future__ import annotations

import functools
import importlib

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from moe_shard.kernels.pallas import (
  clip_group_sizes,
  no_vma_check,
  round_up,
  vary_like,
)
from moe_shard.kernels.tpu_quant_tiling import (
  DTYPES,
  FP8_BLOCK,
  MXFP4_BLOCK,
  Layout,
  check_args,
  check_tiling,
  default_tiling,
  vmem_bytes,
)
from moe_shard.kernels.tpu_tiling import target_device_kind, vmem_limit
from moe_shard.quant import QuantizedArray
from moe_shard.sharding import match_vma, varying_axes

__all__ = ["DTYPES", "default_tiling", "quantized_gmm", "vmem_bytes"]

_mb = importlib.import_module("jax.experimental.pallas.ops.tpu.megablox.gmm")


def _f32_from_bits(bits):
  return lax.bitcast_convert_type(bits, jnp.float32)


def _decode_e4m3(b):
  """f32 of float8_e4m3fn codes given as int32 bytes: sign, 4 exponent bits (bias 7), 3
  mantissa bits; exponent 0 is subnormal (m * 2^-9); 0x7F and 0xFF are NaN."""
  e = (b >> 3) & 0xF
  m = b & 0x7
  normal = _f32_from_bits(((e + 120) << 23) | (m << 20))
  mag = jnp.where(e == 0, m.astype(jnp.float32) * (2.0**-9), normal)
  mag = jnp.where((b & 0x7F) == 0x7F, jnp.float32(jnp.nan), mag)
  return jnp.where((b & 0x80) != 0, -mag, mag)


def _decode_e2m1(c):
  """f32 of e2m1 codes (int32, 0..15), `quant.FP4_VALUES`: sign bit 3, exponent bits 2..1
  (bias 1), mantissa bit 0; exponent 0 gives 0 or 0.5."""
  e = (c >> 1) & 0x3
  m = c & 0x1
  bits = jnp.where(e == 0, m * 0x3F000000, ((e + 126) << 23) | (m << 22))
  return _f32_from_bits(bits | ((c & 0x8) << 28))


def _decode_e8m0(s):
  """f32 of e8m0 exponents (int32, 0..255): 2^(s - 127); s = 0 is the subnormal 2^-127,
  s = 255 NaN (`quant.E8M0_NAN`)."""
  return _f32_from_bits(jnp.where(s == 0, 0x00400000, jnp.where(s == 255, 0x7FC00000, s << 23)))


def _dequantize_block(lay, values_ref, scales_ref, deq_refs, d_idx, f_idx):
  """Decodes the w block in VMEM into `deq_refs` ([block_rows, f_tile] in x's dtype each)."""
  rows, cols = lay.chunk_rows, lay.f_tile
  # mxfp4: the u8 scales block whole (its rows are 32-row tiles in VMEM: a chunk's 8 rows
  # cannot be loaded at their offset), as float32 in a scratch whose 8-row tiles can.
  scales_f32_ref = deq_refs[-1]
  if lay.fmt == "mxfp4":
    scales_f32_ref[...] = _decode_e8m0(scales_ref[...].astype(jnp.int32))

  def finish(w_f32):
    return w_f32.astype(lay.w_dtype).astype(lay.x_dtype)

  def chunk(c, carry):
    r0 = c * rows if lay.static_chunks else pl.multiple_of(c * rows, rows)
    if lay.fmt == "int8":
      v = values_ref[pl.ds(r0, rows), :].astype(jnp.int32).astype(jnp.float32)
      deq_refs[0][pl.ds(r0, rows), :] = finish(v * scales_ref[...])
    elif lay.fmt == "fp8":
      # One SMEM scalar per 128 x 128 sub-block: rows of blocks from d_idx, columns from f_idx.
      for a in range(rows // FP8_BLOCK):
        ra = pl.multiple_of(r0 + a * FP8_BLOCK, FP8_BLOCK)
        row_block = d_idx * (lay.d_tile // FP8_BLOCK) + c * (rows // FP8_BLOCK) + a
        for b in range(cols // FP8_BLOCK):
          s = scales_ref[row_block, f_idx * (cols // FP8_BLOCK) + b]
          sl = (pl.ds(ra, FP8_BLOCK), pl.ds(b * FP8_BLOCK, FP8_BLOCK))
          v = lax.bitcast_convert_type(values_ref[sl], jnp.uint8).astype(jnp.int32)
          deq_refs[0][sl] = finish(_decode_e4m3(v) * s)
    else:
      v = values_ref[pl.ds(r0, rows), :].astype(jnp.int32)
      s_rows = rows // 16
      s0 = c * s_rows if lay.static_chunks else pl.multiple_of(c * s_rows, s_rows)
      s = scales_f32_ref[pl.ds(s0, s_rows), :]
      for plane, codes in enumerate((v & 0xF, v >> 4)):
        w = _decode_e2m1(codes).reshape(rows // 16, 16, cols) * s[:, None, :]
        deq_refs[plane][pl.ds(r0, rows), :] = finish(w.reshape(rows, cols))
    return carry

  if lay.static_chunks:
    for c in range(lay.block_rows // rows):
      chunk(c, None)
  else:
    lax.fori_loop(0, lay.block_rows // rows, chunk, None)


def _store_masks(group_metadata, grid_id, tm, cols):
  """[tm, cols] bools: the rows of this row tile that belong to its group (megablox's), and
  the rows past every group (zeros)."""
  group_offsets, group_ids, m_tile_ids = group_metadata
  g = group_ids[grid_id]
  rows = lax.broadcasted_iota(jnp.int32, (tm, cols), 0) + m_tile_ids[grid_id] * tm
  past = rows >= group_offsets[group_offsets.shape[0] - 1]
  return (rows >= group_offsets[g]) & (rows < group_offsets[g + 1]), past


def _kernel(lay, group_metadata, *refs):
  """One grid step (n_i, grid_id, k_i): decode the w block if it changed, multiply, and on
  the last contraction tile store the rows of the tile's group."""
  n_x = 1 if lay.transpose else lay.planes
  n_out = lay.planes if lay.transpose else 1
  x_refs = refs[:n_x]
  values_ref, scales_ref = refs[n_x : n_x + 2]
  out_refs = refs[n_x + 2 : n_x + 2 + n_out]
  acc_refs = refs[n_x + 2 + n_out : n_x + 2 + 2 * n_out]
  deq_refs = refs[n_x + 2 + 2 * n_out :]  # the decoded planes, then mxfp4's f32 scales
  _, group_ids, _ = group_metadata
  n_i, grid_id, k_i = pl.program_id(0), pl.program_id(1), pl.program_id(2)
  d_idx, f_idx = (n_i, k_i) if lay.transpose else (k_i, n_i)

  @pl.when(k_i == 0)
  def _zero():
    for acc in acc_refs:
      acc[...] = jnp.zeros_like(acc)

  # The block index (group, d, f) changes at every step with several contraction tiles;
  # with one, only where the group does (or a new column tile starts at grid_id 0).
  if lay.tiles_k > 1:
    _dequantize_block(lay, values_ref, scales_ref, deq_refs, d_idx, f_idx)
  else:
    prev = group_ids[jnp.maximum(grid_id - 1, 0)]

    @pl.when((grid_id == 0) | (group_ids[grid_id] != prev))
    def _decode():
      _dequantize_block(lay, values_ref, scales_ref, deq_refs, d_idx, f_idx)

  if lay.transpose:
    dy = x_refs[0][...]
    for acc, deq in zip(acc_refs, deq_refs[: lay.planes]):
      acc[...] += lax.dot_general(
        dy, deq[...], (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32
      )
  else:
    total = acc_refs[0][...]
    for x, deq in zip(x_refs, deq_refs[: lay.planes]):
      total += jnp.dot(x[...], deq[...], preferred_element_type=jnp.float32)
    acc_refs[0][...] = total

  @pl.when(k_i == lay.tiles_k - 1)
  def _store():
    for out, acc in zip(out_refs, acc_refs):
      mine, past = _store_masks(group_metadata, grid_id, lay.tm, out.shape[1])
      kept = jnp.where(past, 0.0, out[...].astype(jnp.float32))
      out[...] = lax.select(mine, acc[...], kept).astype(lay.out_dtype)


def quantized_gmm(
  x_MD,
  w: QuantizedArray,
  group_sizes_G,
  *,
  transpose_rhs=False,
  preferred_element_type=None,
  tiling=None,
  vmem_limit_bytes=None,
  interpret=False,
):
  """Multiplies each group of rows by its group's quantized matrix, dequantized in VMEM.

  Args:
    x_MD: bf16[M, D] or f32[M, D], rows sorted by group; with `transpose_rhs`, dy: [M, F].
    w: `QuantizedArray` standing for f[G, D, F] ("int8", "fp8" or "mxfp4").
    group_sizes_G: int[G] rows per group; rows past sum(group_sizes_G) give zeros (sizes
      are clipped to end by M).
    transpose_rhs: compute dx[m] = dy[m] @ deq(w)[g(m)]^T, [M, D] (default False:
      y[m] = x[m] @ deq(w)[g(m)], [M, F]).
    preferred_element_type: dtype of the result (default None: x's dtype). Products
      accumulate in float32.
    tiling: (tm, tk, tn): rows, contraction and output-column tiles (default None:
      `default_tiling`). Tiles along D and F divide them and are multiples of 128 (of 1024
      along D for "mxfp4") or the whole dimension.
    vmem_limit_bytes: the kernel's VMEM limit (default None: `tpu.vmem_limit` of the TPU
      traced for; Mosaic's default where it is not known, and in interpret mode).
    interpret: run the Pallas kernel in interpret mode, e.g. on CPU (default False).

  Returns:
    [M, F] (or [M, D] with `transpose_rhs`) in `preferred_element_type`. Not
    differentiable itself: the backward of the forward is the transposed call.

  Raises:
    TypeError: x not bfloat16/float32, w not a `QuantizedArray`, non-integer group sizes,
      a non-float `preferred_element_type`.
    ValueError: bad ranks, mismatched dimensions or groups, a bad tiling or VMEM limit.
  """
  fn = "quantized_gmm"
  x_MK, group_sizes_G, out_dtype = check_args(
    fn, x_MD, w, group_sizes_G, transpose_rhs, preferred_element_type
  )
  G, D, F = w.shape
  M = x_MK.shape[0]
  if vmem_limit_bytes is None:
    vmem_limit_bytes = None if interpret else vmem_limit(target_device_kind())
  elif (
    not isinstance(vmem_limit_bytes, int)
    or isinstance(vmem_limit_bytes, bool)
    or vmem_limit_bytes <= 0
  ):
    raise ValueError(f"{fn}: vmem_limit_bytes must be a positive int (got {vmem_limit_bytes!r})")
  if tiling is None:
    tiling = default_tiling(
      M,
      D,
      F,
      x_MK.dtype,
      w.fmt,
      num_groups=G,
      transpose_rhs=transpose_rhs,
      vmem_limit=vmem_limit_bytes,
    )
  tm, tk, tn = check_tiling(fn, tiling, w.fmt, D, F, transpose_rhs)
  group_sizes_G = clip_group_sizes(group_sizes_G, M)
  x_MK, values, scales, group_sizes_G = match_vma(x_MK, w.values, w.scales, group_sizes_G)
  # Padded only up to one row tile; past it the last row tile is partial (Mosaic reads
  # unspecified rows past the array, which no store keeps, and drops the writes past it).
  x_RK = jnp.pad(x_MK, ((0, max(tm - M, 0)), (0, 0)))
  lay = Layout(
    fmt=w.fmt,
    transpose=bool(transpose_rhs),
    tm=tm,
    tk=tk,
    tn=tn,
    tiles_k=(F if transpose_rhs else D) // tk,
    w_dtype=jnp.dtype(w.dtype),
    x_dtype=x_RK.dtype,
    out_dtype=out_dtype,
  )
  with no_vma_check():
    out = _call(lay, x_RK, values, scales, group_sizes_G, vmem_limit_bytes, bool(interpret))
  (out,) = vary_like(varying_axes(x_MK), out)
  return out[:M]


def _visit_every_tile(group_sizes_G, Q, tm):
  """megablox's group metadata, with one more grid step for each row tile past the groups:
  every row tile is stored, so the rows past the groups are the kernel's zeros (no `where`
  over the result in XLA). The added steps keep the last step's group, so its w block stays
  in VMEM. Returns ((group_offsets, group_ids, m_tile_ids), number of steps)."""
  (offsets, group_ids, m_tile_ids), active = _mb.make_group_metadata(
    group_sizes=group_sizes_G,
    m=Q,
    tm=tm,
    start_group=jnp.zeros((), jnp.int32),
    num_nonzero_groups=group_sizes_G.shape[0],
    visit_empty_groups=False,
  )
  used = (offsets[-1] + tm - 1) // tm  # row tiles holding a row of some group
  extra = Q // tm - used
  j = jnp.arange(group_ids.shape[0], dtype=jnp.int32) - active
  added = (j >= 0) & (j < extra)
  last_group = group_ids[jnp.maximum(active - 1, 0)]
  group_ids = jnp.where(added, last_group, group_ids)
  m_tile_ids = jnp.where(added, used + j, m_tile_ids)
  return (offsets, group_ids, m_tile_ids), active + extra


def _in_hbm(a, interpret):
  """`a` constrained to stay in HBM as the kernel's operand (off TPU, as it is)."""
  return a if interpret else pltpu.with_memory_space_constraint(a, pltpu.HBM)


@functools.partial(jax.jit, static_argnums=(0, 5, 6))
def _call(lay, x_RK, values, scales, group_sizes_G, vmem_limit_bytes, interpret):
  """The pallas_call, and the XLA reshapes of x, w and the result around it."""
  G, R = values.shape[0], x_RK.shape[0]
  Q = round_up(R, lay.tm)  # rows of the row tiles
  D, F = values.shape[1] * lay.planes, values.shape[2]
  N = D if lay.transpose else F
  tm, tk, tn, P = lay.tm, lay.tk, lay.tn, lay.planes
  group_metadata, num_steps = _visit_every_tile(group_sizes_G, Q, tm)

  def m_tile(n_i, grid_id, k_i, meta):
    return meta[2][grid_id]

  def group(grid_id, meta):
    return meta[1][grid_id]

  def d_f(n_i, k_i):
    return (n_i, k_i) if lay.transpose else (k_i, n_i)

  if lay.transpose or P == 1:
    xs = (x_RK,)
    x_block = (tm, tk)
  else:  # mxfp4 forward: x's even and odd columns, against the even and odd rows of w
    xs = (x_RK[:, 0::2], x_RK[:, 1::2])
    x_block = (tm, tk // 2)
  x_spec = pl.BlockSpec(x_block, lambda n, g, k, meta: (m_tile(n, g, k, meta), k))
  values_spec = pl.BlockSpec(
    (None, lay.block_rows, lay.f_tile), lambda n, g, k, meta: (group(g, meta), *d_f(n, k))
  )
  if lay.fmt == "int8":
    scales_spec = pl.BlockSpec(
      (None, 1, lay.f_tile), lambda n, g, k, meta: (group(g, meta), 0, d_f(n, k)[1])
    )
  elif lay.fmt == "fp8":
    scales_spec = pl.BlockSpec(
      (None, *scales.shape[1:]),
      lambda n, g, k, meta: (group(g, meta), 0, 0),
      memory_space=pltpu.SMEM,
    )
  else:
    scales_spec = pl.BlockSpec(
      (None, lay.d_tile // MXFP4_BLOCK, lay.f_tile),
      lambda n, g, k, meta: (group(g, meta), *d_f(n, k)),
    )
  n_out = P if lay.transpose else 1
  out_cols = tn // n_out
  out_spec = pl.BlockSpec((tm, out_cols), lambda n, g, k, meta: (m_tile(n, g, k, meta), n))
  out_shape = [jax.ShapeDtypeStruct((R, N // n_out), lay.out_dtype)] * n_out
  scratch = [pltpu.VMEM((tm, out_cols), jnp.float32)] * n_out
  scratch += [pltpu.VMEM((lay.block_rows, lay.f_tile), lay.x_dtype)] * P
  if lay.fmt == "mxfp4":  # the block's scales as float32
    scratch += [pltpu.VMEM((lay.d_tile // MXFP4_BLOCK, lay.f_tile), jnp.float32)]

  tiles_m = Q // tm
  w_bytes = values.size * values.dtype.itemsize + scales.size * scales.dtype.itemsize
  # w: each group's blocks once per column tile with one contraction tile (row tiles of a
  # group share them), else a [K, tn] column of blocks per row tile visited.
  w_fetched = w_bytes if lay.tiles_k == 1 else w_bytes // G * (tiles_m + G - 1)
  # x: once per column tile, or once in all where its block never changes (one row tile
  # and one contraction tile: the pipeline keeps the block it has).
  x_fetched = x_RK.size * x_RK.dtype.itemsize * (1 if tiles_m == lay.tiles_k == 1 else N // tn)
  cost = pl.CostEstimate(
    flops=2 * Q * D * F,
    transcendentals=0,
    bytes_accessed=x_fetched + w_fetched + R * N * jnp.dtype(lay.out_dtype).itemsize,
  )
  outs = pl.pallas_call(
    functools.partial(_kernel, lay),
    out_shape=out_shape,
    grid_spec=pltpu.PrefetchScalarGridSpec(
      num_scalar_prefetch=1,
      in_specs=[x_spec] * len(xs) + [values_spec, scales_spec],
      out_specs=[out_spec] * n_out,
      grid=(N // tn, num_steps, (F if lay.transpose else D) // tk),
      scratch_shapes=scratch,
    ),
    compiler_params=pltpu.CompilerParams(
      dimension_semantics=("parallel", "arbitrary", "arbitrary"),
      vmem_limit_bytes=vmem_limit_bytes,
    ),
    interpret=interpret,
    cost_estimate=cost,
  )(group_metadata, *xs, _in_hbm(values, interpret), _in_hbm(scales, interpret))
  if n_out == 1:
    return outs[0]
  return jnp.stack(outs, axis=-1).reshape(R, N)  # even and odd columns interleaved
