"""`python -m bench.maxtext_models`: MaxText's published training steps compiled with each MoE
block (MaxText's dropped and dropless paths, moe_shard's), read with the one estimate.

    PYTHONPATH=.tpu-libs python -m bench.maxtext_models --calib /work/calib \\
      --folders mixtral_8x7b_dropped,mixtral_8x7b_dropped_moe_shard \\
      --out bench/results/tpu_maxtext_models

reads folders that `bench/peers/maxtext_train.py` wrote (`--block moe_shard` for moe_shard's
block) and writes one row per folder to OUT.json and OUT.md: the workload, its slice, the
block (`block_name`), the config changes every block of the workload shares and those of
the block, the estimate (`bench.reading.estimate.step_estimate`, as `bench.calibration`
reads the same folders) with its parts, and the measured step where one was published for
that block's config. Rows of one workload are compared with its `maxtext_dropped` row.
Nothing ran on a TPU: every step time is an estimate.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys

from bench import calibration
from bench.peers import maxtext_workloads as mw
from bench.reading.hlo import branch_key
from moe_shard.parallel import OVERFLOW_SCOPE, RAGGED_LAST_SCOPE, RAGGED_SCOPE

BLOCKS = ("maxtext_dropped", "maxtext_dropless", "moe_shard")
# moe_shard's exchange rounds per layer call -> the trips of its overflow loops (totals over
# the step, or None: once per entry) and the ragged dispatch's last-round branch. One
# round: every item fits the first round's buffer (balanced routing); two: one overflow
# round in every call of the layer (forward, its recompute and backward alike).
ROUNDS = {
  1: {OVERFLOW_SCOPE: 0, RAGGED_SCOPE: 0, branch_key(RAGGED_LAST_SCOPE): 0},
  2: {branch_key(RAGGED_LAST_SCOPE): 0},
}
# Config fields that choose MaxText's MoE path or moe_shard's layout: a block's own changes.
BLOCK_FIELDS = (
  "capacity_factor",
  "sparse_matmul",
  "megablox",
  "ici_expert_parallelism",
  "allow_split_physical_axes",
)


def block_name(workload, meta):
  """The row's block: "moe_shard" for `--block moe_shard`, else MaxText's path by its
  effective capacity_factor ("maxtext_dropped" above 0, "maxtext_dropless" otherwise)."""
  if str(meta.get("block", "maxtext")).startswith("moe_shard"):
    return "moe_shard"
  config = {**workload.params, **(meta.get("changes") or {})}
  return "maxtext_dropped" if float(config.get("capacity_factor", -1)) > 0 else "maxtext_dropless"


def make_row(workload, meta, estimate, unseen, rounds=None):
  """One row: workload, topology, block, estimate_step_s and its parts, the changes;
  `rounds`: moe_shard's exchange rounds per call the estimate assumes (`ROUNDS`)."""
  changes = meta.get("changes") or {}
  block = block_name(workload, meta)
  same_block = block == block_name(workload, {})  # the block the published config runs
  shared = {k: v for k, v in changes.items() if k not in BLOCK_FIELDS}
  row = {
    "workload": workload.name,
    "topology": workload.compile_topology,
    "block": block,
    "impl": meta.get("block") if block == "moe_shard" else None,
    "rounds": rounds,
    "estimate_step_s": estimate["estimate_s"],
    "lower_bound_s": estimate["lower_bound_s"],
    "compute_s": estimate["compute_s"],
    "hbm_s": estimate["hbm_s"],
    "ici_exposed_s": estimate["ici_exposed_s"],
    "flops": estimate["flops"],
    "hbm_bytes": estimate["hbm_bytes"],
    "splash_s": unseen.get("splash_s"),
    "host_gb": max(unseen["to_host_bytes"], unseen["from_host_bytes"]) / 1e9,
    "changes": shared,
    "block_changes": {
      **{k: v for k, v in changes.items() if k in BLOCK_FIELDS},
      **({"moe_shard_chunk_size": meta["chunk_size"]} if meta.get("chunk_size") else {}),
    },
    "dropped_flags": meta.get("dropped_flags", []),
    "measured_step_s": None,
    "measured_source": None,
    "compile_s": meta.get("compile_s"),
    "versions": meta.get("versions"),
    "command": " ".join(
      ["ALLOW_MULTIPLE_LIBTPU_LOAD=1 /work/venvs/mt/bin/python -m bench.peers.maxtext_train"]
      + list(meta.get("argv", [])[1:])
    ),
  }
  if same_block and set(shared) <= {"per_device_batch_size"} and workload.measured:
    measured, how = mw.measured_step_s(workload)
    scale, _ = calibration.scale_back(workload, shared)
    row["measured_step_s"] = measured / scale  # at the compiled batch
    row["measured_source"] = how + (
      f"; times {1 / scale:.4f} for the compiled batch" if scale != 1 else ""
    )
  return row


def compare(rows):
  """Each row's estimate over its workload's maxtext_dropped and maxtext_dropless rows."""
  base = {
    (r["workload"], r["block"]): r["estimate_step_s"] for r in rows if r["block"] != "moe_shard"
  }
  for r in rows:
    for other in ("maxtext_dropped", "maxtext_dropless"):
      b = base.get((r["workload"], other))
      r[f"speedup_vs_{other}"] = None if b is None else b / r["estimate_step_s"]
  return rows


def _fmt(x, spec=".2f"):
  return "-" if x is None else format(x, spec)


def markdown(rows, command):
  lines = [
    "# MaxText training steps with each MoE block: the one estimate",
    "",
    f"`{command}`",
    "",
    "Each workload's whole training step compiled here for its slice (nothing ran) by "
    "`bench/peers/maxtext_train.py`, with MaxText's own MoE block or moe_shard's "
    "(`--block moe_shard`), read by `bench.reading.estimate.step_estimate`; seconds per step. "
    "x dropped / x dropless: that block's estimate over this row's (above 1: this row is faster). "
    "rounds: the exchange rounds per layer call moe_shard's row assumes, its overflow loops' "
    "trips (1: every item fits the first round, as under balanced routing; 2: one overflow "
    "round in every call); MaxText's paths have no data-dependent loop.",
    "",
    "| workload | slice | block | rounds | estimate s | lower bound s | compute s | HBM s | ICI exposed s "
    "| x dropped | x dropless | measured s | block's changes |",
    "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
  ]
  for r in rows:
    changes = ", ".join(f"{k}={v}" for k, v in r["block_changes"].items()) or "-"
    lines.append(
      f"| {r['workload']} | {r['topology']} | {r['block']} | {r['rounds'] or '-'} "
      f"| {r['estimate_step_s']:.2f} "
      f"| {r['lower_bound_s']:.2f} | {r['compute_s']:.2f} | {r['hbm_s']:.2f} "
      f"| {r['ici_exposed_s']:.2f} | {_fmt(r['speedup_vs_maxtext_dropped'])} "
      f"| {_fmt(r['speedup_vs_maxtext_dropless'])} | {_fmt(r['measured_step_s'], '.3f')} "
      f"| {changes} |"
    )
  lines += ["", "Each compiled step:", ""]
  for r in {r["command"]: r for r in rows}.values():
    shared = ", ".join(f"{k}={v}" for k, v in r["changes"].items()) or "none"
    size = r["block_changes"].get("moe_shard_chunk_size")
    chunk = f" (chunk_size {size})" if size else ""
    measured = (
      f" Measured: {r['measured_step_s']:.3f} s ({r['measured_source']})."
      if r["measured_step_s"] is not None
      else ""
    )
    lines.append(
      f"- **{r['workload']} / {r['block']}**{chunk}: changes from the published config shared by "
      f"every block of the workload: {shared}; published XLA flags this libtpu refused, left "
      f"out: {', '.join(r['dropped_flags']) or 'none'}.{measured} Compiled in "
      f"{_fmt(r['compile_s'], '.0f')} s by `{r['command']}`."
    )
  return "\n".join(lines) + "\n"


def main(argv=None):
  p = argparse.ArgumentParser(
    prog="python -m bench.maxtext_models", description=__doc__.split("\n")[0]
  )
  p.add_argument("--calib", default=str(calibration.CALIB), help="folders of maxtext_train")
  p.add_argument("--folders", required=True, help="comma-separated folder names")
  p.add_argument("--out", default="bench/results/tpu_maxtext_models", help="OUT.json and OUT.md")
  a = p.parse_args(argv)
  rows = []
  for name in a.folders.split(","):
    folder = pathlib.Path(a.calib) / name
    workload, meta, estimate, unseen = calibration._read_folder(folder)
    if block_name(workload, meta) != "moe_shard":
      rows.append(make_row(workload, meta, estimate, unseen))
    else:
      for rounds, trips in ROUNDS.items():
        workload, meta, estimate, unseen = calibration._read_folder(folder, trips)
        rows.append(make_row(workload, meta, estimate, unseen, rounds))
    print(f"{name}: {rows[-1]['block']} estimate {rows[-1]['estimate_step_s']:.2f} s")
  compare(rows)
  args = argv if argv is not None else sys.argv[1:]
  command = "PYTHONPATH=.tpu-libs python -m bench.maxtext_models " + " ".join(args)
  out = pathlib.Path(a.out)
  data = {
    "kind": "maxtext_models",
    "argv": ["python", "-m", "bench.maxtext_models", *args],
    "rows": rows,
    "machine": calibration._machine(),
  }
  out.with_suffix(".json").write_text(json.dumps(data, indent=1, default=str) + "\n")
  out.with_suffix(".md").write_text(markdown(rows, command))
  return 0


if __name__ == "__main__":
  sys.exit(main())
