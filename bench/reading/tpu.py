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


def estimates(compiled, flops, wire_bytes, topology, hbm_bytes=None, dependent=None):
  """XLA's TPU cost estimate and a roofline, per device, in seconds.

  Args:
    compiled: the TPU `Compiled`.
    flops: `measure.executed_flops(compiled, trip_counts)` of one device.
    wire_bytes: collective bytes one device sends (loops scaled).
    topology: e.g. "v5e:2x4".
    hbm_bytes: `bench.reading.hbm.executed_bytes(compiled, trip_counts)` of one device (default
      None: XLA's figure, loop bodies once).
    dependent: `measure.dependent_collectives(compiled, trip_counts)` (default None: no
      latency term).

  Returns:
    dict: xla_optimal_s (cost_analysis()["optimal_seconds"]; XLA visits each while body
    once; None when XLA could not cost an instruction); xla_optimal_scaled_s (that estimate times executed FLOPs / XLA's FLOPs, i.e.
    loop bodies counted once per iteration, assuming time in proportion to FLOPs); and, for
    a chip with cited peaks, roofline_s = max(compute_s, hbm_s, ici_s): executed FLOPs over
    peak FLOP/s, HBM bytes (XLA's "bytes accessed" with loop bodies times their trip
    counts; hbm_bytes_accessed) over HBM bandwidth, bytes sent over ICI bandwidth.
    hbm_bytes_xla is XLA's own figure (bodies once). With `hbm_bytes`, also
    hbm_bytes_no_prefetch (its "no_prefetch": less the bytes of values in VMEM, which
    XLA counts as HBM's; `bench.reading.hbm`) and roofline_no_prefetch_s, the roofline with it.
    With `dependent`, also dependent_collectives (that count) and latency_s: it times
    `collective_latency_s(topology)`, the time the chain of collectives waits on the
    interconnect whatever their bytes, which the rooflines above leave out (add it to
    either: a collective's result is what the next step waits for).
  """
  from bench.reading import measure

  ca = measure._cost(compiled)
  opt = float(ca.get("optimal_seconds", -1.0))
  # XLA adds -1 s for each instruction it cannot cost (seen: the transposes of TPU's
  # ragged-dot kernel in a backward pass); such a total is no estimate.
  opt = opt if opt >= 0 else None
  out = {
    "xla_optimal_s": opt,
    "xla_optimal_scaled_s": (
      None if opt is None else opt * flops["executed"] / max(flops["xla"], 1.0)
    ),
    "hbm_bytes_xla": float(ca.get("bytes accessed", 0.0)),
  }
  out["hbm_bytes_accessed"] = out["hbm_bytes_xla"] if hbm_bytes is None else hbm_bytes["executed"]
  peak = PEAKS.get(generation(topology))
  if peak is not None:
    out["compute_s"] = flops["executed"] / peak["flops"]
    out["hbm_s"] = out["hbm_bytes_accessed"] / peak["hbm"]
    out["ici_s"] = wire_bytes / peak["ici"]
    out["roofline_s"] = max(out["compute_s"], out["hbm_s"], out["ici_s"])
    if hbm_bytes is not None and "no_prefetch" in hbm_bytes:
      out["hbm_bytes_no_prefetch"] = hbm_bytes["no_prefetch"]
      hbm_s = hbm_bytes["no_prefetch"] / peak["hbm"]
      out["roofline_no_prefetch_s"] = max(out["compute_s"], hbm_s, out["ici_s"])
  latency = collective_latency_s(topology)
  if dependent is not None and latency is not None:
    out["dependent_collectives"] = dependent
    out["latency_s"] = dependent * latency
  return out
