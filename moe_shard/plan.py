"""Offset and size math of the expert-parallel dispatch, as pure functions (no collectives).

The all_to_all dispatch sends, in round r, slots [start_r, start_r + C_r) of each
(source, destination) queue. Round 0 has C_first slots, every later (overflow) round
C_overflow (`Chunks`). The ragged dispatch's receive buffers: round 0's rows, big overflow
rounds' and one last small round's (`Rows`). Everything here is local to one device and
testable on its own.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp

from moe_shard import _checks, local
from moe_shard.kernels.tpu_tiling import LANES, MAX_ROW_TILE, default_tiling

# Receive buffers of at most this many rows hold the most that can arrive, whatever the
# routing (`default_chunks`, `default_capacity`): one round, so the weights are read once.
# A buffer's matmul does 2 * rows FLOPs per weight it reads (2 bytes in bf16), so it costs
# less than reading the weight while rows stay under the chip's FLOPs per HBM byte: about
# 240 on TPU v5e (197 TFLOP/s over 819 GB/s) and 560 on v6e, the peaks `bench/reading/tpu.py` cites.
DECODE_ROWS = 128


@dataclasses.dataclass(frozen=True)
class Chunks:
  """Static slot counts of the all_to_all rounds.

  Attributes:
    first: C_first, slots per (source, destination) pair in round 0.
    overflow: C_overflow, slots per pair in every later round.
  """

  first: int
  overflow: int

  def rounds(self, max_count):
    """Rounds needed to empty a queue of `max_count` items (traced or concrete), >= 1."""
    extra = jnp.maximum(max_count - self.first, 0)
    return 1 + (extra + self.overflow - 1) // self.overflow

  def start(self, r):
    """First slot of round r (r >= 1 traced is fine)."""
    return self.first + (r - 1) * self.overflow


@dataclasses.dataclass(frozen=True)
class Rows:
  """Static receive-buffer rows of the ragged dispatch's rounds.

  Round 0 receives `first` rows of each device's receive order. Past them, while more than
  `last` rows remain, rounds of `big` rows run; then at most one round of `last` rows takes
  the rest. Each round re-reads every local weight and, in the backward, replays its
  forward and writes the weight gradient, so large rounds cost less per row; one small
  round at the end keeps the padding of a small excess small.

  Attributes:
    first: C, rows of round 0.
    big: rows of each big overflow round.
    last: rows of the last, small overflow round (at most `big`).
  """

  first: int
  big: int
  last: int

  def rounds(self, most):
    """(big rounds, last rounds: 0 or 1) to receive `most` rows (traced or concrete)."""
    extra = jnp.maximum(most - self.first, 0)
    n_big = jnp.maximum(extra - self.last + self.big - 1, 0) // self.big
    return n_big, (extra > n_big * self.big).astype(n_big.dtype)

  def start(self, r):
    """First row of big round r >= 1 (traced is fine)."""
    return self.first + (r - 1) * self.big

  def last_start(self, n_big):
    """First row of the last round, after `n_big` big rounds."""
    return self.first + n_big * self.big


def default_chunks(tokens, k, num_devices, chunk_size=None):
  """Chooses the slot counts of the dispatch rounds.

  With `chunk_size=None`, round 0 carries the expected load of a (source, destination) pair
  under uniform routing plus a margin of 4 standard deviations, `padded_load(ceil(T*K/N))`:
  mean + 4 * sqrt(mean), rounded up to a multiple of 8 (T*K/N = 1024: 1152, 9/8 of it;
  256: 320). Under uniform random routing a pair's load has a standard deviation below
  sqrt(mean), and the busiest of the N^2 pairs exceeds the mean by about 2.5 of them, so
  uniform routing runs one round with little padding. Overflow rounds carry C_first too:
  every round moves rows between [K, T, D] item buffers and the slots, O(T*K*D) bytes
  whatever its slot count, and re-reads every local expert's weights (in the backward it
  replays its forward and writes their gradient again), so a round saved is worth more
  than its slots: under Zipf skew few large rounds beat many small ones
  (bench/results/tpu_v6e_2x4_skew_exchanges against ..._quarter_rounds).

  Round 0 never takes more than the most a pair can carry, T*K rounded up to a multiple of
  8, and takes exactly that when the receive buffer it gives, N times it, is at most
  `DECODE_ROWS`: at decode sizes every routing then runs one round, so the experts'
  weights are read once (each round reads them again), for a buffer whose matmul costs
  less than that read (T=8, K=2, N=8: 16 slots, 128 rows).

  Args:
    tokens: T tokens per device (static).
    k: K slots per token.
    num_devices: N devices on the expert axis.
    chunk_size: None (default, as above), an int C (both rounds C), or a pair
      (C_first, C_overflow).

  Returns:
    `Chunks`.

  Raises:
    TypeError, ValueError: a `chunk_size` that is not None, an int >= 1 or a pair of them.
  """
  chunk_size = _checks.chunk_size_field("moe_all_to_all", chunk_size)
  if chunk_size is None:
    most = max(8, 8 * math.ceil(tokens * k / 8))  # every item of a source to one device
    first = padded_load(math.ceil(tokens * k / num_devices))
    if num_devices * most <= DECODE_ROWS or first > most:
      first = most
    return Chunks(first, first)
  return Chunks(*chunk_size)


def padded_load(mean):
  """A buffer for a load of `mean` items on average under uniform random routing: mean + 4 *
  sqrt(mean), rounded up to a multiple of 8, at least 8 (1024 -> 1152; 256 -> 320; 10 -> 24).
  """
  return max(8, 8 * math.ceil((mean + math.ceil(4 * math.sqrt(mean))) / 8))


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SendPlan:
  """Where each of a device's (token, slot) items goes.

  Items are sorted by global expert id, so by destination device, then local expert.

  Attributes:
    order_I: i32[I] item (t * K + j) at each sorted position; I = T * K.
    count_N: i32[N] valid items bound for each device.
    offset_N: i32[N] sorted position of the first item bound for each device.
    valid_I: bool[I] per item (unsorted): expert id in [0, E).
  """

  order_I: jax.Array
  count_N: jax.Array
  offset_N: jax.Array
  valid_I: jax.Array


def send_plan(experts_TK, num_experts, num_devices):
  """Sorts a device's items by destination device (expert id // L).

  Args:
    experts_TK: int[T, K] global expert ids; ids outside [0, E) are never sent.
    num_experts: E.
    num_devices: N, with E % N == 0.

  Returns:
    `SendPlan`.
  """
  order_I, load_E, valid_I = local.sort_by_expert(experts_TK.reshape(-1), num_experts)
  count_N = load_E.reshape(num_devices, -1).sum(axis=1)
  offset_N = jnp.cumsum(count_N) - count_N
  return SendPlan(order_I, count_N.astype(jnp.int32), offset_N.astype(jnp.int32), valid_I)


def round_slots(plan, start, size):
  """Returns the item sent in each slot of a round, or -1 for a padding slot.

  Args:
    plan: `SendPlan`.
    start: first slot of the round in each (source, destination) queue (traced ok).
    size: C, slots per destination in this round (static).

  Returns:
    i32[N, C] item index (t * K + j) per (destination, slot), -1 where padding.
  """
  c_C = jnp.arange(size, dtype=jnp.int32)
  pos_NC = start + c_C[None, :]
  live_NC = pos_NC < plan.count_N[:, None]
  sorted_NC = jnp.minimum(plan.offset_N[:, None] + pos_NC, plan.order_I.shape[0] - 1)
  return jnp.where(live_NC, plan.order_I[sorted_NC], -1)


def round_counts(count_N, chunks, rounds):
  """Returns the items each (source, destination) queue sends in each round, and C_r.

  Round r sends slots [start_r, start_r + C_r) of every queue, so a queue of `count` items
  fills `min(C_r, max(count - start_r, 0))` of them; the other slots of the round are
  padding. This is the host-side picture of what the dispatch's `all_to_all`s carry.

  Args:
    count_N: int[..., N] queue lengths: `SendPlan.count_N` of one device, or int[S, N] for
      S source devices.
    chunks: `Chunks`.
    rounds: R rounds to lay out, a Python int >= 1 (e.g. `int(chunks.rounds(count.max()))`).

  Returns:
    (sent_RN: i32[..., R, N] items sent in round r to destination n, slots_R: i32[R] the
    slots C_r of each queue in round r: C_first, then C_overflow).

  Raises:
    TypeError: `count_N` is not an integer array or `rounds` not an int.
    ValueError: `rounds` is below 1.
  """
  count_N = _checks.int_array("round_counts", "count_N", count_N)
  rounds = _checks.int_in_range("round_counts", "rounds", rounds, 1, 2**31 - 1)
  slots_R = jnp.asarray([chunks.first] + [chunks.overflow] * (rounds - 1), jnp.int32)
  start_R = jnp.cumsum(slots_R) - slots_R
  left_RN = count_N.astype(jnp.int32)[..., None, :] - start_R[:, None]
  return jnp.clip(left_RN, 0, slots_R[:, None]), slots_R


# --------------------------------------------------------------------------- ragged_all_to_all
# The ragged dispatch sends each (source, destination, local expert) queue exactly. A device's
# receive order is expert-major, source-minor: the queues of local expert 0 from sources
# 0..N-1, then those of expert 1, and so on, so rows arrive grouped by local expert. Round r
# moves the window [start_r, start_r + C_r) of every device's receive order into its C_r-row
# buffer: round 0 C rows, then big rounds and one last small one (`Rows`).


def default_capacity(tokens, k, recv_capacity=None, num_devices=None, num_local=1):
  """Rows of the ragged dispatch's receive buffers per device: round 0's, then the others'.

  Args:
    tokens: T tokens per device (static).
    k: K slots per token.
    recv_capacity: None (default): round 0 takes the expected load T*K (every device receives
      T*K items on average) plus 4 standard deviations, `padded_load(T*K)` (2048 -> 2232),
      and from 4096 rows up a multiple of `kernels.tpu_tiling.MAX_ROW_TILE` (512: 8192 -> 8704,
      1.0625x), the row tile of TPU's grouped matmul, which would otherwise copy the buffer
      into a padded one on every call; the overflow rounds as many (`Rows.big`), the last
      of them a quarter of that, rounded up to a multiple of 8 (`Rows.last`): few large
      rounds, each of which re-reads every local weight (figures:
      bench/results/tpu_v5e_2x4_skew, the "none" rows), and a small excess padded little. With `num_devices`, round 0 never takes more than the most a device can
      receive, N*T*K rounded up to a multiple of 8, and takes exactly that when it is at
      most `DECODE_ROWS`: at decode sizes every routing then runs one round, reading the
      weights once (T=8, K=2, N=8: 128 rows, where the margin gives 32 and skewed routings
      up to 13 rounds of 8). With `num_local` > 1, round 0 is then rounded up to whole row
      tiles of TPU's grouped matmul (`kernels.tpu_tiling.default_tiling`'s tm for that many rows
      and groups) where that adds at most 1/16 of its rows: the kernel would otherwise pad
      a copy of the buffer on every call (256 tokens per device, K=8: 2232 -> 2304 rows),
      while every other pass over the buffer moves the added rows (K=4: 1152 stays, not
      1280). An int C >= 1: C rows in every round.
    num_devices: N devices on the expert axis (default None: no such bound).
    num_local: L local experts per device, the grouped matmul's groups (default 1: one
      expert runs as a dense matmul, no row tiles).

  Returns:
    `Rows(first, big, last)`.

  Raises:
    TypeError, ValueError: a `recv_capacity` that is not None or an int >= 1.
  """
  if recv_capacity is not None:
    c = _checks.int_field("moe_ragged_all_to_all", "recv_capacity", recv_capacity, 1)
    return Rows(c, c, c)
  first = padded_load(tokens * k)
  if first >= 4096:
    first = MAX_ROW_TILE * math.ceil(first / MAX_ROW_TILE)
  if num_devices is not None:
    most = max(8, 8 * math.ceil(num_devices * tokens * k / 8))  # every source sends all here
    if most <= DECODE_ROWS or first > most:
      first = most
  if num_local > 1:
    tiled = first
    for _ in range(2):  # more rows can take a larger tile (256 -> 512), once
      tm = default_tiling(tiled, LANES, LANES, jnp.bfloat16, num_groups=num_local)[0]
      tiled = tm * math.ceil(tiled / tm)
    if 16 * (tiled - first) <= first:  # padding rows move in every pass over the buffer
      first = tiled
  return Rows(first, first, max(8, 8 * math.ceil(first / 4 / 8)))


def receive_starts(recv_SL):
  """Where each (source, local expert) queue begins in this device's receive order.

  Args:
    recv_SL: int[S, L] items source s sends to local expert l of this device.

  Returns:
    i32[S, L]: exclusive prefix sums in expert-major, source-minor order.
  """
  flat = recv_SL.T.reshape(-1).astype(jnp.int32)  # [L * S], expert-major
  return (jnp.cumsum(flat) - flat).reshape(recv_SL.shape[::-1]).T


def window(start, count, lo, size):
  """The part of a queue that falls in the window [lo, lo + size) of a receive order.

  A queue of `count` items at positions [start, start + count) of its receiver's order
  sends its items [skip, skip + n) in this round, written at `at` of the receive buffer.
  The rounds' windows tile the receive order, so every item falls in exactly one.

  Args:
    start, count: int arrays of one shape (traced ok).
    lo: first position of the window (traced ok).
    size: C, its length.

  Returns:
    (skip, n, at), i32 arrays of that shape; n == 0 where the window misses the queue
    (then `at` is clipped into [0, size]).
  """
  first = jnp.clip(lo - start, 0, count)
  last = jnp.clip(lo + size - start, 0, count)
  at = jnp.clip(start + first - lo, 0, size)
  return first.astype(jnp.int32), (last - first).astype(jnp.int32), at.astype(jnp.int32)
