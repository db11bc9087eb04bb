"""Host-side accounting of the data-dependent loops the benchmark's programs run.

`bench.reading.measure` reads FLOPs and bytes from a compiled program but counts each `while_loop`
body once; the counts here, computed on the host from the routing, scale each loop body by
its iterations. They are an independent NumPy model of the library's loops (no library
code runs), so `tests/test_bench.py` checks each against what the library does.
"""

from __future__ import annotations

import dataclasses
import math

import jax.numpy as jnp
import numpy as np

import moe_shard as ms
from bench.reading.hlo import branch_key
from moe_shard.kernels.tiled import GROUP_SCOPE, TILE_SCOPE, default_tiles, tile_sizes
from moe_shard.parallel import OVERFLOW_SCOPE, RAGGED_LAST_SCOPE, RAGGED_SCOPE
from moe_shard.sharding import EXPERT


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
  counts.update({f"{TILE_SCOPE}{t}": n for t, n in schedule_rows(sizes_G, num_rows, tiles).items()})
  return counts


# --------------------------------------------------------------------------- per implementation
# What the benchmark needs of each implementation on a case, from the host routing alone:
# `Accounting(rounds, dropped, trips)`, trips one {scope path: iterations} dict per device
# (mesh order). `bench/cases/impls.py` keeps one of these functions beside each implementation.


@dataclasses.dataclass(frozen=True)
class Accounting:
  """Host-side facts of one implementation on one case.

  Attributes:
    rounds: dispatch rounds (None when the notion does not apply).
    dropped: (token, slot) items the implementation drops (0 for a dropless one).
    trips: per device (mesh order), {named-scope path: total iterations} of its
      data-dependent loops, for `measure.executed_flops` / `collective_bytes`.
    kept: bool[T, K] the (token, slot) items it computes, or None for all of them.
    sent_bytes: {mode: bytes} the busiest device sends through collectives sized at run
      time (ragged-all-to-all), which the compiled program cannot show; None when none.
  """

  rounds: int | None
  dropped: int
  trips: list
  kept: np.ndarray | None = None
  sent_bytes: dict | None = None


def device_loads(experts_TK, num_experts, num_devices):
  """int[devices, E]: items each device's tokens route to each expert (token blocks in mesh
  order: the sharding P(all axes))."""
  e = np.asarray(experts_TK).reshape(num_devices, -1)
  load = np.zeros((num_devices, num_experts), np.int64)
  for d in range(num_devices):
    valid = e[d][(e[d] >= 0) & (e[d] < num_experts)]
    load[d] = np.bincount(valid, minlength=num_experts)
  return load


def _layout(case):
  """(n_dev, N expert-axis devices, M devices along the other axes, L local experts, T_dev,
  loads [devices, E]) of a case; device index = e * M + m."""
  mesh = case.mesh
  n_dev = mesh.size
  N = mesh.shape[EXPERT]
  return (
    n_dev,
    N,
    n_dev // N,
    case.E // N,
    case.size.T // n_dev,
    device_loads(case.experts_TK, case.E, n_dev),
  )


def _padded_load(mean):
  """mean + 4 * sqrt(mean) rounded up to a multiple of 8, at least 8: the dispatches'
  documented default buffer rule (`plan.padded_load`), written out again here."""
  return max(8, 8 * math.ceil((mean + math.ceil(4 * math.sqrt(mean))) / 8))


def a2a_chunks(tokens_per_device, k, num_devices, chunk_size=None):
  """(C_first, C_overflow) of the all_to_all dispatch, written out from its documented rule
  (`moe_all_to_all`): C_first = the expected (source, destination) load T_dev*K/N plus
  4 * sqrt of it, rounded up to a multiple of 8 (at least 8), C_overflow = C_first;
  C_first at most the most a pair can carry, T_dev*K rounded
  up to a multiple of 8, and that when N of it is at most 128 rows (`plan.DECODE_ROWS`)."""
  if chunk_size is not None:
    return (chunk_size, chunk_size) if isinstance(chunk_size, int) else tuple(chunk_size)
  first = _padded_load(math.ceil(tokens_per_device * k / num_devices))
  most = max(8, 8 * math.ceil(tokens_per_device * k / 8))
  first = most if num_devices * most <= 128 or first > most else first
  return first, first


def a2a_rounds(busiest_queue, chunks):
  """Rounds the all_to_all runs: 1, plus one per C_overflow items past C_first on the
  busiest (source, destination) queue of the mesh."""
  first, overflow = chunks
  return 1 + -(-max(busiest_queue - first, 0) // overflow)


def all_to_all(case, on_tpu=False):
  """The all_to_all's rounds and, per device, the tiled kernel's loops in each round (round 0
  outside the overflow loop, the others inside it)."""
  n_dev, N, M, L, T_dev, load = _layout(case)
  first, overflow = a2a_chunks(T_dev, case.size.K, N, case.size.chunk_size)
  queues = load.reshape(n_dev, N, L)  # [source, destination, local expert]
  rounds = a2a_rounds(int(queues.sum(axis=2).max()), (first, overflow))
  trips = [{OVERFLOW_SCOPE: rounds - 1} for _ in range(n_dev)]
  if on_tpu:  # no tiled kernel on TPU
    return Accounting(rounds, 0, trips)
  ends = np.cumsum(queues, axis=2)
  starts = ends - queues
  inner = OVERFLOW_SCOPE + "/"
  for d in range(n_dev):  # loops inside the overflow loop run 0 times when it never runs
    trips[d].update({inner + k: 0 for k in loop_trip_counts(np.zeros(L, int), N * overflow)})
  for r in range(rounds):
    lo = 0 if r == 0 else first + (r - 1) * overflow
    C = first if r == 0 else overflow
    got = np.clip(np.minimum(ends, lo + C) - np.maximum(starts, lo), 0, None)
    for dst in range(n_dev):
      e_dst, m = divmod(dst, M)
      sizes = got[[e_src * M + m for e_src in range(N)], e_dst].sum(axis=0)
      for k, v in loop_trip_counts(sizes, N * C).items():
        key = k if r == 0 else inner + k
        trips[dst][key] = trips[dst].get(key, 0) + v
  return Accounting(rounds, 0, trips)


def _row_tile(rows, groups):
  """megablox's row tile for `rows` rows in `groups` groups at narrow columns, from its
  documented rule (`kernels.tpu.default_tiling`): 512, or 256 where (G - 1) * 512 > 3/4 of
  the rows, or 1024 where the boundaries and padding cost at most 1/8 of them; at most the
  rows rounded up to 128."""
  tm = 512 if 4 * (groups - 1) * 512 <= 3 * rows else 256
  if 8 * ((groups - 1) * 1024 + 1024 * math.ceil(rows / 1024) - rows) <= rows:
    tm = 1024
  return min(tm, 128 * math.ceil(max(rows, 1) / 128))


def ragged_capacity(tokens_per_device, k, num_devices, recv_capacity=None, num_local=1):
  """Receive-buffer rows of the ragged dispatch's round 0 and later rounds,
  written out from its documented rule (`moe_ragged_all_to_all`, `plan.default_capacity`):
  C = T_dev*K plus 4 * sqrt of it, rounded up to a multiple of 8 (at least 8) and from 4096
  up to a multiple of 512, at most the most a device can receive, N*T_dev*K rounded up to a
  multiple of 8, and that when it is at most 128 rows (`plan.DECODE_ROWS`); with more than
  one local expert, then rounded up to whole row tiles of TPU's grouped matmul (twice: more
  rows can take a larger tile) where that adds at most C / 16 rows; the big overflow rounds
  C rows, the last one C / 4 rounded up to a multiple of 8. Returns (C, big, last)."""
  if recv_capacity is not None:
    return recv_capacity, recv_capacity, recv_capacity
  first = _padded_load(tokens_per_device * k)
  first = first if first < 4096 else 512 * math.ceil(first / 512)
  most = max(8, 8 * math.ceil(num_devices * tokens_per_device * k / 8))
  first = most if most <= 128 or first > most else first
  if num_local > 1:
    tiled = first
    for _ in range(2):
      tm = _row_tile(tiled, num_local)
      tiled = tm * math.ceil(tiled / tm)
    first = tiled if 16 * (tiled - first) <= first else first
  return first, first, max(8, 8 * math.ceil(first / 4 / 8))


def ragged_windows(most, rows):
  """([(first row, rows)] of every round, last rounds: 0 or 1) of the ragged dispatch for a
  fullest receive order of `most` rows: round 0, big rounds while more than the last
  round's rows remain, then at most one last round (`plan.Rows`, written out)."""
  first, big, last = rows
  extra = max(most - first, 0)
  n_big = max(extra - last + big - 1, 0) // big
  out = [(0, first)] + [(first + r * big, big) for r in range(n_big)]
  n_last = int(extra > n_big * big)
  return out + [(first + n_big * big, last)] * n_last, n_last


def ragged_all_to_all(case, on_tpu=False):
  """The ragged dispatch's rounds, the bytes its exchanges send, and (CPU) the tiled
  kernel's loops in each round.

  Device (e, m) receives, for each local expert l and source (e_src, m), the source's items
  for that expert, laid out expert-major; round r moves the window [r*C, (r+1)*C) of that
  layout (C rows in round 0, then big rounds and at most one last small one:
  `ragged_windows`). Bytes are exact: each item crosses
  once out (D wide) and once back (F_out wide) when source and expert device differ. In
  fwd_bwd, round 0 is differentiated directly (its transpose: the same items, widths
  swapped) and each later round is replayed by the custom_vjp's backward: its dispatch
  again (XLA drops the replayed return, whose value the transpose does not need), then
  both exchanges transposed.
  """
  n_dev, N, M, L, T_dev, load = _layout(case)
  rows = ragged_capacity(T_dev, case.size.K, N, num_local=L)
  recv = load.reshape(N, M, N, L).transpose(1, 2, 0, 3)  # [m, e_dst, e_src, l]
  windows, n_last = ragged_windows(int(recv.sum(axis=(2, 3)).max()), rows)
  rounds = len(windows)
  # Position of each (source, expert) queue in its receiver's expert-major layout.
  flat = recv.transpose(0, 1, 3, 2).reshape(M, N, L * N)
  ends = np.cumsum(flat, axis=2).reshape(M, N, L, N).transpose(0, 1, 3, 2)  # [m, dst, src, l]
  starts = ends - recv
  D = case.size.D
  f_out = case.size.F if case.level == "kernel" else D
  b = np.dtype(jnp.dtype(case.size.dtype)).itemsize
  # The big rounds' loop runs its trips; the last round's cond takes branch 1 when it runs.
  trips = [
    {RAGGED_SCOPE: rounds - 1 - n_last, branch_key(RAGGED_LAST_SCOPE): n_last} for _ in range(n_dev)
  ]
  loop_of = lambda r: (
    "" if r == 0 else (RAGGED_LAST_SCOPE if r == rounds - n_last else RAGGED_SCOPE) + "/"
  )
  if not on_tpu:
    for d in range(n_dev):
      for scope, C in ((RAGGED_SCOPE, rows[1]), (RAGGED_LAST_SCOPE, rows[2])):
        trips[d].update({scope + "/" + k: 0 for k in loop_trip_counts(np.zeros(L, int), C)})
  out_items = np.zeros((rounds, M, N), np.int64)  # items sent to other devices
  back_items = np.zeros((rounds, M, N), np.int64)  # outputs returned to other devices
  other = ~np.eye(N, dtype=bool)  # [dst, src]
  for r, (lo, C) in enumerate(windows):
    got = np.clip(np.minimum(ends, lo + C) - np.maximum(starts, lo), 0, None)
    back_items[r] = np.where(other[None, :, :, None], got, 0).sum(axis=(2, 3))
    out_items[r] = np.where(other[None, :, :, None], got, 0).sum(axis=3).sum(axis=1)
    if not on_tpu:
      for e in range(N):
        for m in range(M):
          counts = loop_trip_counts(got[m, e].sum(axis=0), C)
          for k, v in counts.items():
            key = loop_of(r) + k
            trips[e * M + m][key] = trips[e * M + m].get(key, 0) + v
  fwd = out_items * D + back_items * f_out  # [r, m, e]
  bwd = out_items * f_out + back_items * D  # the transposes: cotangents out, dx back
  replays = np.where(np.arange(rounds) == 0, 0, 1)[:, None, None]
  sent = {
    "fwd": float(fwd.sum(axis=0).max() * b),
    "fwd_bwd": float((fwd + bwd + replays * out_items * D).sum(axis=0).max() * b),
  }
  return Accounting(rounds, 0, trips, sent_bytes=sent)


def all_gather(case, on_tpu=False):
  """One pass; per device, the tiled kernel's loops over the items of its own experts."""
  n_dev, N, M, L, T_dev, load = _layout(case)
  trips = [dict() for _ in range(n_dev)]
  if not on_tpu:
    for dst in range(n_dev):
      e_dst, m = divmod(dst, M)
      sizes = load[[e_src * M + m for e_src in range(N)]][:, e_dst * L : (e_dst + 1) * L]
      trips[dst] = loop_trip_counts(sizes.sum(axis=0), N * T_dev * case.size.K)
  return Accounting(None, 0, trips)


def ragged_dot(case, on_tpu=False):
  """Under jit on sharded inputs XLA runs the whole sort and grouped matmul on every device."""
  n_dev, *_, load = _layout(case)
  counts = {} if on_tpu else loop_trip_counts(load.sum(axis=0), case.size.T * case.size.K)
  return Accounting(None, 0, [dict(counts) for _ in range(n_dev)])


def masked_scan(case, on_tpu=False):
  """A scan over the E experts (its trip count is static; given for completeness)."""
  return Accounting(None, 0, [{"moe_masked_scan": case.E} for _ in range(case.mesh.size)])


def gshard(case, on_tpu=False):
  """No loops; items past each (group, expert)'s capacity dropped, a group being the tokens
  of one device (the same capacity formula as the layer's, `ms.capacity`), its queues filled
  slot-major: every token's first choice before any second choice."""
  n_dev, *_, T_dev, load = _layout(case)
  K = case.size.K
  C = ms.capacity(case.size.capacity_factor, T_dev, K, case.E)
  kept = np.zeros(case.experts_TK.shape, bool)
  for d in range(n_dev):
    e_TK = case.experts_TK[d * T_dev : (d + 1) * T_dev]
    filled = np.zeros(case.E + 1, np.int64)
    for j in range(K):  # slot-major
      for t in range(T_dev):
        e = e_TK[t, j] if 0 <= e_TK[t, j] < case.E else case.E
        if e < case.E and filled[e] < C:
          kept[d * T_dev + t, j] = True
        filled[e] += 1
  dropped = int(np.maximum(load - C, 0).sum())
  return Accounting(1, dropped, [dict() for _ in range(n_dev)], kept)


def unknown(case, on_tpu=False):
  """An implementation with no accounting: no rounds, nothing dropped, loops counted once
  (the benchmark marks such figures)."""
  return Accounting(None, 0, [dict() for _ in range(case.mesh.size)])


def routing_bound_bytes(case):
  """Bytes the busiest device must send, forward, when tokens move to their experts.

  Device d sends D-wide rows of its items bound for other devices' experts and returns
  F_out-wide outputs of the items other devices send to its experts: the least any
  dropless token-moving dispatch of this routing sends from d. Equals `bound_bytes` on
  average under uniform routing; skew raises it.
  """
  _, N, M, L, _, load = _layout(case)
  f_out = case.size.F if case.level == "kernel" else case.size.D
  load = load.reshape(N, M, N, L).sum(axis=3)  # [e_src, m, e_dst]
  own = np.eye(N, dtype=bool)[:, None, :]
  sent = np.where(own, 0, load).sum(axis=2)  # [e, m] items leaving device (e, m)
  returned = np.where(own, 0, load).sum(axis=0).T  # [e, m] items others send to (e, m)
  b = np.dtype(jnp.dtype(case.size.dtype)).itemsize
  return float(np.max(sent * case.size.D + returned * f_out) * b)


# --------------------------------------------------------------------------- placements
# With a placement the dispatch runs over S slots: the host models below give the slot of
# every item (the layer's documented replica rule), the step's plan for placement "step"
# (its documented rule), and the bytes of the replicas' weights the layer fetches. The
# per-implementation functions above then run on the case as the dispatch sees it (E = S,
# the items' slots as their ids).
