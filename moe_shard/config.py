"""`MoEConfig`: the static description of one MoE layer, every field checked on construction.

The three independent choices of the package are fields that take a name from their table
or a function of the table's signature:

  * `router`: `routing.ROUTERS` or `(logits_TE, cfg) -> Routing`;
  * `impl` (the dispatch): `dispatch.DISPATCHES` or
    `(x_TD, ffn, experts_TK, weights_TK, *, mesh, cfg) -> (y_TD, stats)`;
  * `gmm_impl` (the grouped-matmul backend): `grouped_matmul.IMPLS`.
"""

from __future__ import annotations

import dataclasses
import fractions
import math
from typing import Callable

import jax.numpy as jnp

from moe_shard import _checks
from moe_shard.dispatch import DISPATCHES
from moe_shard.grouped_matmul import IMPLS as GMM_IMPLS
from moe_shard.routing import ROUTERS
from moe_shard.sharding import EXPERT

EXPERT_TYPES = ("swiglu", "linear")
IMPLS = ("auto", *DISPATCHES)


def _table_field(name, value, names):
  """A name from a table, or a callable (hashable, so the config stays a jit static)."""
  if callable(value) and not isinstance(value, str):
    try:
      hash(value)
    except TypeError as e:
      raise TypeError(f"MoEConfig: {name} must be hashable when a callable (got "
                      f"{value!r})") from e
    return value
  if isinstance(value, str) and value in names:
    return value
  raise ValueError(f"MoEConfig: {name} must be one of {tuple(names)} or a callable "
                   f"(got {value!r})")


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
    expert_type: "swiglu" (default; gate, up [E, D, F] and down [E, F, D]) or "linear"
      (w [E, D, D]).
    router: "top_k" (default: softmax top-k, `routing.top_k_router`), or a function
      `(logits_TE, cfg) -> Routing`.
    impl: the dispatch: a name of `dispatch.DISPATCHES` ("masked_scan", "ragged_dot",
      "all_gather", "all_to_all", "ragged_all_to_all"), "auto" (default; with a mesh whose
      expert axis has more than one device, "ragged_all_to_all" on TPU and GPU devices and
      "all_to_all" on CPU; "ragged_dot" otherwise), or a function
      `(x_TD, ffn, experts_TK, weights_TK, *, mesh, cfg) -> (y_TD, stats)`.
    capacity_factor: None (default) for dropless routing; a real c > 0 caps each expert at
      `ceil(c * T * K / E)` (token, slot) items per call, T the tokens of the call. Items
      past the cap are dropped by token order (see `routing.drop_over_capacity`).
    chunk_size: `chunk_size` of `moe_all_to_all`: None (default), an int C (stored as
      (C, C)), or a pair (C_first, C_overflow).
    recv_capacity: receive-buffer rows per device of the "ragged_all_to_all" dispatch
      (`moe_ragged_all_to_all`'s `capacity`): None (default; round 0 1.25 times the
      expected load T_dev*K rounded up to a multiple of 8, later rounds a quarter of that)
      or an int >= 1 (every round). More to receive than fits takes more rounds, never drops.
    gmm_impl: grouped-matmul backend of the sorting dispatches (`grouped_matmul`'s `impl`):
      "auto" (default; by the platform compiled for, `grouped_matmul.PLATFORM_BACKENDS`),
      "ragged_dot" or "tiled".
    num_shared_experts: dense SwiGLU experts every token goes through, summed (default 0).
    shared_d_ff: hidden width of each shared expert (default None: `d_ff`).
    normalize_top_k: rescale each token's K weights to sum to 1 (default True).
    load_balance_coef: weight of the load-balancing loss in `aux["aux_loss"]`
      (default 1e-2).
    z_loss_coef: weight of the router z-loss in `aux["aux_loss"]` (default 1e-3).
    param_dtype: dtype of the expert and shared-expert weights (default float32). The router
      is always float32.
    compute_dtype: dtype the tokens and expert weights are cast to for the expert matmuls,
      which accumulate in float32 (default None: the dtype of x).
    expert_axis: mesh axis the experts are split over (default "expert").
  """

  d_model: int
  d_ff: int
  num_experts: int
  top_k: int
  expert_type: str = "swiglu"
  router: str | Callable = "top_k"
  impl: str | Callable = "auto"
  capacity_factor: float | None = None
  chunk_size: int | tuple[int, int] | None = None
  recv_capacity: int | None = None
  gmm_impl: str = "auto"
  num_shared_experts: int = 0
  shared_d_ff: int | None = None
  normalize_top_k: bool = True
  load_balance_coef: float = 1e-2
  z_loss_coef: float = 1e-3
  param_dtype: jnp.dtype = jnp.dtype(jnp.float32)
  compute_dtype: jnp.dtype | None = None
  expert_axis: str = EXPERT

  def __post_init__(self):
    fn = "MoEConfig"

    def put(name, value):
      object.__setattr__(self, name, value)

    for name in ("d_model", "d_ff", "num_experts", "top_k"):
      put(name, _checks.int_field(fn, name, getattr(self, name), 1))
    if self.top_k > self.num_experts:
      raise ValueError(f"{fn}: top_k must be <= num_experts ({self.num_experts}) "
                       f"(got {self.top_k})")
    _checks.choice_field(fn, "expert_type", self.expert_type, EXPERT_TYPES)
    _checks.choice_field(fn, "gmm_impl", self.gmm_impl, GMM_IMPLS)
    put("router", _table_field("router", self.router, tuple(ROUTERS)))
    put("impl", _table_field("impl", self.impl, IMPLS))
    if self.expert_type == "linear" and self.d_ff != self.d_model:
      raise ValueError(f"{fn}: d_ff must equal d_model ({self.d_model}) when "
                       f"expert_type is 'linear', whose experts map D to F (got {self.d_ff})")
    if self.capacity_factor is not None:
      put("capacity_factor", _checks.real_field(fn, "capacity_factor", self.capacity_factor,
                                                positive=True))
    put("chunk_size", _checks.chunk_size_field(fn, self.chunk_size))
    if self.recv_capacity is not None:
      put("recv_capacity", _checks.int_field(fn, "recv_capacity", self.recv_capacity, 1))
    put("num_shared_experts",
        _checks.int_field(fn, "num_shared_experts", self.num_shared_experts, 0))
    if self.shared_d_ff is not None:
      put("shared_d_ff", _checks.int_field(fn, "shared_d_ff", self.shared_d_ff, 1))
    _checks.bool_field(fn, "normalize_top_k", self.normalize_top_k)
    for name in ("load_balance_coef", "z_loss_coef"):
      put(name, _checks.real_field(fn, name, getattr(self, name), positive=False))
    put("param_dtype", _checks.dtype_field(fn, "param_dtype", self.param_dtype))
    if self.compute_dtype is not None:
      put("compute_dtype", _checks.dtype_field(fn, "compute_dtype", self.compute_dtype))
    if not isinstance(self.expert_axis, str) or not self.expert_axis:
      raise TypeError(f"{fn}: expert_axis must be a non-empty str (got {self.expert_axis!r})")

  @property
  def shared_hidden(self):
    """Hidden width of each shared expert: `shared_d_ff`, or `d_ff` when that is None."""
    return self.d_ff if self.shared_d_ff is None else self.shared_d_ff

  def capacity(self, num_tokens):
    """Items each expert takes in a call of `num_tokens` tokens; None when dropless.

    `capacity(capacity_factor, T, K, E)`: the one capacity formula of the package.
    """
    if self.capacity_factor is None:
      return None
    return capacity(self.capacity_factor, num_tokens, self.top_k, self.num_experts)


def capacity(capacity_factor, tokens, k, num_experts):
  """Returns `ceil(capacity_factor * tokens * k / num_experts)`, the items an expert takes.

  Computed exactly on the decimal value of `capacity_factor` (so 1.1 * 10 is 11, not 12).
  At least 1 whenever tokens >= 1. The layer's capacity (`MoEConfig.capacity`, over the
  tokens of a call) and the GShard benchmark baseline's (over the tokens of a group) both
  use it.
  """
  c = fractions.Fraction(repr(float(capacity_factor)))
  return math.ceil(c * tokens * k / num_experts)


def check_config(fn, cfg):
  """Raises TypeError unless `cfg` is a `MoEConfig`."""
  if not isinstance(cfg, MoEConfig):
    raise TypeError(f"{fn}: cfg must be a MoEConfig (got {type(cfg).__name__})")
