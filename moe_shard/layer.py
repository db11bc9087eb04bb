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

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import AbstractMesh, Mesh
from jax.sharding import PartitionSpec as P
from jaxtyping import Array, Float, Int

from moe_shard import _checks, parallel
from moe_shard.balance import expert_load, router_z_loss
from moe_shard.config import MoEConfig, check_config
from moe_shard.dispatch import check_placement_keywords, choose_impl, get_dispatch
from moe_shard.experts import shared_experts
from moe_shard.parallel.common import split_specs
from moe_shard.params import MoEParams, _check_params, check_split_axes, moe_param_specs
from moe_shard.placement import Placement, check_placement, concrete
from moe_shard.quant import expand, freeze, is_quantized
from moe_shard.remat import MOE_DISPATCH_OUT, MOE_ROUTER_LOGITS
from moe_shard.replica_rule import StepPlacement
from moe_shard.replicas import SlotParams
from moe_shard.routing import Routing, drop_over_capacity, get_router, route_in_groups
from moe_shard.sharding import (
  auto,
  axis_size,
  explicit_mesh,
  flatten_tokens,
  like,
  place,
  resolve_mesh,
  token_spec,
  unflatten_tokens,
)

# --------------------------------------------------------------------------- routing stage


def num_routing_groups(
  cfg: MoEConfig, num_tokens: int, mesh: Mesh | AbstractMesh | None = None
) -> int:
  """Returns G, the routing groups of a call: runs of consecutive tokens routed on their own.

  A router sees the tokens of one group at a time (`routing.route_in_groups`). Top-k is per
  token, so G changes nothing there; expert choice ranks each group's tokens on its own, so
  its result depends on G. `cfg.routing_groups` when set; by default (None) one group per
  device on a mesh whose size divides the tokens (the router then runs per device, with no
  communication), else 1 (all the tokens of the call). Group g is tokens [g*T/G, (g+1)*T/G)
  of the flattened `x_BSD` (batch-major), which on a mesh is the g-th device's share of the
  tokens, in the order of the mesh's devices. So a mesh result is reproduced on one device by
  `routing_groups=mesh.size`.

  Args:
    cfg: `MoEConfig`.
    num_tokens: T, the tokens of the call (B * S).
    mesh: None (default) or the layer's mesh.

  Returns:
    int G, dividing T.

  Raises:
    ValueError: `cfg.routing_groups` does not divide T.
  """
  if cfg.routing_groups is not None:
    _checks.divisible("moe_layer", "tokens B*S", num_tokens, "routing_groups", cfg.routing_groups)
    return cfg.routing_groups
  if mesh is not None and num_tokens % mesh.size == 0:
    return mesh.size
  return 1


def route(logits_TE, cfg, mesh=None, bias_E=None):
  """Runs the router of `cfg.router` on each routing group, token-parallel on a mesh.

  XLA's partitioner all-gathers the input of TopK (every device would route all T tokens),
  so on a mesh whose size divides T and the number of groups G (`num_routing_groups`) the
  router runs under `shard_map` over the tokens instead, G / mesh.size groups per device:
  no communication. Otherwise it runs on the whole [T, E] array, a vmap over groups.

  Args:
    logits_TE: f32[T, E] router logits.
    cfg: `MoEConfig` (router, top_k, normalize_top_k, ...).
    mesh: None (default) or the layer's mesh.
    bias_E: None (default) or f32[E] selection bias (`bias_balancing`), passed to the router.

  Returns:
    `Routing`, split over every mesh axis when on a mesh that divides T.
  """
  T = logits_TE.shape[0]
  G = num_routing_groups(cfg, T, mesh)
  kwargs = {} if bias_E is None else dict(bias_E=bias_E)
  if mesh is not None and T % mesh.size == 0 and G % mesh.size == 0:
    router = _token_parallel_router(cfg, mesh, G // mesh.size, bias_E is not None)
    return router(
      place(logits_TE, mesh, token_spec(mesh)),
      *([] if bias_E is None else [place(bias_E, mesh, P())]),
    )
  router = functools.partial(route_in_groups, get_router(cfg.router), cfg=cfg, groups=G, **kwargs)
  if G == 1:
    return router(logits_TE)
  # Groups of a token-split array: let XLA choose the shardings of the reshape and the sort.
  # Routing(spec, spec, spec): a pytree of PartitionSpecs, the specs of a Routing's leaves.
  return auto(router, logits_TE, lambda spec: Routing(spec, spec, spec))(logits_TE)  # pyright: ignore[reportArgumentType]


@functools.lru_cache(maxsize=64)
def _token_parallel_router(cfg, mesh, groups_per_device, with_bias):
  """The router of one (config, mesh) under shard_map, built once (no re-trace per call)."""
  tok = token_spec(mesh)
  router = get_router(cfg.router)

  def body(logits_TE, *bias_E):  # per device: T / mesh.size tokens
    kwargs = dict(bias_E=bias_E[0]) if with_bias else {}
    return route_in_groups(router, logits_TE, cfg, groups_per_device, **kwargs)

  in_specs = (tok, P()) if with_bias else (tok,)
  # out_specs: a Routing of PartitionSpecs, one per leaf.
  return jax.jit(
    jax.shard_map(body, mesh=mesh, in_specs=in_specs, out_specs=Routing(tok, tok, tok))  # pyright: ignore[reportArgumentType]
  )


# --------------------------------------------------------------------------- layer


def input_weighted_items(
  x_TD: Float[Array, "T D"], experts_TK: Int[Array, "T K"], weights_TK: Float[Array, "T K"]
) -> tuple[Float[Array, "I D"], Int[Array, "I 1"], Float[Array, "I 1"]]:
  """The items of `weights_on="input"`: each (token, slot) is its own row `w * x`, weight 1.

      x_ID[t*K + j] = weights_TK[t, j] * x_TD[t]      (in float32, then x's dtype)
      experts_I1[t*K + j, 0] = experts_TK[t, j]

  So any dispatch computes `expert(w * x)` per item; `sum_items` adds each token's K
  outputs. Item order is token-major: a token's items stay on the device of the token.
  For K = 1 this is just the tokens scaled by their weight. A dropped item (id -1) stays
  dropped and contributes zero.

  Args:
    x_TD: f[T, D] tokens.
    experts_TK: i32[T, K] expert ids.
    weights_TK: f32[T, K] combine weights.

  Returns:
    (x_ID: f[T*K, D] in the dtype of x_TD, experts_I1: i32[T*K, 1], ones_I1: f32[T*K, 1]).
  """
  T, K = experts_TK.shape
  x_TKD = weights_TK[:, :, None].astype(jnp.float32) * x_TD[:, None, :].astype(jnp.float32)
  x_ID = x_TKD.reshape(T * K, x_TD.shape[1]).astype(x_TD.dtype)
  return x_ID, experts_TK.reshape(T * K, 1), jnp.ones((T * K, 1), jnp.float32)


def sum_items(y_ID: Float[Array, "I D"], tokens: int) -> Float[Array, "T D"]:
  """Sums the K consecutive item outputs of each token: f[T*K, D] -> f32[T, D]."""
  return jnp.sum(y_ID.reshape(tokens, -1, y_ID.shape[-1]).astype(jnp.float32), axis=1)


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
      one device "auto" picks "all_to_all" at up to 64 tokens per device, else
      "ragged_all_to_all" on TPU and GPU devices and "all_to_all" elsewhere
      (`choose_impl`). The local implementations ("masked_scan",
      "ragged_dot") do not split experts: XLA shards them as it likes.
    placement: None (default), a one-layer `Placement` of the E experts over S slots
      (replicated experts: each item goes to one replica of its expert, the outputs and
      gradients are the layer's without one; logical params fetch the slots' weights
      and sum their gradients back), or "step" / a `StepPlacement` (planned inside the
      step from its own load, used where it pays). docs/guides/skew.md.

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
  # Differentiating a quantized matrix raises (naming it): it has no gradient to apply.
  params = freeze(fn, params)
  check_split_axes(fn, cfg, mesh)
  T = x_BSD.shape[0] * x_BSD.shape[1]
  impl = choose_impl(
    cfg,
    mesh,
    tokens=None if mesh is None else -(-T // mesh.size),
    replicated=placement is not None,
  )
  dispatch = get_dispatch(impl)
  if placement is not None:
    check_placement_keywords(fn, dispatch.fn)
  if mesh is None and dispatch.needs_mesh:
    raise ValueError(
      f"{fn}: impl {impl!r} needs a mesh with the expert axis "
      f"{cfg.expert_axis!r} (got mesh=None, and no mesh in scope with that "
      f"axis): pass mesh= or call under `with jax.set_mesh(mesh):`"
    )
  E = cfg.num_experts
  compute_dtype = cfg.compute_dtype or x_BSD.dtype
  router = get_router(cfg.router)

  x_TD = flatten_tokens(x_BSD, mesh)  # on an Explicit mesh: split over it (if T divides)
  if mesh is not None and explicit_mesh(x_TD)[1] and not explicit_mesh(params.router_DE)[1]:
    # Parameters not on the Explicit mesh yet: placed as `moe_param_specs` says (a router
    # gradient would otherwise contract the split token axis with an unplaced array).
    specs = moe_param_specs(dataclasses.replace(cfg, weights_format=None))
    if isinstance(params, SlotParams):  # the same specs: the slot axis splits like E
      specs = SlotParams(**{f.name: getattr(specs, f.name) for f in dataclasses.fields(specs)})
    specs = expand(specs, params)
    params = jax.tree.map(lambda a, spec: place(a, mesh, spec), params, specs)
  T = x_TD.shape[0]
  num_routing_groups(cfg, T, mesh)  # raises on groups that do not divide T
  with jax.named_scope("route"):
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
    balance_loss = functools.partial(router.balance_loss, cfg=cfg, seq_len=x_BSD.shape[1])
    lb_loss = auto(balance_loss, routing.experts_TK, lambda _: P())(routing)
    z_loss = router_z_loss(logits_TE)
    experts_TK = routing.experts_TK
    capacity = None if router.applies_capacity else cfg.capacity(T)
    if capacity is None:
      dropped_TK = jnp.zeros_like(experts_TK, dtype=bool)
    else:
      experts_TK, dropped_TK = auto(
        functools.partial(drop_over_capacity, num_experts=E, capacity=capacity),
        experts_TK,
        lambda spec: (spec, spec),
      )(experts_TK)
    if isinstance(placement, Placement) and not concrete(placement.logcnt):
      # A traced placement is not checked: the items of an expert it gives no slot drop.
      fn_drop = auto(drop_unplaced, experts_TK, lambda spec: (spec, spec))
      experts_TK, dropped_TK = fn_drop(experts_TK, dropped_TK, placement.logcnt)
    load_E = auto(functools.partial(expert_load, num_experts=E), experts_TK, lambda _: P())(
      experts_TK
    )
  step_used = None
  if isinstance(placement, StepPlacement):
    if mesh is not None and n > 1:
      with jax.named_scope("plan_step"):
        placement, step_used = placement.plan(load_E, n, mesh.size // n)
    else:  # one device: nothing to spread over
      placement, step_used = None, jnp.zeros((), bool)
  dispatch_kwargs = {}
  if placement is not None:
    dispatch_kwargs = dict(placement=placement, slot_weights=slot_weights)
  experts = params.experts
  if slot_weights:  # each replica's gradient: its expert's (summed over the replicas)
    specs = split_specs(experts, cfg.expert_axis, cfg.expert_tensor_axis, cfg.expert_fsdp_axis)
    experts = parallel.tie_replicas(
      experts, placement, mesh=mesh, expert_axis=cfg.expert_axis, specs=specs
    )
  with jax.named_scope("dispatch"):
    # Quantized matrices stay as they are: the matmuls dequantize them to the compute dtype.
    ffn = jax.tree.map(
      lambda a: a if is_quantized(a) else a.astype(compute_dtype),
      experts,
      is_leaf=is_quantized,
    )
    if cfg.weights_on == "output":
      y_TD, stats = dispatch.fn(
        x_TD.astype(compute_dtype),
        ffn,
        experts_TK,
        routing.weights_TK,
        mesh=mesh,
        cfg=cfg,
        **dispatch_kwargs,
      )
    else:
      items = auto(input_weighted_items, x_TD, lambda spec: (spec, spec, spec))
      x_ID, experts_I1, ones_I1 = items(x_TD.astype(compute_dtype), experts_TK, routing.weights_TK)
      y_ID, stats = dispatch.fn(
        x_ID, ffn, experts_I1, ones_I1, mesh=mesh, cfg=cfg, **dispatch_kwargs
      )
      y_TD = auto(functools.partial(sum_items, tokens=T), y_ID, lambda spec: spec)(y_ID)
    y_TD = checkpoint_name(like(y_TD.astype(jnp.float32), x_TD), MOE_DISPATCH_OUT)
  if params.shared is not None:
    with jax.named_scope("shared_experts"):
      split = (cfg.expert_tensor_axis, cfg.expert_fsdp_axis) != (None, None)
      if mesh is not None and split and T % mesh.size == 0:  # explicit collectives
        shared_TD = parallel.shared_mlp(
          params.shared,
          x_TD.astype(compute_dtype),
          mesh=mesh,
          tensor_axis=cfg.expert_tensor_axis,
          fsdp_axis=cfg.expert_fsdp_axis,
        )
      else:  # XLA shards it as it likes
        shared_TD = shared_experts(params.shared, x_TD.astype(compute_dtype))
      if params.shared_gate_D is not None:  # one gate per token on the shared experts' sum
        gate_D = params.shared_gate_D.astype(jnp.float32)
        gate_T = jax.nn.sigmoid(jnp.einsum("td,d->t", x_TD.astype(jnp.float32), gate_D))
        shared_TD = shared_TD * gate_T[:, None]
      y_TD = y_TD + shared_TD
  if placement is not None and "slot_load" not in stats:
    raise ValueError(
      f"{fn}: with a placement the dispatch's stats must hold 'slot_load' (i32[S], items "
      f"each slot computed; docs/guides/dispatch.md); impl {impl!r} returned "
      f"{sorted(stats)}"
    )
  y_BSD = unflatten_tokens(y_TD.astype(x_BSD.dtype), x_BSD, mesh)
  dropped_items = jnp.sum(dropped_TK, dtype=jnp.int32) + stats.get("dropped_items", 0)
  aux = dict(
    aux_loss=cfg.load_balance_coef * lb_loss + cfg.z_loss_coef * z_loss,
    load_balance_loss=lb_loss,
    z_loss=z_loss,
    expert_load=load_E,
    rounds=jnp.asarray(stats.get("rounds", 1), jnp.int32),
    dropped_items=dropped_items,
    dropped_tokens=jnp.sum(jnp.all((experts_TK < 0) | (experts_TK >= E), axis=1), dtype=jnp.int32),
    **device_load(load_E if placement is None else stats["slot_load"], n),
  )
  if step_used is not None:
    aux["step_placement"] = step_used.astype(jnp.int32)
  return like(y_BSD, x_BSD), aux


def drop_unplaced(experts_TK, dropped_TK, logcnt_E):
  """(experts_TK with -1 for the items of experts `logcnt_E` gives no slot, dropped_TK
  with those items set)."""
  E = logcnt_E.shape[0]
  valid = (experts_TK >= 0) & (experts_TK < E)
  unplaced = valid & (jnp.asarray(logcnt_E)[jnp.clip(experts_TK, 0, E - 1)] < 1)
  return jnp.where(unplaced, -1, experts_TK), dropped_TK | unplaced


def device_load(load: Int[Array, " S"], num_devices: int) -> dict[str, Array]:
  """{"device_load": i32[N] the items of each device's S / N experts or slots,
  "balancedness": f32[] their mean over their max (1.0 when all are zero)}."""
  per_device = jnp.sum(load.reshape(num_devices, -1), axis=1, dtype=jnp.int32)
  busiest = jnp.max(per_device)
  mean = jnp.mean(per_device.astype(jnp.float32))
  balance = jnp.where(busiest > 0, mean / jnp.maximum(busiest, 1).astype(jnp.float32), 1.0)
  return dict(device_load=per_device, balancedness=balance)


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
    # The slots checked as experts, by shape only (abstract zeros of E experts' shapes).
    E = cfg.num_experts

    def probe():
      experts = jax.tree.map(lambda a: jnp.zeros((E,) + a.shape[1:], a.dtype), params.experts)
      _check_params(fn, dataclasses.replace(params, experts=experts), cfg)

    jax.eval_shape(probe)
  else:
    _check_params(fn, params, cfg)
  return placement, served
