"""`moe_shard.hf`: Hugging Face checkpoints to `MoEParams` and back, with no torch.

Each family's checkpoint is written here in its own tensor names (`hf_checkpoints.py`), and
what the loader makes of it is compared with the transforms written out below in NumPy, one
function per family, from the published layouts (torch Linear weights [out, in], DBRX's
[E*F, D] rows, Granite's [E, 2F, D] halves, gpt-oss's interleaved gate/up, MXFP4). The
comparison with the transformers blocks themselves is `test_hf_fixtures.py`.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import hf_checkpoints
import jax
import ml_dtypes
import numpy as np
import pytest
from hf_checkpoints import BF16, MOE_LAYERS, PREFIX
from jax.sharding import PartitionSpec as P
from safetensors import safe_open

import moe_shard as ms
from moe_shard import hf

FAMILIES = sorted(hf_checkpoints.CONFIGS)


def _T(a):
  return np.swapaxes(a, -1, -2)


def _stack(T, p, n, name):
  return np.stack([T[p + name.format(j=j)].T for j in range(n)])


def _per_expert(gate, up, down, router="gate.weight"):
  def expect(T, p, n):
    return {
      "router_DE": T[p + router].T,
      "experts.gate_EDF": _stack(T, p, n, "experts.{j}." + gate + ".weight"),
      "experts.up_EDF": _stack(T, p, n, "experts.{j}." + up + ".weight"),
      "experts.down_EFD": _stack(T, p, n, "experts.{j}." + down + ".weight"),
    }

  return expect


def _shared(T, p):
  return {
    "shared.gate_EDF": T[p + "gate_proj.weight"].T[None],
    "shared.up_EDF": T[p + "up_proj.weight"].T[None],
    "shared.down_EFD": T[p + "down_proj.weight"].T[None],
  }


def _qwen2(T, p, n):
  return {
    **_per_expert("gate_proj", "up_proj", "down_proj")(T, p, n),
    **_shared(T, p + "shared_expert."),
    "shared_gate_D": T[p + "shared_expert_gate.weight"][0],
  }


def _deepseek(T, p, n):
  return {
    **_per_expert("gate_proj", "up_proj", "down_proj")(T, p, n),
    **_shared(T, p + "shared_experts."),
    "router_bias": T[p + "gate.e_score_correction_bias"],
  }


def _gpt_oss(T, p, n):
  gu, gub = T[p + "experts.gate_up_proj"], T[p + "experts.gate_up_proj_bias"]
  return {
    "router_DE": T[p + "router.weight"].T,
    "router_logit_bias": T[p + "router.bias"],
    "experts.gate_EDF": gu[..., 0::2],
    "experts.up_EDF": gu[..., 1::2],
    "experts.gate_b_EF": gub[..., 0::2],
    "experts.up_b_EF": gub[..., 1::2],
    "experts.down_EFD": T[p + "experts.down_proj"],
    "experts.down_b_ED": T[p + "experts.down_proj_bias"],
  }


def _dbrx(T, p, n):
  def experts(name):
    return T[p + "experts.mlp." + name].reshape(n, -1, T[p + "experts.mlp." + name].shape[-1])

  return {
    "router_DE": T[p + "router.layer.weight"].T,
    "experts.gate_EDF": _T(experts("w1")),
    "experts.up_EDF": _T(experts("v1")),
    "experts.down_EFD": experts("w2"),
  }


def _granite(T, p, n):
  w = T[p + "input_linear.weight"]  # [E, 2F, D]: gate rows first, then up
  F = w.shape[1] // 2
  return {
    "router_DE": T[p + "router.layer.weight"].T,
    "experts.gate_EDF": _T(w[:, :F]),
    "experts.up_EDF": _T(w[:, F:]),
    "experts.down_EFD": _T(T[p + "output_linear.weight"]),
  }


def _llama4(T, p, n):
  gu = T[p + "experts.gate_up_proj"]  # [E, D, 2F]: gate columns first, then up
  F = gu.shape[-1] // 2
  return {
    "router_DE": T[p + "router.weight"].T,
    "experts.gate_EDF": gu[..., :F],
    "experts.up_EDF": gu[..., F:],
    "experts.down_EFD": T[p + "experts.down_proj"],
    **_shared(T, p + "shared_expert."),
  }


EXPECT = {
  "mixtral": _per_expert("w1", "w3", "w2"),
  "jamba": _per_expert("gate_proj", "up_proj", "down_proj", router="router.weight"),
  "olmoe": _per_expert("gate_proj", "up_proj", "down_proj"),
  "qwen3_moe": _per_expert("gate_proj", "up_proj", "down_proj"),
  "qwen2_moe": _qwen2,
  "deepseek_v3": _deepseek,
  "gpt_oss": _gpt_oss,
  "gpt_oss_mxfp4": _gpt_oss,
  "dbrx": _dbrx,
  "granitemoe": _granite,
  "llama4": _llama4,
  "llama4_text": _llama4,
}
# The MoEConfig fields each family's config.json must give (besides D, F, E, K).
EXPECT_CONFIG = {
  "mixtral": dict(normalize_top_k=True),
  "jamba": dict(normalize_top_k=False),
  "olmoe": dict(normalize_top_k=False),
  "qwen3_moe": dict(normalize_top_k=True),
  "qwen2_moe": dict(
    normalize_top_k=False, num_shared_experts=1, shared_d_ff=6, shared_expert_gate=True
  ),
  "deepseek_v3": dict(
    score_func="sigmoid", num_groups=4, top_k_groups=2, routed_scaling=2.5, bias_balancing=True,
    num_shared_experts=1, shared_d_ff=8, normalize_top_k=True,
  ),
  "gpt_oss": dict(
    expert_type="clamped_swiglu", expert_bias=True, router_logit_bias=True, swiglu_limit=7.0,
    swiglu_alpha=1.702, normalize_top_k=True,
  ),
  "dbrx": dict(normalize_top_k=True, normalize_p=2.0),
  "granitemoe": dict(normalize_top_k=True),
  "llama4_text": dict(
    score_func="sigmoid", normalize_top_k=False, weights_on="input", num_shared_experts=1,
    shared_d_ff=4,
  ),
}  # fmt: skip
EXPECT_CONFIG["gpt_oss_mxfp4"] = EXPECT_CONFIG["gpt_oss"]
EXPECT_CONFIG["llama4"] = EXPECT_CONFIG["llama4_text"]


def _leaves(params):
  return {
    jax.tree_util.keystr(p, simple=True, separator="."): np.asarray(a)
    for p, a in jax.tree_util.tree_leaves_with_path(params)
  }


def _tensors(folder):
  """Every tensor of a folder's safetensors files, name -> (array, file)."""
  out = {}
  for f in sorted(folder.glob("*.safetensors")):
    with safe_open(f, framework="numpy") as h:
      out.update({k: (h.get_tensor(k), f.name) for k in h.keys()})  # noqa: SIM118
  return out


@pytest.mark.parametrize("model_type", FAMILIES)
def test_load_maps_each_tensor_to_its_leaf(tmp_path, model_type):
  _, T = hf_checkpoints.write(tmp_path, model_type, files=2)
  cfg, stack = hf.load_moe_layers(tmp_path)
  for k, v in EXPECT_CONFIG[model_type].items():
    assert getattr(cfg, k) == v, k
  assert hf.moe_layers(tmp_path) == MOE_LAYERS[model_type]
  stacked = _leaves(stack)
  for pos, i in enumerate(MOE_LAYERS[model_type]):
    c1, params = hf.load_moe_layer(tmp_path, i)
    assert c1 == cfg
    got = _leaves(params)
    want = EXPECT[model_type](T, PREFIX[model_type].format(i=i), cfg.num_experts)
    assert sorted(got) == sorted(want)
    for k, w in want.items():
      np.testing.assert_array_equal(got[k], w, err_msg=k)
      np.testing.assert_array_equal(stacked[k][pos], w, err_msg=k)
      assert got[k].dtype == (np.float32 if k in ("router_DE", "router_bias") else w.dtype), k


@pytest.mark.parametrize("model_type", FAMILIES)
@pytest.mark.parametrize("dtype", [np.float32, BF16], ids=["f32", "bf16"])
def test_save_of_load_gives_back_every_tensor(tmp_path, model_type, dtype):
  src, out = tmp_path / "src", tmp_path / "out"
  hf_checkpoints.write(src, model_type, dtype=dtype, files=3)
  cfg, params = hf.load_moe_layers(src)
  assert cfg.param_dtype == dtype
  hf.save_moe_layers(out, cfg, params, like=src)
  before, after = _tensors(src), _tensors(out)
  config = json.loads((out / "config.json").read_text())
  if model_type == "gpt_oss_mxfp4":
    # Written dequantized: bfloat16 under the unquantized names, no quantization_config.
    assert "quantization_config" not in config
    quantized = {k for k in before if k.endswith(("_blocks", "_scales"))}
    assert {k.rsplit("_", 1)[0] for k in quantized} == {k for k in after if k not in before}
    for k in quantized:
      before.pop(k)
    again_cfg, again = hf.load_moe_layers(out)
    assert again_cfg == cfg
    jax.tree.map(np.testing.assert_array_equal, again, params)
  else:
    assert config == json.loads((src / "config.json").read_text())
    assert sorted(after) == sorted(before)
  for k, (a, _) in before.items():
    assert after[k][0].dtype == a.dtype, k
    np.testing.assert_array_equal(after[k][0], a, err_msg=k)
  index = json.loads((out / "model.safetensors.index.json").read_text())
  assert index["weight_map"] == {k: f for k, (_, f) in after.items()}
  assert index["metadata"]["total_size"] == sum(a.nbytes for a, _ in after.values())


def test_save_writes_changed_params_in_the_checkpoint_layout(tmp_path):
  # A trained value lands in the right tensor and element (granite: gate half, transposed).
  src, out = tmp_path / "src", tmp_path / "out"
  hf_checkpoints.write(src, "granitemoe")
  cfg, params = hf.load_moe_layers(src)
  gate = params.experts.gate_EDF.at[1, 2, 3, 0].set(42.0)  # layer 1, expert 2, d 3, f 0
  params = jax.tree.map(lambda a: a, params)
  params = params.__class__(**{**params.__dict__, "experts": params.experts.__class__(
    **{**params.experts.__dict__, "gate_EDF": gate})})  # fmt: skip
  hf.save_moe_layers(out, cfg, params, like=src)
  w = _tensors(out)["model.layers.1.block_sparse_moe.input_linear.weight"][0]
  assert w[2, 0, 3] == 42.0 and np.sum(w == 42.0) == 1


def test_save_with_a_subset_of_layers(tmp_path):
  src, out = tmp_path / "src", tmp_path / "out"
  _, T = hf_checkpoints.write(src, "mixtral")
  cfg, params = hf.load_moe_layer(src, 1)
  doubled = jax.tree.map(lambda a: 2 * a[None], params)
  hf.save_moe_layers(out, cfg, doubled, like=src, layers=[1])
  after = _tensors(out)
  name = "model.layers.1.block_sparse_moe.experts.3.w2.weight"
  np.testing.assert_array_equal(after[name][0], 2 * T[name])
  name = "model.layers.0.block_sparse_moe.experts.3.w2.weight"
  np.testing.assert_array_equal(after[name][0], T[name])


# --------------------------------------------------------------------------- MXFP4


def _fp4_reference(code):
  """The value of a 4-bit e2m1 code from its bits: sign, 2 exponent bits (bias 1), 1 mantissa."""
  sign = -1.0 if code & 8 else 1.0
  e, m = (code >> 1) & 3, code & 1
  return sign * (m * 0.5 if e == 0 else (1 + m * 0.5) * 2.0 ** (e - 1))


def test_mxfp4_dequantize_matches_the_published_format():
  rng = np.random.default_rng(0)
  blocks = rng.integers(0, 256, size=(2, 3, 2, 16), dtype=np.uint8)
  scales = rng.integers(120, 135, size=(2, 3, 2), dtype=np.uint8)
  want = np.zeros((2, 3, 64), np.float64)
  for idx in np.ndindex(2, 3, 2, 16):
    e, n, g, i = idx
    byte, s = int(blocks[idx]), 2.0 ** (int(scales[e, n, g]) - 127)
    want[e, n, 32 * g + 2 * i] = _fp4_reference(byte & 0xF) * s  # low nibble first
    want[e, n, 32 * g + 2 * i + 1] = _fp4_reference(byte >> 4) * s
  for dtype in (np.float32, BF16):
    got = hf.dequantize_mxfp4(blocks, scales, dtype)
    assert got.dtype == dtype
    np.testing.assert_array_equal(got.astype(np.float64), want)


def test_mxfp4_checkpoint_loads_dequantized(tmp_path):
  # The writer quantizes exactly representable values: the loaded experts are those values,
  # in transformers' layout ([E, D, 2F] gate/up interleaved, [E, F, D] down).
  _, T = hf_checkpoints.write(tmp_path, "gpt_oss_mxfp4")
  cfg, params = hf.load_moe_layer(tmp_path, 1)
  assert cfg.param_dtype == np.float32  # the biases are float32: nothing is lost
  got = _leaves(params)
  gu = T["model.layers.1.mlp.experts.gate_up_proj"]
  np.testing.assert_array_equal(got["experts.gate_EDF"], gu[..., 0::2])
  np.testing.assert_array_equal(got["experts.down_EFD"], T["model.layers.1.mlp.experts.down_proj"])
  cfg, params = hf.load_moe_layer(tmp_path, 1, dtype=ml_dtypes.bfloat16)
  assert params.experts.up_EDF.dtype == BF16 and params.router_DE.dtype == np.float32
  np.testing.assert_array_equal(np.asarray(params.experts.up_EDF, np.float32), gu[..., 1::2])


# --------------------------------------------------------------------------- mesh, bytes


@pytest.fixture(scope="module")
def mesh24():
  return jax.make_mesh((2, 4), ("data", "expert"))


@pytest.mark.parametrize("model_type", FAMILIES)
def test_mesh_places_every_leaf(tmp_path, model_type, mesh24):
  hf_checkpoints.write(tmp_path, model_type)
  cfg, want = hf.load_moe_layers(tmp_path)
  cfg, got = hf.load_moe_layers(tmp_path, mesh=mesh24)
  specs = jax.tree.leaves(ms.moe_param_specs(cfg), is_leaf=lambda x: isinstance(x, P))
  assert len(specs) == len(jax.tree.leaves(got))
  for a, w, spec in zip(jax.tree.leaves(got), jax.tree.leaves(want), specs):
    assert a.sharding.spec == P(None, *spec), (a.sharding.spec, spec)
    assert a.sharding.mesh == mesh24
    np.testing.assert_array_equal(np.asarray(a), np.asarray(w))
  i = MOE_LAYERS[model_type][0]
  cfg, one = hf.load_moe_layer(tmp_path, i, mesh=mesh24)
  for a, spec in zip(jax.tree.leaves(one), specs):
    assert a.sharding.spec == spec


@pytest.mark.parametrize("model_type", ["mixtral", "gpt_oss", "dbrx", "gpt_oss_mxfp4"])
def test_reads_only_the_block_and_each_byte_once(tmp_path, model_type, mesh24):
  # Only the layer's MoE tensors are read (no embedding, attention or other layer), each byte
  # once, also when two leaves share one fused tensor or two devices the same experts.
  _, T = hf_checkpoints.write(tmp_path, model_type)
  p = PREFIX[model_type].format(i=1)
  block = sum(a.nbytes for k, a in T.items() if k.startswith(p) and not k.endswith("_proj"))
  if model_type != "gpt_oss_mxfp4":
    block = sum(a.nbytes for k, a in T.items() if k.startswith(p))
  for mesh in (None, mesh24):
    hf.reset_bytes_read()
    hf.load_moe_layer(tmp_path, 1, mesh=mesh)
    assert hf.bytes_read() == block, mesh


# --------------------------------------------------------------------------- errors


def _edit_config(folder, **changes):
  c = json.loads((folder / "config.json").read_text())
  c.update(changes)
  (folder / "config.json").write_text(json.dumps(c))


def test_error_unsupported_architecture(tmp_path):
  hf_checkpoints.write(tmp_path, "mixtral")
  _edit_config(tmp_path, model_type="llama")
  with pytest.raises(ValueError, match=r"model_type 'llama' is not a supported .*dbrx.*mixtral"):
    hf.load_moe_layer(tmp_path, 0)


def test_error_missing_tensor(tmp_path):
  hf_checkpoints.write(tmp_path, "mixtral", files=2)
  index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
  del index["weight_map"]["model.layers.1.block_sparse_moe.experts.2.w3.weight"]
  (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
  with pytest.raises(
    ValueError,
    match=r"tensor 'model.layers.1.block_sparse_moe.experts.2.w3.weight' is missing from "
    r".*model.safetensors.index.json",
  ):
    hf.load_moe_layer(tmp_path, 1)


def test_error_shape_disagrees_with_config(tmp_path):
  hf_checkpoints.write(tmp_path, "granitemoe")
  _edit_config(tmp_path, intermediate_size=5)
  with pytest.raises(
    ValueError,
    match=r"tensor 'model.layers.0.block_sparse_moe.input_linear.weight' has shape "
    r"\(4, 8, 8\), but config.json implies \(4, 10, 8\)",
  ):
    hf.load_moe_layer(tmp_path, 0)


@pytest.mark.parametrize(
  "model_type, layer, field",
  [
    ("deepseek_v3", 0, r"i < first_k_dense_replace \(1\)"),
    ("qwen2_moe", 1, r"mlp_only_layers \[1\] contains 1"),
    ("qwen3_moe", 0, r"decoder_sparse_step \(2\)"),
    ("jamba", 2, r"expert_layer_period \(2\) != expert_layer_offset \(1\)"),
    ("llama4", 0, r"interleave_moe_layer_step"),
  ],
)
def test_error_dense_layer(tmp_path, model_type, layer, field):
  hf_checkpoints.write(tmp_path, model_type)
  with pytest.raises(ValueError, match=rf"layer {layer} is dense, not MoE.*{field}"):
    hf.load_moe_layer(tmp_path, layer)


@pytest.mark.parametrize("layer", [-1, 2, 1.0])
def test_error_layer_out_of_range(tmp_path, layer):
  hf_checkpoints.write(tmp_path, "mixtral")
  with pytest.raises(ValueError, match=r"layer must be an int in \[0, 2\) \(num_hidden_layers=2"):
    hf.load_moe_layer(tmp_path, layer)


def test_error_pickle_only_folder_is_never_opened(tmp_path):
  (tmp_path / "config.json").write_text(json.dumps(dict(model_type="mixtral")))
  # Not a pickle at all: a loader that opened it would fail differently.
  (tmp_path / "pytorch_model.bin").write_bytes(b"not read")
  with pytest.raises(
    ValueError, match=r"only PyTorch pickle files \(pytorch_model.bin\).*safetensors"
  ):
    hf.load_moe_layer(tmp_path, 0)


def test_error_no_config(tmp_path):
  with pytest.raises(FileNotFoundError, match=r"has no config.json"):
    hf.load_moe_layers(tmp_path)


def test_error_unsupported_quantization(tmp_path):
  hf_checkpoints.write(tmp_path, "deepseek_v3")
  _edit_config(tmp_path, quantization_config=dict(quant_method="fp8"))
  with pytest.raises(ValueError, match=r"quant_method 'fp8' is not supported for deepseek_v3"):
    hf.load_moe_layers(tmp_path)


def test_error_activation_it_cannot_express(tmp_path):
  hf_checkpoints.write(tmp_path, "olmoe")
  _edit_config(tmp_path, hidden_act="gelu")
  with pytest.raises(ValueError, match=r"hidden_act must be 'silu'.*got 'gelu'"):
    hf.load_moe_layer(tmp_path, 0)


def test_error_save_over_its_source(tmp_path):
  hf_checkpoints.write(tmp_path, "mixtral")
  cfg, params = hf.load_moe_layers(tmp_path)
  with pytest.raises(ValueError, match=r"path must differ from like"):
    hf.save_moe_layers(tmp_path, cfg, params, like=tmp_path)


def test_error_save_stack_of_the_wrong_length(tmp_path):
  hf_checkpoints.write(tmp_path, "mixtral")
  cfg, params = hf.load_moe_layer(tmp_path, 0)
  with pytest.raises(ValueError, match=r"params.router_DE must be stacked on a leading axis of 2"):
    hf.save_moe_layers(tmp_path / "out", cfg, params, like=tmp_path)


def test_error_abstract_mesh(tmp_path, mesh24):
  hf_checkpoints.write(tmp_path, "mixtral")
  with pytest.raises(ValueError, match=r"mesh must be a concrete jax.sharding.Mesh"):
    hf.load_moe_layer(tmp_path, 0, mesh=mesh24.abstract_mesh)


def test_error_mesh_that_does_not_divide_the_experts(tmp_path):
  hf_checkpoints.write(tmp_path, "mixtral")  # 4 experts
  with pytest.raises(ValueError, match=r"load_moe_layer: num_experts \(4\) must be divisible"):
    hf.load_moe_layer(tmp_path, 0, mesh=jax.make_mesh((8,), ("expert",)))


def test_error_dbrx_uniform_expert_assignment(tmp_path):
  hf_checkpoints.write(tmp_path, "dbrx")
  c = json.loads((tmp_path / "config.json").read_text())
  _edit_config(tmp_path, ffn_config=dict(c["ffn_config"], uniform_expert_assignment=True))
  with pytest.raises(ValueError, match=r"uniform_expert_assignment must be false"):
    hf.load_moe_layer(tmp_path, 0)


def test_importing_moe_shard_does_not_import_safetensors():
  code = "import sys, moe_shard; assert 'safetensors' not in sys.modules; from moe_shard import hf"
  subprocess.run(
    [sys.executable, "-c", code], check=True, env=dict(os.environ, JAX_PLATFORMS="cpu")
  )
