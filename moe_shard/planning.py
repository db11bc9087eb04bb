"""Planning a placement on the host from a load per expert: DeepSeek EPLB's packing.

`plan_placement` plans one with EPLB's balanced packing (a NumPy port of its algorithm:
global, or hierarchical over expert groups and nodes), or, with `keep_home=True`, keeping
every expert's first slot on the device that owns it in the logical parameters (the layout
where training on logical parameters moves the fewest weights). An all-zero load plans
the layout of no placement (`home_layout`).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from moe_shard import _checks
from moe_shard.placement import Placement

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
      >= 0 and finite. A layer whose load is all zeros (an empty `LoadWindow`) gets
      `home_layout`: the items stay where no placement puts them (with E not divisible
      by N, where there is no such layout: the packing of an even load).
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
  idle = ~np.any(w2 > 0, axis=1)  # nothing to plan from: the layout of no placement
  if np.any(idle) and E % N:  # no such layout: the packing of an even load
    w2 = np.where(idle[:, None], 1.0, w2)
    idle = np.zeros_like(idle)
  if np.all(idle):
    return Placement.from_phy2log(
      np.broadcast_to(home_layout(E, S, N), (*w.shape[:-1], S)).copy(), E
    )
  if keep_home:
    if groups != 1 or nodes != 1:
      raise ValueError(
        f"{fn}: keep_home=True plans the redundant slots of each device alone: num_groups "
        f"and num_nodes must be 1 (got {groups}, {nodes})"
      )
    _checks.divisible(fn, "num_experts", E, "num_devices", N)
    phy2log = np.stack(
      [
        home_layout(E, S, N) if empty else keep_home_packing(row, N, (S - E) // N)
        for row, empty in zip(w2, idle)
      ]
    )
  else:
    if groups % nodes:  # EPLB: the global policy when groups do not divide over nodes
      groups, nodes = 1, 1
    _checks.divisible(fn, "num_slots", S, "num_nodes", nodes)
    phy2log, rank, logcnt = rebalance_hierarchical(w2, S, groups, nodes, N)
    if np.any(idle):  # some layers idle: their rows the layout of no placement
      phy2log[idle] = home_layout(E, S, N)
      return Placement.from_phy2log(phy2log.reshape(*w.shape[:-1], S), E)
    X = int(logcnt.max())
    log2phy = np.full((w2.shape[0], E, X), -1, np.int64)
    for i in range(w2.shape[0]):
      log2phy[i, phy2log[i], rank[i]] = np.arange(S)
    lead = w.shape[:-1]
    return Placement(
      phy2log.reshape(*lead, S), log2phy.reshape(*lead, E, X), logcnt.reshape(*lead, E)
    )
  return Placement.from_phy2log(phy2log.reshape(*w.shape[:-1], S), E)


def home_layout(num_experts: int, num_slots: int, num_devices: int) -> np.ndarray:
  """The layout of no placement, in slots: device n holds its own L = E / N experts (those
  the logical parameters give it) in its first L slots, and each of its redundant slots a
  replica of one of them, in turn. Items then stay on the devices they go to without a
  placement: what `plan_placement` plans from a load with nothing in it.

  Returns:
    int32[S] phy2log.
  """
  E, S, N = num_experts, num_slots, num_devices
  L, per = E // N, S // N
  return (np.arange(N)[:, None] * L + np.arange(per)[None, :] % L).reshape(-1).astype(np.int32)


def _describe(value):
  shape = getattr(value, "shape", None)
  return f"{type(value).__name__} of shape {tuple(shape)}" if shape is not None else repr(value)
