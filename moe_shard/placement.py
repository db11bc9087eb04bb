"""Placements of experts on slots: replicated hot experts, in DeepSeek EPLB's arrays.

A placement maps S physical expert slots (S = E + R, R redundant) to the E logical experts.
Slots are laid out device-major over the expert axis: with N devices, device n holds slots
[n * S/N, (n + 1) * S/N). Three arrays describe it, as DeepSeek's EPLB
(github.com/deepseek-ai/EPLB, `eplb.rebalance_experts`) returns them:

    phy2log: i32[S]          the logical expert of each slot
    log2phy: i32[E, X]       the slots of each expert, -1 past its count (X = most replicas)
    logcnt:  i32[E]          how many slots each expert has (>= 1)

(each with a leading layer axis [L, ...] for a placement of several layers). So EPLB's
output works as it is (`Placement(phy2log, log2phy, logcnt)`), and `Placement.from_phy2log`
builds the other two from phy2log. `plan_placement` plans one from a load per expert with
EPLB's balanced packing (a NumPy port of its algorithm: global, or hierarchical over expert
groups and nodes), or, with `keep_home=True`, keeping every expert's first slot on the device
that owns it in the logical parameters (the layout training wants: only the redundant slots'
weights move).

`choose_replicas` is the layer's rule for which replica an item goes to, and
`plan_on_device` the per-step plan (`moe_layer(..., placement="step")`), both pure `jnp`.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.core
import jax.numpy as jnp
import numpy as np

from moe_shard import _checks


def _concrete(a):
  """Whether `a` holds values (not a tracer)."""
  return not isinstance(a, jax.core.Tracer)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True, eq=False)
class Placement:
  """Where each logical expert's replicas live: EPLB's three arrays (module docstring).

  A pytree of its three arrays: pass it to `jax.jit` as an argument (the layer then reads
  it as data: a new placement needs no recompile) or close over it (the layer then knows
  it while tracing). Built from concrete arrays it is checked on construction; one made of
  tracers (inside jit, a `lax.scan` over layers) is taken as it is.

  Attributes:
    phy2log: i32[S] (or [L, S]) logical expert of each slot.
    log2phy: i32[E, X] (or [L, E, X]) slots of each expert, -1 past `logcnt`; any order.
    logcnt: i32[E] (or [L, E]) slots of each expert, >= 1.
  """

  phy2log: Any
  log2phy: Any
  logcnt: Any

  def __post_init__(self):
    # Unflattening a pytree calls this with whatever the leaves became (tracers, specs,
    # shapes): only concrete integer arrays are converted and checked.
    leaves = (self.phy2log, self.log2phy, self.logcnt)
    if all(_array_data(a) for a in leaves):
      _validate(self)

  @classmethod
  def from_phy2log(cls, phy2log: Any, num_experts: int) -> Placement:
    """Builds a placement from the logical expert of each slot (e.g. EPLB's `phy2log`).

    log2phy lists each expert's slots in increasing order (replica r of expert e is its
    r-th slot), -1 padded to the most replicas of any expert.

    Args:
      phy2log: int[S] (or [L, S]) logical expert of each slot, in [0, num_experts).
      num_experts: E.

    Returns:
      `Placement`.

    Raises:
      TypeError, ValueError: phy2log not an integer array of rank 1 or 2, a slot's expert
        outside [0, E), or an expert with no slot.
    """
    fn = "Placement.from_phy2log"
    E = _checks.int_field(fn, "num_experts", num_experts, 1)
    p = np.asarray(phy2log)
    if not np.issubdtype(p.dtype, np.integer) or p.ndim not in (1, 2):
      raise TypeError(
        f"{fn}: phy2log must be an integer array [S] or [L, S] (got {p.dtype} {p.shape})"
      )
    p2 = p.reshape(-1, p.shape[-1])
    for layer, row in enumerate(p2):
      _check_slots(fn, row, E, f" of layer {layer}" if p.ndim == 2 else "")
    cnt = np.stack([np.bincount(row, minlength=E) for row in p2])
    X = int(cnt.max())
    l2p = np.full((p2.shape[0], E, X), -1, np.int32)
    for layer, row in enumerate(p2):
      for e in range(E):
        slots = np.flatnonzero(row == e)
        l2p[layer, e, : len(slots)] = slots
    lead = p.shape[:-1]
    return cls(p, l2p.reshape(*lead, E, X), cnt.reshape(*lead, E))

  @property
  def num_slots(self) -> int:
    """S."""
    return self.phy2log.shape[-1]

  @property
  def num_experts(self) -> int:
    """E."""
    return self.logcnt.shape[-1]

  @property
  def num_layers(self) -> int | None:
    """L for a placement of several layers, None for one layer."""
    return self.phy2log.shape[0] if self.phy2log.ndim == 2 else None

  def __getitem__(self, layer) -> Placement:
    """The placement of one layer of a several-layer placement."""
    if self.num_layers is None:
      raise IndexError("Placement: a placement of one layer has no layer axis to index")
    return Placement(self.phy2log[layer], self.log2phy[layer], self.logcnt[layer])

  def __repr__(self) -> str:
    p = self.phy2log
    what = np.asarray(p).tolist() if _concrete(p) and p.size <= 64 else f"{p.dtype}{p.shape}"
    return f"Placement(S={self.num_slots}, E={self.num_experts}, phy2log={what})"


def _array_data(a):
  """Whether `a` is concrete array data (NumPy, a concrete jax.Array, nested lists, or
  anything NumPy converts, such as the torch tensors EPLB returns)."""
  if isinstance(a, (np.ndarray, list, tuple)):
    return True
  if isinstance(a, jax.Array):
    return _concrete(a)
  return hasattr(a, "__array__")


def _validate(placement):
  """Converts a placement's concrete arrays to int32 NumPy and checks that they agree."""
  fn = "Placement"
  for name in ("phy2log", "log2phy", "logcnt"):
    a = np.asarray(getattr(placement, name))
    if not np.issubdtype(a.dtype, np.integer):
      raise TypeError(f"{fn}: {name} must have an integer dtype (got {a.dtype})")
    object.__setattr__(placement, name, a.astype(np.int32))
  p, l2p, cnt = placement.phy2log, placement.log2phy, placement.logcnt
  lead = p.shape[:-1]
  if p.ndim not in (1, 2) or l2p.shape[:-2] != lead or cnt.shape[:-1] != lead:
    raise ValueError(
      f"{fn}: phy2log [S], log2phy [E, X] and logcnt [E] must share their leading layer "
      f"axis, if any (got shapes {p.shape}, {l2p.shape}, {cnt.shape})"
    )
  if l2p.ndim != p.ndim + 1 or cnt.shape[-1] != l2p.shape[-2]:
    raise ValueError(
      f"{fn}: log2phy must be [E, X] with E = logcnt's length (got shapes log2phy "
      f"{l2p.shape}, logcnt {cnt.shape})"
    )
  for layer in range(int(np.prod(lead, dtype=int))):
    idx = np.unravel_index(layer, lead) if lead else ()
    _check_layer(fn, p[idx], l2p[idx], cnt[idx], f" of layer {layer}" if lead else "")


def _check_slots(fn, phy2log_S, E, where):
  bad = np.flatnonzero((phy2log_S < 0) | (phy2log_S >= E))
  if bad.size:
    s = int(bad[0])
    raise ValueError(
      f"{fn}: phy2log{where} must name an expert in [0, {E}) for every slot (got "
      f"phy2log[{s}] = {int(phy2log_S[s])})"
    )
  missing = np.setdiff1d(np.arange(E), phy2log_S)
  if missing.size:
    raise ValueError(
      f"{fn}: every expert needs at least one slot; expert{'s' if missing.size > 1 else ''} "
      f"{missing.tolist()[:8]} ha{'ve' if missing.size > 1 else 's'} none in phy2log{where}"
    )


def _check_layer(fn, p, l2p, cnt, where):
  """Raises unless phy2log, log2phy and logcnt of one layer describe the same placement."""
  E = l2p.shape[0]
  _check_slots(fn, p, E, where)
  want = np.bincount(p, minlength=E)
  if not np.array_equal(cnt, want):
    e = int(np.flatnonzero(cnt != want)[0])
    raise ValueError(
      f"{fn}: logcnt{where} must count each expert's slots in phy2log (got logcnt[{e}] = "
      f"{int(cnt[e])}, phy2log has {int(want[e])})"
    )
  for e in range(E):
    listed, pad = l2p[e, : cnt[e]], l2p[e, cnt[e] :]
    if sorted(listed.tolist()) != np.flatnonzero(p == e).tolist() or np.any(pad != -1):
      raise ValueError(
        f"{fn}: log2phy{where}[{e}] must list expert {e}'s slots "
        f"{np.flatnonzero(p == e).tolist()} then -1s (got {l2p[e].tolist()})"
      )


def check_placement(fn: str, placement: Any, num_experts: int, num_devices: int) -> Placement:
  """Raises unless `placement` is a one-layer `Placement` of `num_experts` experts whose
  slots divide over `num_devices` devices; returns it."""
  if not isinstance(placement, Placement):
    raise TypeError(
      f"{fn}: placement must be a Placement, 'step' or None (got {type(placement).__name__})"
    )
  if placement.num_layers is not None:
    raise ValueError(
      f"{fn}: placement must be one layer's (phy2log [S]); index a placement of "
      f"{placement.num_layers} layers (placement[l]) (got phy2log shape "
      f"{tuple(placement.phy2log.shape)})"
    )
  if placement.num_experts != num_experts:
    raise ValueError(
      f"{fn}: placement must place num_experts ({num_experts}) experts (got "
      f"{placement.num_experts})"
    )
  _checks.divisible(
    fn, "the placement's slots", placement.num_slots, "the expert axis size", num_devices
  )
  return placement


# --------------------------------------------------------------------------- planning (host)
# A port of DeepSeek EPLB's `eplb.py` to NumPy, function for function. Ties go to the lowest
# index (a stable sort, the first of equal minima); EPLB sorts with torch.sort, whose order
# among equal loads is unspecified.


def balanced_packing(weight_XN: np.ndarray, num_packs: int) -> tuple[np.ndarray, np.ndarray]:
  """EPLB's `balanced_packing`: n items into num_packs packs of n / num_packs each, heaviest
  first, each into the lightest pack with room.

  Returns:
    (pack_index: int[X, n], rank_in_pack: int[X, n]).
  """
  X, n = weight_XN.shape
  per = n // num_packs
  if per == 1:
    return np.broadcast_to(np.arange(n), (X, n)).copy(), np.zeros((X, n), np.int64)
  pack_index = np.full((X, n), -1, np.int64)
  rank = np.full((X, n), -1, np.int64)
  for i in range(X):
    weights = [0.0] * num_packs
    items = [0] * num_packs
    for g in np.argsort(-weight_XN[i], kind="stable"):
      pack = min((p for p in range(num_packs) if items[p] < per), key=weights.__getitem__)
      pack_index[i, g], rank[i, g] = pack, items[pack]
      weights[pack] += weight_XN[i, g]
      items[pack] += 1
  return pack_index, rank


def replicate_load(weight_XE: np.ndarray, num_phy: int):
  """EPLB's `replicate_experts`: each extra slot to the expert with the most load per replica.

  Returns:
    (phy2log: int[X, num_phy], rank: int[X, num_phy], logcnt: int[X, E]).
  """
  X, E = weight_XE.shape
  phy2log = np.tile(np.arange(num_phy), (X, 1))
  rank = np.zeros((X, num_phy), np.int64)
  logcnt = np.ones((X, E), np.int64)
  rows = np.arange(X)
  for i in range(E, num_phy):
    e = np.argmax(weight_XE / logcnt, axis=-1)
    phy2log[:, i], rank[:, i] = e, logcnt[rows, e]
    logcnt[rows, e] += 1
  return phy2log, rank, logcnt


def _inverse(perm):
  inv = np.empty_like(perm)
  np.put_along_axis(inv, perm, np.broadcast_to(np.arange(perm.shape[1]), perm.shape), axis=1)
  return inv


def rebalance_hierarchical(weight_LE, num_slots, num_groups, num_nodes, num_devices):
  """EPLB's `rebalance_experts_hierarchical`: groups to nodes, replicas within nodes, replicas
  to devices (one group and one node: EPLB's global policy).

  Returns:
    (phy2log: int[L, S], rank: int[L, S], logcnt: int[L, E]).
  """
  L, E = weight_LE.shape
  group_size = E // num_groups
  groups_per_node = num_groups // num_nodes
  per_device = num_slots // num_devices
  # Step 1: groups to nodes.
  per_group = weight_LE.reshape(L, num_groups, group_size).sum(-1)
  g_pack, g_rank = balanced_packing(per_group, num_nodes)
  log2mlog = (
    ((g_pack * groups_per_node + g_rank) * group_size)[..., None] + np.arange(group_size)
  ).reshape(L, E)
  mlog2log = _inverse(log2mlog)
  # Step 2: replicas within each node.
  per_mlog = np.take_along_axis(weight_LE, mlog2log, axis=-1).reshape(-1, E // num_nodes)
  phy2mlog, phyrank, mlogcnt = replicate_load(per_mlog, num_slots // num_nodes)
  # Step 3: replicas to the devices of each node.
  per_phy = np.take_along_axis(per_mlog / mlogcnt, phy2mlog, axis=-1)
  pack, rank_in = balanced_packing(per_phy, num_devices // num_nodes)
  phy2pphy = pack * per_device + rank_in
  pphy2phy = _inverse(phy2pphy)
  pphy2mlog = np.take_along_axis(phy2mlog, pphy2phy, axis=-1)
  pphy2mlog = (
    pphy2mlog.reshape(L, num_nodes, -1) + np.arange(0, E, E // num_nodes)[None, :, None]
  ).reshape(L, -1)
  pphy2log = np.take_along_axis(mlog2log, pphy2mlog, axis=-1)
  pphyrank = np.take_along_axis(phyrank, pphy2phy, axis=-1).reshape(L, -1)
  logcnt = np.take_along_axis(mlogcnt.reshape(L, -1), log2mlog, axis=-1)
  return pphy2log, pphyrank, logcnt


def keep_home_packing(load_E: np.ndarray, num_devices: int, spare: int) -> np.ndarray:
  """Places `spare` redundant slots per device, every expert keeping its home slot.

  Device n holds its L = E / N home experts in its first L slots (expert n*L + i in slot
  n*(L + spare) + i), as the logical parameters split them, and `spare` redundant slots
  after them. Each redundant slot, one at a time, goes to a replica of the expert with the
  most load per replica on the busiest device, placed on the least-loaded device with a
  free redundant slot that does not hold that expert yet (if no expert of the busiest
  device can go anywhere, the expert with the most load per replica that can; if none
  can, the expert with the most load per replica, on the least-loaded device with room). A device's
  load is the sum over its slots of their expert's load divided by its replicas. Ties go to
  the lowest index. `plan_on_device` is the same rule in `jnp`.

  Returns:
    int32[S] phy2log, S = E + N * spare.
  """
  E, N = load_E.shape[0], num_devices
  L = E // N
  load = load_E.astype(np.float32)
  holds = np.zeros((N, E), bool)
  holds[np.arange(E) // L, np.arange(E)] = True
  cnt = np.ones(E, np.float32)
  used = np.zeros(N, np.int64)
  phy2log = np.zeros((N, L + spare), np.int64)
  phy2log[:, :L] = np.arange(E).reshape(N, L)
  for _ in range(N * spare):
    share = load / cnt
    device = holds.astype(np.float32) @ share
    room = (used < spare)[:, None] & ~holds  # [N, E] where a replica of e could go
    movable = room.any(axis=0)
    busiest = int(np.argmax(device))
    score = np.where(movable & holds[busiest], share, -np.inf)
    if not np.isfinite(score).any():
      score = np.where(movable, share, -np.inf)
    if not np.isfinite(score).any():  # every device with room holds every expert
      room = np.broadcast_to((used < spare)[:, None], room.shape)
      score = share
    e = int(np.argmax(score))
    t = int(np.argmin(np.where(room[:, e], device, np.inf)))
    phy2log[t, L + used[t]] = e
    holds[t, e] = True
    used[t] += 1
    cnt[e] += 1
  return phy2log.reshape(-1).astype(np.int32)


def plan_placement(
  load: Any,
  num_slots: int,
  num_devices: int,
  *,
  num_groups: int = 1,
  num_nodes: int = 1,
  keep_home: bool = False,
) -> Placement:
  """Plans a placement from a load per expert with EPLB's balanced packing.

  Default (`keep_home=False`), DeepSeek EPLB's `rebalance_experts(load, num_slots,
  num_groups, num_nodes, num_devices)`, ported to NumPy: each of the S - E redundant slots
  goes to the expert with the most load per replica, then the replicas are packed onto the
  devices heaviest first, each device taking S / N of them. With `num_groups` divisible by
  `num_nodes`, hierarchically (EPLB's policy for a multi-node mesh): the expert groups are
  first packed onto nodes, replicas made and packed within each node; otherwise globally
  (one group, one node). The experts move freely between devices: the layout a server
  holds (`replicate_experts`).

  `keep_home=True`: every expert keeps one slot on the device that owns it in the logical
  parameters (device n, experts [n*E/N, (n+1)*E/N)), and only the (S - E) / N redundant
  slots per device are planned (`keep_home_packing`): in training only those slots'
  weights move, and their gradients move back.

  Args:
    load: [E] or [L, E] a load per expert (e.g. tokens routed over a window, `LoadWindow`),
      >= 0 and finite.
    num_slots: S >= E slots, a multiple of `num_devices`.
    num_devices: N devices on the expert axis.
    num_groups: expert groups (default 1), dividing E; hierarchical when it divides by
      `num_nodes`.
    num_nodes: nodes (default 1), dividing `num_devices`.
    keep_home: keep each expert's first slot on its owner (default False); needs E
      divisible by N and the default groups and nodes.

  Returns:
    `Placement` ([S] arrays for a load [E], [L, S] for [L, E]).

  Raises:
    TypeError, ValueError: a load that is not a finite non-negative array of rank 1 or 2,
      or sizes that do not divide as above.
  """
  fn = "plan_placement"
  try:
    w = np.asarray(load, dtype=np.float64)
  except (TypeError, ValueError):
    w = None
  if w is None or w.ndim not in (1, 2) or w.shape[-1] < 1:
    raise TypeError(f"{fn}: load must be an array [E] or [L, E] (got {_describe(load)})")
  if not np.all(np.isfinite(w)) or np.any(w < 0):
    raise ValueError(f"{fn}: load must be finite and >= 0 (got min {w.min()}, max {w.max()})")
  E = w.shape[-1]
  S = _checks.int_field(fn, "num_slots", num_slots, E)
  N = _checks.int_field(fn, "num_devices", num_devices, 1)
  groups = _checks.int_field(fn, "num_groups", num_groups, 1)
  nodes = _checks.int_field(fn, "num_nodes", num_nodes, 1)
  _checks.bool_field(fn, "keep_home", keep_home)
  _checks.divisible(fn, "num_slots", S, "num_devices", N)
  _checks.divisible(fn, "num_devices", N, "num_nodes", nodes)
  _checks.divisible(fn, "num_experts", E, "num_groups", groups)
  w2 = w.reshape(-1, E)
  if keep_home:
    if groups != 1 or nodes != 1:
      raise ValueError(
        f"{fn}: keep_home=True plans the redundant slots of each device alone: num_groups "
        f"and num_nodes must be 1 (got {groups}, {nodes})"
      )
    _checks.divisible(fn, "num_experts", E, "num_devices", N)
    phy2log = np.stack([keep_home_packing(row, N, (S - E) // N) for row in w2])
  else:
    if groups % nodes:  # EPLB: the global policy when groups do not divide over nodes
      groups, nodes = 1, 1
    _checks.divisible(fn, "num_slots", S, "num_nodes", nodes)
    phy2log, rank, logcnt = rebalance_hierarchical(w2, S, groups, nodes, N)
    X = int(logcnt.max())
    log2phy = np.full((w2.shape[0], E, X), -1, np.int64)
    for i in range(w2.shape[0]):
      log2phy[i, phy2log[i], rank[i]] = np.arange(S)
    lead = w.shape[:-1]
    return Placement(
      phy2log.reshape(*lead, S), log2phy.reshape(*lead, E, X), logcnt.reshape(*lead, E)
    )
  return Placement.from_phy2log(phy2log.reshape(*w.shape[:-1], S), E)


def _describe(value):
  shape = getattr(value, "shape", None)
  return f"{type(value).__name__} of shape {tuple(shape)}" if shape is not None else repr(value)


# --------------------------------------------------------------------------- on device


def choose_replicas(
  experts_TK: Any,
  log2phy_EX: Any,
  logcnt_E: Any,
  slots_per_device: int,
  chip: Any = None,
  loads_NE: Any = None,
) -> jax.Array:
  """The slot each (token, expert) item of one device goes to: the layer's replica rule.

  With the loads of the N devices of the expert axis (`loads_NE`, the items each routes to
  each expert), every replica of expert e takes load_e / logcnt[e] items (within one, the
  first replicas in log2phy's order one more), so the replicas split their expert's load
  as the planner assumed:

    1. own device first: device c keeps its items for e on its own replicas of e, up to
       their shares, filling them in log2phy's order;
    2. the rest of every device's items for e (device-major, then token-major) fill the
       replicas' remaining room, in log2phy's order.

  A device computes only its own items' slots, from the [N, E] loads (all devices agree on
  them). Without `loads_NE` (or `chip`), each device's r-th item for e (token-major) goes to
  e's replica (r + chip) mod logcnt[e], its own replicas first where it has any: even per
  device, not across them. Deterministic either way: a function of the routing and the
  placement.

  Args:
    experts_TK: int[T, K] logical expert ids of this device's items; ids outside [0, E)
      stay invalid (-1).
    log2phy_EX: int[E, X] each expert's slots, -1 past its count.
    logcnt_E: int[E] replicas per expert; an expert with none gets -1 (invalid).
    slots_per_device: S / N.
    chip: the device's position on the expert axis (i32[], traced ok), or None (default:
      no device is the item's own, every item spreads over all replicas).
    loads_NE: None (default) or int[N, E] the items each device of the expert axis routes
      to each expert (this device's row = its own `experts_TK`'s counts).

  Returns:
    i32[T, K] slot ids in [0, S), -1 for an invalid item.
  """
  T, K = experts_TK.shape
  E, X = log2phy_EX.shape
  # A placement's concrete arrays are NumPy: indexed below by traced ids.
  log2phy_EX, logcnt_E = jnp.asarray(log2phy_EX), jnp.asarray(logcnt_E)
  ids = experts_TK.reshape(-1).astype(jnp.int32)
  valid = (ids >= 0) & (ids < E)
  key = jnp.where(valid, ids, E)
  # r: the item's rank among this device's items for its expert, token-major (stable sort).
  order = jnp.argsort(key, stable=True)
  counts = jnp.zeros((E + 1,), jnp.int32).at[key].add(1)
  first = jnp.cumsum(counts) - counts
  position = jnp.zeros_like(order).at[order].set(jnp.arange(ids.shape[0], dtype=order.dtype))
  rank = position.astype(jnp.int32) - first[key]
  e = jnp.minimum(key, E - 1)
  listed = jnp.arange(X)[None, :] < logcnt_E[:, None]  # [E, X]
  ok = valid & jnp.any(listed[e], axis=1)
  if chip is not None and loads_NE is not None:
    x = _balanced_turn(e, rank, listed, log2phy_EX // slots_per_device, chip, loads_NE)
    return jnp.where(ok, log2phy_EX[e, x], -1).reshape(T, K).astype(jnp.int32)
  if chip is None:
    local = jnp.zeros_like(listed)
    start = jnp.zeros((), jnp.int32)
  else:
    local = listed & (log2phy_EX // slots_per_device == chip)
    start = jnp.asarray(chip, jnp.int32)
  has_local = jnp.any(local, axis=1)
  candidate = jnp.where(has_local[:, None], local, listed)  # [E, X]
  n_candidates = jnp.sum(candidate, axis=1, dtype=jnp.int32)
  # Each expert's candidate slots first, in log2phy's order.
  slots_EX = jnp.take_along_axis(log2phy_EX, jnp.argsort(~candidate, axis=1, stable=True), 1)
  n = n_candidates[e]
  turn = (rank + jnp.where(has_local[e], 0, start)) % jnp.maximum(n, 1)
  return jnp.where(ok, slots_EX[e, turn], -1).reshape(T, K).astype(jnp.int32)


def _balanced_turn(e_I, rank_I, listed_EX, chip_EX, chip, loads_NE):
  """The replica (column of log2phy) of each item under the balanced rule."""
  N = loads_NE.shape[0]
  loads = loads_NE.astype(jnp.int32)
  total = jnp.sum(loads, axis=0)
  cnt = jnp.maximum(jnp.sum(listed_EX, axis=1, dtype=jnp.int32), 1)
  x = jnp.arange(listed_EX.shape[1])[None, :]
  share = total[:, None] // cnt[:, None] + (x < (total % cnt)[:, None])
  cap_EX = jnp.where(listed_EX, share, 0)
  local_NEX = listed_EX[None] & (chip_EX[None] == jnp.arange(N)[:, None, None])
  local_cap = jnp.where(local_NEX, cap_EX[None], 0)
  keep_NE = jnp.minimum(loads, jnp.sum(local_cap, axis=2))
  # Device c's kept items fill its own replicas in order: replica x keeps kept_NEX of them.
  before = jnp.cumsum(local_cap, axis=2) - local_cap
  kept_NEX = jnp.clip(keep_NE[:, :, None] - before, 0, local_cap)
  room_EX = cap_EX - jnp.sum(kept_NEX, axis=0)
  spill_NE = loads - keep_NE
  offset_NE = jnp.cumsum(spill_NE, axis=0) - spill_NE  # device-major order of the rest
  me = jnp.asarray(chip, jnp.int32)
  keep_I = keep_NE[me][e_I]
  own_end = jnp.cumsum(kept_NEX[me], axis=1)[e_I]  # [I, X]
  room_end = jnp.cumsum(room_EX, axis=1)[e_I]
  j_I = offset_NE[me][e_I] + rank_I - keep_I
  own = rank_I < keep_I
  turn_own = jnp.sum(own_end <= rank_I[:, None], axis=1)
  turn_rest = jnp.sum(room_end <= j_I[:, None], axis=1)
  limit = listed_EX.shape[1] - 1
  return jnp.minimum(jnp.where(own, turn_own, turn_rest), limit)


def plan_on_device(load_E: Any, num_devices: int, spare: int) -> Placement:
  """`keep_home_packing` in `jnp`: a placement planned inside jit from this step's load.

  Static shapes: S = E + N * spare slots, log2phy [E, X] with X = 1 + N * spare. The same
  rule and ties as `keep_home_packing`, in float32.

  Args:
    load_E: int or float [E] items per expert (e.g. this step's, summed over the mesh).
    num_devices: N, dividing E.
    spare: redundant slots per device, >= 1.

  Returns:
    `Placement` of traced arrays.
  """
  E, N = load_E.shape[0], num_devices
  L = E // N
  load = load_E.astype(jnp.float32)
  home = (jnp.arange(E) // L)[None, :] == jnp.arange(N)[:, None]

  def step(i, state):
    holds, cnt, used, extra = state
    share = load / cnt
    device = holds.astype(jnp.float32) @ share
    room = (used < spare)[:, None] & ~holds
    movable = jnp.any(room, axis=0)
    busiest = jnp.argmax(device)
    score = jnp.where(movable & holds[busiest], share, -jnp.inf)
    score = jnp.where(jnp.any(jnp.isfinite(score)), score, jnp.where(movable, share, -jnp.inf))
    full = ~jnp.any(jnp.isfinite(score))  # every device with room holds every expert
    room = jnp.where(full, (used < spare)[:, None], room)
    score = jnp.where(full, share, score)
    e = jnp.argmax(score)
    t = jnp.argmin(jnp.where(room[:, e], device, jnp.inf))
    extra = extra.at[t, used[t]].set(e.astype(jnp.int32))
    return holds.at[t, e].set(True), cnt.at[e].add(1.0), used.at[t].add(1), extra

  init = (
    home,
    jnp.ones((E,), jnp.float32),
    jnp.zeros((N,), jnp.int32),
    jnp.zeros((N, spare), jnp.int32),
  )
  _, _, _, extra = jax.lax.fori_loop(0, N * spare, step, init)
  phy2log = jnp.concatenate([jnp.arange(E, dtype=jnp.int32).reshape(N, L), extra], axis=1)
  return placement_arrays(phy2log.reshape(-1), E, 1 + N * spare)


def placement_arrays(phy2log_S: Any, num_experts: int, max_replicas: int) -> Placement:
  """A `Placement` of traced arrays from phy2log alone (log2phy in slot order, X =
  `max_replicas` columns; an expert with more replicas keeps its first X)."""
  E, X = num_experts, max_replicas
  S = phy2log_S.shape[0]
  phy2log_S = phy2log_S.astype(jnp.int32)
  logcnt = jnp.zeros((E,), jnp.int32).at[phy2log_S].add(1, mode="drop")
  order = jnp.argsort(phy2log_S, stable=True).astype(jnp.int32)  # slots by expert, in order
  first = jnp.cumsum(logcnt) - logcnt
  r = jnp.arange(X, dtype=jnp.int32)[None, :]
  at = jnp.minimum(first[:, None] + r, S - 1)
  log2phy = jnp.where(r < logcnt[:, None], order[at], -1)
  return Placement(phy2log_S, log2phy, jnp.minimum(logcnt, X))


def assign_slots(
  experts_TK: Any, placement: Placement, positions: Any = None, rows: Any = None
) -> jax.Array:
  """`choose_replicas` for the tokens of a whole call, device by device.

  Args:
    experts_TK: int[T, K] logical expert ids.
    placement: a one-layer `Placement`.
    positions: None (default: one group of all the tokens, no device their own), or
      int[G] the expert-axis position of each of G devices the tokens are split over in
      order (G dividing T; `sharding.expert_positions`).
    rows: with `positions`, int[G] each device's row: the devices of one row (one position
      each) exchange with one another (default None: one row).

  Returns:
    i32[T, K] slot ids, -1 for invalid items.
  """
  T, K = experts_TK.shape
  if positions is None:
    return choose_replicas(experts_TK, placement.log2phy, placement.logcnt, 1)
  positions = np.asarray(positions)
  rows = np.zeros_like(positions) if rows is None else np.asarray(rows)
  G, n = len(positions), int(np.max(positions)) + 1
  per_device = placement.num_slots // n
  # Each device's row: the devices of its row, by position.
  peers = np.zeros((G, n), np.int32)
  for g in range(G):
    for h in np.flatnonzero(rows == rows[g]):
      peers[g, positions[h]] = h
  e_GTK = experts_TK.reshape(G, T // G, K)
  valid = (e_GTK >= 0) & (e_GTK < placement.num_experts)
  onehot = jax.nn.one_hot(jnp.where(valid, e_GTK, -1), placement.num_experts, dtype=jnp.int32)
  loads_GE = jnp.sum(onehot, axis=(1, 2))

  def pick(e, chip, peer):
    return choose_replicas(e, placement.log2phy, placement.logcnt, per_device, chip, loads_GE[peer])

  slots = jax.vmap(pick)(e_GTK, jnp.asarray(positions), jnp.asarray(peers))
  return slots.reshape(T, K)


@dataclasses.dataclass(frozen=True)
class StepPlacement:
  """A placement planned inside each step from the step's own routing (`moe_layer(...,
  placement="step")` is `StepPlacement()`), for training on logical parameters.

  Each device gets `spare_slots` redundant slots after its home experts. The step's load
  per expert (summed over the mesh) is planned with `keep_home_packing`'s rule
  (`plan_on_device`), with static shapes and no host round trip: the busiest devices'
  hottest experts get replicas on the least-loaded devices, whose weights the layer fetches
  (and whose gradients it sums back). The plan is used only when it pays: when it lowers the
  busiest device's rows by more than `rows_per_moved_expert` for each expert it moves to
  another device (counted on the busiest link: the most replicas one device sends or
  receives); else every redundant slot holds its own device's first expert (nothing moves,
  the load is as without a placement).

  Attributes:
    spare_slots: redundant slots per device, >= 1 (default 2).
    rows_per_moved_expert: rows the busiest device must save per expert moved over the
      busiest link (default 1024). Moving an expert's weights and its gradient back sends
      2 * 3*D*F*b bytes; a row saved saves 18*D*F FLOPs forward and backward (a gated FFN),
      so it pays past b * P / (3 * B) rows, P the chip's FLOP/s and B its link's bytes/s:
      about 660 in bfloat16 on TPU v5e (197 TFLOP/s over 200 GB/s), about 1470 on an H100
      (990 over 450).
  """

  spare_slots: int = 2
  rows_per_moved_expert: int = 1024

  def __post_init__(self):
    _checks.int_field("StepPlacement", "spare_slots", self.spare_slots, 1)
    _checks.int_field("StepPlacement", "rows_per_moved_expert", self.rows_per_moved_expert, 0)

  def plan(
    self, load_E: Any, num_devices: int, devices_per_position: int = 1
  ) -> tuple[Placement, jax.Array]:
    """(the step's placement, bool[] whether it replicates anything) for a load [E]
    summed over the mesh, `num_devices` positions of the expert axis each spanning
    `devices_per_position` devices (the other mesh axes: each computes its share of the
    position's rows and fetches its own replicas' weights)."""
    E, N, J = load_E.shape[0], num_devices, self.spare_slots
    L = E // N
    planned = plan_on_device(load_E, N, J).phy2log.reshape(N, L + J)
    load = load_E.astype(jnp.float32)
    cnt = jnp.zeros((E,), jnp.float32).at[planned.reshape(-1)].add(1.0)
    after = jnp.max(jnp.sum((load / cnt)[planned], axis=1))
    before = jnp.max(jnp.sum(load.reshape(N, L), axis=1))
    # The fetch sends each replica from its expert's owner: the busiest link carries the
    # most replicas one device receives or sends.
    away = planned[:, L:] // L != jnp.arange(N)[:, None]  # [N, J] fetched from elsewhere
    received = jnp.sum(away, axis=1)
    sent = jnp.zeros((N,), jnp.int32).at[planned[:, L:] // L].add(away.astype(jnp.int32))
    moved = jnp.maximum(jnp.max(received), jnp.max(sent))
    pays = (before - after) / devices_per_position > self.rows_per_moved_expert * moved
    home = jnp.arange(E, dtype=jnp.int32).reshape(N, L)
    kept = jnp.concatenate([home, jnp.repeat(home[:, :1], J, axis=1)], axis=1)
    phy2log = jnp.where(pays, planned, kept).reshape(-1)
    return placement_arrays(phy2log, E, 1 + N * J), pays
