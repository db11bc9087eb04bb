"""Grouped matmul on TPU: JAX's megablox Pallas kernels behind one differentiable function.

    y[m] = x[m] @ w[g(m)]   for m < sum(group_sizes), rows of group g contiguous
    y[m] = 0                for m >= sum(group_sizes)

Forward `gmm(x, w)`; backward dx = `gmm(dy, w, transpose_rhs=True)`, dw = `tgmm(x^T, dy)`
(`jax.experimental.pallas.ops.tpu.megablox`, wired by our own `custom_vjp` as its `ops.py`
does). Each kernel visits only the row tiles that hold a group's rows, once per group (a
tile two groups share is multiplied twice): the routed FLOPs plus at most one tile per
group boundary inside a tile. What megablox does not take as is:

  * M: padded with zero rows to a multiple of the row tile `tm` (megablox requires it).
  * D, F: zero-padded to multiples of the column tiles (multiples of 128, the MXU's width);
    y and dw are sliced back. The padding copies x and w on every call: keep D and F
    multiples of 128 (model widths are) and no copy is made.
  * Rows past sum(group_sizes): megablox never writes them (uninitialised; NaN in interpret
    mode), so y and dx are zeroed with a `where` (fused into y's consumer by XLA). Group
    sizes are clipped to end by M: rows past M belong to no group.
  * `jax.shard_map` with check_vma: megablox's pallas_calls declare outputs without mesh-axis
    types, which Pallas rejects there; they are traced with JAX's internal check_vma flag
    off and their outputs cast to vary like the inputs. Inputs that do not vary (e.g.
    replicated w) are cast to varying first (`sharding.match_vma`, as in `grouped_matmul`),
    so a replicated w's gradient comes back summed over the devices. (The other helpers,
    shared with the GPU backend `kernels.gpu`, live in `kernels.pallas`.)

megablox also takes `group_offset` (groups [offset, offset + rhs groups) of the sizes, rhs
holding only those: a device's local experts) and `existing_out` (accumulate into an
aliased output); neither is part of this backend's contract.
"""

from __future__ import annotations

import functools
import importlib

import jax
import jax.numpy as jnp

from moe_shard.kernels.pallas import (
  check_inputs,
  clip_group_sizes,
  no_vma_check,
  round_up,
  vary_like,
  zero_past_groups,
)
from moe_shard.sharding import match_vma
from moe_shard.sharding import varying_axes as _varying_axes

# The kernel module, not `megablox.gmm` (the package re-exports ops.gmm under that name).
_mb = importlib.import_module("jax.experimental.pallas.ops.tpu.megablox.gmm")

LANES = 128  # width of the MXU and of a vector register: tk, tn are multiples of it
MAX_ROW_TILE = 512
ROW_TILE = 256
MAX_COL_TILE = 1024
# Of the 16 MiB of VMEM Mosaic lets a kernel use by default on v5e; Mosaic adds ~1 MiB
# (compiled at D=2048, F=4096 the three kernels use 11.3-13.4 MiB).
VMEM_BUDGET = 12 * 2**20
DTYPES = (jnp.bfloat16, jnp.float32)  # what megablox's kernels accept


def _lane_tile(n, cap):
  """The largest multiple of 128 that divides n rounded up to 128, at most max(cap, 128)."""
  lanes = round_up(max(n, 1), LANES) // LANES
  return LANES * max(d for d in range(1, max(cap // LANES, 1) + 1) if lanes % d == 0)


def vmem_bytes(tm, tk, tn, itemsize):
  """VMEM bytes of the largest of the three kernels: blocks double-buffered, f32 scratch.

  fwd: x[tm, tk], w[tk, tn], y[tm, tn] (f32 at worst), acc[tm, tn]; dx: the same with tk,
  tn swapped, dx in x's dtype; tgmm: x[tm, tk], dy[tm, tn], dw[tk, tn], acc[tk, tn].
  """
  b = itemsize
  fwd = 2 * b * (tm * tk + tk * tn) + (2 * 4 + 4) * tm * tn
  dx = 2 * b * (tm * tn + tn * tk) + (2 * b + 4) * tm * tk
  dw = 2 * b * (tm * tk + tm * tn) + (2 * b + 4) * tk * tn
  return max(fwd, dx, dw)


def default_tiling(M, D, F, dtype, *, num_groups=1):
  """Picks megablox's tiles (tm, tk, tn) for x: dtype[M, D] and w: dtype[G, D, F].

  Rule: tm = 512 rows if (G - 1) * 512 <= 3M/4, else 256, at most M rounded up to 128.
  Why: each row tile reads its group's whole w[g] from HBM, 2*tm*D*F FLOPs per 2*D*F bytes
  (bf16), tm FLOP/byte against v5e's ~240 (197 TFLOP/s / 819 GB/s); with x and y traffic a
  256-row tile is HBM-bound and takes ~0.64 of a 512-row one (D=2048, F=4096). But each
  group boundary inside a tile costs one more tile (up to G - 1): (M/512 + G - 1) * 1 and
  (M/256 + G - 1) * 0.64 cross at (G - 1) * 512 ~ 0.8 M. tk, tn: the largest multiple of
  128 dividing D (F) rounded up to 128, at most 1024 (fewer re-reads of x, fewer grid
  steps), the larger one lowered until `vmem_bytes` fits VMEM_BUDGET (f32: tk = 512).

  Args:
    M, D, F: problem sizes (ints).
    dtype: the inputs' dtype (its size sets the VMEM use).
    num_groups: G (default 1).

  Returns:
    (tm, tk, tn): ints, multiples of 128.
  """
  b = jnp.dtype(dtype).itemsize
  tm = MAX_ROW_TILE if 4 * (num_groups - 1) * MAX_ROW_TILE <= 3 * M else ROW_TILE
  tm = min(tm, round_up(max(M, 1), LANES))
  tk, tn = _lane_tile(D, MAX_COL_TILE), _lane_tile(F, MAX_COL_TILE)
  while vmem_bytes(tm, tk, tn, b) > VMEM_BUDGET and max(tk, tn) > LANES:
    if tk >= tn:
      tk = _lane_tile(D, tk - LANES)
    else:
      tn = _lane_tile(F, tn - LANES)
  return tm, tk, tn


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
def _gmm(x_QD, w_GDF, group_sizes_G, out_dtype, tiling, interpret):
  with no_vma_check():
    y_QF = _mb.gmm(x_QD, w_GDF, group_sizes_G, out_dtype, tiling, interpret=interpret)
  (y_QF,) = vary_like(_varying_axes(x_QD), y_QF)
  return zero_past_groups(y_QF, group_sizes_G)


def _gmm_fwd(x_QD, w_GDF, group_sizes_G, out_dtype, tiling, interpret):
  y_QF = _gmm(x_QD, w_GDF, group_sizes_G, out_dtype, tiling, interpret)
  return y_QF, (x_QD, w_GDF, group_sizes_G)


def _gmm_bwd(out_dtype, tiling, interpret, res, dy_QF):
  del out_dtype
  x_QD, w_GDF, group_sizes_G = res
  tm, tk, tn = tiling
  dy_QF = dy_QF.astype(x_QD.dtype)  # bf16 in, bf16 products (f32 accumulation)
  with no_vma_check():
    # dx = dy @ w[g]^T: contraction over F (tile tn), output columns over D (tile tk).
    dx_QD = _mb.gmm(
      dy_QF, w_GDF, group_sizes_G, x_QD.dtype, (tm, tn, tk), transpose_rhs=True, interpret=interpret
    )
    # dw[g] = x[rows of g]^T @ dy[rows of g]; every group written, empty ones with zeros.
    dw_GDF = _mb.tgmm(
      x_QD.swapaxes(0, 1),
      dy_QF,
      group_sizes_G,
      w_GDF.dtype,
      tiling,
      num_actual_groups=w_GDF.shape[0],
      interpret=interpret,
    )
  dx_QD, dw_GDF = vary_like(_varying_axes(x_QD), dx_QD, dw_GDF)
  return zero_past_groups(dx_QD, group_sizes_G), dw_GDF, None


_gmm.defvjp(_gmm_fwd, _gmm_bwd)


def megablox_gmm(
  x_MD, w_GDF, group_sizes_G, *, preferred_element_type=None, tiling=None, interpret=False
):
  """Multiplies each group of rows by its group's matrix with megablox's TPU kernels.

  Args:
    x_MD: bf16[M, D] or f32[M, D], rows sorted by group.
    w_GDF: f[G, D, F], one matrix per group (cast to the dtype of `x_MD`).
    group_sizes_G: int[G] rows per group; rows past sum(group_sizes_G) give zeros (and
      sizes are clipped to end by M). Not differentiable.
    preferred_element_type: dtype of y (default None: the dtype of `x_MD`). Products
      accumulate in float32 either way.
    tiling: (tm, tk, tn) row, D and F tiles (default None: `default_tiling`); tm a positive
      multiple of 8, tk and tn multiples of 128.
    interpret: run the Pallas kernels in interpret mode, e.g. on CPU (default False).

  Returns:
    y_MF: [M, F] in `preferred_element_type`, differentiable w.r.t. `x_MD` and `w_GDF`
    (dx, dw also by megablox: dw = tgmm(x^T, dy), routed FLOPs only).

  Raises:
    TypeError: `x_MD` not bfloat16/float32, non-float `w_GDF` or `preferred_element_type`,
      non-integer group sizes.
    ValueError: bad ranks, mismatched D or G, bad tiling.
  """
  fn = "megablox_gmm"
  x_MD, w_GDF, group_sizes_G, out_dtype = check_inputs(
    fn, x_MD, w_GDF, group_sizes_G, DTYPES, "megablox's kernels", preferred_element_type
  )
  (M, D), (G, _, F) = x_MD.shape, w_GDF.shape
  if tiling is None:
    tiling = default_tiling(M, D, F, x_MD.dtype, num_groups=G)
  if (
    not isinstance(tiling, (tuple, list))
    or len(tiling) != 3
    or not all(isinstance(t, int) and not isinstance(t, bool) and t > 0 for t in tiling)
    or tiling[0] % 8
    or tiling[1] % LANES
    or tiling[2] % LANES
  ):
    raise ValueError(
      f"{fn}: tiling must be (tm, tk, tn), positive ints, tm a multiple of "
      f"8, tk and tn multiples of {LANES} (got {tiling!r})"
    )
  tm, tk, tn = tiling = tuple(tiling)
  # Sizes that end by M: rows past M (and the padding below) belong to no group.
  group_sizes_G = clip_group_sizes(group_sizes_G, M)
  x_MD, w_GDF, group_sizes_G = match_vma(x_MD, w_GDF.astype(x_MD.dtype), group_sizes_G)
  Q, Dp, Fp = round_up(max(M, 1), tm), round_up(D, tk), round_up(F, tn)
  x_QD = jnp.pad(x_MD, ((0, Q - M), (0, Dp - D)))
  w_GDF = jnp.pad(w_GDF, ((0, 0), (0, Dp - D), (0, Fp - F)))
  y_QF = _gmm(x_QD, w_GDF, group_sizes_G, out_dtype, tiling, bool(interpret))
  # JAX types a custom_vjp made with functools.partial as returning object.
  return y_QF[:M, :F]  # pyright: ignore[reportIndexIssue]
