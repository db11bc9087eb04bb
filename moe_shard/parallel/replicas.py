"""Replicated experts on the mesh: moving expert weights to slots, and gradients back.

Inside a dispatch's `shard_map` body, a placement (`moe_shard.placement.Placement`) turns
the call into one over S slots, S / N a device (`slot_inputs`): each item picks a replica
(`replica_rule.choose_replicas`, its own device first) and, when the weights are the logical
ones ([E, ...], L = E / N a device, as training holds them), each device fetches its slots'
weights from the experts' owners (`fetch_slots`). The fetch is a `ragged_all_to_all` with
one one-expert slice per (source, slot): bytes only for the slots whose expert another
device owns, a local copy for the others. Its backward sends each slot's weight gradient
back to the owner, which sums the replicas' gradients into its expert's.

`gather_slots` is the transport (also `replicas.replicate_experts`'s, moving slot-major
weights between placements); `plan_step` plans a placement inside the step from the step's
own routing (`moe_layer(..., placement="step")`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from moe_shard import _checks, replica_rule
from moe_shard import placement as placement_lib
from moe_shard.balance import expert_load
from moe_shard.experts import as_ffn
from moe_shard.frozen import stop_gradient
from moe_shard.parallel.common import shard_map
from moe_shard.parallel.ragged_exchange import ragged_exchange
from moe_shard.placement import concrete
from moe_shard.quant import is_quantized
from moe_shard.sharding import auto, axis_size, explicit_mesh, like, place


def gather_slots(leaf_R, src_dev_S, src_row_S, *, axis, n):
  """This device's S / N slots of a leaf, each a row of some device's leaf.

  Slot j of device d (global slot d * S/N + j) is row `src_row[s]` of device
  `src_dev[s]`'s `leaf_R` (a local copy where src_dev[s] == d).

  Args:
    leaf_R: [R, ...] this device's rows (experts, or slots).
    src_dev_S: i32[S] (replicated) the device each slot's row comes from.
    src_row_S: i32[S] its row there.
    axis: the mesh axis (or tuple of axes) of the N devices.
    n: N.

  Returns:
    [S / N, ...] in the dtype of `leaf_R`.
  """
  S = src_dev_S.shape[0]
  Ls = S // n
  me = jax.lax.axis_index(axis)
  dev_NJ, row_NJ = src_dev_S.reshape(n, Ls), src_row_S.reshape(n, Ls)
  # As a source: for each destination d and its slot j, send row_NJ[d, j] when it is ours.
  send_NJ = (dev_NJ == me).astype(jnp.int32)
  # As a destination: slot j of ours comes from device src_dev[me * Ls + j].
  mine_J = jax.lax.dynamic_index_in_dim(dev_NJ, me, keepdims=False)
  recv_NJ = (mine_J[None, :] == jnp.arange(n)[:, None]).astype(jnp.int32)
  at_NJ = jnp.broadcast_to(jnp.arange(Ls, dtype=jnp.int32), (n, Ls))
  out = jnp.zeros((Ls,) + leaf_R.shape[1:], leaf_R.dtype)
  # Each device sends each slot's row to the slot's device, and receives its own slots'.
  return ragged_exchange(
    leaf_R,
    out,
    jnp.where(send_NJ > 0, row_NJ, 0).reshape(-1),
    send_NJ.reshape(-1),
    at_NJ.reshape(-1),
    recv_NJ.reshape(-1),
    axis=axis,
    rows_per_peer=Ls,
  )


@dataclasses.dataclass(frozen=True)
class _Fetch:
  """Static facts of one fetch (a custom_vjp nondiff argument)."""

  axis: str | tuple[str, ...]
  n: int  # N devices on the expert axis
  local: int  # L experts a device owns
  grad_rows: int  # most slots whose expert one device owns (the gradient's receive buffer)


def fetch_slots(ffn_L, phy2log_S, *, axis, n, grad_rows):
  """The weights of this device's slots, from the logical experts' owners.

  Args:
    ffn_L: the expert FFN of this device's L = E / N logical experts (expert axis first).
    phy2log_S: i32[S] (replicated) logical expert of each slot.
    axis, n: the expert axis and its size N.
    grad_rows: a static bound on the slots whose expert one device owns (at most
      S - E + L).

  Returns:
    The FFN of this device's S / N slots. Differentiable in the trainable leaves: each
    slot's gradient is summed into its expert's on the owner. Quantized matrices are
    fetched frozen.
  """
  L = jax.tree.leaves(ffn_L)[0].shape[0]
  cfg = _Fetch(axis, n, L, grad_rows)
  leaves, treedef = jax.tree.flatten(ffn_L, is_leaf=is_quantized)
  out = []
  for leaf in leaves:
    if is_quantized(leaf):  # frozen: moved, never differentiated
      leaf = stop_gradient(leaf)
      out.append(jax.tree.map(lambda a: _gather_experts(cfg, a, phy2log_S), leaf))
    else:
      out.append(_fetch(cfg, leaf, phy2log_S))
  return jax.tree.unflatten(treedef, out)


def _gather_experts(cfg, leaf_L, phy2log_S):
  return gather_slots(leaf_L, phy2log_S // cfg.local, phy2log_S % cfg.local, axis=cfg.axis, n=cfg.n)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _fetch(cfg, leaf_L, phy2log_S):
  return _gather_experts(cfg, leaf_L, phy2log_S)


def _fetch_fwd(cfg, leaf_L, phy2log_S):
  return _gather_experts(cfg, leaf_L, phy2log_S), phy2log_S


def _fetch_bwd(cfg, phy2log_S, d_slots):
  """Each slot's gradient goes back to its expert's owner, which sums them per expert.

  The owner receives into G rows: row l the gradient of its expert l's first slot (every
  expert has one), rows L.. those of its experts' other slots, in slot order; each of the
  G - L extra rows is then added into its expert's row (one slice each: a scatter-add of
  whole matrices is a loop over them on TPU, each pass over the whole result)."""
  n, L, G = cfg.n, cfg.local, cfg.grad_rows
  S = phy2log_S.shape[0]
  Ls = S // n
  me = jax.lax.axis_index(cfg.axis)
  owner_S = phy2log_S // L
  earlier = jnp.arange(S)[None, :] < jnp.arange(S)[:, None]  # [s, s'] s' < s
  first_S = ~jnp.any(earlier & (phy2log_S[None, :] == phy2log_S[:, None]), axis=1)
  extra_rank_S = jnp.sum(earlier & (owner_S[None, :] == owner_S[:, None]) & ~first_S[None, :], 1)
  at_S = jnp.where(first_S, phy2log_S % L, L + extra_rank_S).astype(jnp.int32)
  mine = jax.lax.dynamic_slice_in_dim(owner_S, me * Ls, Ls)  # owners of this device's slots
  send_NJ = (mine[None, :] == jnp.arange(n)[:, None]).astype(jnp.int32)
  at_J = jax.lax.dynamic_slice_in_dim(at_S, me * Ls, Ls)
  recv_NJ = (owner_S.reshape(n, Ls) == me).astype(jnp.int32)
  # Each device sends each slot's gradient to the owner of the slot's expert.
  buf = ragged_exchange(
    d_slots,
    jnp.zeros((G,) + d_slots.shape[1:], d_slots.dtype),
    jnp.broadcast_to(jnp.arange(Ls, dtype=jnp.int32), (n, Ls)).reshape(-1),
    send_NJ.reshape(-1),
    jnp.broadcast_to(at_J, (n, Ls)).reshape(-1),
    recv_NJ.reshape(-1),
    axis=cfg.axis,
    rows_per_peer=Ls,
  )
  (extra_slots,) = jnp.nonzero((owner_S == me) & ~first_S, size=G - L, fill_value=0)
  acc = jnp.promote_types(d_slots.dtype, jnp.float32)  # at least float32, rounded once
  d_L = buf[:L].astype(acc)
  for g in range(G - L):  # padding rows are zeros: adding them changes nothing
    d_L = d_L.at[phy2log_S[extra_slots[g]] % L].add(buf[L + g].astype(acc))
  return d_L.astype(d_slots.dtype), None


_fetch.defvjp(_fetch_fwd, _fetch_bwd)


def grad_rows_bound(placement, num_experts, n):
  """The static bound `fetch_slots` needs: the most slots whose expert one device owns (at
  least L: each expert has one); exact for a placement known while tracing, S - E + L for
  a traced one."""
  phy2log = placement.phy2log
  S, L = placement.num_slots, num_experts // n
  if concrete(phy2log):
    return max(L, int(np.bincount(np.asarray(phy2log) // L, minlength=n).max()))
  return S - num_experts + L


def slot_inputs(lay, placement, ffn, experts_TK, *, slot_weights, grad_rows):
  """A dispatch body's inputs over slots: (lay over S slots, the slots' FFN, slot ids, stats).

  Args:
    lay: the call's `_Layout` (experts over `lay.expert_axis`).
    placement: `Placement` of traced or constant arrays, replicated.
    ffn: this device's expert weights: L logical experts (`slot_weights` False: fetched
      from their owners) or S / N slots (`slot_weights` True: used as they are).
    experts_TK: i32[T, K] this device's logical expert ids.
    slot_weights: whether `ffn` holds slots.
    grad_rows: `grad_rows_bound` of the placement.

  Returns:
    (lay with num_experts = S, the FFN of this device's S / N slots, slots_TK: i32[T, K],
    stats: expert_load i32[E] (logical, summed over the mesh) and slot_load i32[S]).
  """
  S, E, n = placement.num_slots, placement.num_experts, lay.n
  chip = jax.lax.axis_index(lay.expert_axis)
  # Every device of the expert axis learns what the others route to each expert, so that
  # the replicas split each expert's load evenly (`choose_replicas`).
  loads_NE = jax.lax.all_gather(expert_load(experts_TK, E), lay.expert_axis)
  slots_TK = replica_rule.choose_replicas(
    experts_TK, placement.log2phy, placement.logcnt, S // n, chip, loads_NE
  )
  if not slot_weights:
    ffn = fetch_slots(ffn, placement.phy2log, axis=lay.expert_axis, n=n, grad_rows=grad_rows)
  stats = dict(
    expert_load=jax.lax.psum(expert_load(experts_TK, E), lay.all_axes),
    slot_load=jax.lax.psum(expert_load(slots_TK, S), lay.all_axes),
  )
  return dataclasses.replace(lay, num_experts=S), ffn, slots_TK, stats


def check_dispatch_placement(fn, placement, w, mesh, expert_axis, slot_weights):
  """A dispatch's placement arguments checked at trace time: (placement, grad_rows).

  `w` must hold the placement's E logical experts, or its S slots with `slot_weights`;
  the slots must divide over the expert axis.
  """
  if placement is None:
    if slot_weights:
      raise ValueError(f"{fn}: slot_weights=True needs the placement of the slots (got None)")
    return None, 0
  _, leading = as_ffn(fn, w)
  n = axis_size(mesh, expert_axis)
  E = placement.num_experts
  placement = placement_lib.check_placement(fn, placement, E, n)
  want, what = (placement.num_slots, "S slots") if slot_weights else (E, "E experts")
  if leading != want:
    raise ValueError(
      f"{fn}: w must hold the placement's {what} ({want}) on its first axis with "
      f"slot_weights={slot_weights} (got {leading})"
    )
  _checks_divisible(fn, E, n, expert_axis)
  return placement, 0 if slot_weights else grad_rows_bound(placement, E, n)


def _checks_divisible(fn, E, n, expert_axis):
  _checks.divisible(fn, "num_experts", E, f"the {expert_axis!r} axis size", n)


# --------------------------------------------------------------------------- tied replicas


@dataclasses.dataclass(frozen=True)
class _Tie:
  """Static facts of one replica tie (a custom_vjp nondiff argument)."""

  mesh: Any  # None: one device (the sum is a segment sum, no collective)
  axis: str | tuple[str, ...]
  n: int  # N devices on the expert axis
  reduce_rows: int  # most followers whose leader one device holds (0: nothing replicated)
  return_rows: int  # most followers one device holds
  spec: Any  # the leaf's PartitionSpec on the mesh


def leader_slots(placement, slots_per_device):
  """i32[S]: the leader of each slot's expert, the replica that sums its replicas' gradients.

  Experts are taken most replicas first; each gets as leader its replica on the device that
  leads the fewest other replicas so far (the first such replica in log2phy's order), so
  no device gathers the gradients of many experts. A function of the placement's arrays
  (traced or constant).
  """
  log2phy_EX = jnp.asarray(placement.log2phy, jnp.int32)
  logcnt_E = jnp.asarray(placement.logcnt, jnp.int32)
  E, X = log2phy_EX.shape
  n = placement.num_slots // slots_per_device

  def take(i, state):
    load_N, lead_E = state
    e = order_E[i]
    valid_X = jnp.arange(X) < logcnt_E[e]
    dev_X = jnp.where(valid_X, log2phy_EX[e] // slots_per_device, 0)
    x = jnp.argmin(jnp.where(valid_X, load_N[dev_X], jnp.iinfo(jnp.int32).max))
    load_N = load_N.at[dev_X[x]].add(jnp.maximum(logcnt_E[e] - 1, 0))  # unplaced: 0 slots
    return load_N, lead_E.at[e].set(log2phy_EX[e, x])

  order_E = jnp.argsort(-logcnt_E, stable=True)
  init = (jnp.zeros((n,), jnp.int32), jnp.zeros((E,), jnp.int32))
  _, lead_E = jax.lax.fori_loop(0, E, take, init)
  return lead_E[jnp.asarray(placement.phy2log, jnp.int32)]


def tie_bounds(placement, n):
  """(reduce_rows, return_rows): the static buffer rows of `tie_replicas` on N devices: the
  most followers (replicas not their expert's leader, `leader_slots`) whose leader one
  device holds, and the most one device holds. Exact for a placement known while tracing;
  S - 1 for a traced one (every slot but one a follower: one expert in every slot, the
  others unplaced, is a valid placement)."""
  if not concrete(placement.phy2log):
    bound = placement.num_slots - 1
    return bound, bound
  S = placement.num_slots
  Ls = S // n
  with jax.ensure_compile_time_eval():  # a constant placement: evaluated here, inside jit too
    leader = np.asarray(leader_slots(placement, Ls))
  follower = leader != np.arange(S)
  reduce_rows = np.bincount(leader[follower] // Ls, minlength=n).max(initial=0)
  return_rows = np.bincount(np.flatnonzero(follower) // Ls, minlength=n).max(initial=0)
  return int(reduce_rows), int(return_rows)


def tie_replicas(ffn_S, placement, *, mesh, expert_axis, specs):
  """Slot-major expert weights whose every replica gets its expert's whole gradient.

  The forward is the identity. In the backward each slot's gradient becomes the sum of the
  gradients of every slot holding the same expert (`placement.phy2log`): the logical
  expert's gradient, on each of its replicas. So an elementwise optimizer keeps the
  replicas equal, and a step on slot-major parameters is the step on the logical ones.
  On a mesh the sum is two `ragged_all_to_all`s over the expert axis (emulated on CPU): each
  follower (a replica that is not its expert's leader, `leader_slots`) sends its gradient
  to its leader's device, which adds them, and the leader sends the sum back; bytes only
  for replicated experts. The sum is taken in float32 (float64 for float64 gradients) and
  rounded once to the gradient's dtype (the gradients travel in their own dtype).

  Args:
    ffn_S: the expert FFN over the S slots, slot axis first (split over `expert_axis` on a
      mesh). Quantized matrices are frozen: passed through.
    placement: the one-layer `Placement` the slots were made for (traced or constant).
    mesh: the mesh, or None (one device).
    expert_axis: the mesh axis (or tuple of axes) the slots are split over.
    specs: the `PartitionSpec`s of `ffn_S`'s leaves on the mesh (a pytree like it).

  Returns:
    `ffn_S`, whose gradients are summed over replicas.
  """
  n = 1 if mesh is None else axis_size(mesh, expert_axis)
  reduce_rows, return_rows = tie_bounds(placement, n)
  if reduce_rows == 0:
    return ffn_S  # no expert has two slots (or S = E): nothing to sum
  with jax.ensure_compile_time_eval() if concrete(placement.phy2log) else contextlib.nullcontext():
    leader_S = leader_slots(placement, placement.num_slots // n)  # a constant where it can
  leaves, treedef = jax.tree.flatten(ffn_S, is_leaf=is_quantized)
  spec_leaves = jax.tree.leaves(specs, is_leaf=lambda s: isinstance(s, P) or is_quantized(s))
  out = []
  for leaf, spec in zip(leaves, spec_leaves):
    if is_quantized(leaf):  # frozen
      out.append(leaf)
      continue
    cfg = _Tie(None if n == 1 else mesh, expert_axis, n, reduce_rows, return_rows, spec)
    out.append(_tie(cfg, leaf, leader_S))
  return jax.tree.unflatten(treedef, out)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _tie(cfg, leaf_S, leader_S):
  del cfg, leader_S
  return leaf_S


def _tie_fwd(cfg, leaf_S, leader_S):
  del cfg
  return leaf_S, leader_S


def _tie_bwd(cfg, leader_S, d_S):
  if cfg.mesh is None:  # one device: a segment sum over the slots of each expert

    def segment_sum(d, lead):  # summed in at least float32, rounded once
      wide = d.astype(jnp.promote_types(d.dtype, jnp.float32))
      return jnp.zeros_like(wide).at[lead].add(wide)[lead].astype(d.dtype)

    # On an Explicit mesh whose expert axis has one device the cotangent is typed sharded.
    return auto(segment_sum, d_S, lambda spec: spec)(d_S, leader_S), None
  spec = cfg.spec
  if explicit_mesh(d_S)[1]:  # on an Explicit mesh: the cotangent's own layout, if it can
    own = jax.typeof(d_S).sharding.spec
    spec = own if own and own[0] == spec[0] else spec
  body = functools.partial(_sum_replicas, cfg=cfg)
  fn = shard_map(body, cfg.mesh, in_specs=(spec, P()), out_specs=spec)
  return like(fn(place(d_S, cfg.mesh, spec), leader_S), d_S), None


_tie.defvjp(_tie_fwd, _tie_bwd)


def _sum_replicas(d_J, leader_S, *, cfg):
  """Per device: this device's J = S / N slots' gradients, each replaced by its expert's sum."""
  n, S = cfg.n, leader_S.shape[0]
  J = S // n
  me = jax.lax.axis_index(cfg.axis)
  s_S = jnp.arange(S, dtype=jnp.int32)
  follower_S = leader_S != s_S
  lead_dev_S = leader_S // J
  earlier_SS = s_S[None, :] < s_S[:, None]
  mine = functools.partial(jax.lax.dynamic_slice_in_dim, start_index=me * J, slice_size=J)
  exchange = functools.partial(ragged_exchange, axis=cfg.axis)
  at_NJ = jnp.broadcast_to(jnp.arange(J, dtype=jnp.int32), (n, J)).reshape(-1)
  peers_N1 = jnp.arange(n)[:, None]
  # Reduce: each follower's gradient goes to its leader's device, at its rank among the
  # followers whose leader is there (slot order); the leader adds them.
  G = cfg.reduce_rows
  rank_S = jnp.sum(
    earlier_SS & follower_S[None, :] & (lead_dev_S[None, :] == lead_dev_S[:, None]), 1
  )
  send_NJ = (mine(lead_dev_S)[None, :] == peers_N1) & mine(follower_S)[None, :]
  recv_NJ = (follower_S & (lead_dev_S == me)).reshape(n, J)
  buf_GX = exchange(
    d_J,
    jnp.zeros((G,) + d_J.shape[1:], d_J.dtype),
    at_NJ,
    send_NJ.reshape(-1).astype(jnp.int32),
    jnp.broadcast_to(mine(rank_S), (n, J)).reshape(-1).astype(jnp.int32),
    recv_NJ.reshape(-1).astype(jnp.int32),
    rows_per_peer=min(J, G),
  )
  # Each row here whose expert has followers adds their rows in place, in float32 (float64
  # stays float64), rounded once: in bfloat16 each addition would round the partial sum
  # again, the experts with the most replicas getting the least exact gradients.
  (came_G,) = jnp.nonzero(follower_S & (lead_dev_S == me), size=G, fill_value=0)
  from_G = jnp.where(jnp.arange(G) < jnp.sum(recv_NJ), leader_S[came_G] % J, J)  # J: padding
  L = min(J, G)
  summed_J = jnp.any(from_G[:, None] == jnp.arange(J), 0)
  (lead_L,) = jnp.nonzero(summed_J, size=L, fill_value=0)
  acc = jnp.promote_types(d_J.dtype, jnp.float32)
  for l in range(L):  # a padding entry (l past the count) adds nothing to row 0
    row = lead_L[l]
    take_G = (from_G == row) & (l < jnp.sum(summed_J))
    wide = d_J[row].astype(acc)
    for g in range(G):
      wide = wide + jnp.where(take_G[g], buf_GX[g], 0).astype(acc)
    d_J = jax.lax.dynamic_update_index_in_dim(d_J, wide.astype(d_J.dtype), row, 0)
  # Return: each leader sends its sum to its followers' devices, into their rows.
  R = cfg.return_rows
  own_rank_S = jnp.sum(
    earlier_SS & follower_S[None, :] & (s_S[None, :] // J == s_S[:, None] // J), 1
  )
  send_NJ = (follower_S & (lead_dev_S == me)).reshape(n, J)
  recv_NJ = (mine(lead_dev_S)[None, :] == peers_N1) & mine(follower_S)[None, :]
  sums_RX = exchange(
    d_J,
    jnp.zeros((R,) + d_J.shape[1:], d_J.dtype),
    (leader_S % J).astype(jnp.int32),
    send_NJ.reshape(-1).astype(jnp.int32),
    own_rank_S.astype(jnp.int32),
    recv_NJ.reshape(-1).astype(jnp.int32),
    rows_per_peer=min(J, R),
  )
  (mine_R,) = jnp.nonzero(mine(follower_S), size=R, fill_value=0)
  count = jnp.sum(mine(follower_S))
  for r in range(R):  # one row each, in place
    row = mine_R[r]
    value = jnp.where(r < count, sums_RX[r], d_J[row])
    d_J = jax.lax.dynamic_update_index_in_dim(d_J, value, row, 0)
  return d_J
