"""Expert-parallel dispatch (`moe_all_gather`, `moe_all_to_all`) against the references.

Outputs and gradients (x, every leaf of w, weights) are compared with the float64 NumPy
oracle and with `moe_masked_scan`, on meshes (expert x data) 8x1, 4x2, 2x4, 1x8 and 1x1, with
Auto and Explicit axis types, and the all_to_all dispatch statistics with a host NumPy
count from the routing.

Compile time dominates this file, so every (implementation, mesh, shape) is jitted once, by
`run` (outputs, gradients and stats in one program) or `cases.outputs` (outputs and stats),
and all routings of that shape share it: a routing changes values, not shapes. The partials
passed to them are cached by `impl`, so the same callable (their static argument) comes back
every time. Only one test calls without jit: that runs the shard_map body op by op,
recompiling every op on every call (20-35 s here).
"""

import functools
import math
import re
import types

import hypothesis
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import oracle
import pytest
from cases import (
  FAST_COMPILE,
  ROUTINGS,
  TiedFFN,
  assert_close,
  assert_tree_close,
  cotangent,
  feasible,
  make_case,
  outputs,
  outputs_and_grads,
  trace,
)
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import moe_shard as ms

# --------------------------------------------------------------------------- meshes

MESH_SHAPES = {"8x1": (8, 1), "4x2": (4, 2), "2x4": (2, 4), "1x8": (1, 8), "1x1": (1, 1)}
KINDS = {"auto": AxisType.Auto, "explicit": AxisType.Explicit}
MESHES = [f"{shape}-{kind}" for shape in MESH_SHAPES for kind in KINDS]
# Every mesh shape runs with both axis types: gradients with one, outputs (and stats) with the
# other, alternating, so that each axis type gets gradients on some shapes. (A compile with
# gradients costs about 2.5 forward compiles.)
GRAD_MESHES = ["8x1-explicit", "4x2-auto", "2x4-explicit", "1x8-auto", "1x1-explicit"]
FWD_MESHES = ["8x1-auto", "4x2-explicit", "2x4-auto", "1x8-explicit", "1x1-auto"]
assert sorted(GRAD_MESHES + FWD_MESHES) == sorted(MESHES)


@functools.cache
def mesh(name):
  """`"4x2-explicit"` -> a (expert, data) mesh over the first 8 (or 1) devices."""
  shape_name, kind = name.split("-")
  shape = MESH_SHAPES[shape_name]
  return jax.make_mesh(
    shape,
    (ms.EXPERT, ms.DATA),
    axis_types=(KINDS[kind],) * 2,
    devices=jax.devices()[: math.prod(shape)],
  )


@pytest.fixture(scope="module", autouse=True)
def _eight_devices(devices):
  del devices  # conftest's fixture asserts the 8 simulated devices


# --------------------------------------------------------------------------- compiled calls


@functools.cache
def impl(name, mesh_, chunk_size=None, stats=True, expert_axis=ms.EXPERT, gmm_impl="auto"):
  """The same partial for the same arguments, so `run` and `outputs` reuse their compiles.

  The all_to_all partial returns `(y, stats)` unless `stats=False`.
  """
  kw = dict(mesh=mesh_, expert_axis=expert_axis, gmm_impl=gmm_impl)
  if name == "all_gather":
    return functools.partial(ms.moe_all_gather, **kw)
  assert name == "all_to_all", name
  return functools.partial(ms.moe_all_to_all, chunk_size=chunk_size, return_stats=stats, **kw)


IMPLS = ["all_gather", "all_to_all"]


@functools.partial(jax.jit, static_argnums=0, compiler_options=FAST_COMPILE)
def run(fn, x_TD, w, experts, weights, ct):
  """Returns (y, (dx, dw, dweights), stats) of `fn`; stats is {} when `fn` returns y only.

  The gradients are of `sum(y * ct)`, as in `cases.outputs_and_grads`.
  """

  def loss(x_TD, w, weights):
    out = fn(x_TD, w, experts, weights)
    y, stats = out if isinstance(out, tuple) else (out, {})
    return jnp.sum(y.astype(jnp.float32) * ct), (y, stats)

  grads, (y, stats) = jax.grad(loss, argnums=(0, 1, 2), has_aux=True)(x_TD, w, weights)
  return y, grads, stats


# --------------------------------------------------------------------------- references

# T = 40: 5 tokens per device on 8 devices, so with the default chunks (8 slots) a skewed
# routing needs an overflow round. E = 8 divides every expert axis here.
SHAPE = dict(T=40, D=4, F=6, E=8, K=2)
SHAPE_PADDED = dict(SHAPE, T=37)  # 37 tokens do not split over 8 (or 2, or 4) devices
SHAPE_K_EQUALS_E = dict(T=16, D=4, F=6, E=8, K=8)
MAIN_ROUTINGS = [r for r in ROUTINGS if feasible(r, E=SHAPE["E"], K=SHAPE["K"])]
assert "k_equals_e" not in MAIN_ROUTINGS and len(MAIN_ROUTINGS) == len(ROUTINGS) - 1


@functools.cache
def reference(routing, shape, ffn="linear", dtype="float32", seed=0, num_devices=8):
  """The case, its cotangent, and the oracle's and the masked scan's outputs and gradients.

  `shape` is a tuple of (name, size) pairs (hashable); cached, since the same case is
  checked on every mesh.
  """
  dtype = jnp.dtype(dtype)
  case = make_case(routing, seed=seed, dtype=dtype, ffn=ffn, num_devices=num_devices, **dict(shape))
  y = oracle.moe(*case)
  ct = cotangent(y.shape, dtype, seed)
  dx, dw, dweights = oracle.moe_grads(*case, ct)
  scan_y, scan_grads = outputs_and_grads(ms.moe_masked_scan, *case, ct)
  return types.SimpleNamespace(
    case=case, ct=ct, dtype=dtype, oracle=(y, (dx, dw, dweights)), scan=(scan_y, scan_grads)
  )


def key(shape):
  return tuple(sorted(shape.items()))


def check(fn, ref, err_msg=""):
  """Runs `fn` (jitted, with gradients) on `ref.case`; compares with oracle and masked scan."""
  x_TD = ref.case[0]
  y, grads, stats = run(fn, *ref.case, ref.ct)
  assert y.dtype == x_TD.dtype and y.shape == ref.oracle[0].shape, (y.dtype, y.shape)
  for what, (want_y, want_grads) in [("oracle", ref.oracle), ("masked_scan", ref.scan)]:
    assert_close(y, want_y, ref.dtype, f"{err_msg} y vs {what}")
    for name, got, want in zip(("dx", "dw", "dweights"), grads, want_grads):
      assert_tree_close(got, want, ref.dtype, f"{err_msg} {name} vs {what}")
  return y, grads, stats


def check_forward(fn, ref, err_msg=""):
  """Runs `fn` (jitted, outputs only); returns (y, stats or None) after comparing y."""
  out = outputs(fn, *ref.case)
  y, stats = out if isinstance(out, tuple) else (out, None)
  x_TD = ref.case[0]
  assert y.dtype == x_TD.dtype and y.shape == ref.oracle[0].shape, (y.dtype, y.shape)
  assert_close(y, ref.oracle[0], ref.dtype, f"{err_msg} y vs oracle")
  assert_close(y, ref.scan[0], ref.dtype, f"{err_msg} y vs masked_scan")
  return y, stats


def expected_chunks(tokens_per_device, K, N, chunk_size):
  """(C_first, C_overflow) by the documented rule, computed independently of `plan`."""
  if chunk_size is None:
    # The mean (source, destination) load T*K/N plus 4 * sqrt of it, rounded up to a
    # multiple of 8 (at least 8); overflow rounds as many.
    mean = math.ceil(tokens_per_device * K / N)
    first = max(8, 8 * math.ceil((mean + math.ceil(4 * math.sqrt(mean))) / 8))
    # Never more than the most a pair can carry, T*K rounded up to 8, and that whenever the
    # N buffers of it hold at most 128 rows (plan.DECODE_ROWS): one round, any routing.
    most = max(8, 8 * math.ceil(tokens_per_device * K / 8))
    first = most if N * most <= 128 or first > most else first
    return first, first
  if isinstance(chunk_size, int):
    return chunk_size, chunk_size
  return tuple(chunk_size)


def expected_stats(experts_TK, E, mesh_, chunk_size=None, expert_axis=ms.EXPERT):
  """The all_to_all statistics, by counting on the host.

  Tokens are padded with id -1 to a multiple of the device count and split in order over
  the devices (device s holds block s of P(all axes)). A (source, destination) pair count is
  the valid items of source s bound for the expert-axis position e // L; the rounds follow
  from the busiest pair on the whole mesh.
  """
  ids_TK = np.asarray(experts_TK).astype(np.int64).reshape(len(experts_TK), -1)
  T, K = ids_TK.shape
  devices, N = mesh_.size, mesh_.shape[expert_axis]
  L = E // N
  ids_SI = np.pad(ids_TK, ((0, -T % devices), (0, 0)), constant_values=-1).reshape(devices, -1)
  valid_SI = (ids_SI >= 0) & (ids_SI < E)
  pairs_SN = np.stack([np.sum(valid_SI & (ids_SI // L == n), axis=1) for n in range(N)], 1)
  first, overflow = expected_chunks(ids_SI.shape[1] // K, K, N, chunk_size)
  rounds = 1 + math.ceil(max(0, pairs_SN.max() - first) / overflow)
  valid_TK = (ids_TK >= 0) & (ids_TK < E)
  return dict(
    rounds=rounds,
    sent_items=valid_SI.sum(axis=1),
    sent_slots=np.full(devices, N * (first + (rounds - 1) * overflow)),
    expert_load=np.bincount(ids_TK[valid_TK], minlength=E),
    invalid_ids=int(np.sum(~valid_TK)),
    chunk_first=first,
    chunk_overflow=overflow,
  )


def check_stats(stats, experts_TK, E, mesh_, chunk_size=None, expert_axis=ms.EXPERT):
  want = expected_stats(experts_TK, E, mesh_, chunk_size, expert_axis)
  assert set(stats) == set(want), sorted(stats)
  for name, value in want.items():
    np.testing.assert_array_equal(np.asarray(stats[name]), value, err_msg=name)
  for name in ("rounds", "sent_items", "sent_slots", "expert_load", "invalid_ids"):
    assert jnp.issubdtype(stats[name].dtype, jnp.integer), (name, stats[name].dtype)
  # The stats agree with each other: every valid item is counted and sent exactly once.
  valid = int(np.sum(want["expert_load"]))
  assert int(np.sum(stats["sent_items"])) == valid
  assert int(np.sum(stats["expert_load"])) == valid
  assert valid + int(stats["invalid_ids"]) == np.size(experts_TK)
  assert np.all(np.asarray(stats["sent_slots"]) >= np.asarray(stats["sent_items"]))
  return want


# --------------------------------------------------------------------------- against the references


@pytest.mark.parametrize("routing", MAIN_ROUTINGS)
@pytest.mark.parametrize("mesh_name", GRAD_MESHES)
@pytest.mark.parametrize("name", IMPLS)
def test_matches_references(name, mesh_name, routing):
  # "one_device" sends every token to the experts of expert-axis position 0 of this mesh.
  m = mesh(mesh_name)
  ref = reference(routing, key(SHAPE), num_devices=m.shape[ms.EXPERT])
  _, _, stats = check(impl(name, m), ref, f"{name}/{mesh_name}/{routing}")
  if name == "all_to_all":
    want = check_stats(stats, ref.case[2], SHAPE["E"], m)
    if routing == "one_expert" and m.shape[ms.EXPERT] > 1:
      # 10 items per device to one destination. 5 tokens * 2 slots: the most a pair can
      # carry is 10 -> 16 slots, N * 16 <= 128 rows (`plan.DECODE_ROWS`), so round 0 holds
      # it whatever the routing: one round. test_chunk_sizes runs many overflow rounds.
      assert want["rounds"] == 1


@pytest.mark.parametrize("routing", MAIN_ROUTINGS)
@pytest.mark.parametrize("mesh_name", FWD_MESHES)
@pytest.mark.parametrize("name", IMPLS)
def test_outputs_match_references(name, mesh_name, routing):
  m = mesh(mesh_name)
  ref = reference(routing, key(SHAPE), num_devices=m.shape[ms.EXPERT])
  _, stats = check_forward(impl(name, m), ref, f"{name}/{mesh_name}/{routing}")
  if name == "all_to_all":
    check_stats(stats, ref.case[2], SHAPE["E"], m)


# SwiGLU on one mesh per implementation; the Explicit one under `jax.set_mesh`, as a model
# would call it.
SWIGLU_MESHES = [("all_gather", "4x2-auto"), ("all_to_all", "2x4-explicit")]


@pytest.mark.parametrize("routing", MAIN_ROUTINGS)
@pytest.mark.parametrize("name, mesh_name", SWIGLU_MESHES)
def test_swiglu_matches_references(name, mesh_name, routing):
  m = mesh(mesh_name)
  ref = reference(routing, key(SHAPE), ffn="swiglu", num_devices=m.shape[ms.EXPERT])
  if mesh_name.endswith("explicit"):
    with jax.set_mesh(m):
      _, (_, dw, _), stats = check(impl(name, m), ref, f"{name}/{mesh_name}/{routing}")
  else:
    _, (_, dw, _), stats = check(impl(name, m), ref, f"{name}/{mesh_name}/{routing}")
  assert isinstance(dw, ms.SwiGLU)
  if name == "all_to_all":
    check_stats(stats, ref.case[2], SHAPE["E"], m)


PADDED_ROUTINGS = ["uniform", "one_expert", "invalid_ids"]


# One mesh per implementation (padding and trimming are shared code): both axis types.
PADDED_MESHES = [("all_gather", "8x1-auto"), ("all_to_all", "4x2-explicit")]


@pytest.mark.parametrize("routing", PADDED_ROUTINGS)
@pytest.mark.parametrize("name, mesh_name", PADDED_MESHES)
def test_tokens_not_divisible(name, mesh_name, routing):
  m = mesh(mesh_name)
  ref = reference(routing, key(SHAPE_PADDED), num_devices=m.shape[ms.EXPERT])
  _, _, stats = check(impl(name, m), ref, f"{name}/{mesh_name}/{routing}")
  if name == "all_to_all":
    # `check_stats` counts invalid ids over the 37 real tokens only: the 3 padding tokens
    # (id -1 on each slot) are not the caller's.
    check_stats(stats, ref.case[2], SHAPE["E"], m)
    if routing != "invalid_ids":
      assert int(stats["invalid_ids"]) == 0


@pytest.mark.parametrize(
  "name, mesh_name", [("all_gather", "8x1-auto"), ("all_to_all", "2x4-explicit")]
)
def test_k_equals_e(name, mesh_name):
  m = mesh(mesh_name)
  ref = reference("k_equals_e", key(SHAPE_K_EQUALS_E))
  _, _, stats = check(impl(name, m), ref, f"{name}/{mesh_name}")
  if name == "all_to_all":
    check_stats(stats, ref.case[2], SHAPE_K_EQUALS_E["E"], m)


# chunk_size=1: one slot per (source, destination) pair per round, many rounds; (3, 1): a
# bigger round 0 then single-slot overflow rounds.
CHUNKED = [(1, "8x1-explicit"), ((3, 1), "4x2-auto")]


@pytest.mark.parametrize("routing", MAIN_ROUTINGS)
@pytest.mark.parametrize("chunk_size, mesh_name", CHUNKED, ids=[f"{c}-{m}" for c, m in CHUNKED])
def test_chunk_sizes(chunk_size, mesh_name, routing):
  m = mesh(mesh_name)
  ref = reference(routing, key(SHAPE), num_devices=m.shape[ms.EXPERT])
  _, _, stats = check(
    impl("all_to_all", m, chunk_size), ref, f"chunk={chunk_size}/{mesh_name}/{routing}"
  )
  want = check_stats(stats, ref.case[2], SHAPE["E"], m, chunk_size)
  if routing == "one_expert":  # 10 items on one pair: 10 rounds of 1, or 3 + 7 rounds of 1
    assert want["rounds"] == (10 if chunk_size == 1 else 8)


@pytest.mark.parametrize("lower, upper", [(0, 5), (1, 5), (1, 1), (1, 0), (0, 0)])
def test_fori_while_runs_body_for_lower_to_upper(lower, upper):
  """The loop of the overflow rounds and of the tiled kernel: body(i, carry) for i = lower ..
  upper - 1 with a traced upper, `init` when the range is empty."""
  from moe_shard.sharding import fori_while

  def run(upper):
    return fori_while(lower, upper, lambda i, c: (c[0] * 10 + i, c[1] + 1), (0, 0))

  got = jax.jit(run)(jnp.int32(upper))
  want = (int("".join(map(str, range(lower, upper))) or 0), max(0, upper - lower))
  assert (int(got[0]), int(got[1])) == want


@pytest.mark.parametrize("mesh_name", ["2x4-explicit", "1x8-auto"])
@pytest.mark.parametrize("name", IMPLS)
def test_all_ids_invalid_give_exact_zeros(name, mesh_name):
  m = mesh(mesh_name)
  ref = reference("uniform", key(SHAPE))
  x_TD, w, experts_TK, weights_TK = ref.case
  E = SHAPE["E"]
  bad = np.array([-1, E, E + 3, -(2**31), 2**31 - 1], np.int32)
  experts_TK = jnp.asarray(np.resize(bad, experts_TK.shape))
  y, (dx, dw, dweights), stats = run(impl(name, m), x_TD, w, experts_TK, weights_TK, ref.ct)
  for what, got in [("y", y), ("dx", dx), ("dw", dw), ("dweights", dweights)]:
    np.testing.assert_array_equal(got, 0.0, err_msg=what)
  if name == "all_to_all":
    want = check_stats(stats, experts_TK, E, m)
    assert want["rounds"] == 1 and want["invalid_ids"] == experts_TK.size


@pytest.mark.parametrize("mesh_name", ["4x2-auto", "8x1-explicit"])
@pytest.mark.parametrize("name", IMPLS)
def test_nonfinite_values_stay_with_their_tokens(name, mesh_name):
  # A NaN token, or an expert full of Inf, changes only the tokens routed through it: no
  # padding slot, gathered copy or reduce-scatter spreads 0 * NaN to other tokens. Same
  # compiled program as the clean run, so the other rows must be bitwise equal.
  m = mesh(mesh_name)
  ref = reference("uniform", key(SHAPE))
  x_TD, w, experts_TK, weights_TK = ref.case
  fn = impl(name, m)
  # (Outputs on an Explicit mesh are indexed as NumPy arrays: a boolean mask is a gather
  # whose out_sharding JAX will not guess.)
  host = lambda out: jax.tree.map(np.asarray, out)
  clean_y, (clean_dx, _, _), _ = host(run(fn, *ref.case, ref.ct))
  t = 6
  y, (dx, _, _), _ = host(run(fn, x_TD.at[t, 1].set(jnp.nan), w, experts_TK, weights_TK, ref.ct))
  others = np.arange(SHAPE["T"]) != t
  np.testing.assert_array_equal(y[others], clean_y[others])
  np.testing.assert_array_equal(dx[others], clean_dx[others])
  assert np.all(np.isnan(y[t]))
  e = int(experts_TK[0, 0])
  y, _, _ = host(run(fn, x_TD, w.at[e].set(jnp.inf), experts_TK, weights_TK, ref.ct))
  routed = np.any(np.asarray(experts_TK) == e, axis=1)
  assert routed.any() and not routed.all()
  np.testing.assert_array_equal(y[~routed], clean_y[~routed])
  assert not np.any(np.isfinite(y[routed]))


# --------------------------------------------------------------------------- across meshes


@pytest.mark.parametrize("routing", ["uniform", "one_expert", "invalid_ids"])
@pytest.mark.parametrize("name", IMPLS)
def test_same_result_on_every_expert_axis(name, routing):
  # The same inputs on expert axes of 1, 2, 4 and 8 devices (and both axis types): the same
  # outputs and gradients within float32 tolerance, whatever the split.
  ref = reference(routing, key(SHAPE))
  grads = {
    mesh_name: run(impl(name, mesh(mesh_name)), *ref.case, ref.ct)[:2] for mesh_name in GRAD_MESHES
  }
  ys = {mesh_name: y for mesh_name, (y, _) in grads.items()}
  for mesh_name in FWD_MESHES:
    out = outputs(impl(name, mesh(mesh_name)), *ref.case)
    ys[mesh_name] = out[0] if isinstance(out, tuple) else out
  base_y, base_grads = grads["1x1-explicit"]
  for mesh_name, y in ys.items():
    assert_close(y, base_y, jnp.float32, f"{mesh_name} y")
  for mesh_name, (_, g) in grads.items():
    assert_tree_close(g, base_grads, jnp.float32, f"{mesh_name} grads")


@pytest.mark.parametrize("mesh_name", ["2x4-explicit", "4x2-auto"])
def test_two_runs_are_bitwise_identical(mesh_name):
  m = mesh(mesh_name)
  for routing in ("uniform", "one_device", "invalid_ids"):
    ref = reference(routing, key(SHAPE), num_devices=m.shape[ms.EXPERT])
    for name in IMPLS:
      first = run(impl(name, m), *ref.case, ref.ct)
      second = run(impl(name, m), *ref.case, ref.ct)
      jax.tree.map(np.testing.assert_array_equal, first, second)


def test_chunk_size_does_not_change_the_result_beyond_rounding():
  # Different chunkings change which round carries an item, not the sum (within tolerance).
  m = mesh("8x1-explicit")
  ref = reference("one_expert", key(SHAPE), num_devices=8)
  y_default = run(impl("all_to_all", m), *ref.case, ref.ct)[0]
  y_one = run(impl("all_to_all", m, 1), *ref.case, ref.ct)[0]
  assert_close(y_one, y_default, jnp.float32)


# --------------------------------------------------------------------------- calling conventions


def _place(case, m, spec_x, spec_w, spec_ids):
  x_TD, w, experts_TK, weights_TK = case
  put = lambda a, spec: jax.device_put(a, NamedSharding(m, spec))
  return (
    put(x_TD, spec_x),
    jax.tree.map(lambda leaf: put(leaf, spec_w), w),
    put(experts_TK, spec_ids),
    put(weights_TK, spec_ids),
  )


TOKENS = P((ms.EXPERT, ms.DATA))
PLACEMENTS = {
  # What the functions would do themselves: tokens over every axis, experts over "expert".
  "matching": (TOKENS, P(ms.EXPERT), TOKENS),
  # Placed, but not as shard_map wants them: must be resharded, not rejected.
  "other": (P(ms.DATA), P(), P()),
}


@pytest.mark.parametrize("placement", list(PLACEMENTS))
@pytest.mark.parametrize("name", IMPLS)
def test_jit_forward_with_placed_inputs(name, placement):
  # No set_mesh: the mesh argument is enough. Explicit axes: shard_map itself would reject
  # inputs whose sharding differs from its in_specs (Auto inputs are only constrained).
  mesh_name = "4x2-explicit"
  m = mesh(mesh_name)
  ref = reference("one_device", key(SHAPE), num_devices=m.shape[ms.EXPERT])
  placed = _place(ref.case, m, *PLACEMENTS[placement])
  y = outputs(impl(name, m, stats=False), *placed)
  assert isinstance(y, jax.Array)  # return_stats=False (default): the array alone
  assert_close(y, ref.oracle[0], jnp.float32, f"{name}/{mesh_name}/{placement}")
  assert y.sharding.mesh.shape == m.shape


# A call without jit of the caller's: padding, placement and trimming (T = 37) on an
# Explicit mesh, with inputs the caller did not place.


def test_eager_call_plain_inputs_explicit_mesh():
  # No jit, no set_mesh, plain arrays on the default device, top-1 ids int[T], weights=None.
  m = mesh("4x2-explicit")
  x_TD, w, experts_TK, _ = reference("one_expert", key(dict(SHAPE_PADDED, K=1))).case
  experts_T = experts_TK[:, 0]
  y, stats = ms.moe_all_to_all(x_TD, w, experts_T, mesh=m, return_stats=True)
  assert y.shape == (SHAPE_PADDED["T"], SHAPE["F"])
  assert_close(y, oracle.moe(x_TD, w, experts_T), jnp.float32)
  check_stats(stats, experts_TK, SHAPE["E"], m)
  assert int(stats["invalid_ids"]) == 0  # the 3 padding tokens are not counted
  assert type(stats["chunk_first"]) is int and type(stats["chunk_overflow"]) is int


@pytest.mark.parametrize("name", IMPLS)
def test_bfloat16(name):
  m = mesh("4x2-explicit")
  for routing in MAIN_ROUTINGS:
    ref = reference(routing, key(SHAPE), dtype="bfloat16", num_devices=m.shape[ms.EXPERT])
    y, (dx, dw, _), _ = check(impl(name, m), ref, f"{name}/bf16/{routing}")
    assert y.dtype == dx.dtype == dw.dtype == jnp.bfloat16


@pytest.mark.parametrize("name", IMPLS)
def test_gmm_impl_ragged_dot(name):
  # The other grouped matmul (`lax.ragged_dot`, TPU's native path) through the same dispatch.
  # Forward and backward (its gradient is JAX's transpose of ragged_dot, not the tiled
  # kernel's custom_vjp).
  m = mesh("4x2-auto")
  for routing in ("one_device", "invalid_ids"):
    ref = reference(routing, key(SHAPE), num_devices=m.shape[ms.EXPERT])
    _, _, stats = check(impl(name, m, gmm_impl="ragged_dot"), ref, f"{name}/{routing}")
    if name == "all_to_all":
      check_stats(stats, ref.case[2], SHAPE["E"], m)


# Meshes beyond (expert, data): one axis only, and an expert axis with another name that is
# not the first axis (tokens are then split data-major).
OTHER_MESHES = {
  "expert_only": lambda: jax.make_mesh((8,), (ms.EXPERT,), axis_types=(AxisType.Explicit,)),
  "ep_minor": lambda: jax.make_mesh((2, 4), ("batch", "ep"), axis_types=(AxisType.Auto,) * 2),
}


@pytest.mark.parametrize("mesh_kind", list(OTHER_MESHES))
@pytest.mark.parametrize("name", IMPLS)
def test_other_mesh_layouts(name, mesh_kind):
  # Outputs and gradients: the gradients' collectives (the reverse dispatch, the sums of
  # the replicated parameters' gradients over the other axes) name the axes too.
  m = OTHER_MESHES[mesh_kind]()
  axis = m.axis_names[-1]
  ref = reference("one_device", key(SHAPE), num_devices=m.shape[axis])
  _, _, stats = check(impl(name, m, expert_axis=axis), ref, f"{name}/{mesh_kind}")
  if name == "all_to_all":
    check_stats(stats, ref.case[2], SHAPE["E"], m, expert_axis=axis)


@pytest.mark.parametrize("name", IMPLS)
def test_weights_none_gradients(name):
  # weights=None (all ones) on a mesh: gradients of x and every leaf of w, no dweights.
  # (lax.ragged_dot compiles ~3x faster than the tiled kernel, which the cases above run.)
  m = mesh("2x4-auto")
  ref = reference("duplicate", key(SHAPE), ffn="swiglu", num_devices=m.shape[ms.EXPERT])
  x_TD, w, experts_TK, _ = ref.case
  fn = impl(name, m, stats=False, gmm_impl="ragged_dot")
  y, (dx, dw, dweights) = outputs_and_grads(fn, x_TD, w, experts_TK, None, ref.ct)
  assert dweights is None
  want_dx, want_dw, _ = oracle.moe_grads(x_TD, w, experts_TK, None, ref.ct)
  assert_close(y, oracle.moe(x_TD, w, experts_TK), jnp.float32, f"{name} y")
  assert_close(dx, want_dx, jnp.float32, f"{name} dx")
  assert_tree_close(dw, want_dw, jnp.float32, f"{name} dw")


# --------------------------------------------------------------------------- errors

FNS = {"all_gather": ms.moe_all_gather, "all_to_all": ms.moe_all_to_all}


def _args(E=8):
  return (
    np.zeros((8, 4), np.float32),
    np.zeros((E, 4, 6), np.float32),
    np.zeros((8, 2), np.int32),
    None,
  )


@pytest.mark.parametrize("name", IMPLS)
def test_experts_not_divisible_by_expert_axis(name):
  fn = FNS[name]
  with pytest.raises(
    ValueError,
    match=re.escape(f"moe_{name}: num_experts (6) must be divisible by the 'expert' axis size (4)"),
  ):
    trace(fn, *_args(E=6), mesh=mesh("4x2-explicit"))
  # SwiGLU: the expert count of the pytree, not of one matrix.
  w = ms.SwiGLU(*(np.zeros(s, np.float32) for s in [(3, 4, 6), (3, 4, 6), (3, 6, 4)]))
  with pytest.raises(
    ValueError,
    match=re.escape(f"moe_{name}: num_experts (3) must be divisible by the 'expert' axis size (2)"),
  ):
    trace(fn, _args()[0], w, _args()[2], None, mesh=mesh("2x4-auto"))


@pytest.mark.parametrize("name", IMPLS)
def test_expert_axis_not_in_mesh(name):
  with pytest.raises(
    ValueError,
    match=re.escape(
      f"moe_{name}: mesh must have the expert axis 'model' (got axes ('expert', 'data'))"
    ),
  ):
    trace(FNS[name], *_args(), mesh=mesh("4x2-auto"), expert_axis="model")


@pytest.mark.parametrize(
  "bad_mesh, type_name",
  [
    ("expert", "str"),
    ((4, 2), "tuple"),
  ],
  ids=["str", "tuple"],
)
@pytest.mark.parametrize("name", IMPLS)
def test_mesh_not_a_mesh(name, bad_mesh, type_name):
  # None means the mesh in scope and an AbstractMesh works under jit: tests/test_mesh_scope.py.
  with pytest.raises(
    TypeError,
    match=re.escape(
      f"moe_{name}: mesh must be a jax.sharding.Mesh, an AbstractMesh or None (got {type_name})"
    ),
  ):
    trace(FNS[name], *_args(), mesh=bad_mesh)


@pytest.mark.parametrize("name", IMPLS)
def test_bad_inputs_are_checked_like_the_references(name):
  # The shared input checks run first, naming this function.
  x_TD, w, experts_TK, _ = _args()
  with pytest.raises(
    ValueError,
    match=re.escape(f"moe_{name}: w's input dimension (5) must equal x's last dimension D (4)"),
  ):
    trace(FNS[name], x_TD, np.zeros((8, 5, 6), np.float32), experts_TK, None, mesh=mesh("4x2-auto"))
  with pytest.raises(
    TypeError, match=re.escape(f"moe_{name}: experts must have an integer dtype (got float32)")
  ):
    trace(FNS[name], x_TD, w, experts_TK.astype(np.float32), None, mesh=mesh("4x2-auto"))


BAD_CHUNKS = [0, -1, (1, 2, 3), (0, 1), (2, 0), True, (1.5, 1), 1.5]


@pytest.mark.parametrize("chunk_size", BAD_CHUNKS)
def test_bad_chunk_size(chunk_size):
  with pytest.raises(
    (TypeError, ValueError),
    match=re.escape(
      f"moe_all_to_all: chunk_size must be None, an int >= 1 or a pair of ints >= 1 "
      f"(got {chunk_size!r})"
    ),
  ):
    trace(ms.moe_all_to_all, *_args(), mesh=mesh("4x2-explicit"), chunk_size=chunk_size)


@pytest.mark.parametrize("mesh_name", ["4x2-auto", "1x1-explicit"])
@pytest.mark.parametrize("name", IMPLS)
def test_good_input_traces(name, mesh_name):
  # The baseline the error cases perturb is valid (so each error is the one named).
  out = trace(FNS[name], *_args(), mesh=mesh(mesh_name))
  assert out.shape == (8, 6) and out.dtype == jnp.float32


# --------------------------------------------------------------------------- hypothesis

HYPOTHESIS_MESHES = ["2x4-explicit", "8x1-auto", "4x2-auto", "1x8-explicit", "1x1-auto"]


@st.composite
def parallel_problems(draw):
  """(mesh name, routing, shape, ffn, chunk_size, seed): tiny shapes, awkward sizes first."""
  mesh_name = draw(st.sampled_from(HYPOTHESIS_MESHES))
  N = MESH_SHAPES[mesh_name.split("-")[0]][0]
  E = N * draw(st.sampled_from([1, 2]))
  K = draw(st.integers(1, min(E, 3)))
  T = draw(st.one_of(st.sampled_from([37, 1, 9]), st.integers(1, 40)))
  D = draw(st.sampled_from([3, 8, 1]))
  F = draw(st.sampled_from([5, 8, 1]))
  routing = draw(st.sampled_from([r for r in reversed(ROUTINGS) if feasible(r, E=E, K=K)]))
  ffn = draw(st.sampled_from(["linear", "swiglu"]))
  chunk_size = draw(st.sampled_from([None, 1, (3, 1), 2]))
  seed = draw(st.integers(0, 2**16))
  return mesh_name, routing, dict(T=T, D=D, F=F, E=E, K=K), ffn, chunk_size, seed


# Each example is a new shape: two new compiles with gradients (~8 s), hence 5 examples.
@hypothesis.settings(max_examples=5)
@hypothesis.given(parallel_problems())
def test_matches_oracle_property(problem):
  # Outputs, gradients (x, every leaf of w, weights) and the all_to_all stats.
  mesh_name, routing, shape, ffn, chunk_size, seed = problem
  for event in (
    f"mesh {mesh_name}",
    f"routing {routing}",
    f"ffn {ffn}",
    f"chunk_size {chunk_size}",
    f"K {shape['K']}",
    "T divides the mesh" if shape["T"] % 8 == 0 else "T padded",
  ):
    hypothesis.event(event)
  m = mesh(mesh_name)
  case = make_case(routing, seed=seed, ffn=ffn, num_devices=m.shape[ms.EXPERT], **shape)
  want = oracle.moe(*case)
  ct = cotangent(want.shape, jnp.float32, seed)
  want_grads = oracle.moe_grads(*case, ct)
  for name, fn in [
    ("all_to_all", impl("all_to_all", m, chunk_size)),
    ("all_gather", impl("all_gather", m)),
  ]:
    y, grads, stats = run(fn, *case, ct)
    assert_close(y, want, jnp.float32, f"{name} {problem}")
    for what, got, w in zip(("dx", "dw", "dweights"), grads, want_grads):
      assert_tree_close(got, w, jnp.float32, f"{name} {what} {problem}")
    if name == "all_to_all":
      check_stats(stats, case[2], shape["E"], m, chunk_size)


# --------------------------------------------------------------------------- backward rounds


@pytest.mark.parametrize("gmm_impl", ["tiled", "ragged_dot"])
def test_all_to_all_grads_over_overflow_rounds_match_the_oracle(gmm_impl):
  """Round 0 is differentiated by JAX, the overflow rounds by the replaying custom_vjp: with
  many rounds, a SwiGLU and an FFN that uses one leaf twice, the gradients of sum(sin(y))
  equal the float64 oracle's (cotangent cos(y))."""
  T, D, F, E, K = 128, 8, 12, 16, 2
  rng = np.random.default_rng(7)
  x = jnp.asarray(rng.normal(size=(T, D)), jnp.float32)
  logits = jnp.asarray(rng.normal(size=(T, E)), jnp.float32).at[:, 0].add(3.0)  # skewed
  routing = ms.top_k_routing(logits, K)
  w = [
    jnp.asarray(rng.normal(size=s) / np.sqrt(s[1]), jnp.float32)
    for s in [(E, D, F), (E, D, F), (E, F, D), (E, D, D)]
  ]
  ffns = {"swiglu": ms.SwiGLU(*w[:3]), "tied": TiedFFN(w[3])}
  m = mesh("8x1-auto")
  for name, ffn in ffns.items():

    def loss(f, x, g):
      y = ms.moe_all_to_all(
        x, f, routing.experts_TK, g, mesh=m, chunk_size=(4, 4), gmm_impl=gmm_impl
      )
      return jnp.sum(jnp.sin(y))

    got = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(ffn, x, routing.weights_TK)
    ct = np.cos(oracle.moe(x, ffn, routing.experts_TK, routing.weights_TK))
    dx, dffn, dweights = oracle.moe_grads(x, ffn, routing.experts_TK, routing.weights_TK, ct)
    want = (dffn, dx, dweights)
    _, stats = jax.jit(
      lambda f: ms.moe_all_to_all(
        x, f, routing.experts_TK, routing.weights_TK, mesh=m, chunk_size=(4, 4), return_stats=True
      )
    )(ffn)
    assert int(stats["rounds"]) >= 3, name
    assert_tree_close(got, want, jnp.float32)


@pytest.mark.parametrize("name", IMPLS)
@pytest.mark.parametrize("mesh_name,summed", [("8x1-auto", False), ("4x2-auto", True)])
def test_weight_gradients_are_all_reduced_only_over_axes_of_size_above_one(name, mesh_name, summed):
  """The expert weights are replicated over the data axis, so their gradients are summed
  there; over a data axis of size 1 that sum would be an all-reduce copying every weight
  gradient for nothing (shard_map transposes a replicated input into a psum)."""
  m = mesh(mesh_name)
  T, D, F, E, K = 16, 4, 6, 8, 2
  x = jnp.ones((T, D), jnp.float32)
  w = jnp.ones((E, D, F), jnp.float32)
  experts = (jnp.arange(T * K, dtype=jnp.int32) % E).reshape(T, K)
  fn = impl(name, m, stats=False)
  hlo = (
    jax.jit(jax.grad(lambda w: jnp.sum(fn(x, w, experts)), argnums=0)).lower(w).compile().as_text()
  )
  weight_sums = [
    line
    for line in hlo.splitlines()
    if " all-reduce(" in line and f",{D},{F}]" in line.split(" all-reduce(")[0]
  ]
  assert bool(weight_sums) == summed, weight_sums
