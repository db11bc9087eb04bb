"""Tiny Hugging Face checkpoint folders in each family's own tensor names, for the tests.

`write(path, model_type)` writes config.json and random tensors named and shaped as the
published checkpoints of that family are (torch `nn.Linear` weights [out, in]), including
dense layers and some non-MoE tensors (embeddings, attention, norms), with no torch. It
returns the tensors it wrote, name -> NumPy array, so a test can check what the loader made
of them. `quantize_mxfp4` packs a float matrix into MXFP4 blocks and scales.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import ml_dtypes
import numpy as np
from safetensors.numpy import save_file

BF16 = np.dtype(ml_dtypes.bfloat16)
D, F, E = 8, 4, 4

CONFIGS = {
  "mixtral": dict(
    hidden_size=D,
    intermediate_size=F,
    num_local_experts=E,
    num_experts_per_tok=2,
    num_hidden_layers=2,
    hidden_act="silu",
    router_jitter_noise=0.1,
    router_aux_loss_coef=0.02,
  ),
  "jamba": dict(
    hidden_size=D,
    intermediate_size=F,
    num_experts=E,
    num_experts_per_tok=2,
    num_hidden_layers=4,
    expert_layer_period=2,
    expert_layer_offset=1,
    hidden_act="silu",
  ),
  "olmoe": dict(
    hidden_size=D,
    intermediate_size=F,
    num_experts=E,
    num_experts_per_tok=2,
    num_hidden_layers=2,
    norm_topk_prob=False,
    hidden_act="silu",
    router_z_loss_coef=0.001,
  ),
  "qwen2_moe": dict(
    hidden_size=D,
    intermediate_size=6,
    moe_intermediate_size=F,
    shared_expert_intermediate_size=6,
    num_experts=E,
    num_experts_per_tok=2,
    num_hidden_layers=3,
    mlp_only_layers=[1],
    decoder_sparse_step=1,
    norm_topk_prob=False,
    hidden_act="silu",
  ),
  "qwen3_moe": dict(
    hidden_size=D,
    intermediate_size=6,
    moe_intermediate_size=F,
    num_local_experts=E,  # the other spelling of num_experts
    num_experts_per_tok=2,
    num_hidden_layers=4,
    mlp_only_layers=[],
    decoder_sparse_step=2,
    norm_topk_prob=True,
    hidden_act="silu",
  ),
  "deepseek_v3": dict(
    hidden_size=D,
    intermediate_size=6,
    moe_intermediate_size=F,
    n_routed_experts=8,
    num_experts_per_tok=2,
    n_group=4,
    topk_group=2,
    n_shared_experts=2,
    first_k_dense_replace=1,
    moe_layer_freq=1,
    routed_scaling_factor=2.5,
    norm_topk_prob=True,
    scoring_func="sigmoid",
    topk_method="noaux_tc",
    aux_loss_alpha=1e-4,
    num_hidden_layers=3,
    hidden_act="silu",
  ),
  "gpt_oss": dict(
    hidden_size=D,
    intermediate_size=F,
    num_local_experts=E,
    num_experts_per_tok=2,
    num_hidden_layers=2,
    swiglu_limit=7.0,
  ),
  "dbrx": dict(
    d_model=D,
    n_layers=2,
    ffn_config=dict(
      ffn_hidden_size=F,
      moe_num_experts=E,
      moe_top_k=2,
      moe_normalize_expert_weights=2.0,
      ffn_act_fn=dict(name="silu"),
      moe_jitter_eps=0.01,
      moe_loss_weight=0.05,
    ),
  ),
  "granitemoe": dict(
    hidden_size=D,
    intermediate_size=F,
    num_local_experts=E,
    num_experts_per_tok=2,
    num_hidden_layers=2,
    hidden_act="silu",
    router_aux_loss_coef=None,
  ),
  "llama4_text": dict(
    hidden_size=D,
    intermediate_size=F,
    intermediate_size_mlp=6,
    num_local_experts=E,
    num_experts_per_tok=1,
    num_hidden_layers=4,
    interleave_moe_layer_step=2,
    hidden_act="silu",
  ),
}
CONFIGS["llama4"] = dict(text_config=dict(CONFIGS["llama4_text"], model_type="llama4_text"))
# gpt-oss with MXFP4 experts: the quantized axis (D for gate_up, F for down) in blocks of 32.
CONFIGS["gpt_oss_mxfp4"] = dict(
  CONFIGS["gpt_oss"],
  hidden_size=32,
  intermediate_size=32,
  quantization_config=dict(quant_method="mxfp4", modules_to_not_convert=["*.mlp.router"]),
)
# DeepSeek-V3 in block-FP8, as its official release: every `*_proj.weight` F8_E4M3 with a
# float32 `weight_scale_inv` per block (blocks of 3 x 5 here, so that edges are partial).
CONFIGS["deepseek_v3_fp8"] = dict(
  CONFIGS["deepseek_v3"],
  quantization_config=dict(
    quant_method="fp8", fmt="e4m3", activation_scheme="dynamic", weight_block_size=[3, 5]
  ),
)
# The config.json model_type of each key of CONFIGS.
KIND = {k: k for k in CONFIGS} | {"gpt_oss_mxfp4": "gpt_oss", "deepseek_v3_fp8": "deepseek_v3"}
MOE_LAYERS = {
  "mixtral": [0, 1], "jamba": [1, 3], "olmoe": [0, 1], "qwen2_moe": [0, 2], "qwen3_moe": [1, 3],
  "deepseek_v3": [1, 2], "deepseek_v3_fp8": [1, 2], "gpt_oss": [0, 1], "gpt_oss_mxfp4": [0, 1], "dbrx": [0, 1],
  "granitemoe": [0, 1], "llama4_text": [1, 3], "llama4": [1, 3],
}  # fmt: skip
PREFIX = {
  "mixtral": "model.layers.{i}.block_sparse_moe.", "jamba": "model.layers.{i}.feed_forward.",
  "olmoe": "model.layers.{i}.mlp.", "qwen2_moe": "model.layers.{i}.mlp.",
  "qwen3_moe": "model.layers.{i}.mlp.", "deepseek_v3": "model.layers.{i}.mlp.",
  "deepseek_v3_fp8": "model.layers.{i}.mlp.",
  "gpt_oss": "model.layers.{i}.mlp.", "gpt_oss_mxfp4": "model.layers.{i}.mlp.",
  "dbrx": "transformer.blocks.{i}.ffn.", "granitemoe": "model.layers.{i}.block_sparse_moe.",
  "llama4_text": "model.layers.{i}.feed_forward.",
  "llama4": "language_model.model.layers.{i}.feed_forward.",
}  # fmt: skip


def _per_expert(n, gate, up, down, f=F, d=D):
  out = {}
  for j in range(n):
    out[f"experts.{j}.{gate}.weight"] = (f, d)
    out[f"experts.{j}.{up}.weight"] = (f, d)
    out[f"experts.{j}.{down}.weight"] = (d, f)
  return out


def _mlp(names, f, d=D):
  """A dense gated MLP (or a shared expert): gate, up [f, d] and down [d, f]."""
  g, u, dn = names
  return {g: (f, d), u: (f, d), dn: (d, f)}


def block_shapes(model_type):
  """Relative tensor name -> shape of one MoE block of the family (MXFP4: the raw tensors)."""
  proj = ("gate_proj.weight", "up_proj.weight", "down_proj.weight")
  if model_type == "mixtral":
    return {"gate.weight": (E, D), **_per_expert(E, "w1", "w3", "w2")}
  if model_type == "jamba":
    return {"router.weight": (E, D), **_per_expert(E, "gate_proj", "up_proj", "down_proj")}
  if model_type in ("olmoe", "qwen3_moe"):
    return {"gate.weight": (E, D), **_per_expert(E, "gate_proj", "up_proj", "down_proj")}
  if model_type == "qwen2_moe":
    return {
      "gate.weight": (E, D),
      **_per_expert(E, "gate_proj", "up_proj", "down_proj"),
      **_mlp([f"shared_expert.{p}" for p in proj], 6),
      "shared_expert_gate.weight": (1, D),
    }
  if model_type in ("deepseek_v3", "deepseek_v3_fp8"):
    return {
      "gate.weight": (8, D),
      "gate.e_score_correction_bias": (8,),
      **_per_expert(8, "gate_proj", "up_proj", "down_proj"),
      **_mlp([f"shared_experts.{p}" for p in proj], 2 * F),
    }
  if model_type == "gpt_oss":
    return {
      "router.weight": (E, D), "router.bias": (E,),
      "experts.gate_up_proj": (E, D, 2 * F), "experts.gate_up_proj_bias": (E, 2 * F),
      "experts.down_proj": (E, F, D), "experts.down_proj_bias": (E, D),
    }  # fmt: skip
  if model_type == "gpt_oss_mxfp4":
    d = f = 32
    return {
      "router.weight": (E, d), "router.bias": (E,),
      "experts.gate_up_proj": (E, d, 2 * f), "experts.gate_up_proj_bias": (E, 2 * f),
      "experts.down_proj": (E, f, d), "experts.down_proj_bias": (E, d),
    }  # fmt: skip
  if model_type == "dbrx":
    return {
      "router.layer.weight": (E, D),
      "experts.mlp.w1": (E * F, D), "experts.mlp.v1": (E * F, D), "experts.mlp.w2": (E * F, D),
    }  # fmt: skip
  if model_type == "granitemoe":
    return {
      "router.layer.weight": (E, D),
      "input_linear.weight": (E, 2 * F, D),
      "output_linear.weight": (E, D, F),
    }
  if model_type in ("llama4", "llama4_text"):
    return {
      "router.weight": (E, D),
      "experts.gate_up_proj": (E, D, 2 * F),
      "experts.down_proj": (E, F, D),
      **_mlp([f"shared_expert.{p}" for p in proj], F),
    }
  raise ValueError(model_type)


def quantize_mxfp4(w):
  """Packs f32[..., N, K] (K a multiple of 32, every value an FP4 value times 2^s per block)
  into (blocks u8[..., N, K/32, 16], scales u8[..., N, K/32]): the exact inverse of the
  dequantization for such values."""
  codes = {v: i for i, v in enumerate([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])}
  *lead, N, K = w.shape
  wb = w.reshape(*lead, N, K // 32, 32)
  amax = np.max(np.abs(wb), axis=-1)
  exp = np.where(amax > 0, np.floor(np.log2(np.maximum(amax, 1e-30))) - 2, 0).astype(np.int32)
  q = wb / np.ldexp(1.0, exp)[..., None]
  idx = np.vectorize(lambda v: codes[abs(v)] | (8 if np.signbit(v) else 0))(q).astype(np.uint8)
  blocks = (idx[..., 0::2] | (idx[..., 1::2] << 4)).astype(np.uint8)
  return blocks, (exp + 127).astype(np.uint8)


def _fp4_matrix(rng, shape):
  """Random values exactly representable in MXFP4: FP4 codes times 2^s, s per 32 along -1."""
  vals = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
  v = rng.choice(vals, size=shape) * rng.choice([-1.0, 1.0], size=shape)
  s = rng.integers(-4, 2, size=(*shape[:-1], shape[-1] // 32))
  return (v * np.ldexp(1.0, np.repeat(s, 32, axis=-1))).astype(np.float32)


def _fp8_matrix(rng, shape, block):
  """(codes f8e4m3[out, in], scale_inv f32[ceil(out / bo), ceil(in / bi)], the values in f32:
  codes times each element's block scale)."""
  bo, bi = block
  codes = np.clip(rng.normal(size=shape) * 100, -448, 448).astype(ml_dtypes.float8_e4m3fn)
  scale = rng.uniform(1e-3, 1e-2, size=(-(-shape[0] // bo), -(-shape[1] // bi)))
  scale = scale.astype(np.float32)
  grid = np.repeat(np.repeat(scale, bo, 0), bi, 1)[: shape[0], : shape[1]]
  return codes, scale, codes.astype(np.float32) * grid


def write(path, model_type, *, dtype=np.float32, seed=0, files=1):
  """Writes a tiny checkpoint of `model_type` into folder `path`.

  Args:
    path: the folder (created).
    model_type: a key of `CONFIGS` ("gpt_oss_mxfp4": gpt_oss with MXFP4 experts,
      "deepseek_v3_fp8": deepseek_v3 with block-FP8 `*_proj.weight` tensors).
    dtype: the dtype of every float tensor (default float32; MXFP4 biases too).
    seed: the random seed.
    files: 1 (default): `model.safetensors`; more: that many shards and an index.

  Returns:
    (config.json dict, tensors: name -> array as written; for MXFP4 also the dequantized
    `experts.gate_up_proj` and `experts.down_proj` under their unquantized names, which are
    not in the files; for FP8 each `*_proj.weight` is its dequantized value in bfloat16, the
    loader's default dtype for it).
  """
  path = Path(path)
  path.mkdir(parents=True, exist_ok=True)
  rng = np.random.default_rng(seed)
  kind = KIND[model_type]
  config = dict(copy.deepcopy(CONFIGS[model_type]), model_type=kind)
  text = config.get("text_config", config)
  n = text.get("num_hidden_layers", text.get("n_layers"))
  d = text.get("hidden_size", text.get("d_model"))
  tensors, extra = {}, {}
  root = "language_model." if model_type == "llama4" else ""
  tensors[root + "model.embed_tokens.weight"] = (11, d)
  for i in range(n):
    layer = PREFIX[model_type].format(i=i).rsplit(".", 2)[0] + "."
    tensors[layer + "input_layernorm.weight"] = (d,)
    tensors[layer + "self_attn.q_proj.weight"] = (d, d)
    if i in MOE_LAYERS[model_type]:
      for name, shape in block_shapes(model_type).items():
        tensors[PREFIX[model_type].format(i=i) + name] = shape
    else:
      dense = [PREFIX[model_type].format(i=i) + p for p in ("gate_proj", "up_proj", "down_proj")]
      tensors.update(_mlp([p + ".weight" for p in dense], 6, d))
  out = {}
  for name, shape in tensors.items():
    if model_type == "gpt_oss_mxfp4" and name.endswith(("gate_up_proj", "down_proj")):
      w = _fp4_matrix(rng, shape[:1] + shape[1:][::-1])  # [E, out, in], quantized along in
      extra[name] = np.swapaxes(w, -1, -2)
      out[name + "_blocks"], out[name + "_scales"] = quantize_mxfp4(w)
    elif model_type == "deepseek_v3_fp8" and name.endswith("_proj.weight"):
      block = config["quantization_config"]["weight_block_size"]
      out[name], out[name + "_scale_inv"], values = _fp8_matrix(rng, shape, block)
      extra[name] = values.astype(BF16)
    else:
      out[name] = (rng.normal(size=shape) * 0.5).astype(dtype)
  names = sorted(out)
  (path / "config.json").write_text(json.dumps(config, indent=2))
  if files == 1:
    save_file(out, path / "model.safetensors", metadata={"format": "pt"})
  else:
    weight_map = {}
    for k in range(files):
      file = f"model-{k + 1:05d}-of-{files:05d}.safetensors"
      part = {m: out[m] for m in names[k::files]}
      save_file(part, path / file, metadata={"format": "pt"})
      weight_map.update(dict.fromkeys(part, file))
    index = {"metadata": {"total_size": 0}, "weight_map": weight_map}
    (path / "model.safetensors.index.json").write_text(json.dumps(index))
  return config, {**out, **extra}
