"""The table of checkpoint families: config.json `model_type` -> `Family`.

A `Family` says, for one architecture of transformers (`models/<type>/modeling_<type>.py`):

  * `config(c)`: the `MoEConfig` fields its config.json `c` (the text config) implies, raising
    on a field that changes the math in a way `moe_layer` cannot express;
  * `num_layers`: the config.json key of the decoder layer count;
  * `dense(c, i)`: None when decoder layer i has an MoE block, else why it is dense, naming
    the config.json field;
  * `prefixes`: where layer i's MoE block lives ("{i}" formatted), the first that holds
    the block's first tensor wins (Llama-4 multimodal checkpoints nest the text model under
    `language_model.`);
  * `layouts(c)`: the block's tensors, relative to the prefix, and the leaves they hold
    (`hf.layouts`).

The routers, as transformers computes them, and the `MoEConfig` that reproduces them:

  mixtral, granitemoe: softmax, top-k, renormalised (granite: softmax of the top-k logits,
    the same thing). Mixtral's `router_jitter_noise` multiplies the input by noise only in
    training; inference ignores it, and so does the mapping.
  jamba: softmax, top-k, not renormalised. olmoe, qwen2_moe, qwen3_moe: softmax, top-k,
    renormalised iff `norm_topk_prob`. qwen2_moe adds one shared expert scaled by
    `sigmoid(x @ shared_expert_gate)`.
  deepseek_v3: sigmoid scores (a `scoring_func` other than "sigmoid" raises: transformers
    ignores the field), `e_score_correction_bias` for selection only, group-limited
    (`n_group`, `topk_group`), renormalised iff `norm_topk_prob`, times
    `routed_scaling_factor`; its `n_shared_experts` shared experts are one fused MLP of
    width n_shared * moe_intermediate_size, mapped to one shared expert of that width.
  gpt_oss: a router Linear with bias, softmax of the top-k logits; experts are clamped
    SwiGLU with biases, gate and up interleaved in `gate_up_proj`.
  dbrx: softmax, top-k, divided by the p-norm of the k weights, p =
    `moe_normalize_expert_weights` (None: not divided). `moe_jitter_eps` is training only.
  llama4: top-k of the logits, weights sigmoid(logit) not renormalised, applied to the
    expert's input; one shared expert of width `intermediate_size`.

The aux-loss weights follow transformers' training loss. Its `load_balancing_loss_func` is
K times moe_shard's balance loss (docs/guides/semantics.md), so a softmax family's
`load_balance_coef` is K * `router_aux_loss_coef` (absent: the config class's default,
0.001, OLMoE 0.01; null: 0), DBRX's K * `ffn_config.moe_loss_weight` (default 0.01).
DeepSeek-V3's is `aux_loss_alpha` as written (the sequence-wise loss; 0 when absent, as
transformers trains without it), Llama-4's 0 (transformers computes no balance loss for it,
whatever its `router_aux_loss_coef`). `z_loss_coef` is `router_z_loss_coef`, else 0. The
expert count is `num_experts` or `num_local_experts`, whichever config.json has.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from moe_shard.hf.layouts import Fused, PerExpert, Rows, Stacked, Whole


@dataclasses.dataclass(frozen=True)
class Family:
  config: Callable[[dict], dict]
  num_layers: str
  dense: Callable[[dict, int], str | None]
  prefixes: tuple[str, ...]
  layouts: Callable[[dict], tuple]


def _silu(c, key="hidden_act"):
  act = c.get(key, "silu")
  if act != "silu":
    raise ValueError(
      f"config.json {key} must be 'silu' for moe_shard's SwiGLU experts (got {act!r})"
    )


def _routed_layouts(router="gate.weight", gate="gate_proj", up="up_proj", down="down_proj"):
  """A router `nn.Linear` [E, D] and per-expert `nn.Linear`s `experts.{j}.<name>.weight`:
  gate and up [F, D], down [D, F]."""
  return (
    Whole(router, "router_DE"),
    PerExpert(f"experts.{{j}}.{gate}.weight", "experts.gate_EDF"),
    PerExpert(f"experts.{{j}}.{up}.weight", "experts.up_EDF"),
    PerExpert(f"experts.{{j}}.{down}.weight", "experts.down_EFD"),
  )


def _shared(prefix):
  """One shared expert of `nn.Linear`s gate_proj, up_proj, down_proj under `prefix`."""
  return (
    Whole(prefix + "gate_proj.weight", "shared.gate_EDF", "T1"),
    Whole(prefix + "up_proj.weight", "shared.up_EDF", "T1"),
    Whole(prefix + "down_proj.weight", "shared.down_EFD", "T1"),
  )


def _always_moe(c, i):
  return None


def _num_experts(c, default=None):
  """The routed expert count, config.json `num_experts` or `num_local_experts`."""
  for key in ("num_experts", "num_local_experts"):
    if c.get(key) is not None:
      return c[key]
  if default is None:
    raise KeyError("num_experts")
  return default


def _aux_loss(top_k, balance, c):
  """The aux-loss weights: `balance` is transformers' coefficient of its
  `load_balancing_loss_func`, which is K times moe_shard's balance loss; the z-loss weight is
  `router_z_loss_coef` (0 when config.json has none)."""
  return dict(
    load_balance_coef=top_k * float(balance or 0.0),
    z_loss_coef=float(c.get("router_z_loss_coef") or 0.0),
  )


def _routed(
  c, d_ff="intermediate_size", aux_default: float | None = 0.001, act: str | None = "hidden_act"
):
  """The fields of a softmax top-k family: D, F (config.json key `d_ff`), E, K, and the
  aux-loss weights from `router_aux_loss_coef` (absent: transformers' default
  `aux_default`; None: no balance loss); `act` (None: not checked) must be silu."""
  if act is not None:
    _silu(c, act)
  K = c["num_experts_per_tok"]
  balance = c.get("router_aux_loss_coef", aux_default) if aux_default is not None else 0.0
  return dict(
    d_model=c["hidden_size"],
    d_ff=c[d_ff],
    num_experts=_num_experts(c),
    top_k=K,
    **_aux_loss(K, balance, c),
  )


# --------------------------------------------------------------------------- mixtral, granite


def _mixtral(c):
  """Mixtral and GraniteMoE: softmax top-k, renormalised (MoEConfig's defaults)."""
  return _routed(c)


# --------------------------------------------------------------------------- jamba


def _jamba(c):
  return dict(_routed(c), normalize_top_k=False)


def _jamba_dense(c, i):
  n = _num_experts(c, 0)
  if n <= 1:
    return f"num_experts is {n}"
  period, offset = c.get("expert_layer_period", 2), c.get("expert_layer_offset", 1)
  if i % period != offset:
    return f"i % expert_layer_period ({period}) != expert_layer_offset ({offset})"
  return None


# --------------------------------------------------------------------------- olmoe, qwen


def _norm_topk(d_ff, aux_default):
  """OLMoE and Qwen-MoE: softmax top-k, renormalised iff `norm_topk_prob`."""

  def config(c):
    cfg = _routed(c, d_ff, aux_default)
    return dict(cfg, normalize_top_k=bool(c.get("norm_topk_prob", False)))

  return config


_olmoe = _norm_topk("intermediate_size", 0.01)
_qwen3 = _norm_topk("moe_intermediate_size", 0.001)


def _qwen2(c):
  cfg = _qwen3(c)
  if not c.get("shared_expert_intermediate_size"):
    raise ValueError("config.json shared_expert_intermediate_size must be > 0 for qwen2_moe")
  return dict(
    cfg,
    num_shared_experts=1,
    shared_d_ff=c["shared_expert_intermediate_size"],
    shared_expert_gate=True,
  )


def _qwen_dense(c, i):
  if i in (c.get("mlp_only_layers") or []):
    return f"mlp_only_layers {c['mlp_only_layers']} contains {i}"
  if not _num_experts(c, 0):
    return "num_experts is 0"
  step = c.get("decoder_sparse_step", 1)
  if (i + 1) % step != 0:
    return f"(i + 1) % decoder_sparse_step ({step}) != 0"
  return None


# --------------------------------------------------------------------------- deepseek_v3


def _deepseek(c):
  _silu(c)
  score = c.get("scoring_func", "sigmoid")
  if score != "sigmoid":
    raise ValueError(
      f"config.json scoring_func must be 'sigmoid': transformers' DeepseekV3TopkRouter "
      f"applies sigmoid whatever the field says (got {score!r})"
    )
  method = c.get("topk_method", "noaux_tc")
  if method != "noaux_tc":
    raise ValueError(f"config.json topk_method must be 'noaux_tc' (got {method!r})")
  n_shared = c.get("n_shared_experts") or 0
  return dict(
    d_model=c["hidden_size"],
    d_ff=c["moe_intermediate_size"],
    num_experts=c["n_routed_experts"],
    top_k=c["num_experts_per_tok"],
    score_func="sigmoid",
    num_groups=c.get("n_group") or 1,
    top_k_groups=c.get("topk_group") or None,
    routed_scaling=float(c.get("routed_scaling_factor", 1.0)),
    normalize_top_k=bool(c.get("norm_topk_prob", True)),
    bias_balancing=True,
    num_shared_experts=1 if n_shared else 0,
    shared_d_ff=n_shared * c["moe_intermediate_size"] if n_shared else None,
    # The sigmoid router's balance loss is DeepSeek-V3's sequence-wise one, weighted by its
    # alpha as written (transformers trains without it: 0 when config.json has none).
    load_balance_coef=float(c.get("aux_loss_alpha") or 0.0),
    z_loss_coef=float(c.get("router_z_loss_coef") or 0.0),
  )


def _deepseek_dense(c, i):
  if not c.get("n_routed_experts"):
    return "n_routed_experts is not set"
  first = c.get("first_k_dense_replace", 0)
  if i < first:
    return f"i < first_k_dense_replace ({first})"
  freq = c.get("moe_layer_freq", 1)
  if i % freq != 0:
    return f"i % moe_layer_freq ({freq}) != 0"
  return None


def _deepseek_layouts(c):
  return (
    *_routed_layouts(),
    Whole("gate.e_score_correction_bias", "router_bias", "id"),
    *(_shared("shared_experts.") if c.get("n_shared_experts") else ()),
  )


# --------------------------------------------------------------------------- gpt_oss


def _gpt_oss(c):
  return dict(
    _routed(c, act=None),  # the experts are clamped SwiGLU whatever hidden_act says
    expert_type="clamped_swiglu",
    expert_bias=True,
    swiglu_alpha=float(c.get("swiglu_alpha", 1.702)),
    swiglu_limit=float(c.get("swiglu_limit", 7.0)),
    router_logit_bias=True,
  )


GPT_OSS = (
  Whole("router.weight", "router_DE"),
  Whole("router.bias", "router_logit_bias", "id"),
  Fused("experts.gate_up_proj", ("experts.gate_EDF", "experts.up_EDF"), "interleave"),
  Fused("experts.gate_up_proj_bias", ("experts.gate_b_EF", "experts.up_b_EF"), "interleave"),
  Stacked("experts.down_proj", "experts.down_EFD"),
  Stacked("experts.down_proj_bias", "experts.down_b_ED"),
)


# --------------------------------------------------------------------------- dbrx


def _dbrx(c):
  f = c["ffn_config"]
  act = (f.get("ffn_act_fn") or {}).get("name", "silu")
  if act != "silu":
    raise ValueError(f"config.json ffn_config.ffn_act_fn.name must be 'silu' (got {act!r})")
  if f.get("uniform_expert_assignment"):
    raise ValueError(
      "config.json ffn_config.uniform_expert_assignment must be false: experts assigned "
      "round-robin, ignoring the router, cannot be expressed (got true)"
    )
  p = f.get("moe_normalize_expert_weights", 1.0)
  K = f.get("moe_top_k", 1)
  return dict(
    d_model=c["d_model"],
    d_ff=f["ffn_hidden_size"],
    num_experts=f["moe_num_experts"],
    top_k=K,
    normalize_top_k=p is not None,
    **_aux_loss(K, f.get("moe_loss_weight", 0.01), f),
    **({} if p is None or float(p) == 1.0 else dict(normalize_p=float(p))),
  )


DBRX = (
  Whole("router.layer.weight", "router_DE"),
  Rows("experts.mlp.w1", "experts.gate_EDF", transpose=True),
  Rows("experts.mlp.v1", "experts.up_EDF", transpose=True),
  Rows("experts.mlp.w2", "experts.down_EFD"),
)


# --------------------------------------------------------------------------- granitemoe


GRANITE = (
  Whole("router.layer.weight", "router_DE"),
  Fused("input_linear.weight", ("experts.gate_EDF", "experts.up_EDF"), "halves", transpose=True),
  Stacked("output_linear.weight", "experts.down_EFD", transpose=True),
)


# --------------------------------------------------------------------------- llama4


def _llama4(c):
  return dict(
    _routed(c, aux_default=None),  # transformers computes no balance loss for Llama-4
    score_func="sigmoid",
    normalize_top_k=False,
    weights_on="input",
    num_shared_experts=1,
    shared_d_ff=c["intermediate_size"],
  )


def _llama4_moe_layers(c):
  if c.get("moe_layers") is not None:
    return list(c["moe_layers"])
  step = c.get("interleave_moe_layer_step", 1)
  return list(range(step - 1, c["num_hidden_layers"], step))


def _llama4_dense(c, i):
  layers = _llama4_moe_layers(c)
  if i not in layers:
    src = "moe_layers" if c.get("moe_layers") is not None else "interleave_moe_layer_step"
    return f"{i} is not in the MoE layers {layers} ({src})"
  return None


LLAMA4 = (
  Whole("router.weight", "router_DE"),
  Fused("experts.gate_up_proj", ("experts.gate_EDF", "experts.up_EDF"), "halves"),
  Stacked("experts.down_proj", "experts.down_EFD"),
  *_shared("shared_expert."),
)
_LLAMA4 = Family(
  _llama4,
  "num_hidden_layers",
  _llama4_dense,
  ("model.layers.{i}.feed_forward.", "language_model.model.layers.{i}.feed_forward."),
  lambda c: LLAMA4,
)

ROUTED = _routed_layouts()
FAMILIES = {
  "mixtral": Family(
    _mixtral,
    "num_hidden_layers",
    _always_moe,
    ("model.layers.{i}.block_sparse_moe.",),
    lambda c: _routed_layouts("gate.weight", "w1", "w3", "w2"),
  ),
  "qwen2_moe": Family(
    _qwen2,
    "num_hidden_layers",
    _qwen_dense,
    ("model.layers.{i}.mlp.",),
    lambda c: (
      *_routed_layouts(),
      *_shared("shared_expert."),
      Whole("shared_expert_gate.weight", "shared_gate_D", "row"),
    ),
  ),
  "qwen3_moe": Family(
    _qwen3,
    "num_hidden_layers",
    _qwen_dense,
    ("model.layers.{i}.mlp.",),
    lambda c: ROUTED,
  ),
  "deepseek_v3": Family(
    _deepseek, "num_hidden_layers", _deepseek_dense, ("model.layers.{i}.mlp.",), _deepseek_layouts
  ),
  "olmoe": Family(
    _olmoe,
    "num_hidden_layers",
    _always_moe,
    ("model.layers.{i}.mlp.",),
    lambda c: ROUTED,
  ),
  "gpt_oss": Family(
    _gpt_oss, "num_hidden_layers", _always_moe, ("model.layers.{i}.mlp.",), lambda c: GPT_OSS
  ),
  "dbrx": Family(_dbrx, "n_layers", _always_moe, ("transformer.blocks.{i}.ffn.",), lambda c: DBRX),
  "granitemoe": Family(
    _mixtral,
    "num_hidden_layers",
    _always_moe,
    ("model.layers.{i}.block_sparse_moe.",),
    lambda c: GRANITE,
  ),
  "llama4": _LLAMA4,
  "llama4_text": _LLAMA4,
  "jamba": Family(
    _jamba,
    "num_hidden_layers",
    _jamba_dense,
    ("model.layers.{i}.feed_forward.",),
    lambda c: _routed_layouts("router.weight"),
  ),
}


def text_config(config):
  """The config.json dict that describes the decoder: `text_config` for multimodal llama4."""
  if config.get("model_type") == "llama4" and "text_config" in config:
    return config["text_config"]
  return config
