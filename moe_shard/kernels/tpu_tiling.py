"""megablox's tiles on TPU: the VMEM each kernel needs, the VMEM limit of each TPU generation,
the tiles that fit it (`default_tiling`) and the bytes a kernel moves when its contraction is
one tile (`fetched_once_bytes`).

Pure arithmetic on shapes and device kinds, with no Pallas import: `plan` sizes the
dispatches' buffers by these tiles, and `kernels.tpu` (megablox's wiring) and
`kernels.tpu_quant_tiling` build on them.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from moe_shard.kernels.pallas import round_up

LANES = 128  # width of the MXU and of a vector register: tk, tn are multiples of it
MAX_ROW_TILE = 512
ROW_TILE = 256
BIG_ROW_TILE = 1024  # for few, large groups (see `default_tiling`)
MiB = 2**20
# VMEM per TensorCore, by the device kind JAX reports: the table of the Pallas "TPU Hardware
# Reference", https://docs.jax.dev/en/latest/pallas/tpu/hardware.html (v4 16 MiB, v5e
# 128 MiB, v5p 64 MiB, v6e 128 MiB, TPU7x 64 MiB; made from `pltpu`'s TpuInfo).
VMEM_CAPACITY = {
  "TPU v4": 16 * MiB,
  "TPU v4 lite": 16 * MiB,
  "TPU v5 lite": 128 * MiB,
  "TPU v5e": 128 * MiB,
  "TPU v5": 64 * MiB,
  "TPU v5p": 64 * MiB,
  "TPU v6 lite": 128 * MiB,
  "TPU v6e": 128 * MiB,
  "TPU7x": 64 * MiB,
}
# Mosaic's scoped VMEM limit for a kernel that sets none (16 MiB on v4 and v5e): what a
# generation not in VMEM_CAPACITY, or a trace that does not know its target, keeps.
DEFAULT_VMEM_LIMIT = 16 * MiB
# The blocks' share of a kernel's VMEM limit: Mosaic adds its own scratch (compiled at
# D=2048, F=4096 with 512 x 1024 x 1024 tiles the three kernels use 11.3-13.4 MiB of the
# 16 MiB against `vmem_bytes`' 10-12 MiB).
VMEM_BUDGET = 12 * 2**20  # of DEFAULT_VMEM_LIMIT
DTYPES = (jnp.bfloat16, jnp.float32)  # what megablox's kernels accept


def _lane_tile(n, cap):
  """The largest multiple of 128 that divides n rounded up to 128, at most max(cap, 128)."""
  lanes = round_up(max(n, 1), LANES) // LANES
  return LANES * max(d for d in range(1, max(cap // LANES, 1) + 1) if lanes % d == 0)


KERNELS = ("fwd", "dx", "dw")


def vmem_bytes(tm, tk, tn, itemsize, kernels=KERNELS):
  """VMEM bytes of the largest of `kernels`: blocks double-buffered, f32 scratch.

  "fwd": x[tm, tk], w[tk, tn], y[tm, tn] (f32 at worst), acc[tm, tn]; "dx": the same with
  tk, tn swapped, dx in x's dtype; "dw" (tgmm): x[tm, tk], dy[tm, tn], dw[tk, tn],
  acc[tk, tn]. Default: all three.
  """
  b = itemsize
  need = dict(
    fwd=2 * b * (tm * tk + tk * tn) + (2 * 4 + 4) * tm * tn,
    dx=2 * b * (tm * tn + tn * tk) + (2 * b + 4) * tm * tk,
    dw=2 * b * (tm * tk + tm * tn) + (2 * b + 4) * tk * tn,
  )
  return max(need[k] for k in kernels)


def target_device_kind():
  """The device kind of the TPU the program being traced is for, or None.

  The surrounding mesh's devices (a `jax.shard_map`'s mesh, or `jax.set_mesh`'s), else the
  default backend's first device. An ahead-of-time compile for a TPU topology on a CPU host
  is known inside a shard_map over the topology's devices only.
  """
  device = getattr(jax.sharding.get_abstract_mesh(), "abstract_device", None)
  if device is None:
    device = jax.devices()[0]
  return device.device_kind if device.platform == "tpu" else None


def vmem_limit(device_kind):
  """The VMEM limit the kernels get on a TPU of `device_kind` (None: Mosaic's default).

  Three quarters of the generation's VMEM (`VMEM_CAPACITY`), the rest left to Mosaic's
  internal scratch; never below Mosaic's default. v5e and v6e: 96 MiB; v5p, TPU7x: 48 MiB.
  """
  capacity = VMEM_CAPACITY.get(device_kind)
  if capacity is None or capacity * 3 // 4 <= DEFAULT_VMEM_LIMIT:
    return None
  return capacity * 3 // 4


def tgmm_fits(tm, tk, tn, itemsize, limit):
  """Whether tgmm (the dw kernel) fits a VMEM limit (None: Mosaic's default) with its lhs
  block transposed: Mosaic holds x[tm, tk]^T beside the blocks `vmem_bytes` counts, which
  the budget's headroom does not cover for the largest tiles (compiled for v5e: w [8, 4096,
  2048] at 1024 x 4096 x 2048 runs out of VMEM, at 512 rows it fits, as [8, 2048, 4096] at
  1024 x 2048 x 4096 does). 1 MiB is left for Mosaic's other scratch."""
  limit = DEFAULT_VMEM_LIMIT if limit is None else limit
  return vmem_bytes(tm, tk, tn, itemsize, ("dw",)) + itemsize * tm * tk <= limit - MiB


def vmem_budget(limit):
  """The bytes `vmem_bytes` may reach under a VMEM limit (None: Mosaic's default): 3/4 of
  it at the default (`VMEM_BUDGET`), the limit less 8 MiB above it."""
  return VMEM_BUDGET if limit is None else limit - 8 * MiB


def default_tiling(M, D, F, dtype, *, num_groups=1, vmem_limit=None, forward=False):
  """Picks megablox's tiles (tm, tk, tn) for x: dtype[M, D] and w: dtype[G, D, F].

  Columns: tk and tn start at full width (D and F rounded up to 128) and the larger one is
  lowered, to the next multiple of 128 that divides its width, until `vmem_bytes` fits
  `vmem_budget(vmem_limit)` and tgmm its limit (`tgmm_fits`). Full width reads everything
  once: with tk = D (one contraction tile), consecutive row tiles of a group ask for the
  same w[g] block, which the Pallas pipeline keeps in VMEM instead of fetching it again (it
  copies a block only when its index changes between grid steps;
  https://docs.jax.dev/en/latest/pallas/tpu/sparse.html),
  so w is read once per group, not once per row tile; with tn = F, x is read once, not
  F / tn times. The dx and dw kernels take the same tiles (tgmm's dw[g] block is then the
  whole [D, F] matrix, its largest VMEM use). Under Mosaic's default limit this gives
  1024 x 1024 at D=2048, F=4096 in bf16 (512 x 1024 in f32); under v5e's and v6e's 96 MiB,
  the full 2048 x 4096. With `forward`, the columns fit the forward kernel's blocks alone
  (tm as without it): `megablox_gmm`'s forward takes these, its backward the three
  kernels' tiles, so tgmm's whole-matrix dw block does not narrow the forward's tk below
  D (DeepSeek-V3's D=7168, F=2048 under 96 MiB: 7168 x 2048, against 3584 x 2048, where
  each row tile would read its group's w again).

  Rows: tm = 512 if (G - 1) * 512 <= 3M/4, else 256; 1024 if the padding and the tiles
  split by group boundaries cost at most M/8 rows ((G - 1) * 1024 + padding <= M / 8) and
  VMEM allows; at most M rounded up to 128. Why: each group boundary inside a row tile
  costs one more tile (up to G - 1), which the kernel multiplies in full; and when w is
  fetched per row tile (tk < D), each row tile reads its group's whole w[g]: 2*tm*D*F FLOPs
  per 2*D*F bytes (bf16), tm FLOP/byte against v5e's ~240 (197 TFLOP/s / 819 GB/s); with x
  and y traffic a 256-row tile is HBM-bound and takes ~0.64 of a 512-row one (D=2048,
  F=4096): (M/512 + G - 1) * 1 and (M/256 + G - 1) * 0.64 cross at (G - 1) * 512 ~ 0.8 M.

  Args:
    M, D, F: problem sizes (ints).
    dtype: the inputs' dtype (its size sets the VMEM use).
    num_groups: G (default 1).
    vmem_limit: the kernels' VMEM limit in bytes (default None: Mosaic's default; see
      `vmem_limit`).
    forward: columns for the forward kernel only (default False: all three kernels).

  Returns:
    (tm, tk, tn): ints, multiples of 128.
  """
  b = jnp.dtype(dtype).itemsize
  budget = vmem_budget(vmem_limit)
  rows = round_up(max(M, 1), LANES)
  tm = MAX_ROW_TILE if 4 * (num_groups - 1) * MAX_ROW_TILE <= 3 * M else ROW_TILE
  big = BIG_ROW_TILE
  if 8 * ((num_groups - 1) * big + round_up(max(M, 1), big) - M) <= M:
    tm = big
  tm = min(tm, rows)

  def columns(tm, kernels=KERNELS):
    tk, tn = round_up(max(D, 1), LANES), round_up(max(F, 1), LANES)

    def fits(tk, tn):
      return vmem_bytes(tm, tk, tn, b, kernels) <= budget and (
        "dw" not in kernels or tgmm_fits(tm, tk, tn, b, vmem_limit)
      )

    while not fits(tk, tn) and max(tk, tn) > LANES:
      if tk >= tn:
        tk = _lane_tile(D, tk - LANES)
      else:
        tn = _lane_tile(F, tn - LANES)
    return tk, tn

  tk, tn = columns(tm)
  if tm == big and (tk, tn) != columns(MAX_ROW_TILE):
    tm = min(MAX_ROW_TILE, rows)  # a 1024-row tile only where it keeps the columns
    tk, tn = columns(tm)
  if forward:
    tk, tn = columns(tm, ("fwd",))
  return tm, tk, tn


def fetched_once_bytes(lhs_shape, w_shape, tiling, itemsize, out_itemsize, transpose_rhs=False):
  """The HBM bytes megablox's gmm moves when its contraction is one tile, else None.

  gmm's grid is (output-column tiles, active row tiles, contraction tiles); the Pallas
  pipeline copies a block only when its index changes between grid steps. With one
  contraction tile, w[g]'s block stays while consecutive row tiles belong to group g, so
  each output-column tile fetches each group's w[g] block once: G matrices at most in all,
  x once per output-column tile and y once. megablox declares one whole w[g] per possible
  row tile, M/tm + G - 1 of them, for any tiling (`bench.kernel_runs.gmm_tpu.fetched_bytes` walks the
  grid); XLA's "bytes accessed" takes the declared figure.

  Args:
    lhs_shape: (M, K) of the kernel's lhs (x, or dy for dx).
    w_shape: (G, K, N), or (G, N, K) with `transpose_rhs`.
    tiling: megablox's (tm, tk, tn): tk over K, tn over N.
    itemsize, out_itemsize: bytes per element of the inputs and of the output.
    transpose_rhs: the dx kernel, dy @ w[g]^T (default False).

  Returns:
    int, or None where K takes more than one tile (each row tile then fetches w[g] again,
    as megablox declares).
  """
  (M, K), G = lhs_shape, w_shape[0]
  N = w_shape[1] if transpose_rhs else w_shape[2]
  _, tk, tn = tiling
  if tk < K:
    return None
  return M * K * itemsize * -(-N // tn) + G * K * N * itemsize + M * N * out_itemsize
