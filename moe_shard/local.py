"""The two single-device references: a masked scan over experts, and sort + grouped matmul.

Both compute, for x_TD, an expert FFN `w` with E experts, experts_TK and weights_TK,

    y[t] = sum_j weights[t, j] * expert(w[experts[t, j]], x[t])

An expert id outside [0, E) contributes zero to its token (never another expert's output).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from moe_shard import _checks
from moe_shard.experts import ExpertFFN, as_ffn
from moe_shard.matmuls import GroupedMatmul, dense_matmul


def check_moe_inputs(fn, x_TD, w, experts, weights):
  """Validates the common arguments of every implementation at trace time.

  Args:
    fn: name of the calling function, for error messages.
    x_TD: f[T, D] tokens.
    w: f[E, D, F] or an expert-FFN pytree.
    experts: int[T] or int[T, K] expert ids.
    weights: f[T, K] combine weights (the shape of `experts`), or None for ones.

  Returns:
    (x_TD, ffn, E, experts_TK: int[T, K], weights_TK: f32[T, K]).

  Raises:
    TypeError, ValueError: naming the argument and the rule broken.
  """
  x_TD = _checks.float_array(fn, "x", x_TD, ndim=2)
  T, D = x_TD.shape
  ffn, E = as_ffn(fn, w)
  if ffn.d_in != D:
    raise ValueError(
      f"{fn}: w's input dimension ({ffn.d_in}) must equal x's last dimension D ({D})"
    )
  experts = _checks.int_array(fn, "experts", experts)
  if experts.ndim not in (1, 2) or experts.shape[0] != T:
    raise ValueError(
      f"{fn}: experts must be int[T] or int[T, K] with T = {T} tokens "
      f"(got shape {tuple(experts.shape)})"
    )
  experts_TK = experts.reshape(T, -1)
  if experts_TK.shape[1] < 1:
    raise ValueError(
      f"{fn}: experts must route each token to at least one expert "
      f"(got shape {tuple(experts.shape)})"
    )
  if weights is None:
    weights_TK = jnp.ones(experts_TK.shape, jnp.float32)
  else:
    weights = _checks.float_array(fn, "weights", weights)
    if weights.shape != experts.shape:
      raise ValueError(
        f"{fn}: weights must have the shape of experts "
        f"{tuple(experts.shape)} (got {tuple(weights.shape)})"
      )
    weights_TK = weights.reshape(experts_TK.shape).astype(jnp.float32)
  return x_TD, ffn, E, experts_TK.astype(jnp.int32), weights_TK


@jax.named_scope("moe_masked_scan")
def moe_masked_scan(
  x_TD: Float[Array, "T D"],
  w: Float[Array, "E D F"] | ExpertFFN,
  experts: Int[Array, "T K"] | Int[Array, " T"],
  weights: Float[Array, "T K"] | Float[Array, " T"] | None = None,
) -> Float[Array, "T F"]:
  """Applies each expert to every token and keeps the routed outputs: the ground truth.

  A `lax.scan` over the E experts; step e runs expert e on all T tokens and adds
  `weights[t, j] * out[t]` where `experts[t, j] == e`. E/K times the routed FLOPs, no
  `[E, T, D]` or `[T, D, F]` array.

  Args:
    x_TD: f[T, D] tokens.
    w: f[E, D, F], or an expert-FFN pytree (e.g. `SwiGLU`) with the expert axis first.
    experts: int[T] (top-1) or int[T, K] expert ids; ids outside [0, E) contribute zero.
    weights: f[T, K] (the shape of `experts`) combine weights, or None for ones (default).

  Returns:
    y_TF: f[T, F] in the dtype of `x_TD` (matmuls accumulate in float32).

  Raises:
    TypeError, ValueError: bad argument shapes or dtypes (at trace time).
  """
  x_TD, ffn, E, experts_TK, weights_TK = check_moe_inputs(
    "moe_masked_scan", x_TD, w, experts, weights
  )

  def step(y_TF, e_and_ffn):
    e, ffn_e = e_and_ffn  # ffn_e: the leaves of expert e, without the expert axis
    routed_TK = experts_TK == e
    coef_T = jnp.sum(jnp.where(routed_TK, weights_TK, 0.0), axis=1)
    out_TF = ffn_e(x_TD, dense_matmul)
    # `where`, not a product: a token not routed to e never picks up e's Inf or NaN.
    return y_TF + jnp.where(
      jnp.any(routed_TK, axis=1)[:, None], coef_T[:, None] * out_TF, 0.0
    ), None

  T = x_TD.shape[0]
  y0_TF = jnp.zeros((T, ffn.d_out), jnp.float32)
  y_TF, _ = jax.lax.scan(step, y0_TF, (jnp.arange(E, dtype=jnp.int32), ffn))
  return y_TF.astype(x_TD.dtype)


def sort_by_expert(experts_I, num_experts):
  """Orders items by expert id, invalid ids (outside [0, E)) last.

  Args:
    experts_I: int[I] expert id of each item.
    num_experts: E.

  Returns:
    (order_I: i32[I] item indices in expert order (stable), group_sizes_E: i32[E] valid
    items per expert, valid_I: bool[I]).
  """
  valid_I = (experts_I >= 0) & (experts_I < num_experts)
  key_I = jnp.where(valid_I, experts_I, num_experts)
  order_I = jnp.argsort(key_I, stable=True).astype(jnp.int32)
  group_sizes_E = jnp.zeros((num_experts + 1,), jnp.int32).at[key_I].add(1)[:num_experts]
  return order_I, group_sizes_E, valid_I


def inverse_permutation(order_I):
  """Returns inv with inv[order[i]] = i."""
  I = order_I.shape[0]
  return jnp.zeros_like(order_I).at[order_I].set(jnp.arange(I, dtype=order_I.dtype))


@jax.custom_vjp
def move_rows(x_RD, to_R, from_S):
  """Moves rows: `out[s] = x[from[s]]` (zeros where `from[s]` is out of range), as a scatter.

  Written `out[to[r]] = x[r]` forward, and its transpose `dx[from[s]] = dout[s]` backward:
  both directions are row scatters, never row gathers. Compiled for TPU, XLA's cost model
  charges a gather of [8192, 2048] bf16 rows 436 MB of HBM traffic (6.5x the bytes it moves)
  and the same scatter 168 MB (`python -m bench.tpu_costs`); a plain `x[from]`
  would also transpose to a scatter-add but run the forward as a gather.

  Args:
    x_RD: [R, ...] rows.
    to_R: i32[R] where each row goes (out of [0, S): nowhere). No two rows go to one place.
    from_S: i32[S] the inverse map: where each output row comes from (out of [0, R): none).
      Must agree with `to_R` (`to[from[s]] = s` wherever from[s] is in range).

  Returns:
    [S, ...] in the dtype of `x_RD`.
  """
  return _scatter_rows(x_RD, to_R, from_S.shape[0])


def items_to_rows(x_TD, items_S, K):
  """The token rows of a list of (token, slot) items, moved by scatters (`move_rows`).

  Args:
    x_TD: f[T, D] tokens.
    items_S: i32[S] item t * K + k in each of S rows; out of [0, T * K): a zero row.
    K: slots per token.

  Returns:
    (x_SD, index): x_SD[s] = x[items[s] // K]; `index` for `rows_to_tokens`. Items are
    addressed slot-major (row k * T + t of a [K, T, D] buffer): T and D stay the minor
    dimensions, where [T, K, D] would put K in a TPU tile.
  """
  T = x_TD.shape[0]
  I, S = T * K, items_S.shape[0]
  live_S = (items_S >= 0) & (items_S < I)
  kt_S = jnp.where(live_S, (items_S % K) * T + items_S // K, I)
  row_KT = (
    jnp.full_like(items_S, S, shape=(I,))
    .at[kt_S]
    .set(jnp.arange(S, dtype=items_S.dtype), mode="drop")
  )
  x_KTD = jnp.broadcast_to(x_TD, (K,) + x_TD.shape).reshape(I, -1)
  return move_rows(x_KTD, row_KT, kt_S), (kt_S, row_KT)


def rows_to_tokens(y_SF, index, weights_TK):
  """Combines per-item rows into tokens: y[t] = sum_k weights[t, k] * y_S[row of (t, k)].

  Args:
    y_SF: f[S, F] one row per entry of the `items_S` given to `items_to_rows`.
    index: what `items_to_rows` returned with it.
    weights_TK: f32[T, K] combine weights (items with no row contribute zero).

  Returns:
    f32[T, F].
  """
  kt_S, row_KT = index
  T, K = weights_TK.shape
  y_KTF = move_rows(y_SF, kt_S, row_KT).reshape(K, T, -1)
  # A sum of K weighted [T, F] slices, products in float32, each slice read in its own
  # dtype: for a dot over K (`einsum("tk,ktf->tf")`) XLA:TPU converts the bf16 [K, T, F]
  # rows to float32 and keeps that copy for the backward, and a broadcast product and a sum
  # over K accesses more HBM bytes still (XLA's counts compiled for TPU, the HBM column of
  # `python -m bench --tpu v6e:2x4 --levels layer -E 64`).
  out = weights_TK[:, 0, None] * y_KTF[0].astype(jnp.float32)
  for k in range(1, K):
    out = out + weights_TK[:, k, None] * y_KTF[k].astype(jnp.float32)
  return out


# Rows wider than this many elements are scattered in column chunks of at most this width.
# Compiled for TPU, XLA turns a scatter of wider rows into a gather that it counts at about
# eight times the bytes it moves, and keeps out of VMEM: `items_to_rows` of DeepSeek-V3's
# [2048, 7168] bf16 rows (29 MB) counts 228 MB less VMEM on a v5e, the same rows in two
# [2048, 3584] halves 4 MB, and 16.8 MB rows of 4096 elements 6 MB.
ROW_CHUNK = 4096


def _scatter_rows(x_RD, to_R, rows):
  D = x_RD.shape[-1]
  if x_RD.ndim != 2 or D <= ROW_CHUNK:
    out = jnp.zeros_like(x_RD, shape=(rows,) + x_RD.shape[1:])
    return out.at[to_R].set(x_RD, mode="drop")
  n = -(-D // ROW_CHUNK)  # chunks, each a multiple of 128 wide but the last
  width = -(-D // n // 128) * 128
  return jnp.concatenate(
    [_scatter_rows(x_RD[:, i : i + width], to_R, rows) for i in range(0, D, width)], axis=1
  )


def _move_rows_fwd(x_RD, to_R, from_S):
  return move_rows(x_RD, to_R, from_S), (to_R, from_S)


def _move_rows_bwd(res, dout_SD):
  to_R, from_S = res
  return _scatter_rows(dout_SD, from_S, to_R.shape[0]), None, None


move_rows.defvjp(_move_rows_fwd, _move_rows_bwd)


@jax.named_scope("moe_ragged_dot")
def moe_ragged_dot(
  x_TD: Float[Array, "T D"],
  w: Float[Array, "E D F"] | ExpertFFN,
  experts: Int[Array, "T K"] | Int[Array, " T"],
  weights: Float[Array, "T K"] | Float[Array, " T"] | None = None,
  *,
  gmm_impl: str = "auto",
) -> Float[Array, "T F"]:
  """Sorts the (token, slot) items by expert, runs one grouped matmul, unsorts, combines.

  Args:
    x_TD: f[T, D] tokens.
    w: f[E, D, F], or an expert-FFN pytree (e.g. `SwiGLU`) with the expert axis first.
    experts: int[T] (top-1) or int[T, K] expert ids; ids outside [0, E) contribute zero.
    weights: f[T, K] (the shape of `experts`) combine weights, or None for ones (default).
    gmm_impl: `grouped_matmul` implementation (default "auto"). On TPU "auto" takes
      megablox's Pallas kernels, which XLA cannot partition: under `jax.jit` with inputs
      sharded over several devices, pass "ragged_dot" (XLA's own, which it shards), or
      call this inside a `shard_map`; else the compile raises NotImplementedError
      ("Mosaic kernels cannot be automatically partitioned").

  Returns:
    y_TF: f[T, F] in the dtype of `x_TD` (matmuls accumulate in float32).

  Raises:
    TypeError, ValueError: bad argument shapes or dtypes (at trace time).
  """
  x_TD, ffn, E, experts_TK, weights_TK = check_moe_inputs(
    "moe_ragged_dot", x_TD, w, experts, weights
  )
  return ragged_combine(x_TD, ffn, E, experts_TK, weights_TK, gmm_impl).astype(x_TD.dtype)


def ragged_combine(x_TD, ffn, num_experts, experts_TK, weights_TK, gmm_impl="auto"):
  """The body of `moe_ragged_dot` on checked inputs; returns f32[T, F].

  Ids outside [0, num_experts) contribute zero, so a caller can pass ids relative to a
  slice of experts (`ffn` holding only those) and get that slice's partial output.
  """
  T, K = experts_TK.shape
  with jax.named_scope("permute"):
    order_I, group_sizes_E, valid_I = sort_by_expert(experts_TK.reshape(-1), num_experts)
    x_ID, index = items_to_rows(x_TD, order_I, K)  # I = T*K items in expert order
  with jax.named_scope("experts"):
    # Products accumulate in float32; results are stored in the compute dtype (bf16 matmul
    # outputs and their residuals take half the HBM bytes of float32 ones).
    # Invalid items sort last, past sum(group_sizes): padding rows, given no bias.
    matmul = GroupedMatmul(group_sizes_E, gmm_impl, x_TD.dtype)
    y_IF = ffn(x_ID, matmul)  # rows past sum(group_sizes) are zeros
  with jax.named_scope("unpermute"):
    weights_TK = jnp.where(valid_I.reshape(T, K), weights_TK, 0.0)
    return rows_to_tokens(y_IF, index, weights_TK)


def input_weighted_items(
  x_TD: Float[Array, "T D"], experts_TK: Int[Array, "T K"], weights_TK: Float[Array, "T K"]
) -> tuple[Float[Array, "I D"], Int[Array, "I 1"], Float[Array, "I 1"]]:
  """The items of `weights_on="input"`: each (token, slot) is its own row `w * x`, weight 1.

      x_ID[t*K + j] = weights_TK[t, j] * x_TD[t]      (in float32, then x's dtype)
      experts_I1[t*K + j, 0] = experts_TK[t, j]

  So any dispatch computes `expert(w * x)` per item; `sum_items` adds each token's K
  outputs. Item order is token-major: a token's items stay on the device of the token.
  For K = 1 this is just the tokens scaled by their weight. A dropped item (id -1) stays
  dropped and contributes zero.

  Args:
    x_TD: f[T, D] tokens.
    experts_TK: i32[T, K] expert ids.
    weights_TK: f32[T, K] combine weights.

  Returns:
    (x_ID: f[T*K, D] in the dtype of x_TD, experts_I1: i32[T*K, 1], ones_I1: f32[T*K, 1]).
  """
  T, K = experts_TK.shape
  x_TKD = weights_TK[:, :, None].astype(jnp.float32) * x_TD[:, None, :].astype(jnp.float32)
  x_ID = x_TKD.reshape(T * K, x_TD.shape[1]).astype(x_TD.dtype)
  return x_ID, experts_TK.reshape(T * K, 1), jnp.ones((T * K, 1), jnp.float32)


def sum_items(y_ID: Float[Array, "I D"], tokens: int) -> Float[Array, "T D"]:
  """Sums the K consecutive item outputs of each token: f[T*K, D] -> f32[T, D]."""
  return jnp.sum(y_ID.reshape(tokens, -1, y_ID.shape[-1]).astype(jnp.float32), axis=1)
