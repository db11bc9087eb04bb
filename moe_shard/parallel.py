"""Expert parallelism with `jax.shard_map`: the only module that issues collectives.

Tokens are split over every mesh axis; expert parameters over the expert axis only
(replicated over the others, e.g. "data"). Each group of devices along the expert axis
serves its own tokens with the E experts split L = E / N per device.

  * `moe_all_gather`: all_gather tokens and routing along the expert axis, each device runs
    its L experts on the items routed to them, a reduce-scatter returns the outputs.
  * `moe_all_to_all`: each device sorts its items by destination device and sends them in
    rounds of fixed-size `lax.all_to_all`s; dropless, with the number of rounds set on device
    by the busiest (source, destination) pair.
  * `moe_ragged_all_to_all`: `lax.ragged_all_to_all` sends each (source, destination, expert)
    queue exactly (an emulation from padded `all_to_all`s on CPU); rounds only when a
    receive buffer overflows. At the end of the file.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from moe_shard import _checks, local, plan as plan_lib
from moe_shard.grouped_matmul import grouped_matmul
from moe_shard.routing import expert_load
from moe_shard.sharding import (EXPERT, check_mesh, place, token_spec, trim, vary_over,
                               zeros_varying)

OVERFLOW_SCOPE = "a2a_overflow_rounds"


@dataclasses.dataclass(frozen=True)
class _Layout:
  """Static facts about a call: mesh, axes and sizes."""

  mesh: jax.sharding.Mesh
  expert_axis: str
  num_experts: int  # E
  tokens: int  # T before padding
  padded: int  # T after padding to a multiple of the device count

  @property
  def all_axes(self):
    return tuple(self.mesh.axis_names)

  @property
  def other_axes(self):
    return tuple(a for a in self.mesh.axis_names if a != self.expert_axis)

  @property
  def n(self):
    return self.mesh.shape[self.expert_axis]

  @property
  def token_spec(self):
    return token_spec(self.mesh)


def _prepare(fn, x_TD, w, experts, weights, mesh, expert_axis):
  """Checks, pads T to a multiple of the device count and places the inputs on the mesh."""
  x_TD, ffn, E, experts_TK, weights_TK = local.check_moe_inputs(fn, x_TD, w, experts, weights)
  check_mesh(fn, mesh, expert_axis, E)
  T = x_TD.shape[0]
  pad = -T % mesh.size
  if pad:  # padding tokens route nowhere (id -1) and are trimmed from the output
    # Pad replicated arrays: a T that does not divide cannot be split over the mesh.
    x_TD, experts_TK, weights_TK = (place(a, mesh, P())
                                    for a in (x_TD, experts_TK, weights_TK))
    x_TD = jnp.pad(x_TD, ((0, pad), (0, 0)))
    experts_TK = jnp.pad(experts_TK, ((0, pad), (0, 0)), constant_values=-1)
    weights_TK = jnp.pad(weights_TK, ((0, pad), (0, 0)))
  lay = _Layout(mesh, expert_axis, E, T, T + pad)
  x_TD, experts_TK, weights_TK = (place(a, mesh, lay.token_spec)
                                  for a in (x_TD, experts_TK, weights_TK))
  ffn = jax.tree.map(lambda leaf: place(leaf, mesh, P(expert_axis)), ffn)
  return lay, x_TD, ffn, experts_TK, weights_TK


# --------------------------------------------------------------------------- all_gather


def moe_all_gather(x_TD, w, experts, weights=None, *, mesh, expert_axis=EXPERT,
                   gmm_impl="auto"):
  """Expert-parallel MoE: all_gather tokens, compute local experts, reduce-scatter.

  Each device gathers the tokens, expert ids and weights of the N devices on its expert
  axis, runs its L = E / N experts on the items routed to them (sort + grouped matmul), and
  a reduce-scatter sums the N partial outputs of each token on the device that owns it.
  Moves about (N - 1) * T * (D + F) elements per device: best when K >= N.

  Args:
    x_TD: f[T, D] tokens (global shape; split over every mesh axis inside).
    w: f[E, D, F], or an expert-FFN pytree with the expert axis first (split over
      `expert_axis`, replicated over the other axes).
    experts: int[T] or int[T, K] expert ids; ids outside [0, E) contribute zero.
    weights: f[T, K] combine weights (the shape of `experts`), or None for ones (default).
    mesh: a `jax.sharding.Mesh` with `expert_axis`; Auto or Explicit axis types. Inputs are
      placed (resharded) on it as needed.
    expert_axis: name of the mesh axis experts are split over (default "expert").
    gmm_impl: `grouped_matmul` implementation (default "auto").

  Returns:
    y_TF: f[T, F] in the dtype of `x_TD`, split over the mesh like the tokens.

  Raises:
    TypeError, ValueError: bad arguments, or E not divisible by the expert-axis size.
  """
  check_mesh("moe_all_gather", mesh, expert_axis)
  return _all_gather_jit(x_TD, w, experts, weights, mesh=mesh, expert_axis=expert_axis,
                         gmm_impl=gmm_impl)


@functools.partial(jax.jit, static_argnames=("mesh", "expert_axis", "gmm_impl"))
def _all_gather_jit(x_TD, w, experts, weights, *, mesh, expert_axis, gmm_impl):
  # Jitted so that a call outside jit does not run the shard_map body op by op.
  lay, x_TD, ffn, experts_TK, weights_TK = _prepare(
      "moe_all_gather", x_TD, w, experts, weights, mesh, expert_axis)
  body = functools.partial(_all_gather_body, lay=lay, gmm_impl=gmm_impl)
  tok = lay.token_spec
  y_TF = jax.shard_map(body, mesh=mesh,
                       in_specs=(tok, jax.tree.map(lambda _: P(expert_axis), ffn), tok, tok),
                       out_specs=tok)(x_TD, ffn, experts_TK, weights_TK)
  return trim(y_TF, mesh, lay.tokens)


def _all_gather_body(x_TD, ffn_L, experts_TK, weights_TK, *, lay, gmm_impl):
  # Per-device sizes: T tokens of this device, L = E / N local experts.
  axis = lay.expert_axis
  L = lay.num_experts // lay.n
  ffn_L = vary_over(ffn_L, lay.other_axes)
  # Every device receives the tokens, ids and weights of all N devices on its expert axis.
  with jax.named_scope("all_gather"):
    x_MD, experts_MK, weights_MK = (jax.lax.all_gather(a, axis, axis=0, tiled=True)
                                    for a in (x_TD, experts_TK, weights_TK))
  with jax.named_scope("local_experts"):
    local_MK = experts_MK - jax.lax.axis_index(axis) * L  # outside [0, L): not ours, zero
    y_MF = local.ragged_combine(x_MD, ffn_L, L, local_MK, weights_MK, gmm_impl)
  # Each device receives, summed over the N devices, the partial outputs of its own tokens.
  with jax.named_scope("reduce_scatter"):
    y_TF = jax.lax.psum_scatter(y_MF.astype(x_TD.dtype), axis, scatter_dimension=0,
                                tiled=True)
  return y_TF


# --------------------------------------------------------------------------- all_to_all


def moe_all_to_all(x_TD, w, experts, weights=None, *, mesh, expert_axis=EXPERT,
                   chunk_size=None, return_stats=False, gmm_impl="auto"):
  """Expert-parallel MoE: dropless chunked all_to_all dispatch, compute, and return.

  Each device sorts its T*K (token, slot) items by destination device. Round 0 sends the
  first C_first items of every (source, destination) queue with one `lax.all_to_all`
  (`[N, C, D]` per device), the receiver runs its L = E / N experts on them through the
  grouped matmul, and a second `all_to_all` brings the outputs back, where they are
  combined with the weights. A `while_loop` runs overflow rounds of C_overflow items until
  the busiest queue on the mesh is empty; the count is computed on device (no host sync,
  no dropped token). Buffers are per round, never `[N, T, D]`.

  The backward pass (a `custom_vjp`) replays the same rounds: each round's gradient is the
  same dispatch reversed.

  Args:
    x_TD: f[T, D] tokens (global shape; split over every mesh axis inside).
    w: f[E, D, F], or an expert-FFN pytree with the expert axis first (split over
      `expert_axis`, replicated over the other axes).
    experts: int[T] or int[T, K] expert ids; ids outside [0, E) contribute zero.
    weights: f[T, K] combine weights (the shape of `experts`), or None for ones (default).
    mesh: a `jax.sharding.Mesh` with `expert_axis`; Auto or Explicit axis types.
    expert_axis: name of the mesh axis experts are split over (default "expert").
    chunk_size: None (default): C_first = the expected (source, destination) load
      T_dev*K/N rounded up to a multiple of 8 and C_overflow = C_first/4 rounded up to a
      multiple of 8, so padding stays near 25% under uniform routing and skew costs small
      extra rounds. An int C uses C for every round; a pair (C_first, C_overflow) sets both.
    return_stats: also return a dict of dispatch statistics (default False).
    gmm_impl: `grouped_matmul` implementation (default "auto").

  Returns:
    y_TF: f[T, F] in the dtype of `x_TD`; with `return_stats`, `(y_TF, stats)` where stats
    holds `rounds` (i32[]), `sent_items` and `sent_slots` (i32[devices]: valid items and
    all slots, padding included, sent per device; self included), `expert_load` (i32[E]),
    `invalid_ids` (i32[]: ids outside [0, E)), `chunk_first` and `chunk_overflow` (ints).

  Raises:
    TypeError, ValueError: bad arguments, or E not divisible by the expert-axis size.
  """
  check_mesh("moe_all_to_all", mesh, expert_axis)
  chunk_size = _checks.chunk_size_field("moe_all_to_all", chunk_size)
  out = _all_to_all_jit(x_TD, w, experts, weights, mesh=mesh, expert_axis=expert_axis,
                        chunk_size=chunk_size, return_stats=bool(return_stats),
                        gmm_impl=gmm_impl)
  if not return_stats:
    return out
  y_TF, stats = out
  T, K = jnp.shape(x_TD)[0], (jnp.shape(experts) + (1,))[1]
  chunks = plan_lib.default_chunks(-(-T // mesh.size), K, mesh.shape[expert_axis], chunk_size)
  return y_TF, dict(stats, chunk_first=chunks.first, chunk_overflow=chunks.overflow)


@functools.partial(jax.jit, static_argnames=("mesh", "expert_axis", "chunk_size",
                                             "return_stats", "gmm_impl"))
def _all_to_all_jit(x_TD, w, experts, weights, *, mesh, expert_axis, chunk_size,
                    return_stats, gmm_impl):
  # Jitted so that a call outside jit does not run the shard_map body op by op.
  lay, x_TD, ffn, experts_TK, weights_TK = _prepare(
      "moe_all_to_all", x_TD, w, experts, weights, mesh, expert_axis)
  chunks = plan_lib.default_chunks(lay.padded // mesh.size, experts_TK.shape[1], lay.n,
                                   chunk_size)
  body = functools.partial(_all_to_all_body, lay=lay, chunks=chunks, gmm_impl=gmm_impl)
  tok = lay.token_spec
  stats_specs = dict(rounds=P(), sent_items=tok, sent_slots=tok, expert_load=P(),
                     invalid_ids=P())
  y_TF, stats = jax.shard_map(
      body, mesh=mesh,
      in_specs=(tok, jax.tree.map(lambda _: P(expert_axis), ffn), tok, tok),
      out_specs=(tok, stats_specs))(x_TD, ffn, experts_TK, weights_TK)
  y_TF = trim(y_TF, mesh, lay.tokens)
  if not return_stats:
    return y_TF
  # Padding tokens carry id -1 on each of their K slots; they are not the caller's.
  stats["invalid_ids"] = stats["invalid_ids"] - (lay.padded - lay.tokens) * experts_TK.shape[1]
  return y_TF, stats


@dataclasses.dataclass(frozen=True)
class _A2A:
  """Static configuration of one all_to_all dispatch (hashable: a custom_vjp nondiff arg)."""

  axis: str
  n: int  # N devices on the expert axis
  local_experts: int  # L
  chunks: plan_lib.Chunks
  gmm_impl: str


def _all_to_all_body(x_TD, ffn_L, experts_TK, weights_TK, *, lay, chunks, gmm_impl):
  # Per-device sizes: T tokens of this device, K slots, L = E / N local experts.
  cfg = _A2A(lay.expert_axis, lay.n, lay.num_experts // lay.n, chunks, gmm_impl)
  with jax.named_scope("plan"):
    plan = plan_lib.send_plan(experts_TK, lay.num_experts, lay.n)
    local_I = experts_TK.reshape(-1) % cfg.local_experts  # local expert id at the receiver
    # Every device runs as many rounds as the busiest queue on the whole mesh needs.
    rounds = chunks.rounds(jax.lax.pmax(jnp.max(plan.count_N), lay.all_axes))
  ffn_L = vary_over(ffn_L, lay.other_axes)
  y_TF = _dispatch(cfg, x_TD, ffn_L, weights_TK, plan, local_I, rounds)
  sent = jnp.sum(plan.count_N)
  stats = dict(
      rounds=rounds.astype(jnp.int32),
      sent_items=sent[None],
      sent_slots=(cfg.n * (chunks.first + (rounds - 1) * chunks.overflow))[None].astype(jnp.int32),
      expert_load=jax.lax.psum(expert_load(experts_TK, lay.num_experts), lay.all_axes),
      invalid_ids=jax.lax.psum(jnp.sum(~plan.valid_I).astype(jnp.int32), lay.all_axes),
  )
  return y_TF.astype(x_TD.dtype), stats


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
  T, K = weights_TK.shape
  N, C = slots_NC.shape
  live_NC = slots_NC >= 0
  item_NC = jnp.maximum(slots_NC, 0)
  send_NCD = jnp.where(live_NC[..., None], x_TD[item_NC // K], 0)
  ids_NC = jnp.where(live_NC, local_I[item_NC], cfg.local_experts)
  # Each device sends row n of its buffers to device n and receives, from every device s,
  # the items s routes to the experts of this device.
  with jax.named_scope("dispatch"):
    recv_NCD = jax.lax.all_to_all(send_NCD, cfg.axis, 0, 0, tiled=True)
    rids_NC = jax.lax.all_to_all(ids_NC, cfg.axis, 0, 0, tiled=True)
  with jax.named_scope("local_experts"):
    out_NCF = _local_experts(cfg, recv_NCD.reshape(N * C, -1), rids_NC.reshape(-1), ffn_L)
    out_NCF = out_NCF.reshape(N, C, -1).astype(x_TD.dtype)
  # Each device returns the outputs to the devices the items came from.
  with jax.named_scope("return"):
    back_NCF = jax.lax.all_to_all(out_NCF, cfg.axis, 0, 0, tiled=True)
  with jax.named_scope("combine"):
    w_NC = jnp.where(live_NC, weights_TK.reshape(-1)[item_NC], 0.0)
    token_NC = jnp.where(live_NC, item_NC // K, T)  # padding: index T, dropped
    contrib_TF = jnp.zeros_like(weights_TK, shape=(T, back_NCF.shape[-1]))
    return contrib_TF.at[token_NC].add(w_NC[..., None] * back_NCF.astype(jnp.float32),
                                       mode="drop")


def _local_experts(cfg, x_MD, ids_M, ffn_L):
  """Runs the L local experts on received rows (id L = padding, gives zeros); f32[M, F]."""
  order_M, group_sizes_L, _ = local.sort_by_expert(ids_M, cfg.local_experts)
  matmul = functools.partial(grouped_matmul, group_sizes_G=group_sizes_L, impl=cfg.gmm_impl,
                             preferred_element_type=jnp.float32)
  y_MF = ffn_L(x_MD[order_M], matmul)
  return y_MF[local.inverse_permutation(order_M)]


def _loop_rounds(cfg, plan, rounds, first, step):
  """Folds `step(acc, slots_NC)` over round 0 (C_first) and the overflow rounds."""
  acc = first(plan_lib.round_slots(plan, 0, cfg.chunks.first))

  def cond(carry):
    return carry[0] < rounds

  def body(carry):
    r, acc = carry
    slots_NC = plan_lib.round_slots(plan, cfg.chunks.start(r), cfg.chunks.overflow)
    return r + 1, step(acc, slots_NC)

  # Named so that measure.collective_bytes can scale the loop body by rounds - 1.
  with jax.named_scope(OVERFLOW_SCOPE):
    return jax.lax.while_loop(cond, body, (jnp.ones((), jnp.int32), acc))[1]


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _dispatch(cfg, x_TD, ffn_L, weights_TK, plan, local_I, rounds):
  """Sum over rounds of `_round`: f32[T, F]. Differentiable in x, ffn and weights."""
  run = functools.partial(_round, cfg, x_TD, ffn_L, weights_TK, local_I=local_I)
  return _loop_rounds(cfg, plan, rounds, lambda s: run(slots_NC=s),
                      lambda acc, s: acc + run(slots_NC=s))


def _dispatch_fwd(cfg, x_TD, ffn_L, weights_TK, plan, local_I, rounds):
  y = _dispatch(cfg, x_TD, ffn_L, weights_TK, plan, local_I, rounds)
  return y, (x_TD, ffn_L, weights_TK, plan, local_I, rounds)


def _dispatch_bwd(cfg, res, dy_TF):
  x_TD, ffn_L, weights_TK, plan, local_I, rounds = res

  def grads(slots_NC):
    _, vjp = jax.vjp(
        lambda x, f, w: _round(cfg, x, f, w, slots_NC, local_I), x_TD, ffn_L, weights_TK)
    return vjp(dy_TF)

  def add(acc, slots_NC):
    return jax.tree.map(jnp.add, acc, grads(slots_NC))

  dx, dffn, dw = _loop_rounds(cfg, plan, rounds, grads, add)
  return dx, dffn, dw, None, None, None


_dispatch.defvjp(_dispatch_fwd, _dispatch_bwd)


# --------------------------------------------------------------------------- ragged_all_to_all

RAGGED_SCOPE = "ragged_overflow_rounds"
# Platforms whose XLA implements the ragged-all-to-all opcode; others (CPU) run an emulation.
RAGGED_PLATFORMS = ("tpu", "cuda", "rocm")


def ragged_all_to_all_emulated(operand, output, input_offsets, send_sizes, output_offsets,
                               recv_sizes, *, axis_name, rows_per_peer=None):
  """`lax.ragged_all_to_all`'s semantics from one `lax.all_to_all` of padded buffers.

  Each device packs the slices it sends to device n (slices n*J .. n*J + J - 1, J slices
  per device) one after another into row n of a `[N, rows_per_peer, ...]` buffer; one
  `all_to_all` moves the buffers and the receiver writes each slice at its output offset
  (sent along with a small `all_to_all`, as the primitive's own pseudocode does):

      send[n, p] = operand[input_offsets[n*J + j] + p - sum(send_sizes[n*J : n*J + j])]
      result[output_offsets_[s*J + j] + q] = recv[s, q + sum(recv_sizes[s*J : s*J + j])]

  for p, q inside slice j. Padded traffic: N * rows_per_peer rows per device, whatever the
  sizes (for CPU, where XLA has no ragged-all-to-all).

  Args:
    operand, output, input_offsets, send_sizes, output_offsets, recv_sizes, axis_name: as
      in `lax.ragged_all_to_all`.
    rows_per_peer: static bound on the rows one device sends another (the sum of its J
      send sizes for that peer); rows past it are not sent. Default None: J times the
      smaller of the operand's and the output's rows, which any in-range call meets.

  Returns:
    `output` with the received slices written in.
  """
  N = jax.lax.axis_size(axis_name)
  J = input_offsets.shape[0] // N
  if rows_per_peer is None:
    rows_per_peer = J * min(operand.shape[0], output.shape[0])
  p_P = jnp.arange(rows_per_peer, dtype=jnp.int32)

  def unpack(sizes_NJ, offsets_NJ):
    # Slice j of each packed row p, and the row's position in that slice's own numbering.
    end_NJ = jnp.cumsum(sizes_NJ, axis=1)
    j_NP = jnp.sum(p_P[None, None, :] >= end_NJ[:, :, None], axis=1)
    live_NP = j_NP < J
    j_NP = jnp.minimum(j_NP, J - 1)
    skip_NP = jnp.take_along_axis(end_NJ - sizes_NJ, j_NP, axis=1)
    return live_NP, jnp.take_along_axis(offsets_NJ, j_NP, axis=1) + p_P - skip_NP

  live_NP, row_NP = unpack(send_sizes.reshape(N, J), input_offsets.reshape(N, J))
  row_NP = jnp.clip(row_NP, 0, operand.shape[0] - 1)
  mask = live_NP.reshape(live_NP.shape + (1,) * (operand.ndim - 1))
  send_NP = jnp.where(mask, operand[row_NP], 0)
  # Each device sends row n of the packed buffer to device n, and receives row s of each
  # source s: its slices for this device, packed. Their offsets here travel the same way.
  recv_NP = jax.lax.all_to_all(send_NP, axis_name, 0, 0, tiled=True)
  offsets_NJ = jax.lax.all_to_all(output_offsets, axis_name, 0, 0, tiled=True).reshape(N, J)
  live_NP, dst_NP = unpack(recv_sizes.reshape(N, J), offsets_NJ)
  dst_NP = jnp.where(live_NP, dst_NP, output.shape[0])  # past the end: dropped
  return output.at[dst_NP.reshape(-1)].set(
      recv_NP.reshape((-1,) + operand.shape[1:]).astype(output.dtype), mode="drop")


def _exchange(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes, *,
              axis, rows_per_peer):
  """`lax.ragged_all_to_all` where XLA has it, `ragged_all_to_all_emulated` elsewhere.

  Chosen by the platform compiled for (`lax.platform_dependent`), so an ahead-of-time TPU
  compile on a CPU host holds the real primitive and no emulation.
  """
  def native(*args):
    return jax.lax.ragged_all_to_all(*args, axis_name=axis)

  def emulated(*args):
    return ragged_all_to_all_emulated(*args, axis_name=axis, rows_per_peer=rows_per_peer)

  return jax.lax.platform_dependent(
      operand, output, input_offsets, send_sizes, output_offsets, recv_sizes,
      default=emulated, **{p: native for p in RAGGED_PLATFORMS})


def moe_ragged_all_to_all(x_TD, w, experts, weights=None, *, mesh, expert_axis=EXPERT,
                          capacity=None, return_stats=False, gmm_impl="auto"):
  """Expert-parallel MoE: dropless `ragged_all_to_all` dispatch, compute, and return.

  Each device sorts its T*K (token, slot) items by expert (so by destination device, then
  local expert). A small `all_to_all` tells every device how many items each source sends
  each of its L = E / N local experts; each device lays out what it will receive
  expert-major (all sources' items for local expert 0, then expert 1, ...). Round 0 moves
  positions [0, C) of every device's layout into its C-row receive buffer, each later round
  the next C_overflow positions, each with one
  `ragged_all_to_all` that sends each (source, destination, expert) queue exactly: no
  padding on the wire. The rows arrive grouped by local expert, the grouped matmul runs on
  them, and a second `ragged_all_to_all` returns the outputs to the sorted positions they
  came from; the combine with the weights follows the last round. Round 0 runs outside any
  loop (JAX differentiates it, through the primitive's own transpose); while some device
  has more to receive, a `while_loop` runs further rounds (count from a `pmax`, no host
  sync), differentiated by a `custom_vjp` that replays each round's exchange reversed.

  On platforms whose XLA has no ragged-all-to-all (CPU), the exchange is an emulation with
  the same semantics built from `lax.all_to_all` of padded buffers
  (`ragged_all_to_all_emulated`): the same results, but padded traffic.

  Args:
    x_TD: f[T, D] tokens (global shape; split over every mesh axis inside).
    w: f[E, D, F], or an expert-FFN pytree with the expert axis first (split over
      `expert_axis`, replicated over the other axes).
    experts: int[T] or int[T, K] expert ids; ids outside [0, E) contribute zero.
    weights: f[T, K] combine weights (the shape of `experts`), or None for ones (default).
    mesh: a `jax.sharding.Mesh` with `expert_axis`; Auto or Explicit axis types.
    expert_axis: name of the mesh axis experts are split over (default "expert").
    capacity: rows of the receive buffer per device and round. None (default): round 0
      takes C = 1.25 times the expected load T_dev*K, rounded up to a multiple of 8, so
      uniform routing takes one round, and later rounds C_overflow = C/4 rounded up to a
      multiple of 8 (`plan.default_capacity`); an int C >= 1: C in every round.
    return_stats: also return a dict of dispatch statistics (default False).
    gmm_impl: `grouped_matmul` implementation (default "auto").

  Returns:
    y_TF: f[T, F] in the dtype of `x_TD`; with `return_stats`, `(y_TF, stats)` where stats
    holds `rounds` (i32[]), `sent_items` and `received_items` (i32[devices]: valid items
    each device sends and receives, itself included), `expert_load` (i32[E]),
    `invalid_ids` (i32[]: ids outside [0, E)), `capacity` and `capacity_overflow` (ints:
    C and C_overflow).

  Raises:
    TypeError, ValueError: bad arguments, or E not divisible by the expert-axis size.
  """
  fn = "moe_ragged_all_to_all"
  check_mesh(fn, mesh, expert_axis)
  if capacity is not None:
    capacity = _checks.int_field(fn, "capacity", capacity, 1)
  out = _ragged_jit(x_TD, w, experts, weights, mesh=mesh, expert_axis=expert_axis,
                    capacity=capacity, return_stats=bool(return_stats), gmm_impl=gmm_impl)
  if not return_stats:
    return out
  y_TF, stats = out
  T, K = jnp.shape(x_TD)[0], (jnp.shape(experts) + (1,))[1]
  rows = plan_lib.default_capacity(-(-T // mesh.size), K, capacity)
  return y_TF, dict(stats, capacity=rows.first, capacity_overflow=rows.overflow)


@functools.partial(jax.jit, static_argnames=("mesh", "expert_axis", "capacity",
                                             "return_stats", "gmm_impl"))
def _ragged_jit(x_TD, w, experts, weights, *, mesh, expert_axis, capacity, return_stats,
                gmm_impl):
  lay, x_TD, ffn, experts_TK, weights_TK = _prepare(
      "moe_ragged_all_to_all", x_TD, w, experts, weights, mesh, expert_axis)
  K = experts_TK.shape[1]
  rows = plan_lib.default_capacity(lay.padded // mesh.size, K, capacity)
  body = functools.partial(_ragged_body, lay=lay, rows=rows, gmm_impl=gmm_impl)
  tok = lay.token_spec
  stats_specs = dict(rounds=P(), sent_items=tok, received_items=tok, expert_load=P(),
                     invalid_ids=P())
  y_TF, stats = jax.shard_map(
      body, mesh=mesh,
      in_specs=(tok, jax.tree.map(lambda _: P(expert_axis), ffn), tok, tok),
      out_specs=(tok, stats_specs))(x_TD, ffn, experts_TK, weights_TK)
  y_TF = trim(y_TF, mesh, lay.tokens)
  if not return_stats:
    return y_TF
  stats["invalid_ids"] = stats["invalid_ids"] - (lay.padded - lay.tokens) * K
  return y_TF, stats


@dataclasses.dataclass(frozen=True)
class _Ragged:
  """Static configuration of one ragged dispatch (hashable: a custom_vjp nondiff arg)."""

  axis: str
  local_experts: int  # L
  rows: plan_lib.Chunks  # receive-buffer rows of round 0, and of each later round
  gmm_impl: str


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


def _ragged_body(x_TD, ffn_L, experts_TK, weights_TK, *, lay, rows, gmm_impl):
  # Per-device sizes: T tokens of this device, K slots, I = T*K items, L local experts,
  # N (= S) devices on the expert axis, C rows of a receive buffer.
  axis, N = lay.expert_axis, lay.n
  cfg = _Ragged(axis, lay.num_experts // N, rows, gmm_impl)
  T, K = experts_TK.shape
  with jax.named_scope("plan"):
    order_I, load_E, valid_I = local.sort_by_expert(experts_TK.reshape(-1), lay.num_experts)
    count_NL = load_E.reshape(N, cfg.local_experts)
    offset_NL = (jnp.cumsum(load_E) - load_E).reshape(N, -1).astype(jnp.int32)
    # Each device sends each destination its queue lengths and sorted positions for that
    # destination's experts, and receives those of every source for its own experts.
    from_SL, recv_SL = jax.lax.all_to_all(jnp.stack([offset_NL, count_NL]), axis, 1, 1,
                                          tiled=True)
    rstart_SL = plan_lib.receive_starts(recv_SL)
    # ... and tells each source where its queues begin in this device's receive order.
    start_NL = jax.lax.all_to_all(rstart_SL, axis, 0, 0, tiled=True)
    q = _Queues(offset_NL, count_NL, start_NL, from_SL, recv_SL, rstart_SL)
    # Every device runs as many rounds as the fullest receive order on the mesh needs.
    received = jnp.sum(recv_SL)
    rounds = rows.rounds(jax.lax.pmax(received, lay.all_axes))
  ffn_L = vary_over(ffn_L, lay.other_axes)
  with jax.named_scope("permute"):
    x_ID = x_TD[order_I // K]  # sorted by (destination, expert); invalid items last
  y_IF = _ragged_round(cfg, x_ID, ffn_L, q, 0, rows.first)
  y_IF = y_IF + _ragged_overflow(cfg, x_ID, ffn_L, q, rounds)
  with jax.named_scope("combine"):
    y_TKF = y_IF[local.inverse_permutation(order_I)].reshape(T, K, -1)
    weights_TK = jnp.where(valid_I.reshape(T, K), weights_TK, 0.0)
    y_TF = jnp.einsum("tk,tkf->tf", weights_TK, y_TKF.astype(jnp.float32))
  stats = dict(
      rounds=rounds.astype(jnp.int32),
      sent_items=jnp.sum(count_NL)[None].astype(jnp.int32),
      received_items=received[None].astype(jnp.int32),
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
  exchange = functools.partial(_exchange, axis=cfg.axis, rows_per_peer=rows)
  # Each device sends each (destination, expert) queue's part in this window, exactly, to
  # its place in the destination's buffer; rows arrive grouped by local expert.
  with jax.named_scope("dispatch"):
    recv_CD = exchange(x_ID, zeros_varying((C, x_ID.shape[1]), x_ID.dtype, x_ID),
                       flat(q.offset_NL + skip_NL), flat(send_NL), flat(at_NL),
                       flat(recv_SL))
  with jax.named_scope("local_experts"):
    matmul = functools.partial(grouped_matmul, group_sizes_G=jnp.sum(recv_SL, axis=0),
                               impl=cfg.gmm_impl, preferred_element_type=jnp.float32)
    out_CF = ffn_L(recv_CD, matmul).astype(x_ID.dtype)  # rows past the received: zeros
  # Each device returns the outputs to the sorted positions their items came from.
  with jax.named_scope("return"):
    if y_IF is None:
      y_IF = zeros_varying((I, out_CF.shape[1]), out_CF.dtype, out_CF)
    return exchange(out_CF, y_IF, flat(rat_SL), flat(recv_SL), flat(q.from_SL + rskip_SL),
                    flat(send_NL))


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _ragged_overflow(cfg, x_ID, ffn_L, q, rounds):
  """Rounds 1 .. rounds - 1 of `_ragged_round`: f[I, F] (zeros when there are none)."""
  def body(carry):
    r, y_IF = carry
    return r + 1, _ragged_round(cfg, x_ID, ffn_L, q, cfg.rows.start(r), cfg.rows.overflow,
                                y_IF)

  y_IF = zeros_varying((x_ID.shape[0], ffn_L.d_out), x_ID.dtype, x_ID)
  # Named so that measure.collective_bytes can scale the loop body by rounds - 1.
  with jax.named_scope(RAGGED_SCOPE):
    return jax.lax.while_loop(lambda c: c[0] < rounds, body,
                              (jnp.ones((), jnp.int32), y_IF))[1]


def _ragged_overflow_fwd(cfg, x_ID, ffn_L, q, rounds):
  return _ragged_overflow(cfg, x_ID, ffn_L, q, rounds), (x_ID, ffn_L, q, rounds)


def _ragged_overflow_bwd(cfg, res, dy_IF):
  x_ID, ffn_L, q, rounds = res

  def body(carry):
    r, acc = carry
    _, vjp = jax.vjp(lambda x, f: _ragged_round(cfg, x, f, q, cfg.rows.start(r),
                                                cfg.rows.overflow), x_ID, ffn_L)
    return r + 1, jax.tree.map(jnp.add, acc, vjp(dy_IF))

  zeros = jax.tree.map(jnp.zeros_like, (x_ID, ffn_L))
  with jax.named_scope(RAGGED_SCOPE):
    dx, dffn = jax.lax.while_loop(lambda c: c[0] < rounds, body,
                                  (jnp.ones((), jnp.int32), zeros))[1]
  return dx, dffn, None, None


_ragged_overflow.defvjp(_ragged_overflow_fwd, _ragged_overflow_bwd)
