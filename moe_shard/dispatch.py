"""The dispatch table: how tokens reach their experts and come back.

A dispatch is a function

    dispatch(x_TD, ffn, experts_TK, weights_TK, *, mesh, cfg) -> (y_TD, stats)

  x_TD: f[T, D] tokens (the compute dtype); ffn: the expert FFN, expert axis first;
  experts_TK: i32[T, K] expert ids (outside [0, E): contributes zero); weights_TK: f32[T, K];
  mesh: a `jax.sharding.Mesh` or None; cfg: the `MoEConfig`.
  y_TD: f[T, F] = sum_j weights[t, j] * ffn(experts[t, j], x[t]); stats: a dict of
  dispatch statistics (possibly empty), merged into the layer's `aux`.

Given a placement (`moe_layer(..., placement=...)`), the layer calls it with two more
keywords: `placement` (a one-layer `Placement`: experts_TK stay logical ids, each item goes
to a replica, `replica_rule.choose_replicas`) and `slot_weights` (whether `ffn` holds the
placement's S slots, slot-major, or the E logical experts); its stats then hold
`slot_load` (i32[S], items each slot computed).

`DISPATCHES` maps a name to a `Dispatch` (the function and whether it needs a mesh);
`MoEConfig(impl=...)` takes a name from it or any function of the signature above. A new
dispatch is one function and one entry.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
from collections.abc import Callable
from typing import Any

from jax.sharding import PartitionSpec as P
from jaxtyping import Array, Float

from moe_shard import local, parallel, replica_rule
from moe_shard.balance import expert_load
from moe_shard.sharding import auto, data_rows, expert_positions

# A dispatch function: (x_TD, ffn, experts_TK, weights_TK, *, mesh, cfg) -> (y_TF, stats).
DispatchFn = Callable[..., tuple[Float[Array, "T F"], dict[str, Any]]]


def masked_scan(
  x_TD, ffn, experts_TK, weights_TK, *, mesh, cfg, placement=None, slot_weights=False
):
  """`moe_masked_scan` (XLA shards it as it likes on a mesh)."""
  experts_TK, stats = _local_slots(experts_TK, mesh, cfg, placement, slot_weights)
  fn = auto(local.moe_masked_scan, x_TD, lambda spec: spec)
  return fn(x_TD, ffn, experts_TK, weights_TK), stats


def ragged_dot(x_TD, ffn, experts_TK, weights_TK, *, mesh, cfg, placement=None, slot_weights=False):
  """`moe_ragged_dot` with `cfg.gmm_impl` (XLA shards it as it likes on a mesh; on TPU only
  with gmm_impl="ragged_dot": XLA cannot partition megablox's Pallas kernel)."""
  experts_TK, stats = _local_slots(experts_TK, mesh, cfg, placement, slot_weights)
  fn = auto(functools.partial(local.moe_ragged_dot, gmm_impl=cfg.gmm_impl), x_TD, lambda spec: spec)
  return fn(x_TD, ffn, experts_TK, weights_TK), stats


def _local_slots(experts_TK, mesh, cfg, placement, slot_weights):
  """A local dispatch's ids and stats under a placement: each item's slot as the mesh's
  devices would pick it (`replica_rule.assign_slots`), counted in `slot_load`; the ids become
  the slots when the weights are slot-major, else stay logical (the local dispatches hold
  every expert: the placement changes where the rows would go, not the result)."""
  if placement is None:
    return experts_TK, {}
  T = experts_TK.shape[0]
  positions = rows = None
  if mesh is not None and T % mesh.size == 0:
    positions = expert_positions(mesh, cfg.expert_axis)
    rows = data_rows(mesh, cfg.expert_axis)

  def slots_and_load(e, placement):
    slots = replica_rule.assign_slots(e, placement, positions, rows)
    return slots, expert_load(slots, placement.num_slots)

  # The placement an argument, not closed over: a traced one (made inside jit) has Explicit
  # axes, which the Auto context of `auto` must convert.
  fn = auto(slots_and_load, experts_TK, lambda spec: (spec, P()))
  slots_TK, load_S = fn(experts_TK, placement)
  return (slots_TK if slot_weights else experts_TK), dict(slot_load=load_S)


def all_gather(x_TD, ffn, experts_TK, weights_TK, *, mesh, cfg, placement=None, slot_weights=False):
  """`moe_all_gather` over `cfg.expert_axis`; with a placement, stats: slot_load (the
  replica rule's count on the tokens as the mesh splits them)."""
  y_TF, stats = parallel.moe_all_gather(
    x_TD,
    ffn,
    experts_TK,
    weights_TK,
    mesh=mesh,
    expert_axis=cfg.expert_axis,
    gmm_impl=cfg.gmm_impl,
    expert_tensor_axis=cfg.expert_tensor_axis,
    expert_fsdp_axis=cfg.expert_fsdp_axis,
    placement=placement,
    slot_weights=slot_weights,
    return_stats=True,
  )
  return y_TF, ({} if placement is None else dict(slot_load=stats["slot_load"]))


def all_to_all(x_TD, ffn, experts_TK, weights_TK, *, mesh, cfg, placement=None, slot_weights=False):
  """`moe_all_to_all` over `cfg.expert_axis`; stats: rounds, items sent, invalid ids."""
  return parallel.moe_all_to_all(
    x_TD,
    ffn,
    experts_TK,
    weights_TK,
    mesh=mesh,
    expert_axis=cfg.expert_axis,
    chunk_size=cfg.chunk_size,
    return_stats=True,
    gmm_impl=cfg.gmm_impl,
    expert_tensor_axis=cfg.expert_tensor_axis,
    expert_fsdp_axis=cfg.expert_fsdp_axis,
    placement=placement,
    slot_weights=slot_weights,
  )


def ragged_all_to_all(
  x_TD, ffn, experts_TK, weights_TK, *, mesh, cfg, placement=None, slot_weights=False
):
  """`moe_ragged_all_to_all` over `cfg.expert_axis` (receive buffer `cfg.recv_capacity`);
  stats: rounds, items sent and received, invalid ids."""
  return parallel.moe_ragged_all_to_all(
    x_TD,
    ffn,
    experts_TK,
    weights_TK,
    mesh=mesh,
    expert_axis=cfg.expert_axis,
    recv_capacity=cfg.recv_capacity,
    return_stats=True,
    gmm_impl=cfg.gmm_impl,
    expert_tensor_axis=cfg.expert_tensor_axis,
    expert_fsdp_axis=cfg.expert_fsdp_axis,
    placement=placement,
    slot_weights=slot_weights,
  )


@dataclasses.dataclass(frozen=True)
class Dispatch:
  """An entry of the dispatch table.

  Attributes:
    fn: the dispatch function (signature in the module docstring).
    needs_mesh: it splits experts over the mesh's expert axis (a mesh is required).
  """

  fn: DispatchFn
  needs_mesh: bool = False


DISPATCHES: dict[str, Dispatch] = {
  "masked_scan": Dispatch(masked_scan),
  "ragged_dot": Dispatch(ragged_dot),
  "all_gather": Dispatch(all_gather, needs_mesh=True),
  "all_to_all": Dispatch(all_to_all, needs_mesh=True),
  "ragged_all_to_all": Dispatch(ragged_all_to_all, needs_mesh=True),
}


def check_placement_keywords(fn: str, dispatch: DispatchFn) -> None:
  """Raises unless `dispatch` takes the keywords the layer adds with a placement
  (`placement`, `slot_weights`; or `**kwargs`)."""
  try:
    params = inspect.signature(dispatch).parameters
  except (TypeError, ValueError):  # no signature to read (a builtin): it will tell
    return
  if any(p.kind == inspect.Parameter.VAR_KEYWORD for p in params.values()):
    return
  missing = [k for k in ("placement", "slot_weights") if k not in params]
  if missing:
    name = getattr(dispatch, "__name__", type(dispatch).__name__)
    raise TypeError(
      f"{fn}: with a placement the layer calls the dispatch with placement= and "
      f"slot_weights= and reads stats['slot_load'] (docs/guides/dispatch.md); impl {name!r} "
      f"takes no {' or '.join(missing)}"
    )


def get_dispatch(impl: str | DispatchFn) -> Dispatch:
  """The `Dispatch` of a resolved impl: a table entry, or a user's function (no mesh rule)."""
  return DISPATCHES[impl] if isinstance(impl, str) else Dispatch(impl)
