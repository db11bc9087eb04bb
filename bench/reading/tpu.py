"""Compiling for a TPU topology on a machine without one: devices, peak figures, estimates.

`jax.experimental.topologies.get_topology_desc(platform="tpu", topology_name="v5e:2x4")`
(needs libtpu: `pip install -e ".[tpu]"`) gives abstract devices of that slice; a mesh over
them and `jax.ShapeDtypeStruct` inputs with shardings let `jit(f).lower(...).compile()`
build the real TPU program. Nothing runs: every figure from it is an estimate.
"""

from __future__ import annotations

import functools

# Published per-chip peaks (bf16 FLOP/s, HBM bytes/s, ICI bytes/s sent per chip = half the
# bidirectional figure). Sources: Cloud TPU system architecture pages,
# https://cloud.google.com/tpu/docs/v5e ("Peak compute per chip (bf16) 197 TFLOPs",
# "HBM2 capacity and bandwidth 16 GB, 819 GBps", "Bidirectional inter-chip interconnect
# (ICI) bandwidth (per chip) 400 GBps") and https://cloud.google.com/tpu/docs/v6e
# ("918 TFLOPs", "HBM bandwidth per chip 1638 GBps", "Bidirectional ICI bandwidth (per
# chip) 800 GBps") and https://cloud.google.com/tpu/docs/v5p ("Peak compute per chip (BF16)
# (TFLOPs) 459", "HBM bandwidth per chip (GBps) 2765", "Bidirectional inter-chip
# interconnect (ICI) bandwidth per chip (GBps) 1200") and https://cloud.google.com/tpu/docs/tpu7x
# ("Peak compute per chip (BF16) (TFLOPs) 2307", "HBM bandwidth per chip (GB/s) 7380",
# "Bi-directional inter-chip interconnect (ICI) bandwidth per chip (GB/s) 1200"). Figures are
# per device: a TPU7x chip shows as two devices (its two TensorCores, one per chiplet: "the
# Ironwood programming model lets you access two TPU devices"), each half of the chip's;
# v5p's two TensorCores show as one device (megacore).
PEAKS = {
  "v5e": {"flops": 197e12, "hbm": 819e9, "ici": 400e9 / 2},
  "v5p": {"flops": 459e12, "hbm": 2765e9, "ici": 1200e9 / 2},
  "v6e": {"flops": 918e12, "hbm": 1638e9, "ici": 800e9 / 2},
  "tpu7x": {"flops": 2307e12 / 2, "hbm": 7380e9 / 2, "ici": 1200e9 / 2 / 2},
}


def generation(topology):
  """ "v5e:2x4" -> "v5e"."""
  return topology.split(":", 1)[0].lower()


def devices(topology):
  """The abstract TPU devices of `topology` (e.g. "v5e:2x4", "v6e:2x4", "v4:2x2x2").

  Raises:
    ValueError: libtpu is missing or the topology is unknown (one line, the cause named).
  """
  try:
    from jax.experimental import topologies
  except ImportError as err:  # pragma: no cover - part of jax
    raise ValueError(f"--tpu needs jax.experimental.topologies ({err})") from None
  try:
    import libtpu  # noqa: F401
  except ImportError:
    raise ValueError('--tpu needs libtpu: pip install -e ".[tpu]"') from None
  try:
    topo = topologies.get_topology_desc(platform="tpu", topology_name=topology)
  except Exception as err:
    first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
    raise ValueError(f"--tpu {topology}: cannot describe this topology ({first})") from None
  return list(topo.devices)


@functools.cache
def collective_latency_s(topology):
  """The fixed cost of one collective over every chip of `topology`
  (`moe_shard.chips.collective_latency_s`: 1 us per ICI hop, times the hops between the
  slice's farthest chips: 4 us on a v5e or v6e 2x4); None for a chip it does not list."""
  from moe_shard import chips

  return chips.collective_latency_s(devices(topology))


def estimates(compiled, topology, trip_counts=None, wire_bytes=None, dependent=None, groups=None):
  """XLA's TPU cost estimate and the one count (`bench.reading.estimate`), per device, in seconds.

  Args:
    compiled: the TPU `Compiled`.
    topology: e.g. "v5e:2x4".
    trip_counts: the loops' trips and branches of the device counted (the busiest).
    wire_bytes: collective bytes one device sends, loops scaled, where the caller knows them
      better than the HLO (a ragged exchange's run-time sizes; default None: the HLO's).
    dependent: `measure.dependent_collectives(compiled, trip_counts)` (default None: no
      latency term).
    groups: {G: expected rows per group} of the grouped-matmul kernels (`hbm.op_bytes`).

  Returns:
    dict: xla_optimal_s (cost_analysis()["optimal_seconds"]; XLA visits each while body
    once; None when XLA could not cost an instruction); hbm_bytes_xla (XLA's "bytes
    accessed", bodies once: a reference column); and, for a chip with cited peaks, the one
    count: estimate_s (the sum over ops of each op's larger of FLOPs / peak and HBM bytes /
    bandwidth, plus the exposed link time ici_exposed_s), roofline_s (the whole-step lower
    bound max(compute_s, hbm_s, ici_s) by the same counts), compute_s, hbm_s, ici_s,
    hbm_bytes_accessed (the one count's bytes), estimate_flops. With `dependent`, also
    dependent_collectives (that count) and latency_s: it times
    `collective_latency_s(topology)`, the time the chain of collectives waits on the
    interconnect whatever their bytes, which the estimate leaves out (add it: a
    collective's result is what the next step waits for).
  """
  from bench.reading import estimate, measure

  ca = measure._cost(compiled)
  opt = float(ca.get("optimal_seconds", -1.0))
  # XLA adds -1 s for each instruction it cannot cost (seen: the transposes of TPU's
  # ragged-dot kernel in a backward pass); such a total is no estimate.
  out = {
    "xla_optimal_s": opt if opt >= 0 else None,
    "hbm_bytes_xla": float(ca.get("bytes accessed", 0.0)),
  }
  if PEAKS.get(generation(topology)) is not None:
    one = estimate.step_estimate(
      compiled, topology, trip_counts, ca, groups=groups, ici_bytes=wire_bytes
    )
    out.update(
      estimate_s=one["estimate_s"],
      roofline_s=one["lower_bound_s"],
      compute_s=one["compute_s"],
      hbm_s=one["hbm_s"],
      ici_s=one["ici_s"],
      ici_exposed_s=one["ici_exposed_s"],
      hbm_bytes_accessed=one["hbm_bytes"],
      estimate_flops=one["flops"],
    )
  latency = collective_latency_s(topology)
  if dependent is not None and latency is not None:
    out["dependent_collectives"] = dependent
    out["latency_s"] = dependent * latency
  return out
