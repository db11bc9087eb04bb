"""`moe_shard.chips`: the hops between a slice's farthest chips, and a collective's latency."""

import jax
import numpy as np
import pytest

from moe_shard import chips


def grid(*dims):
  return [list(c) + [0] * (3 - len(dims)) for c in np.ndindex(*dims)]


@pytest.mark.parametrize(
  "dims, wraps, want",
  [
    ((2, 4), "16", 1 + 3),  # a v5e / v6e 2x4: no wraparound under 16 chips
    ((16, 16), "16", 8 + 8),  # a whole v5e pod: both axes are rings
    ((4, 16), "16", 3 + 8),
    ((1,), "16", 0),  # one chip
    ((4, 4, 4), "cube", 2 + 2 + 2),  # a v5p cube: rings on every axis
    ((4, 4, 8), "cube", 2 + 2 + 4),
    ((2, 2, 2), "cube", 1 + 1 + 1),  # smaller than a cube: no optical wraparound
    ((2, 2, 4), "cube", 1 + 1 + 3),
  ],
)
def test_hops_between_the_farthest_chips(dims, wraps, want):
  assert chips.hops(grid(*dims), wraps) == want


def test_collective_latency_of_tpu_slices_and_none_elsewhere():
  assert chips.ICI_HOP_S == 1e-6
  assert chips.collective_latency_s(jax.devices("cpu")) is None  # no published figure
  pytest.importorskip("libtpu")
  from bench.reading import tpu

  assert chips.collective_latency_s(tpu.devices("v5e:2x4")) == pytest.approx(4e-6)
  assert chips.collective_latency_s(tpu.devices("v6e:2x4")) == pytest.approx(4e-6)
  assert chips.collective_latency_s(tpu.devices("v5e:2x4")[:2]) == pytest.approx(1e-6)


def test_chip_figures_agree_with_the_benchmarks_peaks():
  from bench.reading import tpu

  for kind, gen in (
    ("TPU v5 lite", "v5e"),
    ("TPU v6 lite", "v6e"),
    ("TPU v5", "v5p"),
    ("TPU7x", "tpu7x"),
  ):
    c = chips.chip(kind)
    assert (c.hbm, c.flops) == (tpu.PEAKS[gen]["hbm"], tpu.PEAKS[gen]["flops"])
  assert chips.chip("NVIDIA H100 80GB HBM3") is None and chips.chip(None) is None


def test_ironwood_shows_each_chip_as_two_devices():
  # The per-device peaks of TPU7x are half a chip's: libtpu describes a 2x2x1 slice (4 chips)
  # as 8 devices of kind "TPU7x", two on each chip's coordinates.
  pytest.importorskip("libtpu")
  from bench.reading import tpu

  devs = tpu.devices("tpu7x:2x2x1")
  assert len(devs) == 8 and {d.device_kind for d in devs} == {"TPU7x"}
  assert len({tuple(d.coords) for d in devs}) == 4
  assert chips.chip("TPU7x").flops == tpu.PEAKS["tpu7x"]["flops"] == 2307e12 / 2
