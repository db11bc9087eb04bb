"""`moe_shard.hf`: Hugging Face checkpoints to `MoEParams` and back, with no torch.

Each family's checkpoint is written here in its own tensor names (`hf_checkpoints.py`), and
what the loader makes of it is compared with the transforms written out below in NumPy, one
function per family, from the published layouts (torch Linear weights [out, in], DBRX's
[E*F, D] rows, Granite's [E, 2F, D] halves, gpt-oss's interleaved gate/up, MXFP4,
block-FP8). The comparison with the transformers blocks themselves is `test_hf_models.py`.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import hf_checkpoints
import jax
import ml_dtypes
import numpy as np
import pytest
from hf_checkpoints import BF16, MOE_LAYERS, PREFIX
from jax.sharding import PartitionSpec as P
from safetensors.numpy import save_file

import moe_shard as ms
from moe_shard import hf
from moe_shard.hf import fp8
from moe_shard.hf.families import text_config

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
  "deepseek_v3_fp8": _deepseek,
  "gpt_oss": _gpt_oss,
  "gpt_oss_mxfp4": _gpt_oss,
  "dbrx": _dbrx,
  "granitemoe": _granite,
  "llama4": _llama4,
  "llama4_text": _llama4,
}
# The MoEConfig fields each family's config.json must give (besides D, F, E, K). The aux-loss
# weights: K * router_aux_loss_coef (transformers' default when absent: 0.001, OLMoE 0.01;
# None: 0), DBRX K * moe_loss_weight, DeepSeek-V3 aux_loss_alpha, Llama-4 0 (transformers
# computes no balance loss); z_loss_coef router_z_loss_coef, else 0.
EXPECT_CONFIG = {
  "mixtral": dict(normalize_top_k=True, load_balance_coef=2 * 0.02, z_loss_coef=0.0),
  "jamba": dict(normalize_top_k=False, load_balance_coef=2 * 0.001, z_loss_coef=0.0),
  "olmoe": dict(normalize_top_k=False, load_balance_coef=2 * 0.01, z_loss_coef=0.001),
  "qwen3_moe": dict(normalize_top_k=True, load_balance_coef=2 * 0.001, z_loss_coef=0.0),
  "qwen2_moe": dict(
    normalize_top_k=False, num_shared_experts=1, shared_d_ff=6, shared_expert_gate=True,
    load_balance_coef=2 * 0.001, z_loss_coef=0.0,
  ),
  "deepseek_v3": dict(
    score_func="sigmoid", num_groups=4, top_k_groups=2, routed_scaling=2.5, bias_balancing=True,
    num_shared_experts=1, shared_d_ff=8, normalize_top_k=True, load_balance_coef=1e-4,
    z_loss_coef=0.0,
  ),
  "gpt_oss": dict(
    expert_type="clamped_swiglu", expert_bias=True, router_logit_bias=True, swiglu_limit=7.0,
    swiglu_alpha=1.702, normalize_top_k=True, load_balance_coef=2 * 0.001, z_loss_coef=0.0,
  ),
  "dbrx": dict(normalize_top_k=True, normalize_p=2.0, load_balance_coef=2 * 0.05, z_loss_coef=0.0),
  "granitemoe": dict(normalize_top_k=True, load_balance_coef=0.0, z_loss_coef=0.0),
  "llama4_text": dict(
    score_func="sigmoid", normalize_top_k=False, weights_on="input", num_shared_experts=1,
    shared_d_ff=4, load_balance_coef=0.0, z_loss_coef=0.0,
  ),
}  # fmt: skip
EXPECT_CONFIG["gpt_oss_mxfp4"] = EXPECT_CONFIG["gpt_oss"]
EXPECT_CONFIG["deepseek_v3_fp8"] = EXPECT_CONFIG["deepseek_v3"]
EXPECT_CONFIG["llama4"] = EXPECT_CONFIG["llama4_text"]


def _leaves(params):
  return {
    jax.tree_util.keystr(p, simple=True, separator="."): np.asarray(a)
    for p, a in jax.tree_util.tree_leaves_with_path(params)
  }


_DTYPES = {
  "F32": np.dtype(np.float32), "BF16": BF16, "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn),
  "U8": np.dtype(np.uint8), "I32": np.dtype(np.int32),
}  # fmt: skip


def _tensors(folder):
  """Every tensor of a folder's safetensors files, name -> (array, file), parsed from the
  bytes (an 8-byte header length, a JSON header of dtype, shape, data_offsets, the data)."""
  out = {}
  for f in sorted(folder.glob("*.safetensors")):
    raw = f.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8 : 8 + n])
    header.pop("__metadata__", None)
    for k, m in header.items():
      begin, end = m["data_offsets"]
      a = np.frombuffer(raw[8 + n + begin : 8 + n + end], _DTYPES[m["dtype"]])
      out[k] = (a.reshape(m["shape"]), f.name)
  return out


def _assert_bits_equal(a, b, err_msg=""):
  assert a.dtype == b.dtype and a.shape == b.shape, err_msg
  np.testing.assert_array_equal(a.view(np.uint8), b.view(np.uint8), err_msg=err_msg)


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
  assert cfg.param_dtype == (BF16 if model_type == "deepseek_v3_fp8" else dtype)
  hf.save_moe_layers(out, cfg, params, like=src)
  before, after = _tensors(src), _tensors(out)
  config = json.loads((out / "config.json").read_text())
  assert config == json.loads((src / "config.json").read_text())  # MXFP4: quantization_config
  assert sorted(after) == sorted(before)  # MXFP4: the `_blocks` and `_scales` tensors
  for k, (a, _) in before.items():
    _assert_bits_equal(after[k][0], a, err_msg=k)
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


def _mxfp4_reference(v):
  """Fresh MXFP4 of one block of 32 values, element by element in float64: the smallest
  power of two 2^e with max|v| / 2^e <= 6, each v / 2^e rounded to the nearest e2m1 value,
  ties to the code whose mantissa bit is 0. Returns (codes [32], biased exponent)."""
  amax = max(abs(float(x)) for x in v)
  e = -127
  while amax / 2.0**e > 6:
    e += 1
  codes = []
  for x in v:
    q = float(x) / 2.0**e
    dist = [(abs(abs(q) - _fp4_reference(c)), c & 1, c) for c in range(8)]
    code = min(dist)[2]  # nearest, then the even mantissa
    codes.append(code | (8 if np.signbit(q) else 0))
  return codes, e + 127


def test_mxfp4_quantize_keeps_scales_that_fit_and_rounds_the_rest():
  rng = np.random.default_rng(1)
  blocks = rng.integers(0, 256, size=(2, 3, 2, 16), dtype=np.uint8)
  scales = rng.integers(120, 135, size=(2, 3, 2), dtype=np.uint8)
  v = hf.dequantize_mxfp4(blocks, scales, np.float32)
  b, s = hf.quantize_mxfp4(v, scales)  # every block fits its scale: bit for bit
  np.testing.assert_array_equal(b, blocks)
  np.testing.assert_array_equal(s, scales)
  # Ties (0.25, 0.75, 1.25, 2.5, 5 times the scale), values between codes, a signed zero.
  ties = np.array([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.25, -0.0, 0.3, -2.7, 4.9, 6.0])
  w = v.astype(np.float64)
  w[0, 0, :32] = 0.0
  w[0, 0, :13] = ties  # max 6: the fresh scale is 2^0, the ties stay ties
  w[1, 2, 32:] = rng.normal(size=32) * 3.7
  w[1, 1, 40] = 1e-3  # too small for its block's scale: the block gets a fresh one
  b, s = hf.quantize_mxfp4(w, scales)
  for e, n, g in np.ndindex(2, 3, 2):
    if (e, n, g) in [(0, 0, 0), (1, 2, 1), (1, 1, 1)]:
      codes, exp = _mxfp4_reference(w[e, n, 32 * g : 32 * (g + 1)])
      assert s[e, n, g] == exp, (e, n, g)
      got = np.stack([b[e, n, g] & 0xF, b[e, n, g] >> 4], -1).reshape(-1)
      np.testing.assert_array_equal(got, codes, err_msg=str((e, n, g)))
    else:
      assert s[e, n, g] == scales[e, n, g], (e, n, g)
      np.testing.assert_array_equal(b[e, n, g], blocks[e, n, g])
  # By hand: 0.25 -> 0, 0.75 -> 1, 1.25 -> 1, 1.75 -> 2, 2.5 -> 2, 3.5 -> 4, 5 -> 4 (ties to the
  # even code), -0.25 -> -0, -0 -> -0, 0.3 -> 0.5, -2.7 -> -3, 4.9 -> 4, 6 -> 6.
  got = np.stack([b[0, 0, 0] & 0xF, b[0, 0, 0] >> 4], -1).reshape(-1)
  assert s[0, 0, 0] == 127
  np.testing.assert_array_equal(got[:13], [0, 2, 2, 4, 4, 6, 6, 8, 8, 1, 13, 6, 7])


def test_save_requantizes_a_changed_mxfp4_block_only(tmp_path):
  src, out = tmp_path / "src", tmp_path / "out"
  hf_checkpoints.write(src, "gpt_oss_mxfp4")
  cfg, params = hf.load_moe_layers(src)
  # Layer 1, expert 2, d 5, f 3: in the checkpoint's down_proj [E, D, F] order row 5, block 0.
  down = params.experts.down_EFD.at[1, 2, 3, 5].add(0.01)
  experts = dataclasses.replace(params.experts, down_EFD=down)
  hf.save_moe_layers(out, cfg, dataclasses.replace(params, experts=experts), like=src)
  before, after = _tensors(src), _tensors(out)
  name = "model.layers.1.mlp.experts.down_proj"
  b0, s0 = before[name + "_blocks"][0], before[name + "_scales"][0]
  b1, s1 = after[name + "_blocks"][0], after[name + "_scales"][0]
  changed = np.zeros(s0.shape, bool)
  changed[2, 5, 0] = True
  np.testing.assert_array_equal(s1[~changed], s0[~changed])
  np.testing.assert_array_equal(b1[~changed], b0[~changed])
  block = np.asarray(down[1, 2, :, 5], np.float64)  # the 32 values of that block
  codes, exp = _mxfp4_reference(block)
  assert s1[2, 5, 0] == exp
  np.testing.assert_array_equal(np.stack([b1[2, 5, 0] & 0xF, b1[2, 5, 0] >> 4], -1).ravel(), codes)
  for k in before:
    if k != name + "_blocks" and k != name + "_scales":
      np.testing.assert_array_equal(after[k][0], before[k][0], err_msg=k)


# --------------------------------------------------------------------------- block-FP8


def test_fp8_checkpoint_loads_dequantized_in_the_dtype_asked(tmp_path):
  hf_checkpoints.write(tmp_path, "deepseek_v3_fp8")
  raw = _tensors(tmp_path)
  name = "model.layers.2.mlp.experts.5.down_proj.weight"  # [D, F] = [8, 4], blocks 3 x 5
  w, s = raw[name][0], raw[name + "_scale_inv"][0]
  assert w.dtype == ml_dtypes.float8_e4m3fn and s.shape == (3, 1)
  want = np.array([[float(w[o, i]) * float(s[o // 3, i // 5]) for i in range(4)] for o in range(8)])
  _, params = hf.load_moe_layer(tmp_path, 2, dtype=np.float32)
  np.testing.assert_array_equal(np.asarray(params.experts.down_EFD[5]), want.T.astype(np.float32))
  assert params.router_DE.dtype == np.float32


def test_fp8_save_keeps_the_scales_and_encodes_a_changed_value(tmp_path):
  src, out = tmp_path / "src", tmp_path / "out"
  hf_checkpoints.write(src, "deepseek_v3_fp8")
  cfg, params = hf.load_moe_layers(src, dtype=np.float32)
  name = "model.layers.2.mlp.experts.5.gate_proj.weight"  # [F, D] = [4, 8]; leaf [D, F]
  scale = _tensors(src)[name + "_scale_inv"][0]
  value = np.float32(scale[1, 1]) * np.float32(3.0)  # f 3, d 6: block (1, 1)
  gate = params.experts.gate_EDF.at[1, 5, 6, 3].set(value)
  changed = dataclasses.replace(params, experts=dataclasses.replace(params.experts, gate_EDF=gate))
  hf.save_moe_layers(out, cfg, changed, like=src)
  before, after = _tensors(src), _tensors(out)
  w0, w1 = before[name][0], after[name][0]
  assert float(w1[3, 6]) == 3.0
  mask = np.ones(w0.shape, bool)
  mask[3, 6] = False
  _assert_bits_equal(w1[mask], w0[mask])
  _assert_bits_equal(after[name + "_scale_inv"][0], scale)
  big = params.experts.gate_EDF.at[1, 5, 6, 3].set(1e6)
  too_big = dataclasses.replace(params, experts=dataclasses.replace(params.experts, gate_EDF=big))
  with pytest.raises(
    ValueError, match=rf"save_moe_layers: tensor '{name}' has a value of .* beyond FP8 e4m3's 448"
  ):
    hf.save_moe_layers(tmp_path / "big", cfg, too_big, like=src)


@pytest.mark.parametrize("dtype", [np.float32, ml_dtypes.bfloat16], ids=["f32", "bf16"])
def test_fp8_every_code_comes_back_bit_for_bit(dtype):
  """What hf/fp8.py's docstring says is bit-exact: each of the 254 finite e4m3 codes (-0
  included), dequantized in float32 or bfloat16 with a scale from 2^-117 to 2^118 and
  quantized again with that scale, is the same code; quotients up to one step (32) past
  448 saturate, further or not finite raise."""
  codes = np.arange(256, dtype=np.uint8).view(fp8.E4M3)
  codes = codes[np.isfinite(codes.astype(np.float32))].reshape(2, 127)
  assert codes.size == 254
  for e in range(-117, 119, 3):
    scale = np.full((1, 1), np.float32(2.0**e * 1.37), np.float32)
    values = fp8.dequantize(codes, scale, (128, 128), dtype)
    _assert_bits_equal(fp8.quantize("w", values, scale, (128, 128)), codes)
  one = np.ones((1, 1), np.float32)
  np.testing.assert_array_equal(
    fp8.quantize("w", np.float32([[479.0, -470.0]]), one, (128, 128)).astype(np.float32),
    [[448.0, -448.0]],
  )
  with pytest.raises(
    ValueError, match=r"tensor 'w' has a value of 481.0 times .* more than one step"
  ):
    fp8.quantize("w", np.float32([[481.0]]), one, (128, 128))
  with pytest.raises(ValueError, match=r"tensor 'w' holds a value that is not finite"):
    fp8.quantize("w", np.float32([[np.nan]]), one, (128, 128))


def test_fp8_rows_that_start_inside_a_scale_block(tmp_path, mesh24):
  # DBRX keeps each expert matrix as rows [e*F, (e + 1)*F) of one [E*F, D] tensor: over the
  # 4 devices of the expert axis each device reads one expert's F = 4 rows, and with scale
  # blocks of 3 rows the reads at rows 4 and 8 start inside a block.
  _, T = hf_checkpoints.write(tmp_path, "dbrx")
  bo, bi = 3, 5
  rng = np.random.default_rng(1)
  tensors, want = {k: a for k, (a, _) in _tensors(tmp_path).items()}, dict(T)
  for name in [k for k in tensors if ".experts.mlp." in k]:
    rows, cols = tensors[name].shape
    codes = np.clip(rng.normal(size=(rows, cols)) * 100, -448, 448).astype(ml_dtypes.float8_e4m3fn)
    scale = rng.uniform(1e-3, 1e-2, size=(-(-rows // bo), -(-cols // bi))).astype(np.float32)
    tensors[name], tensors[name + "_scale_inv"] = codes, scale
    want[name] = np.array(
      [
        [float(codes[o, i]) * float(scale[o // bo, i // bi]) for i in range(cols)]
        for o in range(rows)
      ]
    )
  save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
  _edit_config(tmp_path, quantization_config=dict(quant_method="fp8", weight_block_size=[bo, bi]))
  cfg, got = hf.load_moe_layers(tmp_path, mesh=mesh24, dtype=np.float32)
  assert got.experts.down_EFD.sharding.spec == P(None, "expert", None, None)
  got = _leaves(got)
  for pos, i in enumerate(MOE_LAYERS["dbrx"]):
    for k, w in EXPECT["dbrx"](want, PREFIX["dbrx"].format(i=i), cfg.num_experts).items():
      # An e4m3 code times an f32 scale is exact in float64: one rounding to float32.
      np.testing.assert_array_equal(got[k][pos], w.astype(np.float32), err_msg=k)


def test_error_fp8_scales_of_another_block(tmp_path):
  hf_checkpoints.write(tmp_path, "deepseek_v3_fp8")
  c = json.loads((tmp_path / "config.json").read_text())
  _edit_config(
    tmp_path, quantization_config=dict(c["quantization_config"], weight_block_size=[4, 4])
  )
  with pytest.raises(ValueError, match=r"tensor 'model.layers.1.mlp.experts.0.gate_proj.weight_"
                     r"scale_inv' has shape \(2, 2\), .* in blocks of \[4, 4\] implies \(1, 2\)"):  # fmt: skip
    hf.load_moe_layer(tmp_path, 1)


def test_error_fp8_without_scales(tmp_path):
  hf_checkpoints.write(tmp_path, "mixtral")
  tensors = {k: a.astype(ml_dtypes.float8_e4m3fn) for k, (a, _) in _tensors(tmp_path).items()}
  save_file(tensors, tmp_path / "model.safetensors")
  with pytest.raises(ValueError, match=r"tensor 'model.layers.0.block_sparse_moe.experts.0.w1."
                     r"weight' has dtype F8_E4M3 without block scales .*dequantize"):  # fmt: skip
    hf.load_moe_layer(tmp_path, 0)


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


@pytest.mark.parametrize(
  "model_type", ["mixtral", "gpt_oss", "dbrx", "gpt_oss_mxfp4", "deepseek_v3_fp8"]
)
def test_reads_only_the_block_and_each_byte_once(tmp_path, model_type, mesh24):
  # Only the layer's MoE tensors are read (no embedding, attention or other layer), each byte
  # once, also when two leaves share one fused tensor or two devices the same experts.
  hf_checkpoints.write(tmp_path, model_type)
  p = PREFIX[model_type].format(i=1)
  block = sum(a.nbytes for k, (a, _) in _tensors(tmp_path).items() if k.startswith(p))
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


@pytest.mark.parametrize(
  "first, freq, want", [(1, 2, [2, 4, 6]), (0, 3, [0, 3, 6]), (2, 3, [3, 6])]
)
def test_deepseek_moe_layer_freq_counts_from_layer_0(tmp_path, first, freq, want):
  # DeepSeek-V3's rule (its modeling_deepseek.py): layer i is MoE when
  # i >= first_k_dense_replace and i % moe_layer_freq == 0; `want` is that, listed by hand.
  hf_checkpoints.write(tmp_path, "deepseek_v3")
  _edit_config(tmp_path, num_hidden_layers=7, first_k_dense_replace=first, moe_layer_freq=freq)
  assert hf.moe_layers(tmp_path) == want
  dense = min(set(range(first, 7)) - set(want))
  with pytest.raises(
    ValueError, match=rf"layer {dense} is dense, not MoE.*i % moe_layer_freq \({freq}\) != 0"
  ):
    hf.load_moe_layer(tmp_path, dense)


@pytest.mark.parametrize("layer", [-1, 2, 1.0, True, np.int64(2), "1"])
def test_error_layer_out_of_range(tmp_path, layer):
  hf_checkpoints.write(tmp_path, "mixtral")
  with pytest.raises(ValueError, match=r"layer must be an int in \[0, 2\) \(num_hidden_layers=2"):
    hf.load_moe_layer(tmp_path, layer)


def test_layer_may_be_a_numpy_integer(tmp_path):
  hf_checkpoints.write(tmp_path, "mixtral")
  cfg, want = hf.load_moe_layer(tmp_path, 1)
  cfg, got = hf.load_moe_layer(tmp_path, np.int64(1))
  jax.tree.map(np.testing.assert_array_equal, got, want)
  cfg, stack = hf.load_moe_layers(tmp_path)
  hf.save_moe_layers(tmp_path / "out", cfg, stack, like=tmp_path, layers=list(np.arange(2)))
  assert json.loads((tmp_path / "out" / "config.json").read_text())["model_type"] == "mixtral"


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


FIXTURES = Path(__file__).parent / "fixtures" / "hf"
LFS = b"version https://git-lfs.github.com/spec/v1\noid sha256:%s\nsize 57720\n" % (b"0" * 64)


@pytest.mark.parametrize(
  "corrupt, error, what",
  [
    # Cut short (an interrupted download): the header promises more bytes than there are.
    (lambda raw: raw[: len(raw) // 2], "incomplete metadata", "truncated or corrupt"),
    # A header of garbage: its 8-byte length reads as an absurd size.
    (lambda raw: b"\xff" * 8 + raw[8:], "header too large", "truncated or corrupt"),
    # A clone without git-lfs leaves the pointer in the file's place.
    (lambda raw: LFS, "header too large", r"Git LFS pointer.*git lfs pull"),
  ],
  ids=["truncated", "garbage_header", "lfs_pointer"],
)
def test_error_corrupt_safetensors_names_the_file(tmp_path, corrupt, error, what):
  shutil.copytree(FIXTURES / "mixtral", tmp_path, dirs_exist_ok=True)
  file = tmp_path / "model.safetensors"
  file.write_bytes(corrupt(file.read_bytes()))
  with pytest.raises(
    ValueError,
    match=rf"load_moe_layers: '{re.escape(str(file))}' is not a readable safetensors file "
    rf"\(.*{error}.*\); .*{what}",
  ):
    hf.load_moe_layers(tmp_path)


@pytest.mark.parametrize("name", ["config.json", "model.safetensors.index.json"])
def test_error_corrupt_json_names_the_file(tmp_path, name):
  hf_checkpoints.write(tmp_path, "mixtral", files=2)
  file = tmp_path / name
  file.write_text(file.read_text()[:-10])
  with pytest.raises(
    ValueError, match=rf"load_moe_layer: '{re.escape(str(file))}' is not valid JSON \(.*\)"
  ):
    hf.load_moe_layer(tmp_path, 0)


def test_error_not_a_folder(tmp_path):
  with pytest.raises(FileNotFoundError, match=r"load_moe_layers: path must be a model folder"):
    hf.load_moe_layers(tmp_path / "absent")


def test_error_no_safetensors(tmp_path):
  (tmp_path / "config.json").write_text(json.dumps(dict(model_type="mixtral")))
  with pytest.raises(FileNotFoundError, match=r"load_moe_layers: .* has no \*.safetensors files"):
    hf.load_moe_layers(tmp_path)


def test_error_config_lacks_a_field(tmp_path):
  hf_checkpoints.write(tmp_path, "mixtral")
  c = json.loads((tmp_path / "config.json").read_text())
  del c["num_experts_per_tok"]
  (tmp_path / "config.json").write_text(json.dumps(c))
  with pytest.raises(ValueError, match=r"load_moe_layer: config.json lacks the field "
                     r"'num_experts_per_tok'"):  # fmt: skip
    hf.load_moe_layer(tmp_path, 0)


def test_error_expert_tensor_not_a_float(tmp_path):
  hf_checkpoints.write(tmp_path, "mixtral", dtype=np.int32)
  with pytest.raises(
    ValueError, match=r"tensor 'model.layers.0.block_sparse_moe.experts.0.w1.weight' has dtype "
    r"I32, not a float dtype"
  ):  # fmt: skip
    hf.load_moe_layer(tmp_path, 0)


def test_error_no_moe_layer(tmp_path):
  hf_checkpoints.write(tmp_path, "jamba")
  _edit_config(tmp_path, expert_layer_period=8, expert_layer_offset=7)  # 4 layers: none MoE
  assert hf.moe_layers(tmp_path) == []
  with pytest.raises(ValueError, match=r"load_moe_layers: .* has no MoE layer"):
    hf.load_moe_layers(tmp_path)


@pytest.mark.parametrize(
  "model_type, change, message",
  [
    ("qwen2_moe", dict(shared_expert_intermediate_size=0),
     r"shared_expert_intermediate_size must be > 0 for qwen2_moe"),
    ("deepseek_v3", dict(scoring_func="softmax"),
     r"scoring_func must be 'sigmoid': transformers' DeepseekV3TopkRouter .*got 'softmax'"),
    ("deepseek_v3", dict(topk_method="greedy"), r"topk_method must be 'noaux_tc' \(got 'greedy'"),
  ],
)  # fmt: skip
def test_error_config_field_it_cannot_express(tmp_path, model_type, change, message):
  hf_checkpoints.write(tmp_path, model_type)
  _edit_config(tmp_path, **change)
  with pytest.raises(ValueError, match=r"load_moe_layers: config.json " + message):
    hf.load_moe_layers(tmp_path)


def test_error_dbrx_activation(tmp_path):
  hf_checkpoints.write(tmp_path, "dbrx")
  c = json.loads((tmp_path / "config.json").read_text())
  _edit_config(tmp_path, ffn_config=dict(c["ffn_config"], ffn_act_fn=dict(name="gelu")))
  with pytest.raises(ValueError, match=r"ffn_config.ffn_act_fn.name must be 'silu' \(got 'gelu'"):
    hf.load_moe_layer(tmp_path, 0)


@pytest.mark.parametrize(
  "model_type",
  ["mixtral", "jamba", "olmoe", "qwen2_moe", "qwen3_moe", "gpt_oss", "granitemoe", "llama4_text"],
)
def test_expert_count_may_be_spelled_either_way(model_type):
  c = dict(hf_checkpoints.CONFIGS[model_type])
  n = c.pop("num_experts", None) or c.pop("num_local_experts")
  family = hf.FAMILIES[model_type]
  cfg = family.config(dict(c, num_experts=n))
  assert cfg["num_experts"] == n
  assert family.config(dict(c, num_local_experts=n)) == cfg
  i = MOE_LAYERS[model_type][0]
  assert family.dense(dict(c, num_experts=n), i) is None
  assert family.dense(dict(c, num_local_experts=n), i) is None
  with pytest.raises(KeyError, match="num_experts"):  # load_*: "config.json lacks the field"
    family.config(c)


@pytest.mark.parametrize("model_type", FAMILIES)
def test_each_family_maps_exactly_the_leaves_of_its_config(model_type):
  # The family table's layouts cover every leaf of the MoEConfig it makes, and no other.
  config = dict(hf_checkpoints.CONFIGS[model_type], model_type=hf_checkpoints.KIND[model_type])
  variants = [config]
  if model_type == "deepseek_v3":
    variants.append(dict(config, n_shared_experts=0))
  for c in variants:
    family = hf.FAMILIES[c["model_type"]]
    text = text_config(c)
    cfg = ms.MoEConfig(**family.config(text))
    leaves = [jax.tree_util.keystr(p, simple=True, separator=".")
              for p, _ in jax.tree_util.tree_leaves_with_path(ms.moe_param_shapes(cfg))]  # fmt: skip
    mapped = [leaf for lay in family.layouts(text) for leaf in lay.leaves]
    assert sorted(mapped) == sorted(leaves)


@pytest.mark.parametrize("method", ["awq", "mxfp4"])
def test_error_unsupported_quantization(tmp_path, method):
  hf_checkpoints.write(tmp_path, "deepseek_v3")
  _edit_config(tmp_path, quantization_config=dict(quant_method=method))
  with pytest.raises(ValueError, match=rf"quant_method '{method}' is not supported for deepseek"):
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
