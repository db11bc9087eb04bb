"""`python -m bench.docs_page`: writes docs/benchmarks.md from the results in bench/results/.

Every `*.json` there becomes a section: the command that made it, the machine it recorded,
and its rows as tables (the layer benchmark's through `bench.reports.report`, the grouped-matmul
benchmarks' here), with links to the `.md`, `.csv`, `.json` and `.png` files of the same
name. Results kept only as Markdown are linked. `docs/results` is a link to
`bench/results`, so the site serves those files and embeds the plots. A file `STEM_rerunN`
holds STEM's command run again (another day, load or machine): it gets no section of its
own, and STEM's section tabulates the headline figures of every run, for their spread.

`tests/test_docs.py` checks the committed page equals this script's output.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import re

from bench import calibration, maxtext_models
from bench.reports import report
from bench.reports.page_text import INTRO, NOTES, OLD_TPU_COUNT, SECTIONS

ROOT = pathlib.Path(__file__).resolve().parents[2]
RESULTS = ROOT / "bench" / "results"
PAGE = ROOT / "docs" / "benchmarks.md"
LINK = "results"  # docs/results -> ../bench/results
FULL_TABLE_ROWS = 40  # a layer run with more rows shows its headline table only
RERUN = re.compile(r"^(?P<stem>.+)_rerun(?P<n>\d+)$")  # STEM_rerunN: STEM's command run again
# Columns of the layer benchmark that a compile determines: equal in every run of one tree.
COUNTS = ("executed_flops", "wire_bytes", "temp_bytes", "rounds", "dropped")


def _command(argv, prog):
  """The command line of a results file: its argv, with the module when argv lacks it."""
  if argv and argv[0] == "python":
    return " ".join(argv)
  return " ".join(["python", "-m", prog, *argv])


def _machine(info, rows):
  """One sentence: where the rows come from."""
  r0 = rows[0] if rows else {}
  host = f"{info['cpu']}, {info['cores']} cores, JAX {info['jax']}"
  if "topology" in r0:
    slices = ", ".join(dict.fromkeys(r["topology"] for r in rows))
    return (
      f"Compiled for TPU {slices} on a CPU host ({host}): every time is an estimate, nothing ran."
    )
  if info.get("gpu"):
    return f"Measured on {info['gpu']} ({host})."
  n = info["devices"]
  where = f"Measured on {n} {info['backend'].upper()} device{'s' * (n != 1)} of one host ({host})"
  if info.get("malloc"):
    where += f"; malloc: {info['malloc']}"
  return where + "."


def _files(stem):
  """Links to the results files of one stem."""
  names = sorted(p.name for p in RESULTS.glob(stem + ".*"))
  return "Files: " + ", ".join(f"[{n}]({LINK}/{n})" for n in names) + "."


def _layer(data):
  """A `python -m bench` results file: its headline and its rows."""
  rows = data["rows"]

  def values(key):
    return ", ".join(str(v) for v in dict.fromkeys(r[key] for r in rows))

  parts = [
    f"T={values('T')} tokens in all, D={values('D')}, F={values('F')}, K={values('K')}, "
    f"E={values('E')}, {values('dtype')}, "
    + (f"{values('shared_experts')} shared expert(s), " if rows[0].get("shared_experts") else "")
    + f"mesh {report.mesh_text(rows)}.",
  ]
  head = report.headline(rows)
  if head:
    parts.append("all_to_all against the best jit-only version:\n\n" + head.rstrip())
  if len(rows) <= FULL_TABLE_ROWS:
    parts.append("Every row:\n\n" + report.table(rows).rstrip())
  else:
    parts.append(f"{len(rows)} rows: see the files below for every row.")
  memory = report.memory_section(rows)
  if memory:
    parts.append("Memory per device:\n\n" + memory.rstrip())
  return parts


def _headline_rows(rows):
  """Per case and mode: the all_to_all row and the fastest jit-only row."""
  out = {}
  for r in rows:
    if r["impl"] != "all_to_all" or "error" in r:
      continue
    key = (r["level"], r["T"], r["E"], r["routing"], r["mode"])
    jit = [
      q
      for q in rows
      if q["impl"].startswith("jit_")
      and "error" not in q
      and (q["level"], q["T"], q["E"], q["routing"], q["mode"]) == key
    ]
    fast = min(jit, key=lambda q: q["time_s"]["median"])
    out[key] = (r, fast)
  return out


def _counts(rows):
  return {(r["level"], r["impl"], r["mode"]): tuple(r.get(c) for c in COUNTS) for r in rows}


def run_to_run(runs):
  """The headline figures of several runs of one command, and their ranges.

  Args:
    runs: (stem, results dict) pairs, the layer benchmark's results files.

  Returns:
    Markdown: a table with one line per run and mode, then the range of each figure and
    whether the counts (`COUNTS`) agree across the runs.

  Raises:
    ValueError: the runs' settings (the benchmark's case) differ.
  """
  first, settings = runs[0][0], runs[0][1]["settings"]
  for stem, data in runs[1:]:
    if data["settings"] != settings:
      raise ValueError(
        f"run_to_run: runs must share their settings; {stem} has {data['settings']}, "
        f"{first} has {settings}"
      )
  lines = [
    "| file | machine | load at start | mode | all_to_all ms (min-max) | efficiency "
    "| fastest jit-only ms | speed-up |",
    "|---|---|---|---|---|---|---|---|",
  ]
  spread = {}
  for stem, data in runs:
    info = data["machine"]
    for a2a, fast in _headline_rows(data["rows"]).values():
      mode, t, eff = a2a["mode"], a2a["time_s"], a2a["efficiency"]
      speed = fast["time_s"]["median"] / t["median"]
      spread.setdefault(mode, []).append((eff, speed))
      lines.append(
        f"| {stem} | {info['cpu']}, {info['cores']} cores | {info['load_average_1min']:.1f} "
        f"| {mode} | {t['median'] * 1e3:.0f} ({t['min'] * 1e3:.0f}-{t['max'] * 1e3:.0f}) "
        f"| {eff:.2f} | {fast['impl']} {fast['time_s']['median'] * 1e3:.0f} | {speed:.1f}x |"
      )
  ranges = []
  for mode, figures in spread.items():
    effs, speeds = [f[0] for f in figures], [f[1] for f in figures]
    ranges.append(
      f"{mode}: efficiency {_span(effs, '.2f')}, speed-up over the fastest jit-only version "
      f"{_span(speeds, '.1f')}x"
    )
  counts = [_counts(data["rows"]) for _, data in runs]
  differ = sorted(
    f"{impl} {mode} {column}"
    for (level, impl, mode), values in counts[0].items()
    for i, column in enumerate(COUNTS)
    if any(c.get((level, impl, mode), values)[i] != values[i] for c in counts[1:])
  )
  text = (
    f"Over the {len(runs)} runs: " + "; ".join(ranges) + ". The counts (executed FLOPs, "
    "bytes sent, temp memory, rounds, drops) "
    + (
      f"differ between the runs, as only another tree or JAX version makes them: "
      f"{', '.join(differ)}."
      if differ
      else "are the same in every run."
    )
  )
  return "\n".join(lines) + "\n\n" + text


def _span(values, fmt):
  """`lo-hi` of `values` in format `fmt`, or one value where both read the same."""
  lo, hi = format(min(values), fmt), format(max(values), fmt)
  return lo if lo == hi else f"{lo}-{hi}"


def _reruns(stem):
  """The results files `STEM_rerunN` of one stem, in order of N."""
  found = [RERUN.match(p.stem) for p in RESULTS.glob(f"{stem}_rerun*.json")]
  return [
    m[0] for m in sorted((m for m in found if m and m["stem"] == stem), key=lambda m: int(m["n"]))
  ]


def _num(x, fmt):
  return "-" if x is None else format(x, fmt)


def _gmm(data):
  """A `python -m bench.gmm` results file (CPU grouped matmul)."""
  s = data["shape"]
  lines = [
    "| G | skew | impl | mode | flops / routed | speed / dense | temp / (x+y) | impl ms "
    "| dense ms |",
    "|---|---|---|---|---|---|---|---|---|",
  ]
  for r in data["rows"]:
    lines.append(
      f"| {r['G']} | {r['skew']} | {r['impl']} | {r['mode']} | {_num(r['flops_ratio'], '.2f')} "
      f"| {_num(r['speed_ratio'], '.2f')} | {_num(r['temp_ratio'], '.2f')} "
      f"| {_num(r['impl_ms'], '.1f')} | {_num(r['dense_ms'], '.1f')} |"
    )
  return [
    f"M={s['M']}, D={s['D']}, F={s['F']}, {s['dtype']}; speed / dense: one dense matmul of "
    "the routed FLOPs' time over the backend's.",
    "\n".join(lines),
  ]


def _gpu(data):
  """A `python -m bench.gpu` results file (GPU grouped matmul, or its block sweep)."""
  lines = [
    "| G | skew | impl | mode | impl ms | dense ms | speed / dense |",
    "|---|---|---|---|---|---|---|",
  ]
  for r in data["rows"]:
    lines.append(
      f"| {r['G']} | {r['skew']} | {r['impl']} | {r['mode']} | {_num(r.get('impl_ms'), '.2f')} "
      f"| {_num(r.get('dense_ms'), '.2f')} | {_num(r.get('speed_vs_dense'), '.2f')} |"
    )
  return [
    "speed / dense: one dense [M, D] @ [D, F] matmul's time over the backend's (medians).",
    "\n".join(lines),
  ]


def _section(stem, title):
  """The Markdown of one results stem."""
  json_path = RESULTS / f"{stem}.json"
  out = [f"## {title}"]
  if json_path.exists():
    data = json.loads(json_path.read_text())
    info = data.get("machine") or data.get("info")
    if "settings" in data:
      prog, body = "bench", _layer(data)
    elif "shape" in data:
      prog, body = "bench.gmm", _gmm(data)
    elif data.get("kind") == "maxtext_models":
      text = maxtext_models.markdown(data["rows"], "").split("\n\n", 2)[2]
      prog, body = "bench.maxtext_models", [text.strip()]
    elif data.get("kind") == "calibration":
      prog, body = (
        "bench.calibration",
        [calibration.tables(data["rows"]), calibration.notes(data["rows"])],
      )
    else:
      prog, body = "bench.gpu", _gpu(data)
    # A merged file (`--from-json A,B`) holds several commands.
    lines = "\n\n".join(f"`{_command(w, prog)}`" for w in report.argvs(data.get("argv", [])))
    out += [lines, _machine(info, data["rows"]), *body]
    rows = data["rows"]
    read_by_the_one_count = data.get("kind") in ("calibration", "maxtext_models")
    if (
      not read_by_the_one_count
      and any("topology" in r for r in rows)
      and not any("estimate_s" in r for r in rows)
    ):
      out.append(OLD_TPU_COUNT)
    out.append(_files(stem))
  else:
    md = (RESULTS / f"{stem}.md").read_text().splitlines()
    commands = [line for line in md if line.startswith("`python")]
    out += [*commands[:1], f"Kept as Markdown only: [{stem}.md]({LINK}/{stem}.md)."]
  reruns = _reruns(stem)
  if reruns:
    runs = [(s, json.loads((RESULTS / f"{s}.json").read_text())) for s in [stem, *reruns]]
    links = ", ".join(f"[{s}.json]({LINK}/{s}.json)" for s in reruns)
    out.append(
      f"The same command run again, at other times, loads and machines ({links}):\n\n"
      + run_to_run(runs)
    )
  if stem in NOTES:
    out.append(NOTES[stem])
  png = RESULTS / f"{stem}.png"
  if png.exists():
    out.append(f"![{title}]({LINK}/{png.name})")
  return "\n\n".join(out)


def page():
  """The whole page, from the files in bench/results/."""
  stems = sorted({p.stem for p in RESULTS.glob("*.json")} | {p.stem for p in RESULTS.glob("*.md")})
  stems = [s for s in stems if not ((m := RERUN.match(s)) and m["stem"] in stems)]
  ordered = [s for s in SECTIONS if s in stems] + [s for s in stems if s not in SECTIONS]
  sections = [_section(s, SECTIONS.get(s, s)) for s in ordered]
  return INTRO + "\n" + "\n\n".join(sections) + "\n"


def main(argv=None):
  p = argparse.ArgumentParser(prog="python -m bench.docs_page", description=__doc__.split("\n")[0])
  p.add_argument("--out", default=str(PAGE), help="where to write the page (default: %(default)s)")
  a = p.parse_args(argv)
  pathlib.Path(a.out).write_text(page())
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
