"""What the layer does with a placement on device: the replica rule and the per-step plan.

`choose_replicas` is the layer's rule for which replica an item goes to (`assign_slots`
applies it to the tokens of a whole call, device by device), and `plan_on_device` /
`StepPlacement` the per-step plan (`moe_layer(..., placement="step")`), all pure `jnp`.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from moe_shard import _checks
from moe_shard.placement import Placement


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
    """(the step's placement, bool[] whether it pays: it saves the busiest device more than
    `rows_per_moved_expert` rows per expert moved) for a load [E]
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
