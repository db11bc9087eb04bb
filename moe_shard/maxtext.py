"""moe_shard's layer as the MoE block of MaxText models (MaxText 0.2.5; optional, not a dependency).

From a MaxText command line, the same arguments as MaxText's trainer after this module's name:

    python -m moe_shard.maxtext maxtext/configs/base.yml model_name=mixtral-8x7b \\
        capacity_factor=-1 moe_shard_impl=auto ...

From Python, before MaxText builds its model:

    from moe_shard import maxtext as ms_maxtext
    ms_maxtext.install()                     # or: with ms_maxtext.installed(): ...

`install` replaces MaxText's `maxtext.layers.moe.RoutedMoE` with `routed_moe_class()`, a
subclass that keeps MaxText's `__init__` (so the parameters are MaxText's own: the router
`gate.kernel` [D, E], `wi_0`, `wi_1` [E, D, F], `wo` [E, F, D], DeepSeek's selection bias
`gate.bias` [E]; the same names, shapes, dtypes and logical shardings, so a MaxText checkpoint
loads, trains and serves unchanged) and computes the block with `moe_layer`: moe_shard's
router, its dispatch for the mesh (`impl`, default "auto") and its grouped matmuls. The
decoder layers that build `moe.RoutedMoE` (Mixtral) or `moe.RoutedAndSharedMoE` (DeepSeek,
whose shared experts stay MaxText's `MlpBlock`) pick it up when they are constructed.

MaxText's routing per decoder block maps onto `top_k_routing` (`moe_config`):

    mixtral:  top-k of the logits, softmax over the k  = softmax scores, top-k, normalized;
    deepseek: sigmoid scores + `gate.bias` for selection only, `n_routing_groups` groups
              ranked by their top-2 sum, `topk_routing_group` kept, the k weights (unbiased)
              normalized (sigmoid) and times `routed_scaling_factor`
              = score_func="sigmoid", bias_E, num_groups, top_k_groups, scaling.

MaxText's bookkeeping comes back as MaxText returns it: the load-balance loss by MaxText's own
`load_balance_loss` (or Megatron's sequence loss) on moe_shard's choices, and the bias update
`rate * sign(mean load - load)` from moe_shard's `expert_load`. The block is dropless: a
MaxText capacity (`capacity_factor > 0`) raises, as do the features the block does not map
(quantization, fused or padded weights, expert biases, hash or random routing, forced experts,
separate gate inputs, other activations and decoder blocks): each error names the field.

Importing `moe_shard` does not import MaxText; `install`, `routed_moe_class` and `main` do.
This module issues no collectives: the dispatch under `moe_layer` does (moe_shard/parallel).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import sys
from collections.abc import Iterator, Sequence
from typing import Any

import jax
import jax.numpy as jnp

from moe_shard.config import MoEConfig
from moe_shard.experts import SwiGLU
from moe_shard.layer import moe_layer
from moe_shard.params import MoEParams
from moe_shard.routing import top_k_router

__all__ = [
  "install",
  "installed",
  "main",
  "moe_config",
  "routed_moe_class",
  "split_options",
  "uninstall",
]

# decoder_block (MaxText's DecoderBlockType value) -> the routing it maps onto.
ROUTINGS = {"mixtral": "softmax_top_k", "deepseek": "deepseek_v3"}

# Prefixes of MaxText model names whose router keeps pre-bias scores (GateLogit, get_topk).
_DEEPSEEK_NAMES = ("deepseek3", "deepseek4", "kimi-k2")


def _unsupported(field: str, rule: str, value: Any) -> ValueError:
  return ValueError(f"moe_shard.maxtext: {field} {rule} (got {value!r})")


def _block_name(mt_cfg: Any) -> str:
  block = mt_cfg.decoder_block
  return str(getattr(block, "value", block))


def moe_config(
  mt_cfg: Any,
  *,
  num_experts: int,
  top_k: int,
  d_model: int,
  d_ff: int,
  impl: str = "auto",
  gmm_impl: str = "auto",
  chunk_size: int | tuple[int, int] | None = None,
) -> MoEConfig:
  """The `MoEConfig` of a MaxText routed MoE block.

  Args:
    mt_cfg: MaxText's config (`pyconfig.HyperParameters`).
    num_experts: the block's E.
    top_k: the block's K.
    d_model: the block's D (`moe_expert_input_dim`, or `emb_dim` when that is <= 0).
    d_ff: the block's F.
    impl: moe_shard's dispatch (default "auto": picked for the mesh and chip).
    gmm_impl: moe_shard's grouped-matmul backend (default "auto").
    chunk_size: `MoEConfig.chunk_size`, the all_to_all dispatch's rows per (source,
      destination) pair in its first and overflow rounds (default None: moe_shard's).

  Returns:
    `MoEConfig`: dropless, SwiGLU experts, MaxText's routing, no aux-loss weights (MaxText
    adds its own), `compute_dtype` MaxText's `dtype`.

  Raises:
    ValueError: a MaxText setting the block does not map, named.
  """
  block = _block_name(mt_cfg)
  if block not in ROUTINGS:
    raise _unsupported("decoder_block", f"must be one of {tuple(ROUTINGS)}", block)
  if float(mt_cfg.capacity_factor) > 0:
    raise _unsupported(
      "capacity_factor", "must be <= 0: the block is dropless", mt_cfg.capacity_factor
    )
  if tuple(mt_cfg.mlp_activations) != ("silu", "linear"):
    raise _unsupported(
      "mlp_activations", "must be ['silu', 'linear']", list(mt_cfg.mlp_activations)
    )
  for field in (
    "mlp_bias",
    "prefuse_moe_weights",
    "use_random_routing",
    "te_moe_block",
    "norm_topk_prob",
  ):
    if getattr(mt_cfg, field, False):
      raise _unsupported(field, "must be False", getattr(mt_cfg, field))
  if getattr(mt_cfg, "padded_base_moe_mlp_dim", None) is not None:
    raise _unsupported("padded_base_moe_mlp_dim", "must be None", mt_cfg.padded_base_moe_mlp_dim)
  score = mt_cfg.routed_score_func
  mixtral = MoEConfig(
    d_model=d_model,
    d_ff=d_ff,
    num_experts=num_experts,
    top_k=top_k,
    impl=impl,
    gmm_impl=gmm_impl,
    chunk_size=chunk_size,
    load_balance_coef=0.0,
    z_loss_coef=0.0,
    compute_dtype=jnp.dtype(mt_cfg.dtype),
  )
  if block == "mixtral":
    if score or mt_cfg.routed_bias:
      raise _unsupported(
        "routed_score_func / routed_bias",
        "must be '' / False for mixtral",
        (score, mt_cfg.routed_bias),
      )
    return mixtral
  if not str(mt_cfg.model_name).startswith(_DEEPSEEK_NAMES):
    raise _unsupported("model_name", f"must start with one of {_DEEPSEEK_NAMES}", mt_cfg.model_name)
  if score not in ("sigmoid", "softmax"):
    raise _unsupported("routed_score_func", "must be 'sigmoid' or 'softmax'", score)
  groups = int(mt_cfg.n_routing_groups)
  return dataclasses.replace(
    mixtral,
    score_func=score,
    normalize_top_k=score == "sigmoid",
    num_groups=1 if groups == -1 else groups,
    top_k_groups=None if groups == -1 else int(mt_cfg.topk_routing_group),
    routed_scaling=float(mt_cfg.routed_scaling_factor),
    bias_balancing=bool(mt_cfg.routed_bias),
  )


def _check_call(module, gate_inputs, input_ids, forced_routed_experts):
  """Raise on what the block does not map, at trace time."""
  if module.quant is not None:
    raise _unsupported("quantization", "must be off", type(module.quant).__name__)
  if module.is_hash_routing or input_ids is not None:
    raise _unsupported("is_hash_routing / input_ids", "must be off / None", module.is_hash_routing)
  if gate_inputs is not None:
    raise _unsupported(
      "gate_inputs", "must be None (the router reads the block's inputs)", "an array"
    )
  if forced_routed_experts is not None:
    raise _unsupported("forced_routed_experts", "must be None", "an array")
  if module.per_expert_scale is not None:
    raise _unsupported("per_expert_scale", "must be None", "a parameter")


def _maxtext_aux(module, x_BSD, params, cfg, expert_load_E):
  """MaxText's (load-balance loss, bias update) of moe_shard's routing."""
  mt = module.config
  lb_loss = None
  if mt.load_balance_loss_weight > 0.0:  # routes again: moe_layer returns loads, not choices
    B, S, D = x_BSD.shape
    logits_TE = jnp.einsum(
      "td,de->te", x_BSD.reshape(B * S, D).astype(jnp.float32), params.router_DE.astype(jnp.float32)
    )
    bias_E = None if params.router_bias is None else jax.lax.stop_gradient(params.router_bias)
    routing = top_k_router(
      logits_TE, cfg, bias_E=None if bias_E is None else bias_E.astype(jnp.float32)
    )
    scores_BSE = routing.probs_TE.reshape(B, S, -1)
    if _block_name(mt) == "mixtral":  # MaxText's probabilities are the softmax of the logits
      scores_BSE = logits_TE.reshape(B, S, -1)
    if getattr(mt, "moe_use_megatron_seq_aux_loss", False) and cfg.score_func == "sigmoid":
      lb_loss = module.megatron_seq_aux_loss(scores_BSE)
    else:
      probs_BSE = jax.nn.softmax(scores_BSE, axis=-1).astype(mt.dtype)
      lb_loss = module.load_balance_loss(routing.experts_TK.reshape(B, S, -1), probs_BSE)
  bias_updates = None
  if module.should_update_load_balance():
    from maxtext.layers import moe  # pyright: ignore[reportMissingImports]

    bias_updates = moe.load_balance_updates_from_counts(
      expert_load_E, cfg.num_experts, mt.routed_bias_update_rate
    )
  return lb_loss, bias_updates


def routed_moe_class(
  impl: str = "auto", gmm_impl: str = "auto", chunk_size: int | tuple[int, int] | None = None
) -> type:
  """MaxText's `RoutedMoE` computed by `moe_layer`: its subclass with the same parameters.

  Args:
    impl: moe_shard's dispatch (default "auto").
    gmm_impl: moe_shard's grouped-matmul backend (default "auto").
    chunk_size: `moe_config`'s (default None).

  Returns:
    The class (one per (impl, gmm_impl, chunk_size)); imports MaxText.
  """
  return _routed_moe_class(impl, gmm_impl, chunk_size)


@functools.cache
def _routed_moe_class(impl, gmm_impl, chunk_size):
  from maxtext.layers import moe  # pyright: ignore[reportMissingImports]

  original = getattr(moe.RoutedMoE, "_moe_shard_original", moe.RoutedMoE)

  class MoeShardRoutedMoE(original):
    """MaxText's RoutedMoE (its parameters) with moe_shard's `moe_layer` as the computation."""

    _moe_shard_original = original

    def moe_shard_config(self) -> MoEConfig:
      return moe_config(
        self.config,
        num_experts=self.num_experts,
        top_k=self.num_experts_per_tok,
        d_model=self.moe_expert_input_dim,
        d_ff=self.intermediate_dim,
        impl=impl,
        gmm_impl=gmm_impl,
        chunk_size=chunk_size,
      )

    def moe_shard_params(self) -> MoEParams:
      """MaxText's variables as `MoEParams` (the same arrays)."""
      bias = self.gate.bias
      return MoEParams(
        router_DE=self.gate.kernel[...],
        experts=SwiGLU(gate_EDF=self.wi_0[...], up_EDF=self.wi_1[...], down_EFD=self.wo[...]),
        shared=None,
        router_bias=None if bias is None else bias[...].astype(jnp.float32),
      )

    def __call__(
      self, inputs, input_ids=None, gate_inputs=None, out_sharding=None, forced_routed_experts=None
    ):
      _check_call(self, gate_inputs, input_ids, forced_routed_experts)
      cfg = self.moe_shard_config()
      params = self.moe_shard_params()
      x_BSD = inputs.astype(self.config.dtype)
      y_BSD, aux = moe_layer(params, x_BSD, cfg, mesh=self.mesh)
      if out_sharding is not None:
        y_BSD = jax.lax.with_sharding_constraint(y_BSD, out_sharding)
      lb_loss, bias_updates = _maxtext_aux(self, x_BSD, params, cfg, aux["expert_load"])
      return y_BSD, lb_loss, bias_updates

  MoeShardRoutedMoE.__module__ = __name__
  return MoeShardRoutedMoE


def install(
  impl: str = "auto", gmm_impl: str = "auto", chunk_size: int | tuple[int, int] | None = None
) -> type:
  """Makes MaxText build moe_shard's block wherever it builds `RoutedMoE` from now on.

  Replaces `maxtext.layers.moe.RoutedMoE` (and the name in every loaded `maxtext.*` module
  that imported it) with `routed_moe_class(impl, gmm_impl, chunk_size)`. Models built before keep their
  blocks.

  Args:
    impl: moe_shard's dispatch (default "auto").
    gmm_impl: moe_shard's grouped-matmul backend (default "auto").
    chunk_size: `moe_config`'s (default None).

  Returns:
    The installed class.
  """
  cls = routed_moe_class(impl, gmm_impl, chunk_size)
  _replace(cls._moe_shard_original, cls)
  return cls


def uninstall() -> None:
  """Puts MaxText's own `RoutedMoE` back (after `install`); a no-op otherwise."""
  from maxtext.layers import moe  # pyright: ignore[reportMissingImports]

  original = getattr(moe.RoutedMoE, "_moe_shard_original", None)
  if original is not None:
    _replace(original, original)


def _replace(original: type, new: type) -> None:
  """Sets `RoutedMoE` to `new` in every loaded maxtext module holding `original` or a
  class `install` made from it."""
  for name, module in list(sys.modules.items()):
    held = getattr(module, "RoutedMoE", None) if name.startswith("maxtext.") else None
    if held is original or getattr(held, "_moe_shard_original", None) is original:
      module.RoutedMoE = new  # pyright: ignore[reportAttributeAccessIssue]


@contextlib.contextmanager
def installed(
  impl: str = "auto", gmm_impl: str = "auto", chunk_size: int | tuple[int, int] | None = None
) -> Iterator[type]:
  """`install` for the duration of a `with` block, then MaxText's own block again."""
  cls = install(impl, gmm_impl, chunk_size)
  try:
    yield cls
  finally:
    uninstall()


def split_options(argv: Sequence[str]) -> tuple[dict[str, Any], list[str]]:
  """`main`'s arguments: ({"impl", "gmm_impl", "chunk_size"}, the arguments left for MaxText).

  `moe_shard_impl=NAME` and `moe_shard_gmm_impl=NAME` (default "auto" each) and
  `moe_shard_chunk_size=C` or `=C_FIRST,C_OVERFLOW` (default None) are taken out; every
  other argument, `argv[0]` first, is kept in order.

  Raises:
    ValueError: a `moe_shard_chunk_size` that is not one or two integers.
  """
  options: dict[str, Any] = {"impl": "auto", "gmm_impl": "auto", "chunk_size": None}
  rest = list(argv[:1])
  for arg in argv[1:]:
    key, sep, value = arg.partition("=")
    if sep and key in ("moe_shard_impl", "moe_shard_gmm_impl"):
      options[key.removeprefix("moe_shard_")] = value
    elif sep and key == "moe_shard_chunk_size":
      try:
        sizes = tuple(int(v) for v in value.split(","))
      except ValueError:
        sizes = ()
      if len(sizes) not in (1, 2):
        raise _unsupported("moe_shard_chunk_size", "must be C or C_FIRST,C_OVERFLOW", value)
      options["chunk_size"] = sizes[0] if len(sizes) == 1 else sizes
    else:
      rest.append(arg)
  return options, rest


def main(argv: Sequence[str] | None = None) -> None:
  """MaxText's trainer (`maxtext.trainers.pre_train.train`) with moe_shard's block.

  Args:
    argv: MaxText's command line (default `sys.argv`), with `moe_shard_impl=NAME`,
      `moe_shard_gmm_impl=NAME` and `moe_shard_chunk_size=C[,C]` optional (`split_options`).
  """
  options, rest = split_options(sys.argv if argv is None else argv)
  install(**options)
  from absl import app  # pyright: ignore[reportMissingImports]
  from maxtext.trainers.pre_train import train  # pyright: ignore[reportMissingImports]

  app.run(train.main, argv=rest)


if __name__ == "__main__":
  main()
