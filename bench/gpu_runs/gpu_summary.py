"""The one-command GPU run's summary (`bench/gpu_h100.sh`): the ratios against the PyTorch
peers, read from its files.

    python -m bench.gpu_runs.gpu_summary RESULTS_DIR [--tests LOG]

Reads `gpu_TAG_gmm.json` (`python -m bench.gpu`) and `gpu_TAG_layer{,_e64}.json` (`python -m
bench`) in RESULTS_DIR and prints, from the rows of that one run:

  * grouped matmul: each backend's speed over `torch._grouped_mm`'s (time of torch / time
    of the backend, same G, uniform sizes), forward and forward+backward;
  * layer: `auto` (the default path) over `torch_moe`, and `ragged_all_to_all` on the 1x1
    mesh over `auto`, forward and forward+backward, at each E; the error column of each;
  * with --tests, the pytest summary line and the slowest tests of the log.

A row that did not run prints its reason. Nothing here measures or imports JAX.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys


def _load(path):
  try:
    with open(path) as f:
      return json.load(f)["rows"]
  except (OSError, ValueError, KeyError):
    return None


def _ms(row, key):
  """A row's time in ms, or its reason for having none."""
  if row is None:
    return None, "no row"
  if "error" in row:
    return None, row["error"][:90]
  if key == "impl_ms":
    return row.get("impl_ms"), ""
  return row["time_s"]["median"] * 1e3, ""


def gmm_lines(rows):
  """Lines of the grouped-matmul section: per G and pass, every impl's ms and its speed over
  torch's (>1: faster than torch)."""
  if rows is None:
    return ["grouped matmul: no results file"]
  out = ["grouped matmul (uniform sizes): ms, and speed over torch._grouped_mm (>1 faster)"]
  keys = sorted({(r["G"], r["mode"]) for r in rows if r.get("skew", "uniform") == "uniform"})
  for G, mode in keys:
    here = {r["impl"]: r for r in rows if (r["G"], r["mode"], r["skew"]) == (G, mode, "uniform")}
    torch_ms, _ = _ms(here.get("torch"), "impl_ms")
    cells = []
    for impl, r in here.items():
      t, _ = _ms(r, "impl_ms")
      if t is None:
        cells.append(f"{impl} -")
        continue
      ratio = f" ({torch_ms / t:.2f}x)" if torch_ms and impl != "torch" else ""
      cells.append(f"{impl} {t:.2f}{ratio}")
    out.append(f"  G={G:<4} {mode:<8} " + ", ".join(cells))
  reasons = {r["impl"]: r["error"] for r in rows if "error" in r}
  out += [f"  {impl}: {why[:110]}" for impl, why in reasons.items()]
  return out


def layer_lines(rows):
  """Lines of the layer section: per E and mode, auto / torch_moe and ragged_all_to_all /
  auto as speed ratios (>1: the first is faster), each row's ms and rel err."""
  if not rows:
    return ["layer: no results file"]
  out = ["layer (bf16): ms [rel err]; auto speed over torch_moe; ragged_all_to_all over auto"]
  for E, mode in sorted({(r["E"], r["mode"]) for r in rows}):
    here = {r["impl"]: r for r in rows if (r["E"], r["mode"]) == (E, mode)}
    cells = []
    for impl, r in here.items():
      t, _ = _ms(r, "time_s")
      err = f" [{r['rel_err']:.1e}]" if r.get("rel_err") is not None else ""
      cells.append(f"{impl} {t:.1f}{err}" if t is not None else f"{impl} -")
    auto, _ = _ms(here.get("auto"), "time_s")
    torch_ms, _ = _ms(here.get("torch_moe"), "time_s")
    ragged, _ = _ms(here.get("ragged_all_to_all"), "time_s")
    ratios = []
    if auto and torch_ms:
      ratios.append(f"auto/torch_moe speed {torch_ms / auto:.2f}")
    if auto and ragged:
      ratios.append(f"ragged_all_to_all time / auto {ragged / auto:.2f}")
    out.append(f"  E={E:<3} {mode:<8} " + ", ".join(cells))
    if ratios:
      out.append("           " + "; ".join(ratios))
  reasons = {r["impl"]: r["error"] for r in rows if "error" in r}
  out += [f"  {impl}: {why[:110]}" for impl, why in reasons.items()]
  return out


def test_lines(log):
  """The pytest summary line and the `--durations` lines of a log."""
  try:
    with open(log) as f:
      text = f.read()
  except OSError:
    return [f"tests: no log at {log}"]
  summary = [
    line.strip("= ") for line in text.splitlines() if re.search(r"\d+ (passed|failed)", line)
  ]
  slow = [line for line in text.splitlines() if re.match(r"\s*\d+\.\d+s (call|setup)", line)]
  return ["tests: " + (summary[-1] if summary else "no pytest summary in the log")] + [
    "  " + line.strip() for line in slow[:8]
  ]


def summary(results, tests=None, tag="h100"):
  """The summary as text, from the files of the card named by `tag` (gpu_TAG_*.json)."""
  gmm = _load(os.path.join(results, f"gpu_{tag}_gmm.json"))
  layer = []  # the script's two layer files only (others, e.g. gpu_TAG_layer_levers, not)
  for stem in ("layer", "layer_e64"):
    layer += _load(os.path.join(results, f"gpu_{tag}_{stem}.json")) or []
  lines = (test_lines(tests) + [""] if tests else []) + gmm_lines(gmm) + [""] + layer_lines(layer)
  return "\n".join(lines)


def main(argv=None):
  p = argparse.ArgumentParser(
    prog="python -m bench.gpu_runs.gpu_summary", description=__doc__.split("\n")[0]
  )
  p.add_argument("results", help="the folder holding gpu_TAG_*.json")
  p.add_argument("--tag", default="h100", help="the card the files are named after (h100, h200)")
  p.add_argument("--tests", help="the pytest log to summarise")
  a = p.parse_args(sys.argv[1:] if argv is None else argv)
  print(summary(a.results, a.tests, a.tag))
  return 0


if __name__ == "__main__":
  sys.exit(main())
