"""`python -m bench.calibration`: the one estimate (`bench.reading.estimate.step_estimate`)
of MaxText training steps whose time was measured on a TPU and published, beside the
measured time.

    PYTHONPATH=.tpu-libs python -m bench.calibration --calib /work/calib \\
      --out bench/results/tpu_calibration

reads each folder of --calib that `bench/peers/maxtext_train.py` wrote (the compiled step's
HLO text, XLA's cost analysis, its meta.json) and writes one row per folder to OUT.json and
OUT.md: the workload and its slice, the measured step (`maxtext_workloads.measured_step_s`:
as published, or derived from a published TFLOP/s), the estimate (the one count) and its
parts, estimate / measured, and what the estimate does not see, sized where the HLO tells:

  * host offload transfers: the bytes the step moves between HBM and host memory (values in
    memory space S(5), loop bodies times their trips; `host_transfers`), and their time at
    `HOST_LINK` where one is cited (the estimate counts neither);
  * collective latency: the collectives on the longest dependent chain
    (`measure.dependent_collectives`) times the slice's fixed cost of one collective
    (`tpu.collective_latency_s`, from the chips' coordinates: libtpu on the path);
  * Pallas kernels: their FLOPs and bytes as declared (or, for grouped matmuls, as their
    grid visits them at the routing's expected rows, `--groups`; for splash attention, which
    declares no FLOPs, the blocks its mask leaves), not their run time.

Where a published config does not compile here, its folder holds the compile of the
smallest change that does (meta.json's `changes`); a change of per_device_batch_size scales
the estimate back by MaxText's FLOPs per device of the two configs (`scale_back`).
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import platform
import re
import sys

from bench.peers import maxtext_workloads as mw

CALIB = pathlib.Path("/work/calib")

# Host link per chip, bytes/s each way, where one is cited; None: bytes reported, no time.
# https://cloud.google.com/tpu/docs/v6e: "Each v6e chip ... connects to the host through a
# PCIe Gen5 interface"; the lane count is not given: x16's 63 GB/s is assumed.
HOST_LINK = {"v6e": 63e9}
_HOST_RE = re.compile(r"S\(5\)")  # memory space 5 (host) in a layout
# Async starts that count when they start: a copy (its source), an update of a host buffer
# (its update operand).
_COUNTED_STARTS = ("copy-start", "dynamic-update-slice-start")

# Row column -> `step_estimate`'s key.
COLUMNS = {
  "estimate_step_s": "estimate_s",
  "lower_bound_s": "lower_bound_s",
  "compute_s": "compute_s",
  "hbm_s": "hbm_s",
  "ici_s": "ici_s",
  "ici_exposed_s": "ici_exposed_s",
}


def host_transfers(compiled_or_text, trip_counts=None):
  """Bytes one run of a program moves between device and host memory (memory space S(5)).

  An op whose result is in host memory and some operand is not moves that operand's bytes
  to the host (a `copy-start` its source; an update of a host buffer its update operand);
  one that reads a host value into device memory moves its result's bytes back. Each op
  counts times the runs of its computation (`HloModule.executions`, loops by their trips).

  Returns:
    dict: to_host_bytes, from_host_bytes, ops (how many instructions move host data).
  """
  from bench.reading import hlo_ops, measure

  mod = measure._module(compiled_or_text)
  runs = mod.executions(trip_counts, default_trip_count=1)
  to_host = from_host = 0.0
  ops = 0
  for comp, instrs in mod.comps.items():
    n = runs.get(comp, 0.0)
    types = {ins.name: ins.type for ins in instrs}
    for ins in instrs:
      if ins.opcode in ("copy-done", "get-tuple-element", "bitcast", "tuple", "parameter"):
        continue
      if ins.opcode.endswith("-start") and ins.opcode not in _COUNTED_STARTS:
        continue  # a read from the host counts at its -done, by what it brings
      result = ins.type
      if ins.opcode == "copy-start":  # (destination, source, context)
        parts = hlo_ops._split_top_level(result[1:-1])
        result = parts[0] if parts else result
      src = [types.get(o, "") for o in ins.operands]
      on_host = [bool(_HOST_RE.search(t)) for t in src]
      if _HOST_RE.search(result) and not all(on_host):
        to_host += n * sum(hlo_ops.shape_bytes(t) for t, h in zip(src, on_host) if not h)
        ops += 1
      elif not _HOST_RE.search(result) and any(on_host):
        from_host += n * hlo_ops.shape_bytes(result)
        ops += 1
  return {"to_host_bytes": to_host, "from_host_bytes": from_host, "ops": ops}


def kernel_flops(compiled_or_text, trip_counts=None):
  """FLOPs the Pallas kernels of a program declare, loops scaled (their share of the
  estimate's FLOPs is counted as they declare it, not as they run)."""
  from bench.reading import hlo_ops, measure

  mod = measure._module(compiled_or_text)
  runs = mod.executions(trip_counts, default_trip_count=1)
  total, calls = 0.0, 0
  for comp, instrs in mod.comps.items():
    for ins in instrs:
      if ins.opcode == "custom-call" and 'custom_call_target="tpu_custom_call"' in ins.attrs:
        total += runs.get(comp, 0.0) * hlo_ops.custom_call_flops(ins.attrs)
        calls += 1
  return {"kernel_flops": total, "kernel_calls": calls}


def splash_flops(compiled_or_text, trip_counts=None):
  """FLOPs of the splash-attention kernels (loops scaled), which declare none: the part of
  the estimate's FLOPs that `hlo_ops.splash_flops` counts from their shapes and the blocks
  their grid visits.

  Returns:
    dict: splash_flops (loops scaled), splash_calls.
  """
  from bench.reading import hlo_ops, measure

  mod = measure._module(compiled_or_text)
  runs = mod.executions(trip_counts, default_trip_count=1)
  total, calls = 0.0, 0
  for comp, instrs in mod.comps.items():
    types = {ins.name: ins.type for ins in instrs}
    for ins in instrs:
      if hlo_ops.splash_role(ins):
        total += runs.get(comp, 0.0) * hlo_ops.splash_flops(ins, types)
        calls += 1
  return {"splash_flops": total, "splash_calls": calls}


def scale_back(workload, changes):
  """The factor from the compiled program's estimate to the published one's, and how.

  A changed per_device_batch_size scales the step by the published over the compiled
  per_device_batch_size: MaxText's FLOPs per device (every term of its count, attention
  included) are proportional to it at a fixed max_target_length. Other changes keep the
  work's FLOPs and are not scaled.

  Returns:
    (float, str): the factor and a sentence.
  """
  if not changes:
    return 1.0, "the published config"
  named = ", ".join(f"{k}={v}" for k, v in changes.items())
  if "per_device_batch_size" in changes:
    published = workload.params["per_device_batch_size"]
    compiled = changes["per_device_batch_size"]
    return published / compiled, (
      f"compiled with {named}; the estimate scaled by the published per_device_batch_size "
      f"over the compiled one ({published} / {compiled}: MaxText's FLOPs per device are "
      "proportional to it)"
    )
  return 1.0, f"compiled with {named}; not scaled"


def make_row(workload, meta, estimate, extra):
  """One results row: the workload, the measured and estimated step, the parts, the unseen.

  Args:
    workload: a `maxtext_workloads.Workload`.
    meta: the folder's meta.json (changes, dropped_flags, versions, compile_s, ...).
    estimate: `step_estimate`'s dict for the compiled program.
    extra: {name: value} of the unseen terms (host transfers, latency, kernels).

  Returns:
    dict: workload, topology, mesh, measured_step_s, measured_source, estimate_step_s,
    ratio (estimate / measured), the parts of `COLUMNS` (scaled as the estimate), flops,
    hbm_bytes, hbm_bytes_xla, change, scale, dropped_flags, unseen, compile.
  """
  measured, how = mw.measured_step_s(workload)
  scale, change = scale_back(workload, meta.get("changes") or {})
  row = {
    "workload": workload.name,
    "topology": workload.compile_topology,
    "mesh": workload.topology,
    "measured_step_s": measured,
    "measured_source": how,
    "measured_with": workload.measured_with,
    "config_source": workload.config_source,
  }
  for c, key in COLUMNS.items():
    row[c] = estimate[key] * scale
  row["ratio"] = row["estimate_step_s"] / measured
  # The unseen term the HLO sizes, added: the dependent collectives' latency.
  unseen_s = extra.get("latency_s") or 0.0
  row["with_unseen_s"] = row["estimate_step_s"] + unseen_s * scale
  row["ratio_with_unseen"] = row["with_unseen_s"] / measured
  for c in ("flops", "hbm_bytes", "hbm_bytes_xla"):
    row[c] = estimate.get(c)
  row["change"] = change
  row["scale"] = scale
  row["dropped_flags"] = meta.get("dropped_flags", [])
  row["unseen"] = extra
  row["compile"] = {k: meta.get(k) for k in ("versions", "compile_s", "maxtext_tflops_per_device")}
  row["compile"]["command"] = " ".join(
    ["ALLOW_MULTIPLE_LIBTPU_LOAD=1 /work/venvs/mt/bin/python -m bench.peers.maxtext_train"]
    + list(meta.get("argv", [])[1:])
  )
  return row


def _read_folder(folder, trip_counts=None):
  """(workload, meta, estimate, unseen) of one folder of `maxtext_train`; `trip_counts` as
  `step_estimate`'s (default None: a loop of unknown trips runs once per entry)."""
  from bench.reading import estimate as est
  from bench.reading import measure, tpu

  meta = json.loads((folder / "meta.json").read_text())
  workload = mw.WORKLOADS[meta["workload"]]
  text = (folder / "step.hlo.txt").read_text()
  cost = json.loads((folder / "cost.json").read_text())
  mod = measure._module(text)
  estimate = est.step_estimate(mod, workload.topology, trip_counts, cost=cost)
  unseen = dict(host_transfers(mod, trip_counts))
  link = HOST_LINK.get(tpu.generation(workload.topology))
  # Each direction at the link's rate, the two at once.
  busiest = max(unseen["to_host_bytes"], unseen["from_host_bytes"])
  unseen["host_s"] = None if link is None else busiest / link
  chain = measure.dependent_collectives(mod, default_trip_count=1)
  try:
    latency = tpu.collective_latency_s(workload.topology)
  except ValueError:  # no libtpu on the path: the count without its time
    latency = None
  unseen["dependent_collectives"] = chain
  unseen["latency_s"] = None if latency is None else chain * latency
  unseen.update(kernel_flops(mod))
  unseen["kernel_flops_share"] = unseen["kernel_flops"] / max(estimate["flops"], 1.0)
  unseen.update(splash_flops(mod))
  unseen["splash_s"] = (
    unseen["splash_flops"] / tpu.PEAKS[tpu.generation(workload.topology)]["flops"]
  )
  return workload, meta, estimate, unseen


def _fmt(x, spec=".2f"):
  return "-" if x is None else format(x, spec)


def tables(rows):
  """Markdown: estimate / measured with the estimate's parts, and the unseen terms."""
  lines = [
    "| workload | slice | measured s | estimate s | estimate / measured | lower bound s "
    "| compute s | HBM s | ICI s | ICI exposed s | with unseen s | with unseen / measured |",
    "|---|---|---|---|---|---|---|---|---|---|---|---|",
  ]
  for r in rows:
    lines.append(
      f"| {r['workload']} | {r['topology']} | {r['measured_step_s']:.2f} "
      f"| {r['estimate_step_s']:.2f} | {r['ratio']:.2f} | {r['lower_bound_s']:.2f} "
      f"| {r['compute_s']:.2f} | {r['hbm_s']:.2f} | {r['ici_s']:.2f} "
      f"| {r['ici_exposed_s']:.2f} | {r['with_unseen_s']:.2f} | {r['ratio_with_unseen']:.2f} |"
    )
  lines += [
    "",
    "What the estimate does not see, per step and device, and the splash-attention kernels "
    "it counts from their shapes:",
    "",
    "| workload | to host GB | from host GB | host link s | dependent collectives "
    "| their latency s | declared Pallas FLOPs share | splash attention s at peak (counted) |",
    "|---|---|---|---|---|---|---|---|",
  ]
  for r in rows:
    u = r["unseen"]
    splash = None if u.get("splash_s") is None else u["splash_s"] * r["scale"]
    lines.append(
      f"| {r['workload']} | {u['to_host_bytes'] / 1e9:.1f} | {u['from_host_bytes'] / 1e9:.1f} "
      f"| {_fmt(u['host_s'])} | {u['dependent_collectives']:.0f} | {_fmt(u['latency_s'], '.3f')} "
      f"| {u['kernel_flops_share']:.2f} | {_fmt(splash)} |"
    )
  lines += [
    "",
    "with unseen: the estimate plus the latency of the dependent collectives; the host "
    "transfers are listed, not added (they run beside the compute). Splash attention declares "
    "no FLOPs: the estimate counts the blocks its causal mask leaves (`hlo_ops.splash_flops`); "
    "the last column is that count at peak, scaled as the estimate.",
  ]
  return "\n".join(lines)


def notes(rows):
  """Markdown: for each row, where its measured figure and config come from, and what was
  changed to compile it here."""
  lines = []
  for r in rows:
    dropped = ", ".join(r["dropped_flags"]) or "none"
    lines.append(
      f"- **{r['workload']}** ({r['topology']}): measured {r['measured_step_s']:.3f} s, "
      f"{r['measured_source']}; measured with {r['measured_with']}; config: "
      f"{r['config_source']}. Compiled here: {r['change']} (scale {r['scale']:.4f}); "
      f"published XLA flags this libtpu refused, left out: {dropped}. Compiled by "
      f"`{r['compile']['command']}`."
    )
  return "\n".join(lines)


def markdown(rows, command):
  """The results file's Markdown: the command, `tables` and `notes`."""
  return "\n".join(
    [
      "# MaxText training steps measured on TPUs: the one estimate against the measured step",
      "",
      f"`{command}`",
      "",
      "Each workload's training step compiled here for its slice (nothing ran) by "
      "`bench/peers/maxtext_train.py` and read by `bench.reading.estimate.step_estimate`; "
      "times in seconds per step, per device.",
      "",
      tables(rows),
      "",
      "Each row:",
      "",
      notes(rows),
      "",
    ]
  )


def _machine():
  import jax

  return {
    "python": platform.python_version(),
    "jax": jax.__version__,
    "cpu": platform.processor() or platform.machine(),
    "cores": os.cpu_count(),
  }


def main(argv=None):
  p = argparse.ArgumentParser(
    prog="python -m bench.calibration", description=__doc__.split("\n")[0]
  )
  p.add_argument("--calib", default=str(CALIB), help="folders of maxtext_train (%(default)s)")
  p.add_argument("--folders", default="", help="comma-separated folder names (default: all)")
  p.add_argument("--out", default="bench/results/tpu_calibration", help="OUT.json and OUT.md")
  a = p.parse_args(argv)
  root = pathlib.Path(a.calib)
  names = [n for n in a.folders.split(",") if n] or sorted(
    d.name for d in root.iterdir() if (d / "step.hlo.txt").exists()
  )
  rows = []
  for name in names:
    workload, meta, estimate, unseen = _read_folder(root / name)
    rows.append(make_row(workload, meta, estimate, unseen))
    print(f"{name}: estimate {rows[-1]['estimate_step_s']:.2f} s, ratio {rows[-1]['ratio']:.2f}")
  # libtpu on the path (`.tpu-libs`) gives the chips' coordinates for the latency column.
  args = " ".join(argv if argv is not None else sys.argv[1:])
  command = "PYTHONPATH=.tpu-libs python -m bench.calibration " + args
  out = pathlib.Path(a.out)
  data = {
    "kind": "calibration",
    "argv": ["python", "-m", "bench.calibration", *(argv or sys.argv[1:])],
    "rows": rows,
  }
  data["machine"] = _machine()
  out.with_suffix(".json").write_text(json.dumps(data, indent=1) + "\n")
  out.with_suffix(".md").write_text(markdown(rows, command.strip()))
  return 0


if __name__ == "__main__":
  sys.exit(main())
