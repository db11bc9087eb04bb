"""Host-side accounting of the data-dependent loops the benchmark's programs run.

`bench.measure` reads FLOPs and bytes from a compiled program but counts each `while_loop`
body once; the counts here, computed on the host from the routing, scale each loop body by
its iterations. They are an independent NumPy model of the library's loops (no library
code runs), so `tests/test_bench.py` checks each against what the library does.
"""

from __future__ import annotations

import numpy as np

from moe_shard.gmm_tiled import GROUP_SCOPE, TILE_SCOPE, default_tiles, tile_sizes


def schedule_rows(group_sizes_G, num_rows, tiles=None):
  """Tile visits of the tiled grouped matmul for these group sizes, per tile size.

  Group g (its rows clipped to the first M) runs floor(s / t_0) tiles of the largest size,
  then, for each smaller size but the last, one tile when the rows left allow it, then
  ceil(rows left / t_last) tiles of the smallest size (the last one masked).

  Args:
    group_sizes_G: int[G] rows per group.
    num_rows: M.
    tiles: tile sizes, largest first (default: the kernel's `default_tiles(M, G)`).

  Returns:
    dict tile size -> visits; rows computed = sum(tile * visits).
  """
  sizes_G = np.asarray(group_sizes_G, np.int64)
  if tiles is None:
    tiles = tile_sizes(num_rows, *default_tiles(num_rows, sizes_G.shape[0]))
  end_G = np.minimum(np.cumsum(sizes_G), num_rows)
  left_G = np.maximum(end_G - np.concatenate([[0], end_G[:-1]]), 0)
  visits = {}
  for i, t in enumerate(tiles):
    last = i == len(tiles) - 1
    n_G = -(-left_G // t) if last else left_G // t
    visits[int(t)] = int(n_G.sum())
    left_G = left_G - np.minimum(n_G * t, left_G)
  return visits


def loop_trip_counts(group_sizes_G, num_rows, tiles=None):
  """Total iterations of each loop of the tiled grouped matmul, keyed by named scope.

  The form `measure.executed_flops(compiled, trip_counts=...)` takes: the group loop runs
  once per non-empty group (rows clipped to M), the loop of tile size t once per tile of
  that size. Forward and backward loops share these counts.

  Returns:
    {"gmm_groups": non-empty groups, "gmm_tile_256": tiles of 256 rows, ...}.
  """
  sizes_G = np.asarray(group_sizes_G, np.int64)
  end_G = np.minimum(np.cumsum(sizes_G), num_rows)
  nonempty = int(np.sum(end_G - np.concatenate([[0], end_G[:-1]]) > 0))
  counts = {GROUP_SCOPE: nonempty}
  counts.update({f"{TILE_SCOPE}{t}": n
                 for t, n in schedule_rows(sizes_G, num_rows, tiles).items()})
  return counts
