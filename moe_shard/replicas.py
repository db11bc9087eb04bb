"""Slot-major parameters (replicated experts, served and trained), and a load recorder.

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

`LoadWindow` keeps the expert loads of the last steps per layer (`aux["expert_load"]`), the
load to plan a placement from (`plan_placement(window.load(), ...)`).
"""

from __future__ import annotations

import collections
import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AbstractMesh, Mesh
from jax.sharding import PartitionSpec as P

from moe_shard import _checks
from moe_shard.parallel.common import shard_map, split_specs
from moe_shard.parallel.replicas import gather_slots
from moe_shard.params import MoEParams
from moe_shard.placement import Placement, check_placement, concrete
from moe_shard.sharding import EXPERT, axis_size, place, resolve_mesh


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SlotParams(MoEParams):
  """`MoEParams` whose routed experts are slot-major: [S, ...], slot s holding expert
  `phy2log[s]` of the placement they were made for (`replicate_experts`). A serving and a
  training state: the layer gives every replica its expert's whole gradient."""


ServedParams = SlotParams  # the name before slot-major parameters trained


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
      optimizer's moments of them).
    placement: a one-layer `Placement` of the E experts over S slots (S divisible by the
      expert axis size).
    mesh: the mesh (default None: the mesh in scope; without one, on the default device).
      The experts' weights are taken as split over its expert axis, as `init_moe_params`
      places them, and the slots come back split the same way (S / N a device).
    previous: with `SlotParams`, the placement they were made for (required then;
      with logical `MoEParams`, an error).
    expert_axis, expert_tensor_axis, expert_fsdp_axis: the `MoEConfig` fields of the same
      names (defaults "expert", None, None), as the layer splits the weights.

  Returns:
    `SlotParams`: `params` with experts [S, ...]. On a mesh, every slot of a device
    comes from a device that holds its expert: a copy on the device itself where it can,
    else one `ragged_all_to_all` (emulated on CPU) that sends just those slots.

  Raises:
    TypeError, ValueError: params of the wrong kind, `previous` missing for slot-major
      params or given for logical ones, a placement that does not match them (E, or S for
      `previous`) or whose slots do not divide over the expert axis.
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
  placement, mesh, n = _on_mesh(fn, placement, mesh, expert_axis)
  E = placement.num_experts
  first = jax.tree.leaves(params.experts)[0].shape[0]
  if served:
    previous = check_placement(fn, previous, E, n)
    _host_placement(fn, "previous", previous)
    want, what = previous.num_slots, "the slots of previous"
  else:
    want, what = E, "the placement's experts"
  if first != want:
    raise ValueError(f"{fn}: params.experts must hold {what} ({want}) on axis 0 (got {first})")
  src_dev, src_row = _sources(placement, previous, n, first // n)
  axes = (expert_axis, expert_tensor_axis, expert_fsdp_axis)
  experts = _rows_from(params.experts, src_dev, src_row, first // n, mesh, n, axes)
  fields = {f.name: getattr(params, f.name) for f in dataclasses.fields(MoEParams)}
  return SlotParams(**dict(fields, experts=experts))


def _on_mesh(fn, placement, mesh, expert_axis):
  """(the placement, checked for the expert axis; the mesh resolved; N devices on the axis)."""
  if not isinstance(placement, Placement):
    raise TypeError(f"{fn}: placement must be a Placement (got {type(placement).__name__})")
  _host_placement(fn, "placement", placement)
  mesh = resolve_mesh(fn, mesh, expert_axis, required=False)
  n = 1 if mesh is None else axis_size(mesh, expert_axis)
  return check_placement(fn, placement, placement.num_experts, n), mesh, n


def _host_placement(fn, name, placement):
  """Slots' weights move by a plan made on the host: a placement traced inside jit cannot say."""
  if not concrete(placement.phy2log):
    raise TypeError(
      f"{fn}: {name} must be known on the host (NumPy or concrete arrays): the slots' rows "
      f"move by a plan made from it (got a placement traced inside jit)"
    )


def _rows_from(experts, src_dev, src_row, rows, mesh, n, axes):
  """New rows of every leaf of `experts` (`rows` a device), row i of device d being row
  `src_row[d * len / n + i]` of device `src_dev[...]`: gathered on the mesh (a local copy
  where the source is the device itself), indexed without one."""
  if mesh is None:
    index = jnp.asarray(src_dev * rows + src_row)
    return jax.tree.map(lambda a: a[index], experts)
  expert_axis, tensor_axis, fsdp_axis = axes
  specs = split_specs(experts, expert_axis, tensor_axis, fsdp_axis)
  experts = jax.tree.map(lambda a, s: place(a, mesh, s), experts, specs)
  return _gather(mesh, expert_axis, n, specs, src_dev, src_row)(experts)


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
  `replicate_experts(t, placement, previous=previous, ...)`, every other leaf as it is.

  Args:
    tree: any pytree; its `SlotParams` nodes are on `previous`.
    placement, previous, mesh, expert_axis, expert_tensor_axis, expert_fsdp_axis: as in
      `replicate_experts`.

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

  Args:
    params: `SlotParams` made for `placement` (parameters, or a slot-major tree of the same
      structure, such as gradients or an optimizer's moments).
    placement: the one-layer `Placement` they were made for.
    mesh, expert_axis, expert_tensor_axis, expert_fsdp_axis: as in `replicate_experts`.

  Returns:
    `MoEParams` with experts [E, ...].

  Raises:
    TypeError, ValueError: `params` not `SlotParams` (logical `MoEParams` refused), or a
      placement that does not match them.
  """
  fn = "logical_params"
  if not isinstance(params, SlotParams):
    raise TypeError(
      f"{fn}: params must be slot-major SlotParams (from replicate_experts); got "
      f"{type(params).__name__}, which is not slot-major"
    )
  placement, mesh, n = _on_mesh(fn, placement, mesh, expert_axis)
  first = jax.tree.leaves(params.experts)[0].shape[0]
  if first != placement.num_slots:
    raise ValueError(
      f"{fn}: params.experts must hold the placement's {placement.num_slots} slots on "
      f"axis 0 (got {first})"
    )
  _, first_slot_E = np.unique(np.asarray(placement.phy2log), return_index=True)  # e's first
  Ls = placement.num_slots // n
  src_dev, src_row = (first_slot_E // Ls).astype(np.int32), (first_slot_E % Ls).astype(np.int32)
  axes = (expert_axis, expert_tensor_axis, expert_fsdp_axis)
  experts = _rows_from(params.experts, src_dev, src_row, Ls, mesh, n, axes)
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
    ValueError: an expert leaf of a `SlotParams` does not lead with the placement's axes.
  """
  cnt_S = jnp.take_along_axis(
    jnp.asarray(placement.logcnt), jnp.asarray(placement.phy2log), axis=-1
  ).astype(jnp.float32)
  weight = 1.0 / jnp.maximum(cnt_S, 1.0)  # [S] or [L, S]
  is_slots = lambda t: isinstance(t, SlotParams)

  def squares(t):
    if not is_slots(t):
      return [jnp.sum(jnp.square(a.astype(jnp.float32))) for a in jax.tree.leaves(t)]
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


def _sources(placement, previous, n, rows):
  """(device, row) each new slot's weights come from: the expert's owner (logical
  params), or, from slot-major ones, the old slot itself when it holds the same expert,
  else one on the same device, else the first that holds it."""
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


@functools.lru_cache(maxsize=32)
def _gather_cached(mesh, expert_axis, n, specs_leaves, treedef, src_dev, src_row):
  specs = jax.tree.unflatten(treedef, list(specs_leaves))

  def body(experts):
    dev, row = jnp.asarray(np.array(src_dev, np.int32)), jnp.asarray(np.array(src_row, np.int32))
    # Each device receives its slots' weights from the devices holding their experts.
    return jax.tree.map(lambda a: gather_slots(a, dev, row, axis=expert_axis, n=n), experts)

  return jax.jit(shard_map(body, mesh, in_specs=(specs,), out_specs=specs))


def _gather(mesh, expert_axis, n, specs, src_dev, src_row):
  leaves, treedef = jax.tree.flatten(specs, is_leaf=lambda x: isinstance(x, P))
  return _gather_cached(
    mesh, expert_axis, n, tuple(leaves), treedef, tuple(src_dev.tolist()), tuple(src_row.tolist())
  )


class LoadWindow:
  """The expert loads of the last `window` steps, per layer: the load to plan from.

  `record(aux["expert_load"])` after each step (an i32[E] of one layer or [L, E] of a
  stack, device arrays kept as they are: nothing is copied to the host until `load()`);
  `load()` sums the window, oldest steps dropped. vLLM counts the same way (a window of
  1000 steps, re-planned every 3000). Loads are counts or weights: integer loads sum as
  int64, float ones (e.g. a router's mean probabilities) as float64; none may be negative
  or non-finite.

  Args:
    num_experts: E.
    num_layers: L, or None (default) for one layer.
    window: steps kept (default 1000).
  """

  def __init__(self, num_experts: int, num_layers: int | None = None, window: int = 1000):
    fn = "LoadWindow"
    self.num_experts = _checks.int_field(fn, "num_experts", num_experts, 1)
    self.num_layers = (
      None if num_layers is None else _checks.int_field(fn, "num_layers", num_layers, 1)
    )
    self.window = _checks.int_field(fn, "window", window, 1)
    self._steps: collections.deque = collections.deque(maxlen=self.window)

  @property
  def shape(self) -> tuple[int, ...]:
    return (self.num_experts,) if self.num_layers is None else (self.num_layers, self.num_experts)

  def record(self, expert_load: Any) -> None:
    """Adds one step's load (i32[E], or [L, E] with layers; or floats).

    Raises:
      TypeError: a load that is not a real-number array.
      ValueError: the wrong shape, or (checked here for host arrays, at `load()` for
        device arrays) a negative or non-finite value.
    """
    fn = "LoadWindow.record"
    shape = tuple(np.shape(expert_load))
    if shape != self.shape:
      raise ValueError(f"{fn}: expert_load must have shape {self.shape} (got {shape})")
    dtype = getattr(expert_load, "dtype", None)
    dtype = np.asarray(expert_load).dtype if dtype is None else np.dtype(dtype)
    if not (jnp.issubdtype(dtype, jnp.integer) or jnp.issubdtype(dtype, jnp.floating)):
      raise TypeError(f"{fn}: expert_load must hold integers or floats (got {dtype})")
    if not isinstance(expert_load, jax.Array):  # host data: checked now, for free
      # Its index once appended (the oldest step leaves a full window first).
      _check_load(fn, np.asarray(expert_load), min(len(self._steps), self.window - 1))
    self._steps.append(expert_load)

  def __len__(self) -> int:
    return len(self._steps)

  def load(self) -> np.ndarray:
    """int64[E] (or [L, E]): the loads of the steps in the window, summed (zeros if none);
    float64 when any step's load is floats.

    Raises:
      ValueError: a step's load holds a negative or non-finite value (named by its step).
    """
    steps = [np.asarray(step) for step in self._steps]
    floats = any(jnp.issubdtype(step.dtype, jnp.floating) for step in steps)  # bf16 too
    total = np.zeros(self.shape, np.float64 if floats else np.int64)
    for i, step in enumerate(steps):
      _check_load("LoadWindow.load", step, i)
      total += step.astype(total.dtype)
    return total


def _check_load(fn, load, step):
  if jnp.issubdtype(load.dtype, jnp.floating):
    load = load.astype(np.float64)
  bad = ~np.isfinite(load) | (load < 0) if load.dtype == np.float64 else load < 0
  if np.any(bad):
    value = load[np.unravel_index(int(np.argmax(bad)), load.shape)]
    raise ValueError(
      f"{fn}: a load must be finite and >= 0 (step {step} of the window holds {value})"
    )
