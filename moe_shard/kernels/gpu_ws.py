"""Warp-specialized grouped matmuls for NVIDIA Hopper (sm_90a), in Mosaic GPU Pallas.

    ragged_dot:            out[m] = lhs[m] @ rhs[g(m)]       (rhs^T with transpose_rhs)
    transposed_ragged_dot: out[g] = lhs[rows of g]^T @ rhs[rows of g]

The structure of JAX's dense `hopper_matmul_mgpu` (jax/experimental/pallas/ops/gpu) given
groups: each CTA runs three warpgroups, a producer that issues the TMA copies of a pipeline of
`max_concurrent_steps` stages (`plgpu.emit_pipeline_warp_specialized`) and two consumers that
each own a block_m x block_n float32 accumulator and issue the warpgroup MMAs. The CTA is
persistent: one per SM, looping over output tiles in planar-snake order. A consumer's epilogue
writes its tile to shared memory and issues its TMA stores without waiting for them: the stores
drain while the next tile's main loop runs, and only the next epilogue waits for them to have
read shared memory. JAX's `ragged_dot_mgpu` / `transposed_ragged_dot_mgpu`, which these
replace as `kernels.gpu`'s default, run one warpgroup per CTA that both waits for its copies
and computes, and wait for every tile's stores before the next tile.

ragged_dot (forward, and dx with transpose_rhs): a CTA tile is block_m rows by 2 * block_n
columns, the consumers side by side along the columns (CUTLASS's 128 x 256 "cooperative"
tile). Rows are visited as row tiles, each lying in one group: a tile of block_m rows that
two groups share is visited once per group, its rows outside the group computed but not
stored (a ladder of power-of-two TMA stores writes exactly the group's rows, as in
`ragged_dot_mgpu`). The list of (group, row block, first row, rows) per visited tile is made
outside the kernel (`row_tiles`, a few [G]-sized XLA ops) and read from global memory, so
the tile loop has no empty tiles and no per-tile search over the groups.

transposed_ragged_dot (dw): a CTA tile is 2 * block_m rows (of lhs's columns, D) by block_n
columns (F), the consumers one above the other; its main loop runs over the group's rows in
steps of block_k, a dynamic number of steps. Rows of a neighbouring group in the first or
last step are zeroed in shared memory by the consumer that reads them (each consumer reads
its own half of lhs's tile), so a non-finite value in a neighbour's dy row can still reach
dw through 0 * inf. An empty group runs one fully masked step, which writes its zeros.

Shapes must be multiples of the tiles (`kernels.gpu.padded_sizes` pads them); both kernels
write their inputs' dtype from float32 accumulators, and leave ragged_dot's rows past
sum(group_sizes) unwritten.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

# plgpu.ACC: the warpgroup MMA's register accumulator (re-exported by plgpu with a noqa,
# which the type checker reads as private).
ACC = plgpu.ACC  # pyright: ignore[reportPrivateImportUsage]

# Registers per thread left to the producer warpgroup (hopper_matmul_mgpu's choice); the two
# consumers share the rest of the 64K-register file (232 each).
MEMORY_REGISTERS = 40
WGS = 2  # consumer warpgroups per CTA


def _transforms(block_minor, dtype):
  """Shared-memory tiling and swizzle for a TMA-loaded MMA operand whose rows hold
  `block_minor` elements (128-byte swizzle for 64 bf16)."""
  swizzle = plgpu.find_swizzle(block_minor * jnp.dtype(dtype).itemsize * 8)
  elems = swizzle // jnp.dtype(dtype).itemsize
  return (plgpu.TilingTransform((8, elems)), plgpu.SwizzleTransform(swizzle))


def row_tiles(group_sizes_G, m, block_m):
  """The row tiles `ragged_dot` visits, as one int32 array read by the kernel.

  Tile t lies in group g_t: the rows [start_t, start_t + size_t) of row block b_t (rows
  b_t * block_m ...) belong to g_t, and a tile is listed for each (group, row block) pair
  that shares a row. There are at most cdiv(m, block_m) + G - 1 of them.

  Returns:
    int32[1 + 4 * T]: the number of tiles, then (g_t, b_t, start_t, size_t) for each of
    T = cdiv(m, block_m) + G - 1 slots (slots past the number of tiles hold zeros).
  """
  G = group_sizes_G.shape[0]
  T = pl.cdiv(m, block_m) + G - 1
  sizes_G = group_sizes_G.astype(jnp.int32)
  ends_G = jnp.cumsum(sizes_G)
  starts_G = ends_G - sizes_G
  first_G = starts_G // block_m
  blocks_G = jnp.where(sizes_G > 0, (ends_G - 1) // block_m - first_G + 1, 0)
  tile_ends_G = jnp.cumsum(blocks_G)
  t_T = jnp.arange(T, dtype=jnp.int32)
  g_T = jnp.minimum(jnp.searchsorted(tile_ends_G, t_T, side="right"), G - 1).astype(jnp.int32)
  b_T = first_G[g_T] + t_T - (tile_ends_G - blocks_G)[g_T]
  lo_T = jnp.maximum(starts_G[g_T], b_T * block_m)
  hi_T = jnp.minimum(ends_G[g_T], (b_T + 1) * block_m)
  valid_T = t_T < tile_ends_G[-1]
  tiles_T4 = jnp.stack([g_T, b_T, lo_T - b_T * block_m, hi_T - lo_T], axis=1) * valid_T[
    :, None
  ].astype(jnp.int32)
  return jnp.concatenate([tile_ends_G[-1:], tiles_T4.reshape(-1)]).astype(jnp.int32)


def group_steps(group_sizes_G, k, block_k):
  """The contraction steps of each group in `transposed_ragged_dot`, one int32 array.

  Group g's rows lie in the row blocks first_g ... first_g + steps_g - 1 (of block_k rows);
  in the first, rows before lo_g belong to an earlier group, in the last, rows from hi_g on
  to a later one. An empty group gets one step whose rows are all masked (lo_g = block_k),
  on a row block inside [0, k).

  Returns:
    int32[G, 4]: (first_g, steps_g, lo_g, hi_g).
  """
  sizes_G = group_sizes_G.astype(jnp.int32)
  ends_G = jnp.cumsum(sizes_G)
  starts_G = ends_G - sizes_G
  first_G = jnp.minimum(starts_G // block_k, k // block_k - 1)
  last_G = jnp.maximum((ends_G - 1) // block_k, first_G)
  lo_G = jnp.where(sizes_G > 0, starts_G - first_G * block_k, block_k)
  hi_G = jnp.where(sizes_G > 0, ends_G - last_G * block_k, block_k)
  return jnp.stack([first_G, last_G - first_G + 1, lo_G, hi_G], axis=1).astype(jnp.int32)


def _compiler_params():
  return plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup)


def _store_rows(o_smem, o_gmem, start, size, rows, col, max_rows):
  """TMA-stores rows [start, start + size) of `o_smem` to rows `rows + start ...` of
  `o_gmem` at columns `col`: one store per set bit of size (static row counts), one group."""
  n = o_smem.shape[1]
  count = 1 << (max_rows.bit_length() - 1)
  while count:

    @pl.when(size & count != 0)
    def _(start=start, count=count):  # pl.when calls it at once: bound for the linter
      plgpu.copy_smem_to_gmem(
        o_smem.at[pl.ds(start, count)],
        o_gmem.at[pl.ds(rows + start, count), pl.ds(col, n)],
        commit_group=False,
      )

    start += size & count
    count //= 2
  plgpu.commit_smem_to_gmem_group()


def ragged_dot(lhs, rhs, *, group_sizes, blocks, num_sms, transpose_rhs=False):
  """out = lhs[rows of g] @ rhs[g] for each group g, two consumer warpgroups per CTA.

  Args:
    lhs: bf16[M, K] (or f16), rows sorted by group; M a multiple of blocks.block_m.
    rhs: [G, K, N] ([G, N, K] with transpose_rhs), lhs's dtype; K a multiple of
      blocks.block_k, N of 2 * blocks.block_n.
    group_sizes: int32[G], summing to at most M.
    blocks: `kernels.gpu.BlockConfig` (block_m, block_n: each consumer's tile;
      block_k, max_concurrent_steps, grid_block_n: the snake's width in CTA tiles,
      epi_block_n: columns per epilogue store).
    num_sms: CTAs to launch (the GPU's SM count).
    transpose_rhs: multiply by rhs[g]^T (default False).

  Returns:
    [M, N] in lhs's dtype; rows past sum(group_sizes) unwritten.
  """
  m, k = lhs.shape
  n = rhs.shape[1 if transpose_rhs else 2]
  bm, bn, bk = blocks.block_m, blocks.block_n, blocks.block_k
  epi_n = blocks.epi_block_n or bn
  if m % bm or k % bk or n % (WGS * bn) or bn % epi_n:
    raise ValueError(f"ragged_dot: shapes {lhs.shape}, {rhs.shape} do not fit blocks {blocks}")
  dtype = lhs.dtype
  k_steps, grid_n = k // bk, n // (WGS * bn)
  tiles = row_tiles(group_sizes, m, bm)
  in_t = _transforms(bk, dtype)
  rhs_spec = (
    plgpu.BlockSpec((WGS * bn, bk), lambda s: (0, s), transforms=in_t)
    if transpose_rhs
    else plgpu.BlockSpec((bk, WGS * bn), lambda s: (s, 0), transforms=_transforms(WGS * bn, dtype))
  )

  def pipeline(body, compute_context):
    return plgpu.emit_pipeline_warp_specialized(
      body,
      grid=(k_steps,),
      memory_registers=MEMORY_REGISTERS,
      in_specs=[plgpu.BlockSpec((bm, bk), lambda s: (0, s), transforms=in_t), rhs_spec],
      wg_axis="wg",
      num_compute_wgs=WGS,
      max_concurrent_steps=blocks.max_concurrent_steps,
      compute_context=compute_context,
    )

  def kernel(tiles_gmem, lhs_gmem, rhs_gmem, out_gmem):
    ignore = lambda *_, **__: None
    rhs_shape = rhs_gmem.at[0]

    @functools.partial(
      pl.run_scoped,
      allocs=pipeline(ignore, ignore).get_allocations(lhs_gmem, rhs_shape),
      o_smem=plgpu.SMEM((WGS, bm, epi_n), dtype),
      collective_axes="wg",
    )
    def _(allocs, o_smem):
      wg = lax.axis_index("wg")
      num_tiles = tiles_gmem[0]

      @plgpu.nd_loop((num_tiles * grid_n,), collective_axes="sm")
      def _(info):
        ti, ni = plgpu.planar_snake(info.index[0], (num_tiles, grid_n), 1, blocks.grid_block_n)
        group = tiles_gmem[1 + 4 * ti]
        block = tiles_gmem[2 + 4 * ti]
        start = tiles_gmem[3 + 4 * ti]
        size = tiles_gmem[4 + 4 * ti]
        cols = pl.ds(ni * (WGS * bn), WGS * bn)
        wg_cols = pl.ds(wg * bn, bn)

        def compute_context(run):
          @functools.partial(pl.run_scoped, acc_ref=ACC((bm, bn), jnp.float32))
          def _(acc_ref):
            run(acc_ref)
            acc = acc_ref[...].astype(dtype)
            for e in range(bn // epi_n):
              # The previous stores from this consumer's buffer have read it.
              plgpu.wait_smem_to_gmem(0, wait_read_only=True)
              o_smem[wg] = acc[:, e * epi_n : (e + 1) * epi_n]
              plgpu.commit_smem()
              col = ni * (WGS * bn) + wg * bn + e * epi_n
              _store_rows(o_smem.at[wg], out_gmem, start, size, block * bm, col, min(bm, m))

        def mma(_, lhs_smem, rhs_smem, acc_ref):
          if transpose_rhs:
            b = rhs_smem.at[wg_cols].transpose((1, 0))
          else:
            b = rhs_smem.at[:, wg_cols]
          plgpu.wgmma(acc_ref, lhs_smem, b)
          plgpu.wgmma_wait(0)
          return acc_ref

        rhs_g = rhs_gmem.at[group]
        pipeline(mma, compute_context)(
          lhs_gmem.at[pl.ds(block * bm, bm), :],
          rhs_g.at[cols, :] if transpose_rhs else rhs_g.at[:, cols],
          allocations=allocs,
        )

    plgpu.wait_smem_to_gmem(0)

  return plgpu.kernel(
    kernel,
    out_type=jax.ShapeDtypeStruct((m, n), dtype),
    grid=(num_sms,),
    grid_names=("sm",),
    num_threads=WGS + 1,
    thread_name="wg",
    compiler_params=_compiler_params(),
  )(tiles, lhs, rhs)


def transposed_ragged_dot(lhs, rhs, *, group_sizes, blocks, num_sms):
  """out[g] = lhs[rows of g]^T @ rhs[rows of g], two consumer warpgroups per CTA.

  Args:
    lhs: bf16[K, M] (or f16), rows sorted by group; K a multiple of blocks.block_k, M of
      2 * blocks.block_m.
    rhs: [K, N], lhs's dtype; N a multiple of blocks.block_n.
    group_sizes: int32[G], summing to at most K.
    blocks: `kernels.gpu.BlockConfig` (block_m, block_n: each consumer's tile, block_k:
      rows per step, max_concurrent_steps, grid_block_n: the snake's width in CTA tiles).
    num_sms: CTAs to launch (the GPU's SM count).

  Returns:
    [G, M, N] in lhs's dtype (zeros for an empty group).
  """
  k, m = lhs.shape
  n = rhs.shape[1]
  g = group_sizes.shape[0]
  bm, bn, bk = blocks.block_m, blocks.block_n, blocks.block_k
  epi_n = blocks.epi_block_n or bn
  if k % bk or m % (WGS * bm) or n % bn or bn % epi_n:
    raise ValueError(
      f"transposed_ragged_dot: shapes {lhs.shape}, {rhs.shape} do not fit blocks {blocks}"
    )
  dtype = lhs.dtype
  grid_m, grid_n = m // (WGS * bm), n // bn
  steps = group_steps(group_sizes, k, bk).reshape(-1)
  lhs_t, rhs_t = _transforms(WGS * bm, dtype), _transforms(bn, dtype)
  specs = [
    plgpu.BlockSpec((bk, WGS * bm), lambda s: (s, 0), transforms=lhs_t),
    plgpu.BlockSpec((bk, bn), lambda s: (s, 0), transforms=rhs_t),
  ]

  def pipeline(body, compute_context, num_steps):
    return plgpu.emit_pipeline_warp_specialized(
      body,
      grid=(num_steps,),
      memory_registers=MEMORY_REGISTERS,
      in_specs=specs,
      wg_axis="wg",
      num_compute_wgs=WGS,
      max_concurrent_steps=blocks.max_concurrent_steps,
      compute_context=compute_context,
    )

  def kernel(steps_gmem, lhs_gmem, rhs_gmem, out_gmem):
    ignore = lambda *_, **__: None
    # Allocations for max_concurrent_steps slots (a static grid that long shrinks nothing).
    allocs = pipeline(ignore, ignore, blocks.max_concurrent_steps).get_allocations(
      lhs_gmem, rhs_gmem
    )

    @functools.partial(
      pl.run_scoped,
      allocs=allocs,
      o_smem=plgpu.SMEM((WGS, bm, epi_n), dtype, transforms=_transforms(epi_n, dtype)),
      collective_axes="wg",
    )
    def _(allocs, o_smem):
      wg = lax.axis_index("wg")

      @plgpu.nd_loop((g, grid_m * grid_n), collective_axes="sm")
      def _(info):
        gi = info.index[0]
        mi, ni = plgpu.planar_snake(info.index[1], (grid_m, grid_n), 1, blocks.grid_block_n)
        first = steps_gmem[4 * gi]
        num_steps = steps_gmem[4 * gi + 1]
        lo = steps_gmem[4 * gi + 2]
        hi = steps_gmem[4 * gi + 3]
        rows = pl.ds(pl.multiple_of(first * bk, bk), k)  # runs past k; never read there

        def compute_context(run):
          @functools.partial(pl.run_scoped, acc_ref=ACC((bm, bn), jnp.float32))
          def _(acc_ref):
            run(acc_ref)
            acc = acc_ref[...].astype(dtype)
            for e in range(bn // epi_n):
              # The previous store from this consumer's buffer has read it.
              plgpu.wait_smem_to_gmem(0, wait_read_only=True)
              o_smem[wg] = acc[:, e * epi_n : (e + 1) * epi_n]
              plgpu.commit_smem()
              plgpu.copy_smem_to_gmem(
                o_smem.at[wg],
                out_gmem.at[
                  gi, pl.ds(mi * (WGS * bm) + wg * bm, bm), pl.ds(ni * bn + e * epi_n, epi_n)
                ],
              )

        def mma(idx, lhs_smem, rhs_smem, acc_ref):
          (s,) = idx
          for w in range(WGS):  # static halves: each consumer masks only the rows it reads

            @pl.when(wg == w)
            def _(w=w):
              half = lhs_smem.at[:, pl.ds(w * bm, bm)]
              _mask_rows(half, (s == 0) & (lo > 0), lambda r: r >= lo)
              _mask_rows(half, (s == num_steps - 1) & (hi < bk), lambda r: r < hi)
              plgpu.wgmma(acc_ref, half.transpose((1, 0)), rhs_smem)

          plgpu.wgmma_wait(0)
          return acc_ref

        pipeline(mma, compute_context, num_steps)(
          lhs_gmem.at[rows, pl.ds(mi * (WGS * bm), WGS * bm)],
          rhs_gmem.at[rows, pl.ds(ni * bn, bn)],
          allocations=allocs,
        )

    plgpu.wait_smem_to_gmem(0)

  return plgpu.kernel(
    kernel,
    out_type=jax.ShapeDtypeStruct((g, m, n), dtype),
    grid=(num_sms,),
    grid_names=("sm",),
    num_threads=WGS + 1,
    thread_name="wg",
    compiler_params=_compiler_params(),
  )(steps, lhs, rhs)


def _mask_rows(ref, when, keep):
  """Zeros the rows r of a [block_k, block] shared-memory tile where not keep(r), if when."""

  @pl.when(when)
  def _():
    rows = plgpu.layout_cast(lax.broadcasted_iota(jnp.int32, ref.shape, 0), plgpu.Layout.WGMMA)
    ref[...] = ref[...] * keep(rows).astype(ref.dtype)
    plgpu.commit_smem()
