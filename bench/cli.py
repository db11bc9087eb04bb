"""moe_shard benchmark: shard_map MoE against jit-only versions, on the devices found.

    python -m bench                    # default: the layer at T=8192, D=512, F=1024, K=2, E=8
    python -m bench --quick            # small sizes, about a minute
    python -m bench --sweep            # levels x E in {8, 64} x four routing skews, smaller
    python -m bench --tpu v5e:2x4      # compile for a TPU slice here: estimates, not runs

Every implementation of a case gets the same sharded inputs (tokens over every mesh axis,
expert weights over "expert"); see `bench/programs.py`. On a CPU-only machine JAX is given
`--devices` (default 8) simulated CPU devices. Each row (case x impl x mode):

  time: median (min, max) wall seconds over --repeats runs after a warm-up, all programs of
    a case timed in turns; compile seconds separately.
  GFLOP/s: routed FLOPs / median time. flops x: FLOPs executed, summed over devices (read
    from the compiled HLO, loop bodies times their trip counts), over the routed FLOPs.
  MiB/dev, x bound: collective bytes each device sends (from the HLO, loops scaled) and
    their ratio to the cost model's lower bound T_dev*K*(N-1)/N*(D + F_out)*bytes (x2 for
    forward+backward).
  temp MiB: temp memory per device (`memory_analysis()`).
  rounds: all_to_all dispatch rounds; dropped: (token, slot) items the capacity-factor
    baseline drops (the others are dropless).
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import io
import json
import os
import re
import sys
import time

from bench import IMPLS, LEVELS, MODES, ROUTINGS

PRESETS = {
    # jit_ragged_dot is left out of the default (XLA replicates its work on every device:
    # 8x the FLOPs and 3x the time of the next slowest); --impls or --sweep include it.
    "default": dict(tokens=8192, d_model=512, d_ff=1024, top_k=2, experts="8",
                    routing="uniform", levels="layer", modes="fwd,fwd_bwd", repeats=2,
                    impls="all_to_all,all_gather,jit_masked_scan,jit_gshard_einsum"),
    "quick": dict(tokens=2048, d_model=256, d_ff=512, top_k=2, experts="8",
                  routing="uniform", levels="layer", modes="fwd,fwd_bwd", repeats=2),
    "sweep": dict(tokens=4096, d_model=256, d_ff=512, top_k=2, experts="8,64",
                  routing="uniform,zipf,hot_expert,one_device", levels="kernel,layer",
                  modes="fwd,fwd_bwd", repeats=2),
    "tpu": dict(tokens=32768, d_model=2048, d_ff=4096, top_k=2, experts="8,64",
                routing="uniform", levels="layer,kernel", modes="fwd,fwd_bwd", repeats=0),
    "tpu_quick": dict(tokens=2048, d_model=256, d_ff=512, top_k=2, experts="8",
                      routing="uniform", levels="layer,kernel", modes="fwd,fwd_bwd",
                      repeats=0),
}


class UsageError(Exception):
  """A bad flag or an impossible combination: one line on stderr, exit code 2."""


def parser():
  from bench import distributed
  p = argparse.ArgumentParser(
      prog="python -m bench", description=__doc__.split("\n")[0],
      formatter_class=argparse.RawDescriptionHelpFormatter,
      epilog="Presets (flags given override them): " + "; ".join(
          f"{k}: T={v['tokens']} D={v['d_model']} F={v['d_ff']} E={v['experts']} "
          f"routing={v['routing']} levels={v['levels']}" for k, v in PRESETS.items()))
  g = p.add_mutually_exclusive_group()
  g.add_argument("--quick", action="store_true", help="small sizes, about a minute")
  g.add_argument("--sweep", action="store_true", help="the full matrix (tens of minutes)")
  p.add_argument("--tpu", metavar="TOPOLOGY",
                 help="compile for a TPU topology (e.g. v5e:2x4) without running; needs "
                      "the tpu extra. Default sizes T=32768 D=2048 F=4096 bf16")
  p.add_argument("-T", "--tokens", type=int, help="tokens in all (B*S)")
  p.add_argument("-D", "--d-model", type=int)
  p.add_argument("-F", "--d-ff", type=int, help="expert width (kernel: the matrix's F)")
  p.add_argument("-K", "--top-k", type=int)
  p.add_argument("-E", "--experts", help="comma-separated, e.g. 8,64")
  p.add_argument("--mesh", help="EXPERTxDATA, e.g. 8x1 (default: all devices on expert)")
  p.add_argument("--dtype", choices=("float32", "bfloat16"),
                 help="default float32 (bfloat16 with --tpu)")
  p.add_argument("--routing", help="comma-separated from uniform, zipf, hot_expert, "
                                   "one_device")
  p.add_argument("--zipf-s", type=float, default=1.2, help="Zipf exponent (default 1.2)")
  p.add_argument("--impls", help="comma-separated from " + ", ".join(IMPLS))
  p.add_argument("--levels", help="comma-separated from layer, kernel")
  p.add_argument("--modes", help="comma-separated from fwd, fwd_bwd")
  p.add_argument("--repeats", type=int, help="timed runs per program after a warm-up")
  p.add_argument("--capacity-factor", type=float, default=1.25,
                 help="jit_gshard_einsum's capacity factor (default 1.25)")
  p.add_argument("--chunk-size", type=int, help="all_to_all's slots per pair and round")
  p.add_argument("--devices", type=int,
                 help="simulated CPU devices in all, when JAX finds only a CPU (default 8)")
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--out", metavar="STEM",
                 help="write STEM.json, STEM.csv and STEM.md (machine and argv recorded)")
  p.add_argument("--json", metavar="PATH")
  p.add_argument("--csv", metavar="PATH")
  p.add_argument("--plot", metavar="PNG", help="bar charts of time and bytes (matplotlib)")
  p.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
  p.add_argument("--from-json", metavar="PATH",
                 help="measure nothing: print (and with --out/--csv/--plot, write) the tables "
                      "and plot of a results file written before")
  distributed.add_arguments(p)
  return p


def _list(value, allowed, what):
  items = [v.strip() for v in value.split(",") if v.strip()]
  bad = [v for v in items if v not in allowed]
  if bad or not items:
    raise UsageError(f"unknown {what} {', '.join(bad) or repr(value)}; choose from "
                     f"{', '.join(allowed)}")
  return items


def _ints(value, what):
  try:
    items = [int(v) for v in value.split(",")]
  except ValueError:
    raise UsageError(f"{what} must be comma-separated integers (got {value!r})") from None
  if any(v < 1 for v in items):
    raise UsageError(f"{what} must be >= 1 (got {value!r})")
  return items


def settings(a):
  """Merges the preset with the flags; validates what needs no JAX."""
  preset = ("tpu_quick" if a.quick else "tpu") if a.tpu else (
      "quick" if a.quick else "sweep" if a.sweep else "default")
  s = dict(PRESETS[preset], preset=preset)
  for key in ("tokens", "d_model", "d_ff", "top_k", "experts", "routing", "levels", "modes",
              "repeats"):
    if getattr(a, key) is not None:
      s[key] = getattr(a, key)
  for key in ("tokens", "d_model", "d_ff", "top_k"):
    if s[key] < 1:
      raise UsageError(f"--{key.replace('_', '-')} must be >= 1 (got {s[key]})")
  if s["repeats"] < (0 if a.tpu else 1):
    raise UsageError(f"--repeats must be >= 1 (got {s['repeats']})")
  s["experts"] = _ints(str(s["experts"]), "--experts")
  s["routing"] = _list(s["routing"], ROUTINGS, "routing")
  s["levels"] = _list(s["levels"], LEVELS, "level")
  s["modes"] = _list(s["modes"], MODES, "mode")
  s["impls"] = _list(a.impls or s.get("impls") or ",".join(IMPLS), IMPLS, "impl")
  s["dtype"] = a.dtype or ("bfloat16" if a.tpu else "float32")
  if a.capacity_factor <= 0:
    raise UsageError(f"--capacity-factor must be > 0 (got {a.capacity_factor})")
  if a.chunk_size is not None and a.chunk_size < 1:
    raise UsageError(f"--chunk-size must be >= 1 (got {a.chunk_size})")
  if a.num_processes < 1:
    raise UsageError(f"--num-processes must be >= 1 (got {a.num_processes})")
  if a.devices is not None and a.devices < 1:
    raise UsageError(f"--devices must be >= 1 (got {a.devices})")
  if a.mesh is not None:
    try:
      n_e, n_d = (int(v) for v in a.mesh.split("x"))
      assert n_e >= 1 and n_d >= 1
    except (ValueError, AssertionError):
      raise UsageError(f"--mesh must be EXPERTxDATA with positive sizes, e.g. 8x1 "
                       f"(got {a.mesh!r})") from None
  return s


def _ask_for_devices(count, num_processes):
  """Asks XLA for simulated CPU devices before JAX starts: `count` (default 8) in all, split
  over the processes. Raises UsageError when JAX, or XLA_FLAGS, already fixed another count."""
  flag = "--xla_force_host_platform_device_count"
  local = max(1, (count or 8) // num_processes)
  if _backend_started():
    import jax
    have = jax.local_device_count()
    if count is not None and jax.default_backend() == "cpu" and have != local:
      raise UsageError(f"--devices {count}: JAX is already initialised with {have} CPU "
                       "devices in this process; ask for them before JAX starts")
    return
  flags = os.environ.get("XLA_FLAGS", "")
  m = re.search(flag + r"=(\d+)", flags)
  if m is None:
    os.environ["XLA_FLAGS"] = f"{flags} {flag}={local}".strip()
  elif count is not None and int(m.group(1)) != local:
    raise UsageError(f"--devices {count} asks for {local} CPU devices per process but "
                     f"XLA_FLAGS sets {flag}={m.group(1)}")


def _backend_started():
  if "jax" not in sys.modules:
    return False
  from jax._src import xla_bridge
  return bool(getattr(xla_bridge, "_backends", {}))


def _mesh(spec, devices):
  import jax
  import numpy as np
  n = len(devices)
  n_e, n_d = (int(v) for v in spec.split("x")) if spec else (n, 1)
  if n_e * n_d > n:
    hint = ("" if spec is None else
            "; JAX was initialised with fewer devices, or set "
            "XLA_FLAGS=--xla_force_host_platform_device_count before JAX starts")
    raise UsageError(f"mesh {n_e}x{n_d} needs {n_e * n_d} devices, found {n}{hint}")
  grid = np.array(devices[:n_e * n_d], dtype=object).reshape(n_e, n_d)
  return jax.sharding.Mesh(grid, ("expert", "data"),
                           axis_types=(jax.sharding.AxisType.Auto,) * 2)


class Progress:
  """A one-line progress bar on stderr (a line per step when stderr is not a terminal)."""

  def __init__(self, total, enabled):
    self.total, self.done, self.enabled = total, 0, enabled
    self.t0 = time.perf_counter()
    self.tty = sys.stderr.isatty()

  def step(self, what):
    self.done += 1
    if not self.enabled:
      return
    frac = self.done / max(self.total, 1)
    bar = "#" * int(24 * frac)
    line = (f"[{bar:<24}] {self.done}/{self.total} {time.perf_counter() - self.t0:5.0f}s "
            f"{what}")
    if self.tty:
      sys.stderr.write("\r" + line[:120].ljust(120))
      if self.done == self.total:
        sys.stderr.write("\n")
    else:
      sys.stderr.write(line + "\n")
    sys.stderr.flush()


def run(s, a, mesh, progress_enabled, tpu_topology=None):
  """Measures every (level, E, routing) case; returns the rows."""
  from bench import common, tpu
  from bench import programs as progs
  from bench import measure

  size = progs.Size(T=s["tokens"], D=s["d_model"], F=s["d_ff"], K=s["top_k"],
                    dtype=s["dtype"], capacity_factor=a.capacity_factor, zipf_s=a.zipf_s,
                    chunk_size=a.chunk_size)
  cases = [(lv, E, r) for lv in s["levels"] for E in s["experts"] for r in s["routing"]]
  for lv, E, _ in cases:  # every impossible combination before any work
    try:
      progs.check_combination(size, E, mesh, lv)
    except ValueError as err:
      raise UsageError(str(err)) from None
  n_prog = len(s["impls"]) * len(s["modes"])
  per_case = n_prog + (n_prog if tpu_topology else s["repeats"] + 2)
  bar = Progress(len(cases) * per_case, progress_enabled)
  rows = []
  mesh_name = "x".join(str(mesh.shape[k]) for k in mesh.axis_names)
  for level, E, routing in cases:
    case = progs.make_case(level, E, routing, size, mesh, abstract=bool(tpu_topology),
                           seed=a.seed)
    timed = []
    case_rows = []
    for impl in s["impls"]:
      fns = progs.programs(case, impl)
      rounds, dropped = progs.rounds_and_dropped(case, impl)
      trips = progs.trip_counts(case, impl, on_tpu=bool(tpu_topology))
      for mode in s["modes"]:
        args = case.args
        base = dict(level=level, impl=impl, E=E, routing=routing, mode=mode, T=size.T,
                    D=size.D, F=size.F, K=size.K, dtype=size.dtype, mesh=mesh_name,
                    devices=mesh.size, **({"topology": tpu_topology} if tpu_topology else {}))
        t0 = time.perf_counter()
        try:
          compiled = fns[mode].lower(*args).compile()
        except Exception as err:  # noqa: BLE001 - e.g. RESOURCE_EXHAUSTED: does not fit
          case_rows.append(dict(base, error=_one_line(err)))
          bar.step(f"failed {level} E={E} {routing} {impl} {mode}")
          if tpu_topology:
            bar.step(f"skipped {level} E={E} {routing} {impl} {mode}")
          continue
        compile_s = time.perf_counter() - t0
        bar.step(f"compiled {level} E={E} {routing} {impl} {mode}")
        passes = 1 if mode == "fwd" else 3
        executed, busiest = _executed_flops(compiled, trips)
        # Every device sends the same slots in every round: device 0's counts serve.
        coll = _counted(measure.collective_bytes, compiled, trips[0])
        approx = bool(coll.pop("loop_counted_once", False) or busiest.get("loop_counted_once"))
        wire = sum(c["wire_bytes"] for c in coll.values())
        bound = case.bound_bytes * (1 if mode == "fwd" else 2)
        routing_bound = progs.routing_bound_bytes(case) * (1 if mode == "fwd" else 2)
        row = dict(base, compile_s=compile_s,
                   routed_flops=case.routed_flops * passes,
                   executed_flops=executed,
                   flops_ratio=executed / (case.routed_flops * passes),
                   wire_bytes=wire,
                   bytes_over_bound=wire / bound if bound else None,
                   bytes_over_routing_bound=wire / routing_bound if routing_bound else None,
                   collectives={k: c["wire_bytes"] for k, c in coll.items()},
                   temp_bytes=measure.memory_bytes(compiled)["temp"],
                   rounds=rounds if impl == "all_to_all" else None, dropped=dropped,
                   **({"loop_counted_once": True} if approx else {}))
        if tpu_topology:
          row.update(tpu.estimates(compiled, busiest, wire, tpu_topology))
          bar.step(f"estimated {level} E={E} {routing} {impl} {mode}")
        else:
          timed.append((compiled, args, row))
        case_rows.append(row)
    if not tpu_topology:
      times = common.time_in_turns(
          [(c, args) for c, args, _ in timed], s["repeats"],
          on_turn=lambda i: bar.step(f"{'warmed up' if i == 0 else f'timed turn {i}'} "
                                     f"{level} E={E} {routing}"))
      for (compiled, args, row), t in zip(timed, times):
        row["time_s"] = t
        row["gflops"] = row["routed_flops"] / t["median"] / 1e9
      _errors(case, case_rows, timed)
      bar.step(f"checked {level} E={E} {routing}")
    rows += case_rows
  return rows


def _one_line(err):
  """The first line of an exception's message, with its type."""
  text = str(err).strip().splitlines()
  return f"{type(err).__name__}: {text[0] if text else ''}"[:300]


def _counted(fn, compiled, trips):
  """`fn(compiled, trips)`; a loop XLA wrote with no trip count it shows (and none of ours)
  is counted as running once per entry, and the result says so ("loop_counted_once")."""
  try:
    return fn(compiled, trips)
  except ValueError:
    out = fn(compiled, trips, default_trip_count=1)
    return dict(out, loop_counted_once=True) if isinstance(out, dict) else out


def _executed_flops(compiled, trips):
  """(FLOPs executed summed over devices, `executed_flops` of the busiest device), from
  each device's trip counts (devices with equal counts share one evaluation)."""
  from bench import measure
  by_counts = {}
  for t in trips:
    key = tuple(sorted(t.items()))
    if key not in by_counts:
      by_counts[key] = _counted(measure.executed_flops, compiled, t)
  per_device = [by_counts[tuple(sorted(t.items()))] for t in trips]
  return (sum(f["executed"] for f in per_device),
          max(per_device, key=lambda f: f["executed"]))


def _errors(case, rows, timed):
  """Max |y - reference| of each forward, the reference the local ragged_dot on one device."""
  import jax
  import numpy as np
  import moe_shard as ms
  if jax.process_count() > 1:
    return  # the outputs are not all on this process
  if case.level == "kernel":
    x, w, e, g, _ = (jax.device_get(v) for v in case.args)
    ref = np.asarray(jax.jit(ms.moe_ragged_dot)(x, w, e, g), np.float32)
  else:
    params, x, _ = (jax.device_get(v) for v in case.args)
    ref = np.asarray(jax.jit(lambda p, x: ms.moe_layer(p, x, dataclasses.replace(
        case.cfg, impl="ragged_dot"))[0])(params, x), np.float32)
  for compiled, args, row in timed:
    if row["mode"] != "fwd":
      continue
    out = compiled(*args)
    y = out if case.level == "kernel" else out[0]
    if case.level == "layer":  # what the layer reports, against the host's count
      row["rounds_reported"], row["dropped_reported"] = int(out[2]), int(out[3])
    row["max_abs_err"] = float(np.max(np.abs(np.asarray(jax.device_get(y), np.float32)
                                             - ref)))


# --------------------------------------------------------------------------- output


def _ms(t):
  if t is None:
    return "n/a"
  return f"{t * 1e3:.0f}" if t >= 0.01 else f"{t * 1e3:.2g}"


def table(rows):
  """The results as a Markdown table."""
  tpu = any("topology" in r for r in rows)
  if tpu:
    head = ("| level | E | routing | mode | impl | XLA est. ms | XLA est. ms, loops scaled | "
            "roofline ms (compute/HBM/ICI) | flops x | MiB/dev | x bound (uniform/routing) | "
            "HBM temp MiB | "
            "rounds | dropped | compile s |")
  else:
    head = ("| level | E | routing | mode | impl | median ms (min-max) | GFLOP/s | flops x | "
            "MiB/dev | x bound (uniform/routing) | temp MiB | rounds | dropped | max err | "
            "compile s |")
  out = [head, "|" + "---|" * (head.count("|") - 1)]
  for r in rows:
    common = (f"| {r['level']} | {r['E']} | {r['routing']} | {r['mode']} | {r['impl']} ")
    if "error" in r:
      out.append(common + f"| did not compile: {r['error']} |" + " |" * (head.count("|") - 7))
      continue
    bound = "/".join(f"{r[k]:.2f}" if r.get(k) is not None else "-"
                     for k in ("bytes_over_bound", "bytes_over_routing_bound"))
    star = "*" if r.get("loop_counted_once") else ""
    tail = (f"| {r['flops_ratio']:.2f}{star} | {r['wire_bytes'] / 2**20:.2f}{star} | {bound} | "
            f"{r['temp_bytes'] / 2**20:.1f} | {r['rounds'] if r['rounds'] else '-'} | "
            f"{r['dropped']} ")
    if tpu:
      roof = (f"{_ms(r['roofline_s'])} ({_ms(r['compute_s'])}/{_ms(r['hbm_s'])}/"
              f"{_ms(r['ici_s'])})" if "roofline_s" in r else "-")
      out.append(common + f"| {_ms(r['xla_optimal_s'])} | {_ms(r['xla_optimal_scaled_s'])} | "
                 f"{roof} " + tail + f"| {r['compile_s']:.1f} |")
    else:
      t = r["time_s"]
      err = f"{r['max_abs_err']:.1e}" if "max_abs_err" in r else "-"
      out.append(common + f"| {_ms(t['median'])} ({_ms(t['min'])}-{_ms(t['max'])}) | "
                 f"{r['gflops']:.1f} " + tail + f"| {err} | {r['compile_s']:.1f} |")
  if any(r.get("loop_counted_once") for r in rows):
    out.append("\n\\* a loop XLA generated without a trip count it shows was counted once: "
               "these FLOPs and bytes are a lower bound.")
  return "\n".join(out) + "\n"


def headline(rows):
  """all_to_all against the best jit-only version of each case: time and bytes."""
  tpu = any("topology" in r for r in rows)
  key = ("roofline_s" if all("roofline_s" in r for r in rows if "error" not in r)
         else "xla_optimal_scaled_s") if tpu else None

  def seconds(r):
    return r[key] if key else r["time_s"]["median"]

  groups = {}
  for r in rows:
    if "error" not in r:
      groups.setdefault((r["level"], r["E"], r["routing"], r["mode"]), []).append(r)
  lines = []
  for (level, E, routing, mode), rs in groups.items():
    a2a = [r for r in rs if r["impl"] == "all_to_all"]
    jit = [r for r in rs if r["impl"].startswith("jit_")]
    timed = [r for r in jit if seconds(r) is not None]
    if not a2a or not jit:
      continue
    a2a = a2a[0]
    light = min(jit, key=lambda r: r["wire_bytes"])
    if timed and seconds(a2a) is not None:
      fast = min(timed, key=seconds)
      speed = (f"{_named(fast)} {_ms(seconds(fast))} | "
               f"{seconds(fast) / seconds(a2a):.1f}x")
    else:
      speed = "n/a | n/a"
    lines.append(
        f"| {level} | {E} | {routing} | {mode} | {_ms(seconds(a2a))} | {speed} | "
        f"{a2a['wire_bytes'] / 2**20:.2f} | {_named(light)} {light['wire_bytes'] / 2**20:.2f} "
        f"| {light['wire_bytes'] / max(a2a['wire_bytes'], 1):.2f}x |")
  if not lines:
    return ""
  what = {"roofline_s": "roofline estimate for the TPU compiled for, not a measurement",
          "xla_optimal_scaled_s": "XLA's TPU cost estimate, loops scaled; not a measurement",
          None: "median wall time"}[key]
  return ("| level | E | routing | mode | all_to_all ms | fastest jit-only ms | speed-up | "
          "all_to_all MiB/dev | fewest-bytes jit-only MiB/dev | bytes ratio |\n"
          "|---|---|---|---|---|---|---|---|---|---|\n" + "\n".join(lines) +
          f"\n\n(times: {what}; bytes ratio: the jit-only version's bytes over all_to_all's)\n")


def _named(row):
  """The impl's name, with the items it dropped when it dropped some."""
  return row["impl"] + (f" (drops {row['dropped']})" if row.get("dropped") else "")


def markdown(rows, info, argv, s):
  r0 = rows[0]
  where = (f"compiled for TPU {r0['topology']} on this machine: every time is an estimate, "
           "nothing ran" if "topology" in r0 else
           f"{info['devices']} {info['backend']} devices")
  return (f"# moe_shard benchmark\n\n`{' '.join(argv)}`\n\n"
          f"T={r0['T']} tokens in all, D={r0['D']}, F={r0['F']}, K={r0['K']}, {r0['dtype']}, "
          f"mesh {r0['mesh']} (expert x data), {where}. Machine: {info['cpu']}, "
          f"{info['cores']} cores, JAX {info['jax']}, load average "
          f"{info['load_average_1min']:.1f} at start. Layer level: router + dispatch + SwiGLU "
          "+ combine; kernel level: one [D, F] matrix per expert. See `python -m bench "
          "--help` for the columns.\n\n## all_to_all against the best jit-only version\n\n"
          + headline(rows) + "\n## Every row\n\n" + table(rows))


CSV_FIELDS = ("level", "impl", "E", "routing", "mode", "T", "D", "F", "K", "dtype", "mesh",
              "devices", "time_median_s", "time_min_s", "time_max_s", "compile_s", "gflops",
              "routed_flops", "executed_flops", "flops_ratio", "wire_bytes",
              "bytes_over_bound", "bytes_over_routing_bound", "temp_bytes", "rounds", "dropped", "max_abs_err",
              "topology", "xla_optimal_s", "xla_optimal_scaled_s", "roofline_s",
              "compute_s", "hbm_s", "ici_s", "error")


def to_csv(rows):
  buf = io.StringIO()
  w = csv.DictWriter(buf, CSV_FIELDS, extrasaction="ignore")
  w.writeheader()
  for r in rows:
    flat = dict(r)
    if "time_s" in r:
      flat.update(time_median_s=r["time_s"]["median"], time_min_s=r["time_s"]["min"],
                  time_max_s=r["time_s"]["max"])
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
  impls = list(dict.fromkeys(r["impl"] for r in rows))
  fig, axes = plt.subplots(2, len(panels), figsize=(min(5 * len(panels), 22), 7.5),
                           squeeze=False)
  width = 0.8 / len(impls)
  for col, (level, mode) in enumerate(panels):
    here = [r for r in rows if (r["level"], r["mode"]) == (level, mode)]
    cases = list(dict.fromkeys((r["E"], r["routing"]) for r in here))
    for i, impl in enumerate(impls):
      by = {(r["E"], r["routing"]): r for r in here if r["impl"] == impl}
      xs = [j + i * width for j, c in enumerate(cases) if c in by]
      secs = [by[c].get("roofline_s") if tpu else by[c]["time_s"]["median"]
              for c in cases if c in by]
      axes[0, col].bar(xs, [1e3 * t if t is not None else 0 for t in secs], width,
                       color=f"C{i}", label=impl)
      axes[1, col].bar(xs, [by[c]["wire_bytes"] / 2**20 for c in cases if c in by], width,
                       color=f"C{i}", label=impl)
    for ax in axes[:, col]:
      ax.set_yscale("log")
      ax.set_xticks([j + 0.4 - width / 2 for j in range(len(cases))])
      ax.set_xticklabels([f"E={e}\n{rt}" for e, rt in cases], fontsize=7)
    axes[0, col].set_title(f"{level}, {mode.replace('_', '+')}", fontsize=10)
  axes[0, 0].set_ylabel("roofline estimate, ms (not measured)" if tpu else
                        "median wall time, ms")
  axes[1, 0].set_ylabel("collective MiB sent per device")
  axes[0, 0].legend(fontsize=7)
  r0 = rows[0]
  fig.suptitle(f"T={r0['T']} D={r0['D']} F={r0['F']} K={r0['K']} {r0['dtype']}, mesh "
               f"{r0['mesh']}" + (f", compiled for TPU {r0['topology']}" if tpu else
                                  f", {r0['devices']} devices"), fontsize=10)
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
        json.dump({"machine": info, "argv": argv, "settings": s, "rows": rows}, f, indent=1,
                  default=str)
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


def main(argv=None):
  argv = sys.argv[1:] if argv is None else list(argv)
  try:
    return _main(argv)
  except UsageError as err:
    print(f"python -m bench: error: {err}", file=sys.stderr)
    return 2
  except KeyboardInterrupt:
    print("python -m bench: interrupted", file=sys.stderr)
    return 130


def _main(argv):
  a = parser().parse_args(argv)
  s = settings(a)
  if a.plot:
    try:
      import matplotlib  # noqa: F401 - only checked here
    except ImportError:
      raise UsageError("--plot needs matplotlib: pip install -e \".[bench]\"") from None
  if a.from_json:
    try:
      with open(a.from_json) as f:
        saved = json.load(f)
      rows = saved["rows"]
    except (OSError, ValueError, KeyError, TypeError) as err:
      raise UsageError(f"--from-json {a.from_json}: not a results file ({err!r})") from None
    print(headline(rows))
    print(table(rows))
    a.json = None  # the file itself stays as it was
    for path in write(rows, saved["machine"], saved["argv"], saved.get("settings", s), a):
      print("wrote", path)
    return 0
  if a.tpu and not _backend_started():
    # Compile only: no TPU is opened, so libtpu's one-process lock is not needed.
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
  _ask_for_devices(a.devices, a.num_processes)
  from bench import distributed
  try:
    distributed.initialize(a)
  except ValueError as err:
    raise UsageError(str(err)) from None
  import jax
  from bench import common, tpu

  leader = distributed.is_leader()
  if a.tpu:
    try:
      devices = tpu.devices(a.tpu)
    except ValueError as err:
      raise UsageError(str(err)) from None
  else:
    devices = jax.devices()
  mesh = _mesh(a.mesh, devices)
  info = common.machine_info()
  full = ["python", "-m", "bench", *argv]
  if leader:
    where = f"TPU {a.tpu} (compile only)" if a.tpu else (
        f"{len(devices)} {jax.default_backend()} devices, {jax.process_count()} process(es)")
    print(f"moe_shard benchmark ({s['preset']}): T={s['tokens']} D={s['d_model']} "
          f"F={s['d_ff']} K={s['top_k']} E={s['experts']} {s['dtype']} on {where}, mesh "
          f"{mesh.shape['expert']}x{mesh.shape['data']}", flush=True)
  progress = leader and not a.no_progress
  rows = run(s, a, mesh, progress, tpu_topology=a.tpu)
  if leader:
    print()
    print(headline(rows))
    print(table(rows))
    for path in write(rows, info, full, s, a):
      print("wrote", path)
  return 0


if __name__ == "__main__":
  sys.exit(main())
