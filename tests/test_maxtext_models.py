"""The whole-step comparison's pure parts (`bench/maxtext_models.py`): which block a compiled
folder holds, the measured step only where the config is the published one, the speedups
over MaxText's paths, and the page's table."""

import pytest

from bench import maxtext_models as mm
from bench.peers import maxtext_workloads as mw

DROPPED = mw.WORKLOADS["mixtral_8x7b_dropped"]
EST = dict(estimate_s=2.0, lower_bound_s=1.0, compute_s=1.0, hbm_s=0.5, ici_exposed_s=0.1)
EST.update(flops=1e15, hbm_bytes=1e12)
UNSEEN = dict(splash_s=0.3, to_host_bytes=2e9, from_host_bytes=1e9)


def _meta(changes, block="maxtext"):
  return {"changes": changes, "block": block, "argv": ["x", "mixtral_8x7b_dropped"]}


def test_block_name_by_block_and_capacity():
  assert mm.block_name(DROPPED, _meta({})) == "maxtext_dropped"
  assert mm.block_name(DROPPED, _meta({"capacity_factor": -1})) == "maxtext_dropless"
  assert (
    mm.block_name(DROPPED, _meta({"capacity_factor": -1}, "moe_shard(impl=auto)")) == "moe_shard"
  )


def test_measured_only_for_the_published_block_and_scaled_to_the_batch():
  row = mm.make_row(DROPPED, _meta({"per_device_batch_size": 11}), EST, UNSEEN)
  assert row["block"] == "maxtext_dropped"
  assert row["measured_step_s"] == pytest.approx(13.484 * 11 / 12)
  dropless = {"per_device_batch_size": 11, "capacity_factor": -1, "sparse_matmul": True}
  row = mm.make_row(DROPPED, _meta(dropless), EST, UNSEEN)
  assert row["block"] == "maxtext_dropless" and row["measured_step_s"] is None
  assert row["changes"] == {"per_device_batch_size": 11}
  assert row["block_changes"] == {"capacity_factor": -1, "sparse_matmul": True}
  remat = {"per_device_batch_size": 11, "remat_policy": "full"}
  assert mm.make_row(DROPPED, _meta(remat), EST, UNSEEN)["measured_step_s"] is None


def test_compare_over_each_maxtext_path_of_the_workload():
  rows = [
    dict(workload="w", block="maxtext_dropped", estimate_step_s=4.0),
    dict(workload="w", block="maxtext_dropless", estimate_step_s=6.0),
    dict(workload="w", block="moe_shard", estimate_step_s=3.0),
    dict(workload="w", block="moe_shard", estimate_step_s=1.5),  # never a baseline
    dict(workload="v", block="moe_shard", estimate_step_s=1.0),
  ]
  mm.compare(rows)
  assert rows[2]["speedup_vs_maxtext_dropped"] == pytest.approx(4 / 3)
  assert rows[2]["speedup_vs_maxtext_dropless"] == pytest.approx(2.0)
  assert rows[0]["speedup_vs_maxtext_dropped"] == pytest.approx(1.0)
  assert rows[4]["speedup_vs_maxtext_dropped"] is None


def test_markdown_has_a_row_per_folder():
  rows = mm.compare(
    [
      mm.make_row(DROPPED, _meta({"per_device_batch_size": 11}), EST, UNSEEN),
      mm.make_row(DROPPED, _meta({"capacity_factor": -1}, "moe_shard(impl=auto)"), EST, UNSEEN, 1),
    ]
  )
  text = mm.markdown(rows, "cmd")
  assert text.count("| mixtral_8x7b_dropped | v6e-256 |") == 2
  assert "| moe_shard | 1 | 2.00 |" in text and "capacity_factor=-1" in text


def test_rounds_name_the_overflow_loops_of_both_exchanges():
  from moe_shard.parallel import OVERFLOW_SCOPE, RAGGED_SCOPE

  one, two = mm.ROUNDS[1], mm.ROUNDS[2]
  assert one[OVERFLOW_SCOPE] == 0 and one[RAGGED_SCOPE] == 0
  assert OVERFLOW_SCOPE not in two and RAGGED_SCOPE not in two  # once per entry


def test_a_workload_without_a_published_step_has_no_measured_column():
  w = mw.WORKLOADS["mixtral_8x7b_dropless"]
  assert mw.measured_step_s(w) == (None, "no measured step of mixtral_8x7b_dropless is published")
  row = mm.make_row(w, _meta({}), EST, UNSEEN)
  assert row["block"] == "maxtext_dropless" and row["measured_step_s"] is None
