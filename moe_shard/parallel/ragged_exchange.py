"""The ragged exchange: `lax.ragged_all_to_all` where XLA has it, an emulation elsewhere.

The transport of `moe_ragged_all_to_all` (`ragged.py`), apart from the dispatch that plans
its offsets and sizes: `ragged_exchange` picks the native primitive or
`ragged_all_to_all_emulated` by the platform compiled for.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

# Platforms whose XLA implements the ragged-all-to-all opcode; others (CPU) run an emulation,
# and `impl="auto"` takes the ragged dispatch only here. In `lax.platform_dependent`'s names,
# which has "cuda" and "rocm" and refuses "gpu".
RAGGED_PLATFORMS = ("tpu", "cuda", "rocm")


def ragged_all_to_all_emulated(
  operand,
  output,
  input_offsets,
  send_sizes,
  output_offsets,
  recv_sizes,
  *,
  axis_name,
  rows_per_peer=None,
):
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
    recv_NP.reshape((-1,) + operand.shape[1:]).astype(output.dtype), mode="drop"
  )


def ragged_exchange(
  operand, output, input_offsets, send_sizes, output_offsets, recv_sizes, *, axis, rows_per_peer
):
  """`lax.ragged_all_to_all` where XLA has it, `ragged_all_to_all_emulated` elsewhere.

  Chosen by the platform compiled for (`lax.platform_dependent`), so an ahead-of-time TPU
  compile on a CPU host holds the real primitive and no emulation.

  Args:
    operand, output, input_offsets, send_sizes, output_offsets, recv_sizes: as in
      `lax.ragged_all_to_all`.
    axis: the mesh axis to exchange over.
    rows_per_peer: the emulation's static bound on the rows one device sends another
      (`ragged_all_to_all_emulated`); the native primitive needs none.

  Returns:
    `output` with the received slices written in.
  """

  def native(*args):
    return jax.lax.ragged_all_to_all(*args, axis_name=axis)

  def emulated(*args):
    return ragged_all_to_all_emulated(*args, axis_name=axis, rows_per_peer=rows_per_peer)

  return jax.lax.platform_dependent(
    operand,
    output,
    input_offsets,
    send_sizes,
    output_offsets,
    recv_sizes,
    default=emulated,
    **{p: native for p in RAGGED_PLATFORMS},
  )
