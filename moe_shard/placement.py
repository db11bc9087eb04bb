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
builds the other two from phy2log. This module holds the `Placement` and its checks;
`planning` plans one on the host from a load per expert (`plan_placement`), and
`replica_rule` is what the layer does with one on device (which replica an item takes,
the per-step plan).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.core
import numpy as np

from moe_shard import _checks


def concrete(a):
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
    what = np.asarray(p).tolist() if concrete(p) and p.size <= 64 else f"{p.dtype}{p.shape}"
    return f"Placement(S={self.num_slots}, E={self.num_experts}, phy2log={what})"


def _array_data(a):
  """Whether `a` is concrete array data (NumPy, a concrete jax.Array, nested lists, or
  anything NumPy converts, such as the torch tensors EPLB returns)."""
  if isinstance(a, (np.ndarray, list, tuple)):
    return True
  if isinstance(a, jax.Array):
    return concrete(a)
  return hasattr(a, "__array__")


def _validate(placement):
  """Converts a placement's concrete arrays to int32 NumPy and checks that they agree."""
  fn = "Placement"
  for name in ("phy2log", "log2phy", "logcnt"):
    a = np.asarray(getattr(placement, name))
    if not np.issubdtype(a.dtype, np.integer):
      raise TypeError(f"{fn}: {name} must have an integer dtype (got {a.dtype})")
    low, high = np.iinfo(np.int32).min, np.iinfo(np.int32).max
    if a.size and (a.min() < low or a.max() > high):  # checked before the cast wraps it
      bad = a.max() if a.max() > high else a.min()
      raise ValueError(f"{fn}: {name} must hold int32 values (got {bad} in a {a.dtype} array)")
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
