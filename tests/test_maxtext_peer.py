"""The host-side counts of `bench.peers.maxtext_peer` (MaxText itself is not imported here)."""

import numpy as np
import pytest

from bench.peers import maxtext_layer as mp


def test_capacity_drops_matches_maxtexts_own_example():
  # MaxText's TokenDroppingTest.test_generate_masks: E=8, K=2, 4 sequences of 4 tokens,
  # capacity_factor=2 -> capacity (4 * 2 / 8) * 2 = 2 per sequence and expert. Dropped, by
  # hand: sequence 0 the 3rd item of expert 0, sequence 1 the 3rd of expert 1, sequence 2
  # the 3rd and 4th of expert 2.
  experts_BSK = np.array(
    [
      [[0, 5], [0, 4], [1, 0], [3, 5]],
      [[1, 2], [4, 1], [5, 0], [7, 1]],
      [[6, 2], [2, 3], [4, 2], [1, 2]],
      [[4, 1], [0, 7], [5, 0], [4, 7]],
    ]
  )
  assert mp.capacity_drops(experts_BSK, 8, 2.0) == 4


def test_capacity_rounds_the_balanced_load_up_before_the_factor():
  # S * K / E = 3 / 2 -> ceil 2, times 1.0: capacity 2 of 3 items to expert 0.
  assert mp.capacity_drops(np.zeros((1, 3, 1), int), 2, 1.0) == 1
  # 1.25 * ceil(3 / 2) = 2.5 -> int 2: still one dropped.
  assert mp.capacity_drops(np.zeros((1, 3, 1), int), 2, 1.25) == 1
  # Each sequence has its own capacity, ceil(2 / 2) = 1: expert 0's two items, one per
  # sequence, both fit; two in one sequence do not.
  assert mp.capacity_drops(np.array([[[0], [1]], [[0], [1]]]), 2, 1.0) == 0
  assert mp.capacity_drops(np.array([[[0], [0]], [[1], [1]]]), 2, 1.0) == 2


def test_buffer_drops_counts_what_overflows_each_shard():
  experts_TK = np.zeros((4, 1), int)  # every item to expert 0, on shard 0 of 2
  # Buffer int(4 / 2 * 1 * 1.0) = 2 rows per shard: 2 of the 4 items overflow.
  assert mp.buffer_drops(experts_TK, 4, 2, 1.0) == 2
  assert mp.buffer_drops(experts_TK, 4, 2, 2.0) == 0
  assert mp.buffer_drops(experts_TK, 4, 2, -1.0) == 0  # worst-case buffer
  # Experts 0, 1 on shard 0 and 2, 3 on shard 1: an even split drops nothing at 1.0.
  assert mp.buffer_drops(np.array([[0], [1], [2], [3]]), 4, 2, 1.0) == 0


def test_dropped_uses_each_paths_rule():
  # 2 shards, sequences of 2 tokens: tokens 0, 1 form sequence 0.
  experts_TK = np.array([[0, 1], [0, 1], [0, 1], [2, 3]])
  # capacity: int(max(ceil(2 * 2 / 4) * 1.25, 1.25)) = 1 per sequence and expert: sequence 0
  # drops the 2nd items of experts 0 and 1; sequence 1 drops nothing.
  assert mp.dropped("maxtext_capacity", experts_TK, 4, 2) == 2
  assert mp.dropped("maxtext_megablox", experts_TK, 4, 2) == 0
  # Shard 0 receives 6 items into int(2 * 2 * 1.25) = 5 rows.
  assert mp.dropped("maxtext_megablox_rbf1.25", experts_TK, 4, 2) == 1


def test_config_needs_whole_sequences_per_device():
  fields = mp.maxtext_config("maxtext_capacity", 8, 32768, 2048, 4096, 2, 8)
  assert fields["max_target_length"] * fields["ici_expert_parallelism"] == 32768
  assert fields["capacity_factor"] == 1.25 and not fields["sparse_matmul"]
  with pytest.raises(ValueError, match=r"maxtext_peer: tokens \(100\) must be divisible"):
    mp.maxtext_config("maxtext_capacity", 8, 100, 2048, 4096, 2, 8)


def test_every_path_has_a_summary_for_the_results_file():
  assert set(mp.SUMMARIES) == set(mp.PATHS)
