"""What a run's rows carry besides the program's own counts: the parameters' bytes as held,
a model's training state, seconds and efficiency, the groups a kernel visits, errors against the NumPy reference, and the host memory a program needs."""

from __future__ import annotations

import os


def visited_groups(case):
  """{L: the rows each local expert holds on the device the routing loads most}: the
  grouped-matmul kernels' expected group sizes (`bench.reading.hbm.op_bytes`), from the
  case's routing on the host (uniform, Zipf), which the compiled program only learns at run
  time. None with a placement (its slots, not the experts, are the kernels' groups).

  The kernels of every round take these sizes: a round past the first visits at most its
  buffer, so a skewed row's later rounds count at most their whole buffer."""
  import numpy as np

  from moe_shard import EXPERT

  if case.placement is not None or EXPERT not in case.mesh.shape:
    return None
  N = case.mesh.shape[EXPERT]
  L = case.E // N
  e = np.asarray(case.experts_TK).ravel()
  counts = np.bincount(e[(e >= 0) & (e < case.E)], minlength=case.E).reshape(N, L)
  busiest = counts[int(np.argmax(counts.sum(axis=1)))]
  return {L: [int(c) for c in busiest]}


def param_bytes(params):
  """What one device stores of `params` (arrays or ShapeDtypeStructs with shardings, an
  `ms.MoEParams`), summed over the leaves' shard shapes: {"bytes", "elems", "expert_bytes",
  "frozen_bytes", "frozen_elems"}.

  expert_bytes: the routed experts' matrices as held (values and scales when quantized);
  frozen_*: the quantized ones (`ms.QuantizedArray`), which get no gradient.
  """
  import jax
  import numpy as np

  import moe_shard as ms

  def held(a):  # (bytes, elements) of one device's shard of an array
    n = int(np.prod(a.sharding.shard_shape(a.shape)))
    return n * np.dtype(a.dtype).itemsize, n

  out = dict.fromkeys(("bytes", "elems", "expert_bytes", "frozen_bytes", "frozen_elems"), 0)
  for path, leaf in jax.tree_util.tree_leaves_with_path(params, is_leaf=ms.quant.is_quantized):
    frozen = ms.quant.is_quantized(leaf)
    for a in leaf.arrays() if frozen else (leaf,):
      b, n = held(a)
      out["bytes"] += b
      out["elems"] += n
      if frozen:
        out["frozen_bytes"] += b
        out["frozen_elems"] += n
      # The routed experts' matrices: rank 3 (their biases are [E, out]).
      if jax.tree_util.keystr(path).startswith(".experts") and (frozen or leaf.ndim == 3):
        out["expert_bytes"] += b
  return out


def model_state_bytes(stored, layers):
  """Per device, a model of `layers` such layers: {"layers", "weights", "experts", "grads",
  "adam", "total"}, in bytes but the first.

  Weights as stored (`param_bytes`), of which "experts" (where `stored` has
  "expert_bytes") are the routed experts' matrices (values and scales when quantized); gradients in the weights' dtypes and Adam's two
  moments in float32 (8 bytes per parameter) of the trainable leaves only: quantized
  matrices are frozen. Activations not included.
  """
  w = stored["bytes"] * layers
  frozen_b, frozen_n = stored.get("frozen_bytes", 0), stored.get("frozen_elems", 0)
  out = {
    "layers": layers,
    "weights": w,
    **({"experts": stored["expert_bytes"] * layers} if "expert_bytes" in stored else {}),
    "grads": (stored["bytes"] - frozen_b) * layers,
    "adam": 8 * (stored["elems"] - frozen_n) * layers,
  }
  out["total"] = out["weights"] + out["grads"] + out["adam"]
  return out


def seconds(row):
  """A row's time: the median wall time, or for a TPU compile the one count (`estimate_s`)."""
  if "time_s" in row:
    return row["time_s"]["median"]
  return row.get("estimate_s")


def efficiency(rows):
  """Sets each row's `efficiency`: the dense limit's time over its own (same mode)."""
  limit = {r["mode"]: seconds(r) for r in rows if r["impl"] == "dense_limit" and "error" not in r}
  for r in rows:
    t = seconds(r) if "error" not in r else None
    if limit.get(r["mode"]) and t:
      r["efficiency"] = limit[r["mode"]] / t


def host_memory_short(compiled, fraction=0.75):
  """Why running `compiled` on this host's simulated CPU devices would exhaust its memory,
  or None: temp + argument + output bytes per device (`memory_analysis()`) times the local
  devices, against `fraction` of the memory available now (Linux `sysconf`; None where it
  is unknown). `run` returns what malloc holds freed to the kernel before each case
  (`malloc.release_freed_memory`), so that figure includes it."""
  import jax

  from bench.reading import measure

  if jax.default_backend() != "cpu":
    return None
  try:
    avail = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
  except (ValueError, OSError, AttributeError):
    return None
  mem = measure.memory_bytes(compiled)
  need = (mem["temp"] + mem["argument"] + mem["output"]) * jax.local_device_count()
  if need <= fraction * avail:
    return None
  return (
    f"not run: needs {need / 2**30:.1f} GiB of host memory for "
    f"{jax.local_device_count()} simulated devices, {avail / 2**30:.1f} GiB available"
  )


def one_line(err):
  """The first line of an exception's message, with its type."""
  text = str(err).strip().splitlines()
  return f"{type(err).__name__}: {text[0] if text else ''}"[:300]


def counted(fn, compiled, trips):
  """`fn(compiled, trips)`; a loop XLA wrote with no trip count it shows (and none of ours)
  is counted as running once per entry, and the result says so ("loop_counted_once")."""
  try:
    return fn(compiled, trips)
  except ValueError:
    out = fn(compiled, trips, default_trip_count=1)
    return dict(out, loop_counted_once=True) if isinstance(out, dict) else out


def busiest_flops(compiled, trips):
  """(FLOPs executed summed over devices, `executed_flops` of the busiest device, its trip
  counts), from each device's trip counts (devices with equal counts share one
  evaluation)."""
  from bench.reading import measure

  by_counts = {}
  for t in trips:
    key = tuple(sorted(t.items()))
    if key not in by_counts:
      by_counts[key] = counted(measure.executed_flops, compiled, t)
  per_device = [by_counts[tuple(sorted(t.items()))] for t in trips]
  i = max(range(len(trips)), key=lambda d: per_device[d]["executed"])
  return sum(f["executed"] for f in per_device), per_device[i], trips[i]


def errors(case, rows, timed, kept, outputs):
  """Each forward's error against the reference computed in NumPy from the host routing
  (`bench/cases/reference.py`, float32 with float64 sums, on the same rounded inputs) without the
  items each implementation drops (`kept`: impl -> bool[T, K] or None): `rel_err`,
  ||y - ref|| / ||ref|| over the whole output, and `max_abs_err`, max |y - ref|. The
  layer's reported rounds and drops are recorded beside.

  `rel_err` is the dtype's rounding (about 1e-6 in float32, 1e-3 in bfloat16) unless items
  go wrong. `outputs`: id(row) -> the last output of the row's timed program
  (`common.time_in_turns`), which is checked. `max_abs_err` is one element's: a token routed to another expert than the
  host's (a near tie in its router logits, which XLA:GPU computes in TF32 by default) puts
  a whole expert's output there, O(|y|), while adding about sqrt(1/T) to `rel_err`."""
  import jax
  import numpy as np

  import moe_shard as ms
  from bench.cases import reference

  if jax.process_count() > 1:
    return  # the outputs are not all on this process
  # Quantized matrices as the float values they stand for: the reference of the
  # dequantized weights (`ms.dequantize_experts`), which the layer computes with; adapters
  # folded into their matrices (`ms.merge_adapters`).
  host = [
    np.asarray(jax.device_get(v.dequantize() if ms.quant.is_quantized(v) else v))
    if not hasattr(v, "router_DE")
    else jax.tree.map(
      lambda a: np.asarray(jax.device_get(a)), ms.dequantize_experts(ms.merge_adapters(v))
    )
    # Slot-major parameters ("served"): the reference reads the logical ones.
    for v in (case.args if case.logical_params is None else (case.logical_params, *case.args[1:]))
  ]
  refs = {}
  for _, _, row in timed:
    if row["mode"] != "fwd":
      continue
    if row["impl"] not in kept:
      continue  # not a dispatch (the dense limit): nothing to check against
    keep = kept[row["impl"]]
    key = None if keep is None else keep.tobytes()
    if key not in refs:
      refs[key] = (
        reference.kernel(*host[:4], kept=keep)
        if case.level == "kernel"
        else reference.layer(host[0], host[1], case.cfg, case.experts_TK, kept=keep)
      )
    out = outputs[id(row)]  # the program's last timed output
    y = out if case.level == "kernel" else out[0]
    if case.level == "layer":  # what the layer reports, against the host's count
      row["rounds_reported"], row["dropped_reported"] = int(out[2]), int(out[3])
    if hasattr(y, "detach"):  # a PyTorch peer's output
      from bench.peers import torch_peer

      got = torch_peer.to_numpy(y)
    else:
      got = np.asarray(jax.device_get(y), np.float32)
    ref = refs[key]
    row["max_abs_err"] = float(np.max(np.abs(got - ref)))
    row["rel_err"] = float(np.linalg.norm(got - ref) / max(float(np.linalg.norm(ref)), 1e-30))
