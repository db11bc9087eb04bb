"""The "tiled" grouped-matmul backend: only the routed FLOPs, on any platform.

    y[m] = x[m] @ w[g(m)]   for m < sum(group_sizes), where rows of group g are contiguous
    y[m] = 0                for m >= sum(group_sizes)

How "tiled" works. Tile sizes are powers of two t_0 > t_1 > ... > t_{L-1} (`tile_sizes`).
Group g (rows [off_g, end_g)) is cut into floor(s_g / t_0) tiles of the largest size, then
one tile of size t_i for each set bit of the remainder, then one masked tile of the
smallest size for the rows left (`tile_schedule`). Rows computed <= M + G * (t_{L-1} - 1).
The default smallest tile (`default_tiles`) is 32 rows, lowered until G * (t_{L-1} - 1) is
at most M / 4: on XLA:CPU every tile is one dot call that repacks the group's [D, F]
matrix, so a few masked rows cost less than more, smaller calls.

The loops are group-major: an outer `while_loop` over the non-empty groups copies w[g] out
of w_GDF once, and inside it one `while_loop` per tile size runs that group's tiles of that
size (zero, one or two of each small size, many of the largest). So w[g] is read from
memory once per group, not once per tile, and the number of iterations follows the actual
group sizes. A tile that would run past the last row is slid back to end there (its extra
rows are masked), so no input or output is padded (except when M is below the largest tile).

The `custom_vjp` backward is one group-major loop too: per group it copies w[g] once, and
for each tile writes dx_tile = dy_tile @ w[g]^T and adds x_tile^T @ dy_tile into dw[g] in
place (one fused read-add-write of [D, F] per tile; a [D, F] accumulator carried over the
group's tiles measured slower on XLA:CPU: it adds a zero fill and a copy per group). Forward
and backward both do only the routed FLOPs, plus the same padding.

Every loop runs under a `jax.named_scope` ("gmm_groups", "gmm_tile_<t>") that XLA keeps in
the HLO, so the benchmark (`bench/reading/accounting.py`, `bench/reading/measure.py`) can multiply each loop
body by its trip count.

Inside `jax.shard_map` (with check_vma), loop carries are created from the inputs
(`sharding.zeros_varying`) so they vary over the same mesh axes; `grouped_matmul` casts an
input that does not vary (e.g. replicated w) to varying before the custom_vjp
(`sharding.match_vma`): its gradient then comes back summed over the devices.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from moe_shard.frozen import zero_cotangent
from moe_shard.quant import is_quantized
from moe_shard.sharding import fori_while, zeros_varying

DEFAULT_MAX_TILE = 256
# Smallest tile the default schedule prefers. On XLA:CPU each tile is one dot call, which
# repacks the group's [D, F] matrix: a fixed cost of roughly 10-40 rows of compute
# (measured at D=512, F=1024 on 2 cores). A masked last tile wasting up to 31 rows costs
# about what the extra calls of smaller tiles would.
PREFERRED_MIN_TILE = 32
# Worst-case padding allowed by the default min_tile: G * (min_tile - 1) <= PAD_BUDGET * M,
# so executed FLOPs <= (1 + PAD_BUDGET) x routed whatever the group sizes.
PAD_BUDGET = 0.25
# Named scopes of the loops (kept in the HLO metadata), for `loop_trip_counts`.
GROUP_SCOPE = "gmm_groups"
TILE_SCOPE = "gmm_tile_"


def default_tiles(num_rows, num_groups):
  """Returns the default (max_tile, min_tile) for M rows in G groups.

  max_tile is 256 (a [256, D] x [D, F] product runs at the speed of one large matmul on
  XLA:CPU). min_tile is `PREFERRED_MIN_TILE` (32), lowered to the largest power of two with
  G * (min_tile - 1) <= PAD_BUDGET * M, so that padding never exceeds a quarter of M rows
  whatever the group sizes (e.g. M=8192: 32 for G <= 66, 16 for G=128, 1 when G > M / 4).

  Args:
    num_rows: M.
    num_groups: G.

  Returns:
    (max_tile, min_tile), powers of two.
  """
  min_tile = 1
  while min_tile < PREFERRED_MIN_TILE and num_groups * (2 * min_tile - 1) <= PAD_BUDGET * num_rows:
    min_tile *= 2
  return DEFAULT_MAX_TILE, min_tile


def tile_sizes(num_rows, max_tile, min_tile):
  """Returns the tile sizes (powers of two, largest first) the tiled kernel uses for M rows.

  Args:
    num_rows: M.
    max_tile: largest tile, capped at the power of two >= M (and at least `min_tile`).
    min_tile: smallest tile.

  Returns:
    tuple of ints, e.g. (256, 128, 64, 32, 16, 8).

  Raises:
    TypeError: a tile size that is not an int.
    ValueError: a tile size that is not a power of two, or min_tile > max_tile.
  """
  for name, v in (("max_tile", max_tile), ("min_tile", min_tile)):
    if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
      raise TypeError(f"grouped_matmul: {name} must be an int (got {type(v).__name__})")
    if v < 1 or v & (v - 1):
      raise ValueError(f"grouped_matmul: {name} must be a power of two (got {v})")
  if min_tile > max_tile:
    raise ValueError(f"grouped_matmul: min_tile ({min_tile}) must be <= max_tile ({max_tile})")
  top = max(min_tile, min(max_tile, 1 << max(0, int(num_rows - 1).bit_length())))
  sizes = []
  t = top
  while t >= min_tile:
    sizes.append(t)
    t //= 2
  return tuple(int(s) for s in sizes)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Schedule:
  """Where the tiles of each group are, for tile sizes `tiles` (largest first).

  Group g's tiles of size tiles[l] start at rows first_GL[g, l] + j * tiles[l] for
  j < count_GL[g, l]; its rows end at end_G[g]. `groups` lists the non-empty groups first
  (`num_groups` of them), so a loop visits only groups that have rows.
  """

  groups: jax.Array  # i32[G] non-empty groups first
  num_groups: jax.Array  # i32[] how many groups are non-empty
  count_GL: jax.Array  # i32[G, L] tiles of each size per group
  first_GL: jax.Array  # i32[G, L] first row of each size's first tile
  end_G: jax.Array  # i32[G] one past the last row of each group
  tiles: tuple = dataclasses.field(metadata=dict(static=True))


def tile_schedule(group_sizes_G, num_rows, tiles):
  """Builds, on device, the tiles of each group.

  Group g (rows [off_g, off_g + s_g)) gets floor(s_g / t_0) tiles of the largest size t_0,
  then as many tiles of each smaller size as fit in the rows left (for consecutive powers of
  two: one tile of size t_i for each set bit of the remainder), then one masked tile of the
  smallest size if rows are left. Only that last tile computes rows that are not the
  group's, fewer than the smallest size. Rows past M are never assigned to a group.

  Args:
    group_sizes_G: int[G] rows per group (sum may be < M; larger sums are clipped to M).
    num_rows: M (static).
    tiles: tile sizes, powers of two, largest first (static).

  Returns:
    `Schedule`.
  """
  gs_G = jnp.asarray(group_sizes_G).astype(np.int32)
  end_G = jnp.minimum(jnp.cumsum(gs_G), num_rows).astype(np.int32)
  off_G = jnp.concatenate([jnp.zeros((1,), np.int32), end_G[:-1]])
  s_G = jnp.maximum(end_G - off_G, 0)
  done_G = jnp.zeros_like(s_G)
  counts, firsts = [], []
  for i, t in enumerate(tiles):
    rem_G = s_G - done_G
    if i < len(tiles) - 1:
      n_G = rem_G // t  # with consecutive powers of two: 0 or 1 below the largest size
    else:  # smallest size: also the final partial (masked) tile
      n_G = (rem_G + t - 1) // t
    counts.append(n_G)
    firsts.append(off_G + done_G)
    done_G = done_G + t * n_G
  nonempty_G = s_G > 0
  groups = jnp.argsort(~nonempty_G, stable=True).astype(np.int32)
  return Schedule(
    groups=groups,
    num_groups=jnp.sum(nonempty_G).astype(np.int32),
    count_GL=jnp.stack(counts, axis=1).astype(np.int32),
    first_GL=jnp.stack(firsts, axis=1).astype(np.int32),
    end_G=end_G,
    tiles=tuple(tiles),
  )


def _own_zeros(shape, w_GDF, *refs):
  """f32 zeros for a loop's output buffer that XLA cannot merge with another call's.

  XLA's CSE merges equal zero fills: the gate and up matmuls of a SwiGLU (same shapes)
  would share one, and each of their loops, which write it in place, would start with a
  whole copy of it. Tying the fill to this call's `w` (a scalar that is always 0, even
  for inf or nan weights) keeps one fill per loop and no copies.
  """
  zero = jnp.sum(jnp.isnan(w_GDF.reshape(-1)[:1])).astype(jnp.float32) * 0.0
  return zeros_varying(shape, jnp.float32, w_GDF, *refs) + zero


def _for_each_tile(sched, g, num_rows, body, carry):
  """Runs body(tile, row0, mask_t1, carry) over the tiles of group g, one loop per size.

  row0 is the first row of the tile as sliced. Tiles of every size but the smallest lie
  inside the group, and mask_t1 is None. In the smallest size's loop, a tile that would run
  past `num_rows` is slid back to end there, and mask_t1 (bool[tile, 1]) marks the rows that
  are the group's own (not before the tile's true start, not at or past the group's end).
  """
  end = sched.end_G[g]
  last = len(sched.tiles) - 1
  for l, t in enumerate(sched.tiles):

    def step(j, carry, l=l, t=t):
      start = sched.first_GL[g, l] + j * t
      if l < last:  # a whole tile of the group: no mask, no select
        return body(t, start, None, carry)
      row0 = jnp.minimum(start, num_rows - t)
      r_t = row0 + jnp.arange(t, dtype=jnp.int32)
      mask_t1 = ((r_t >= start) & (r_t < end))[:, None]
      return body(t, row0, mask_t1, carry)

    with jax.named_scope(f"{TILE_SCOPE}{t}"):  # names the loop for `measure`
      carry = fori_while(0, sched.count_GL[g, l], step, carry)
  return carry


def _for_each_group(sched, body, carry):
  """Runs body(g, carry) for each non-empty group g."""
  with jax.named_scope(GROUP_SCOPE):
    return fori_while(0, sched.num_groups, lambda i, c: body(sched.groups[i], c), carry)


def _padded_rows(M, tiles):
  """Rows of the working buffers: M, or one more than the largest tile when M is not larger.

  Every tile slice must fit; and a buffer of exactly one largest tile would make that tile's
  slice start provably 0, so XLA would hoist its matmul out of the (data-dependent) loop
  and run it whether or not the loop runs.
  """
  return M if tiles[0] < M else tiles[0] + 1


def _pad_rows(a_MK, rows):
  """Pads to `rows` rows when M is not larger than the largest tile (small inputs only)."""
  return a_MK if a_MK.shape[0] >= rows else jnp.pad(a_MK, ((0, rows - a_MK.shape[0]), (0, 0)))


def _read_rows(a_QK, row0, t, mask_t1):
  """Rows [row0, row0 + t) of a, those outside the mask (when there is one) zeroed."""
  a_tK = jax.lax.dynamic_slice_in_dim(a_QK, row0, t)
  return a_tK if mask_t1 is None else jnp.where(mask_t1, a_tK, 0)


def _write_rows(a_QK, new_tK, row0, mask_t1):
  """a with rows [row0, row0 + t) set to new's; with a mask, only the masked rows (the
  others keep what their own group's tile wrote: any order works)."""
  if mask_t1 is not None:
    old_tK = jax.lax.dynamic_slice_in_dim(a_QK, row0, new_tK.shape[0])
    new_tK = jnp.where(mask_t1, new_tK, old_tK)
  return jax.lax.dynamic_update_slice_in_dim(a_QK, new_tK, row0, axis=0)


def _group_matrix(w_GDF, g, dtype):
  """w[g] as a dense [D, F] matrix: a `QuantizedArray`'s group dequantized (one group's
  float copy at a time, never the whole tensor's)."""
  return w_GDF[g].dequantize(dtype) if is_quantized(w_GDF) else w_GDF[g]


def _ref(w_GDF):
  """An array of w for `_own_zeros` and the varying axes (a quantized w's values)."""
  return w_GDF.values if is_quantized(w_GDF) else w_GDF


def _gmm_fwd_loop(x_MD, w_GDF, sched):
  """y_MF: f32[M, F], y[rows of g] = x[rows of g] @ w[g], other rows 0."""
  M = x_MD.shape[0]
  Q = _padded_rows(M, sched.tiles)
  x_QD = _pad_rows(x_MD, Q)
  y_QF = _own_zeros((Q, w_GDF.shape[2]), _ref(w_GDF), x_MD)

  def group(g, y_QF):
    w_DF = _group_matrix(w_GDF, g, x_MD.dtype)

    def tile(t, row0, mask_t1, y_QF):
      x_tD = jax.lax.dynamic_slice_in_dim(x_QD, row0, t)
      new_tF = jnp.einsum("td,df->tf", x_tD, w_DF, preferred_element_type=jnp.float32)
      return _write_rows(y_QF, new_tF, row0, mask_t1)

    return _for_each_tile(sched, g, Q, tile, y_QF)

  return _for_each_group(sched, group, y_QF)[:M]


def _gmm_bwd_loop(x_MD, w_GDF, dy_MF, sched):
  """(dx_MD: f32[M, D], dw_GDF: f32[G, D, F]) of y = gmm(x, w) for the cotangent dy_MF."""
  M, D = x_MD.shape
  G, _, F = w_GDF.shape
  Q = _padded_rows(M, sched.tiles)
  x_QD = _pad_rows(x_MD, Q)
  dy_QF = _pad_rows(dy_MF, Q)
  dx_QD = _own_zeros((Q, D), w_GDF, x_MD, dy_MF)
  dw_GDF = _own_zeros((G, D, F), w_GDF, x_MD, dy_MF)

  def group(g, carry):
    w_DF = w_GDF[g]

    def tile(t, row0, mask_t1, carry):
      dx_QD, dw_GDF = carry
      x_tD = _read_rows(x_QD, row0, t, mask_t1)
      dy_tF = _read_rows(dy_QF, row0, t, mask_t1)
      # dx[rows of g] = dy[rows of g] @ w[g]^T; rows of other groups keep their value.
      new_tD = jnp.einsum("tf,df->td", dy_tF, w_DF, preferred_element_type=jnp.float32)
      dx_QD = _write_rows(dx_QD, new_tD, row0, mask_t1)
      # dw[g] += x_tile^T @ dy_tile (rows of other groups are zeroed above). Added in place
      # into dw (one fused read-add-write of [D, F]): cheaper on XLA:CPU than a [D, F]
      # accumulator carry, which costs a zero fill, the same add and a final copy per group.
      dw_DF = jnp.einsum("td,tf->df", x_tD, dy_tF, preferred_element_type=jnp.float32)
      return dx_QD, dw_GDF.at[g].add(dw_DF)

    return _for_each_tile(sched, g, Q, tile, carry)

  dx_QD, dw_GDF = _for_each_group(sched, group, (dx_QD, dw_GDF))
  return dx_QD[:M], dw_GDF


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def gmm_tiled(x_MD, w_GDF, group_sizes_G, tiles):
  sched = tile_schedule(group_sizes_G, x_MD.shape[0], tiles)
  return _gmm_fwd_loop(x_MD, w_GDF, sched)


def _gmm_tiled_fwd(x_MD, w_GDF, group_sizes_G, tiles):
  return gmm_tiled(x_MD, w_GDF, group_sizes_G, tiles), (x_MD, w_GDF, group_sizes_G)


def _gmm_tiled_bwd(tiles, res, dy_MF):
  x_MD, w_GDF, group_sizes_G = res
  sched = tile_schedule(group_sizes_G, x_MD.shape[0], tiles)
  dx_MD, dw_GDF = _gmm_bwd_loop(x_MD, w_GDF, dy_MF.astype(x_MD.dtype), sched)
  return dx_MD.astype(x_MD.dtype), dw_GDF.astype(w_GDF.dtype), None


gmm_tiled.defvjp(_gmm_tiled_fwd, _gmm_tiled_bwd)


def _dx_loop(x_MD, w_GDF, dy_MF, sched):
  """dx_MD: f32[M, D] of y = gmm(x, w) for the cotangent dy_MF (w frozen: no dw)."""
  M, D = x_MD.shape
  Q = _padded_rows(M, sched.tiles)
  dy_QF = _pad_rows(dy_MF, Q)
  dx_QD = _own_zeros((Q, D), _ref(w_GDF), x_MD, dy_MF)

  def group(g, dx_QD):
    w_DF = _group_matrix(w_GDF, g, x_MD.dtype)

    def tile(t, row0, mask_t1, dx_QD):
      dy_tF = _read_rows(dy_QF, row0, t, mask_t1)
      new_tD = jnp.einsum("tf,df->td", dy_tF, w_DF, preferred_element_type=jnp.float32)
      return _write_rows(dx_QD, new_tD, row0, mask_t1)

    return _for_each_tile(sched, g, Q, tile, dx_QD)

  return _for_each_group(sched, group, dx_QD)[:M]


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def gmm_tiled_frozen(x_MD, w_GDF, group_sizes_G, tiles):
  """`gmm_tiled` for a frozen w (a `QuantizedArray`): the same forward, each group's matrix
  dequantized once in the group loop; the backward computes dx only, w's cotangent is zero."""
  sched = tile_schedule(group_sizes_G, x_MD.shape[0], tiles)
  return _gmm_fwd_loop(x_MD, w_GDF, sched)


def _gmm_frozen_fwd(x_MD, w_GDF, group_sizes_G, tiles):
  return gmm_tiled_frozen(x_MD, w_GDF, group_sizes_G, tiles), (x_MD, w_GDF, group_sizes_G)


def _gmm_frozen_bwd(tiles, res, dy_MF):
  x_MD, w_GDF, group_sizes_G = res
  sched = tile_schedule(group_sizes_G, x_MD.shape[0], tiles)
  dx_MD = _dx_loop(x_MD, w_GDF, dy_MF.astype(x_MD.dtype), sched)
  return dx_MD.astype(x_MD.dtype), zero_cotangent(w_GDF), None


gmm_tiled_frozen.defvjp(_gmm_frozen_fwd, _gmm_frozen_bwd)
