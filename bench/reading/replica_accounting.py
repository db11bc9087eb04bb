"""The host accounting of a case on a placement: which slot each item takes (the layer's
replica rule, written out again), the per-step plan, and the bytes of fetching the replicas'
weights or of summing their gradients. `placed` wraps a dispatch's own accounting
(`accounting.py`)."""

from __future__ import annotations

import dataclasses

import jax
import numpy as np

import moe_shard as ms
from bench.reading.accounting import device_loads
from moe_shard.sharding import EXPERT

# Rows with no dispatch of the library's (XLA shards them; the placement changes nothing).
UNPLACED = (
  "jit_ragged_dot",
  "jit_masked_scan",
  "jit_gshard_einsum",
  "dense_limit",
  "matmul_limit",
  "torch_moe",
)


def placed(fn, case, on_tpu, impl):
  """`fn(case, on_tpu)` on the case as its dispatch sees it, and the rows of each chip.

  Returns:
    (Accounting, rows: int[devices] (token, expert) items each device computes, or None at
    kernel level). With a placement on logical parameters, `sent_bytes` adds the fetch of
    the replicas' weights (and, fwd_bwd, their gradients' return): the busiest device's
    dispatch bytes plus the busiest device's fetch bytes, an upper bound on their sum.
  """
  if case.level != "layer":
    return fn(case, on_tpu), None
  if case.placement is None or impl in UNPLACED:
    return fn(case, on_tpu), chip_rows(case.experts_TK, case.E, case)
  phy2log = host_phy2log(case)
  log2phy = getattr(case.placement, "log2phy", None)  # the step's plan: slots in order
  slots = replica_slots(
    case.experts_TK, phy2log, case.mesh.size, case.mesh.shape[EXPERT], log2phy=log2phy
  )
  sub = dataclasses.replace(case, E=len(phy2log), experts_TK=slots)
  acc = fn(sub, on_tpu)
  # Logical parameters fetch the slots' weights; slot-major ones sum their replicas'
  # gradients (`tie_bytes`).
  moved = tie_bytes if case.size.placement == "served" else fetch_bytes
  extra = moved(case, phy2log)
  sent = acc.sent_bytes or {}
  acc = dataclasses.replace(acc, sent_bytes={m: sent.get(m, 0.0) + b for m, b in extra.items()})
  return acc, chip_rows(slots, len(phy2log), case)


def tie_bytes(case, phy2log):
  """{mode: bytes}: what the busiest device sends to sum the replicas' gradients of
  slot-major parameters (`parallel.tie_replicas`, fwd_bwd only): each replica that is not
  its expert's first sends its gradient to the first's device, which sends the sum back."""
  N = case.mesh.shape[EXPERT]
  phy2log = np.asarray(phy2log)
  S = len(phy2log)
  Ls = S // N
  grads = _grad_bytes(case.args[0].experts)
  _, first = np.unique(phy2log, return_index=True)
  leader = first[np.searchsorted(np.unique(phy2log), phy2log)]
  remote = (leader != np.arange(S)) & (leader // Ls != np.arange(S) // Ls)
  reduce = np.bincount((np.arange(S) // Ls)[remote], minlength=N)  # followers send
  back = np.bincount((leader // Ls)[remote], minlength=N)  # leaders send the sums back
  return {"fwd": 0.0, "fwd_bwd": float(((reduce + back) * grads).max())}


def _grad_bytes(experts):
  """Bytes of one expert's trainable matrices (quantized ones are frozen)."""
  total = 0
  for leaf in jax.tree.leaves(experts, is_leaf=ms.quant.is_quantized):
    if not ms.quant.is_quantized(leaf):
      total += int(np.prod(leaf.shape[1:])) * np.dtype(leaf.dtype).itemsize
  return total


def step_branch(case):
  """The case as the per-step placement's `lax.cond` runs it: with the plan the host makes
  from the case's load (`host_phy2log`) as a `Placement` where it pays, else with none.
  The benchmark measures that program's FLOPs, bytes and collectives (the branch that
  runs), and the memory of the program with both branches."""
  phy2log = host_phy2log(case)
  N = case.mesh.shape[EXPERT]
  if np.array_equal(phy2log, step_home(case.E, N, phy2log)):
    return dataclasses.replace(case, placement=None)
  return dataclasses.replace(case, placement=ms.Placement.from_phy2log(phy2log, case.E))


def step_home(E, N, phy2log):
  """The per-step plan's layout when it does not pay: each device's redundant slots hold
  its first expert."""
  L, J = E // N, len(phy2log) // N - E // N
  home = np.arange(E).reshape(N, L)
  return np.concatenate([home, np.repeat(home[:, :1], J, axis=1)], axis=1).reshape(-1)


def chip_rows(ids_TK, num_ids, case):
  """int[devices]: the items device (e, m) computes: those the tokens of devices (., m)
  route to the experts (or slots) of expert-axis position e."""
  n_dev, N = case.mesh.size, case.mesh.shape[EXPERT]
  M = n_dev // N
  load = device_loads(ids_TK, num_ids, n_dev).reshape(N, M, N, num_ids // N)
  return load.sum(axis=(0, 3)).T.reshape(-1)  # [e_dst, m] in device order e * M + m


def replica_slots(experts_TK, phy2log, n_dev, N, log2phy=None):
  """The slot of every item by the layer's documented rule. Device g holds the g-th block
  of tokens, at expert-axis position g // M of row g % M. In each row, replica x of expert
  e (its slots in log2phy's order; without `log2phy`, in increasing order) takes the
  row's load of e divided by e's count, the first (load mod count) one more; each
  device's items for e (token-major) first fill its own replicas of e in order up to
  those shares, and the rest, device by device in position order, fill the remaining room
  in order. Invalid ids stay -1."""
  phy2log = np.asarray(phy2log)
  S = phy2log.shape[0]
  Ls, M = S // N, n_dev // N
  e_all = np.asarray(experts_TK)
  T, K = e_all.shape
  per = T // n_dev
  blocks = e_all.reshape(n_dev, per * K)
  out = np.full((n_dev, per * K), -1, np.int64)
  for m in range(M):
    members = [p * M + m for p in range(N)]  # the row's devices, by position
    for e in range(int(phy2log.max()) + 1):
      slots = np.flatnonzero(phy2log == e)
      if log2phy is not None:
        slots = np.asarray(log2phy)[e][: slots.size]
      items = [np.flatnonzero(blocks[g] == e) for g in members]
      q, extra = divmod(sum(i.size for i in items), slots.size)
      room = q + (np.arange(slots.size) < extra)
      rest = []
      for p, g in enumerate(members):
        take = items[p]
        for x in np.flatnonzero(slots // Ls == p):
          n = min(room[x], take.size)
          out[g, take[:n]] = slots[x]
          room[x] -= n
          take = take[n:]
        rest += [(g, i) for i in take]
      at = 0
      for x in range(slots.size):
        for g, i in rest[at : at + room[x]]:
          out[g, i] = slots[x]
        at += room[x]
  return out.reshape(T, K)


def host_phy2log(case):
  """The placement's phy2log; for placement "step", the step's plan from the case's load
  by the documented rule (`ms.StepPlacement`), written out again here."""
  p = case.placement
  if hasattr(p, "phy2log"):
    return np.asarray(p.phy2log)
  N = case.mesh.shape[EXPERT]
  e = np.asarray(case.experts_TK).ravel()
  load = np.bincount(e[(e >= 0) & (e < case.E)], minlength=case.E).astype(np.float32)
  M = case.mesh.size // N
  return step_plan(load, N, p.spare_slots, p.rows_per_moved_expert, M)


def step_plan(load, N, J, rows_per_moved, M=1):
  """phy2log of the per-step placement: J redundant slots after each device's L home
  experts; each in turn to a replica of the expert with the most load per replica on the
  busiest device, put on the least-loaded device with room that lacks it (else any expert
  that can move; else anywhere with room); used when the busiest device's load drops by
  more than `rows_per_moved` per expert on the busiest link (the most replicas one device
  sends or receives), the load of a position of the expert axis shared by its M devices,
  else each redundant slot holds its device's first expert. float32, ties to the lowest
  index."""
  E = load.shape[0]
  L = E // N
  holds = np.zeros((N, E), bool)
  holds[np.arange(E) // L, np.arange(E)] = True
  cnt = np.ones(E, np.float32)
  used = np.zeros(N, np.int64)
  extra = np.zeros((N, J), np.int64)
  for _ in range(N * J):
    share = load / cnt
    dev = holds.astype(np.float32) @ share
    room = (used < J)[:, None] & ~holds
    movable = room.any(axis=0)
    busy = int(np.argmax(dev))
    score = np.where(movable & holds[busy], share, -np.inf)
    if not np.isfinite(score).any():
      score = np.where(movable, share, -np.inf)
    if not np.isfinite(score).any():
      room, score = np.repeat((used < J)[:, None], E, axis=1), share
    e = int(np.argmax(score))
    t = int(np.argmin(np.where(room[:, e], dev, np.inf)))
    extra[t, used[t]] = e
    holds[t, e] = True
    used[t] += 1
    cnt[e] += 1
  planned = np.concatenate([np.arange(E).reshape(N, L), extra], axis=1)
  cnt = np.bincount(planned.ravel(), minlength=E).astype(np.float32)
  after = np.max((load / cnt)[planned].sum(axis=1))
  before = np.max(load.reshape(N, L).sum(axis=1))
  away = planned[:, L:] // L != np.arange(N)[:, None]
  sent = np.bincount((planned[:, L:] // L)[away], minlength=N)
  moved = max(int(away.sum(axis=1).max()), int(sent.max()))
  if (before - after) / M > rows_per_moved * moved:
    return planned.reshape(-1)
  return step_home(E, N, planned.reshape(-1))


def fetch_bytes(case, phy2log):
  """{mode: bytes}: what the busiest device sends to fetch its slots' weights from their
  experts' owners (logical parameters), and, fwd_bwd, with the replicas' gradients sent
  back (trainable leaves only: quantized matrices are frozen)."""
  N = case.mesh.shape[EXPERT]
  S = len(phy2log)
  L, Ls = case.E // N, S // N
  experts = case.args[0].experts
  weights = grads = 0
  for leaf in jax.tree.leaves(experts, is_leaf=ms.quant.is_quantized):
    arrays = leaf.arrays() if ms.quant.is_quantized(leaf) else (leaf,)
    b = sum(int(np.prod(a.shape[1:])) * np.dtype(a.dtype).itemsize for a in arrays)
    weights += b
    grads += 0 if ms.quant.is_quantized(leaf) else b
  owner = np.asarray(phy2log) // L
  away = owner != np.arange(S) // Ls
  out_fwd = np.bincount(owner[away], minlength=N) * weights  # owners send the weights
  out_bwd = np.bincount((np.arange(S) // Ls)[away], minlength=N) * grads  # slots send back
  return {"fwd": float(out_fwd.max()), "fwd_bwd": float((out_fwd + out_bwd).max())}
