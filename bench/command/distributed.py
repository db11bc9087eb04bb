"""Multi-process runs: the process layout from flags or env vars, and `jax.distributed` setup.

    parser = argparse.ArgumentParser()
    distributed.add_arguments(parser)
    args = parser.parse_args()
    distributed.initialize(args)  # before any other JAX use (jax.config excepted)
    mesh = jax.make_mesh(shape, axes, devices=jax.devices())  # the devices of every process

Every process runs the same program on its own devices; `is_leader()` picks the one that
prints and writes files.

A process that dies stops the others: after `heartbeat_s` without its heartbeats the
coordination service (in process 0) declares it dead and every live process aborts with
"Terminating process because the JAX distributed service detected fatal errors". If
process 0 dies, the others abort as soon as they lose their connection to it.
"""

from __future__ import annotations

import os

import jax

HEARTBEAT_S = 30  # JAX's default is 100 s
CONNECT_S = 300  # how long initialize waits for every process to join (JAX's default)


def add_arguments(parser):
  """Adds --num-processes, --process-id and --coordinator, defaulting to the JAX_* env vars."""
  env = os.environ.get
  parser.add_argument(
    "--num-processes",
    type=int,
    default=env("JAX_NUM_PROCESSES", "1"),
    help="processes in the job (default: $JAX_NUM_PROCESSES or 1)",
  )
  parser.add_argument(
    "--process-id",
    type=int,
    default=env("JAX_PROCESS_ID", "0"),
    help="this process, 0 .. N-1 (default: $JAX_PROCESS_ID or 0)",
  )
  parser.add_argument(
    "--coordinator",
    default=env("JAX_COORDINATOR_ADDRESS"),
    help="host:port of process 0 (default: $JAX_COORDINATOR_ADDRESS)",
  )
  return parser


def initialize(args, *, heartbeat_s=HEARTBEAT_S, connect_s=CONNECT_S):
  """Joins this process to the job with `jax.distributed`; a no-op for a single process.

  Args:
    args: a namespace from a parser given `add_arguments`, or a dict with the keys
      num_processes, process_id and coordinator.
    heartbeat_s: seconds without heartbeats after which a process counts as dead and the
      job stops (default HEARTBEAT_S).
    connect_s: seconds to wait for every process to join (default CONNECT_S).

  Raises:
    ValueError: several processes but no coordinator, or process_id not in [0, N).
  """
  v = args if isinstance(args, dict) else vars(args)
  n, pid, coordinator = int(v["num_processes"]), int(v["process_id"]), v["coordinator"]
  if n == 1:
    return
  if not coordinator:
    raise ValueError(
      f"distributed.initialize: coordinator must be host:port with {n} "
      "processes (--coordinator or $JAX_COORDINATOR_ADDRESS; got none)"
    )
  if not 0 <= pid < n:
    raise ValueError(f"distributed.initialize: process_id must be in [0, {n}) (got {pid})")
  # Collectives between the CPU devices of different processes; GPU and TPU ignore it.
  jax.config.update("jax_cpu_collectives_implementation", "gloo")
  jax.distributed.initialize(
    coordinator_address=coordinator,
    num_processes=n,
    process_id=pid,
    initialization_timeout=connect_s,
    heartbeat_timeout_seconds=heartbeat_s,
  )


def is_leader():
  """Whether this is process 0, the one that prints and writes results."""
  return jax.process_index() == 0
