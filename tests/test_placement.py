"""Placements (`moe_shard/placement.py`): EPLB's arrays, its packing, the replica rule.

Expected values are derived by hand in the comments from DeepSeek EPLB's algorithm
(github.com/deepseek-ai/EPLB `eplb.py`) and the documented rules; no library output is
copied. Host-only and small `jnp` programs: no mesh.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import moe_shard as ms
from moe_shard import placement as pl
from moe_shard import planning, replica_rule


def test_from_phy2log_builds_eplb_arrays():
  p = ms.Placement.from_phy2log(np.array([0, 1, 2, 3, 0, 0, 1, 2]), num_experts=4)
  np.testing.assert_array_equal(p.logcnt, [3, 2, 2, 1])
  # Each expert's slots in increasing order, -1 padded to the most replicas (3).
  np.testing.assert_array_equal(p.log2phy, [[0, 4, 5], [1, 6, -1], [2, 7, -1], [3, -1, -1]])
  assert (p.num_slots, p.num_experts, p.num_layers) == (8, 4, None)


def test_eplb_triple_in_rank_order_is_accepted():
  # EPLB lists replicas by rank, not by slot: expert 0's rank 1 may sit in a later slot.
  p = ms.Placement(
    [0, 0, 3, 0, 1, 2], [[0, 3, 1], [4, -1, -1], [5, -1, -1], [2, -1, -1]], [3, 1, 1, 1]
  )
  assert p.phy2log.dtype == np.int32


def test_global_packing_matches_eplb_by_hand():
  # E = 4, loads [40, 10, 8, 2], S = 6 on N = 2 (EPLB's global policy).
  # replicate: slot 4 -> expert 0 (40/1 largest), slot 5 -> expert 0 (40/2 = 20 > 10);
  #   phy2log [0 1 2 3 0 0], rank [0 0 0 0 1 2], per-replica load [40/3 10 8 2 40/3 40/3].
  # balanced_packing into 2 packs of 3, heaviest first (stable): 0 -> p0, 4 -> p1,
  #   5 -> p0 (tie, lowest), 1 -> p1 (23.3 < 26.7), 2 -> p1, 3 -> p0 (only room).
  #   p0 = [phy 0, 5, 3], p1 = [phy 4, 1, 2] -> phy2log [0 0 3 | 0 1 2], ranks [0 2 0 | 1 0 0].
  p = ms.plan_placement(np.array([40.0, 10, 8, 2]), num_slots=6, num_devices=2)
  np.testing.assert_array_equal(p.phy2log, [0, 0, 3, 0, 1, 2])
  np.testing.assert_array_equal(p.logcnt, [3, 1, 1, 1])
  np.testing.assert_array_equal(p.log2phy, [[0, 3, 1], [4, -1, -1], [5, -1, -1], [2, -1, -1]])


def test_hierarchical_packing_matches_eplb_by_hand():
  # Groups {0, 1}, {2, 3} (loads 50, 10) onto 2 nodes: one group a node, in order. Node 0
  # replicates expert 0 (slots [0 1 0]), node 1 expert 2 ([2 3 2]); one device a node packs
  # heaviest first: [20 10 20] -> order phy 0, 2, 1 -> [0 0 1]; node 1 [4 2 4] -> [2 2 3].
  p = ms.plan_placement(
    np.array([40.0, 10, 8, 2]), num_slots=6, num_devices=2, num_groups=2, num_nodes=2
  )
  np.testing.assert_array_equal(p.phy2log, [0, 0, 1, 2, 2, 3])
  np.testing.assert_array_equal(p.log2phy, [[0, 1], [2, -1], [3, 4], [5, -1]])
  # Groups that do not divide over the nodes: EPLB's global policy.
  g = ms.plan_placement(np.array([40.0, 10, 8, 2]), 6, 2, num_groups=1, num_nodes=2)
  np.testing.assert_array_equal(g.phy2log, [0, 0, 3, 0, 1, 2])


def test_keep_home_by_hand():
  # E = N = 4, one redundant slot each, loads [10 1 1 1]. Busiest device 0 (10): expert 0
  # to the lightest device with room, 1 (shares 5: loads 5 6 1 1); busiest 1: expert 0 again
  # -> device 2 (3.33: 3.3 4.3 4.3 1); busiest 1: expert 0 -> 3 (2.5: 2.5 3.5 3.5 3.5);
  # busiest 1: expert 0 cannot move (device 0, the only room, holds it) -> expert 1 -> 0.
  p = ms.plan_placement(np.array([10.0, 1, 1, 1]), num_slots=8, num_devices=4, keep_home=True)
  np.testing.assert_array_equal(p.phy2log, [0, 1, 1, 0, 2, 0, 3, 0])
  # Layers plan one by one: [L, E] -> [L, S].
  two = ms.plan_placement(np.array([[10.0, 1, 1, 1], [1, 1, 1, 10]]), 8, 4, keep_home=True)
  assert two.phy2log.shape == (2, 8) and two.num_layers == 2
  np.testing.assert_array_equal(two[0].phy2log, p.phy2log)
  assert two[1].phy2log[6] == 3 and list(two[1].phy2log[[0, 2, 4]]) == [0, 1, 2]


@pytest.mark.parametrize("seed", range(4))
def test_plan_on_device_follows_keep_home(seed):
  # The same rule written twice (NumPy on the host, jnp in the step); integer loads.
  load = np.random.default_rng(seed).zipf(1.5, size=16).astype(np.int64) * 7 + seed
  want = planning.keep_home_packing(load, 4, 2)
  got = jax.jit(lambda a: replica_rule.plan_on_device(a, 4, 2))(jnp.asarray(load, jnp.int32))
  np.testing.assert_array_equal(got.phy2log, want)
  p = ms.Placement.from_phy2log(want, 16)
  np.testing.assert_array_equal(got.logcnt, p.logcnt)
  np.testing.assert_array_equal(got.log2phy[:, : p.log2phy.shape[1]], p.log2phy)


def test_choose_replicas_own_device_first_else_in_turn():
  # S = 6 slots on 3 devices (2 each): expert 0 in slots 0, 2, 4 (one per device), expert 1
  # in slot 1, expert 2 in slots 3 and 5 (devices 1 and 2).
  p = ms.Placement.from_phy2log(np.array([0, 1, 0, 2, 0, 2]), 3)
  e = jnp.array([[0], [0], [2], [2], [2], [1], [-1], [3]])
  # Device 0: expert 0 local (slot 0); expert 2 not local: its items 0, 1, 2 go to
  # replicas (r + 0) mod 2 -> slots 3, 5, 3; expert 1 slot 1; invalid ids -1.
  got = replica_rule.choose_replicas(e, p.log2phy, p.logcnt, 2, chip=0)
  np.testing.assert_array_equal(got[:, 0], [0, 0, 3, 5, 3, 1, -1, -1])
  # Device 1 holds expert 0 (slot 2) and expert 2 (slot 3).
  got = replica_rule.choose_replicas(e, p.log2phy, p.logcnt, 2, chip=1)
  np.testing.assert_array_equal(got[:, 0], [2, 2, 3, 3, 3, 1, -1, -1])
  # No device: every expert's items in turn from replica 0.
  got = replica_rule.choose_replicas(e, p.log2phy, p.logcnt, 2)
  np.testing.assert_array_equal(got[:, 0], [0, 2, 3, 5, 3, 1, -1, -1])


def test_choose_replicas_spreads_evenly():
  # 3 replicas of expert 0 on devices 1, 2, 3; 100 items from device 0: 34/33/33, and
  # device 0's start (0) differs from device 4's (4 mod 3 = 1).
  p = ms.Placement.from_phy2log(np.array([1, 0, 0, 0, 2]), 3)
  e = jnp.zeros((50, 2), jnp.int32)
  slots = replica_rule.choose_replicas(e, p.log2phy, p.logcnt, 1, chip=0)
  np.testing.assert_array_equal(
    np.bincount(np.asarray(slots).ravel(), minlength=5), [0, 34, 33, 33, 0]
  )
  slots = replica_rule.choose_replicas(e, p.log2phy, p.logcnt, 1, chip=4)
  assert int(slots[0, 0]) == 2


@pytest.mark.parametrize(
  "make, error, match",
  [
    (lambda: ms.Placement.from_phy2log([0, 1, 1, 1], 3), ValueError, r"expert \[2\] has none"),
    (lambda: ms.Placement.from_phy2log([0, 1, 4, 2], 3), ValueError, r"phy2log\[2\] = 4"),
    (lambda: ms.Placement.from_phy2log([0.0, 1.0], 2), TypeError, "integer array"),
    (lambda: ms.Placement([0, 1, 0], [[0, -1], [1, -1]], [2, 1]), ValueError, r"log2phy\[0\]"),
    (lambda: ms.Placement([0, 1, 0], [[0, 2], [1, -1]], [1, 1]), ValueError, r"logcnt\[0\] = 1"),
    (lambda: ms.plan_placement([1.0, -1.0], 4, 2), ValueError, "finite and >= 0"),
    (lambda: ms.plan_placement("hot", 4, 2), TypeError, "load must be an array"),
    (lambda: ms.plan_placement([1.0, 2.0], 1, 1), ValueError, "num_slots must be >= 2"),
    (lambda: ms.plan_placement([1.0, 2.0], 5, 2), ValueError, r"num_slots \(5\) must be divisible"),
    (lambda: ms.plan_placement([1.0, 2, 3], 6, 2, keep_home=True), ValueError, "num_experts"),
  ],
)
def test_bad_placements_raise(make, error, match):
  with pytest.raises(error, match=match):
    make()


def test_check_placement_names_the_rule():
  p = ms.Placement.from_phy2log(np.array([0, 1, 2, 3, 0, 0]), 4)
  with pytest.raises(
    ValueError, match=r"slots \(6\) must be divisible by the expert axis size \(4\)"
  ):
    pl.check_placement("moe_layer", p, 4, 4)
  with pytest.raises(ValueError, match=r"num_experts \(8\)"):
    pl.check_placement("moe_layer", p, 8, 2)
  with pytest.raises(TypeError, match="must be a Placement"):
    pl.check_placement("moe_layer", [0, 1], 4, 2)
  two = ms.plan_placement(np.ones((2, 4)), 6, 2)
  with pytest.raises(ValueError, match="one layer's"):
    pl.check_placement("moe_layer", two, 4, 2)


def test_choose_replicas_balanced_by_hand():
  # Slots [0 1 0 2 0 2] on 3 devices (2 each); loads (device x expert) [[4 1 2] [1 0 0]
  # [1 0 2]]. Expert 0: 6 items over 3 replicas, 2 each; each device keeps its own first
  # (device 0 two in slot 0, devices 1 and 2 one each in slots 2 and 4), device 0's other
  # two fill the room left: slot 2, then slot 4. Expert 2: 4 items, 2 a replica (slots 3,
  # 5); device 2 keeps its 2 in slot 5, device 0 (none of its own) fills slot 3.
  p = ms.Placement.from_phy2log(np.array([0, 1, 0, 2, 0, 2]), 3)
  e = jnp.array([[0], [0], [2], [0], [1], [2], [0]])
  loads = jnp.array([[4, 1, 2], [1, 0, 0], [1, 0, 2]])
  got = replica_rule.choose_replicas(e, p.log2phy, p.logcnt, 2, chip=0, loads_NE=loads)
  np.testing.assert_array_equal(got[:, 0], [0, 0, 3, 2, 1, 3, 4])


def test_int64_arrays_out_of_int32_raise():
  # EPLB returns int64: a value past int32 must not wrap into a valid one (2**32 - 1 would
  # become the padding -1 of log2phy, 2**32 + 1 a count of 1).
  p = ms.Placement.from_phy2log(np.array([0, 1, 0, 2]), 3)
  log2phy = p.log2phy.astype(np.int64)
  log2phy[log2phy < 0] = 2**32 - 1
  with pytest.raises(ValueError, match=r"log2phy must hold int32 values \(got 4294967295"):
    ms.Placement(p.phy2log.astype(np.int64), log2phy, p.logcnt.astype(np.int64))
  logcnt = p.logcnt.astype(np.int64) + 2**32
  with pytest.raises(ValueError, match=r"logcnt must hold int32 values"):
    ms.Placement(p.phy2log, p.log2phy, logcnt)
  same = ms.Placement(p.phy2log.astype(np.int64), p.log2phy.astype(np.int64), p.logcnt)
  np.testing.assert_array_equal(same.log2phy, p.log2phy)


def test_load_window_takes_float_loads_and_refuses_negative_ones():
  w = ms.LoadWindow(num_experts=4)
  w.record(np.array([0.9, 0.05, 0.03, 0.02]))
  w.record(np.array([1, 0, 0, 0]))
  np.testing.assert_allclose(w.load(), [1.9, 0.05, 0.03, 0.02])
  assert w.load().dtype == np.float64
  with pytest.raises(ValueError, match=r"finite and >= 0 \(step 2 of the window holds -1\)"):
    w.record(np.array([1, -1, 0, 0]))
  with pytest.raises(ValueError, match=r"finite and >= 0 \(step 2 of the window holds nan\)"):
    w.record(np.array([1.0, np.nan, 0, 0]))
  with pytest.raises(TypeError, match=r"integers or floats \(got bool\)"):
    w.record(np.array([True, False, False, False]))
  # A device array is checked when the window is read (no copy to the host at record).
  w.record(jnp.array([0, -3, 0, 0]))
  with pytest.raises(ValueError, match=r"step 2 of the window holds -3"):
    w.load()
  ints = ms.LoadWindow(num_experts=2)
  ints.record(jnp.array([3, 4]))
  assert ints.load().dtype == np.int64


@pytest.mark.parametrize("keep_home", [False, True])
def test_all_zero_load_plans_the_layout_of_no_placement(keep_home):
  # An empty window's load: every device keeps its own experts, its redundant slots hold
  # replicas of them, so every item stays where no placement sends it.
  empty = ms.LoadWindow(num_experts=8).load()
  p = ms.plan_placement(empty, num_slots=12, num_devices=4, keep_home=keep_home)
  np.testing.assert_array_equal(p.phy2log, [0, 1, 0, 2, 3, 2, 4, 5, 4, 6, 7, 6])
  # The per-device load under the replica rule equals the load without a placement.
  experts = np.random.default_rng(0).integers(0, 8, (64, 2))
  slots = np.asarray(
    replica_rule.assign_slots(jnp.asarray(experts), p, np.arange(4), np.zeros(4, int))
  )
  per_device = np.bincount(slots.reshape(-1) // 3, minlength=4)  # 3 slots a device
  np.testing.assert_array_equal(per_device, np.bincount(experts.reshape(-1) // 2, minlength=4))
  # A stack: only the idle layer gets the layout; the other is planned.
  both = ms.plan_placement(np.array([[0] * 8, [9, 1, 1, 1, 1, 1, 1, 1]]), 12, 4)
  np.testing.assert_array_equal(both.phy2log[0], p.phy2log)
  assert both.logcnt[1][0] == 5
  # E not divisible by N: no layout without a placement; the packing of an even load.
  even = ms.plan_placement(np.zeros(6), num_slots=8, num_devices=4)
  np.testing.assert_array_equal(even.phy2log, ms.plan_placement(np.ones(6), 8, 4).phy2log)
