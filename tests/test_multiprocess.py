"""Expert parallelism across processes: 2 processes x 4 CPU devices, gloo collectives.

Each test starts two `tests/mp_worker.py` processes on localhost, joined by
`jax.distributed` through `bench/command/distributed.py`. One test compares their `moe_layer`
forward and backward, in each of `mp_worker.CONFIGS` (all_to_all and all_gather, Auto and
Explicit meshes, capacity mode), with the same computation in this process (8 simulated
devices) and with the float64 layer model of `layer_oracle.py`; the
others make one process die and check that the survivor stops, with a clear message, in
bounded time.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import jax
import layer_oracle
import mp_worker
import numpy as np
import pytest
from cases import assert_close

TESTS = Path(__file__).resolve().parent
TIMEOUT_S = 120  # a whole job: start, connect, compile, run
HEARTBEAT_S = 10  # a process without heartbeats for this long counts as dead
STOP_S = 60  # the survivor must be gone this long after the other process died
FATAL = "JAX distributed service detected fatal errors"


def _free_port():
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


@contextlib.contextmanager
def _workers(tmp_path, *flags, command=None):
  """Starts the two workers, each in its own process group; kills what is left on exit.

  `command(i)` gives process i's command line before the process-layout flags (default:
  `mp_worker.py --out results.npz` and `flags`)."""
  env = dict(
    os.environ,
    XLA_FLAGS="--xla_force_host_platform_device_count=4",
    JAX_PLATFORMS="cpu",
    PYTHONPATH=os.pathsep.join(
      filter(None, [str(TESTS.parent), str(TESTS), os.environ.get("PYTHONPATH")])
    ),
  )
  for name in ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID"):
    env.pop(name, None)
  port = _free_port()
  procs = []
  try:
    for i in range(2):
      with open(tmp_path / f"out{i}.txt", "w") as out, open(tmp_path / f"err{i}.txt", "w") as err:
        argv = (
          command(i)
          if command
          else [
            sys.executable,
            str(TESTS / "mp_worker.py"),
            "--out",
            str(tmp_path / "results.npz"),
            *flags,
          ]
        )
        procs.append(
          subprocess.Popen(
            [
              *argv,
              "--num-processes",
              "2",
              "--process-id",
              str(i),
              "--coordinator",
              f"127.0.0.1:{port}",
            ],
            env=env,
            stdout=out,
            stderr=err,
            start_new_session=True,
            cwd=TESTS.parent,
          )
        )
    yield procs
  finally:
    for p in procs:
      if p.poll() is None:  # not yet reaped, so its pid (and group id) is still its own
        os.killpg(p.pid, signal.SIGKILL)
        p.wait()


def _wait(procs, timeout_s):
  """Waits for every process; returns [(exit code or None if still running, exit time)]."""
  deadline = time.monotonic() + timeout_s
  ends = [None] * len(procs)
  while None in ends and time.monotonic() < deadline:
    for i, p in enumerate(procs):
      if ends[i] is None and p.poll() is not None:
        ends[i] = time.monotonic()
    time.sleep(0.1)
  return [(p.poll(), end) for p, end in zip(procs, ends)]


def _log(tmp_path, i, stream="err", lines=30):
  text = (tmp_path / f"{stream}{i}.txt").read_text(errors="replace")
  return f"--- worker {i} std{stream} (last {lines} lines) ---\n" + "\n".join(
    text.splitlines()[-lines:]
  )


def _max_error(got, want):
  """max |got - want| relative to max(1, max |want|): the scale `assert_close`'s atol uses."""
  want = np.asarray(want, np.float64)
  return float(
    np.max(np.abs(np.asarray(got, np.float64) - want)) / max(1.0, float(np.max(np.abs(want))))
  )


def test_two_processes_match_one_process(tmp_path):
  # Every config of `mp_worker.CONFIGS`, forward and backward, on 2 processes x 4 devices:
  # equal to the same step in this process (8 devices), and the outputs and aux equal to
  # the float64 layer model (the one-process gradients are checked against its finite
  # differences in test_layer_oracle.py).
  with _workers(tmp_path) as procs:
    # While the workers start and compile: the same steps here, on one process's 8 devices.
    want = {}
    for name in mp_worker.CONFIGS:
      want.update(jax.device_get(mp_worker.run(name)))
    exits = _wait(procs, TIMEOUT_S)
  for i, (code, _) in enumerate(exits):
    assert code == 0, f"worker {i} exit code {code}\n{_log(tmp_path, i)}"
  with np.load(tmp_path / "results.npz") as f:
    got = dict(f)
  assert sorted(got) == sorted(want)
  params, x_BSD, _ = mp_worker.case()
  errors = {}
  for name, w in want.items():
    assert got[name].shape == w.shape, name
    if name.endswith("/place"):
      np.testing.assert_array_equal(got[name], x_BSD, err_msg=name)
    elif np.issubdtype(w.dtype, np.integer):  # expert_load, rounds, dropped counts
      np.testing.assert_array_equal(got[name], w, err_msg=name)
    else:
      errors[name] = _max_error(got[name], w)
      assert_close(got[name], w, np.float32, err_msg=name)
  # The float64 model, from the same NumPy case; its top-k must be that of float32 logits.
  assert (
    layer_oracle.routing_margin(
      x_BSD.reshape(-1, x_BSD.shape[-1]), params.router_DE, mp_worker.CFG.top_k
    )
    > 1e-4
  )
  for name, (cfg, _, _) in mp_worker.CONFIGS.items():
    y, aux = layer_oracle.layer(params, x_BSD, cfg)
    errors[f"{name}/y vs float64 model"] = _max_error(got[f"{name}/y"], y)
    assert_close(got[f"{name}/y"], y, np.float32, err_msg=f"{name}/y vs model")
    for key in ("aux_loss", "load_balance_loss", "z_loss"):
      assert_close(got[f"{name}/aux/{key}"], aux[key], np.float32, err_msg=f"{name} {key}")
    for key in ("expert_load", "dropped_items", "dropped_tokens"):
      np.testing.assert_array_equal(got[f"{name}/aux/{key}"], aux[key], err_msg=f"{name} {key}")
    if cfg.capacity_factor is not None:
      # Drops on both processes' tokens, whole tokens among them: the global order counts.
      dropped_T = np.all(aux["experts_TK"] < 0, axis=1)
      half = len(dropped_T) // 2
      assert aux["dropped_items"] > 0 and dropped_T[half:].any(), aux["dropped_items"]
  for name in mp_worker.CONFIGS:  # shown with `pytest -s`
    mine = {k: v for k, v in errors.items() if k.startswith(name + "/") and "model" not in k}
    print(
      f"{name}: max error vs one process {max(mine.values()):.1e} over {len(mine)} "
      f"arrays (y, aux losses, dx, every dparam); y vs float64 model "
      f"{errors[f'{name}/y vs float64 model']:.1e}; dropped items "
      f"{int(got[f'{name}/aux/dropped_items'])}, tokens {int(got[f'{name}/aux/dropped_tokens'])}"
    )


@pytest.mark.parametrize("die, dying", [("during", 1), ("after_init", 0)])
def test_dead_process_stops_the_other(tmp_path, die, dying):
  # Process 1 dying is seen by the coordination service (in process 0) when its heartbeats
  # stop; process 0 (the coordinator) dying, by process 1 when it loses the connection.
  with _workers(
    tmp_path, "--die", die, "--dying", str(dying), "--heartbeat", str(HEARTBEAT_S)
  ) as procs:
    exits = _wait(procs, TIMEOUT_S)
  (dead_code, died), (code, stopped) = exits[dying], exits[1 - dying]
  survivor = 1 - dying
  assert dead_code == 1, f"dying worker exit code {dead_code}\n{_log(tmp_path, dying)}"
  assert code is not None, f"survivor still running after {TIMEOUT_S} s"
  assert code != 0, _log(tmp_path, survivor)
  assert stopped - died < STOP_S, f"survivor stopped {stopped - died:.0f} s after the death"
  assert FATAL in (tmp_path / f"err{survivor}.txt").read_text(errors="replace"), _log(
    tmp_path, survivor
  )
  assert not (tmp_path / "results.npz").exists()


def test_benchmark_cli_across_processes(tmp_path):
  """`python -m bench` on 2 processes x 4 devices: one 8-device mesh, process 0 reports."""

  def command(i):
    return [
      sys.executable,
      "-m",
      "bench",
      "-T",
      "256",
      "-D",
      "16",
      "-F",
      "32",
      "-E",
      "8",
      "--levels",
      "kernel",
      "--impls",
      "all_to_all,jit_gshard_einsum",
      "--modes",
      "fwd",
      "--repeats",
      "1",
      "--out",
      str(tmp_path / f"process{i}"),
    ]

  with _workers(tmp_path, command=command) as procs:
    exits = _wait(procs, TIMEOUT_S)
  for i, (code, _) in enumerate(exits):
    assert code == 0, f"process {i} exit code {code}\n{_log(tmp_path, i)}"
  out0 = (tmp_path / "out0.txt").read_text()
  assert "8 cpu devices, 2 process(es)" in out0 and "| all_to_all |" in out0
  out1 = (tmp_path / "out1.txt").read_text()  # gloo itself may print "[Gloo] ..." lines
  assert "moe_shard benchmark" not in out1 and "|" not in out1  # only process 0 prints ...
  assert not list(tmp_path.glob("process1.*"))  # ... and writes
  rows = json.loads((tmp_path / "process0.json").read_text())["rows"]
  a2a = next(r for r in rows if r["impl"] == "all_to_all")
  assert a2a["devices"] == 8 and a2a["rounds"] >= 1 and a2a["wire_bytes"] > 0


def test_hf_load_reads_only_each_process_experts(tmp_path):
  """`hf.load_moe_layers` on 2 processes: each reads its own experts' rows and the router;
  `hf.save_moe_layers` of those leaves, which no process holds whole, raises."""
  import hf_checkpoints

  from moe_shard import hf

  ckpt = tmp_path / "ckpt"
  _, tensors = hf_checkpoints.write(ckpt, "mixtral", files=2)
  experts = sum(a.nbytes for k, a in tensors.items() if ".experts." in k)
  router = sum(a.nbytes for k, a in tensors.items() if k.endswith("block_sparse_moe.gate.weight"))

  def command(i):
    return [
      sys.executable,
      str(TESTS / "hf_mp_worker.py"),
      "--path",
      str(ckpt),
      "--out",
      str(tmp_path / "hf"),
    ]

  with _workers(tmp_path, command=command) as procs:
    _, want = hf.load_moe_layers(ckpt)
    exits = _wait(procs, TIMEOUT_S)
  for i, (code, _) in enumerate(exits):
    assert code == 0, f"worker {i} exit code {code}\n{_log(tmp_path, i)}"
  for i in range(2):
    got = json.loads((tmp_path / f"hf.{i}.json").read_text())
    read = got["bytes_read"]
    error = got["save_error"] or ""
    assert error.startswith("save_moe_layers: params.") and "must be fully addressable" in error
    # Half of the experts (the process's 2 of the expert axis's 4 devices) and the router.
    assert read == experts // 2 + router, (i, read, experts, router)
    assert read <= 0.6 * experts
  with np.load(tmp_path / "hf.npz") as got:
    for p, w in jax.tree_util.tree_leaves_with_path(want):
      np.testing.assert_array_equal(got[jax.tree_util.keystr(p, simple=True, separator=".")], w)
