"""Shared pieces of the benchmarks: machine facts, timing, synthetic routings, output."""

from __future__ import annotations

import os
import platform
import statistics
import time

import jax
import numpy as np

from bench import ROUTINGS


def machine_info():
  """CPU model, core count, JAX/jaxlib versions and the environment knobs that matter."""
  model = platform.processor() or platform.machine()
  try:
    with open("/proc/cpuinfo") as f:
      for line in f:
        if line.startswith("model name"):
          model = line.split(":", 1)[1].strip()
          break
  except OSError:
    pass
  import jaxlib

  return {
    "cpu": model,
    "cores": os.cpu_count(),
    "jax": jax.__version__,
    "jaxlib": jaxlib.__version__,
    "python": platform.python_version(),
    "backend": jax.default_backend(),
    "devices": len(jax.devices()),
    "XLA_FLAGS": os.environ.get("XLA_FLAGS", ""),
    "GLIBC_TUNABLES": os.environ.get("GLIBC_TUNABLES", ""),
    "load_average_1min": os.getloadavg()[0],
  }


# A program has run enough once it has SETTLE_RUNS timed runs which, the slowest one aside,
# are within SETTLE_SPREAD of their median: (second slowest - fastest) / median
# (`time_in_turns`). One slow run is let pass: on a shared host a run that another process
# interrupts is slower, never faster.
SETTLE_RUNS = 3
SETTLE_SPREAD = 0.10


def time_in_turns(fns_args, repeats, on_turn=None, *, settle=False, outputs=None):
  """Calls each (fn, args) once to warm up, then in turn `repeats` times.

  Args:
    fns_args: list of (fn, args).
    repeats: timed calls of each (at most, with `settle`).
    on_turn: called with the turn number after the warm-up (0) and each timed turn.
    settle: a program leaves the turns once its timed runs are `SETTLE_RUNS` or more and,
      the slowest one aside, within `SETTLE_SPREAD` of their median (default False: every
      program runs `repeats` times); the others go on, in turns, up to `repeats`.
    outputs: None (default), or a list that gets each program's last output, in order
      (what a check of the results can use instead of calling the programs again).

  Returns:
    list of dicts {"median", "min", "max", "runs"} in seconds (runs: timed calls), one per
    (fn, args).
  """
  last = [jax.block_until_ready(fn(*args)) for fn, args in fns_args]
  if on_turn:
    on_turn(0)
  times = [[] for _ in fns_args]

  def settled(t):
    if not settle or len(t) < SETTLE_RUNS:
      return False
    fastest, *_, second_slowest, _ = sorted(t)
    return second_slowest - fastest <= SETTLE_SPREAD * statistics.median(t)

  for turn in range(repeats):
    for i, (fn, args) in enumerate(fns_args):
      if settled(times[i]):
        continue
      last[i] = None  # its buffers freed before the call, as between the calls of a loop
      t0 = time.perf_counter()
      last[i] = jax.block_until_ready(fn(*args))
      times[i].append(time.perf_counter() - t0)
    if on_turn:
      on_turn(turn + 1)
  if outputs is not None:
    outputs.extend(last)
  return [
    {"median": statistics.median(t), "min": min(t), "max": max(t), "runs": len(t)} for t in times
  ]


def routing_log_popularity(routing, num_experts, k, *, num_devices=8, zipf_s=1.2, seed=0):
  """Log-popularity of each expert under a routing skew (+inf: always chosen, -inf: never).

  "uniform": all 0. "zipf": -s * log(rank), ranks placed on experts in a random
  permutation (popular experts spread over devices, as an unconstrained router spreads
  them). "hot_expert": expert 0 is +inf (one slot of every token), the others 0.
  "one_device": 0 for the experts of device 0 (ids < E / num_devices, at least K of them),
  -inf for the others.

  Returns:
    np.float64[E].
  """
  logp = np.zeros(num_experts)
  if routing == "zipf":
    ranks = np.random.default_rng(seed).permutation(num_experts) + 1
    logp = -zipf_s * np.log(ranks)
  elif routing == "hot_expert":
    logp[0] = np.inf
  elif routing == "one_device":
    local = max(num_experts // num_devices, k)
    logp = np.where(np.arange(num_experts) < local, 0.0, -np.inf)
  elif routing != "uniform":
    raise ValueError(f"routing must be one of {', '.join(ROUTINGS)} (got {routing!r})")
  return logp


def synthetic_routing(routing, tokens, num_experts, k, *, num_devices=8, zipf_s=1.2, seed=0):
  """Draws a routing: K distinct experts per token and combine weights summing to 1.

  Each token's K experts are a draw without replacement from the popularity of
  `routing_log_popularity` (Gumbel top-k).

  Args:
    routing: one of ROUTINGS; see `routing_log_popularity`.
    tokens, num_experts, k: T, E, K.
    num_devices: devices on the expert axis, for "one_device" (default 8).
    zipf_s: Zipf exponent (default 1.2).
    seed: RNG seed (default 0).

  Returns:
    (experts_TK: i32[T, K], weights_TK: f32[T, K]) as NumPy arrays.
  """
  logp = routing_log_popularity(
    routing, num_experts, k, num_devices=num_devices, zipf_s=zipf_s, seed=seed
  )
  rng = np.random.default_rng(seed + 1)
  gumbel = rng.gumbel(size=(tokens, num_experts))
  experts = np.argsort(-(logp + gumbel), axis=1, kind="stable")[:, :k]
  weights = rng.random((tokens, k)) + 0.1
  weights /= weights.sum(axis=1, keepdims=True)
  return experts.astype(np.int32), weights.astype(np.float32)
