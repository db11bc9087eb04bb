"""The one estimate of a TPU program's step time, read from its compiled HLO.

    estimate_s = sum over ops (loop bodies times their runs) of
                   max(op FLOPs / peak FLOP/s, op HBM bytes / HBM bandwidth)
                 + the link time the schedule leaves exposed (ici_exposed_s)

Each op is a kernel of the optimised module (`bench.reading.hbm.op_bytes`): its FLOPs (a dot,
a convolution, the dots inside a fusion, a Pallas kernel's declared or visited FLOPs; splash
attention, which declares none, the blocks its causal mask leaves) and its HBM bytes by the
one model (`bench.reading.hbm`: in-place updates by their slice, VMEM prefetches once,
grouped kernels at the tiles their grid visits). The link time is each
collective's wire bytes over the chip's link bandwidth; the part that no op scheduled in
its window covers is exposed (`bench.reading.schedule`). Beside it, the whole-step lower
bound `max(compute_s, hbm_s, ici_s)` by the same counts, which assumes every HBM-bound op
overlaps every FLOP-bound op and every collective. XLA's own "bytes accessed" is a
reference column (`hbm_bytes_xla`), counted by XLA's rules, loop bodies once.

What it does not see: a collective's fixed latency (the bench's `latency_s`), host offload
transfers, the time between kernels, and a Pallas kernel's cost beyond its declared or
visited bytes and FLOPs.

    from bench.reading import estimate
    estimate.step_estimate(compiled, "v5p:4x4x4")
    estimate.step_estimate(open("step.hlo").read(), "v6e:16x16", cost=cost_dict)
"""

from __future__ import annotations

from bench.reading import hbm, measure, schedule, tpu


def step_estimate(
  compiled_or_text,
  topology,
  trip_counts=None,
  cost=None,
  *,
  groups=None,
  row_tile=hbm.ROW_TILE,
  ici_bytes=None,
):
  """The one count of a TPU program's step time, per device.

  Args:
    compiled_or_text: a `jax.stages.Compiled` for TPU, or its optimised HLO text
      (`as_text()`).
    topology: e.g. "v5p:4x4x4", "v6e:16x16"; its generation picks `tpu.PEAKS`.
    trip_counts: {scope: total iterations} for loops without a known trip count, and
      `hlo.branch_key` entries for conditionals (as `measure.executed_flops`); a loop with
      neither runs once. XLA's `known_trip_count` (a scanned model's layers) is read from the
      text.
    cost: XLA's `cost_analysis()` dict, for text input (default None: the compiled's own).
      Only its "bytes accessed" is read, as the reference column.
    groups: {G: expected rows per group} for the grouped-matmul kernels of G groups
      (`hbm.op_bytes`; default None: they count what they declare).
    row_tile: those kernels' row tile (default `hbm.ROW_TILE`).
    ici_bytes: the link bytes one device sends, where the caller knows them better than the
      HLO does (a ragged exchange's run-time sizes; default None: the HLO's wire bytes). The
      exposed part keeps the schedule's share.

  Returns:
    dict: estimate_s (the one count), lower_bound_s (max of compute_s, hbm_s, ici_s),
    ops_s (the sum over ops), compute_s, hbm_s, ici_s, ici_exposed_s, flops, hbm_bytes (the
    one count), hbm_bytes_xla (XLA's, None when not known).

  Raises:
    ValueError: a topology whose generation has no cited peaks.
  """
  peak = tpu.PEAKS.get(tpu.generation(topology))
  if peak is None:
    raise ValueError(
      f"step_estimate: topology must be of a TPU generation with cited peaks "
      f"({', '.join(tpu.PEAKS)}), got {topology!r}"
    )
  mod = measure._module(compiled_or_text)
  rows = hbm.op_bytes(mod, trip_counts, groups=groups, row_tile=row_tile)
  if cost is None and hasattr(compiled_or_text, "cost_analysis"):
    cost = measure._cost(compiled_or_text)
  counts = hbm.step_bytes(mod, trip_counts, rows, cost=cost or {})
  link = schedule.exposed_link(mod, peak, trip_counts, rows)
  flops = sum(r["flops"] * r["runs"] for r in rows)
  ici_s = link["link_s"] if ici_bytes is None else ici_bytes / peak["ici"]
  share = link["exposed_s"] / link["link_s"] if link["link_s"] else 0.0
  out = dict(
    flops=flops,
    hbm_bytes=counts["hbm"],
    hbm_bytes_xla=counts["xla"],
    compute_s=flops / peak["flops"],
    hbm_s=counts["hbm"] / peak["hbm"],
    ici_s=ici_s,
    ici_exposed_s=ici_s * share,
    ops_s=link["ops_s"],
  )
  out["estimate_s"] = out["ops_s"] + out["ici_exposed_s"]
  out["lower_bound_s"] = max(out["compute_s"], out["hbm_s"], out["ici_s"])
  return out
