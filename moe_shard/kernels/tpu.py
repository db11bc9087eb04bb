"""Grouped matmul on TPU: JAX's megablox Pallas kernels behind one differentiable function.

    y[m] = x[m] @ w[g(m)]   for m < sum(group_sizes), rows of group g contiguous
    y[m] = 0                for m >= sum(group_sizes)

Forward `gmm(x, w)`; backward dx = `gmm(dy, w, transpose_rhs=True)`, dw = `tgmm(x^T, dy)`
(`jax.experimental.pallas.ops.tpu.megablox`, wired by our own `custom_vjp` as its `ops.py`
does). Each kernel visits only the row tiles that hold a group's rows, once per group (a
tile two groups share is multiplied twice): the routed FLOPs plus at most one tile per
group boundary inside a tile. What megablox does not take as is:

  * M: padded with zero rows to a multiple of the row tile `tm` (megablox requires it).
  * D, F: not padded. Widths that are not multiples of the column tiles (gpt-oss's 2880)
    end in a partial tile: megablox masks the contraction's last tile to its `k_rem`
    columns, and Pallas clips the out-of-bounds part of an output block. (Padding w
    would copy all of it on every call: 0.54 GB per gpt-oss-120b matrix on a chip.)
  * VMEM: megablox sets no VMEM limit (Mosaic's default, 16 MiB on v5e, of v5e's 128 MiB)
    and takes none; the limit of the TPU generation traced for (`vmem_limit`) is added to
    the compiler parameters it builds while it traces, and the tiles grow to fill it
    (`default_tiling`); the forward's to fill it alone.
  * Declared bytes: with one contraction tile, gmm declares the bytes its pipeline fetches
    (`fetched_once_bytes`), not megablox's one w[g] per possible row tile.
  * Rows past sum(group_sizes): megablox never writes them (uninitialised; NaN in interpret
    mode), so y and dx are zeroed with a `where` (fused into y's consumer by XLA). Group
    sizes are clipped to end by M: rows past M belong to no group.
  * `jax.shard_map` with check_vma: megablox's pallas_calls declare outputs without mesh-axis
    types, which Pallas rejects there; they are traced with JAX's internal check_vma flag
    off and their outputs cast to vary like the inputs. Inputs that do not vary (e.g.
    replicated w) are cast to varying first (`sharding.match_vma`, as in `grouped_matmul`),
    so a replicated w's gradient comes back summed over the devices. (The other helpers,
    shared with the GPU backend `kernels.gpu`, live in `kernels.pallas`.)

megablox's `group_offset` and `existing_out` are not part of this backend's contract.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib
import threading

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from moe_shard.kernels.pallas import (
  check_inputs,
  clip_group_sizes,
  no_vma_check,
  round_up,
  vary_like,
  zero_past_groups,
)
from moe_shard.kernels.tpu_tiling import (  # noqa: F401 - re-exported: megablox's tiles
  DTYPES,
  KERNELS,
  LANES,
  VMEM_CAPACITY,
  default_tiling,
  fetched_once_bytes,
  target_device_kind,
  tgmm_fits,
  vmem_budget,
  vmem_bytes,
  vmem_limit,
)
from moe_shard.sharding import match_vma
from moe_shard.sharding import varying_axes as _varying_axes

# The kernel module, not `megablox.gmm` (the package re-exports ops.gmm under that name).
_mb = importlib.import_module("jax.experimental.pallas.ops.tpu.megablox.gmm")


class _PltpuWithVmemLimit:
  """`jax.experimental.pallas.tpu` whose `CompilerParams` set `vmem_limit_bytes`."""

  def __init__(self, limit):
    self._limit = limit

  def __getattr__(self, name):
    return getattr(pltpu, name)

  def CompilerParams(self, *args, **kwargs):  # the name megablox calls
    return pltpu.CompilerParams(*args, vmem_limit_bytes=self._limit, **kwargs)


class _PlWithCost:
  """`jax.experimental.pallas` whose `CostEstimate` declares `bytes_accessed` bytes."""

  def __init__(self, bytes_accessed):
    self._bytes = bytes_accessed

  def __getattr__(self, name):
    return getattr(pl, name)

  def CostEstimate(self, **kwargs):  # the name megablox calls
    return pl.CostEstimate(**dict(kwargs, bytes_accessed=self._bytes))


_PATCH_LOCK = threading.Lock()


@contextlib.contextmanager
def _megablox_traced(tiles):
  """While megablox traces, its kernels get the VMEM limit and declared bytes of `tiles`.

  megablox builds its `pltpu.CompilerParams` and `pl.CostEstimate` itself, with no VMEM
  limit and no argument for one or for its cost: its module's `pltpu` and `pl` are
  replaced, while it traces, by ones that add them (under a lock, restored after). Its
  functions are jitted with the tiling static, so the tiling is a `_Tiles` that holds
  both: a trace under one limit or cost is never reused under another. A tuple: no change.
  """
  if not isinstance(tiles, _Tiles):
    yield
    return
  with _PATCH_LOCK:
    if tiles.vmem_limit is not None:
      setattr(_mb, "pltpu", _PltpuWithVmemLimit(tiles.vmem_limit))  # noqa: B010 - a module global
    if tiles.bytes_accessed is not None:
      setattr(_mb, "pl", _PlWithCost(tiles.bytes_accessed))  # noqa: B010
    try:
      yield
    finally:
      setattr(_mb, "pltpu", pltpu)  # noqa: B010
      setattr(_mb, "pl", pl)  # noqa: B010


@dataclasses.dataclass(frozen=True)
class _Tiles:
  """A tiling for megablox (which calls it with (m, k, n)) keyed also by the VMEM limit and
  the bytes the kernel declares (None: megablox's own)."""

  tm: int
  tk: int
  tn: int
  vmem_limit: int | None
  bytes_accessed: int | None = None

  def __call__(self, m, k, n):
    del m, k, n
    return self.tm, self.tk, self.tn


def _tiles(tiling, limit, bytes_accessed=None):
  tm, tk, tn = tiling
  none = limit is None and bytes_accessed is None
  return (tm, tk, tn) if none else _Tiles(tm, tk, tn, limit, bytes_accessed)


def _call_gmm(lhs, w_GDF, group_sizes_G, out_dtype, tiling, vmem_limit, interpret, transpose):
  """megablox's gmm, its declared bytes those it fetches where that is known."""
  b, ob = jnp.dtype(lhs.dtype).itemsize, jnp.dtype(out_dtype).itemsize
  fetched = fetched_once_bytes(lhs.shape, w_GDF.shape, tiling, b, ob, transpose)
  tiles = _tiles(tiling, vmem_limit, fetched)
  with no_vma_check(), _megablox_traced(tiles):
    return _mb.gmm(
      lhs, w_GDF, group_sizes_G, out_dtype, tiles, transpose_rhs=transpose, interpret=interpret
    )


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5, 6))
def _gmm(x_QD, w_GDF, group_sizes_G, out_dtype, tilings, vmem_limit, interpret):
  # tilings: (forward's, backward's) (tm, tk, tn).
  y_QF = _call_gmm(x_QD, w_GDF, group_sizes_G, out_dtype, tilings[0], vmem_limit, interpret, False)
  (y_QF,) = vary_like(_varying_axes(x_QD), y_QF)
  return zero_past_groups(y_QF, group_sizes_G)


def _gmm_fwd(x_QD, w_GDF, group_sizes_G, out_dtype, tilings, vmem_limit, interpret):
  y_QF = _gmm(x_QD, w_GDF, group_sizes_G, out_dtype, tilings, vmem_limit, interpret)
  return y_QF, (x_QD, w_GDF, group_sizes_G)


def _gmm_bwd(out_dtype, tilings, vmem_limit, interpret, res, dy_QF):
  del out_dtype
  x_QD, w_GDF, group_sizes_G = res
  tiling = tilings[1]
  tm, tk, tn = tiling
  dy_QF = dy_QF.astype(x_QD.dtype)  # bf16 in, bf16 products (f32 accumulation)
  # dx = dy @ w[g]^T: contraction over F (tile tn), output columns over D (tile tk).
  dx_QD = _call_gmm(
    dy_QF, w_GDF, group_sizes_G, x_QD.dtype, (tm, tn, tk), vmem_limit, interpret, True
  )
  tiles = _tiles(tiling, vmem_limit)
  with no_vma_check(), _megablox_traced(tiles):
    # dw[g] = x[rows of g]^T @ dy[rows of g]; every group written, empty ones with zeros.
    dw_GDF = _mb.tgmm(
      x_QD.swapaxes(0, 1),
      dy_QF,
      group_sizes_G,
      w_GDF.dtype,
      tiles,
      num_actual_groups=w_GDF.shape[0],
      interpret=interpret,
    )
  dx_QD, dw_GDF = vary_like(_varying_axes(x_QD), dx_QD, dw_GDF)
  return zero_past_groups(dx_QD, group_sizes_G), dw_GDF, None


_gmm.defvjp(_gmm_fwd, _gmm_bwd)


def megablox_gmm(
  x_MD,
  w_GDF,
  group_sizes_G,
  *,
  preferred_element_type=None,
  tiling=None,
  vmem_limit_bytes=None,
  interpret=False,
):
  """Multiplies each group of rows by its group's matrix with megablox's TPU kernels.

  Args:
    x_MD: bf16[M, D] or f32[M, D], rows sorted by group.
    w_GDF: f[G, D, F], one matrix per group (cast to the dtype of `x_MD`).
    group_sizes_G: int[G] rows per group; rows past sum(group_sizes_G) give zeros (and
      sizes are clipped to end by M). Not differentiable.
    preferred_element_type: dtype of y (default None: the dtype of `x_MD`). Products
      accumulate in float32 either way.
    tiling: (tm, tk, tn) row, D and F tiles of the three kernels (default None:
      `default_tiling` for the VMEM limit, the forward's with `forward=True`); tm a
      positive multiple of 8, tk and tn multiples of 128.
    vmem_limit_bytes: the kernels' VMEM limit (default None: `vmem_limit` of the TPU
      traced for, `target_device_kind()`; Mosaic's default where it is not known, and in
      interpret mode).
    interpret: run the Pallas kernels in interpret mode, e.g. on CPU (default False).

  Returns:
    y_MF: [M, F] in `preferred_element_type`, differentiable w.r.t. `x_MD` and `w_GDF`
    (dx, dw also by megablox: dw = tgmm(x^T, dy), routed FLOPs only).

  Raises:
    TypeError: `x_MD` not bfloat16/float32, non-float `w_GDF` or `preferred_element_type`,
      non-integer group sizes.
    ValueError: bad ranks, mismatched D or G, bad tiling, a VMEM limit that is not a
      positive int.
  """
  fn = "megablox_gmm"
  x_MD, w_GDF, group_sizes_G, out_dtype = check_inputs(
    fn, x_MD, w_GDF, group_sizes_G, DTYPES, "megablox's kernels", preferred_element_type
  )
  (M, D), (G, _, F) = x_MD.shape, w_GDF.shape
  if vmem_limit_bytes is None:
    vmem_limit_bytes = None if interpret else vmem_limit(target_device_kind())
  elif (
    not isinstance(vmem_limit_bytes, int)
    or isinstance(vmem_limit_bytes, bool)
    or vmem_limit_bytes <= 0
  ):
    raise ValueError(f"{fn}: vmem_limit_bytes must be a positive int (got {vmem_limit_bytes!r})")
  if tiling is not None and (
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
  if tiling is None:
    tiles = functools.partial(
      default_tiling, M, D, F, x_MD.dtype, num_groups=G, vmem_limit=vmem_limit_bytes
    )
    tilings = (tiles(forward=True), tiles())
  else:
    tilings = (tuple(tiling), tuple(tiling))
  tm = tilings[0][0]  # the backward's too (`default_tiling`)
  # Sizes that end by M: rows past M (and the padding below) belong to no group.
  group_sizes_G = clip_group_sizes(group_sizes_G, M)
  x_MD, w_GDF, group_sizes_G = match_vma(x_MD, w_GDF.astype(x_MD.dtype), group_sizes_G)
  Q = round_up(max(M, 1), tm)
  x_QD = jnp.pad(x_MD, ((0, Q - M), (0, 0)))
  y_QF = _gmm(x_QD, w_GDF, group_sizes_G, out_dtype, tilings, vmem_limit_bytes, bool(interpret))
  # JAX types a custom_vjp made with functools.partial as returning object.
  return y_QF[:M]  # pyright: ignore[reportIndexIssue]
