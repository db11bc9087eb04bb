"""The pure offset and size helpers of the all_to_all dispatch (`moe_shard.plan`).

Expected values are worked out by hand in the comments; a property test then checks that
the rounds of `round_slots` send every valid item exactly once, to its own destination.
"""

import re

import hypothesis
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from moe_shard.kernels import tpu as gmm_tpu
from moe_shard.plan import (
  Chunks,
  Rows,
  default_capacity,
  default_chunks,
  receive_starts,
  round_counts,
  round_slots,
  send_plan,
  window,
)

# --------------------------------------------------------------------------- default_chunks


@pytest.mark.parametrize(
  "tokens, k, n, want",
  [
    # C_first = mean + ceil(4 * sqrt(mean)), mean = ceil(T * K / N), rounded up to a
    # multiple of 8, at least 8; C_overflow = C_first.
    # mean = ceil(5 * 2 / 4) = 3 -> 3 + 7 = 10 -> 16.
    (5, 2, 4, Chunks(16, 16)),
    # mean = 64 -> 64 + 32 = 96 (a multiple of 8).
    (64, 2, 2, Chunks(96, 96)),
    # mean = ceil(100 / 3) = 34 -> 34 + 24 = 58 -> 64.
    (100, 1, 3, Chunks(64, 64)),
    # One device on the expert axis: mean = 40 * 2 = 80 -> 80 + 36 = 116 -> 120, more
    # than the 80 a pair can carry: 80, and N * 80 <= 128.
    (40, 2, 1, Chunks(80, 80)),
    # mean = 20 -> 20 + 18 = 38 -> 40 > the most, 20 -> 24.
    (10, 2, 1, Chunks(24, 24)),
    # Decode, 8 tokens per device, K=2, N=8: the margin gives mean 2 -> 2 + 6 -> 8, but the
    # most a pair carries is 16 and 8 * 16 = 128 rows <= DECODE_ROWS: 16, one round always.
    (8, 2, 8, Chunks(16, 16)),
    # 64 tokens: 8 * 128 rows > 128: the margin, mean 16 -> 16 + 16 = 32.
    (64, 2, 8, Chunks(32, 32)),
    # K=8 (Qwen3, DeepSeek-V3), 8 tokens: mean 8 -> 8 + 12 = 20 -> 24 < the most, 64.
    (8, 8, 8, Chunks(24, 24)),
    # The bench's CPU layer: mean = 1024 * 2 / 8 = 256 -> 256 + 64 = 320.
    (1024, 2, 8, Chunks(320, 320)),
    # The bench's TPU layer: mean = 4096 * 2 / 8 = 1024 -> 1024 + 128 = 1152.
    (4096, 2, 8, Chunks(1152, 1152)),
    # Tiny or empty: the floor of 8 slots.
    (1, 1, 8, Chunks(8, 8)),
    (0, 2, 4, Chunks(8, 8)),
  ],
)
def test_default_chunks(tokens, k, n, want):
  got = default_chunks(tokens, k, n)
  assert got == want
  assert got.first % 8 == 0 and got.overflow % 8 == 0


@pytest.mark.parametrize(
  "chunk_size, want",
  [
    (1, Chunks(1, 1)),
    (5, Chunks(5, 5)),
    ((3, 1), Chunks(3, 1)),
    ([3, 1], Chunks(3, 1)),
    ((1, 7), Chunks(1, 7)),
  ],
)
def test_default_chunks_explicit_size(chunk_size, want):
  # An explicit size ignores tokens, k and devices.
  assert default_chunks(40, 2, 4, chunk_size) == want


BAD_CHUNKS = [0, -1, (1, 2, 3), (2,), (0, 1), (2, 0), (1, -1), True, (True, 1), (1.5, 1), "ab", 1.5]


@pytest.mark.parametrize("chunk_size", BAD_CHUNKS)
def test_default_chunks_rejects(chunk_size):
  with pytest.raises(
    (TypeError, ValueError),
    match=re.escape(
      f"moe_all_to_all: chunk_size must be None, an int >= 1 or a pair of ints >= 1 "
      f"(got {chunk_size!r})"
    ),
  ):
    default_chunks(40, 2, 4, chunk_size)


def test_default_chunks_accepts_numpy_int():
  assert default_chunks(40, 2, 4, np.int64(4)) == Chunks(4, 4)


# --------------------------------------------------------------------------- Chunks


@pytest.mark.parametrize(
  "chunks, max_count, want",
  [
    (Chunks(3, 1), 0, 1),  # an empty queue still runs round 0
    (Chunks(3, 1), 3, 1),  # exactly fills round 0
    (Chunks(3, 1), 4, 2),  # one item over: one overflow round
    (Chunks(3, 1), 6, 4),  # 3 over, 1 per overflow round
    (Chunks(8, 8), 9, 2),
    (Chunks(8, 8), 16, 2),
    (Chunks(8, 8), 17, 3),
    (Chunks(8, 2), 13, 4),  # 1 + ceil((13 - 8) / 2) = 1 + 3
    (Chunks(1, 1), 40, 40),
  ],
)
def test_chunks_rounds(chunks, max_count, want):
  assert int(chunks.rounds(max_count)) == want
  assert int(chunks.rounds(np.int32(max_count))) == want


@pytest.mark.parametrize(
  "chunks, r, want",
  [
    (Chunks(3, 1), 1, 3),
    (Chunks(3, 1), 2, 4),
    (Chunks(3, 1), 3, 5),
    # Chunks(8, 2): round 0 is slots 0..7, round 1 8..9, round 2 10..11, round 3 12..13.
    (Chunks(8, 2), 1, 8),
    (Chunks(8, 2), 2, 10),
    (Chunks(8, 2), 3, 12),
  ],
)
def test_chunks_start(chunks, r, want):
  assert int(chunks.start(r)) == want


def test_chunks_traced():
  # Inside the dispatch both are called on traced values (the mesh-wide max, the loop index).
  chunks = Chunks(8, 2)
  rounds, start = jax.jit(lambda m, r: (chunks.rounds(m), chunks.start(r)))(
    jnp.int32(13), jnp.int32(3)
  )
  assert (int(rounds), int(start)) == (4, 12)


def test_chunks_rounds_cover_the_queue():
  # The slots of rounds 0 .. rounds-1 are contiguous and reach past the last item.
  for chunks in (Chunks(3, 1), Chunks(8, 2), Chunks(2, 5)):
    for count in range(0, 20):
      rounds = int(chunks.rounds(count))
      end = chunks.first + (rounds - 1) * chunks.overflow
      assert end >= count
      assert rounds == 1 or int(chunks.start(rounds - 1)) < count  # the last round is needed


# --------------------------------------------------------------------------- send_plan

# E = 4 experts on N = 2 devices (L = 2: experts 0, 1 on device 0; 2, 3 on device 1), K = 2.
#   experts_TK = [[3, 0], [1, -1], [2, 3]]
#   items i = t * K + j:   0:3  1:0  2:1  3:-1  4:2  5:3
# Stable sort by expert, invalid last: expert 0: item 1; 1: item 2; 2: item 4; 3: items 0, 5;
# invalid: item 3.
#   order_I = [1, 2, 4, 0, 5, 3], load_E = [1, 1, 1, 2]
#   count_N = [1 + 1, 1 + 2] = [2, 3], offset_N = [0, 2]
EXAMPLE_TK = [[3, 0], [1, -1], [2, 3]]


_round_slots_jit = jax.jit(round_slots, static_argnums=2)


def test_send_plan_by_hand():
  plan = send_plan(jnp.asarray(EXAMPLE_TK, jnp.int32), 4, 2)
  np.testing.assert_array_equal(plan.order_I, [1, 2, 4, 0, 5, 3])
  np.testing.assert_array_equal(plan.count_N, [2, 3])
  np.testing.assert_array_equal(plan.offset_N, [0, 2])
  np.testing.assert_array_equal(plan.valid_I, [True, True, True, False, True, True])
  for a in (plan.order_I, plan.count_N, plan.offset_N):
    assert a.dtype == jnp.int32


@pytest.mark.parametrize(
  "start, size, want",
  [
    # Round 0 with C = 2: device 0 gets its 2 items (sorted positions 0, 1: items 1, 2);
    # device 1 the first 2 of its 3 (positions 2, 3: items 4, 0).
    (0, 2, [[1, 2], [4, 0]]),
    # Next round, slots 2..3: device 0 is done; device 1 gets position 4 (item 5).
    (2, 2, [[-1, -1], [5, -1]]),
    # One round of C = 4 holds everything, padded.
    (0, 4, [[1, 2, -1, -1], [4, 0, 5, -1]]),
    # C = 1, slot 1: device 0 position 1 (item 2), device 1 position 3 (item 0).
    (1, 1, [[2], [0]]),
    # Past the end of every queue (never reads out of bounds): all padding.
    (5, 3, [[-1, -1, -1], [-1, -1, -1]]),
  ],
)
def test_round_slots_by_hand(start, size, want):
  plan = send_plan(jnp.asarray(EXAMPLE_TK, jnp.int32), 4, 2)
  # `start` is traced in the overflow rounds: jit with a traced start, size static.
  got = _round_slots_jit(plan, jnp.int32(start), size)
  assert got.shape == (2, size) and got.dtype == jnp.int32
  np.testing.assert_array_equal(got, want)


def test_round_slots_skips_empty_destinations_and_invalid_ids():
  # E = 4 on N = 4 devices (L = 1), K = 1: experts_TK = [[2], [4], [2], [0]].
  # Items 0:2  1:4 (invalid)  2:2  3:0 -> order_I = [3, 0, 2, 1], count_N = [1, 0, 2, 0],
  # offset_N = [0, 1, 1, 3]. Device 3's offset points at the invalid item 1, but its count is 0.
  plan = send_plan(jnp.asarray([[2], [4], [2], [0]], jnp.int32), 4, 4)
  np.testing.assert_array_equal(plan.order_I, [3, 0, 2, 1])
  np.testing.assert_array_equal(plan.count_N, [1, 0, 2, 0])
  np.testing.assert_array_equal(plan.offset_N, [0, 1, 1, 3])
  np.testing.assert_array_equal(round_slots(plan, 0, 1), [[3], [-1], [0], [-1]])
  np.testing.assert_array_equal(round_slots(plan, 1, 1), [[-1], [-1], [2], [-1]])
  np.testing.assert_array_equal(round_slots(plan, 2, 1), [[-1], [-1], [-1], [-1]])


def test_send_plan_int32_extremes_are_invalid():
  # The int32 extremes and E itself are never sent (no overflow of offset arithmetic).
  ids = jnp.asarray([[-(2**31), 1], [2**31 - 1, 4], [-1, 0]], jnp.int32)
  plan = send_plan(ids, 4, 2)
  np.testing.assert_array_equal(plan.valid_I, [False, True, False, False, False, True])
  np.testing.assert_array_equal(plan.count_N, [2, 0])
  np.testing.assert_array_equal(round_slots(plan, 0, 3), [[5, 1, -1], [-1, -1, -1]])


@st.composite
def plans(draw):
  """(experts_TK: [6, 2] with some invalid ids, E = 4, N, Chunks).

  One shape and few chunk sizes, so the eager ops compile once and the examples reuse them.
  """
  E, T, K = 4, 6, 2
  N = draw(st.sampled_from([2, 4, 1]))
  ids = draw(
    st.lists(st.sampled_from(list(range(E)) + [-1, E, -(2**31)]), min_size=T * K, max_size=T * K)
  )
  chunks = Chunks(draw(st.sampled_from([1, 3])), draw(st.sampled_from([1, 2])))
  return np.asarray(ids, np.int32).reshape(T, K), E, N, chunks


@hypothesis.settings(max_examples=12)
@hypothesis.given(plans())
def test_rounds_send_every_valid_item_once(problem):
  experts_TK, E, N, chunks = problem
  L = E // N
  ids_I = experts_TK.reshape(-1).astype(np.int64)
  valid_I = (ids_I >= 0) & (ids_I < E)
  want_count_N = np.bincount(ids_I[valid_I] // L, minlength=N)
  plan = send_plan(jnp.asarray(experts_TK), E, N)
  np.testing.assert_array_equal(plan.count_N, want_count_N)
  rounds = int(chunks.rounds(plan.count_N.max()))
  assert rounds == 1 + -(-max(0, want_count_N.max() - chunks.first) // chunks.overflow)
  slots = [np.asarray(round_slots(plan, 0, chunks.first))]
  slots += [
    np.asarray(round_slots(plan, chunks.start(r), chunks.overflow)) for r in range(1, rounds)
  ]
  sent = {n: [i for s in slots for i in s[n] if i >= 0] for n in range(N)}
  # Every valid item exactly once, in the row of its destination device, in expert order.
  assert sorted(i for n in sent for i in sent[n]) == list(np.flatnonzero(valid_I))
  for n, items in sent.items():
    assert all(ids_I[i] // L == n for i in items), (n, items)
    assert list(ids_I[items]) == sorted(ids_I[items])
  # No round after the last is needed: one more would be all padding.
  extra = round_slots(plan, chunks.start(rounds), chunks.overflow)
  np.testing.assert_array_equal(extra, -1)


# --------------------------------------------------------------------------- round_counts


def test_round_counts_by_hand():
  # Chunks(8, 2), queues of 2, 3, 0 and 13 items; rounds start at slots 0, 8, 10, 12.
  #   13 items: round 0 takes 8, rounds 1 and 2 take 2 each, round 3 the last 1.
  #   2, 3 and 0 items: all in round 0 (or none), nothing after.
  sent_RN, slots_R = round_counts(np.array([2, 3, 0, 13]), Chunks(8, 2), 4)
  np.testing.assert_array_equal(slots_R, [8, 2, 2, 2])
  np.testing.assert_array_equal(sent_RN, [[2, 3, 0, 8], [0, 0, 0, 2], [0, 0, 0, 2], [0, 0, 0, 1]])
  assert sent_RN.dtype == slots_R.dtype == jnp.int32


def test_round_counts_per_source_matches_round_slots():
  # S = 2 sources: each source's counts per round are the live slots of `round_slots`.
  sources = [EXAMPLE_TK, [[0, 1], [1, 0], [3, 2]]]
  plans = [send_plan(jnp.asarray(e, jnp.int32), 4, 2) for e in sources]
  count_SN = jnp.stack([p.count_N for p in plans])  # [[2, 3], [4, 2]]
  chunks = Chunks(2, 1)
  rounds = int(chunks.rounds(count_SN.max()))  # 1 + (4 - 2) = 3
  sent_SRN, slots_R = round_counts(count_SN, chunks, rounds)
  assert sent_SRN.shape == (2, 3, 2)
  np.testing.assert_array_equal(slots_R, [2, 1, 1])
  for s, plan in enumerate(plans):
    for r in range(rounds):
      start = 0 if r == 0 else chunks.start(r)
      live_N = (np.asarray(round_slots(plan, start, int(slots_R[r]))) >= 0).sum(axis=1)
      np.testing.assert_array_equal(sent_SRN[s, r], live_N)
  # Every item is sent in some round.
  np.testing.assert_array_equal(sent_SRN.sum(axis=1), count_SN)


@pytest.mark.parametrize(
  "count, rounds, err, match",
  [
    (np.array([1.0, 2.0]), 1, TypeError, "round_counts: count_N must have an integer dtype"),
    (np.array([1, 2]), 0, ValueError, r"round_counts: rounds must be in \[1, "),
    (np.array([1, 2]), 1.0, TypeError, "round_counts: rounds must be an int"),
  ],
)
def test_round_counts_rejects(count, rounds, err, match):
  with pytest.raises(err, match=match):
    round_counts(count, Chunks(8, 8), rounds)


# --------------------------------------------------------------------------- ragged dispatch


@pytest.mark.parametrize(
  "tokens, k, capacity, want",
  [
    # T*K = 10 -> 10 + ceil(4 * 3.16) = 23 -> 24; big rounds as many, the last a quarter.
    (5, 2, None, Rows(24, 24, 8)),
    # 128 -> 128 + ceil(45.25) = 174 -> 176; big rounds as many, the last a quarter.
    (64, 2, None, Rows(176, 176, 48)),
    # The benchmark's T_dev = 32768 / 8, K = 2: 8192 + 363 = 8555 -> 8560, past 4096 rows
    # whole 512-row tiles: 8704; big rounds as many, the last a quarter.
    (4096, 2, None, Rows(8704, 8704, 2176)),
    # 1800 * 2 = 3600 + 240 = 3840 < 4096: multiples of 8 only; big rounds as many, the last a quarter.
    (1800, 2, None, Rows(3840, 3840, 960)),
    (1, 1, None, Rows(8, 8, 8)),  # 1 + 4 -> the floor of 8 rows
    (0, 2, None, Rows(8, 8, 8)),
    (40, 2, 3, Rows(3, 3, 3)),  # an explicit capacity: every round
  ],
)
def test_default_capacity(tokens, k, capacity, want):
  assert default_capacity(tokens, k, capacity) == want


@pytest.mark.parametrize(
  "tokens, k, n, want",
  [
    # Decode, 8 tokens per device, K=2, N=8: the margin gives 16 + 16 = 32 rows, the most
    # a device can receive is 8 * 8 * 2 = 128 <= DECODE_ROWS: 128, one round always.
    (8, 2, 8, Rows(128, 128, 32)),
    # 64 tokens: the most is 1024 > 128: the margin, 128 + 46 = 174 -> 176; big rounds as many, the last a quarter.
    (64, 2, 8, Rows(176, 176, 48)),
    # 256 tokens (Mixtral at 256 per chip): 512 + 91 = 603 -> 608; big rounds as many, the last a quarter.
    (256, 2, 8, Rows(608, 608, 152)),
    # K=8, 8 tokens, N=8: the most is 512 > 128: 64 + 32 = 96; big rounds as many, the last a quarter.
    (8, 8, 8, Rows(96, 96, 24)),
    # One device: the most it receives is its own 5 * 2 = 10 -> 16 rows (the margin: 24).
    (5, 2, 1, Rows(16, 16, 8)),
    # Training sizes unchanged: 4096 * 2 -> 8704 (whole 512-row tiles).
    (4096, 2, 8, Rows(8704, 8704, 2176)),
  ],
)
def test_default_capacity_bounded_by_devices(tokens, k, n, want):
  assert default_capacity(tokens, k, None, num_devices=n) == want
  assert default_capacity(tokens, k, 7, num_devices=n) == Rows(7, 7, 7)  # explicit wins


@pytest.mark.parametrize(
  "tokens, k, n, L, want, whole",
  [
    # Qwen3-30B-A3B at 256 tokens per chip (16 local experts): 2048 + 181 -> 2232 rows, in
    # 256-row tiles of the grouped matmul (15 * 512 * 4 > 3 * 2232): 2304 (72 <= 2232 / 16).
    (256, 8, 8, 16, Rows(2304, 2304, 576), True),
    # gpt-oss-120b (K=4): 1024 + 128 = 1152 -> 1280 would add 128 > 1152 / 16 rows: stays.
    (256, 4, 8, 16, Rows(1152, 1152, 288), False),
    # Two local experts, 4 * 512 <= 3 * 2232: 512-row tiles, 2560 would add 328: stays.
    (256, 8, 8, 2, Rows(2232, 2232, 560), False),
    # One local expert (a dense matmul, no row tiles): unchanged.
    (256, 2, 8, 1, Rows(608, 608, 152), False),
    # Small buffers stay (24 rows would take a 128-row tile); decode's 128 rows are whole.
    (5, 2, 4, 2, Rows(40, 40, 16), False),
    (8, 2, 8, 8, Rows(128, 128, 32), True),
    # Training sizes: already whole 512-row tiles.
    (4096, 2, 8, 8, Rows(8704, 8704, 2176), True),
  ],
)
def test_default_capacity_whole_row_tiles(tokens, k, n, L, want, whole):
  got = default_capacity(tokens, k, None, num_devices=n, num_local=L)
  assert got == want
  # Whole row tiles: the grouped matmul pads nothing.
  tm = gmm_tpu.default_tiling(got.first, 128, 128, jnp.bfloat16, num_groups=L)[0]
  assert (got.first % tm == 0) == whole


@pytest.mark.parametrize(
  "capacity, err", [(0, ValueError), (-2, ValueError), (1.5, TypeError), (True, TypeError)]
)
def test_default_capacity_rejects(capacity, err):
  with pytest.raises(err, match=re.escape("moe_ragged_all_to_all: recv_capacity must be ")):
    default_capacity(40, 2, capacity)


def test_receive_starts_by_hand():
  # recv[s, l]: 3 sources, 2 local experts. Expert-major order: (s0,l0)=2, (s1,l0)=0,
  # (s2,l0)=1, then (s0,l1)=4, (s1,l1)=3, (s2,l1)=5.
  recv_SL = jnp.array([[2, 4], [0, 3], [1, 5]])
  # Starts: l0: 0, 2, 2; l1: 3, 7, 10.
  np.testing.assert_array_equal(receive_starts(recv_SL), [[0, 3], [2, 7], [2, 10]])


@pytest.mark.parametrize(
  "start, count, lo, size, want",
  [
    # A queue at [3, 8) and the window [0, 4): its first item, written at row 3.
    (3, 5, 0, 4, (0, 1, 3)),
    # The window [4, 8): items 1..4 of the queue, written from row 0.
    (3, 5, 4, 4, (1, 4, 0)),
    # The window [8, 12): nothing left (n = 0), `at` clipped to 0.
    (3, 5, 8, 4, (5, 0, 0)),
    # A queue wholly past the window [0, 2): nothing, `at` clipped to the size.
    (6, 2, 0, 2, (0, 0, 2)),
    # An empty queue.
    (0, 0, 0, 4, (0, 0, 0)),
  ],
)
def test_window_by_hand(start, count, lo, size, want):
  got = window(jnp.int32(start), jnp.int32(count), jnp.int32(lo), size)
  assert tuple(int(v) for v in got) == want


@hypothesis.settings(max_examples=15)
@hypothesis.given(
  st.lists(st.lists(st.integers(0, 6), min_size=3, max_size=3), min_size=1, max_size=4),
  st.integers(1, 7),
)
def test_windows_receive_every_item_once_grouped_by_expert(recv, capacity):
  # The rounds' windows cover each (source, expert) queue exactly once; the rows of each
  # round's buffer are grouped by expert, in the order of the receive layout.
  recv_SL = np.array(recv).T  # [S=3, L]
  start_SL = np.asarray(receive_starts(jnp.asarray(recv_SL)))
  total = int(recv_SL.sum())
  rounds = max(1, -(-total // capacity))
  seen = np.zeros(recv_SL.shape, int)
  for r in range(rounds):
    skip, n, at = (
      np.asarray(a)
      for a in window(jnp.asarray(start_SL), jnp.asarray(recv_SL), r * capacity, capacity)
    )
    assert np.all(n >= 0) and np.all(at + n <= capacity)
    np.testing.assert_array_equal(skip, seen)  # each round resumes where the last stopped
    seen += n
    rows = np.full(capacity, -1)
    for s, l in zip(*np.nonzero(n)):
      assert np.all(rows[at[s, l] : at[s, l] + n[s, l]] == -1)  # no overlap
      rows[at[s, l] : at[s, l] + n[s, l]] = l
    filled = rows[: int(n.sum())]
    assert np.all(filled >= 0) and np.all(np.diff(filled) >= 0)  # packed, expert-major
  np.testing.assert_array_equal(seen, recv_SL)


@pytest.mark.parametrize(
  "most, want",
  [
    (8704, (0, 0)),  # round 0 holds it
    (8704 + 100, (0, 1)),  # a little more: one last round of 2176 rows
    (8704 + 2176, (0, 1)),  # exactly the last round
    (8704 + 2177, (1, 0)),  # more than the last round holds: one big round
    (8704 + 8704 + 2176, (1, 1)),
    (27081, (2, 1)),  # E=64 under Zipf s=1.2 (the busiest chip's rows): 2 big, 1 last
  ],
)
def test_rows_rounds_big_then_one_last(most, want):
  # Past round 0's 8704 rows: big rounds of 8704 while more than 2176 rows remain, then at
  # most one last round of 2176 (27081 - 8704 = 18377 = 2 * 8704 + 969).
  rows = Rows(8704, 8704, 2176)
  n_big, n_last = rows.rounds(jnp.asarray(most))
  assert (int(n_big), int(n_last)) == want
  assert rows.last_start(int(n_big)) == 8704 + int(n_big) * 8704
  covered = rows.first + int(n_big) * rows.big + int(n_last) * rows.last
  assert covered >= most
