"""`moe_ragged_all_to_all`: exact bytes with `lax.ragged_all_to_all` (emulated on CPU)."""

from __future__ import annotations

import functools
from typing import Any, Literal, overload

import jax
import jax.numpy as jnp
from jax.sharding import AbstractMesh, Mesh
from jax.sharding import PartitionSpec as P
from jaxtyping import Array, Float, Int

from moe_shard import _checks, local
from moe_shard import plan as plan_lib
from moe_shard.experts import ExpertFFN
from moe_shard.parallel.common import (
  _prepare,
  gather_weights,
  output_once,
  run_on_mesh,
)
from moe_shard.parallel.ragged_rounds import Queues, Ragged, ragged_rounds
from moe_shard.parallel.replicas import check_dispatch_placement, slot_inputs
from moe_shard.placement import Placement
from moe_shard.sharding import (
  EXPERT,
  axis_size,
  resolve_mesh,
  vary_over,
)

# --------------------------------------------------------------------------- ragged_all_to_all


@overload
def moe_ragged_all_to_all(
  x_TD: Float[Array, "T D"],
  w: Float[Array, "E D F"] | ExpertFFN,
  experts: Int[Array, "T K"] | Int[Array, " T"],
  weights: Float[Array, "T K"] | Float[Array, " T"] | None = None,
  *,
  mesh: Mesh | AbstractMesh | None = None,
  expert_axis: str | tuple[str, ...] = EXPERT,
  recv_capacity: int | None = None,
  return_stats: Literal[False] = False,
  gmm_impl: str = "auto",
  expert_tensor_axis: str | None = None,
  expert_fsdp_axis: str | None = None,
  placement: Placement | None = None,
  slot_weights: bool = False,
) -> Float[Array, "T F"]: ...
@overload
def moe_ragged_all_to_all(
  x_TD: Float[Array, "T D"],
  w: Float[Array, "E D F"] | ExpertFFN,
  experts: Int[Array, "T K"] | Int[Array, " T"],
  weights: Float[Array, "T K"] | Float[Array, " T"] | None = None,
  *,
  mesh: Mesh | AbstractMesh | None = None,
  expert_axis: str | tuple[str, ...] = EXPERT,
  recv_capacity: int | None = None,
  return_stats: Literal[True],
  gmm_impl: str = "auto",
  expert_tensor_axis: str | None = None,
  expert_fsdp_axis: str | None = None,
  placement: Placement | None = None,
  slot_weights: bool = False,
) -> tuple[Float[Array, "T F"], dict[str, Any]]: ...
def moe_ragged_all_to_all(
  x_TD: Float[Array, "T D"],
  w: Float[Array, "E D F"] | ExpertFFN,
  experts: Int[Array, "T K"] | Int[Array, " T"],
  weights: Float[Array, "T K"] | Float[Array, " T"] | None = None,
  *,
  mesh: Mesh | AbstractMesh | None = None,
  expert_axis: str | tuple[str, ...] = EXPERT,
  recv_capacity: int | None = None,
  return_stats: bool = False,
  gmm_impl: str = "auto",
  expert_tensor_axis: str | None = None,
  expert_fsdp_axis: str | None = None,
  placement: Placement | None = None,
  slot_weights: bool = False,
) -> Float[Array, "T F"] | tuple[Float[Array, "T F"], dict[str, Any]]:
  """Expert-parallel MoE: dropless `ragged_all_to_all` dispatch, compute, and return.

  Each device sorts its T*K (token, slot) items by expert (so by destination device, then
  local expert). A small `all_gather` tells every device how many items each source sends
  each of the L = E / N local experts of every device; each device lays out what it will
  receive expert-major (all sources' items for local expert 0, then expert 1, ...), and
  where its own queues fall in the others' layouts, with no second exchange. Round 0 moves
  positions [0, C) of every device's layout into its C-row receive buffer, each later round
  the next positions (C of them, the last round a quarter of C: `plan.Rows`), each with one
  `ragged_all_to_all` that sends each (source, destination, expert) queue exactly: no
  padding on the wire. The rows arrive grouped by local expert, the grouped matmul runs on
  them, and a second `ragged_all_to_all` returns the outputs to the sorted positions they
  came from; the combine with the weights follows the last round. Round 0 runs outside any
  loop; while some device has more to receive, a `while_loop` runs further rounds (count
  from a `pmax`, no host sync) that write into round 0's output. One `custom_vjp`
  differentiates them: round 0's vjp from its saved residuals (through the primitive's own
  transpose), then a loop that replays each later round's exchange reversed and adds its
  gradient into round 0's in place.

  On a mesh whose expert axis has one device (and no `expert_tensor_axis`), every device
  holds all E experts and nothing is exchanged: its items take `moe_ragged_dot`'s path in
  one round, and `recv_capacity` does not apply (the stats' `capacity` is then the plan's,
  unused).

  On platforms whose XLA has no ragged-all-to-all (CPU), the exchange is an emulation with
  the same semantics built from `lax.all_to_all` of padded buffers
  (`ragged_all_to_all_emulated`): the same results, but padded traffic.

  Args:
    x_TD: f[T, D] tokens (global shape; split over every mesh axis inside).
    w: f[E, D, F], or an expert-FFN pytree with the expert axis first (split over
      `expert_axis`, replicated over the other axes).
    experts: int[T] or int[T, K] expert ids; ids outside [0, E) contribute zero.
    weights: f[T, K] combine weights (the shape of `experts`), or None for ones (default).
    mesh: a `jax.sharding.Mesh` with `expert_axis`; Auto or Explicit axis types. None
      (default): the mesh in scope (`jax.set_mesh`).
    expert_axis: name of the mesh axis experts are split over (default "expert").
    recv_capacity: rows of the receive buffer per device and round (not the routing
      capacity: no item is dropped, items past it go in a later round). None (default):
      round 0 takes C = the expected load T_dev*K plus 4 * sqrt of it (4 standard
      deviations of uniform random routing), rounded up to a multiple of 8 (from 4096
      rows, of 512: 1.0625x at T_dev*K = 8192), so uniform routing takes one round, and
      later rounds as many, the last of them a quarter of C (`plan.Rows`: few rounds, each
      of which re-reads the weights); C at most N*T_dev*K,
      the most a device can receive, and that when it is at most `plan.DECODE_ROWS` rows
      (one round whatever the routing) (`plan.default_capacity`); an int C >= 1: C in
      every round.
    return_stats: also return a dict of dispatch statistics (default False).
    gmm_impl: `grouped_matmul` implementation (default "auto").
    expert_tensor_axis: None (default) or a mesh axis splitting every F (hidden) dimension
      of `w` (`MoEConfig.expert_tensor_axis`): the rows a device receives are all-gathered
      over it, and the partial outputs reduce-scattered before the return trip.
    expert_fsdp_axis: None (default) or a mesh axis splitting the last dimension of every
      matrix of `w` (`MoEConfig.expert_fsdp_axis`): all-gathered once per call, before the
      rounds.
    placement: None (default) or a one-layer `Placement` of the E experts over S slots:
      each item goes to a replica of its expert (`replica_rule.choose_replicas`: one on its
      own device first, else spread evenly), and the dispatch runs over the slots, S / N a
      device. `w` holds the E logical experts, whose slots' weights are fetched from their
      owners inside the call (their gradients summed back), or, with `slot_weights`, the
      S slots (`replicate_experts`).
    slot_weights: whether `w` holds the placement's slots (default False).

  Returns:
    y_TF: f[T, F] in the dtype of `x_TD`; with `return_stats`, `(y_TF, stats)` where stats
    holds `rounds` (i32[]), `sent_items` and `received_items` (i32[devices]: valid items
    each device sends and receives, itself included), `expert_load` (i32[E]),
    `invalid_ids` (i32[]: ids outside [0, E)), `capacity`, `capacity_overflow` and
    `capacity_last` (ints: the rows of round 0, of each big overflow round and of the last,
    small one); with a placement, `slot_load` (i32[S]: items each slot computed).

  Raises:
    TypeError, ValueError: bad arguments, no mesh (none given and none in scope), or E not
      divisible by the expert-axis size.
  """
  fn = "moe_ragged_all_to_all"
  expert_axis = _checks.expert_axis_field(fn, expert_axis)
  mesh = resolve_mesh(fn, mesh, expert_axis, required=True)
  if recv_capacity is not None:
    recv_capacity = _checks.int_field(fn, "recv_capacity", recv_capacity, 1)
  placement, grad_rows = check_dispatch_placement(fn, placement, w, mesh, expert_axis, slot_weights)
  out = _ragged_jit(
    x_TD,
    w,
    experts,
    weights,
    mesh=mesh,
    expert_axis=expert_axis,
    recv_capacity=recv_capacity,
    return_stats=bool(return_stats),
    gmm_impl=gmm_impl,
    tensor_axis=expert_tensor_axis,
    fsdp_axis=expert_fsdp_axis,
    placement=placement,
    slot_weights=bool(slot_weights),
    grad_rows=grad_rows,
  )
  if not return_stats:
    return out
  y_TF, stats = out
  T, K = jnp.shape(x_TD)[0], (jnp.shape(experts) + (1,))[1]
  N = axis_size(mesh, expert_axis)
  E = jax.tree.leaves(w)[0].shape[0] if placement is None else placement.num_slots
  rows = plan_lib.default_capacity(-(-T // mesh.size), K, recv_capacity, N, E // N)
  return y_TF, dict(stats, capacity=rows.first, capacity_overflow=rows.big, capacity_last=rows.last)


@functools.partial(
  jax.jit,
  static_argnames=(
    "mesh",
    "expert_axis",
    "recv_capacity",
    "return_stats",
    "gmm_impl",
    "tensor_axis",
    "fsdp_axis",
    "slot_weights",
    "grad_rows",
  ),
)
def _ragged_jit(
  x_TD,
  w,
  experts,
  weights,
  *,
  mesh,
  expert_axis,
  recv_capacity,
  return_stats,
  gmm_impl,
  tensor_axis,
  fsdp_axis,
  placement,
  slot_weights,
  grad_rows,
):
  lay, x_TD, ffn, experts_TK, weights_TK = _prepare(
    "moe_ragged_all_to_all", x_TD, w, experts, weights, mesh, expert_axis, tensor_axis, fsdp_axis
  )
  K = experts_TK.shape[1]
  E = lay.num_experts if placement is None else placement.num_slots
  rows = plan_lib.default_capacity(lay.padded // mesh.size, K, recv_capacity, lay.n, E // lay.n)
  body = functools.partial(
    _ragged_body,
    lay=lay,
    rows=rows,
    gmm_impl=gmm_impl,
    slot_weights=slot_weights,
    grad_rows=grad_rows,
  )
  tok = lay.token_spec
  stats_specs = dict(
    rounds=P(), sent_items=tok, received_items=tok, expert_load=P(), invalid_ids=P()
  )
  return run_on_mesh(
    body, lay, x_TD, ffn, experts_TK, weights_TK, stats_specs, return_stats, placement
  )


def _ragged_body(
  x_TD, ffn_L, experts_TK, weights_TK, *placement, lay, rows, gmm_impl, slot_weights, grad_rows
):
  # Per-device sizes: T tokens of this device, K slots, I = T*K items, L local experts,
  # N (= S) devices on the expert axis, C rows of a receive buffer. With a placement the
  # experts are its slots (E = S, L = S / N here) and the ids slot ids.
  extra = {}
  if placement:
    lay, ffn_L, experts_TK, extra = slot_inputs(
      lay, placement[0], ffn_L, experts_TK, slot_weights=slot_weights, grad_rows=grad_rows
    )
  axis, N = lay.expert_axis, lay.n
  ffn_L = vary_over(
    output_once(gather_weights(ffn_L, lay.fsdp_axis), lay.tensor_axis), lay.other_axes
  )
  if N == 1 and lay.tensor_axis is None:
    y_TF, stats = _one_device_body(x_TD, ffn_L, experts_TK, weights_TK, lay=lay, gmm_impl=gmm_impl)
    return y_TF, stats | extra
  cfg = Ragged(axis, lay.num_experts // N, rows, gmm_impl, lay.tensor_axis)
  T, K = experts_TK.shape
  with jax.named_scope("plan"):
    order_I, load_E, valid_I = local.sort_by_expert(experts_TK.reshape(-1), lay.num_experts)
    count_NL = load_E.reshape(N, cfg.local_experts)
    offset_NL = (jnp.cumsum(load_E) - load_E).reshape(N, -1).astype(jnp.int32)
    # Every device learns every queue's length and sorted position at its source, in one
    # collective (at decode its latency, not its few bytes, is the cost): each device then
    # lays out every receive order itself, its own and the ones its queues go into.
    offset_SNL, count_SNL = jax.lax.all_gather(jnp.stack([offset_NL, count_NL]), axis, axis=1)
    me = jax.lax.axis_index(axis)
    from_SL, recv_SL = offset_SNL[:, me], count_SNL[:, me]
    rstart_NSL = jax.vmap(plan_lib.receive_starts, in_axes=1)(count_SNL)
    rstart_SL, start_NL = rstart_NSL[me], rstart_NSL[:, me]
    q = Queues(offset_NL, count_NL, start_NL, from_SL, recv_SL, rstart_SL)
    # Every device runs as many rounds as the fullest receive order on the mesh needs.
    received = jnp.sum(recv_SL)
    rounds = rows.rounds(jax.lax.pmax(received, lay.all_axes))
  with jax.named_scope("permute"):
    # Sorted by (destination, expert), invalid items last; moved by scatters both ways.
    x_ID, index = local.items_to_rows(x_TD, order_I, K)
  y_IF = ragged_rounds(cfg, x_ID, ffn_L, q, rounds)
  with jax.named_scope("combine"):
    weights_TK = jnp.where(valid_I.reshape(T, K), weights_TK, 0.0)
    y_TF = local.rows_to_tokens(y_IF, index, weights_TK)
  stats = (
    dict(
      rounds=(1 + rounds[0] + rounds[1]).astype(jnp.int32),
      sent_items=jnp.sum(count_NL)[None].astype(jnp.int32),
      received_items=received[None].astype(jnp.int32),
      expert_load=jax.lax.psum(load_E, lay.all_axes),
      invalid_ids=jax.lax.psum(jnp.sum(~valid_I).astype(jnp.int32), lay.all_axes),
    )
    | extra
  )  # with a placement: the logical expert_load, and slot_load
  return y_TF.astype(x_TD.dtype), stats


def _one_device_body(x_TD, ffn, experts_TK, weights_TK, *, lay, gmm_impl):
  """A one-device expert axis: this device holds every expert and has nothing to exchange.
  Its items run through `moe_ragged_dot`'s body, in one round whatever the capacity: no
  receive buffer, no second sort by local expert, no exchange."""
  E = lay.num_experts
  _, load_E, valid_I = local.sort_by_expert(experts_TK.reshape(-1), E)
  y_TF = local.ragged_combine(x_TD, ffn, E, experts_TK, weights_TK, gmm_impl)
  items = jnp.sum(load_E)[None].astype(jnp.int32)
  stats = dict(
    rounds=jnp.int32(1),
    sent_items=items,
    received_items=items,
    expert_load=jax.lax.psum(load_E, lay.all_axes),
    invalid_ids=jax.lax.psum(jnp.sum(~valid_I).astype(jnp.int32), lay.all_axes),
  )
  return y_TF.astype(x_TD.dtype), stats
