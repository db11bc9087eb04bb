"""`MoEConfig`: the static description of one MoE layer, every field checked on construction.

The three independent choices of the package are fields that take a name from their table
or a function of the table's signature:

  * `router`: `routing.ROUTERS` ("top_k", "expert_choice") or
    `(logits_TE, cfg, *, bias_E=None) -> Routing`;
  * `impl` (the dispatch): `dispatch.DISPATCHES` or
    `(x_TD, ffn, experts_TK, weights_TK, *, mesh, cfg) -> (y_TD, stats)`;
  * `gmm_impl` (the grouped-matmul backend): `grouped_matmul.GMM_CHOICES`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax.numpy as jnp

from moe_shard import _checks, quant
from moe_shard.dispatch import DISPATCHES
from moe_shard.experts import expert_class, split_dims
from moe_shard.kernels.grouped_matmul import GMM_CHOICES
from moe_shard.routing import ROUTERS, SCORE_FUNCS, capacity, check_normalize_p
from moe_shard.sharding import EXPERT

# Fields that configure one FFN class; an FFN reads those in its `CONFIG_FIELDS`, and any
# other FFN requires their defaults (so that a value is never silently ignored).
FFN_FIELDS = dict(swiglu_alpha=1.702, swiglu_limit=7.0)
# The top_k router's fields and their defaults, which router="expert_choice" requires.
TOP_K_ONLY = dict(
  score_func="softmax",
  num_groups=1,
  top_k_groups=None,
  routed_scaling=1.0,
  bias_balancing=False,
  normalize_p=1.0,
)
WEIGHTS_ON = ("output", "input")
DISPATCH_CHOICES = ("auto", *DISPATCHES)


def _table_field(name, value, names):
  """A name from a table, or a callable (hashable, so the config stays a jit static)."""
  if callable(value) and not isinstance(value, str):
    try:
      hash(value)
    except TypeError as e:
      raise TypeError(f"MoEConfig: {name} must be hashable when a callable (got {value!r})") from e
    return value
  if isinstance(value, str) and value in names:
    return value
  raise ValueError(f"MoEConfig: {name} must be one of {tuple(names)} or a callable (got {value!r})")


@dataclasses.dataclass(frozen=True, kw_only=True)
class MoEConfig:
  """Static description of one MoE layer; frozen and hashable (a `jax.jit` static argument).

  Keyword-only. Every field is checked on construction (also by `dataclasses.replace`);
  dtypes are stored as `jnp.dtype`, `chunk_size` as None or a pair, so equal configs hash
  equally.

  Attributes:
    d_model: D, the width of the tokens.
    d_ff: F, the hidden width of each routed expert. Must equal `d_model` when
      `expert_type` is "linear" (one [D, F] matrix per expert, and the layer returns D).
    num_experts: E routed experts.
    top_k: K experts per token, 1 <= K <= E.
    expert_type: the routed experts' FFN: a name of `experts.EXPERTS` ("swiglu", the
      default: gate, up [E, D, F] and down [E, F, D]; "linear": w [E, D, D]; "gelu",
      "geglu", "clamped_swiglu"), or an FFN class (its `param_shapes(cfg)` gives the
      leaves; it must map D to D). Hashable either way.
    expert_bias: give every matrix of the routed experts its bias leaf, [E, F] after an
      input matrix and [E, D] after the output one (default False). Zeros at init; each
      is added only to the rows routed to its expert, under every dispatch.
    swiglu_alpha: `alpha` of "clamped_swiglu" (default 1.702); other expert types require
      the default.
    swiglu_limit: `limit` of "clamped_swiglu", > 0 (default 7.0); other expert types
      require the default.
    router: "top_k" (default: each token picks its top_k experts, `routing.top_k_router`),
      "expert_choice" (each expert picks its tokens, `routing.expert_choice_router`), or a
      function `(logits_TE, cfg, *, bias_E=None) -> Routing` (docs/guides/routers.md).
    impl: the dispatch: a name of `dispatch.DISPATCHES` ("masked_scan", "ragged_dot",
      "all_gather", "all_to_all", "ragged_all_to_all"), "auto" (default; with a mesh whose
      expert axis has more than one device, the exchange `choose_impl` picks for the chip
      and the tokens per device, "all_to_all" on CPU; "ragged_dot" otherwise), or a function
      `(x_TD, ffn, experts_TK, weights_TK, *, mesh, cfg) -> (y_TD, stats)`.
    capacity_factor: None (default) for dropless routing; a real c > 0 caps each expert at
      `ceil(c * T * K / E)` (token, slot) items per call, T the tokens of the call. Items
      past the cap are dropped by token order (see `routing.drop_over_capacity`). Under
      expert choice: each expert takes `ceil(c * T_group * K / E)` tokens of each routing
      group, c = 1.0 when None.
    chunk_size: `chunk_size` of `moe_all_to_all`: None (default), an int C (stored as
      (C, C)), or a pair (C_first, C_overflow).
    recv_capacity: receive-buffer rows per device of the "ragged_all_to_all" dispatch
      (`moe_ragged_all_to_all`'s `recv_capacity`): None (default; round 0 the expected load
      T_dev*K plus 4 * sqrt of it, rounded up to a multiple of 8, later rounds as many, the
      last a quarter, `plan.Rows`) or an int >= 1 (every round). More to receive than fits takes more rounds,
      never drops.
    gmm_impl: grouped-matmul backend of the sorting dispatches (`grouped_matmul`'s `impl`,
      one of `grouped_matmul.GMM_CHOICES`): "auto" (default; by the platform compiled for,
      `grouped_matmul.PLATFORM_BACKENDS`: "megablox" on TPU, "mosaic_gpu" on CUDA, "tiled"
      elsewhere), "megablox", "mosaic_gpu", "ragged_dot" or "tiled".
    num_shared_experts: dense SwiGLU experts every token goes through, summed (default 0).
    shared_d_ff: hidden width of each shared expert (default None: `d_ff`).
    shared_expert_gate: scale the shared experts' output (their sum) per token by
      `sigmoid(x @ shared_gate_D)` (default False; Qwen2-MoE). True gives `MoEParams` a
      trained float32 `shared_gate_D` [D]; needs num_shared_experts >= 1.
    normalize_top_k: rescale each token's K weights to sum to 1 (default True).
    normalize_p: with `normalize_top_k`, divide each token's K weights by their p-norm
      `(sum_j |w_j|^p)^(1/p)`, a real p >= 1 (default 1.0: their sum; DBRX's
      `moe_normalize_expert_weights`).
    score_func: the top_k router's scores, "softmax" (default) or "sigmoid" (DeepSeek-V3;
      its balance loss is then the sequence-wise one, `balance.sequence_balance_loss`).
    num_groups: expert groups of the top_k router (default 1: none); must divide E.
    top_k_groups: groups each token keeps, 1..num_groups (default None: all); top_k must be
      <= top_k_groups * E / num_groups (DeepSeek-V3: 8 groups, keep 4).
    routed_scaling: factor on the routed experts' combine weights (default 1.0; DeepSeek-V3
      2.5).
    weights_on: where the combine weights apply: "output" (default; `y = sum_j w_j *
      expert_j(x)`) or "input" (`y = sum_j expert_j(w_j * x)`, Llama-4). "input" sends
      each (token, slot) item as its own row, `w_j * x` (`layer.moe_layer`).
    bias_balancing: aux-loss-free balancing (default False). True gives `MoEParams` a
      float32 `router_bias` [E], added to the scores for top-k selection only (no
      gradient), moved by `balance.update_router_bias` after each step.
    router_logit_bias: a trained float32 `MoEParams.router_logit_bias` [E] added to the
      router logits before the router (and the z-loss) sees them (default False; gpt-oss's
      router is a Linear with a bias). Zeros at init; it gets gradients. Independent of
      `bias_balancing` (both may be on).
    routing_groups: how many runs of consecutive tokens the router ranks on its own (matters
      for expert choice; top-k is per token). Default None: one group per device on a mesh
      whose size divides the tokens, else one group of all the tokens of the call (see
      `route_groups.num_routing_groups`). An int G: G groups, G must divide the tokens of a call.
    load_balance_coef: weight of the load-balancing loss in `aux["aux_loss"]`
      (default 1e-2).
    z_loss_coef: weight of the router z-loss in `aux["aux_loss"]` (default 1e-3).
    param_dtype: dtype of the expert and shared-expert weights (default float32). The router
      is always float32.
    weights_format: None (default: the routed experts' matrices in `param_dtype`) or "int8",
      "fp8" or "mxfp4": `init_moe_params` quantizes them (`quant.QuantizedArray`, frozen),
      and `moe_param_shapes` and `moe_param_specs` describe the quantized leaves. The
      layer takes quantized matrices whatever this says (`quantize_experts`); the blocks
      of the format must divide d_model and d_ff (docs/guides/quantization.md).
    compute_dtype: dtype the tokens and expert weights are cast to for the expert matmuls,
      which accumulate in float32 (default None: the dtype of x).
    expert_axis: mesh axis the experts are split over (default "expert"), or a tuple of
      axes, e.g. ("data", "expert"): the experts are then split over the product of their
      sizes, in the order given (a list is stored as a tuple, a 1-tuple as its name).
    expert_tensor_axis: None (default) or a mesh axis over which each routed expert's
      hidden dimension F is split (expert tensor parallelism): gate and up by columns, down
      by rows; the shared experts' hidden dimension too (a dense tensor-parallel MLP). Needs
      an expert type with a hidden dimension (not "linear") and F (and `shared_d_ff`)
      divisible by the axis size. docs/guides/sharding.md says where the partial sums meet.
    expert_fsdp_axis: None (default) or a mesh axis over which the last dimension of every
      matrix of the routed and shared experts is stored split (FSDP of expert weights: F
      of gate and up, after `expert_tensor_axis` when both are set; D of down), all-gathered
      inside the layer where used, gradients reduce-scattered. F (and `shared_d_ff`) must
      divide by the product of the axes that split it, D by this one. Typically the data
      axis; never an axis of `expert_axis` or `expert_tensor_axis`.
  """

  d_model: int
  d_ff: int
  num_experts: int
  top_k: int
  expert_type: str | type = "swiglu"
  expert_bias: bool = False
  swiglu_alpha: float = 1.702
  swiglu_limit: float = 7.0
  router: str | Callable = "top_k"
  impl: str | Callable = "auto"
  capacity_factor: float | None = None
  chunk_size: int | tuple[int, int] | None = None
  recv_capacity: int | None = None
  gmm_impl: str = "auto"
  num_shared_experts: int = 0
  shared_d_ff: int | None = None
  shared_expert_gate: bool = False
  normalize_top_k: bool = True
  normalize_p: float = 1.0
  score_func: str = "softmax"
  num_groups: int = 1
  top_k_groups: int | None = None
  routed_scaling: float = 1.0
  weights_on: str = "output"
  bias_balancing: bool = False
  router_logit_bias: bool = False
  routing_groups: int | None = None
  load_balance_coef: float = 1e-2
  z_loss_coef: float = 1e-3
  param_dtype: jnp.dtype = jnp.dtype(jnp.float32)
  weights_format: str | None = None
  compute_dtype: jnp.dtype | None = None
  expert_axis: str | tuple[str, ...] = EXPERT
  expert_tensor_axis: str | None = None
  expert_fsdp_axis: str | None = None

  def __post_init__(self):
    fn = "MoEConfig"

    def put(name, value):
      object.__setattr__(self, name, value)

    for name in ("d_model", "d_ff", "num_experts", "top_k"):
      put(name, _checks.int_field(fn, name, getattr(self, name), 1))
    if self.top_k > self.num_experts:
      raise ValueError(
        f"{fn}: top_k must be <= num_experts ({self.num_experts}) (got {self.top_k})"
      )
    _checks.choice_field(fn, "gmm_impl", self.gmm_impl, GMM_CHOICES)
    put("router", _table_field("router", self.router, tuple(ROUTERS)))
    put("impl", _table_field("impl", self.impl, DISPATCH_CHOICES))
    if self.capacity_factor is not None:
      put(
        "capacity_factor",
        _checks.real_field(fn, "capacity_factor", self.capacity_factor, positive=True),
      )
    put("chunk_size", _checks.chunk_size_field(fn, self.chunk_size))
    if self.recv_capacity is not None:
      put("recv_capacity", _checks.int_field(fn, "recv_capacity", self.recv_capacity, 1))
    put(
      "num_shared_experts", _checks.int_field(fn, "num_shared_experts", self.num_shared_experts, 0)
    )
    if self.shared_d_ff is not None:
      put("shared_d_ff", _checks.int_field(fn, "shared_d_ff", self.shared_d_ff, 1))
    _checks.bool_field(fn, "shared_expert_gate", self.shared_expert_gate)
    if self.shared_expert_gate and self.num_shared_experts == 0:
      raise ValueError(
        f"{fn}: shared_expert_gate=True needs num_shared_experts >= 1, the experts it "
        f"gates (got num_shared_experts=0)"
      )
    _checks.bool_field(fn, "normalize_top_k", self.normalize_top_k)
    put("normalize_p", check_normalize_p(fn, self.normalize_p))
    if not self.normalize_top_k and self.normalize_p != 1.0:
      raise ValueError(
        f"{fn}: normalize_p must be 1.0 when normalize_top_k is False, which leaves the "
        f"weights unnormalised (got {self.normalize_p!r})"
      )
    _checks.choice_field(fn, "weights_on", self.weights_on, WEIGHTS_ON)
    self._check_router_fields(fn, put)
    for name in ("load_balance_coef", "z_loss_coef"):
      put(name, _checks.real_field(fn, name, getattr(self, name), positive=False))
    put("param_dtype", _checks.dtype_field(fn, "param_dtype", self.param_dtype))
    if self.weights_format is not None:
      quant.check_format(fn, "weights_format", self.weights_format)
    if self.compute_dtype is not None:
      put("compute_dtype", _checks.dtype_field(fn, "compute_dtype", self.compute_dtype))
    put("expert_axis", _checks.expert_axis_field(fn, self.expert_axis))
    _checks.split_axes_fields(fn, self.expert_axis, self.expert_tensor_axis, self.expert_fsdp_axis)
    self._check_expert_fields(fn, put)

  def _check_expert_fields(self, fn, put):
    """Checks expert_type, expert_bias and the FFN fields, and that the FFN maps D to D."""
    cls = expert_class(fn, self.expert_type)
    _checks.bool_field(fn, "expert_bias", self.expert_bias)
    put("swiglu_alpha", _checks.real_field(fn, "swiglu_alpha", self.swiglu_alpha, positive=True))
    put("swiglu_limit", _checks.real_field(fn, "swiglu_limit", self.swiglu_limit, positive=True))
    label = self.expert_type if isinstance(self.expert_type, str) else cls.__name__
    reads = set(getattr(cls, "CONFIG_FIELDS", {}).values())
    for name, default in FFN_FIELDS.items():
      if name not in reads and getattr(self, name) != default:
        raise ValueError(
          f"{fn}: {name} must be {default!r} with expert_type {label!r}, which does not "
          f"read it (got {getattr(self, name)!r})"
        )
    shapes = cls.param_shapes(self)
    if self.weights_format is not None:
      for f in dataclasses.fields(shapes):
        leaf = getattr(shapes, f.name)
        if not f.metadata.get("static") and leaf is not None and len(leaf.shape) == 3:
          quant.check_blocks(
            fn, f"weights_format {self.weights_format!r}: {f.name}", leaf.shape, self.weights_format
          )
    if self.expert_tensor_axis is not None or self.expert_fsdp_axis is not None:
      split_dims(fn, shapes)  # raises for an FFN whose leaves do not name their dimensions
    if self.expert_tensor_axis is not None and split_dims(fn, shapes)[1] == "F":
      raise ValueError(
        f"{fn}: expert_tensor_axis needs experts with a hidden dimension F between their "
        f"input and output matrices; expert_type {label!r} outputs F (got "
        f"expert_tensor_axis={self.expert_tensor_axis!r})"
      )
    D = self.d_model
    if (shapes.d_in, shapes.d_out) != (D, D):
      raise ValueError(
        f"{fn}: the experts of expert_type {label!r} must map d_model ({D}) to d_model "
        f"(got d_in {shapes.d_in}, d_out {shapes.d_out}; 'linear' maps d_model to d_ff)"
      )

  @property
  def expert_class(self) -> type:
    """The FFN class of `expert_type` (`experts.EXPERTS[expert_type]`, or the class)."""
    return expert_class("MoEConfig", self.expert_type)

  def _check_router_fields(self, fn, put):
    """Checks the fields of the top_k router and of balancing, and what expert choice uses."""
    E = self.num_experts
    _checks.choice_field(fn, "score_func", self.score_func, tuple(SCORE_FUNCS))
    put("num_groups", _checks.int_field(fn, "num_groups", self.num_groups, 1))
    _checks.divisible(fn, "num_experts", E, "num_groups", self.num_groups)
    kept = self.num_groups
    if self.top_k_groups is not None:
      kept = _checks.int_field(fn, "top_k_groups", self.top_k_groups, 1)
      if kept > self.num_groups:
        raise ValueError(
          f"{fn}: top_k_groups must be <= num_groups ({self.num_groups}) (got {kept})"
        )
      put("top_k_groups", kept)
    if self.top_k > kept * (E // self.num_groups):
      raise ValueError(
        f"{fn}: top_k must be <= top_k_groups * num_experts / num_groups "
        f"({kept * (E // self.num_groups)}) (got {self.top_k})"
      )
    put(
      "routed_scaling", _checks.real_field(fn, "routed_scaling", self.routed_scaling, positive=True)
    )
    _checks.bool_field(fn, "bias_balancing", self.bias_balancing)
    _checks.bool_field(fn, "router_logit_bias", self.router_logit_bias)
    if self.routing_groups is not None:
      put("routing_groups", _checks.int_field(fn, "routing_groups", self.routing_groups, 1))
    if self.router == "expert_choice":
      # Fields of the top_k router that expert choice would silently ignore.
      for name, default in TOP_K_ONLY.items():
        if getattr(self, name) != default:
          raise ValueError(
            f"{fn}: {name} must be {default!r} with router 'expert_choice' "
            f"(a top_k router field) (got {getattr(self, name)!r})"
          )

  @property
  def shared_hidden(self) -> int:
    """Hidden width of each shared expert: `shared_d_ff`, or `d_ff` when that is None."""
    return self.d_ff if self.shared_d_ff is None else self.shared_d_ff

  def capacity(self, num_tokens: int) -> int | None:
    """Items each expert takes in a call of `num_tokens` tokens; None when dropless.

    The top_k router's capacity over a whole call (expert choice applies its own, per
    routing group: `routing.expert_choice_router`).

    `capacity(capacity_factor, T, K, E)`: the one capacity formula of the package.
    """
    if self.capacity_factor is None:
      return None
    return capacity(self.capacity_factor, num_tokens, self.top_k, self.num_experts)


def check_config(fn, cfg):
  """Raises TypeError unless `cfg` is a `MoEConfig`."""
  if not isinstance(cfg, MoEConfig):
    raise TypeError(f"{fn}: cfg must be a MoEConfig (got {type(cfg).__name__})")
