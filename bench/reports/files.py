"""A run's files: the Markdown tables, the CSV of every row, the plot, written where --out and --plot say (`write`)."""

from __future__ import annotations

import csv
import io
import json
import os

from bench.reports.report import markdown, quantized_rows, weights

CSV_FIELDS = (
  "level",
  "impl",
  "E",
  "routing",
  "mode",
  "T",
  "D",
  "F",
  "K",
  "dtype",
  "weights_format",
  "mesh",
  "devices",
  "time_median_s",
  "time_min_s",
  "time_max_s",
  "compile_s",
  "gflops",
  "routed_flops",
  "executed_flops",
  "flops_ratio",
  "wire_bytes",
  "bytes_over_bound",
  "bytes_over_routing_bound",
  "temp_bytes",
  "expert_bytes",
  "placement",
  "replicas",
  "balancedness",
  "busiest_rows",
  "mean_rows",
  "rounds",
  "dropped",
  "max_abs_err",
  "rel_err",
  "efficiency",
  "topology",
  "xla_optimal_s",
  "estimate_s",
  "roofline_s",
  "compute_s",
  "hbm_s",
  "ici_s",
  "ici_exposed_s",
  "hbm_bytes_xla",
  "hbm_bytes_accessed",
  "dependent_collectives",
  "latency_s",
  "bound_s",
  "bound_bytes",
  "bound_flops",
  "touched_experts",
  "model",
  "error",
)


def to_csv(rows):
  buf = io.StringIO()
  w = csv.DictWriter(buf, CSV_FIELDS, extrasaction="ignore")
  w.writeheader()
  for r in rows:
    flat = dict(r)
    if "time_s" in r:
      flat.update(
        time_median_s=r["time_s"]["median"],
        time_min_s=r["time_s"]["min"],
        time_max_s=r["time_s"]["max"],
      )
    w.writerow(flat)
  return buf.getvalue()


def plot(rows, path):
  """Bar charts of time (or the TPU estimate) and bytes per device, one panel per (level,
  mode), a group of bars per (E, routing)."""
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  tpu = any("topology" in r for r in rows)
  rows = [r for r in rows if "error" not in r]
  panels = list(dict.fromkeys((r["level"], r["mode"]) for r in rows))
  quant = quantized_rows(rows)

  def series(r):  # one colour per impl, and per weights format when there are several
    return f"{r['impl']} {weights(r)}" if quant else r["impl"]

  impls = list(dict.fromkeys(series(r) for r in rows))
  fig, axes = plt.subplots(3, len(panels), figsize=(min(5 * len(panels), 22), 10), squeeze=False)
  width = 0.8 / len(impls)
  for col, (level, mode) in enumerate(panels):
    here = [r for r in rows if (r["level"], r["mode"]) == (level, mode)]
    cases = list(dict.fromkeys((r["T"], r["E"], r["routing"]) for r in here))
    for i, impl in enumerate(impls):
      by = {(r["T"], r["E"], r["routing"]): r for r in here if series(r) == impl}
      xs = [j + i * width for j, c in enumerate(cases) if c in by]
      secs = [
        by[c].get("estimate_s") if tpu else by[c]["time_s"]["median"] for c in cases if c in by
      ]
      axes[0, col].bar(
        xs, [1e3 * t if t is not None else 0 for t in secs], width, color=f"C{i}", label=impl
      )
      axes[1, col].bar(
        xs,
        [by[c].get("wire_bytes", 0) / 2**20 for c in cases if c in by],
        width,
        color=f"C{i}",
        label=impl,
      )
      axes[2, col].bar(
        xs,
        [by[c].get("efficiency") or 0 for c in cases if c in by],
        width,
        color=f"C{i}",
        label=impl,
      )
    for row, ax in enumerate(axes[:, col]):
      ax.set_yscale("log" if row < 2 else "linear")
      ax.set_xticks([j + 0.4 - width / 2 for j in range(len(cases))])
      ax.set_xticklabels([f"T={t}\nE={e}\n{rt}" for t, e, rt in cases], fontsize=7)
    axes[0, col].set_title(f"{level}, {mode.replace('_', '+')}", fontsize=10)
  axes[0, 0].set_ylabel(
    "estimate (one count), ms (not measured)" if tpu else "median wall time, ms"
  )
  axes[1, 0].set_ylabel("collective MiB sent per device")
  axes[2, 0].set_ylabel("efficiency: dense limit time / time")
  axes[0, 0].legend(fontsize=7)
  r0 = rows[0]
  fig.suptitle(
    f"D={r0['D']} F={r0['F']} K={r0['K']} {r0['dtype']}, mesh "
    f"{r0['mesh']}"
    + (f", compiled for TPU {r0['topology']}" if tpu else f", {r0['devices']} devices"),
    fontsize=10,
  )
  fig.tight_layout()
  fig.savefig(path, dpi=80)
  plt.close(fig)


def write(rows, info, argv, s, a):
  """Writes the requested files; returns their paths."""
  paths = []
  targets = []
  if a.out:
    targets += [(a.out + ".json", "json"), (a.out + ".csv", "csv"), (a.out + ".md", "md")]
  if a.json:
    targets.append((a.json, "json"))
  if a.csv:
    targets.append((a.csv, "csv"))
  for path, kind in targets:
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w") as f:
      if kind == "json":
        json.dump(
          {"machine": info, "argv": argv, "settings": s, "rows": rows}, f, indent=1, default=str
        )
      elif kind == "csv":
        f.write(to_csv(rows))
      else:
        f.write(markdown(rows, info, argv, s))
    paths.append(path)
  if a.plot:
    os.makedirs(os.path.dirname(a.plot) or ".", exist_ok=True)
    plot(rows, a.plot)
    paths.append(a.plot)
  return paths
