"""The MoE layer: router, capacity, dispatch, expert FFN, combine and shared experts.

    y[t] = shared(x[t]) + sum_j G[t, j] * expert(W[B[t, j]], x[t])

(with `weights_on="input"`: `expert(W[B[t, j]], G[t, j] * x[t])`, unweighted sum; with
`shared_expert_gate`: `shared(x[t])` times `sigmoid(x[t] @ shared_gate_D)`).

`moe_layer` composes the three independent choices of the package, each a named stage:

  * route    (`routing.py`): float32 router logits (plus `params.router_logit_bias` with
    `router_logit_bias`) -> the router of `MoEConfig.router`
    (default softmax top-k; with `bias_balancing`, `params.router_bias` shifts the
    selection) run on each routing group -> (weights, experts); the auxiliary losses
    (`balance.py`); then, with a capacity, `drop_over_capacity` sets the expert id of
    every item past its expert's capacity to -1 (expert choice applies its own).
  * dispatch (`dispatch.py`): an entry of `DISPATCHES` or the user's function, chosen by
    `MoEConfig.impl`. Ids outside [0, E) contribute zero in every one of them, so capacity
    drops give the same result whatever the implementation. With `weights_on="input"` the
    dispatch gets the T*K items `G[t, j] * x[t]`, one expert each with weight 1
    (`input_weighted_items`), and the layer sums each token's K outputs.
  * experts  (`experts.py`): a class of `EXPERTS` (`cfg.expert_type`), expert axis first.

Parameters are a `MoEParams` pytree built by `init_moe_params`; with a mesh they are created
already placed: expert weights split over the expert axis, router and shared experts
replicated (`moe_param_specs`).

On a mesh. Tokens are split over every mesh axis. The router runs per device under `shard_map`
(`route`), so by default a routing group is the tokens of one device (`num_routing_groups`).
`jax.make_mesh` defaults to `AxisType.Explicit`, under which JAX refuses to guess shardings
for sort and scatter: the stages that are plain array programs (capacity, load statistics,
the local implementations) run under `jax.sharding.auto_axes`, so XLA chooses their
shardings; the expert-parallel implementations place their inputs themselves. The output has the sharding of `x_BSD`. Capacity needs the global token order:
on a mesh XLA all-gathers the T*K int32 expert ids for it (4*K bytes per token, against
D*b for the token itself).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import AbstractMesh, Mesh
from jax.sharding import PartitionSpec as P
from jaxtyping import Array, Float, Int

from moe_shard import _checks, local, parallel
from moe_shard.balance import expert_load, router_z_loss
from moe_shard.config import MoEConfig, check_config
from moe_shard.dispatch import (
  Dispatch,
  DispatchFn,
  check_placement_keywords,
  get_dispatch,
)
from moe_shard.exchange_rule import choose_impl
from moe_shard.experts import shared_experts
from moe_shard.frozen import freeze
from moe_shard.parallel.common import split_specs
from moe_shard.params import MoEParams, _check_params, check_split_axes, moe_param_specs
from moe_shard.placement import Placement, check_placement, concrete
from moe_shard.quant import expand, is_quantized
from moe_shard.remat import MOE_DISPATCH_OUT, MOE_ROUTER_LOGITS
from moe_shard.replica_rule import StepPlacement
from moe_shard.replicas import SlotParams, as_slots
from moe_shard.route_groups import num_routing_groups, route
from moe_shard.routing import drop_over_capacity, get_router
from moe_shard.sharding import (
  auto,
  axis_size,
  explicit_mesh,
  flatten_tokens,
  like,
  place,
  resolve_mesh,
  unflatten_tokens,
)
from moe_shard.slot_moves import check_made_for

# The named scope of the per-step placement's `lax.cond` (the benchmark names its branch).
STEP_SCOPE = "step_placement"


def moe_layer(
  params: MoEParams,
  x_BSD: Float[Array, "B S D"],
  cfg: MoEConfig,
  mesh: Mesh | AbstractMesh | None = None,
  placement: Placement | StepPlacement | str | None = None,
) -> tuple[Float[Array, "B S D"], dict[str, Array]]:
  """Applies one MoE layer: route, (drop over capacity), dispatch, combine, add shared.

      logits_TE = x_TD @ router_DE                      (float32)
      weights_TK, experts_TK = router(logits_TE)        (per routing group; default top-k)
      y[t] = shared(x[t]) + sum_j weights[t, j] * expert(W[experts[t, j]], x[t])

  T = B * S tokens. Works under `jax.jit` (cfg and mesh static), `jax.grad` (w.r.t. params
  and x) and inside `lax.scan` over stacked params.

  Args:
    params: `MoEParams` from `init_moe_params(key, cfg)`, or, with a `Placement`, the
      slot-major `SlotParams` that `replicate_experts(params, placement)` made for it.
    x_BSD: f[B, S, D] tokens, D = cfg.d_model; on the mesh or not.
    cfg: `MoEConfig`.
    mesh: a `jax.sharding.Mesh` (or, under `jax.jit` or `jax.eval_shape`, an
      `AbstractMesh`) with `cfg.expert_axis`, whose size must divide E. None (default): the
      mesh in scope (`jax.set_mesh(mesh)`) when it has the expert axis, else no mesh.
      Required by the expert-parallel implementations; when the expert axis has more than
      one device "auto" picks the exchange for the chip and the tokens per device
      (`choose_impl`). The local implementations ("masked_scan",
      "ragged_dot") do not split experts: XLA shards them as it likes.
    placement: None (default), a one-layer `Placement` of the E experts over S slots
      (replicated experts: each item goes to one replica of its expert, the outputs and
      gradients are the layer's without one; logical params fetch the slots' weights
      and sum their gradients back), or "step" / a `StepPlacement` (planned inside the
      step from its own load, used where it pays). docs/guides/skew.md. A placement
      passed traced is not checked: with logical params it must give every expert a
      slot (as `plan_placement` and the per-step plan do), or the slots' gradient return
      is sized too small.

  Returns:
    (y_BSD, aux). y_BSD has the shape, dtype and sharding of x_BSD. aux is a dict:
      aux_loss: f32[] `load_balance_coef * load_balance_loss + z_loss_coef * z_loss`,
        to add to the training loss.
      load_balance_loss: f32[] the router's balance loss of its choices (before any
        capacity drop), unweighted; 1.0 when balanced: softmax top-k
        `load_balancing_loss`, sigmoid top-k `sequence_balance_loss` over each of the B
        sequences, expert choice 0.0 (`balance.py`).
      z_loss: f32[] `router_z_loss`, unweighted.
      expert_load: i32[E] (token, slot) items each expert computed (after capacity drops,
        and without the items of experts a traced placement gives no slot).
      rounds: i32[] dispatch rounds: the dispatch's `stats["rounds"]` (the all_to_all's,
        >= 1), else 1 (one pass).
      dropped_items: i32[] (token, slot) items dropped by the capacity (0 when dropless)
        or for want of a slot (an expert a placement passed traced, which is not checked,
        gives none), plus any the dispatch reports dropping (`stats["dropped_items"]`).
      dropped_tokens: i32[] tokens that reach no routed expert: all of their K items dropped
        (by the capacity, or for want of a slot), or under expert choice chosen by no
        expert (they get the shared experts' output only).
      device_load: i32[N] (token, expert) items computed at each position of the expert
        axis (summed over the other mesh axes; N = 1 without a mesh), replicas counted
        where they run.
      balancedness: f32[] mean / max of device_load (1.0 when even; 1.0 when empty).
      step_placement: i32[] (placement "step" only) 1 when the step's plan was used, 0
        when it did not pay.
    Other statistics of a dispatch (e.g. the all_to_all's items sent per device) come from
    calling it directly (`moe_all_to_all(..., return_stats=True)`).

  Raises:
    TypeError, ValueError: a bad cfg, mesh, x (rank, dtype, d_model) or params (a leaf
      missing or of the wrong shape, named), `cfg.routing_groups` not dividing B * S, or a
      bad placement (not of E experts, slots not dividing the expert axis, slot-major
      params without theirs), at trace time.
    TypeError: differentiating params in a quantized matrix (a `QuantizedArray`'s float
      scales or FP8 values), at trace time: quantized matrices are frozen; differentiate
      the leaves of `split_trainable(params)[0]` (docs/guides/quantization.md).
  """
  x_BSD, call = _check(params, x_BSD, cfg, mesh, placement)
  E = cfg.num_experts
  x_TD = flatten_tokens(x_BSD, call.mesh)  # on an Explicit mesh: split over it (if T divides)
  params = _place_params(params, x_TD, cfg, call.mesh)
  with jax.named_scope("route"):
    routing, lb_loss, z_loss = _route(params, x_TD, cfg, call.mesh, x_BSD.shape[1])
    experts_TK, dropped_TK, load_E = _drop(routing.experts_TK, cfg, call.placement)
  with jax.named_scope("dispatch"):
    y_TD, stats = _dispatch(params, x_TD, experts_TK, routing.weights_TK, load_E, cfg, call)
    y_TD = checkpoint_name(like(y_TD.astype(jnp.float32), x_TD), MOE_DISPATCH_OUT)
  if params.shared is not None:
    with jax.named_scope("shared_experts"):
      y_TD = y_TD + _shared(params, x_TD.astype(call.compute_dtype), cfg, call.mesh)
  y_BSD = unflatten_tokens(y_TD.astype(x_BSD.dtype), x_BSD, call.mesh)
  aux = dict(
    aux_loss=cfg.load_balance_coef * lb_loss + cfg.z_loss_coef * z_loss,
    load_balance_loss=lb_loss,
    z_loss=z_loss,
    expert_load=load_E,
    rounds=jnp.asarray(stats.get("rounds", 1), jnp.int32),
    dropped_items=jnp.sum(dropped_TK, dtype=jnp.int32) + stats.get("dropped_items", 0),
    dropped_tokens=jnp.sum(jnp.all((experts_TK < 0) | (experts_TK >= E), axis=1), dtype=jnp.int32),
    device_load=stats["device_load"],
    balancedness=balancedness(stats["device_load"]),
  )
  if "step_placement" in stats:
    aux["step_placement"] = stats["step_placement"]
  return like(y_BSD, x_BSD), aux


@dataclasses.dataclass(frozen=True)
class _Call:
  """What `_check` resolved of one call."""

  mesh: Mesh | AbstractMesh | None
  n: int  # devices on the expert axis (1 without a mesh)
  placement: Placement | StepPlacement | None
  slot_weights: bool  # params hold the placement's slots (SlotParams)
  impl: str | DispatchFn
  dispatch: Dispatch
  compute_dtype: Any


def _check(params, x_BSD, cfg, mesh, placement):
  """Check: the config, x (returned as an array), the mesh, params with the placement, and
  the dispatch."""
  fn = "moe_layer"
  check_config(fn, cfg)
  x_BSD = _checks.float_array(fn, "x_BSD", x_BSD)
  if x_BSD.ndim != 3 or x_BSD.shape[-1] != cfg.d_model:
    raise ValueError(
      f"{fn}: x_BSD must have shape [B, S, d_model={cfg.d_model}] (got shape {tuple(x_BSD.shape)})"
    )
  mesh = resolve_mesh(fn, mesh, cfg.expert_axis, cfg.num_experts, required=False)
  n = 1 if mesh is None else axis_size(mesh, cfg.expert_axis)
  placement, slot_weights = _check_placement(fn, params, cfg, placement, n)
  check_split_axes(fn, cfg, mesh)
  T = x_BSD.shape[0] * x_BSD.shape[1]
  num_routing_groups(cfg, T, mesh)  # raises on groups that do not divide T
  tokens = None if mesh is None else -(-T // mesh.size)
  impl = choose_impl(cfg, mesh, tokens=tokens, replicated=placement is not None)
  dispatch = get_dispatch(impl)
  if placement is not None:
    check_placement_keywords(fn, dispatch.fn)
  if mesh is None and dispatch.needs_mesh:
    raise ValueError(
      f"{fn}: impl {impl!r} needs a mesh with the expert axis "
      f"{cfg.expert_axis!r} (got mesh=None, and no mesh in scope with that "
      f"axis): pass mesh= or call under `with jax.set_mesh(mesh):`"
    )
  compute_dtype = cfg.compute_dtype or x_BSD.dtype
  return x_BSD, _Call(mesh, n, placement, slot_weights, impl, dispatch, compute_dtype)


def _place_params(params, x_TD, cfg, mesh):
  """Place: parameters not on an Explicit mesh yet, placed as `moe_param_specs` says (a
  router gradient would otherwise contract the split token axis with an unplaced array);
  quantized matrices frozen (differentiating one raises, naming it: it has no gradient)."""
  params = freeze("moe_layer", params)
  if mesh is None or not explicit_mesh(x_TD)[1] or explicit_mesh(params.router_DE)[1]:
    return params
  specs = moe_param_specs(dataclasses.replace(cfg, weights_format=None))
  if isinstance(params, SlotParams):  # the same specs: the slot axis splits like E
    specs = as_slots(specs, params)
  specs = expand(specs, params)
  return jax.tree.map(lambda a, spec: place(a, mesh, spec), params, specs)


def _route(params, x_TD, cfg, mesh, seq_len):
  """Route: float32 logits, the router per routing group, its balance loss and the z-loss."""
  logits_TE = jnp.einsum(
    "td,de->te", x_TD.astype(jnp.float32), params.router_DE.astype(jnp.float32)
  )
  if params.router_logit_bias is not None:  # trained: the router and the z-loss see it
    logits_TE = logits_TE + params.router_logit_bias.astype(jnp.float32)
  logits_TE = checkpoint_name(logits_TE, MOE_ROUTER_LOGITS)
  bias_E = params.router_bias
  if bias_E is not None:  # selection only: it is moved by update_router_bias, not grad
    bias_E = jax.lax.stop_gradient(bias_E.astype(jnp.float32))
  routing = route(logits_TE, cfg, mesh, bias_E)
  balance_loss = functools.partial(get_router(cfg.router).balance_loss, cfg=cfg, seq_len=seq_len)
  lb_loss = auto(balance_loss, routing.experts_TK, lambda _: P())(routing)
  return routing, lb_loss, router_z_loss(logits_TE)


def _drop(experts_TK, cfg, placement):
  """Drop: items past their expert's capacity, and of experts a traced placement gives no
  slot (a traced placement is not checked), get id -1. Returns (experts_TK, dropped_TK,
  load_E: i32[E] the items each expert computes)."""
  E, T = cfg.num_experts, experts_TK.shape[0]
  capacity = None if get_router(cfg.router).applies_capacity else cfg.capacity(T)
  if capacity is None:
    dropped_TK = jnp.zeros_like(experts_TK, dtype=bool)
  else:
    drop = functools.partial(drop_over_capacity, num_experts=E, capacity=capacity)
    experts_TK, dropped_TK = auto(drop, experts_TK, lambda spec: (spec, spec))(experts_TK)
  if isinstance(placement, Placement) and not concrete(placement.logcnt):
    fn_drop = auto(drop_unplaced, experts_TK, lambda spec: (spec, spec))
    experts_TK, dropped_TK = fn_drop(experts_TK, dropped_TK, placement.logcnt)
  load = functools.partial(expert_load, num_experts=E)
  return experts_TK, dropped_TK, auto(load, experts_TK, lambda _: P())(experts_TK)


def _dispatch(params, x_TD, experts_TK, weights_TK, load_E, cfg, call):
  """Dispatch: the items to their experts (or replicas) and back, combined with the
  weights. stats: the dispatch's, with device_load (and step_placement for "step")."""
  placement = call.placement
  if isinstance(placement, StepPlacement):
    return _dispatch_step(params, x_TD, experts_TK, weights_TK, load_E, cfg, call)
  experts = params.experts
  if call.slot_weights:  # each replica's gradient: its expert's (summed over the replicas)
    specs = split_specs(experts, cfg.expert_axis, cfg.expert_tensor_axis, cfg.expert_fsdp_axis)
    experts = parallel.tie_replicas(
      experts, placement, mesh=call.mesh, expert_axis=cfg.expert_axis, specs=specs
    )
  # Quantized matrices stay as they are: the matmuls dequantize them to the compute dtype.
  cast = lambda a: a if is_quantized(a) else a.astype(call.compute_dtype)
  ffn = jax.tree.map(cast, experts, is_leaf=is_quantized)
  kwargs = {} if placement is None else dict(placement=placement, slot_weights=call.slot_weights)
  run = functools.partial(call.dispatch.fn, ffn=ffn, mesh=call.mesh, cfg=cfg, **kwargs)
  x_TD = x_TD.astype(call.compute_dtype)
  if cfg.weights_on == "output":
    y_TD, stats = run(x_TD, experts_TK=experts_TK, weights_TK=weights_TK)
  else:
    items = auto(local.input_weighted_items, x_TD, lambda spec: (spec, spec, spec))
    x_ID, experts_I1, ones_I1 = items(x_TD, experts_TK, weights_TK)
    y_ID, stats = run(x_ID, experts_TK=experts_I1, weights_TK=ones_I1)
    y_TD = auto(functools.partial(local.sum_items, tokens=x_TD.shape[0]), y_ID, lambda spec: spec)(
      y_ID
    )
  if placement is not None and "slot_load" not in stats:
    raise ValueError(
      f"moe_layer: with a placement the dispatch's stats must hold 'slot_load' (i32[S], "
      f"items each slot computed; docs/guides/dispatch.md); impl {call.impl!r} returned "
      f"{sorted(stats)}"
    )
  per_device = device_load(load_E if placement is None else stats["slot_load"], call.n)
  return y_TD, dict(stats, device_load=per_device)


def _dispatch_step(params, x_TD, experts_TK, weights_TK, load_E, cfg, call):
  """The per-step placement: planned from the step's load, and the dispatch run on it only
  where the plan pays (a `lax.cond`: otherwise the dispatch without a placement, with none
  of the slots' buffers, fetch or gradient return)."""
  step = call.placement
  assert isinstance(step, StepPlacement)
  without = dataclasses.replace(call, placement=None)
  if call.mesh is None or call.n == 1:  # one device: nothing to spread over
    y_TD, stats = _dispatch(params, x_TD, experts_TK, weights_TK, load_E, cfg, without)
    return y_TD, dict(stats, step_placement=jnp.zeros((), jnp.int32))
  with jax.named_scope("plan_step"):
    planned, used = step.plan(load_E, call.n, call.mesh.size // call.n)

  def branch(c):
    def run(operands):
      params, x_TD, experts_TK, weights_TK = operands
      y_TD, stats = _dispatch(params, x_TD, experts_TK, weights_TK, load_E, cfg, c)
      keep = ("rounds", "dropped_items", "device_load")
      return y_TD, {k: jnp.asarray(stats.get(k, 0 if k != "rounds" else 1)) for k in keep}

    return run

  operands = (params, x_TD, experts_TK, weights_TK)
  with jax.named_scope(STEP_SCOPE):
    with_plan = dataclasses.replace(call, placement=planned)
    y_TD, stats = jax.lax.cond(used, branch(with_plan), branch(without), operands)
  return y_TD, dict(stats, step_placement=used.astype(jnp.int32))


def _shared(params, x_TD, cfg, mesh):
  """The shared experts' output (gated with `shared_expert_gate`)."""
  split = (cfg.expert_tensor_axis, cfg.expert_fsdp_axis) != (None, None)
  if mesh is not None and split and x_TD.shape[0] % mesh.size == 0:  # explicit collectives
    shared_TD = parallel.shared_mlp(
      params.shared,
      x_TD,
      mesh=mesh,
      tensor_axis=cfg.expert_tensor_axis,
      fsdp_axis=cfg.expert_fsdp_axis,
    )
  else:  # XLA shards it as it likes
    shared_TD = shared_experts(params.shared, x_TD)
  if params.shared_gate_D is not None:  # one gate per token on the shared experts' sum
    gate_D = params.shared_gate_D.astype(jnp.float32)
    gate_T = jax.nn.sigmoid(jnp.einsum("td,d->t", x_TD.astype(jnp.float32), gate_D))
    shared_TD = shared_TD * gate_T[:, None]
  return shared_TD


def drop_unplaced(experts_TK, dropped_TK, logcnt_E):
  """(experts_TK with -1 for the items of experts `logcnt_E` gives no slot, dropped_TK
  with those items set)."""
  E = logcnt_E.shape[0]
  valid = (experts_TK >= 0) & (experts_TK < E)
  unplaced = valid & (jnp.asarray(logcnt_E)[jnp.clip(experts_TK, 0, E - 1)] < 1)
  return jnp.where(unplaced, -1, experts_TK), dropped_TK | unplaced


def device_load(load: Int[Array, " S"], num_devices: int) -> Int[Array, " N"]:
  """i32[N]: the items of each device's S / N experts or slots."""
  return jnp.sum(load.reshape(num_devices, -1), axis=1, dtype=jnp.int32)


def balancedness(per_device: Int[Array, " N"]) -> Float[Array, ""]:
  """f32[]: the mean of `device_load` over its max (1.0 when all are zero)."""
  busiest = jnp.max(per_device)
  mean = jnp.mean(per_device.astype(jnp.float32))
  return jnp.where(busiest > 0, mean / jnp.maximum(busiest, 1).astype(jnp.float32), 1.0)


def _check_placement(fn, params, cfg, placement, n):
  """Checks params and placement together: (the placement, StepPlacement or None, and
  whether params hold its slots)."""
  served = isinstance(params, SlotParams)
  if isinstance(placement, str):
    if placement != "step":
      raise ValueError(
        f"{fn}: placement must be a Placement, 'step', a StepPlacement or None (got {placement!r})"
      )
    placement = StepPlacement()
  if isinstance(placement, StepPlacement):
    if served:
      raise ValueError(
        f"{fn}: placement 'step' plans on the logical parameters (MoEParams); got "
        f"slot-major SlotParams: pass the placement they were made for"
      )
    if n > 1:
      _checks.divisible(fn, "num_experts", cfg.num_experts, "the expert axis size", n)
    _check_params(fn, params, cfg)
    return placement, False
  if placement is None:
    if served:
      raise ValueError(
        f"{fn}: params are slot-major (SlotParams from replicate_experts): pass the "
        f"placement they were made for (got placement=None)"
      )
    _check_params(fn, params, cfg)
    return None, False
  placement = check_placement(fn, placement, cfg.num_experts, n)
  if served:
    S = placement.num_slots
    first = jax.tree.leaves(params.experts)[0].shape[0]
    if first != S:
      raise ValueError(
        f"{fn}: params.experts must hold the placement's {S} slots on axis 0 (got {first})"
      )
    check_made_for(fn, "placement", params, placement)
    # The slots checked as experts, by shape only (abstract zeros of E experts' shapes).
    E = cfg.num_experts

    def probe():
      experts = jax.tree.map(lambda a: jnp.zeros((E,) + a.shape[1:], a.dtype), params.experts)
      _check_params(fn, dataclasses.replace(params, experts=experts), cfg)

    jax.eval_shape(probe)
  else:
    _check_params(fn, params, cfg)
  return placement, served
