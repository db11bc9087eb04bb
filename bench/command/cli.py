"""moe_shard benchmark: shard_map MoE against jit-only versions, on the devices found.

    python -m bench                    # default: the layer at T=8192, D=512, F=1024, K=2, E=8
    python -m bench --quick            # small sizes, about a minute
    python -m bench --sweep            # levels x E in {8, 64} x four routing skews, smaller
    python -m bench --tpu v5e:2x4      # compile for a TPU slice here: estimates, not runs

Every implementation of a case gets the same sharded inputs (tokens over every mesh axis,
expert weights over "expert"); see `bench/cases/programs.py`. On a CPU-only machine JAX is given
`--devices` (default 8) simulated CPU devices. Each row (case x impl x mode):

  time: median (min, max) wall seconds over up to --repeats runs after a warm-up, all
    programs of a case timed in turns (a program leaves the turns once 3 or more of its runs,
    the slowest aside, are within 10% of their median; `runs` in the results); compile
    seconds separately.
  GFLOP/s: routed FLOPs / median time. flops x: FLOPs executed, summed over devices (read
    from the compiled HLO, loop bodies times their trip counts), over the routed FLOPs.
  MiB/dev, x bound: collective bytes each device sends (from the HLO, loops scaled) and
    their ratio to the cost model's lower bound T_dev*K*(N-1)/N*(D + F_out)*bytes (x2 for
    forward+backward).
  temp MiB: temp memory per device (`memory_analysis()`).
  Timed on CPU with glibc's malloc set to reuse freed memory (`bench/command/malloc.py`; XLA:CPU
    allocates a program's temporaries on each call, and fresh pages fault on first touch);
    --system-malloc keeps glibc's defaults. The results file records which.
  --tpu only: estimate = the one count (`bench/reading/estimate.py`): the sum over the
    program's ops (loop bodies times their trip counts) of each op's larger of FLOPs over
    peak and HBM bytes over bandwidth, plus the ICI time the compiled schedule leaves
    exposed (`bench/reading/schedule.py`: a synchronous collective covers nothing; an async
    one is covered by the ops scheduled between its start and done). HBM bytes: the one
    model (`bench/reading/hbm.py`: in-place updates by their slice, VMEM prefetches once,
    grouped matmuls at the tiles their grids visit under the case's routing); XLA's
    "bytes accessed" (loop bodies once) beside it for reference. lower bound =
    max(compute, HBM, ICI) by the same counts. The collectives' latency (`latency_s`): the
    longest chain of collectives that wait on each other (`dependent_collectives`) times a
    published fixed cost per collective (1 us per ICI hop between the slice's farthest
    chips, `moe_shard.chips`), which the estimate leaves out.
  bound ms (estimate/bound, that plus the latency over it; or time/bound): `bench/reading/bound.py`, per device, the larger of the
    bytes read and written at the least (the parameters as stored, the routed experts' only
    for those the routing is expected to touch, and the activations) over HBM bandwidth and
    the routed FLOPs over peak, where the chip's peaks are cited (TPU); rows elsewhere carry
    bound_bytes and bound_flops only. --preset NAME: a published model's layer
    (`bench/cases/models.py`).
  rounds: all_to_all dispatch rounds; dropped: (token, slot) items the capacity-factor
    baseline drops (the others are dropless).
  rel err (max abs): the forward against a NumPy reference of the same inputs and host
    routing (float32, float64 sums): ||y - ref|| / ||ref|| over the whole output, and in
    brackets max |y - ref|, which one token routed otherwise (a near tie of its router
    logits, TF32 on a GPU) makes O(|y|) (`rows.errors`).
  dense_limit, matmul_limit: the routed FLOPs as dense matmuls per device, no dispatch
    (`bench/cases/baselines.py`): the first with the layer's SwiGLU and float32 router (eff. is
    its time over each row's), the second the matmuls alone in the case's dtype.
  auto: the library's default dispatch on the mesh; torch_moe: a torchtitan-style PyTorch
    layer on one CUDA device (`bench/peers/torch_peer.py`), elsewhere "not run" with the reason.
  weights: with --weights-format, the routed experts' matrices as held: the case's dtype, or
    int8, fp8 or mxfp4 (`ms.QuantizedArray`; rel err against the dequantized values). Rows
    that take float matrices only (jit_gshard_einsum, dense_limit, matmul_limit, torch_moe)
    run for the float format only.
  Memory per device (layer level): the layer's parameters as stored (their shardings: a
    tensor axis in --mesh splits each expert's F, --fsdp its D), the program's arguments
    and temp, the routed experts' matrices as held (experts MiB, with quantized rows); with
    --model-layers L, the weights, gradients and Adam state of L layers (none of either for
    quantized matrices: frozen).
"""

from __future__ import annotations

import json
import os
import sys

from bench.command import malloc
from bench.command.checks import UsageError, settings
from bench.command.flags import parser
from bench.command.run import ask_for_devices, backend_started, make_mesh, mesh_label, run
from bench.reports import files as result_files
from bench.reports import report


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
      raise UsageError('--plot needs matplotlib: pip install -e ".[bench]"') from None
  if a.from_json:
    files = []
    for path in a.from_json.split(","):
      try:
        with open(path) as f:
          files.append(json.load(f))
        files[-1]["rows"]
      except (OSError, ValueError, KeyError, TypeError) as err:
        raise UsageError(f"--from-json {path}: not a results file ({err!r})") from None
    saved = files[0]
    rows = [r for f in files for r in f["rows"]]
    if len(files) > 1:  # merged: every file's command
      saved["argv"] = [w for f in files for w in report.argvs(f["argv"])]
    print(report.headline(rows))
    print(report.table(rows))
    a.json = None  # the file itself stays as it was
    for path in result_files.write(
      rows, saved["machine"], saved["argv"], saved.get("settings", s), a
    ):
      print("wrote", path)
    return 0
  if a.tpu and not backend_started():
    # Compile only: no TPU is opened, so libtpu's one-process lock is not needed.
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
  # Before JAX starts its threads: timed programs reuse freed memory (`bench/command/malloc.py`).
  allocator = (
    malloc.SYSTEM + " (--system-malloc)"
    if a.system_malloc
    else malloc.SYSTEM + " (--tpu: nothing runs)"
    if a.tpu
    else malloc.reuse_freed_memory()
  )
  ask_for_devices(a.devices, a.num_processes)
  from bench.command import distributed

  try:
    distributed.initialize(a)
  except ValueError as err:
    raise UsageError(str(err)) from None
  import jax

  from bench.cases import common
  from bench.reading import tpu

  leader = distributed.is_leader()
  if a.tpu:
    try:
      devices = tpu.devices(a.tpu)
    except ValueError as err:
      raise UsageError(str(err)) from None
  else:
    devices = jax.devices()
  mesh = make_mesh(a.mesh, devices)
  info = dict(common.machine_info(), malloc=allocator)
  full = ["python", "-m", "bench", *argv]
  if leader:
    where = (
      f"TPU {a.tpu} (compile only)"
      if a.tpu
      else (f"{len(devices)} {jax.default_backend()} devices, {jax.process_count()} process(es)")
    )
    print(
      f"moe_shard benchmark ({s.get('model') or s['preset']}): T={s['tokens']} D={s['d_model']} "
      f"F={s['d_ff']} K={s['top_k']} E={s['experts']} {s['dtype']} on {where}, mesh "
      f"{mesh_label(mesh)}" + (f", fsdp over {a.fsdp}" if a.fsdp else ""),
      flush=True,
    )
  progress = leader and not a.no_progress
  rows = run(s, a, mesh, progress, tpu_topology=a.tpu)
  if leader:
    print()
    print(report.headline(rows))
    print(report.table(rows))
    print(report.memory_section(rows))
    print(report.hbm_sections(rows))
    for path in result_files.write(rows, info, full, s, a):
      print("wrote", path)
  return 0


if __name__ == "__main__":
  sys.exit(main())
