"""Shared pieces of the benchmarks: machine facts, timing, synthetic routings, output."""

from __future__ import annotations

import json
import os
import platform
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

ROUTINGS = ("uniform", "zipf", "hot_expert", "one_device")


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
  return {"cpu": model, "cores": os.cpu_count(), "jax": jax.__version__,
          "jaxlib": jaxlib.__version__, "python": platform.python_version(),
          "backend": jax.default_backend(), "devices": len(jax.devices()),
          "XLA_FLAGS": os.environ.get("XLA_FLAGS", ""),
          "GLIBC_TUNABLES": os.environ.get("GLIBC_TUNABLES", ""),
          "load_average_1min": os.getloadavg()[0]}


def time_in_turns(fns_args, repeats):
  """Calls each (fn, args) once to warm up, then in turn `repeats` times.

  Returns:
    list of dicts {"median", "min", "max"} in seconds, one per (fn, args).
  """
  for fn, args in fns_args:
    jax.block_until_ready(fn(*args))
  times = [[] for _ in fns_args]
  for _ in range(repeats):
    for i, (fn, args) in enumerate(fns_args):
      t0 = time.perf_counter()
      jax.block_until_ready(fn(*args))
      times[i].append(time.perf_counter() - t0)
  return [{"median": statistics.median(t), "min": min(t), "max": max(t)} for t in times]


def synthetic_routing(routing, tokens, num_experts, k, *, num_devices=8, zipf_s=1.2, seed=0):
  """Draws a routing: K distinct experts per token and combine weights summing to 1.

  Args:
    routing: "uniform"; "zipf" (expert popularity proportional to rank^-s, ranks placed on
      experts in a random permutation, so popular experts are spread over devices as an
      unconstrained router would spread them); "hot_expert" (one slot of every token goes
      to expert 0, the others uniform); "one_device" (every token to the experts of device
      0, i.e. ids < E / num_devices, padded with uniform if K exceeds them).
    tokens, num_experts, k: T, E, K.
    num_devices: devices on the expert axis, for "one_device" (default 8).
    zipf_s: Zipf exponent (default 1.2).
    seed: RNG seed (default 0).

  Returns:
    (experts_TK: i32[T, K], weights_TK: f32[T, K]) as NumPy arrays.
  """
  rng = np.random.default_rng(seed)
  logp = np.zeros(num_experts)
  if routing == "zipf":
    ranks = rng.permutation(num_experts) + 1
    logp = -zipf_s * np.log(ranks)
  elif routing == "one_device":
    local = max(1, num_experts // num_devices)
    logp = np.where(np.arange(num_experts) < max(local, k), 0.0, -np.inf)
  elif routing not in ("uniform", "hot_expert"):
    raise ValueError(f"synthetic_routing: routing must be one of {ROUTINGS} (got {routing!r})")
  gumbel = rng.gumbel(size=(tokens, num_experts))  # Gumbel top-k: K draws without replacement
  experts = np.argsort(-(logp + gumbel), axis=1)[:, :k]
  if routing == "hot_expert":
    others = np.argsort(-(gumbel[:, 1:]), axis=1)[:, :k - 1] + 1
    experts = np.concatenate([np.zeros((tokens, 1), int), others], axis=1)
  weights = rng.random((tokens, k)) + 0.1
  weights /= weights.sum(axis=1, keepdims=True)
  return experts.astype(np.int32), weights.astype(np.float32)


def write_results(path_stem, rows, markdown, info, argv):
  """Writes `<stem>.json` (rows + machine) and `<stem>.md` (the table); returns the paths."""
  os.makedirs(os.path.dirname(path_stem) or ".", exist_ok=True)
  with open(path_stem + ".json", "w") as f:
    json.dump({"machine": info, "argv": argv, "rows": rows}, f, indent=1)
  with open(path_stem + ".md", "w") as f:
    f.write(markdown)
  return path_stem + ".json", path_stem + ".md"


def make_mesh(spec):
  """Builds an Auto ("expert", "data") mesh from "NxM" over the first N*M devices.

  Raises:
    ValueError: `spec` is not "NxM", or needs more devices than JAX found.
  """
  try:
    n_e, n_d = (int(v) for v in spec.split("x"))
  except ValueError:
    raise ValueError(f"mesh must be EXPERTxDATA, e.g. 8x1 (got {spec!r})") from None
  if n_e * n_d > len(jax.devices()):
    raise ValueError(f"mesh {spec} needs {n_e * n_d} devices, found {len(jax.devices())}")
  return jax.make_mesh((n_e, n_d), ("expert", "data"),
                       axis_types=(jax.sharding.AxisType.Auto,) * 2,
                       devices=jax.devices()[:n_e * n_d])


def dtype_bytes(dtype):
  return jnp.dtype(dtype).itemsize
