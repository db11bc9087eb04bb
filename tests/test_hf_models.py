"""moe_shard against the transformers MoE block of every supported model family.

Each folder of tests/fixtures/hf/ is a tiny causal LM that transformers saved (config.json,
model.safetensors) with `moe_io.npz`: the input x, output y, a cotangent r and the input
gradient dx = d sum(y * r) / dx of one MoE layer's block, all computed by transformers in
float32 (tests/fixtures/make_hf_fixtures.py makes them by hand; torch and transformers are
needed there, not here). The input keeps every token's top-k choice clear of near-ties, so
float rounding cannot flip a routing decision.

`hf.load_moe_layer` reads the layer's config and weights from the folder; `ms.moe_layer` then
runs on one device and on a 2x4 (data, expert) mesh. On the mesh the families take the
"all_to_all" and "ragged_all_to_all" dispatches in turn (alphabetical order), so each
dispatch meets about half of them: a family's own parts (router, expert FFN, shared experts)
run the same under both, and both dispatches match the float64 oracles on every routing and
FFN elsewhere (test_parallel.py, test_ragged.py, test_experts.py). Both y and dx must match
the fixture with a relative error (max|a - b| / max|b| over the whole array) of at most 1e-5.
"""

import dataclasses
import functools
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from cases import FAST_COMPILE

import moe_shard as ms
from moe_shard import hf

FIXTURES = Path(__file__).parent / "fixtures" / "hf"
FAMILIES = [
  "dbrx",  # moe_normalize_expert_weights=2 (the p-norm)
  "dbrx_p1",  # moe_normalize_expert_weights=1
  "deepseek_v3",
  "gpt_oss",
  "gpt_oss_mxfp4",  # MXFP4 experts (*_blocks, *_scales)
  "granitemoe",
  "jamba",
  "llama4",  # Llama4ForConditionalGeneration: language_model.model.layers.*, text_config
  "llama4_text",  # Llama4ForCausalLM: model.layers.*
  "mixtral",
  "olmoe",
  "qwen2_moe",
  "qwen3_moe",
]
MESH_IMPLS = ["all_to_all", "ragged_all_to_all"]
CASES = [(name, "one_device") for name in FAMILIES] + [
  (name, MESH_IMPLS[i % len(MESH_IMPLS)]) for i, name in enumerate(FAMILIES)
]
MAX_REL_ERR = 1e-5
MAX_FIXTURE_BYTES = 3_000_000


def rel_err(a, b):
  """max|a - b| / max|b| over the whole array, in float64."""
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  return float(np.abs(a - b).max() / np.abs(b).max())


@functools.partial(jax.jit, static_argnames=("cfg", "mesh"), compiler_options=FAST_COMPILE)
def outputs_and_dx(params, x_BSD, r_BSD, cfg, mesh):
  """(y_BSD, dx_BSD): the layer's output and the gradient of sum(y * r) w.r.t. x.

  Jitted with cfg and mesh static, so fixtures whose configs agree share one compile.
  """

  def loss(x_BSD):
    y_BSD, _ = ms.moe_layer(params, x_BSD, cfg, mesh=mesh)
    return jnp.sum(y_BSD * r_BSD), y_BSD

  dx_BSD, y_BSD = jax.grad(loss, has_aux=True)(x_BSD)
  return y_BSD, dx_BSD


@pytest.fixture(scope="module")
def mesh(devices):
  del devices  # conftest's fixture asserts the 8 simulated devices
  return jax.make_mesh((2, 4), (ms.DATA, ms.EXPERT))


def test_every_family_has_a_fixture():
  have = sorted(p.name for p in FIXTURES.iterdir() if (p / "moe_io.npz").is_file())
  assert have == FAMILIES


def test_fixtures_stay_small():
  total = sum(p.stat().st_size for p in FIXTURES.rglob("*") if p.is_file())
  assert total <= MAX_FIXTURE_BYTES, f"tests/fixtures/hf holds {total} bytes"


@pytest.mark.parametrize("name, impl", CASES, ids=[f"{n}-{i}" for n, i in CASES])
def test_layer_matches_transformers(name, impl, mesh):
  folder = FIXTURES / name
  io = np.load(folder / "moe_io.npz")
  layer = int(io["layer"])
  if impl == "one_device":
    cfg, params = hf.load_moe_layer(folder, layer)
    on = None
  else:
    cfg, params = hf.load_moe_layer(folder, layer, mesh=mesh)
    cfg, on = dataclasses.replace(cfg, impl=impl), mesh
  y_BSD, dx_BSD = outputs_and_dx(params, io["x_BSD"], io["r_BSD"], cfg=cfg, mesh=on)
  assert y_BSD.dtype == jnp.float32 and y_BSD.shape == io["y_BSD"].shape
  err_y, err_dx = rel_err(y_BSD, io["y_BSD"]), rel_err(dx_BSD, io["dx_BSD"])
  assert err_y <= MAX_REL_ERR and err_dx <= MAX_REL_ERR, f"y {err_y:.2e}, dx {err_dx:.2e}"
