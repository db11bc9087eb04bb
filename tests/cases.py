"""Shared test cases: named routings, tolerances, and helpers reused by every dispatch test.

`make_case(routing, T=..., D=..., F=..., E=..., K=..., seed=...)` builds the inputs of
`y = moe(x_TD, w, experts_TK, weights_TK)`; compare any implementation with the float64
oracle in `tests/oracle.py` using `assert_close`, whose tolerances come from `TOL`.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

import moe_shard as ms


class _DtypeTable(dict):
  """A dict keyed by dtype: `TOL[jnp.float32]`, `TOL[x.dtype]`, `TOL["float32"]` agree."""

  def __init__(self, table):
    super().__init__({jnp.dtype(k): v for k, v in table.items()})

  def __getitem__(self, dtype):
    return super().__getitem__(jnp.dtype(dtype))

  def __contains__(self, dtype):
    return super().__contains__(jnp.dtype(dtype))


# Tolerances against the float64 oracle, which sees the same (already rounded) inputs. `atol`
# is relative to the largest |expected| of the array (see `assert_close`): a matmul's absolute
# error scales with the magnitude of its terms, and a near-zero sum of large terms (common in
# gradients) can only be checked to that scale.
TOL = _DtypeTable(
  {
    # float32: unit roundoff 6e-8; the longest sums here (T <= 40 tokens into a weight
    # gradient, D, F <= 16 in a matmul) give errors of a few 1e-7. 1e-5 leaves ~20x margin
    # for XLA's summation order and the float32 silu, and still catches any wrong term
    # (an O(1) error).
    jnp.float32: dict(rtol=1e-5, atol=1e-5),
    # bfloat16: unit roundoff 2**-9 = 2e-3. An implementation may round each matmul output
    # to bfloat16 (SwiGLU: gate, up, h, down; then y), backward rounds each cotangent again,
    # and an expert-parallel combine may sum partial outputs in bfloat16: up to ~10 roundings
    # compound. The local references measured <= 7e-3 (SwiGLU dx); 3e-2 still catches a
    # dropped or misrouted term, which is O(weight) ~ 0.1 or more.
    jnp.bfloat16: dict(rtol=3e-2, atol=3e-2),
  }
)

ROUTINGS = (
  "uniform",
  "one_expert",
  "empty_experts",
  "k_equals_e",
  "duplicate",
  "one_device",
  "invalid_ids",
)

# Ids outside [0, E) that `invalid_ids` uses: -1 wraps to the last expert under NumPy
# indexing, E (one past the end) is clamped to E - 1 by XLA's gather, and the int32 extremes
# overflow careless offset arithmetic. E + 0 and E + 3 are added per case.
_INVALID = (-1, -(2**31), 2**31 - 1)
_PAST_END = (0, 3)


def feasible(routing, *, E, K):
  """Whether `make_case(routing, E=E, K=K, ...)` can build the named routing."""
  if routing not in ROUTINGS:
    raise ValueError(f"unknown routing {routing!r}; expected one of {ROUTINGS}")
  if not 1 <= K <= E:
    return False
  if routing == "k_equals_e":
    return K == E
  if routing == "duplicate":
    return K >= 2
  return True


def _distinct(rng, pool, T, K):
  """int[T, K]: each row K ids from `pool`, distinct when len(pool) >= K, else with repeats."""
  pool = np.asarray(pool)
  if len(pool) >= K:
    return pool[np.argsort(rng.random((T, len(pool))), axis=1)[:, :K]]
  return rng.choice(pool, size=(T, K))


def routing_ids(routing, *, T, E, K, seed, num_devices=8):
  """Returns experts_TK: np.int32[T, K] for a named routing.

  Routings:
    uniform: K distinct experts per token, uniformly at random.
    one_expert: every (token, slot) item to one expert (so repeated in a token when K > 1):
      one group holds every row, all others are empty.
    empty_experts: tokens pick only from max(1, E // 4) random experts (distinct within a
      token when possible); the other experts get nothing.
    k_equals_e: requires K == E; each token's row is a random permutation of range(E).
    duplicate: requires K >= 2; like uniform, but every even token repeats its slot-0 expert
      in slot 1 (odd tokens stay distinct).
    one_device: every token to experts [0, max(1, E // num_devices)): the experts that live
      on device 0 of `num_devices` (default 8) under expert parallelism. Distinct within a
      token when there are at least K of them.
    invalid_ids: like uniform, but token 0 has only invalid ids and about a third of the
      other items are invalid: -1, E, E + 3 and the int32 extremes.

  Raises:
    ValueError: unknown routing, or K, E not feasible for it (see `feasible`).
  """
  if not feasible(routing, E=E, K=K):
    raise ValueError(f"routing {routing!r} is not possible with E={E}, K={K}")
  rng = np.random.default_rng([seed, ROUTINGS.index(routing)])
  if routing in ("uniform", "k_equals_e", "duplicate", "invalid_ids"):
    ids = _distinct(rng, np.arange(E), T, K)
  elif routing == "one_expert":
    ids = np.full((T, K), rng.integers(E))
  elif routing == "empty_experts":
    used = rng.permutation(E)[: max(1, E // 4)]
    ids = _distinct(rng, used, T, K)
  else:  # one_device
    ids = _distinct(rng, np.arange(max(1, E // num_devices)), T, K)
  ids = ids.astype(np.int64)
  if routing == "duplicate":
    ids[::2, 1] = ids[::2, 0]
  if routing == "invalid_ids":
    bad = np.array(list(_INVALID) + [E + d for d in _PAST_END])
    mask = rng.random((T, K)) < 1 / 3
    mask[0] = True
    ids = np.where(mask, rng.choice(bad, size=(T, K)), ids)
    ids[0, 0] = -1  # -1 and E always appear
    ids[0, -1] = E if K > 1 else ids[0, -1]
  return ids.astype(np.int32)


def make_case(routing, *, T, D, F, E, K, seed, dtype=jnp.float32, ffn="linear", num_devices=8):
  """Builds the inputs of one MoE call with a named routing.

  Values are scaled so that every matmul output is O(1) (normal / sqrt(fan-in)), which keeps
  bfloat16 sane. The combine weights are positive and sum to 1 over each token's K slots,
  like normalized top-k weights; invalid slots get weight too, so a leak would show.

  Args:
    routing: one of `ROUTINGS` (see `routing_ids`).
    T, D, F, E, K: tokens, model width, expert hidden width, experts, experts per token.
    seed: int seed; the same arguments give the same case.
    dtype: dtype of x and of the expert weights (default float32); the combine weights are
      always float32, as `top_k_routing` returns them.
    ffn: "linear" (w: dtype[E, D, F], output F) or "swiglu" (w: `ms.SwiGLU` with gate, up
      [E, D, F] and down [E, F, D], output D).
    num_devices: devices on the expert axis, for "one_device" (default 8).

  Returns:
    (x_TD: dtype[T, D], w, experts_TK: i32[T, K], weights_TK: f32[T, K]), jax arrays.
  """
  experts_TK = routing_ids(routing, T=T, E=E, K=K, seed=seed, num_devices=num_devices)
  rng = np.random.default_rng([seed, 1000 + ROUTINGS.index(routing)])
  x_TD = rng.normal(size=(T, D))
  if ffn == "linear":
    w = jnp.asarray(rng.normal(size=(E, D, F)) / np.sqrt(D), dtype)
  elif ffn == "swiglu":
    w = ms.SwiGLU(
      gate_EDF=jnp.asarray(rng.normal(size=(E, D, F)) / np.sqrt(D), dtype),
      up_EDF=jnp.asarray(rng.normal(size=(E, D, F)) / np.sqrt(D), dtype),
      down_EFD=jnp.asarray(rng.normal(size=(E, F, D)) / np.sqrt(F), dtype),
    )
  else:
    raise ValueError(f"ffn must be 'linear' or 'swiglu' (got {ffn!r})")
  weights_TK = rng.uniform(0.2, 1.0, size=(T, K))
  weights_TK /= weights_TK.sum(axis=1, keepdims=True)
  return (
    jnp.asarray(x_TD, dtype),
    w,
    jnp.asarray(experts_TK),
    jnp.asarray(weights_TK, jnp.float32),
  )


def cotangent(shape, dtype, seed):
  """A float32 cotangent already rounded to `dtype` (what reaches a `dtype` output)."""
  ct = np.random.default_rng([seed, 2000]).normal(size=shape)
  return jnp.asarray(jnp.asarray(ct, dtype), jnp.float32)


# Compile fast, run slow: the test shapes are tiny and XLA's compile time dominates the suite.
# These options only lower LLVM's effort; floating-point semantics are unchanged (no fast
# math). Scoped to the functions jitted here, not set globally in XLA_FLAGS.
@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class TiedFFN:
  """An expert FFN whose one leaf feeds two matmuls: y = tanh(x @ w) @ w (D = F). The
  float64 oracle models it too (`oracle.moe`, kind "tied")."""

  w_EDD: jax.Array
  d_in = property(lambda self: self.w_EDD.shape[-2])
  d_out = property(lambda self: self.w_EDD.shape[-1])

  def __call__(self, x_MD, matmul):
    return matmul(jnp.tanh(matmul(x_MD, self.w_EDD)), self.w_EDD)


FAST_COMPILE = dict(xla_backend_optimization_level=0, xla_llvm_disable_expensive_passes=True)


@functools.partial(jax.jit, static_argnums=0, compiler_options=FAST_COMPILE)
def outputs(fn, x_TD, w, experts, weights):
  """Returns `fn(x_TD, w, experts, weights)`, jitted; `fn` is static (pass the same object)."""
  return fn(x_TD, w, experts, weights)


@functools.partial(jax.jit, static_argnums=0, compiler_options=FAST_COMPILE)
def outputs_and_grads(fn, x_TD, w, experts, weights, ct):
  """Returns (y, (dx, dw, dweights)) of `fn(x_TD, w, experts, weights)`, jitted.

  The gradients are of `sum(y * ct)` with respect to x_TD, every leaf of w and weights
  (pass weights=None to leave them out; dweights is then None). `fn` is a static argument:
  pass the same (hashable) callable each time to reuse the compiled function.
  """

  def loss(x_TD, w, weights):
    y = fn(x_TD, w, experts, weights)
    return jnp.sum(y.astype(jnp.float32) * ct), y

  if weights is None:
    (dx, dw), y = jax.grad(lambda x, w: loss(x, w, None), argnums=(0, 1), has_aux=True)(x_TD, w)
    return y, (dx, dw, None)
  grads, y = jax.grad(loss, argnums=(0, 1, 2), has_aux=True)(x_TD, w, weights)
  return y, grads


def assert_close(got, want, dtype, err_msg=""):
  """Asserts `got` is within `TOL[dtype]` of the float64 `want` (atol scaled by max|want|)."""
  tol = TOL[dtype]
  want = np.asarray(want, np.float64)
  got = np.asarray(got).astype(np.float64)
  scale = max(1.0, float(np.max(np.abs(want)))) if want.size else 1.0
  np.testing.assert_allclose(got, want, rtol=tol["rtol"], atol=tol["atol"] * scale, err_msg=err_msg)


class Mismatches:
  """Every comparison of one case, the failures collected so that one assert names them all
  (e.g. "d.router_DE"): `close(got, want, what)` is `assert_close` in float32, `check()`
  fails with each wrong quantity's message."""

  def __init__(self, name):
    self.name, self.wrong = name, []

  def close(self, got, want, what):
    try:
      assert_close(jnp.asarray(got, jnp.float32), want, jnp.float32, f"{self.name}: {what}")
    except AssertionError as e:
      self.wrong.append((what, str(e)))

  def close_tree(self, got, want):
    """`close` leaf by leaf, each named by its path ("d" + keystr)."""
    for (path, g), (_, w) in zip(
      jax.tree_util.tree_leaves_with_path(got), jax.tree_util.tree_leaves_with_path(want)
    ):
      self.close(g, w, f"d{jax.tree_util.keystr(path)}")

  def check(self):
    wrong = self.wrong
    assert not wrong, f"{self.name}: wrong {[w for w, _ in wrong]}\n" + "\n".join(
      m for _, m in wrong
    )


def assert_tree_close(got, want, dtype, err_msg=""):
  """`assert_close` leaf by leaf; the two pytrees must have the same structure."""
  got_leaves, got_def = jax.tree_util.tree_flatten_with_path(got)
  want_leaves, want_def = jax.tree_util.tree_flatten_with_path(want)
  assert got_def == want_def, f"{err_msg}: structure {got_def} != {want_def}"
  for (path, g), (_, v) in zip(got_leaves, want_leaves):
    assert_close(g, v, dtype, err_msg=f"{err_msg} {jax.tree_util.keystr(path)}")


def trace(fn, *args, **kwargs):
  """Calls `fn` under `jax.eval_shape`: arrays become abstract, nothing is compiled or run.

  Array leaves of `args`/`kwargs` (including those inside an FFN pytree) are passed as
  `ShapeDtypeStruct`s; anything else (ints, strings, None, Python lists) is closed over as is.
  So an error raised here was raised at trace time.
  """
  leaves, treedef = jax.tree.flatten((args, kwargs), is_leaf=lambda v: v is None)
  is_array = [isinstance(v, (jax.Array, np.ndarray)) for v in leaves]

  def call(*arrays):
    it = iter(arrays)
    full = [next(it) if a else v for v, a in zip(leaves, is_array)]
    a, kw = jax.tree.unflatten(treedef, full)
    return fn(*a, **kw)

  return jax.eval_shape(
    call, *[jax.ShapeDtypeStruct(v.shape, v.dtype) for v, a in zip(leaves, is_array) if a]
  )
