"""Running the benchmark: the devices and mesh, compiling, measuring and timing each case.

Every implementation of a case (`bench/cases/impls.py`) gets the same sharded inputs
(`bench/cases/programs.py`); FLOPs and bytes are read from the compiled program (`bench/reading/measure.py`)
with the loop counts of `bench/reading/accounting.py`; forward outputs are checked against an
independent NumPy reference (`bench/cases/reference.py`).
"""

from __future__ import annotations

import dataclasses
import os
import re
import sys
import time

from bench.command import rows as row_facts
from bench.command.checks import UsageError, mesh_axes


def ask_for_devices(count, num_processes):
  """Asks XLA for simulated CPU devices before JAX starts: `count` (default 8) in all, split
  over the processes. Raises UsageError when JAX, or XLA_FLAGS, already fixed another count."""
  flag = "--xla_force_host_platform_device_count"
  local = max(1, (count or 8) // num_processes)
  if backend_started():
    import jax

    have = jax.local_device_count()
    if count is not None and jax.default_backend() == "cpu" and have != local:
      raise UsageError(
        f"--devices {count}: JAX is already initialised with {have} CPU "
        "devices in this process; ask for them before JAX starts"
      )
    return
  flags = os.environ.get("XLA_FLAGS", "")
  m = re.search(flag + r"=(\d+)", flags)
  if m is None:
    os.environ["XLA_FLAGS"] = f"{flags} {flag}={local}".strip()
  elif count is not None and int(m.group(1)) != local:
    raise UsageError(
      f"--devices {count} asks for {local} CPU devices per process but "
      f"XLA_FLAGS sets {flag}={m.group(1)}"
    )


def backend_started():
  if "jax" not in sys.modules:
    return False
  from jax._src import xla_bridge

  return bool(getattr(xla_bridge, "_backends", {}))


def make_mesh(spec, devices):
  """The Auto mesh of `--mesh`: ("expert", "data") for "8x1" (default: every device on
  expert), or the named axes of "expert=8,tensor=8" in that order (`checks.mesh_axes`)."""
  import jax
  import numpy as np

  axes = mesh_axes(spec) if spec else (("expert", len(devices)), ("data", 1))
  names, sizes = zip(*axes)
  need = int(np.prod(sizes))
  if need > len(devices):
    hint = (
      ""
      if spec is None
      else "; JAX was initialised with fewer devices, or set "
      "XLA_FLAGS=--xla_force_host_platform_device_count before JAX starts"
    )
    raise UsageError(f"mesh {mesh_label(axes)} needs {need} devices, found {len(devices)}{hint}")
  grid = np.array(devices[:need], dtype=object).reshape(sizes)
  return jax.sharding.Mesh(grid, names, axis_types=(jax.sharding.AxisType.Auto,) * len(names))


def mesh_label(axes):
  """How rows name a mesh, from ((name, size), ...) or a `Mesh`: "8x1" for (expert, data),
  "expert=8,tensor=8" for any other axes."""
  if hasattr(axes, "shape"):
    axes = tuple(axes.shape.items())
  if tuple(n for n, _ in axes) == ("expert", "data"):
    return "x".join(str(v) for _, v in axes)
  return ",".join(f"{n}={v}" for n, v in axes)


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
    line = f"[{bar:<24}] {self.done}/{self.total} {time.perf_counter() - self.t0:5.0f}s {what}"
    if self.tty:
      sys.stderr.write("\r" + line[:120].ljust(120))
      if self.done == self.total:
        sys.stderr.write("\n")
    else:
      sys.stderr.write(line + "\n")
    sys.stderr.flush()


def run(s, a, mesh, progress_enabled, tpu_topology=None):
  """Measures every (level, E, routing) case; returns the rows."""
  from bench.cases import build, common
  from bench.cases.impls import BENCH_IMPLS
  from bench.command import malloc
  from bench.command.presets import SCALING

  def sizes_and_cases(part):
    return [
      (
        build.Size(
          T=T,
          D=part["d_model"],
          F=part["d_ff"],
          K=s["top_k"],
          dtype=s["dtype"],
          capacity_factor=a.capacity_factor,
          zipf_s=a.zipf_s,
          chunk_size=a.chunk_size,
          expert_tensor_axis=s.get("expert_tensor_axis"),
          expert_fsdp_axis=s.get("expert_fsdp_axis"),
          num_shared_experts=s.get("shared_experts", 0),
          expert_type=s.get("expert_type", "swiglu"),
          expert_bias=s.get("expert_bias", False),
          placement=pl,
          replicas=s.get("replicas", 0) if pl != "none" else 0,
          **s["router"],
        ),
        (lv, E, r),
      )
      for T in part["tokens"]
      for lv in part["levels"]
      for E in part["experts"]
      for r in part["routing"]
      for pl in part.get("placements", ["none"])
    ]

  cases = sizes_and_cases(s) + (sizes_and_cases(SCALING) if s["scaling"] else [])
  # The routed experts' matrices: None (float, the case's dtype) or a quantized format.
  formats = [None if f == s["dtype"] else f for f in s.get("weights_formats", [s["dtype"]])]
  # Each format with each adapter rank (0: none): a row of its own, timed in turns together.
  variants = [(f, r) for f in formats for r in s.get("adapter_ranks", [0])]
  for size, (lv, E, _) in cases:  # every impossible combination before any work
    for fmt, rank in variants:
      try:
        build.check_combination(
          dataclasses.replace(size, weights_format=fmt, adapter_rank=rank), E, mesh, lv
        )
      except ValueError as err:
        raise UsageError(str(err)) from None

  def impls_for(fmt, rank):  # rows that take float matrices only run for the float weights
    return [i for i in s["impls"] if (fmt is None and not rank) or BENCH_IMPLS[i].quantized]

  n_prog = sum(len(impls_for(f, r)) for f, r in variants) * len(s["modes"])
  per_case = n_prog + (n_prog if tpu_topology else s["repeats"] + 2)
  bar = Progress(len(cases) * per_case, progress_enabled)
  rows = []
  mesh_name = mesh_label(mesh)
  for base_size, (level, E, routing) in cases:
    malloc.release_freed_memory()  # the last case's buffers, kept by a reusing malloc
    timed = []  # every format's programs, timed in turns together
    case_rows = []
    checks = []  # (case, its rows, its timed programs, kept) of each format
    for fmt, rank in variants:
      size = dataclasses.replace(base_size, weights_format=fmt, adapter_rank=rank)
      case = build.make_case(
        level, E, routing, size, mesh, abstract=bool(tpu_topology), seed=a.seed
      )
      kept = {}
      fmt_rows, fmt_timed = [], []
      checks.append((case, fmt_rows, fmt_timed, kept))
      _run_format(
        s, a, case, impls_for(fmt, rank), mesh_name, tpu_topology, bar, fmt_rows, fmt_timed, kept
      )
      case_rows += fmt_rows
      timed += fmt_timed
    if not tpu_topology:
      outputs = []  # each timed program's last output, which `_errors` checks
      times = common.time_in_turns(
        [(c, args) for c, args, _ in timed],
        s["repeats"],
        on_turn=lambda i: bar.step(
          f"{'warmed up' if i == 0 else f'timed turn {i}'} {level} E={E} {routing}"  # noqa: B023 (called within this iteration)
        ),
        settle=True,
        outputs=outputs,
      )
      for (_, _, row), t in zip(timed, times):
        row["time_s"] = t
        row["gflops"] = row["routed_flops"] / t["median"] / 1e9
      last = {id(row): out for (_, _, row), out in zip(timed, outputs)}
      for case, fmt_rows, fmt_timed, kept in checks:
        row_facts.errors(case, fmt_rows, fmt_timed, kept, last)
      del outputs[:], last
      bar.step(f"checked {level} E={E} {routing}")
    row_facts.efficiency(case_rows)
    rows += case_rows
  return rows


def _run_format(s, a, case, impls, mesh_name, tpu_topology, bar, case_rows, timed, kept):
  """Compiles (and, off TPU, readies for timing) every impl of `impls` on one case with one
  weights format: appends its rows to `case_rows`, the programs to time to `timed` as
  (program, args, row), and the items each dispatch keeps to `kept`."""
  from bench.cases import programs as progs
  from bench.cases.impls import BENCH_IMPLS, NotRun
  from bench.reading import accounting, bound, measure, replica_accounting, tpu
  from moe_shard.layer import STEP_SCOPE

  level, E, routing, size, mesh = case.level, case.E, case.routing, case.size, case.mesh
  routing_bound = accounting.routing_bound_bytes(case)
  # The bound is the problem's: from the logical parameters when args[0] hold slots.
  logical = case.logical_params if case.logical_params is not None else case.args[0]
  stored = row_facts.param_bytes(logical) if level == "layer" else None
  held_params = (
    row_facts.param_bytes(case.args[0]) if level == "layer" else None
  )  # as stored (slots)
  peak = tpu.PEAKS.get(tpu.generation(tpu_topology)) if tpu_topology else None
  held = stored or row_facts.param_bytes(case.args[1])  # the layer's parameters, or the kernel's w
  bounds = {m: bound.bound(case, held, m, peak) for m in s["modes"]}
  for impl in impls:
    entry = BENCH_IMPLS[impl]
    try:
      fns, impl_args = progs.programs_and_args(case, impl)
      not_run = None
    except NotRun as err:  # e.g. the PyTorch peer without PyTorch or a GPU
      fns, impl_args, not_run = None, None, f"not run: {err}"
    # The per-step placement runs one branch of a lax.cond: its figures are that branch's.
    branch = replica_accounting.step_branch(case) if case.size.placement == "step" else case
    acc, device_rows = replica_accounting.placed(entry.accounting, branch, bool(tpu_topology), impl)
    if branch is not case and not tpu_topology:  # the program with both branches is timed
      taken = {measure.branch_key(STEP_SCOPE): int(branch.placement is not None)}
      acc = dataclasses.replace(acc, trips=[dict(t, **taken) for t in acc.trips])
    rounds, dropped, trips = acc.rounds, acc.dropped, acc.trips
    if entry.programs is None or entry.foreign:  # checked against the MoE reference
      kept[impl] = acc.kept
    for mode in s["modes"]:
      args = impl_args
      base = dict(
        level=level,
        impl=impl,
        E=E,
        routing=routing,
        mode=mode,
        T=size.T,
        D=size.D,
        F=size.F,
        K=size.K,
        dtype=size.dtype,
        weights_format=size.weights_format or size.dtype,
        **({"adapter_rank": size.adapter_rank} if size.adapter_rank else {}),
        mesh=mesh_name,
        devices=mesh.size,
        **({"expert_fsdp_axis": size.expert_fsdp_axis} if size.expert_fsdp_axis else {}),
        **({"shared_experts": size.num_shared_experts} if size.num_shared_experts else {}),
        **({"topology": tpu_topology} if tpu_topology else {}),
        **({"model": s["model"]} if s.get("model") else {}),
        **(
          {"placement": size.placement, "replicas": size.replicas}
          if size.placement != "none"
          else {}
        ),
        **(
          {
            "busiest_rows": int(device_rows.max()),
            "mean_rows": float(device_rows.mean()),
            "balancedness": float(device_rows.mean() / max(device_rows.max(), 1)),
          }
          if device_rows is not None
          else {}
        ),
        **bounds[mode],
      )
      passes = 1 if mode == "fwd" else 3
      if fns is None or (entry.foreign and tpu_topology):
        case_rows.append(dict(base, error=not_run or "not run: nothing to compile for a TPU"))
        bar.step(f"skipped {level} E={E} {routing} {impl} {mode}")
        if tpu_topology:
          bar.step(f"skipped {level} E={E} {routing} {impl} {mode}")
        continue
      if entry.foreign:  # timed with the others; its first call stands for a compile
        t0 = time.perf_counter()
        fns[mode](*args)
        row = dict(base, compile_s=time.perf_counter() - t0, rounds=None, dropped=0)
        row.update(routed_flops=case.routed_flops * passes)
        bar.step(f"ran {level} E={E} {routing} {impl} {mode}")
        timed.append((fns[mode], args, row))
        case_rows.append(row)
        continue
      t0 = time.perf_counter()
      try:
        program = fns[mode]
        if a.param_layout == "program" and args is case.args:
          program = progs.in_program_layout(program, args, 0 if level == "layer" else 1)
          base["param_layout"] = "program"
        compiled = program.lower(*args).compile()
      except Exception as err:
        case_rows.append(dict(base, error=row_facts.one_line(err)))
        bar.step(f"failed {level} E={E} {routing} {impl} {mode}")
        if tpu_topology:
          bar.step(f"skipped {level} E={E} {routing} {impl} {mode}")
        continue
      compile_s = time.perf_counter() - t0
      bar.step(f"compiled {level} E={E} {routing} {impl} {mode}")
      memory = measure.memory_bytes(compiled)  # of the whole program
      if branch is not case and tpu_topology:  # estimates: the branch that runs
        branch_fns, branch_args = progs.programs_and_args(branch, impl)
        compiled = branch_fns[mode].lower(*branch_args).compile()
      short = None if tpu_topology else row_facts.host_memory_short(compiled)
      if short:  # simulated devices share the host's memory: running would be killed
        case_rows.append(dict(base, error=short))
        continue
      executed, busiest, busiest_trips = row_facts.busiest_flops(compiled, trips)
      # Every device sends the same slots in every round: device 0's counts serve.
      coll = row_facts.counted(measure.collective_bytes, compiled, trips[0])
      approx = bool(coll.pop("loop_counted_once", False) or busiest.get("loop_counted_once"))
      if acc.sent_bytes and "ragged-all-to-all" in coll:  # sized at run time: the host's
        coll["ragged-all-to-all"]["wire_bytes"] = acc.sent_bytes[mode]
      wire = sum(c["wire_bytes"] for c in coll.values())
      passes_bytes = 1 if mode == "fwd" else 2  # forward, and the backward's reverse
      bound = case.bound_bytes * passes_bytes
      row = dict(
        base,
        compile_s=compile_s,
        routed_flops=case.routed_flops * passes,
        executed_flops=executed,
        flops_ratio=executed / (case.routed_flops * passes),
        wire_bytes=wire,
        bytes_over_bound=wire / bound if bound else None,
        bytes_over_routing_bound=(wire / (routing_bound * passes_bytes) if routing_bound else None),
        collectives={k: c["wire_bytes"] for k, c in coll.items()},
        temp_bytes=memory["temp"],
        argument_bytes=memory["argument"],
        output_bytes=memory["output"],
        rounds=rounds,
        dropped=dropped,
        **({"loop_counted_once": True} if approx else {}),
      )
      if held_params and entry.programs is None:  # the layer's own parameters
        row.update(
          param_bytes=held_params["bytes"],
          param_elems=held_params["elems"],
          expert_bytes=held_params["expert_bytes"],
        )
        if s.get("model_layers"):
          row["model_state_bytes"] = row_facts.model_state_bytes(held_params, s["model_layers"])
      if tpu_topology:
        from bench.reading import hbm

        chain = row_facts.counted(measure.dependent_collectives, compiled, trips[0])
        groups = row_facts.visited_groups(case)
        row.update(
          tpu.estimates(compiled, tpu_topology, busiest_trips, wire, dependent=chain, groups=groups)
        )
        if a.hbm_table:
          row["hbm_table"] = hbm.table(compiled, busiest_trips, top=a.hbm_table, groups=groups)
        bar.step(f"estimated {level} E={E} {routing} {impl} {mode}")
      else:
        timed.append((compiled, args, row))
      case_rows.append(row)
