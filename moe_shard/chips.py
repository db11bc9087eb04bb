"""Published figures of the chips `impl="auto"` prices: HBM bandwidth, peak FLOP/s, and the
latency of a collective over the chips' interconnect.

At decode sizes "auto" compares the dispatches' estimated times
(`exchange_rule.decode_estimates`), past them it reads the chip's ridge point, FLOP/s over
HBM bytes/s (`exchange_rule.chip_ridge`); the benchmark's roofline adds the same latency per
collective (`bench.reading.tpu.estimates`). A chip not listed here has no estimate: "auto"
keeps its rule for unpriced chips there. The figures and the rules that read them are
TPUs': a device of another platform is not priced, whatever its kind.

    latency of one collective = ICI_HOP_S * hops(devices)

with hops the most links a message crosses between two of the collective's chips: along each
axis of the slice that the chips span, d - 1 links for d chips, d // 2 where the axis wraps
around (a torus ring).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence


@dataclasses.dataclass(frozen=True)
class Chip:
  """One chip's published peaks.

  Attributes:
    hbm: HBM bandwidth, bytes/s.
    flops: peak bf16 FLOP/s.
    wraps: the rule for a wraparound link on a slice's axis: "16" (an axis of 16 chips,
      TPU v5e and v6e) or "cube" (every axis, where each is a multiple of 4: whole 4x4x4
      cubes joined by optical switches, TPU v4 and v5p).
  """

  hbm: float
  flops: float
  wraps: str


# Sources: Cloud TPU system architecture pages, https://cloud.google.com/tpu/docs/v5e ("Peak
# compute per chip (bf16) 197 TFLOPs", "HBM2 ... 819 GBps"), https://cloud.google.com/tpu/docs/v6e
# ("918 TFLOPs", "HBM bandwidth per chip 1638 GBps"), https://cloud.google.com/tpu/docs/v5p
# ("459" TFLOPs bf16, "HBM bandwidth per chip (GBps) 2765"), https://cloud.google.com/tpu/docs/tpu7x
# ("Peak compute per chip (BF16) (TFLOPs) 2307", "HBM bandwidth per chip (GB/s) 7380"; a chip
# shows as two devices, each half of it): the peaks `bench.reading.tpu.PEAKS` cites, per device.
# Wraparound links: "How to Scale Your Model" (jax-ml/scaling-book), "All About TPUs": v5e
# and v6e slices have no wraps on axes under 16; v4 and v5p have them on every axis of whole
# 4x4x4 cubes, none on smaller slices ("a 2x2x4 won't have any wraparounds").
CHIPS = {
  "TPU v5 lite": Chip(hbm=819e9, flops=197e12, wraps="16"),
  "TPU v5e": Chip(hbm=819e9, flops=197e12, wraps="16"),
  "TPU v6 lite": Chip(hbm=1638e9, flops=918e12, wraps="16"),
  "TPU v6e": Chip(hbm=1638e9, flops=918e12, wraps="16"),
  "TPU v5": Chip(hbm=2765e9, flops=459e12, wraps="cube"),
  "TPU v5p": Chip(hbm=2765e9, flops=459e12, wraps="cube"),
  "TPU7x": Chip(hbm=7380e9 / 2, flops=2307e12 / 2, wraps="cube"),
}

# The fixed cost of one ICI hop, whatever the bytes: "Each hop over an ICI link has some
# intrinsic overhead regardless of the data volume. This is typically around 1us" ("How to
# Scale Your Model", Sharded Matrices, "A note on ICI latency"; measured there: a 3-hop
# all-gather of 32 kB on a v5e slice took about 8 us against 3 us from this figure). The
# book gives one figure for every generation.
ICI_HOP_S = 1e-6


def chip(device_kind: str | None) -> Chip | None:
  """The `Chip` of a device kind (`jax.Device.device_kind`), or None where none is listed."""
  return CHIPS.get(device_kind) if device_kind else None


def hops(coords: Sequence[Sequence[int]], wraps: str) -> int:
  """The most ICI links a message crosses between two of the chips at `coords`.

  Args:
    coords: each chip's position in its slice (`jax.Device.coords`: x, y, z).
    wraps: `Chip.wraps`.

  Returns:
    The sum over axes of the chips' extent d less one, or d // 2 where the axis wraps
    around: 4 on a 2x4 v5e slice (1 + 3), 6 on a 4x4x4 v5p cube (2 + 2 + 2).
  """
  if not coords:
    return 0
  extents = [
    max(c[i] for c in coords) - min(c[i] for c in coords) + 1 for i in range(len(coords[0]))
  ]
  if wraps == "cube":
    ring = all(d % 4 == 0 for d in extents if d > 1) and all(d >= 4 for d in extents)
    return sum(d // 2 if ring else d - 1 for d in extents)
  return sum(d // 2 if d == 16 else d - 1 for d in extents)


def collective_latency_s(devices) -> float | None:
  """The fixed cost of one collective over `devices`: `ICI_HOP_S` times `hops` of their
  coordinates; None where their kind is not in `CHIPS` or they have no coordinates."""
  devices = list(devices)
  c = chip(getattr(devices[0], "device_kind", None)) if devices else None
  if c is None or not all(hasattr(d, "coords") for d in devices):
    return None
  return ICI_HOP_S * hops([d.coords for d in devices], c.wraps)
