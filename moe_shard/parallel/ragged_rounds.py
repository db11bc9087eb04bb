"""The ragged dispatch's rounds: each round's exchange there and back, and their vjp.

`ragged.py` plans the queues (`Queues`) and calls `ragged_rounds`: round 0 moves positions
[0, C) of every device's receive order, each later round (as many as the fullest receive
order needs: big rounds in a `while_loop`, then at most one small one in a `cond`,
`plan.Rows`) the next rows, each with one `ragged_all_to_all` that
sends each (source, destination, expert) queue exactly, there and back. One `custom_vjp`
differentiates them: round 0's vjp from its saved residuals, then a loop that replays each
later round reversed and adds its gradient into round 0's in place.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from moe_shard import plan as plan_lib
from moe_shard.frozen import merge, split_frozen, zero_cotangent
from moe_shard.matmuls import GroupedMatmul, MaskedMatmul
from moe_shard.parallel.common import local_experts, one_expert_or_grouped
from moe_shard.parallel.ragged_exchange import ragged_exchange
from moe_shard.sharding import fori_while, zeros_varying

RAGGED_SCOPE = "ragged_overflow_rounds"  # the big overflow rounds' loop
RAGGED_LAST_SCOPE = "ragged_last_round"  # the last, small overflow round's cond (runs or not)


@dataclasses.dataclass(frozen=True)
class Ragged:
  """Static configuration of one ragged dispatch (hashable: a custom_vjp nondiff arg)."""

  axis: str
  local_experts: int  # L
  rows: plan_lib.Rows  # receive-buffer rows of round 0, the big rounds and the last one
  gmm_impl: str
  tensor_axis: str | None  # expert tensor parallelism (`local_experts`)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Queues:
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


def _ragged_round(cfg, x_ID, ffn_L, q, lo, C, y_IF=None):
  """One round: window [lo, lo + C) of every receive order, there and back.

  Args:
    cfg: `Ragged`.
    x_ID: f[I, D] this device's items sorted by (destination, expert).
    ffn_L: the expert FFN of this device's L experts.
    q: `Queues`.
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


def _overflow(cfg, rounds, step, acc):
  """Folds `step(start, rows, acc)` over the overflow rounds: `rounds` = (big rounds, last
  rounds), `cfg.rows.big` rows each from `cfg.rows.start(r)`, then 0 or 1 of
  `cfg.rows.last` rows after them."""
  n_big, n_last = rounds
  rows = cfg.rows
  # Named so that the benchmark can scale each loop body by its trip count.
  with jax.named_scope(RAGGED_SCOPE):
    acc = fori_while(1, n_big + 1, lambda r, a: step(rows.start(r), rows.big, a), acc)
  # The last round in a cond, not a loop of 0 or 1 trips: XLA hoists a loop's invariant
  # reshapes of the exchange buffers out of it, where they run even when it does not.
  with jax.named_scope(RAGGED_LAST_SCOPE):
    last = rows.last_start(n_big)
    return jax.lax.cond(n_last > 0, lambda a: step(last, rows.last, a), lambda a: a, acc)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def ragged_rounds(cfg, x_ID, ffn_L, q, rounds):
  """Every round of `_ragged_round`: f[I, F], each item's output at its sorted position.

  Round 0 (C rows) runs as plain JAX; the overflow rounds (`plan.Rows`: big rounds, then
  at most one last small one), whose count is data-dependent, run in a `while_loop` and a
  `cond` that write into round 0's output. Backward: round 0's vjp from the residuals its
  forward saved, then the same loop and cond replaying each overflow round's vjp and
  adding it into round 0's gradients in place.
  """
  y_IF = _ragged_round(cfg, x_ID, ffn_L, q, 0, cfg.rows.first)
  return _write_overflow(cfg, x_ID, ffn_L, q, rounds, y_IF)


def _write_overflow(cfg, x_ID, ffn_L, q, rounds, y_IF):
  """y_IF with the overflow rounds' outputs written at their items' sorted positions."""

  def step(lo, C, y):
    return _ragged_round(cfg, x_ID, ffn_L, q, lo, C, y)

  return _overflow(cfg, rounds, step, y_IF)


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

  def add(lo, C, acc):
    _, vjp = jax.vjp(
      lambda x, t: _ragged_round(cfg, x, merge(tree, t, frozen), q, lo, C), x_ID, trainable
    )
    return jax.tree.map(jnp.add, acc, vjp(dy_IF))

  dx, dtrainable = _overflow(cfg, rounds, add, vjp0(dy_IF))
  return dx, merge(tree, dtrainable, zero_cotangent(frozen)), None, None


ragged_rounds.defvjp(_ragged_rounds_fwd, _ragged_rounds_bwd)
