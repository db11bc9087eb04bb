"""Expert parallelism across processes: 2 processes x 4 CPU devices, gloo collectives.

Each test starts two `tests/mp_worker.py` processes on localhost, joined by
`jax.distributed` through `bench/distributed.py`. One test compares their `moe_layer`
forward and backward with the same computation in this process (8 simulated devices); the
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
import numpy as np
import pytest

import mp_worker
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
  env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=4",
             JAX_PLATFORMS="cpu",
             PYTHONPATH=os.pathsep.join(filter(None, [str(TESTS.parent), str(TESTS),
                                                      os.environ.get("PYTHONPATH")])))
  for name in ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID"):
    env.pop(name, None)
  port = _free_port()
  procs = []
  try:
    for i in range(2):
      with open(tmp_path / f"out{i}.txt", "w") as out, open(tmp_path / f"err{i}.txt", "w") as err:
        argv = command(i) if command else [
            sys.executable, str(TESTS / "mp_worker.py"), "--out",
            str(tmp_path / "results.npz"), *flags]
        procs.append(subprocess.Popen(
            [*argv, "--num-processes", "2", "--process-id", str(i),
             "--coordinator", f"127.0.0.1:{port}"],
            env=env, stdout=out, stderr=err, start_new_session=True, cwd=TESTS.parent))
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
      text.splitlines()[-lines:])


def test_two_processes_match_one_process(tmp_path):
  with _workers(tmp_path) as procs:
    # While the workers start and compile: the same steps here, on one process's 8 devices.
    want = {}
    for shape in mp_worker.MESHES:
      want.update(jax.device_get(mp_worker.run(mp_worker.make_mesh(shape))))
    exits = _wait(procs, TIMEOUT_S)
  for i, (code, _) in enumerate(exits):
    assert code == 0, f"worker {i} exit code {code}\n{_log(tmp_path, i)}"
  with np.load(tmp_path / "results.npz") as f:
    got = dict(f)
  assert sorted(got) == sorted(want)
  x_BSD = mp_worker.case()[1]
  for name, w in want.items():
    assert got[name].shape == w.shape, name
    if name.endswith("/place"):
      np.testing.assert_array_equal(got[name], x_BSD, err_msg=name)
    elif np.issubdtype(w.dtype, np.integer):  # expert_load, rounds, dropped counts
      np.testing.assert_array_equal(got[name], w, err_msg=name)
    else:
      assert_close(got[name], w, np.float32, err_msg=name)


@pytest.mark.parametrize("die, dying", [("during", 1), ("after_init", 0)])
def test_dead_process_stops_the_other(tmp_path, die, dying):
  # Process 1 dying is seen by the coordination service (in process 0) when its heartbeats
  # stop; process 0 (the coordinator) dying, by process 1 when it loses the connection.
  with _workers(tmp_path, "--die", die, "--dying", str(dying),
                "--heartbeat", str(HEARTBEAT_S)) as procs:
    exits = _wait(procs, TIMEOUT_S)
  (dead_code, died), (code, stopped) = exits[dying], exits[1 - dying]
  survivor = 1 - dying
  assert dead_code == 1, f"dying worker exit code {dead_code}\n{_log(tmp_path, dying)}"
  assert code is not None, f"survivor still running after {TIMEOUT_S} s"
  assert code != 0, _log(tmp_path, survivor)
  assert stopped - died < STOP_S, f"survivor stopped {stopped - died:.0f} s after the death"
  assert FATAL in (tmp_path / f"err{survivor}.txt").read_text(errors="replace"), \
      _log(tmp_path, survivor)
  assert not (tmp_path / "results.npz").exists()


def test_benchmark_cli_across_processes(tmp_path):
  """`python -m bench` on 2 processes x 4 devices: one 8-device mesh, process 0 reports."""
  def command(i):
    return [sys.executable, "-m", "bench", "-T", "256", "-D", "16", "-F", "32", "-E", "8",
            "--levels", "kernel", "--impls", "all_to_all,jit_gshard_einsum", "--modes",
            "fwd", "--repeats", "1", "--out", str(tmp_path / f"process{i}")]

  with _workers(tmp_path, command=command) as procs:
    exits = _wait(procs, TIMEOUT_S)
  for i, (code, _) in enumerate(exits):
    assert code == 0, f"process {i} exit code {code}\n{_log(tmp_path, i)}"
  out0 = (tmp_path / "out0.txt").read_text()
  assert "8 cpu devices, 2 process(es)" in out0 and "| all_to_all |" in out0
  out1 = (tmp_path / "out1.txt").read_text()  # gloo itself may print "[Gloo] ..." lines
  assert "moe_shard benchmark" not in out1 and "|" not in out1  # only process 0 prints ...
  assert not list(tmp_path.glob("process1.*"))  # ... and writes
  rows = json.load(open(tmp_path / "process0.json"))["rows"]
  a2a = next(r for r in rows if r["impl"] == "all_to_all")
  assert a2a["devices"] == 8 and a2a["rounds"] >= 1 and a2a["wire_bytes"] > 0
