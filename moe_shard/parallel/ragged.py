"""`moe_ragged_all_to_all`: exact bytes with `lax.ragged_all_to_all` (emulated on CPU)."""

from __future__ import annotations

import dataclasses
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
from moe_shard.matmuls import GroupedMatmul, MaskedMatmul
from moe_shard.parallel.common import (
  _prepare,
  gather_weights,
  local_experts,
  one_expert_or_grouped,
  output_once,
  run_on_mesh,
)
from moe_shard.parallel.ragged_exchange import ragged_exchange
from moe_shard.parallel.replicas import check_dispatch_placement, slot_inputs
from moe_shard.placement import Placement
from moe_shard.quant import merge, split_frozen, zero_cotangent
from moe_shard.sharding import (
  EXPERT,
  axis_size,
  fori_while,
  resolve_mesh,
  vary_over,
  zeros_varying,
)

# --------------------------------------------------------------------------- ragged_all_to_all

RAGGED_SCOPE = "ragged_overflow_rounds"


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
  the next C_overflow positions, each with one
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
      later rounds C_overflow = C/4 rounded up to a multiple of 8; C at most N*T_dev*K,
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
    `invalid_ids` (i32[]: ids outside [0, E)), `capacity` and `capacity_overflow` (ints:
    C and C_overflow); with a placement, `slot_load` (i32[S]: items each slot computed).

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
  return y_TF, dict(stats, capacity=rows.first, capacity_overflow=rows.overflow)


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


@dataclasses.dataclass(frozen=True)
class _Ragged:
  """Static configuration of one ragged dispatch (hashable: a custom_vjp nondiff arg)."""

  axis: str
  local_experts: int  # L
  rows: plan_lib.Chunks  # receive-buffer rows of round 0, and of each later round
  gmm_impl: str
  tensor_axis: str | None  # expert tensor parallelism (`local_experts`)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class _Queues:
  """The (destination, expert) queues of one device, as sender and as receiver.

  Attributes:
    offset_NL: i32[N, L] sorted position of the queue this device sends expert l of n.
    count_NL: i32[N, L] its length.
    start_NL: i32[N, L] where it begins in device n's receive order.
    from_SL: i32[S, L] sorted position, at source s, of the queue it sends this device.
    recv_SL: i32[S, L] its length.
    rstart_SL: i32[S, L] where it begins in this device's receive order.
  """

  offset_NL: jax.Array
  count_NL: jax.Array
  start_NL: jax.Array
  from_SL: jax.Array
  recv_SL: jax.Array
  rstart_SL: jax.Array


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
  cfg = _Ragged(axis, lay.num_experts // N, rows, gmm_impl, lay.tensor_axis)
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
    q = _Queues(offset_NL, count_NL, start_NL, from_SL, recv_SL, rstart_SL)
    # Every device runs as many rounds as the fullest receive order on the mesh needs.
    received = jnp.sum(recv_SL)
    rounds = rows.rounds(jax.lax.pmax(received, lay.all_axes))
  with jax.named_scope("permute"):
    # Sorted by (destination, expert), invalid items last; moved by scatters both ways.
    x_ID, index = local.items_to_rows(x_TD, order_I, K)
  y_IF = _ragged_rounds(cfg, x_ID, ffn_L, q, rounds)
  with jax.named_scope("combine"):
    weights_TK = jnp.where(valid_I.reshape(T, K), weights_TK, 0.0)
    y_TF = local.rows_to_tokens(y_IF, index, weights_TK)
  stats = (
    dict(
      rounds=rounds.astype(jnp.int32),
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


def _ragged_round(cfg, x_ID, ffn_L, q, lo, C, y_IF=None):
  """One round: window [lo, lo + C) of every receive order, there and back.

  Args:
    cfg: `_Ragged`.
    x_ID: f[I, D] this device's items sorted by (destination, expert).
    ffn_L: the expert FFN of this device's L experts.
    q: `_Queues`.
    lo: the window's first position (traced ok).
    C: its rows (static).
    y_IF: f[I, F] to write the returned rows into (default None: zeros).

  Returns:
    y_IF with this round's outputs written at their items' sorted positions.
  """
  I = x_ID.shape[0]
  skip_NL, send_NL, at_NL = plan_lib.window(q.start_NL, q.count_NL, lo, C)
  rskip_SL, recv_SL, rat_SL = plan_lib.window(q.rstart_SL, q.recv_SL, lo, C)
  flat = lambda a: a.reshape(-1)
  rows = min(C, I)  # the most one device sends another in a round, either way
  exchange = functools.partial(ragged_exchange, axis=cfg.axis, rows_per_peer=rows)
  # Each device sends each (destination, expert) queue's part in this window, exactly, to
  # its place in the destination's buffer; rows arrive grouped by local expert.
  with jax.named_scope("dispatch"):
    recv_CD = exchange(
      x_ID,
      zeros_varying((C, x_ID.shape[1]), x_ID.dtype, x_ID),
      flat(q.offset_NL + skip_NL),
      flat(send_NL),
      flat(at_NL),
      flat(recv_SL),
    )
  with jax.named_scope("local_experts"):
    # The window's rows arrive expert-major from row 0; rows past the received are
    # padding (zeros in, zeros out: no bias).
    group_sizes_L = jnp.sum(recv_SL, axis=0)
    if cfg.tensor_axis is None:
      out_CF = one_expert_or_grouped(
        cfg.local_experts,
        cfg.gmm_impl,
        lambda r: ffn_L(r, MaskedMatmul(jnp.arange(C) < group_sizes_L[0], x_ID.dtype)),
        lambda r: ffn_L(r, GroupedMatmul(group_sizes_L, cfg.gmm_impl, x_ID.dtype)),
        recv_CD,
      )
    else:  # the rows of every tensor rank, each buffer expert-major: ids from the sizes
      ends_L = jnp.cumsum(group_sizes_L)
      ids_C = jnp.searchsorted(ends_L, jnp.arange(C, dtype=ends_L.dtype), side="right")
      out_CF = local_experts(
        recv_CD, ids_C.astype(jnp.int32), ffn_L, cfg.local_experts, cfg.gmm_impl, cfg.tensor_axis
      )
  # Each device returns the outputs to the sorted positions their items came from.
  with jax.named_scope("return"):
    if y_IF is None:
      y_IF = zeros_varying((I, out_CF.shape[1]), out_CF.dtype, out_CF)
    return exchange(
      out_CF, y_IF, flat(rat_SL), flat(recv_SL), flat(q.from_SL + rskip_SL), flat(send_NL)
    )


def _overflow_loop(rounds, step, acc):
  """Folds `step(r, acc)` over the overflow rounds r = 1 .. rounds - 1."""
  # Named so that the benchmark can scale the loop body by rounds - 1.
  with jax.named_scope(RAGGED_SCOPE):
    return fori_while(1, rounds, step, acc)


def _later_round(cfg, x_ID, ffn_L, q, r, y_IF=None):
  return _ragged_round(cfg, x_ID, ffn_L, q, cfg.rows.start(r), cfg.rows.overflow, y_IF)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _ragged_rounds(cfg, x_ID, ffn_L, q, rounds):
  """Every round of `_ragged_round`: f[I, F], each item's output at its sorted position.

  Round 0 (C rows) runs as plain JAX; the overflow rounds (C_overflow rows each), whose
  count is data-dependent, run in a `while_loop` that writes into round 0's output.
  Backward: round 0's vjp from the residuals its forward saved, then a loop that replays
  each overflow round's vjp and adds it into round 0's gradients in place.
  """
  y_IF = _ragged_round(cfg, x_ID, ffn_L, q, 0, cfg.rows.first)
  return _write_overflow(cfg, x_ID, ffn_L, q, rounds, y_IF)


def _write_overflow(cfg, x_ID, ffn_L, q, rounds, y_IF):
  """y_IF with the overflow rounds' outputs written at their items' sorted positions."""
  return _overflow_loop(rounds, lambda r, y: _later_round(cfg, x_ID, ffn_L, q, r, y), y_IF)


def _ragged_rounds_fwd(cfg, x_ID, ffn_L, q, rounds):
  # Differentiated in the trainable leaves only: quantized matrices are frozen.
  trainable, frozen, tree = split_frozen(ffn_L)
  y_IF, vjp0 = jax.vjp(
    lambda x, t: _ragged_round(cfg, x, merge(tree, t, frozen), q, 0, cfg.rows.first),
    x_ID,
    trainable,
  )
  return _write_overflow(cfg, x_ID, ffn_L, q, rounds, y_IF), (vjp0, x_ID, ffn_L, q, rounds)


def _ragged_rounds_bwd(cfg, res, dy_IF):
  vjp0, x_ID, ffn_L, q, rounds = res
  trainable, frozen, tree = split_frozen(ffn_L)

  def add(r, acc):
    _, vjp = jax.vjp(
      lambda x, t: _later_round(cfg, x, merge(tree, t, frozen), q, r), x_ID, trainable
    )
    return jax.tree.map(jnp.add, acc, vjp(dy_IF))

  dx, dtrainable = _overflow_loop(rounds, add, vjp0(dy_IF))
  return dx, merge(tree, dtrainable, zero_cotangent(frozen)), None, None


_ragged_rounds.defvjp(_ragged_rounds_fwd, _ragged_rounds_bwd)
