"""`--preset NAME`: the MoE block of a published model, from the fields of its config.json.

Each model's config.json fields that describe its MoE block, as published on the Hugging
Face hub, go through the loader's own mapping (`moe_shard.hf.families`), so a preset is the
layer `hf.load_moe_layer` builds from that checkpoint:

  mixtral-8x7b (mistralai/Mixtral-8x7B-v0.1): E=8, K=2, D=4096, F=14336, SwiGLU, softmax
    top-k renormalised.
  qwen3-30b-a3b (Qwen/Qwen3-30B-A3B): E=128, K=8, D=2048, F=768, SwiGLU, softmax top-k
    renormalised (norm_topk_prob).
  gpt-oss-120b (openai/gpt-oss-120b): E=128, K=4, D=F=2880, clamped SwiGLU (limit 7) with
    expert biases, a router with a bias, softmax of the top-k logits.
  deepseek-v3 (deepseek-ai/DeepSeek-V3): E=256, K=8, D=7168, F=2048, one shared expert of
    width 2048, sigmoid scores, 8 groups of which each token keeps 4, renormalised, routed
    scaling 2.5, a selection bias (e_score_correction_bias).

Flags given on the command line override the preset's values.
"""

from __future__ import annotations

CONFIGS = {
  "mixtral-8x7b": dict(
    model_type="mixtral",
    hidden_size=4096,
    intermediate_size=14336,
    num_local_experts=8,
    num_experts_per_tok=2,
    hidden_act="silu",
    router_aux_loss_coef=0.02,
  ),
  "qwen3-30b-a3b": dict(
    model_type="qwen3_moe",
    hidden_size=2048,
    moe_intermediate_size=768,
    num_experts=128,
    num_experts_per_tok=8,
    norm_topk_prob=True,
    hidden_act="silu",
    router_aux_loss_coef=0.001,
  ),
  "gpt-oss-120b": dict(
    model_type="gpt_oss",
    hidden_size=2880,
    intermediate_size=2880,
    num_local_experts=128,
    num_experts_per_tok=4,
    swiglu_limit=7.0,
    router_aux_loss_coef=0.9,
  ),
  "deepseek-v3": dict(
    model_type="deepseek_v3",
    hidden_size=7168,
    moe_intermediate_size=2048,
    n_routed_experts=256,
    num_experts_per_tok=8,
    n_shared_experts=1,
    n_group=8,
    topk_group=4,
    routed_scaling_factor=2.5,
    norm_topk_prob=True,
    scoring_func="sigmoid",
    topk_method="noaux_tc",
    hidden_act="silu",
  ),
}

# MoEConfig fields a preset hands to the benchmark's Size (`bench.cases.build.Size`) as they are.
ROUTER_FIELDS = (
  "score_func",
  "num_groups",
  "top_k_groups",
  "routed_scaling",
  "normalize_top_k",
  "router_logit_bias",
  "bias_balancing",
)


def moe_fields(name):
  """The `MoEConfig` fields of preset `name`, as the loader maps its config.json."""
  from moe_shard.hf import families

  c = CONFIGS[name]
  return families.FAMILIES[c["model_type"]].config(c)


def settings(name):
  """The benchmark settings of preset `name`: d_model, d_ff, top_k, experts (a str, as
  `-E` gives it), expert_type, expert_bias, shared_experts and router (the `Size` router
  fields that differ from MoEConfig's defaults).

  Raises:
    ValueError: a preset whose shared experts are not as wide as its routed ones (the
      benchmark's shared experts have width F).
  """
  f = moe_fields(name)
  shared = f.get("num_shared_experts", 0)
  if shared and f.get("shared_d_ff") not in (None, f["d_ff"]):
    raise ValueError(f"preset {name}: shared_d_ff ({f['shared_d_ff']}) must equal d_ff")
  defaults = dict(
    score_func="softmax",
    num_groups=1,
    top_k_groups=None,
    routed_scaling=1.0,
    normalize_top_k=True,
    router_logit_bias=False,
    bias_balancing=False,
  )
  return dict(
    d_model=f["d_model"],
    d_ff=f["d_ff"],
    top_k=f["top_k"],
    experts=str(f["num_experts"]),
    expert_type=f.get("expert_type", "swiglu"),
    expert_bias=f.get("expert_bias", False),
    shared_experts=shared,
    router={k: f[k] for k in ROUTER_FIELDS if k in f and f[k] != defaults[k]},
  )
