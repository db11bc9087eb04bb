"""Moving slot-major expert weights between layouts, the backward rules of those moves, and
the placement fingerprint slot-major parameters carry (`replicas.SlotParams`).

Three moves of one layer's experts, each a gather of rows over the expert axis
(`parallel.replicas.gather_slots`: a local copy where the row is on the device itself, else
one `ragged_all_to_all` of just those rows; an index without a mesh):

    to_slots(experts_E, placement)            [E, ...] -> [S, ...]   slot s <- expert phy2log[s]
    to_logical(experts_S, placement)          [S, ...] -> [E, ...]   expert e <- its first slot
    between(experts_S, placement, previous)   [S', ...] -> [S, ...]  slot s <- a slot of its expert

Their backward rules keep the slot convention, that every slot of an expert holds the
expert's whole gradient (the layer's backward gives slot-major parameters that, and an
optimizer's step keeps the replicas equal on it):

    to_slots:    the mean of each expert's slots' cotangents (the gather's transpose, a sum
                 over the replicas, divided by logcnt): the logical gradient;
    to_logical:  every slot gets its expert's cotangent (to_slots of it);
    between:     the mean over the new placement's slots, given to every slot of the old one.

The quantized matrices (`QuantizedArray`: frozen) move as they are, differentiated by JAX
(so `frozen.freeze`'s error still names them).
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

from moe_shard.frozen import stop_gradient
from moe_shard.parallel.common import shard_map, split_specs
from moe_shard.parallel.replicas import gather_slots
from moe_shard.placement import concrete
from moe_shard.quant import is_quantized
from moe_shard.sharding import expert_axes, place


@dataclasses.dataclass(frozen=True)
class Route:
  """Where the rows move: the mesh (None: one device), N devices on its expert axis, and
  the axes the layer splits the experts over (expert, tensor, FSDP)."""

  mesh: Any
  n: int
  axes: tuple
  specs: Any = None  # the leaves' PartitionSpecs, when not those of `split_specs` of the tree


def arrays_mesh(tree, expert_axis):
  """The mesh the arrays of `tree` are placed on, when it has the expert axis; else None."""
  for a in jax.tree.leaves(tree):
    sharding = None if concrete(a) else getattr(jax.typeof(a), "sharding", None)
    sharding = getattr(a, "sharding", None) if sharding is None else sharding
    mesh = getattr(sharding, "mesh", None)
    names = getattr(mesh, "axis_names", ())
    if names and all(axis in names for axis in expert_axes(expert_axis)):
      return mesh
  return None


# ------------------------------------------------------------------------ the fingerprint


def placement_id(placement) -> str | tuple[str, ...]:
  """The fingerprint of a placement known on the host: a digest of E and phy2log (a tuple
  of one per layer for a placement of L layers)."""
  E = np.int64(placement.num_experts).tobytes()
  phy2log = np.asarray(placement.phy2log, np.int64)

  def digest(row):
    return hashlib.blake2b(E + row.tobytes(), digest_size=6).hexdigest()

  return digest(phy2log) if phy2log.ndim == 1 else tuple(digest(row) for row in phy2log)


def check_made_for(fn, name, params, placement):
  """Raises unless `placement` (when known on the host) is the one `params` (`SlotParams`)
  were made for. Slots of L layers (a tuple of fingerprints) need a placement of L layers,
  or one layer's for a stack of one; a single fingerprint on a stack (layers of one
  placement stacked) matches a placement of L layers that is that placement in each."""
  made = getattr(params, "placement_id", None)
  if made is None or not concrete(placement.phy2log):
    return
  given = placement_id(placement)
  if isinstance(made, tuple) and isinstance(given, str) and len(made) > 1:
    raise ValueError(
      f"{fn}: params must be the slots of one layer for a one-layer {name}; got SlotParams "
      f"carrying the fingerprints of a stack of {len(made)} layers (a layer sliced with "
      f"jax.tree.map keeps them all): take layer i with ms.layer_slots(params, i)"
    )
  if isinstance(made, str) and isinstance(given, tuple) and all(g == made for g in given):
    return
  if made == given or (isinstance(made, tuple) and made == (given,)):
    return
  phy2log = np.asarray(placement.phy2log)
  shown = np.array2string(phy2log, threshold=24, separator=",").replace("\n", "")
  if name == "previous":
    fix = "pass the placement the slots were made for as previous="
  else:
    fix = (
      f"move the slots to it first with replicate_experts(params, {name}, "
      f"previous=<the placement they were made for>)"
    )
  raise ValueError(
    f"{fn}: {name} must be the placement the SlotParams were made for (slot s holds expert "
    f"phy2log[s] of that placement, fingerprint {made}); got a placement with phy2log "
    f"{shown} (fingerprint {given}): {fix}"
  )


# ------------------------------------------------------------------------ the three moves


def to_slots(experts_E, placement, route):
  """[E, ...] logical experts -> [S, ...] slots of `placement` (one layer)."""
  move = lambda t: _plain_to_slots(t, placement, route)
  return _ruled(move, lambda ct, r: _mean_logical(ct, placement, r), experts_E, route)


def to_logical(experts_S, placement, route):
  """[S, ...] slots of `placement` -> [E, ...] logical experts, each from its first slot."""
  Ls = placement.num_slots // route.n
  _, first_E = np.unique(np.asarray(placement.phy2log), return_index=True)
  move = lambda t: _rows(t, first_E // Ls, first_E % Ls, Ls, route)
  return _ruled(move, lambda ct, r: _plain_to_slots(ct, placement, r), experts_S, route)


def between(experts_S, placement, previous, route):
  """[S', ...] slots of `previous` -> [S, ...] slots of `placement`: each new slot from the
  old slot itself when it holds the same expert, else one on the same device, else the
  first that holds it."""
  rows = previous.num_slots // route.n
  src_dev, src_row = sources(placement, previous, route.n, rows)
  move = lambda t: _rows(t, src_dev, src_row, rows, route)
  back = lambda ct, r: _plain_to_slots(_mean_logical(ct, placement, r), previous, r)
  return _ruled(move, back, experts_S, route)


def _plain_to_slots(experts_E, placement, route):
  L = placement.num_experts // route.n
  phy2log = np.asarray(placement.phy2log)
  return _rows(experts_E, phy2log // L, phy2log % L, L, route)


def _mean_logical(ct_S, placement, route):
  """[E, ...]: each expert's mean over its slots of `ct_S` (summed in at least float32)."""
  Ls = placement.num_slots // route.n
  _, first_E = np.unique(np.asarray(placement.phy2log), return_index=True)
  wide = jax.tree.map(lambda a: a.astype(jnp.promote_types(a.dtype, jnp.float32)), ct_S)
  at = _rows(wide, first_E // Ls, first_E % Ls, Ls, route)  # any point: the move is linear
  _, transpose = jax.vjp(lambda e: _plain_to_slots(e, placement, route), at)
  (sum_E,) = transpose(wide)
  cnt_E = np.asarray(placement.logcnt)

  def mean(total, like):
    cnt = cnt_E.astype(total.dtype).reshape((-1,) + (1,) * (total.ndim - 1))
    return (total / cnt).astype(like.dtype)

  return jax.tree.map(mean, sum_E, ct_S)


def _ruled(move, back, experts, route):
  """`move(experts)` whose VJP is `back(cotangents, route)` for the trained leaves (the
  others None, empty, in the cotangents and in `route.specs`); the quantized (frozen) and
  non-float leaves moved as they are, differentiated by JAX."""
  nodes, treedef = jax.tree.flatten(experts, is_leaf=is_quantized)
  trained = [not is_quantized(a) and jnp.issubdtype(jnp.result_type(a), jnp.inexact) for a in nodes]
  if not any(trained):
    return move(experts)
  specs = [None] * len(nodes)
  if route.mesh is not None:
    is_spec = lambda x: isinstance(x, P) or is_quantized(x)
    specs = jax.tree.leaves(split_specs(experts, *route.axes), is_leaf=is_spec)

  types = jax.tree.map(jax.typeof, experts)  # each cotangent gets its input's sharding

  @jax.custom_vjp
  def ruled(tree):
    return move(tree)

  def fwd(tree):
    return move(tree), None

  def bwd(_, ct):
    # The frozen leaves' cotangents (float0, or unused) left out: None, an empty subtree,
    # and so their specs (taken from the whole tree: the FFN's shape letters need it).
    cts = jax.tree.leaves(ct, is_leaf=is_quantized)
    only = lambda xs: treedef.unflatten([x if t else None for x, t in zip(xs, trained)])
    d = back(only(cts), dataclasses.replace(route, specs=only(specs)))
    return (jax.tree.map(_typed, d, types, is_leaf=lambda x: x is None),)

  ruled.defvjp(fwd, bwd)
  moved = jax.tree.leaves(ruled(experts), is_leaf=is_quantized)
  if all(trained):
    return treedef.unflatten(moved)
  held = [stop_gradient(a) if t else a for a, t in zip(nodes, trained)]
  frozen = jax.tree.leaves(move(treedef.unflatten(held)), is_leaf=is_quantized)
  return treedef.unflatten([m if t else f for m, f, t in zip(moved, frozen, trained)])


def _typed(d, aval):
  """`d` resharded as `aval` says where that is on an Explicit mesh (None stays None)."""
  spec = getattr(getattr(aval, "sharding", None), "spec", None)
  mesh = getattr(getattr(aval, "sharding", None), "mesh", None)
  if d is None or mesh is None or AxisType.Explicit not in getattr(mesh, "axis_types", ()):
    return d
  if jax.typeof(d).sharding.spec == spec:
    return d
  with jax.sharding.use_abstract_mesh(mesh):
    return jax.sharding.reshard(d, spec)


# ------------------------------------------------------------------------ the transport


def sources(placement, previous, n, rows):
  """(device, row) each new slot's weights come from: the expert's owner (`previous`
  None: logical params), or, from slot-major ones, the old slot itself when it holds the
  same expert, else one on the same device, else the first that holds it."""
  new = np.asarray(placement.phy2log)
  S = new.shape[0]
  Ls = S // n
  if previous is None:
    return (new // rows).astype(np.int32), (new % rows).astype(np.int32)
  old = np.asarray(previous.phy2log)
  src = np.empty(S, np.int64)
  for s, e in enumerate(new):
    holders = np.flatnonzero(old == e)
    here = holders[holders // rows == s // Ls]
    if s < old.shape[0] and old[s] == e and s // rows == s // Ls:
      src[s] = s
    else:
      src[s] = here[0] if here.size else holders[0]
  return (src // rows).astype(np.int32), (src % rows).astype(np.int32)


def _rows(experts, src_dev, src_row, rows, route):
  """New rows of every leaf of `experts` (`rows` a device in the source), row i of device d
  being row `src_row[d * len / n + i]` of device `src_dev[...]`: gathered on the mesh (a
  local copy where the source is the device itself), indexed without one."""
  src_dev, src_row = np.asarray(src_dev, np.int32), np.asarray(src_row, np.int32)
  if route.mesh is None:
    index = jnp.asarray(src_dev * rows + src_row)
    return jax.tree.map(lambda a: a[index], experts)
  expert_axis, tensor_axis, fsdp_axis = route.axes
  specs = route.specs
  if specs is None:
    specs = split_specs(experts, expert_axis, tensor_axis, fsdp_axis)
  experts = jax.tree.map(lambda a, s: place(a, route.mesh, s), experts, specs)
  leaves, treedef = jax.tree.flatten(specs, is_leaf=lambda x: isinstance(x, P))
  gather = _gather(
    route.mesh,
    expert_axis,
    route.n,
    tuple(leaves),
    treedef,
    tuple(src_dev.tolist()),
    tuple(src_row.tolist()),
  )
  return gather(experts)


@functools.lru_cache(maxsize=32)
def _gather(mesh, expert_axis, n, specs_leaves, treedef, src_dev, src_row):
  specs = jax.tree.unflatten(treedef, list(specs_leaves))

  def body(experts):
    dev, row = jnp.asarray(np.array(src_dev, np.int32)), jnp.asarray(np.array(src_row, np.int32))
    # Each device receives its slots' weights from the devices holding their experts.
    return jax.tree.map(lambda a: gather_slots(a, dev, row, axis=expert_axis, n=n), experts)

  return jax.jit(shard_map(body, mesh, in_specs=(specs,), out_specs=specs))
