"""Grouped matmul on NVIDIA Hopper GPUs: Mosaic GPU Pallas kernels behind one
differentiable function.

    y[m] = x[m] @ w[g(m)]   for m < sum(group_sizes), rows of group g contiguous
    y[m] = 0                for m >= sum(group_sizes)

Forward `ragged_dot(x, w)`, backward dx = `ragged_dot(dy, w, transpose_rhs=True)` and
dw = `transposed_ragged_dot(x, dy)` (sm_90a: warpgroup MMAs, TMA copies), wired by our own
`custom_vjp`. Two kernel families, chosen by `BlockConfig.warp_specialized`: the
warp-specialized kernels of `kernels.gpu_ws` (the default: a TMA producer and two consumer
warpgroups per persistent CTA, epilogue stores overlapping the next tile, a list of row
tiles with none empty), and JAX's `ragged_dot_mgpu` / `transposed_ragged_dot_mgpu`
(`jax.experimental.pallas.ops.gpu`: one warpgroup per CTA, M / block_m + G - 1 row tiles,
some empty). Both do the routed FLOPs plus at most one tile per group boundary. What the
kernels do not take as is:

  * dtypes: x and w must have one dtype; bfloat16 or float16 here (the "mosaic_gpu" backend
    of `grouped_matmul` sends other dtypes to `lax.ragged_dot`). The kernels accumulate in
    float32 and write their inputs' dtype: y (and dx, dw) are rounded to x's dtype, then
    cast to `preferred_element_type`.
  * Shapes: the contracted dimension must be a multiple of block_k, the output columns of
    a CTA tile's, dw's rows (D) of a CTA tile's rows (`padded_sizes`). M is zero-padded to
    a multiple of the row tiles, D and F to the multiples their three uses need (256 with
    the default blocks), and y, dx, dw are sliced back. Padding copies x (M, D) and w
    (D, F) on every call: keep M, D and F multiples of 256 and no copy is made.
  * Rows past sum(group_sizes): never written (uninitialised memory), so y and dx are zeroed
    with a `where` (`kernels.pallas.zero_past_groups`). Group sizes are clipped to end by M.
    dw's kernel masks a neighbouring group's rows in a shared block by multiplying them by
    zero: a non-finite value in any row of x or dy (past the groups too) can reach dw.
  * `jax.shard_map` with check_vma: as for megablox (`kernels.pallas`): the pallas_calls are
    traced with the check off, their outputs cast to vary like the inputs.
  * Tracing off a GPU: JAX's `transposed_ragged_dot` reads the SM count from
    `jax.devices()[0]` while tracing. `lax.platform_dependent` traces the CUDA branch on
    any host it is given to (`gmm_impl="mosaic_gpu"` anywhere), so where the default device
    is not a GPU, JAX's dw is traced as `lax.ragged_dot_general` instead (never run there). The
    warp-specialized kernels take the SM count as an argument: 132 off a GPU.

Blocks (`BlockConfig`, default `default_blocks`): block_m rows per tile (dw: columns of D),
block_n output columns per tile (F; dx: D), per consumer warpgroup in the warp-specialized
kernels, block_k the contraction step (D; dx: F; dw: rows), max_concurrent_steps the
pipeline depth (shared memory holds that many steps of both operands), grid_block_n the
width of the tile order's snake (L2 reuse of x's tiles), epi_block_n the columns of each
epilogue store (warp-specialized).
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import math

import jax
import jax.numpy as jnp

from moe_shard.kernels import gpu_ws
from moe_shard.kernels.pallas import (
  check_inputs,
  clip_group_sizes,
  no_vma_check,
  round_up,
  vary_like,
  zero_past_groups,
)
from moe_shard.sharding import match_vma, varying_axes

DTYPES = (jnp.bfloat16, jnp.float16)  # what the kernels' warpgroup MMAs take here


@dataclasses.dataclass(frozen=True)
class BlockConfig:
  """The kernels' tile sizes (the same for forward, dx and dw; see the module doc).

  warp_specialized: JAX's single-warpgroup kernels (False) or `kernels.gpu_ws` (True),
  whose CTA holds two consumer warpgroups of block_m x block_n each (a CTA tile of
  block_m x 2 * block_n; dw: 2 * block_m x block_n) and a producer. There grid_block_n is
  the snake's width in CTA tiles and epi_block_n (default None: block_n) the columns of
  each epilogue store.
  """

  block_m: int = 128
  block_n: int = 128
  block_k: int = 64
  max_concurrent_steps: int = 4
  grid_block_n: int = 1
  warp_specialized: bool = False
  epi_block_n: int | None = None

  def kwargs(self):
    """The arguments of JAX's `ragged_dot_mgpu` kernels."""
    return {f: getattr(self, f) for f in _JAX_KERNEL_FIELDS}


_JAX_KERNEL_FIELDS = ("block_m", "block_n", "block_k", "max_concurrent_steps", "grid_block_n")


def default_blocks(M, D, F, dtype, *, num_groups=1):
  """The block config for x: dtype[M, D], w: dtype[G, D, F] on a Hopper GPU.

  Rule: the warp-specialized kernels (`kernels.gpu_ws`), each consumer warpgroup a
  block_m x block_n = 128 x 128 tile (two 64-row warpgroup MMAs by a 128-wide tile; a CTA
  tile of 128 x 256, CUTLASS's cooperative tile), block_k = 128 bytes of the dtype (64
  elements: one 128-byte swizzled shared-memory row), max_concurrent_steps = 4 (4 steps of
  128x64 + 64x256 bf16 = 192 KiB of the 227 KiB of shared memory) with the epilogue in
  64-column stores (2 x 16 KiB), and the tile order's snake 4 CTA tiles wide. The arguments
  are the problem's; the rule reads the dtype.

  Args:
    M, D, F: problem sizes (ints).
    dtype: the inputs' dtype (2 bytes: bfloat16 or float16).
    num_groups: G (default 1).

  Returns:
    BlockConfig.
  """
  del M, D, F, num_groups
  return BlockConfig(
    block_k=128 // jnp.dtype(dtype).itemsize,
    grid_block_n=4,
    warp_specialized=True,
    epi_block_n=64,
  )


def padded_sizes(M, D, F, blocks):
  """(Q, Dp, Fp): M, D, F rounded up to what the three kernels need with these blocks.

  Rows: the row tiles (block_m) and dw's contraction step (block_k). D: the forward's
  contraction (block_k), dx's output columns (a CTA tile's columns), dw's rows (a CTA
  tile's rows). F: the forward's output columns, dx's contraction (block_k), dw's columns.
  JAX's kernels: a CTA tile is block_m x block_n and the snake's width (grid_block_n)
  must divide the output columns; the warp-specialized ones: 2 * block_n columns (dw:
  2 * block_m rows).
  """
  b = blocks
  wide = 2 if b.warp_specialized else 1
  cols = b.block_n * (wide if b.warp_specialized else b.grid_block_n)
  return (
    round_up(max(M, 1), math.lcm(b.block_m, b.block_k)),
    round_up(D, math.lcm(b.block_k, cols, b.block_m * wide)),
    round_up(F, math.lcm(cols, b.block_k)),
  )


@functools.cache
def _kernels():
  """The kernel modules, imported on first use (they pull in Mosaic GPU's Python side)."""
  return (
    importlib.import_module("jax.experimental.pallas.ops.gpu.ragged_dot_mgpu"),
    importlib.import_module("jax.experimental.pallas.ops.gpu.transposed_ragged_dot_mgpu"),
  )


def _default_device_is_a_gpu():
  """Whether `transposed_ragged_dot` can read the SM count it needs while tracing."""
  return getattr(jax.devices()[0], "core_count", None) is not None


def _num_sms():
  """CTAs the warp-specialized kernels launch: the GPU's SM count (132 on an H100 or H200
  SXM where the default device is not a GPU: the kernel is then only traced)."""
  return getattr(jax.devices()[0], "core_count", None) or 132


def _row_kernel(lhs, rhs, group_sizes, blocks, transpose_rhs=False):
  """lhs[rows of g] @ rhs[g] (rhs[g]^T with transpose_rhs) by the kernels `blocks` names."""
  if blocks.warp_specialized:
    return gpu_ws.ragged_dot(
      lhs,
      rhs,
      group_sizes=group_sizes,
      blocks=blocks,
      num_sms=_num_sms(),
      transpose_rhs=transpose_rhs,
    )
  rd, _ = _kernels()
  return rd.ragged_dot(
    lhs, rhs, group_sizes=group_sizes, transpose_rhs=transpose_rhs, **blocks.kwargs()
  )


def _dw_kernel(x_QD, dy_QF, group_sizes_G, blocks):
  """dw[g] = x[rows of g]^T @ dy[rows of g] by the kernels `blocks` names; empty groups
  zero."""
  if blocks.warp_specialized:
    return gpu_ws.transposed_ragged_dot(
      x_QD, dy_QF, group_sizes=group_sizes_G, blocks=blocks, num_sms=_num_sms()
    )
  if not _default_device_is_a_gpu():  # traced off a GPU (see the module doc): never run here
    return _dw_reference(x_QD, dy_QF, group_sizes_G)
  _, trd = _kernels()
  return trd.transposed_ragged_dot(x_QD, dy_QF, group_sizes=group_sizes_G, **blocks.kwargs())


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _gmm(x_QD, w_GDF, group_sizes_G, blocks):
  with no_vma_check():
    y_QF = _row_kernel(x_QD, w_GDF, group_sizes_G, blocks)
  (y_QF,) = vary_like(varying_axes(x_QD), y_QF)
  return zero_past_groups(y_QF, group_sizes_G)


def _gmm_fwd(x_QD, w_GDF, group_sizes_G, blocks):
  return _gmm(x_QD, w_GDF, group_sizes_G, blocks), (x_QD, w_GDF, group_sizes_G)


def _gmm_bwd(blocks, res, dy_QF):
  x_QD, w_GDF, group_sizes_G = res
  dy_QF = dy_QF.astype(x_QD.dtype)  # the kernels take one dtype (f32 accumulation inside)
  with no_vma_check():
    # dx = dy @ w[g]^T: contraction over F, output columns over D.
    dx_QD = _row_kernel(dy_QF, w_GDF, group_sizes_G, blocks, transpose_rhs=True)
    # dw[g] = x[rows of g]^T @ dy[rows of g]; empty groups written with zeros.
    dw_GDF = _dw_kernel(x_QD, dy_QF, group_sizes_G, blocks)
  dx_QD, dw_GDF = vary_like(varying_axes(x_QD), dx_QD, dw_GDF.astype(w_GDF.dtype))
  return zero_past_groups(dx_QD, group_sizes_G), dw_GDF, None


_gmm.defvjp(_gmm_fwd, _gmm_bwd)


def _dw_reference(x_QD, dy_QF, group_sizes_G):
  dims = jax.lax.RaggedDotDimensionNumbers(
    dot_dimension_numbers=(((0,), (0,)), ((), ())),
    lhs_ragged_dimensions=[0],
    rhs_group_dimensions=[],
  )
  return jax.lax.ragged_dot_general(
    x_QD, dy_QF, group_sizes_G, dims, preferred_element_type=jnp.float32
  ).astype(x_QD.dtype)


def _positive_divisor(v, n):
  return isinstance(v, int) and not isinstance(v, bool) and v > 0 and n % v == 0


def mosaic_gpu_gmm(x_MD, w_GDF, group_sizes_G, *, preferred_element_type=None, blocks=None):
  """Multiplies each group of rows by its group's matrix with JAX's Hopper kernels.

  Args:
    x_MD: bf16[M, D] or f16[M, D], rows sorted by group.
    w_GDF: f[G, D, F], one matrix per group (cast to the dtype of `x_MD`).
    group_sizes_G: int[G] rows per group; rows past sum(group_sizes_G) give zeros (and
      sizes are clipped to end by M). Not differentiable.
    preferred_element_type: dtype of y (default None: the dtype of `x_MD`). Products
      accumulate in float32; y is rounded to x's dtype before the cast.
    blocks: `BlockConfig` (default None: `default_blocks`).

  Returns:
    y_MF: [M, F] in `preferred_element_type`, differentiable w.r.t. `x_MD` and `w_GDF`
    (dx and dw by the kernels too: routed FLOPs only).

  Raises:
    TypeError: `x_MD` not bfloat16/float16, non-float `w_GDF` or `preferred_element_type`,
      non-integer group sizes.
    ValueError: bad ranks, mismatched D or G, a `blocks` that is not a BlockConfig of
      positive ints.
  """
  fn = "mosaic_gpu_gmm"
  x_MD, w_GDF, group_sizes_G, out_dtype = check_inputs(
    fn, x_MD, w_GDF, group_sizes_G, DTYPES, "the Mosaic GPU kernels", preferred_element_type
  )
  (M, D), (G, _, F) = x_MD.shape, w_GDF.shape
  if blocks is None:
    blocks = default_blocks(M, D, F, x_MD.dtype, num_groups=G)
  if (
    not isinstance(blocks, BlockConfig)
    or not all(
      isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in blocks.kwargs().values()
    )
    or not isinstance(blocks.warp_specialized, bool)
    or not (blocks.epi_block_n is None or _positive_divisor(blocks.epi_block_n, blocks.block_n))
  ):
    raise ValueError(
      f"{fn}: blocks must be a BlockConfig of positive ints, epi_block_n None or a divisor "
      f"of block_n (got {blocks!r})"
    )
  group_sizes_G = clip_group_sizes(group_sizes_G, M)
  x_MD, w_GDF, group_sizes_G = match_vma(x_MD, w_GDF.astype(x_MD.dtype), group_sizes_G)
  Q, Dp, Fp = padded_sizes(M, D, F, blocks)
  x_QD = jnp.pad(x_MD, ((0, Q - M), (0, Dp - D)))
  w_GDF = jnp.pad(w_GDF, ((0, 0), (0, Dp - D), (0, Fp - F)))
  y_QF = _gmm(x_QD, w_GDF, group_sizes_G, blocks)
  # JAX types a custom_vjp made with functools.partial as returning object.
  return y_QF[:M, :F].astype(out_dtype)  # pyright: ignore[reportIndexIssue]
