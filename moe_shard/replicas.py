"""Slot-major parameters (replicated experts, served and trained).

`replicate_experts(params, placement, mesh=mesh)` turns logical parameters (the routed
experts [E, ...], what checkpoints hold) into `SlotParams`: the experts slot-major [S, ...],
slot s holding expert `placement.phy2log[s]`, split over the expert axis (S / N slots a
device), the rest as it was. `moe_layer(slots, x, cfg, placement=placement)` runs on them
with no weight movement, and its backward gives every replica its expert's whole gradient
(`parallel.tie_replicas`), so they train: an elementwise optimizer keeps the replicas
equal. Given slot-major parameters (or any slot-major tree: optimizer moments) and the
placement they were made for (`previous=`), it moves them to a new placement, sending only
the slots whose expert changes, each from a device that holds it (its own first);
`move_replicas` does that to every `SlotParams` of a pytree (an optimizer state) at once.
`logical_params` takes the logical experts back ([E, ...], one replica each), and
`logical_global_norm` is the global norm counting each expert once.

`SlotParams` carry the fingerprint of the placement they were made for (static pytree
metadata, `slot_moves.placement_id`): every function given them with a placement known on
the host refuses another placement. Each helper takes one layer, or a stack of L layers
([L, ...] leaves, a placement of L layers: a scanned model). Their backward rules keep the
slot convention (`slot_moves`): `jax.grad` through `replicate_experts` gives the logical
parameters their logical gradient, and a term on `logical_params(slots)` gives every slot
of an expert that expert's gradient.

`LoadWindow` (in `load_window`) keeps the expert loads of the last steps per layer, the load
to plan a placement from.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import AbstractMesh, Mesh

from moe_shard import slot_moves
from moe_shard.load_window import LoadWindow
from moe_shard.params import MoEParams
from moe_shard.placement import Placement, check_placement, concrete
from moe_shard.sharding import EXPERT, axis_size, resolve_mesh
from moe_shard.slot_moves import check_made_for, placement_id

__all__ = [
  "LoadWindow",
  "ServedParams",
  "SlotParams",
  "layer_slots",
  "logical_global_norm",
  "logical_params",
  "move_replicas",
  "replicate_experts",
  "stack_slots",
]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SlotParams(MoEParams):
  """`MoEParams` whose routed experts are slot-major: [S, ...], slot s holding expert
  `phy2log[s]` of the placement they were made for (`replicate_experts`). A serving and a
  training state: the layer gives every replica its expert's whole gradient.

  Attributes:
    placement_id: static (part of the pytree's structure, not a leaf): the fingerprint of
      the placement the slots were made for (`slot_moves.placement_id`; a tuple of one per
      layer for a stack), or None (default: unknown, not checked). Gradients and an
      optimizer's moments of the parameters carry it too; a jitted step given the slots of
      a new placement compiles again.
  """

  placement_id: Any = dataclasses.field(default=None, metadata=dict(static=True))


ServedParams = SlotParams  # the name before slot-major parameters trained


def as_slots(tree: MoEParams, like: SlotParams) -> SlotParams:
  """`tree` (a `MoEParams` of anything: specs, shapes) as the `SlotParams` node of `like`."""
  fields = {f.name: getattr(tree, f.name) for f in dataclasses.fields(MoEParams)}
  return SlotParams(**fields, placement_id=like.placement_id)


def layer_slots(params: SlotParams, i: int) -> SlotParams:
  """Layer `i` of slot-major parameters of a stack of L layers, with that layer's fingerprint.

  `jax.tree.map(lambda a: a[i], params)` slices the arrays but keeps the fingerprints of
  all L layers, which a one-layer placement refuses; this sets the i-th. (Inside
  `lax.scan` over the stack, with the placement scanned over too, nothing is checked.)

  Args:
    params: `SlotParams` of L layers (every array [L, ...]), or a slot-major tree of them.
    i: the layer, 0 <= i < L.

  Returns:
    `SlotParams` of one layer, on the placement of layer `i`.
  """
  fn = "layer_slots"
  if not isinstance(params, SlotParams):
    raise TypeError(f"{fn}: params must be SlotParams (got {type(params).__name__})")
  made = params.placement_id
  L = len(made) if isinstance(made, tuple) else None
  if L is not None and not 0 <= i < L:
    raise ValueError(f"{fn}: i must be a layer of the {L} in params, 0 <= i < {L} (got {i})")
  layer = jax.tree.map(lambda a: a[i], params)
  return dataclasses.replace(layer, placement_id=made if L is None else made[i])


def stack_slots(layers: Sequence[SlotParams]) -> SlotParams:
  """Slot-major parameters of L layers stacked ([L, ...]), carrying each layer's fingerprint.

  `jax.tree.map(jnp.stack, ...)` refuses layers made for different placements (their
  fingerprints are part of the pytree structure); the result here goes with the placement
  of L layers that holds each layer's placement (`Placement.from_phy2log` of the stacked
  `phy2log`s).

  Args:
    layers: `SlotParams` of one layer each, of the same structure and shapes.

  Returns:
    `SlotParams` of L layers; the fingerprint a tuple of the layers' (None if any is None).
  """
  fn = "stack_slots"
  ids = []
  for j, layer in enumerate(layers):
    made = getattr(layer, "placement_id", None)
    if not isinstance(layer, SlotParams) or isinstance(made, tuple):
      kind = type(layer).__name__ + (" of a stack" if isinstance(made, tuple) else "")
      raise TypeError(f"{fn}: layers must be SlotParams of one layer each (layer {j}: {kind})")
    ids.append(made)
  if not ids:
    raise ValueError(f"{fn}: layers must hold at least one layer (got none)")
  plain = [dataclasses.replace(layer, placement_id=None) for layer in layers]
  stacked = jax.tree.map(lambda *xs: jnp.stack(xs), *plain)
  return dataclasses.replace(stacked, placement_id=None if None in ids else tuple(ids))


def replicate_experts(
  params: MoEParams,
  placement: Placement,
  *,
  mesh: Mesh | AbstractMesh | None = None,
  previous: Placement | None = None,
  expert_axis: str | tuple[str, ...] = EXPERT,
  expert_tensor_axis: str | None = None,
  expert_fsdp_axis: str | None = None,
) -> SlotParams:
  """Returns the routed experts slot-major for `placement`, placed on the mesh.

  Args:
    params: `MoEParams` with the E logical experts, or `SlotParams` on the placement
      `previous` (parameters, or a slot-major tree of the same structure such as an
      optimizer's moments of them). A stack of L layers: every expert leaf [L, ...].
    placement: a `Placement` of the E experts over S slots (S divisible by the expert axis
      size), known on the host: one layer's, or L layers' for a stack.
    mesh: the mesh (default None: the mesh in scope; else the mesh the experts' arrays are
      placed on, when it has the expert axis; else the default device). The experts'
      weights are taken as split over its expert axis, as `init_moe_params` places them,
      and the slots come back split the same way (S / N a device).
    previous: with `SlotParams`, the placement they were made for (required then;
      with logical `MoEParams`, an error).
    expert_axis, expert_tensor_axis, expert_fsdp_axis: the `MoEConfig` fields of the same
      names (defaults "expert", None, None), as the layer splits the weights.

  Returns:
    `SlotParams`: `params` with experts [S, ...] (or [L, S, ...]), carrying `placement`'s
    fingerprint. On a mesh, every slot of a device comes from a device that holds its
    expert: a copy on the device itself where it can, else one `ragged_all_to_all`
    (emulated on CPU) that sends just those slots. A tree whose `SlotParams` hold no expert
    leaves (an optimizer's state of frozen experts) only takes the new fingerprint.
    Differentiable in reverse mode: from logical parameters, each expert's gradient is
    the mean of its slots' (each slot holding the expert's whole gradient, as the layer
    gives it: the logical gradient); from slot-major ones, every old slot gets that mean.
    Forward mode (`jax.jvp`) is refused by JAX (a `custom_vjp`): this backward is not the
    transpose of any forward rule.

  Raises:
    TypeError, ValueError: params of the wrong kind, `previous` missing for slot-major
      params or given for logical ones, `previous` not the placement the slots were made
      for, a placement that does not match them (E, layers, or S for `previous`) or whose
      slots do not divide over the expert axis.
  """
  fn = "replicate_experts"
  if not isinstance(params, MoEParams):
    raise TypeError(f"{fn}: params must be a MoEParams (got {type(params).__name__})")
  served = isinstance(params, SlotParams)
  if served and previous is None:
    raise ValueError(
      f"{fn}: params are slot-major (SlotParams): pass the placement they were made for "
      f"as previous="
    )
  if not served and previous is not None:
    raise ValueError(
      f"{fn}: previous= names the placement slot-major params (SlotParams) were made "
      f"for; params are logical (MoEParams): leave previous out"
    )
  axes = (expert_axis, expert_tensor_axis, expert_fsdp_axis)
  placement, route = _route(fn, "placement", placement, mesh, axes, params)
  if served:
    previous, _ = _route(fn, "previous", previous, mesh, axes, params)
    if previous.num_layers != placement.num_layers:
      raise ValueError(
        f"{fn}: previous and placement must have the same layers (got "
        f"{previous.num_layers} and {placement.num_layers}; None: one layer)"
      )
    want, what = previous.num_slots, "the slots of previous"
  else:
    want, what = placement.num_experts, "the placement's experts"

  def move(experts, placement, previous):
    if previous is None:
      return slot_moves.to_slots(experts, placement, route)
    return slot_moves.between(experts, placement, previous, route)

  def check():
    if served:
      check_made_for(fn, "previous", params, previous)

  experts = _by_layer(fn, params.experts, move, placement, previous, want, what, check)
  fields = {f.name: getattr(params, f.name) for f in dataclasses.fields(MoEParams)}
  return SlotParams(**dict(fields, experts=experts), placement_id=placement_id(placement))


def _route(fn, name, placement, mesh, axes, params):
  """(the placement, checked; the `slot_moves.Route`: the mesh resolved, N on its axis)."""
  if not isinstance(placement, Placement):
    raise TypeError(f"{fn}: {name} must be a Placement (got {type(placement).__name__})")
  if not concrete(placement.phy2log):
    raise TypeError(
      f"{fn}: {name} must be known on the host (NumPy or concrete arrays): the slots' rows "
      f"move by a plan made from it (got a placement traced inside jit)"
    )
  expert_axis = axes[0]
  mesh = resolve_mesh(fn, mesh, expert_axis, required=False)
  if mesh is None:  # the arrays' own mesh (an Explicit one cannot be indexed across)
    mesh = slot_moves.arrays_mesh(params.experts, expert_axis)
  n = 1 if mesh is None else axis_size(mesh, expert_axis)
  L = placement.num_layers
  for layer in [placement] if L is None else [placement[i] for i in range(L)]:
    check_placement(fn, layer, placement.num_experts, n)
  return placement, slot_moves.Route(mesh, n, axes)


def _by_layer(fn, experts, move, placement, previous, want, what, check):
  """`move(experts, placement, previous)` for one layer, or each layer of a stack, stacked,
  after the shapes and `check()` (the placement the slots were made for).

  Experts with no leaves (frozen, out of an optimizer's state) come back as they are."""
  leaves = jax.tree.leaves(experts)
  if not leaves:
    check()
    return experts
  L = placement.num_layers
  lead = (want,) if L is None else (L, want)
  for a in leaves:
    if tuple(a.shape[: len(lead)]) != lead:
      raise ValueError(
        f"{fn}: params.experts must hold {what} ({want}) on axis {len(lead) - 1}"
        f"{'' if L is None else f' after the {L} layers'} (got a leaf of shape {a.shape})"
      )
  check()
  if L is None:
    return move(experts, placement, previous)
  layers = [
    move(
      jax.tree.map(lambda a, i=i: a[i], experts),
      placement[i],
      None if previous is None else previous[i],
    )
    for i in range(L)
  ]
  return jax.tree.map(lambda *xs: jnp.stack(xs), *layers)


def move_replicas(
  tree: Any,
  placement: Placement,
  *,
  previous: Placement,
  mesh: Mesh | AbstractMesh | None = None,
  expert_axis: str | tuple[str, ...] = EXPERT,
  expert_tensor_axis: str | None = None,
  expert_fsdp_axis: str | None = None,
) -> Any:
  """Moves every `SlotParams` of a pytree from `previous` to `placement`.

  For an optimizer state (Adam's moments are `SlotParams` like the parameters), or a tuple
  of parameters and optimizer state, in one call; each `SlotParams` as
  `replicate_experts(t, placement, previous=previous, ...)`, every other leaf as it is. A
  `SlotParams` with no expert leaves (the state of an optimizer that leaves the experts
  frozen, `optax.multi_transform`) passes through, with the new placement's fingerprint.

  Args:
    tree: any pytree; its `SlotParams` nodes are on `previous`.
    placement, previous, mesh, expert_axis, expert_tensor_axis, expert_fsdp_axis: as in
      `replicate_experts` (one layer, or L layers for stacked slots).

  Returns:
    `tree` with each `SlotParams` on `placement`.
  """
  move = functools.partial(
    replicate_experts,
    placement=placement,
    previous=previous,
    mesh=mesh,
    expert_axis=expert_axis,
    expert_tensor_axis=expert_tensor_axis,
    expert_fsdp_axis=expert_fsdp_axis,
  )
  is_slots = lambda t: isinstance(t, SlotParams)
  return jax.tree.map(lambda t: move(t) if is_slots(t) else t, tree, is_leaf=is_slots)


def logical_params(
  params: SlotParams,
  placement: Placement,
  *,
  mesh: Mesh | AbstractMesh | None = None,
  expert_axis: str | tuple[str, ...] = EXPERT,
  expert_tensor_axis: str | None = None,
  expert_fsdp_axis: str | None = None,
) -> MoEParams:
  """The logical parameters of slot-major ones: expert e from its first slot, [E, ...].

  For checkpoints (`hf.save_moe_layers`), norms and evaluation on logical parameters. On a
  mesh each device receives its E / N experts from the devices holding their first slots
  (a local copy where it holds one), split over the expert axis as `init_moe_params` places
  them. The replicas of a slot-major tree the layer trained are equal, so any one would do.
  Differentiable: a term on the logical parameters gives every slot of expert e the
  expert's whole gradient (the slot convention, so the replicas stay equal).

  Args:
    params: `SlotParams` made for `placement` (parameters, or a slot-major tree of the same
      structure, such as gradients or an optimizer's moments); a stack of L layers with
      expert leaves [L, S, ...].
    placement: the `Placement` they were made for (one layer's, or L layers').
    mesh, expert_axis, expert_tensor_axis, expert_fsdp_axis: as in `replicate_experts`.

  Returns:
    `MoEParams` with experts [E, ...] (or [L, E, ...]).

  Raises:
    TypeError, ValueError: `params` not `SlotParams` (logical `MoEParams` refused), or a
      placement other than theirs or that does not match them.
  """
  fn = "logical_params"
  if not isinstance(params, SlotParams):
    raise TypeError(
      f"{fn}: params must be slot-major SlotParams (from replicate_experts); got "
      f"{type(params).__name__}, which is not slot-major"
    )
  axes = (expert_axis, expert_tensor_axis, expert_fsdp_axis)
  placement, route = _route(fn, "placement", placement, mesh, axes, params)
  check = lambda: check_made_for(fn, "placement", params, placement)

  def move(experts, placement, previous):
    del previous
    return slot_moves.to_logical(experts, placement, route)

  what = "the placement's slots"
  S = placement.num_slots
  experts = _by_layer(fn, params.experts, move, placement, None, S, what, check)
  fields = {f.name: getattr(params, f.name) for f in dataclasses.fields(MoEParams)}
  return MoEParams(**dict(fields, experts=experts))


def logical_global_norm(tree: Any, placement: Placement) -> jax.Array:
  """The global L2 norm of a pytree counting each expert of its `SlotParams` once.

  `optax.global_norm` of slot-major gradients counts an expert with c replicas c times
  (every replica holds its whole gradient). Here slot s's squares are weighted by
  1 / logcnt[phy2log[s]]: the norm of the logical gradients, computed where the slots are
  (a placement passed traced works), for clipping (docs/guides/skew.md).

  Args:
    tree: a pytree; the experts of its `SlotParams` nodes are slot-major for `placement`
      (a placement of L layers: experts [L, S, ...]), every other leaf counts as it is.
    placement: the `Placement` of the slots.

  Returns:
    f32[] the norm.

  Raises:
    ValueError: an expert leaf of a `SlotParams` does not lead with the placement's axes,
      or (a placement known on the host) the slots were made for another placement.
  """
  cnt_S = jnp.take_along_axis(
    jnp.asarray(placement.logcnt), jnp.asarray(placement.phy2log), axis=-1
  ).astype(jnp.float32)
  weight = 1.0 / jnp.maximum(cnt_S, 1.0)  # [S] or [L, S]
  is_slots = lambda t: isinstance(t, SlotParams)

  def squares(t):
    if not is_slots(t):
      return [jnp.sum(jnp.square(a.astype(jnp.float32))) for a in jax.tree.leaves(t)]
    check_made_for("logical_global_norm", "placement", t, placement)
    rest = dataclasses.replace(t, experts=None)
    out = [jnp.sum(jnp.square(a.astype(jnp.float32))) for a in jax.tree.leaves(rest)]
    for a in jax.tree.leaves(t.experts):
      if a.shape[: weight.ndim] != weight.shape:
        raise ValueError(
          "logical_global_norm: the experts of tree's SlotParams must lead with the "
          f"placement's slot axes {weight.shape} ([S], or [L, S] for L layers; got a leaf "
          f"of shape {a.shape})"
        )
      sq = jnp.square(a.astype(jnp.float32)).reshape(weight.shape + (-1,))
      out.append(jnp.sum(weight[..., None] * sq))
    return out

  total = sum(
    (x for t in jax.tree.leaves(tree, is_leaf=is_slots) for x in squares(t)),
    start=jnp.zeros((), jnp.float32),
  )
  return jnp.sqrt(total)
