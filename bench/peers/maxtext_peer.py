"""MaxText's RoutedMoE as a peer of the layer, compiled for a TPU topology (nothing runs).

    PYTHONPATH=.tpu-libs /tmp/mtvenv/bin/python -m bench.maxtext_peer --tpu v5e:2x4 -E 8,64 \\
      --out bench/results/tpu_v5e_2x4_maxtext

compiles `maxtext.layers.moe.RoutedMoE` (MaxText 0.2.5) on the case of `python -m bench --tpu
v5e:2x4 -E 8,64 --levels layer --modes fwd,fwd_bwd` (T=32768 tokens in all, D=2048, F=4096,
K=2, bfloat16, SwiGLU experts, softmax top-k router, all chips on expert parallelism) and
measures each program with the benchmark's own functions (`bench.reading.measure.executed_flops` and
`collective_bytes`, `bench.reading.tpu.estimates`: the one count), so its rows read
like the benchmark's. The same command compiles the benchmark's dense limit
(`bench.cases.baselines.dense_limit`) on the same topology and sets each row's efficiency from it.

The MaxText paths (`PATHS`; each a set of MaxText config fields):

  * maxtext_capacity: `sparse_matmul=False, capacity_factor=1.25`, its `dense_matmul`: one-hot
    dispatch and combine einsums per sequence (GShard-style), tokens past an expert's
    capacity in their sequence dropped. With pure expert parallelism MaxText's logical rules
    put "expert" on both the expert and the batch dimension of the dispatched tokens; XLA
    then gathers the expert weights to every chip (FSDP-style) instead of moving tokens.
  * maxtext_capacity_a2a: the same with `moe_dispatch_no_expert_sharding=True`, MaxText's
    switch that takes "expert" off the batch dimension so that tokens move (all-to-all).
  * maxtext_megablox: `sparse_matmul=True, megablox=True`, dropless: sort, ragged all-to-all,
    megablox grouped matmuls; the receive buffer sized for the worst case
    (`ragged_buffer_factor=-1`: every token of the expert-parallel group on one device).
  * maxtext_megablox_rbf1.25: the same with `ragged_buffer_factor=1.25`: a receive buffer
    1.25 times the balanced load; items past it are dropped.

megablox's kernels declare their FLOPs and bytes over their whole row buffer, whatever the
group sizes: with the worst-case buffer, min(N, E / K) times the balanced load (4x at E=8,
8x at E=64 on 8 chips). The rows count what their grids visit instead, as the benchmark's
own kernels (`bench.reading.hbm`): the row tiles of the groups the case's uniform routing
fills on the busiest chip (`bench.command.rows.visited_groups`) and the matrices of the
non-empty groups.

Every path also sets: `num_experts=E, num_experts_per_tok=K, base_emb_dim=D,
base_mlp_dim=base_moe_mlp_dim=F, dtype=weight_dtype=bfloat16, float32_gate_logits=True,
per_device_batch_size=1, max_target_length=T/N, ici_expert_parallelism=N,
ici_fsdp_parallelism=1` (N chips); the rest are MaxText's defaults (`configs/base.yml`:
`mlp_activations=[silu, linear]`, top-k on the logits then a softmax over the k,
no load-balance loss). The input is [N, T/N, D] (one sequence per chip), sharded by MaxText's
logical axis rules (batch over "expert"), as the benchmark's x [N, T/N, D] is over its mesh;
parameters take MaxText's shardings (experts over "expert"). The mesh is MaxText's
(`maxtext_utils.create_device_mesh`) over the topology's devices (`bench.reading.tpu.devices`).
fwd is the layer's output; fwd_bwd is `jax.vjp` of the output with a cotangent dy,
gradients for the parameters and x, as `bench/cases/programs.py` does for the layer (without its
auxiliary loss, which this MaxText config does not compute).

Columns: as `python -m bench --tpu` (see `python -m bench --help`). dropped: (token, slot)
items the path drops under the benchmark's uniform routing of this case (the routing its own
rows are counted with, computed on the host: `capacity_drops`, `buffer_drops`); MaxText's
compiled program routes with its own router. The ragged all-to-all's wire bytes are the
routing's (`bench.reading.accounting.routing_bound_bytes`), as the benchmark counts its own
ragged_all_to_all. Every time is an estimate.

The environment. MaxText needs Python 3.12 and pins jax>=0.11.1; the rows here are compiled
with the project's jax 0.10.2 and libtpu (the same compiler as the benchmark's rows), and
MaxText's dependencies are installed one by one with `--no-deps`, only those its MoE module
imports:

    /root/.pyenv/versions/3.12.1/bin/python -m venv /tmp/mtvenv
    /tmp/mtvenv/bin/pip install jax==0.10.2 jaxlib==0.10.2 flax==0.12.8
    /tmp/mtvenv/bin/pip install --no-deps maxtext==0.2.5 aqtp==0.9.0 qwix==0.1.8 \\
      tokamax==0.0.17 jinja2==3.1.6 markupsafe==3.0.4 packaging==26.4 pathwaysutils==0.1.13 \\
      fastapi==0.165.0 starlette==1.10.0 annotated-doc==0.0.7 anyio==4.16.0 \\
      pydantic==2.14.4 pydantic-core==2.50.5 typing-inspection==0.4.5 annotated-types==0.8.0 \\
      opentelemetry-api==1.45.2 requests==2.34.2 urllib3==2.8.0 idna==3.20 \\
      certifi==2026.10.19.post1 uvicorn==0.54.0 click==8.5.1 immutabledict==4.3.1 \\
      xprof==2.24.2 fire==0.7.1 termcolor==3.3.0 six==1.17.0 jaxtyping==0.3.11 einshape==1.0 \\
      tqdm==4.70.1 omegaconf==2.4.0 huggingface-hub==2.4.0 transformers==5.24.0 \\
      regex==2026.11.19 httpx2==2.16.2 filelock==4.3.1 httpcore2==2.16.2 truststore==0.10.5 \\
      h11==0.16.0 safetensors==0.8.0 grain==0.2.18 cloudpickle==3.1.3 portpicker==1.6.0 \\
      array-record==0.8.6 drjax==0.2.1 wadler-lindig==0.1.8 pillow==13.0.0 einops==0.8.2
    /tmp/mtvenv/bin/pip install --no-deps -e .
    /tmp/mtvenv/bin/python tests/install_tpu_libs.py   # libtpu into .tpu-libs/

Run from the repository root (the `bench` package is not installed). One name MaxText 0.2.5
imports is missing from jax 0.10.2, `jax.experimental.xla_metadata.must_fuse_call`, used only
by MaxText's flash-attention kernel: `_jax_compat` puts a stand-in there that raises if
called, before MaxText is imported.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

from bench.peers.maxtext_layer import (
  DENSE_LIMIT,
  PATHS,
  SUMMARIES,
  _jax_compat,
  dropped,
  maxtext_config,
  maxtext_programs,
)


def measure(compiled, base, case, topology, hbm_top=0):
  """A row of `compiled` as `bench.command.run.run` makes one for a TPU topology.

  Args:
    compiled: the program compiled for `topology`.
    base: the row's identifying fields (impl, E, mode, ...).
    case: the benchmark's `Case` of these sizes (routed FLOPs, byte bounds, routing).
    topology: e.g. "v5e:2x4".
    hbm_top: rows of the HBM table to keep (default 0: none).

  Returns:
    dict: the row.
  """
  from bench.command import rows as row_facts
  from bench.reading import accounting, hbm, measure, tpu

  mode = base["mode"]
  passes, passes_bytes = (1, 1) if mode == "fwd" else (3, 2)
  trips = [{} for _ in range(case.mesh.size)]  # no loop with a data-dependent trip count
  executed, busiest, busiest_trips = row_facts.busiest_flops(compiled, trips)
  coll = row_facts.counted(measure.collective_bytes, compiled, trips[0])
  approx = bool(coll.pop("loop_counted_once", False) or busiest.get("loop_counted_once"))
  routing_bound = accounting.routing_bound_bytes(case)
  if "ragged-all-to-all" in coll:  # sized at run time: the routing's bytes
    coll["ragged-all-to-all"]["wire_bytes"] = int(routing_bound * passes_bytes)
  wire = sum(c["wire_bytes"] for c in coll.values())
  memory = measure.memory_bytes(compiled)
  row = dict(
    base,
    routed_flops=case.routed_flops * passes,
    executed_flops=executed,
    flops_ratio=executed / (case.routed_flops * passes),
    wire_bytes=wire,
    bytes_over_bound=wire / (case.bound_bytes * passes_bytes),
    bytes_over_routing_bound=wire / (routing_bound * passes_bytes),
    collectives={k: c["wire_bytes"] for k, c in coll.items()},
    temp_bytes=memory["temp"],
    argument_bytes=memory["argument"],
    output_bytes=memory["output"],
    rounds=None,
    **({"loop_counted_once": True} if approx else {}),
  )
  groups = row_facts.visited_groups(case)  # megablox's groups: the local experts
  row.update(tpu.estimates(compiled, topology, busiest_trips, wire, groups=groups))
  if hbm_top:
    row["hbm_table"] = hbm.table(compiled, busiest_trips, top=hbm_top, groups=groups)
  return row


def _compile(fn, args, enter=None):
  """(compiled, seconds, error line or None) of `jax.jit(fn)` on `args`."""
  import contextlib

  import jax

  from bench.command import rows as row_facts

  t0 = time.perf_counter()
  try:
    with enter() if enter else contextlib.nullcontext():
      compiled = jax.jit(fn).lower(*args).compile()
  except Exception as err:
    return None, time.perf_counter() - t0, row_facts.one_line(err)
  return compiled, time.perf_counter() - t0, None


def parser():
  p = argparse.ArgumentParser(
    prog="python -m bench.maxtext_peer", description=__doc__.split("\n")[0]
  )
  p.add_argument("--tpu", default="v5e:2x4", help="topology compiled for (default: %(default)s)")
  p.add_argument("-E", "--experts", default="8,64", help="comma-separated (default: %(default)s)")
  p.add_argument("-T", "--tokens", type=int, default=32768, help="in all (default: %(default)s)")
  p.add_argument("-D", "--d-model", type=int, default=2048, help="(default: %(default)s)")
  p.add_argument("-F", "--d-ff", type=int, default=4096, help="per expert (default: %(default)s)")
  p.add_argument("-K", "--top-k", type=int, default=2, help="(default: %(default)s)")
  p.add_argument("--modes", default="fwd,fwd_bwd", help="(default: %(default)s)")
  p.add_argument(
    "--paths",
    default=",".join(PATHS),
    help="MaxText paths, comma-separated (default: %(default)s)",
  )
  p.add_argument("--no-dense-limit", action="store_true", help="skip the dense limit rows")
  p.add_argument("--hbm-table", type=int, default=0, metavar="N", help="top N HBM ops per row")
  p.add_argument("--out", help="write OUT.json and OUT.md")
  return p


def main(argv=None):
  argv = sys.argv[1:] if argv is None else list(argv)
  a = parser().parse_args(argv)
  experts = [int(e) for e in a.experts.split(",")]
  modes = a.modes.split(",")
  paths = a.paths.split(",")
  unknown = [p for p in paths if p not in PATHS] + [m for m in modes if m not in ("fwd", "fwd_bwd")]
  if unknown:
    print(f"python -m bench.maxtext_peer: error: unknown {', '.join(unknown)}", file=sys.stderr)
    return 2
  # Compile only: JAX stays on the CPU backend, libtpu only compiles.
  os.environ.setdefault("JAX_PLATFORMS", "cpu")
  os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
  _jax_compat()
  import importlib.metadata

  from bench.cases import build, common
  from bench.cases import programs as progs
  from bench.command import rows as row_facts
  from bench.command import run
  from bench.reading import tpu
  from bench.reports import report

  devices = tpu.devices(a.tpu)
  N = len(devices)
  mesh = run.make_mesh(None, devices)
  size = build.Size(T=a.tokens, D=a.d_model, F=a.d_ff, K=a.top_k, dtype="bfloat16")
  rows = []
  for E in experts:
    case = build.make_case("layer", E, "uniform", size, mesh, abstract=True)
    case_rows = []
    common_fields = dict(
      level="layer",
      E=E,
      routing="uniform",
      T=size.T,
      D=size.D,
      F=size.F,
      K=size.K,
      dtype=size.dtype,
      devices=N,
      topology=a.tpu,
    )
    jobs = [] if a.no_dense_limit else [DENSE_LIMIT]
    for name in jobs + paths:
      if name == DENSE_LIMIT:
        fns, args = progs.programs_and_args(case, DENSE_LIMIT)
        enter, stored, drops, label = None, None, 0, run.mesh_label(mesh)
      else:
        fields = maxtext_config(name, E, size.T, size.D, size.F, size.K, N)
        fns, args, params, enter = maxtext_programs(fields, devices)
        stored = row_facts.param_bytes(params)
        drops = dropped(name, case.experts_TK, E, N)
        label = f"expert={N}"
      for mode in modes:
        base = dict(common_fields, impl=name, mode=mode, mesh=label)
        compiled, seconds, error = _compile(fns[mode], args, enter)
        if error:
          case_rows.append(dict(base, error=error))
          print(f"{name} E={E} {mode}: did not compile: {error}", flush=True)
          continue
        row = measure(compiled, dict(base, compile_s=seconds), case, a.tpu, a.hbm_table)
        row["dropped"] = drops
        if stored:
          row.update(param_bytes=stored["bytes"], param_elems=stored["elems"])
        case_rows.append(row)
        print(
          f"{name} E={E} {mode}: estimate {row.get('estimate_s', 0) * 1e3:.2f} ms, "
          f"compiled in {seconds:.0f} s",
          flush=True,
        )
    row_facts.efficiency(case_rows)
    rows += case_rows
  print()
  print(report.table(rows))
  if a.out:
    info = dict(
      common.machine_info(),
      malloc="system default (compile only: nothing runs)",
      maxtext=importlib.metadata.version("maxtext"),
      libtpu=importlib.metadata.version("libtpu"),
    )
    command = ["python", "-m", "bench.maxtext_peer", *argv]
    settings = dict(
      tokens=[size.T],
      d_model=size.D,
      d_ff=size.F,
      top_k=size.K,
      experts=experts,
      modes=modes,
      dtype=size.dtype,
      paths={p: maxtext_config(p, experts[0], size.T, size.D, size.F, size.K, N) for p in paths},
    )
    os.makedirs(os.path.dirname(a.out) or ".", exist_ok=True)
    with open(a.out + ".json", "w") as f:
      json.dump(
        {"machine": info, "argv": command, "settings": settings, "rows": rows},
        f,
        indent=1,
        default=str,
      )
    with open(a.out + ".md", "w") as f:
      f.write(markdown(rows, info, command, settings))
    print("wrote", a.out + ".json", a.out + ".md")
  return 0


def markdown(rows, info, command, settings):
  """The results file: the command, what was compiled, the rows (`bench.reports.report.table`)."""
  from bench.reports import report

  r0 = rows[0]
  fields = "\n".join(
    f"- {p}: {SUMMARIES[p]} ("
    + ", ".join(f"`{k}={v}`" for k, v in f.items() if k in PATHS[p])
    + ")"
    for p, f in settings["paths"].items()
  )
  own = set().union(*PATHS.values())
  case = next(iter(settings["paths"].values()))
  shared = ", ".join(
    f"`{k}={'E' if k == 'num_experts' else v}`" for k, v in case.items() if k not in own
  )
  return (
    f"# MaxText RoutedMoE against the dense limit\n\n"
    f"`PYTHONPATH=.tpu-libs {' '.join(command)}` (python: the Python 3.12 environment with "
    "MaxText that `bench/peers/maxtext_peer.py` describes)\n\n"
    f"T={r0['T']} tokens in all, D={r0['D']}, F={r0['F']}, K={r0['K']}, {r0['dtype']}, "
    f"compiled for TPU {r0['topology']} on this machine: every time is an estimate, nothing "
    f"ran. MaxText {info['maxtext']} (`maxtext.layers.moe.RoutedMoE`), JAX {info['jax']}, "
    f"libtpu {info['libtpu']}; machine: {info['cpu']}, {info['cores']} cores, load average "
    f"{info['load_average_1min']:.1f} at start. Counted with the benchmark's functions, as "
    "`python -m bench --tpu` counts its rows; see `python -m bench --help` for the columns. "
    "mesh expert=N: MaxText's mesh, every axis but expert of size 1; 8x1: the benchmark's "
    "(expert x data), for the dense limit.\n\n"
    f"MaxText config fields set, every path: {shared}; per path:\n\n{fields}\n\n"
    "dropped: items the path drops under the benchmark's uniform routing of the case (a host "
    "count; the compiled program routes with MaxText's router). efficiency: the dense "
    "limit's roofline over the row's.\n\n## Every row\n\n"
    + report.table(rows)
    + ("\n## Memory per device\n\n" + report.memory_section(rows))
    + report.hbm_sections(rows)
  )


if __name__ == "__main__":
  sys.exit(main())
