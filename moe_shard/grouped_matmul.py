"""Grouped matmul: rows sorted by group, group g multiplied by its own matrix w[g].

    y[m] = x[m] @ w[g(m)]   for m < sum(group_sizes), where rows of group g are contiguous
    y[m] = 0                for m >= sum(group_sizes)

Two implementations:

  * "ragged_dot": `lax.ragged_dot`. A native grouped matmul on TPU; on CPU (and by default
    on GPU) XLA lowers it to a masked dense product over all G groups: G times the routed
    FLOPs and a `[G, M, ...]` temporary.
  * "tiled": only the routed FLOPs, for any G and any group sizes, with static shapes and no
    host sync. Each group is cut into tiles whose sizes are powers of two: as many tiles of
    the largest size as fit, then the binary decomposition of the remainder, with one
    masked tile of the smallest size for the last rows. Each tile size is one `while_loop`
    over a list of (group, first row) visits built on device, so the number of iterations
    follows the actual group sizes. Rows computed <= M + G * (min tile - 1).

"auto" picks "ragged_dot" when compiled for TPU and "tiled" elsewhere, by the platform the
program is compiled for (`lax.platform_dependent`), so an AOT compile for TPU on a CPU host
takes the TPU path.

The tiled version has a `custom_vjp`: dx runs the same tiles against w transposed, dw
accumulates `x_tile^T @ dy_tile` into w[g], so the backward also does only routed FLOPs.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from moe_shard import _checks

IMPLS = ("auto", "ragged_dot", "tiled")
DEFAULT_MAX_TILE = 256
DEFAULT_MIN_TILE = 8


def tile_sizes_for(num_rows, max_tile=DEFAULT_MAX_TILE, min_tile=DEFAULT_MIN_TILE):
  """Returns the tile sizes (powers of two, largest first) the tiled kernel uses for M rows.

  Args:
    num_rows: M.
    max_tile: largest tile (default 256), capped at the power of two >= M.
    min_tile: smallest tile (default 8).

  Returns:
    tuple of ints, e.g. (256, 128, 64, 32, 16, 8).
  """
  for name, v in (("max_tile", max_tile), ("min_tile", min_tile)):
    if v < 1 or v & (v - 1):
      raise ValueError(f"grouped_matmul: {name} must be a power of two (got {v})")
  top = max(min_tile, min(max_tile, 1 << max(0, int(num_rows - 1).bit_length())))
  sizes = []
  t = top
  while t >= min_tile:
    sizes.append(t)
    t //= 2
  return tuple(sizes)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Level:
  """The visits of one tile size: `count` valid (group, start) pairs, the rest unused."""

  group: jax.Array  # i32[V]
  start: jax.Array  # i32[V] first row of the tile
  count: jax.Array  # i32[]
  tile: int = dataclasses.field(metadata=dict(static=True))


def tile_schedule(group_sizes_G, num_rows, tiles):
  """Builds, on device, the visit list of each tile size.

  Group g (rows [off_g, off_g + s_g)) gets floor(s_g / t_0) tiles of the largest size t_0,
  then one tile of size t_i for each set bit of the remainder, then one masked tile of the
  smallest size if rows are left. Rows past M are never visited.

  Args:
    group_sizes_G: int[G] rows per group (sum may be < M; larger sums are clipped to M).
    num_rows: M (static).
    tiles: tile sizes, largest first (static).

  Returns:
    list of `Level`, one per tile size.
  """
  gs_G = jnp.asarray(group_sizes_G, jnp.int32)
  end_G = jnp.minimum(jnp.cumsum(gs_G), num_rows)
  off_G = jnp.concatenate([jnp.zeros((1,), jnp.int32), end_G[:-1]])
  s_G = jnp.maximum(end_G - off_G, 0)
  G = gs_G.shape[0]
  levels = []
  t0 = tiles[0]
  # Largest tiles: several per group. Visit v belongs to the group whose tile range holds v.
  n_G = s_G // t0
  cum_G = jnp.cumsum(n_G)
  V0 = max(1, num_rows // t0)
  v = jnp.arange(V0, dtype=jnp.int32)
  g_V = jnp.minimum(jnp.searchsorted(cum_G, v, side="right"), G - 1).astype(jnp.int32)
  start_V = off_G[g_V] + (v - (cum_G - n_G)[g_V]) * t0
  levels.append(Level(g_V, start_V.astype(jnp.int32), cum_G[-1].astype(jnp.int32), t0))
  # Smaller tiles: at most one per group (two at the smallest size), compacted to the front.
  done_G = n_G * t0
  for i, t in enumerate(tiles[1:], start=1):
    rem_G = s_G - done_G
    count_G = (rem_G >= t).astype(jnp.int32)
    starts = [off_G + done_G]
    if i == len(tiles) - 1:  # last size: also the final partial tile
      count_G = count_G + (rem_G - t * count_G > 0)
      starts.append(off_G + done_G + t)
    levels.append(_compact(count_G, starts, G, t))
    done_G = done_G + t * count_G
  if len(tiles) == 1:  # a single size: the partial last tile goes at that size too
    rem_G = s_G - done_G
    levels.append(_compact((rem_G > 0).astype(jnp.int32), [off_G + done_G], G, t0))
  return levels


def _compact(count_G, starts, G, tile):
  """Packs the visits of groups with count_G >= 1 (and >= 2, with starts[1]) to the front."""
  slots = len(starts)
  pos_G = jnp.cumsum(count_G) - count_G
  group = jnp.zeros((slots * G,), jnp.int32)
  start = jnp.zeros((slots * G,), jnp.int32)
  g = jnp.arange(G, dtype=jnp.int32)
  for j, st in enumerate(starts):
    idx = jnp.where(count_G > j, pos_G + j, slots * G)  # out of range: dropped
    group = group.at[idx].set(g, mode="drop")
    start = start.at[idx].set(st, mode="drop")
  return Level(group, start, jnp.sum(count_G).astype(jnp.int32), tile)


def _zeros_varying(shape, dtype, *refs):
  """Zeros with the mesh-axis variance of `refs` (a loop carry inside shard_map)."""
  z = jnp.zeros_like(refs[0], shape=shape, dtype=dtype)
  for r in refs[1:]:
    z = z + jnp.zeros_like(r, shape=(), dtype=dtype)
  return z


def _row_mask(start, tile, group_end):
  return (start + jnp.arange(tile, dtype=jnp.int32) < group_end)[:, None]


def _tiled_rows(levels, end_G, in_MK, w_GKN, num_rows, contract):
  """Runs every level's tiles: out[rows of g] = contract(in[rows of g], w[g]). f32[M, N]."""
  M = num_rows
  pad = levels[0].tile
  in_PK = jnp.pad(in_MK, ((0, pad), (0, 0)))  # no dynamic_slice ever clamps
  N = jax.eval_shape(contract, in_PK[:1], w_GKN[0]).shape[-1]
  out = _zeros_varying((M + pad, N), jnp.float32, in_MK, w_GKN)
  for lv in levels:
    def body(i, out, lv=lv):
      g, start = lv.group[i], lv.start[i]
      in_tK = jax.lax.dynamic_slice_in_dim(in_PK, start, lv.tile)
      new_tN = contract(in_tK, w_GKN[g])
      old_tN = jax.lax.dynamic_slice_in_dim(out, start, lv.tile)
      # Rows of the next group keep what their own visit wrote (any order is correct).
      merged = jnp.where(_row_mask(start, lv.tile, end_G[g]), new_tN, old_tN)
      return jax.lax.dynamic_update_slice_in_dim(out, merged, start, axis=0)
    out = _fori(lv.count, body, out)
  return out[:M]


def _fori(count, body, init):
  def cond(c):
    return c[0] < count

  def step(c):
    return c[0] + 1, body(c[0], c[1])
  return jax.lax.while_loop(cond, step, (jnp.zeros((), jnp.int32), init))[1]


def _mm(a_MK, b_KN):
  return jnp.einsum("mk,kn->mn", a_MK, b_KN, preferred_element_type=jnp.float32)


def _mm_t(a_MN, b_KN):
  return jnp.einsum("mn,kn->mk", a_MN, b_KN, preferred_element_type=jnp.float32)


def _ends(group_sizes_G, num_rows):
  return jnp.minimum(jnp.cumsum(jnp.asarray(group_sizes_G, jnp.int32)), num_rows)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _gmm_tiled(x_MD, w_GDF, group_sizes_G, tiles):
  levels = tile_schedule(group_sizes_G, x_MD.shape[0], tiles)
  return _tiled_rows(levels, _ends(group_sizes_G, x_MD.shape[0]), x_MD, w_GDF,
                     x_MD.shape[0], _mm)


def _gmm_tiled_fwd(x_MD, w_GDF, group_sizes_G, tiles):
  return _gmm_tiled(x_MD, w_GDF, group_sizes_G, tiles), (x_MD, w_GDF, group_sizes_G)


def _gmm_tiled_bwd(tiles, res, dy_MF):
  x_MD, w_GDF, group_sizes_G = res
  M = x_MD.shape[0]
  levels = tile_schedule(group_sizes_G, M, tiles)
  end_G = _ends(group_sizes_G, M)
  dy_MF = dy_MF.astype(jnp.float32)
  # dx[rows of g] = dy[rows of g] @ w[g]^T
  dx_MD = _tiled_rows(levels, end_G, dy_MF, w_GDF.astype(jnp.float32), M, _mm_t)
  # dw[g] = sum over the tiles of g of x_tile^T @ dy_tile (rows of other groups masked)
  pad = levels[0].tile
  x_PD = jnp.pad(x_MD, ((0, pad), (0, 0)))
  dy_PF = jnp.pad(dy_MF, ((0, pad), (0, 0)))
  dw = _zeros_varying(w_GDF.shape, jnp.float32, w_GDF, x_MD, dy_MF)
  for lv in levels:
    def body(i, dw, lv=lv):
      g, start = lv.group[i], lv.start[i]
      mask = _row_mask(start, lv.tile, end_G[g])
      x_tD = jnp.where(mask, jax.lax.dynamic_slice_in_dim(x_PD, start, lv.tile), 0)
      dy_tF = jnp.where(mask, jax.lax.dynamic_slice_in_dim(dy_PF, start, lv.tile), 0)
      dw_DF = jnp.einsum("td,tf->df", x_tD, dy_tF, preferred_element_type=jnp.float32)
      return dw.at[g].add(dw_DF)
    dw = _fori(lv.count, body, dw)
  return dx_MD.astype(x_MD.dtype), dw.astype(w_GDF.dtype), None


_gmm_tiled.defvjp(_gmm_tiled_fwd, _gmm_tiled_bwd)


def _gmm_ragged_dot(x_MD, w_GDF, group_sizes_G):
  return jax.lax.ragged_dot(x_MD, w_GDF, group_sizes_G, preferred_element_type=jnp.float32)


def grouped_matmul(x_MD, w_GDF, group_sizes_G, *, impl="auto", preferred_element_type=None,
                   max_tile=DEFAULT_MAX_TILE, min_tile=DEFAULT_MIN_TILE):
  """Multiplies each group of rows by its group's matrix.

  Args:
    x_MD: f[M, D] rows sorted by group.
    w_GDF: f[G, D, F] one matrix per group (cast to the dtype of `x_MD`).
    group_sizes_G: int[G] rows per group; rows past `sum(group_sizes_G)` give zeros.
    impl: "auto" (default; "ragged_dot" when compiled for TPU, "tiled" elsewhere),
      "ragged_dot" (`lax.ragged_dot`) or "tiled" (routed FLOPs only).
    preferred_element_type: output dtype (default: the dtype of `x_MD`). Products always
      accumulate in float32.
    max_tile, min_tile: tile sizes of "tiled", powers of two (defaults 256 and 8). Rows
      computed are at most M + G * (min_tile - 1).

  Returns:
    y_MF: [M, F] in `preferred_element_type`.

  Raises:
    TypeError: non-float `x_MD`/`w_GDF` or non-integer `group_sizes_G`.
    ValueError: bad ranks, mismatched D or G, unknown `impl`.
  """
  fn = "grouped_matmul"
  x_MD = _checks.float_array(fn, "x_MD", x_MD, ndim=2)
  w_GDF = _checks.float_array(fn, "w_GDF", w_GDF, ndim=3)
  group_sizes_G = _checks.int_array(fn, "group_sizes_G", group_sizes_G)
  if impl not in IMPLS:
    raise ValueError(f"{fn}: impl must be one of {IMPLS} (got {impl!r})")
  if x_MD.shape[1] != w_GDF.shape[1]:
    raise ValueError(f"{fn}: w_GDF's D ({w_GDF.shape[1]}) must equal x_MD's D "
                     f"({x_MD.shape[1]})")
  if group_sizes_G.shape != (w_GDF.shape[0],):
    raise ValueError(f"{fn}: group_sizes_G must have shape ({w_GDF.shape[0]},), one per "
                     f"group of w_GDF (got {tuple(group_sizes_G.shape)})")
  out_dtype = x_MD.dtype if preferred_element_type is None else preferred_element_type
  w_GDF = w_GDF.astype(x_MD.dtype)
  group_sizes_G = group_sizes_G.astype(jnp.int32)
  tiles = tile_sizes_for(x_MD.shape[0], max_tile, min_tile)

  def tiled(x, w, gs):
    return _gmm_tiled(x, w, gs, tiles)

  if impl == "ragged_dot":
    y = _gmm_ragged_dot(x_MD, w_GDF, group_sizes_G)
  elif impl == "tiled":
    y = tiled(x_MD, w_GDF, group_sizes_G)
  else:
    y = jax.lax.platform_dependent(x_MD, w_GDF, group_sizes_G, tpu=_gmm_ragged_dot,
                                   default=tiled)
  return y.astype(out_dtype)


def schedule_rows(group_sizes_G, num_rows, tiles=None):
  """Host-side count of the rows the tiled kernel computes (for FLOP accounting).

  Args:
    group_sizes_G: int[G] (NumPy or concrete array).
    num_rows: M.
    tiles: tile sizes (default `tile_sizes_for(M)`).

  Returns:
    dict tile size -> visits; rows computed = sum(tile * visits).
  """
  tiles = tiles or tile_sizes_for(num_rows)
  levels = tile_schedule(np.asarray(group_sizes_G), num_rows, tiles)
  return {lv.tile: int(lv.count) for lv in levels}
