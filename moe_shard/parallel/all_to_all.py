"""`moe_all_to_all`: the dropless chunked all_to_all dispatch, in rounds."""

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
from moe_shard.balance import expert_load
from moe_shard.experts import ExpertFFN
from moe_shard.frozen import merge, split_frozen, zero_cotangent
from moe_shard.parallel.common import (
  _prepare,
  gather_weights,
  local_experts,
  output_once,
  run_on_mesh,
)
from moe_shard.parallel.replicas import check_dispatch_placement, slot_inputs
from moe_shard.placement import Placement
from moe_shard.sharding import EXPERT, axis_size, fori_while, resolve_mesh, vary_over

OVERFLOW_SCOPE = "a2a_overflow_rounds"


# --------------------------------------------------------------------------- all_to_all


@overload
def moe_all_to_all(
  x_TD: Float[Array, "T D"],
  w: Float[Array, "E D F"] | ExpertFFN,
  experts: Int[Array, "T K"] | Int[Array, " T"],
  weights: Float[Array, "T K"] | Float[Array, " T"] | None = None,
  *,
  mesh: Mesh | AbstractMesh | None = None,
  expert_axis: str | tuple[str, ...] = EXPERT,
  chunk_size: int | tuple[int, int] | None = None,
  return_stats: Literal[False] = False,
  gmm_impl: str = "auto",
  expert_tensor_axis: str | None = None,
  expert_fsdp_axis: str | None = None,
  placement: Placement | None = None,
  slot_weights: bool = False,
) -> Float[Array, "T F"]: ...
@overload
def moe_all_to_all(
  x_TD: Float[Array, "T D"],
  w: Float[Array, "E D F"] | ExpertFFN,
  experts: Int[Array, "T K"] | Int[Array, " T"],
  weights: Float[Array, "T K"] | Float[Array, " T"] | None = None,
  *,
  mesh: Mesh | AbstractMesh | None = None,
  expert_axis: str | tuple[str, ...] = EXPERT,
  chunk_size: int | tuple[int, int] | None = None,
  return_stats: Literal[True],
  gmm_impl: str = "auto",
  expert_tensor_axis: str | None = None,
  expert_fsdp_axis: str | None = None,
  placement: Placement | None = None,
  slot_weights: bool = False,
) -> tuple[Float[Array, "T F"], dict[str, Any]]: ...
def moe_all_to_all(
  x_TD: Float[Array, "T D"],
  w: Float[Array, "E D F"] | ExpertFFN,
  experts: Int[Array, "T K"] | Int[Array, " T"],
  weights: Float[Array, "T K"] | Float[Array, " T"] | None = None,
  *,
  mesh: Mesh | AbstractMesh | None = None,
  expert_axis: str | tuple[str, ...] = EXPERT,
  chunk_size: int | tuple[int, int] | None = None,
  return_stats: bool = False,
  gmm_impl: str = "auto",
  expert_tensor_axis: str | None = None,
  expert_fsdp_axis: str | None = None,
  placement: Placement | None = None,
  slot_weights: bool = False,
) -> Float[Array, "T F"] | tuple[Float[Array, "T F"], dict[str, Any]]:
  """Expert-parallel MoE: dropless chunked all_to_all dispatch, compute, and return.

  Each device sorts its T*K (token, slot) items by destination device. Round 0 sends the
  first C_first items of every (source, destination) queue with one `lax.all_to_all`
  (`[N, C, D]` per device), the receiver runs its L = E / N experts on them through the
  grouped matmul, and a second `all_to_all` brings the outputs back, where they are
  combined with the weights. A `while_loop` runs overflow rounds of C_overflow items until
  the busiest queue on the mesh is empty; the count is computed on device (no host sync,
  no dropped token). Buffers are per round, never `[N, T, D]`.

  Backward (one `custom_vjp`): round 0's vjp from the residuals its forward saved (no
  recompute), then a loop that replays each overflow round (a loop of data-dependent length
  keeps no residuals) and adds its gradient into round 0's in place: each round's gradient
  is the same dispatch reversed.

  Args:
    x_TD: f[T, D] tokens (global shape; split over every mesh axis inside).
    w: f[E, D, F], or an expert-FFN pytree with the expert axis first (split over
      `expert_axis`, replicated over the other axes).
    experts: int[T] or int[T, K] expert ids; ids outside [0, E) contribute zero.
    weights: f[T, K] combine weights (the shape of `experts`), or None for ones (default).
    mesh: a `jax.sharding.Mesh` with `expert_axis`; Auto or Explicit axis types. Inputs are
      placed (resharded) on it as needed. An `AbstractMesh` works under `jax.jit` with
      inputs already on the mesh, and under `jax.eval_shape`. None (default): the mesh in
      scope (`jax.set_mesh(mesh)`); without one, ValueError.
    expert_axis: name of the mesh axis experts are split over (default "expert"), or a
      tuple of names: experts split over the product of their sizes, in the order given.
    chunk_size: None (default): C_first = the expected (source, destination) load
      T_dev*K/N plus 4 * sqrt of it (4 standard deviations of uniform random routing),
      rounded up to a multiple of 8, and C_overflow = C_first, so uniform routing takes one
      round (at T_dev*K/N = 1024, 12.5% padding) and skew few extra ones; C_first at most T_dev*K, the most a pair can carry, and
      that when N of it is at most `plan.DECODE_ROWS` rows (one round whatever the
      routing) (`plan.default_chunks`). An int C uses C for every round; a pair
      (C_first, C_overflow) sets both.
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
    holds `rounds` (i32[]), `sent_items` and `sent_slots` (i32[devices]: valid items and
    all slots, padding included, sent per device; self included), `expert_load` (i32[E]),
    `invalid_ids` (i32[]: ids outside [0, E)), `chunk_first` and `chunk_overflow` (ints);
    with a placement, `slot_load` (i32[S]: items each slot computed).

  Raises:
    TypeError, ValueError: bad arguments, no mesh (none given and none in scope), or E not
      divisible by the expert-axis size.
  """
  expert_axis = _checks.expert_axis_field("moe_all_to_all", expert_axis)
  mesh = resolve_mesh("moe_all_to_all", mesh, expert_axis, required=True)
  chunk_size = _checks.chunk_size_field("moe_all_to_all", chunk_size)
  placement, grad_rows = check_dispatch_placement(
    "moe_all_to_all", placement, w, mesh, expert_axis, slot_weights
  )
  out = _all_to_all_jit(
    x_TD,
    w,
    experts,
    weights,
    mesh=mesh,
    expert_axis=expert_axis,
    chunk_size=chunk_size,
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
  chunks = plan_lib.default_chunks(-(-T // mesh.size), K, axis_size(mesh, expert_axis), chunk_size)
  return y_TF, dict(stats, chunk_first=chunks.first, chunk_overflow=chunks.overflow)


@functools.partial(
  jax.jit,
  static_argnames=(
    "mesh",
    "expert_axis",
    "chunk_size",
    "return_stats",
    "gmm_impl",
    "tensor_axis",
    "fsdp_axis",
    "slot_weights",
    "grad_rows",
  ),
)
def _all_to_all_jit(
  x_TD,
  w,
  experts,
  weights,
  *,
  mesh,
  expert_axis,
  chunk_size,
  return_stats,
  gmm_impl,
  tensor_axis,
  fsdp_axis,
  placement,
  slot_weights,
  grad_rows,
):
  # Jitted so that a call outside jit does not run the shard_map body op by op.
  lay, x_TD, ffn, experts_TK, weights_TK = _prepare(
    "moe_all_to_all", x_TD, w, experts, weights, mesh, expert_axis, tensor_axis, fsdp_axis
  )
  chunks = plan_lib.default_chunks(lay.padded // mesh.size, experts_TK.shape[1], lay.n, chunk_size)
  body = functools.partial(
    _all_to_all_body,
    lay=lay,
    chunks=chunks,
    gmm_impl=gmm_impl,
    slot_weights=slot_weights,
    grad_rows=grad_rows,
  )
  tok = lay.token_spec
  stats_specs = dict(rounds=P(), sent_items=tok, sent_slots=tok, expert_load=P(), invalid_ids=P())
  return run_on_mesh(
    body, lay, x_TD, ffn, experts_TK, weights_TK, stats_specs, return_stats, placement
  )


@dataclasses.dataclass(frozen=True)
class _A2A:
  """Static configuration of one all_to_all dispatch (hashable: a custom_vjp nondiff arg)."""

  axis: str | tuple[str, ...]
  n: int  # N devices on the expert axis (the product of a tuple's)
  local_experts: int  # L
  chunks: plan_lib.Chunks
  gmm_impl: str
  tensor_axis: str | None  # expert tensor parallelism (`local_experts`)


def _all_to_all_body(
  x_TD, ffn_L, experts_TK, weights_TK, *placement, lay, chunks, gmm_impl, slot_weights, grad_rows
):
  # Per-device sizes: T tokens of this device, K slots, L = E / N local experts (with a
  # placement: E = S slots, L = S / N of them here, and the ids are slots).
  extra = {}
  if placement:
    lay, ffn_L, experts_TK, extra = slot_inputs(
      lay, placement[0], ffn_L, experts_TK, slot_weights=slot_weights, grad_rows=grad_rows
    )
  cfg = _A2A(lay.expert_axis, lay.n, lay.num_experts // lay.n, chunks, gmm_impl, lay.tensor_axis)
  with jax.named_scope("plan"):
    plan = plan_lib.send_plan(experts_TK, lay.num_experts, lay.n)
    local_I = experts_TK.reshape(-1) % cfg.local_experts  # local expert id at the receiver
    # Every device runs as many rounds as the busiest queue on the whole mesh needs.
    rounds = chunks.rounds(jax.lax.pmax(jnp.max(plan.count_N), lay.all_axes))
  ffn_L = vary_over(
    output_once(gather_weights(ffn_L, lay.fsdp_axis), lay.tensor_axis), lay.other_axes
  )
  y_TF = _rounds(cfg, x_TD, ffn_L, weights_TK, plan, local_I, rounds)
  sent = jnp.sum(plan.count_N)
  stats = (
    dict(
      rounds=rounds.astype(jnp.int32),
      sent_items=sent[None],
      sent_slots=(cfg.n * (chunks.first + (rounds - 1) * chunks.overflow))[None].astype(jnp.int32),
      expert_load=jax.lax.psum(expert_load(experts_TK, lay.num_experts), lay.all_axes),
      invalid_ids=jax.lax.psum(jnp.sum(~plan.valid_I).astype(jnp.int32), lay.all_axes),
    )
    | extra
  )  # with a placement: the logical expert_load, and slot_load
  # JAX types a custom_vjp made with functools.partial as returning object.
  return y_TF.astype(x_TD.dtype), stats  # pyright: ignore[reportAttributeAccessIssue]


def _round(cfg, x_TD, ffn_L, weights_TK, slots_NC, local_I):
  """One round: send the items of `slots_NC`, run the local experts, return, combine.

  Args:
    cfg: `_A2A`.
    x_TD: f[T, D] this device's tokens.
    ffn_L: the expert FFN of this device's L experts.
    weights_TK: f32[T, K] combine weights.
    slots_NC: i32[N, C] item (t * K + j) in each (destination, slot), -1 for padding.
    local_I: i32[T * K] local expert id of each item at its destination.

  Returns:
    f32[T, F] this round's contribution to the output.
  """
  K = weights_TK.shape[1]
  N, C = slots_NC.shape
  live_NC = slots_NC >= 0
  # Rows move by scatters both ways (`local.items_to_rows`); padding slots are zeros.
  send_SD, index = local.items_to_rows(x_TD, slots_NC.reshape(-1), K)
  send_NCD = send_SD.reshape(N, C, -1)
  ids_NC = jnp.where(live_NC, local_I[jnp.maximum(slots_NC, 0)], cfg.local_experts)
  # Each device sends row n of its buffers to device n and receives, from every device s,
  # the items s routes to the experts of this device.
  with jax.named_scope("dispatch"):
    recv_NCD = jax.lax.all_to_all(send_NCD, cfg.axis, 0, 0, tiled=True)
    rids_NC = jax.lax.all_to_all(ids_NC, cfg.axis, 0, 0, tiled=True)
  with jax.named_scope("local_experts"):
    out_NCF = local_experts(
      recv_NCD.reshape(N * C, -1),
      rids_NC.reshape(-1),
      ffn_L,
      cfg.local_experts,
      cfg.gmm_impl,
      cfg.tensor_axis,
    )
    out_NCF = out_NCF.reshape(N, C, -1).astype(x_TD.dtype)
  # Each device returns the outputs to the devices the items came from.
  with jax.named_scope("return"):
    back_NCF = jax.lax.all_to_all(out_NCF, cfg.axis, 0, 0, tiled=True)
  with jax.named_scope("combine"):
    # Each item's output (items of other rounds: none), weighted and summed over K.
    return local.rows_to_tokens(back_NCF.reshape(N * C, -1), index, weights_TK)


def _loop_overflow(cfg, plan, rounds, step, acc):
  """Folds `step(acc, slots_NC)` over the overflow rounds 1 .. rounds - 1 (C_overflow)."""

  def body(r, acc):
    return step(acc, plan_lib.round_slots(plan, cfg.chunks.start(r), cfg.chunks.overflow))

  # Named so that the benchmark can scale the loop body by rounds - 1.
  with jax.named_scope(OVERFLOW_SCOPE):
    return fori_while(1, rounds, body, acc)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _rounds(cfg, x_TD, ffn_L, weights_TK, plan, local_I, rounds):
  """Sum of `_round` over every round: f32[T, F].

  Round 0 (C_first slots per pair: the expected load and a margin) runs as plain JAX; the
  overflow rounds, whose count is data-dependent, run in a `while_loop` that adds into its
  output. Backward: round 0's vjp from the residuals its forward saved, then a loop that
  replays each overflow round's vjp and adds it into round 0's gradients in place (no
  zero-filled parameter-sized buffers, no sum of two gradients, when the loop never runs).
  """
  y_TF = _round(
    cfg, x_TD, ffn_L, weights_TK, plan_lib.round_slots(plan, 0, cfg.chunks.first), local_I
  )
  return _add_overflow(cfg, x_TD, ffn_L, weights_TK, plan, local_I, rounds, y_TF)


def _add_overflow(cfg, x_TD, ffn_L, weights_TK, plan, local_I, rounds, y_TF):
  """y_TF plus the overflow rounds' `_round`s."""
  run = functools.partial(_round, cfg, x_TD, ffn_L, weights_TK, local_I=local_I)
  return _loop_overflow(cfg, plan, rounds, lambda acc, s: acc + run(slots_NC=s), y_TF)


def _rounds_fwd(cfg, x_TD, ffn_L, weights_TK, plan, local_I, rounds):
  slots_NC = plan_lib.round_slots(plan, 0, cfg.chunks.first)
  # Differentiated in the trainable leaves only: quantized matrices are frozen.
  trainable, frozen, tree = split_frozen(ffn_L)
  y_TF, vjp0 = jax.vjp(
    lambda x, t, w: _round(cfg, x, merge(tree, t, frozen), w, slots_NC, local_I),
    x_TD,
    trainable,
    weights_TK,
  )
  y_TF = _add_overflow(cfg, x_TD, ffn_L, weights_TK, plan, local_I, rounds, y_TF)
  return y_TF, (vjp0, x_TD, ffn_L, weights_TK, plan, local_I, rounds)


def _rounds_bwd(cfg, res, dy_TF):
  vjp0, x_TD, ffn_L, weights_TK, plan, local_I, rounds = res
  trainable, frozen, tree = split_frozen(ffn_L)

  def add(acc, slots_NC):
    _, vjp = jax.vjp(
      lambda x, t, w: _round(cfg, x, merge(tree, t, frozen), w, slots_NC, local_I),
      x_TD,
      trainable,
      weights_TK,
    )
    return jax.tree.map(jnp.add, acc, vjp(dy_TF))

  dx, dtrainable, dw = _loop_overflow(cfg, plan, rounds, add, vjp0(dy_TF))
  dffn = merge(tree, dtrainable, zero_cotangent(frozen))
  return dx, dffn, dw, None, None, None


_rounds.defvjp(_rounds_fwd, _rounds_bwd)
