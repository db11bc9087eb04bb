"""`impl="auto"`'s chip rule (`moe_shard.exchange_rule`) on stand-in devices: no libtpu.

A stand-in device carries what the rule reads of a `jax.Device`: its platform, kind and
coordinates (and a GPU's client). `jax.sharding.Mesh` takes them as it takes real ones.
"""

import glob
import json
import re
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import moe_shard as ms
from bench.cases import models
from moe_shard import chips, exchange_rule

# The device kinds libtpu gives the benchmark's topologies (`bench.reading.tpu.devices`).
KINDS = {"v5e": "TPU v5 lite", "v6e": "TPU v6 lite", "v5p": "TPU v5", "tpu7x": "TPU7x"}


class Device:
  """A stand-in for a `jax.Device`."""

  def __init__(self, i, platform, kind, coords=None, client=None):
    self.id = i
    self.platform = platform
    self.device_kind = kind
    if coords is not None:
      self.coords = coords
    if client is not None:
      self.client = client

  def __repr__(self):
    return f"Device({self.id}, {self.device_kind})"


def tpu_devices(topology):
  """Stand-ins for a TPU slice's devices: `"v6e:2x4"`, `"tpu7x:2x2x1"` (two devices a
  chip, as libtpu shows TPU7x)."""
  gen, dims = topology.split(":")
  dims = tuple(int(d) for d in dims.split("x"))
  per_chip = 2 if gen == "tpu7x" else 1
  coords = [tuple(c) + (0,) * (3 - len(dims)) for c in np.ndindex(*dims)]
  return [
    Device(per_chip * j + h, "tpu", KINDS[gen], coords=c)
    for j, c in enumerate(coords)
    for h in range(per_chip)
  ]


def mesh_of(devices, shape=(8, 1)):
  return jax.sharding.Mesh(np.array(devices).reshape(shape), (ms.EXPERT, ms.DATA))


def config(**kw):
  return ms.MoEConfig(
    **{**dict(d_model=2048, d_ff=4096, num_experts=64, top_k=2, param_dtype=jnp.bfloat16), **kw}
  )


def test_stand_in_slices_have_the_hops_of_the_real_ones():
  # The hops test_chips pins for libtpu's devices: 4 on a 2x4, 2 across TPU7x's 4 chips.
  assert chips.collective_latency_s(tpu_devices("v6e:2x4")) == pytest.approx(4e-6)
  assert chips.collective_latency_s(tpu_devices("tpu7x:2x2x1")) == pytest.approx(2e-6)


@pytest.mark.parametrize(
  "topology, want",
  [
    ("v5e:2x4", "ragged_all_to_all"),
    ("v5p:2x2x2", "ragged_all_to_all"),
    ("v6e:2x4", "all_to_all"),
    ("tpu7x:2x2x1", "all_to_all"),
  ],
)
def test_choose_impl_reads_the_ridge_of_the_meshs_chips(topology, want):
  mesh = mesh_of(tpu_devices(topology))
  spec = chips.chip(KINDS[topology.split(":")[0]])
  assert exchange_rule.chip_ridge(mesh, ms.EXPERT) == spec.flops / spec.hbm
  assert ms.choose_impl(config(), mesh, tokens=4096) == want
  assert ms.choose_impl(config(), mesh) == want
  # Its AbstractMesh carries the chip (jax.sharding.Mesh.abstract_mesh): the same choice.
  assert exchange_rule.chip_ridge(mesh.abstract_mesh, ms.EXPERT) == spec.flops / spec.hbm
  assert ms.choose_impl(config(), mesh.abstract_mesh, tokens=4096) == want


def test_an_abstract_mesh_without_a_device_takes_the_default_devices_chip(monkeypatch):
  """The platform and the ridge come from the same device: for an AbstractMesh that names
  no device, the default one (a v6e host tracing under `jax.sharding.use_abstract_mesh`)."""
  abstract = jax.sharding.AbstractMesh((8, 1), (ms.EXPERT, ms.DATA))
  assert exchange_rule.chip_ridge(abstract, ms.EXPERT) is None  # the CPU of this test
  assert ms.choose_impl(config(), abstract, tokens=4096) == "all_to_all"
  v6e, v5e = tpu_devices("v6e:2x4")[0], tpu_devices("v5e:2x4")[0]
  monkeypatch.setattr(exchange_rule, "_default_device", lambda: v6e)
  assert exchange_rule.chip_ridge(abstract, ms.EXPERT) == pytest.approx(918 / 1.638)
  assert ms.choose_impl(config(), abstract, tokens=4096) == "all_to_all"
  assert ms.choose_impl(config(), mesh_of(tpu_devices("v6e:2x4")), tokens=4096) == "all_to_all"
  monkeypatch.setattr(exchange_rule, "_default_device", lambda: v5e)
  assert ms.choose_impl(config(), abstract, tokens=4096) == "ragged_all_to_all"
  # No coordinates: decode sizes are not priced.
  assert exchange_rule.decode_estimates(config(), abstract, 8) is None


def test_the_ridge_rule_is_tpu_only(monkeypatch):
  """A GPU whose kind were listed in `chips.CHIPS` with a ridge above `STEP_RIDGE` keeps
  the ragged dispatch past decode sizes and gets no decode estimate: the figures and the
  rules fitted on them are TPUs'."""
  kind = "NVIDIA H100 80GB HBM3"
  monkeypatch.setitem(chips.CHIPS, kind, chips.Chip(hbm=1e12, flops=1e15, wraps="16"))
  client = types.SimpleNamespace(platform_version="cuda 12.8")
  gpus = [Device(i, "gpu", kind, coords=(i, 0, 0), client=client) for i in range(8)]
  mesh = mesh_of(gpus)
  assert exchange_rule._platform(mesh) == "cuda"
  assert exchange_rule.chip_ridge(mesh, ms.EXPERT) is None
  assert ms.choose_impl(config(), mesh, tokens=4096) == "ragged_all_to_all"
  assert exchange_rule.decode_estimates(config(num_experts=128, top_k=8), mesh, 8) is None
  assert exchange_rule.auto_impl("cuda", 8, 4096, ridge=1e9) == "ragged_all_to_all"
  assert exchange_rule.auto_impl("tpu", 8, 4096, ridge=1e9) == "all_to_all"


def test_expert_group_of_an_object_without_axis_names_is_empty():
  holder = types.SimpleNamespace(devices=np.array(tpu_devices("v6e:2x4")))
  assert exchange_rule._expert_group(holder, ms.EXPERT) == []


def qwen3(**kw):
  return config(d_model=2048, d_ff=768, num_experts=128, top_k=8, **kw)


@pytest.mark.parametrize("tokens, want", [(8, "ragged_all_to_all"), (64, "all_to_all")])
def test_decode_rule_on_tpu7x_takes_the_faster_exchange(tokens, want):
  """Qwen3-30B-A3B's layer on TPU7x 2x2x1 (bench/results/tpu_tpu7x_2x2x1_decode.md, the
  one estimate plus the latency over the bound): the ragged dispatch 1.25x against 1.29x
  at 8 tokens per chip, all_to_all 1.60x against 1.70x at 64."""
  mesh = mesh_of(tpu_devices("tpu7x:2x2x1"))
  t = exchange_rule.decode_estimates(qwen3(), mesh, tokens)
  assert min(t, key=t.get) == want
  assert ms.choose_impl(qwen3(), mesh, tokens=tokens) == want


def auto_rows():
  """(file, row) of each "auto" row at decode sizes (uniform routing) in the TPU decode
  results files."""
  for path in sorted(glob.glob("bench/results/tpu_*_decode.json")):
    if not re.fullmatch(r"bench/results/tpu_[a-z0-9]+_[0-9x]+_decode\.json", path):
      continue  # the skew files' rows are about placements
    with open(path) as f:
      rows = json.load(f)["rows"]
    for row in rows:
      decode = -(-row["T"] // row["devices"]) <= exchange_rule.DECODE_TOKENS
      if row["impl"] == "auto" and decode and row["routing"] == "uniform":
        yield path, row


def test_results_files_hold_decode_rows_of_each_priced_chip():
  topologies = {row["topology"] for _, row in auto_rows()}
  assert {"v5e:2x4", "v6e:2x4", "tpu7x:2x2x1"} <= topologies


@pytest.mark.parametrize("path, row", list(auto_rows()), ids=lambda r: str(r)[-40:])
def test_decode_rule_keeps_the_choices_in_the_results_files(path, row):
  """Every "auto" row at decode sizes in the TPU results files resolves to the exchange it
  compiled (its collectives)."""
  settings = models.settings(row["model"])
  fmt = row["weights_format"]
  cfg = ms.MoEConfig(
    d_model=row["D"],
    d_ff=row["F"],
    num_experts=row["E"],
    top_k=row["K"],
    param_dtype=jnp.dtype(row["dtype"]),
    weights_format=None if fmt == row["dtype"] else fmt,
    expert_type=settings["expert_type"],
    expert_bias=settings["expert_bias"],
    num_shared_experts=settings["shared_experts"],
  )
  shape = tuple(int(d) for d in row["mesh"].split("x"))
  mesh = mesh_of(tpu_devices(row["topology"]), shape)
  tokens = -(-row["T"] // row["devices"])
  compiled = "ragged_all_to_all" if "ragged-all-to-all" in row["collectives"] else "all_to_all"
  assert ms.choose_impl(cfg, mesh, tokens=tokens) == compiled
