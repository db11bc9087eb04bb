"""The ragged_all_to_all dispatch (`moe_ragged_all_to_all`) and its CPU emulation.

XLA:CPU has no ragged-all-to-all, so on CPU the dispatch runs `ragged_all_to_all_emulated`
(the primitive's semantics from `lax.all_to_all` of padded buffers). That emulation is
checked first against a NumPy model of the primitive written from its docstring; then the
dispatch (all of whose logic runs on CPU through the emulation) against the float64 oracle,
outputs and gradients, on the adversarial routings of `tests/cases.py`, both axis types, a
data x expert mesh and forced multi-round cases. Last, the TPU program is compiled (v5e 2x4,
libtpu) and must hold the real primitive and no emulation.

The helpers of `tests/test_parallel.py` (meshes, cached references, jitted `run`) are
reused, so each (mesh, shape, capacity) compiles once for every routing.
"""

import dataclasses
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
from cases import ROUTINGS, assert_close, feasible, make_case, outputs, trace
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P
from test_parallel import (
  MAIN_ROUTINGS,
  MESH_SHAPES,
  SHAPE,
  SHAPE_K_EQUALS_E,
  SHAPE_PADDED,
  check,
  check_forward,
  key,
  mesh,
  reference,
  run,
)

import moe_shard as ms
from moe_shard import plan
from moe_shard.parallel import ragged_all_to_all_emulated


@pytest.fixture(scope="module", autouse=True)
def _eight_devices(devices):
  del devices  # conftest's fixture asserts the 8 simulated devices


# --------------------------------------------------------------------------- the emulation


def ragged_all_to_all_model(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes):
  """NumPy model of `lax.ragged_all_to_all` over a whole axis, from its docstring.

  Every argument is stacked over the N devices of the axis (leading dimension N). Slice i of
  device d (J = len(offsets) / N slices per device) goes to device i // J, which writes it
  at the offset the *sender* gave for it; the receiver's `recv_sizes` must agree.
  """
  result = np.array(output, copy=True)
  N, I = np.shape(input_offsets)
  J = I // N
  for src in range(N):
    for i in range(I):
      dst, j = divmod(i, J)
      n = send_sizes[src][i]
      assert recv_sizes[dst][src * J + j] == n, "send and receive sizes disagree"
      rows = operand[src][input_offsets[src][i] : input_offsets[src][i] + n]
      result[dst][output_offsets[src][i] : output_offsets[src][i] + n] = rows
  return result


def random_exchange(rng, N, J, rows_in, rows_out, tail=()):
  """Random in-range arguments: each device's slices for one peer disjoint in the output."""
  send = np.zeros((N, N * J), np.int32)
  in_off = np.zeros((N, N * J), np.int32)
  out_off = np.zeros((N, N * J), np.int32)
  for dst in range(N):
    # The receiver's rows split among its N * J incoming slices, with gaps.
    cuts = np.sort(rng.integers(0, rows_out + 1, size=2 * N * J)).reshape(N * J, 2)
    for k, (a, b) in zip(rng.permutation(N * J), cuts):
      src, j = divmod(int(k), J)
      n = min(int(b - a), rows_in)
      send[src, dst * J + j] = n
      out_off[src, dst * J + j] = a
      in_off[src, dst * J + j] = rng.integers(0, rows_in - n + 1)
  recv = np.zeros_like(send)
  for src in range(N):
    for dst in range(N):
      recv[dst, src * J : (src + 1) * J] = send[src, dst * J : (dst + 1) * J]
  operand = rng.normal(size=(N, rows_in) + tail).astype(np.float32)
  output = rng.normal(size=(N, rows_out) + tail).astype(np.float32)  # kept where not written
  return operand, output, in_off, send, out_off, recv


@functools.cache
def emulated(n, rows_per_peer=None):
  m = jax.make_mesh((n,), ("x",), axis_types=(AxisType.Auto,), devices=jax.devices()[:n])

  def body(*args):
    args = [a[0] for a in args]  # drop the device dimension
    return ragged_all_to_all_emulated(*args, axis_name="x", rows_per_peer=rows_per_peer)[None]

  return jax.jit(jax.shard_map(body, mesh=m, in_specs=P("x"), out_specs=P("x")))


def test_emulation_docstring_example():
  # The example of `lax.ragged_all_to_all`'s docstring, axis of size 2.
  args = (
    [[1, 2, 2], [3, 4, 0]],
    [[0, 0, 0, 0], [0, 0, 0, 0]],
    [[0, 1], [0, 1]],
    [[1, 2], [1, 1]],
    [[0, 0], [1, 2]],
    [[1, 1], [2, 1]],
  )
  args = [np.asarray(a, np.float32 if i < 2 else np.int32) for i, a in enumerate(args)]
  got = emulated(2)(*args)
  np.testing.assert_array_equal(got, [[1, 3, 0, 0], [2, 2, 4, 0]])
  np.testing.assert_array_equal(got, ragged_all_to_all_model(*args))


@pytest.mark.parametrize(
  "N, J, rows_in, rows_out, tail",
  [
    (8, 1, 6, 9, ()),  # one slice per peer
    (8, 3, 5, 20, (2,)),  # three slices per peer (one per local expert), trailing dims
    (4, 2, 1, 3, (2, 3)),  # tiny buffers
  ],
)
@pytest.mark.parametrize("seed", [0, 1])
def test_emulation_matches_numpy_model(N, J, rows_in, rows_out, tail, seed):
  args = random_exchange(np.random.default_rng([seed, N, J]), N, J, rows_in, rows_out, tail)
  want = ragged_all_to_all_model(*args)
  np.testing.assert_array_equal(emulated(N)(*args), want)
  # A tighter bound on the rows a device sends a peer: the same, when the sizes meet it.
  bound = int(max(args[3].reshape(N, N, J).sum(axis=2).max(), 1))
  np.testing.assert_array_equal(emulated(N, bound)(*args), want)


def test_emulation_gradient_is_the_reversed_exchange():
  # d(sum(result * ct)) / d operand: each sent row gets the cotangent of where it landed;
  # d / d output: the cotangent where nothing was written.
  N, J = 4, 2
  args = random_exchange(np.random.default_rng(7), N, J, 5, 8)
  ct = np.random.default_rng(8).normal(size=args[1].shape).astype(np.float32)
  m = jax.make_mesh((N,), ("x",), axis_types=(AxisType.Auto,), devices=jax.devices()[:N])

  def loss(operand, output, *sizes):
    def body(a, b, *rest):
      y = ragged_all_to_all_emulated(a[0], b[0], *(r[0] for r in rest), axis_name="x")
      return y[None]

    y = jax.shard_map(body, mesh=m, in_specs=P("x"), out_specs=P("x"))(operand, output, *sizes)
    return jnp.sum(y * ct)

  d_operand, d_output = jax.jit(jax.grad(loss, argnums=(0, 1)))(*args)
  operand, output, in_off, send, out_off, _ = args
  want_operand = np.zeros_like(operand)
  written = np.zeros(output.shape, bool)
  for src in range(N):
    for i in range(N * J):
      dst, n = i // J, send[src, i]
      want_operand[src, in_off[src, i] : in_off[src, i] + n] += ct[
        dst, out_off[src, i] : out_off[src, i] + n
      ]
      written[dst, out_off[src, i] : out_off[src, i] + n] = True
  np.testing.assert_allclose(d_operand, want_operand, rtol=1e-6)
  np.testing.assert_allclose(d_output, np.where(written, 0, ct), rtol=1e-6)


# --------------------------------------------------------------------------- the dispatch


@functools.cache
def ragged(mesh_, capacity=None, stats=True, expert_axis=ms.EXPERT):
  """The same partial for the same arguments (a static argument of `run`/`outputs`)."""
  return functools.partial(
    ms.moe_ragged_all_to_all,
    mesh=mesh_,
    expert_axis=expert_axis,
    recv_capacity=capacity,
    return_stats=stats,
  )


def expected_stats(experts_TK, E, mesh_, capacity=None, expert_axis=ms.EXPERT):
  """The ragged dispatch's statistics, counted on the host.

  Tokens padded with id -1 to a multiple of the device count, split in order over the
  devices (device index = its position in P(all axes)); device d receives the valid items
  of the devices sharing its other-axes coordinates that route to its L experts. Rounds:
  one of C rows (T_dev K + 4 sqrt(T_dev K), up to a multiple of 8, or of 512 from 4096
  up), then rounds of C while more than C / 4 (up to a multiple of 8) of the fullest
  receiver's items remain, then at most one of C / 4; an explicit capacity: C each.
  """
  ids_TK = np.asarray(experts_TK).astype(np.int64).reshape(len(experts_TK), -1)
  T = ids_TK.shape[0]
  devices, N = mesh_.size, mesh_.shape[expert_axis]
  L = E // N
  ids_SI = np.pad(ids_TK, ((0, -T % devices), (0, 0)), constant_values=-1).reshape(devices, -1)
  valid_SI = (ids_SI >= 0) & (ids_SI < E)
  # Expert-axis position and other-axes coordinates of each device, in token order.
  coords = np.indices(mesh_.devices.shape).reshape(mesh_.devices.ndim, -1)
  axis = mesh_.axis_names.index(expert_axis)
  e_pos = coords[axis]
  other = [tuple(c) for c in np.delete(coords, axis, axis=0).T]
  received = np.zeros(devices, int)
  for d in range(devices):
    for s in range(devices):
      if other[s] == other[d]:
        received[d] += np.sum(valid_SI[s] & (ids_SI[s] // L == e_pos[d]))
  n = ids_SI.shape[1]  # T_dev * K
  C = max(8, 8 * math.ceil((n + math.ceil(4 * math.sqrt(n))) / 8))
  C = C if C < 4096 else 512 * math.ceil(C / 512)
  most = max(8, 8 * math.ceil(N * n / 8))  # every source's items to this device
  C = capacity or (most if most <= 128 or most < C else C)  # 128: plan.DECODE_ROWS
  last = capacity or max(8, 8 * math.ceil(C / 32))  # C / 4 up to a multiple of 8
  # Big rounds of C while more than `last` rows remain, then at most one of `last`.
  extra = max(received.max() - C, 0)
  n_big = -(-max(extra - last, 0) // C)
  valid_TK = (ids_TK >= 0) & (ids_TK < E)
  return dict(
    rounds=1 + n_big + int(extra > n_big * C),
    sent_items=valid_SI.sum(axis=1),
    received_items=received,
    expert_load=np.bincount(ids_TK[valid_TK], minlength=E),
    invalid_ids=int(np.sum(~valid_TK)),
    capacity=C,
    capacity_overflow=C,
    capacity_last=last,
  )


def check_stats(stats, experts_TK, E, mesh_, capacity=None, expert_axis=ms.EXPERT):
  want = expected_stats(experts_TK, E, mesh_, capacity, expert_axis)
  assert set(stats) == set(want), sorted(stats)
  for name, value in want.items():
    np.testing.assert_array_equal(np.asarray(stats[name]), value, err_msg=name)
  assert int(np.sum(stats["sent_items"])) == int(np.sum(stats["received_items"]))
  return want


# Gradients on one mesh of each axis type; forward (with stats) on another of each.
GRAD_MESHES = ["8x1-explicit", "4x2-auto"]
FWD_MESHES = ["2x4-auto", "1x8-explicit"]


@pytest.mark.parametrize("routing", MAIN_ROUTINGS)
@pytest.mark.parametrize("mesh_name", GRAD_MESHES)
def test_matches_references(mesh_name, routing):
  m = mesh(mesh_name)
  ref = reference(routing, key(SHAPE), num_devices=m.shape[ms.EXPERT])
  _, _, stats = check(ragged(m), ref, f"ragged/{mesh_name}/{routing}")
  want = check_stats(stats, ref.case[2], SHAPE["E"], m)
  if routing == "one_expert":
    # The 80 items of each data column's devices go to one device. The most a device can
    # receive, N * 5 tokens * 2 slots (80 on 8x1, 40 on 4x2), is at most 128 rows
    # (`plan.DECODE_ROWS`), so round 0 holds it: one round. test_multi_round runs many.
    assert want["rounds"] == 1


@pytest.mark.parametrize("routing", MAIN_ROUTINGS)
@pytest.mark.parametrize("mesh_name", FWD_MESHES)
def test_outputs_match_references(mesh_name, routing):
  m = mesh(mesh_name)
  ref = reference(routing, key(SHAPE), num_devices=m.shape[ms.EXPERT])
  _, stats = check_forward(ragged(m), ref, f"ragged/{mesh_name}/{routing}")
  check_stats(stats, ref.case[2], SHAPE["E"], m)


# Forced multi-round: a receive buffer of 1 row (one item per round: up to 80 rounds) and of
# 3 rows, with gradients through the custom_vjp's replayed rounds.
MULTI_ROUND = [(1, "8x1-auto"), (3, "2x4-explicit")]


@pytest.mark.parametrize("routing", MAIN_ROUTINGS)
@pytest.mark.parametrize(
  "capacity, mesh_name", MULTI_ROUND, ids=[f"C{c}-{m}" for c, m in MULTI_ROUND]
)
def test_multi_round(capacity, mesh_name, routing):
  m = mesh(mesh_name)
  ref = reference(routing, key(SHAPE), num_devices=m.shape[ms.EXPERT])
  _, _, stats = check(ragged(m, capacity), ref, f"ragged/C{capacity}/{mesh_name}/{routing}")
  want = check_stats(stats, ref.case[2], SHAPE["E"], m, capacity)
  if routing == "one_expert":  # 80 items to the device of one expert
    assert want["rounds"] == -(-80 * m.shape[ms.EXPERT] // 8 // capacity)


@pytest.mark.parametrize("mesh_name", ["1x1-auto", "1x8-explicit"])
def test_one_device_expert_axis_exchanges_nothing(mesh_name):
  # Every device holds every expert: the items take the local ragged path, one round even
  # with a 2-row capacity (which would need many), no exchange in the program; outputs and
  # gradients against the oracle and the masked scan, stats against the host's count.
  m = mesh(mesh_name)
  ref = reference("one_expert", key(SHAPE), num_devices=1)
  _, _, stats = check(ragged(m, 2), ref, f"ragged/C2/{mesh_name}")
  assert int(stats["rounds"]) == 1
  items = np.asarray(stats["sent_items"])
  np.testing.assert_array_equal(items, np.asarray(stats["received_items"]))
  ids = np.asarray(ref.case[2]).reshape(-1)
  load = np.bincount(ids[(ids >= 0) & (ids < SHAPE["E"])], minlength=SHAPE["E"])
  np.testing.assert_array_equal(np.asarray(stats["expert_load"]), load)
  assert int(items.sum()) == int(load.sum()) > 0
  hlo = jax.jit(ragged(m, 2)).lower(*ref.case[:4]).compile().as_text()
  assert "all-to-all" not in hlo, mesh_name


def test_data_by_expert_mesh():
  # The expert axis second: tokens are split data-major; Explicit axes (make_mesh's default).
  m = jax.make_mesh((2, 4), (ms.DATA, ms.EXPERT))
  for routing in MAIN_ROUTINGS:
    ref = reference(routing, key(SHAPE), num_devices=4)
    _, _, stats = check(ragged(m), ref, f"ragged/data x expert/{routing}")
    check_stats(stats, ref.case[2], SHAPE["E"], m)


@pytest.mark.parametrize("routing", ["uniform", "one_expert", "invalid_ids"])
def test_tokens_not_divisible(routing):
  m = mesh("4x2-explicit")
  ref = reference(routing, key(SHAPE_PADDED), num_devices=4)
  _, _, stats = check(ragged(m), ref, f"ragged/T=37/{routing}")
  check_stats(stats, ref.case[2], SHAPE["E"], m)  # the 3 padding tokens' ids not counted


def test_k_equals_e():
  m = mesh("2x4-explicit")
  ref = reference("k_equals_e", key(SHAPE_K_EQUALS_E))
  _, _, stats = check(ragged(m), ref, "ragged/K=E")
  check_stats(stats, ref.case[2], SHAPE_K_EQUALS_E["E"], m)


def test_swiglu_bfloat16_under_set_mesh():
  # SwiGLU in bfloat16 on an Explicit mesh, called as a model would (inside jax.set_mesh).
  m = mesh("2x4-explicit")
  for routing in ("uniform", "one_device", "invalid_ids"):
    ref = reference(routing, key(SHAPE), ffn="swiglu", dtype="bfloat16", num_devices=2)
    with jax.set_mesh(m):
      y, (dx, dw, _), _ = check(ragged(m), ref, f"ragged/swiglu/bf16/{routing}")
    assert isinstance(dw, ms.SwiGLU) and y.dtype == dx.dtype == jnp.bfloat16


def test_all_ids_invalid_give_exact_zeros():
  m = mesh("4x2-auto")
  ref = reference("uniform", key(SHAPE))
  x_TD, w, experts_TK, weights_TK = ref.case
  bad = np.array([-1, SHAPE["E"], -(2**31), 2**31 - 1], np.int32)
  experts_TK = jnp.asarray(np.resize(bad, experts_TK.shape))
  y, grads, stats = run(ragged(m), x_TD, w, experts_TK, weights_TK, ref.ct)
  for what, got in zip(("y", "dx", "dw", "dweights"), (y, *grads)):
    np.testing.assert_array_equal(got, 0.0, err_msg=what)
  assert int(stats["rounds"]) == 1 and int(stats["invalid_ids"]) == experts_TK.size


def test_eager_call_top1_no_weights():
  # No jit of the caller's, plain arrays, ids int[T], weights None, T = 37.
  m = mesh("8x1-explicit")
  x_TD, w, experts_TK, _ = reference("one_device", key(dict(SHAPE_PADDED, K=1))).case
  y, stats = ms.moe_ragged_all_to_all(x_TD, w, experts_TK[:, 0], mesh=m, return_stats=True)
  assert_close(y, oracle.moe(x_TD, w, experts_TK[:, 0]), jnp.float32)
  assert type(stats["capacity"]) is int and type(stats["capacity_overflow"]) is int
  assert int(stats["invalid_ids"]) == 0
  y_only = ms.moe_ragged_all_to_all(x_TD, w, experts_TK[:, 0], mesh=m)
  assert isinstance(y_only, jax.Array)


def test_layer_with_ragged_dispatch():
  # The layer's dispatch table entry, with a receive buffer small enough for several rounds.
  m = mesh("4x2-auto")
  kw = dict(d_model=8, d_ff=16, num_experts=8, top_k=2)
  x_BSD = jax.random.normal(jax.random.key(0), (2, 20, 8))
  params = ms.init_moe_params(jax.random.key(1), ms.MoEConfig(**kw), mesh=m)
  outs = {}
  for impl, extra in [("ragged_dot", {}), ("ragged_all_to_all", dict(recv_capacity=4))]:
    cfg = ms.MoEConfig(impl=impl, **kw, **extra)
    fn = jax.jit(
      jax.value_and_grad(lambda p, x, cfg=cfg: jnp.sum(ms.moe_layer(p, x, cfg, mesh=m)[0] ** 2))
    )
    outs[impl] = fn(params, x_BSD)
  assert_close(outs["ragged_all_to_all"][0], outs["ragged_dot"][0], jnp.float32)
  jax.tree.map(lambda a, b: assert_close(a, b, jnp.float32), *outs.values())


@st.composite
def ragged_problems(draw):
  """(mesh name, routing, shape, ffn, capacity, seed): tiny shapes, awkward sizes first."""
  mesh_name = draw(st.sampled_from(["2x4-explicit", "8x1-auto", "4x2-auto"]))
  N = MESH_SHAPES[mesh_name.split("-")[0]][0]
  E = N * draw(st.sampled_from([1, 2]))
  K = draw(st.integers(1, min(E, 3)))
  T = draw(st.one_of(st.sampled_from([37, 1, 9]), st.integers(1, 40)))
  routing = draw(st.sampled_from([r for r in reversed(ROUTINGS) if feasible(r, E=E, K=K)]))
  shape = dict(T=T, D=draw(st.sampled_from([3, 8])), F=draw(st.sampled_from([5, 1])), E=E, K=K)
  return (
    mesh_name,
    routing,
    shape,
    draw(st.sampled_from(["linear", "swiglu"])),
    draw(st.sampled_from([None, 1, 2, 5])),
    draw(st.integers(0, 2**16)),
  )


@hypothesis.settings(max_examples=4)  # each example is a new shape: a new compile
@hypothesis.given(ragged_problems())
def test_matches_oracle_property(problem):
  mesh_name, routing, shape, ffn, capacity, seed = problem
  m = mesh(mesh_name)
  case = make_case(routing, seed=seed, ffn=ffn, num_devices=m.shape[ms.EXPERT], **shape)
  y, stats = outputs(ragged(m, capacity), *case)
  assert_close(y, oracle.moe(*case), jnp.float32, f"ragged {problem}")
  check_stats(stats, case[2], shape["E"], m, capacity)


# --------------------------------------------------------------------------- impl="auto"


def test_auto_is_ragged_on_tpu_and_chunked_on_cpu():
  cfg = ms.MoEConfig(d_model=8, d_ff=16, num_experts=8, top_k=2)
  assert ms.choose_impl(cfg, mesh("4x2-auto")) == "all_to_all"  # CPU devices
  assert ms.choose_impl(cfg, mesh("1x8-auto")) == "ragged_dot"  # one device on the axis
  assert ms.choose_impl(cfg) == "ragged_dot"
  pytest.importorskip("libtpu")
  from bench.reading import tpu

  tpu_mesh = jax.sharding.Mesh(np.array(tpu.devices("v5e:2x4")).reshape(4, 2), (ms.EXPERT, ms.DATA))
  assert ms.choose_impl(cfg, tpu_mesh) == "ragged_all_to_all"
  # At decode sizes all_to_all, unless a placement's replicas take a device's own items.
  assert ms.choose_impl(cfg, tpu_mesh, tokens=8) == "all_to_all"
  assert ms.choose_impl(cfg, tpu_mesh, tokens=8, replicated=True) == "ragged_all_to_all"
  assert ms.choose_impl(cfg, mesh("4x2-auto"), tokens=8, replicated=True) == "all_to_all"


@pytest.mark.parametrize(
  "platform, expert_devices, tokens, want",
  [
    ("tpu", 8, None, "ragged_all_to_all"),  # tokens not known: the rule for many
    ("tpu", 8, 4096, "ragged_all_to_all"),  # training: 32768 tokens on 8 chips
    ("tpu", 8, 65, "ragged_all_to_all"),  # one past DECODE_TOKENS
    ("tpu", 8, 64, "all_to_all"),  # decode: at most 64 tokens per chip
    ("tpu", 8, 8, "all_to_all"),
    ("cuda", 4, 1, "all_to_all"),
    ("cuda", 4, 1000, "ragged_all_to_all"),
    ("cpu", 8, 4096, "all_to_all"),  # no ragged collective on CPU, whatever the tokens
    ("cpu", 8, 8, "all_to_all"),
    ("tpu", 1, 8, "ragged_dot"),  # one device on the expert axis
    ("tpu", 1, None, "ragged_dot"),
  ],
)
def test_auto_rule(platform, expert_devices, tokens, want):
  from moe_shard.exchange_rule import DECODE_TOKENS, auto_impl

  assert DECODE_TOKENS == 64
  assert auto_impl(platform, expert_devices, tokens) == want


@pytest.mark.parametrize(
  "rows, weight_bytes, want",
  [
    (256, 2.0, "all_to_all"),  # one bf16 expert a chip at 64 tokens (Mixtral, K=2): 128 * 2
    (257, 2.0, "ragged_all_to_all"),
    (256, 1.0, "ragged_all_to_all"),  # the same in int8: the padded rows cost FLOPs
    (128, 1.0, "all_to_all"),
    (48, 0.5 + 1 / 32, "all_to_all"),  # 16 mxfp4 experts a chip
  ],
)
def test_auto_rule_at_decode_weighs_the_buffer_against_the_weights(rows, weight_bytes, want):
  from moe_shard.exchange_rule import DECODE_ROWS_PER_WEIGHT_BYTE, auto_impl

  assert DECODE_ROWS_PER_WEIGHT_BYTE == 128
  got = auto_impl("tpu", 8, 64, rows_per_expert=rows, weight_bytes=weight_bytes)
  assert got == want
  # Past DECODE_TOKENS the buffer does not matter; on CPU there is no ragged collective.
  assert auto_impl("tpu", 8, 65, rows_per_expert=1, weight_bytes=weight_bytes) == (
    "ragged_all_to_all"
  )
  assert auto_impl("cpu", 8, 64, rows_per_expert=rows, weight_bytes=weight_bytes) == "all_to_all"


@pytest.mark.parametrize("tokens", [None, 65, 4096])
def test_auto_rule_past_decode_takes_all_to_all_above_the_ridge(tokens):
  """Past decode sizes the chip's ridge point (FLOP/s per HBM byte/s) picks the exchange:
  at or below `STEP_RIDGE` the ragged dispatch's exact rows, above it all_to_all's fewer
  bytes, on TPUs; no ridge (unknown chips) and GPUs, whatever their ridge, keep the ragged
  dispatch, and CPU has no ragged collective. Decode sizes are priced apart."""
  from moe_shard.exchange_rule import STEP_RIDGE, auto_impl

  assert 240.5 < STEP_RIDGE < 312.6  # TPU v5e's ridge, TPU7x's (bench/results/tpu_*_step)
  assert auto_impl("tpu", 8, tokens, ridge=STEP_RIDGE) == "ragged_all_to_all"
  assert auto_impl("tpu", 8, tokens, ridge=STEP_RIDGE * (1 + 1e-9)) == "all_to_all"
  assert auto_impl("tpu", 8, tokens, ridge=None) == "ragged_all_to_all"
  assert auto_impl("cuda", 8, tokens, ridge=1e9) == "ragged_all_to_all"
  assert auto_impl("cuda", 8, tokens, ridge=1.0) == "ragged_all_to_all"
  assert auto_impl("cpu", 8, tokens, ridge=1.0) == "all_to_all"
  assert auto_impl("tpu", 1, tokens, ridge=1e9) == "ragged_dot"
  times = {"all_to_all": 2e-4, "ragged_all_to_all": 1e-4}
  assert auto_impl("tpu", 8, 64, decode_times=times, ridge=1e9) == "ragged_all_to_all"


@pytest.mark.parametrize(
  "topology, ridge, want",
  [
    ("v5e:2x4", 197 / 0.819, "ragged_all_to_all"),
    ("v5p:2x2x2", 459 / 2.765, "ragged_all_to_all"),
    ("v6e:2x4", 918 / 1.638, "all_to_all"),
    ("tpu7x:2x2x1", 2307 / 7.38, "all_to_all"),
  ],
)
def test_choose_impl_past_decode_by_the_chips_ridge(topology, ridge, want):
  """`choose_impl` reads the ridge from the mesh's chips' published peaks, past decode
  sizes only; on a placement the ragged dispatch whatever the chip."""
  pytest.importorskip("libtpu")
  from bench.reading import tpu
  from moe_shard.exchange_rule import chip_ridge

  devices = np.array(tpu.devices(topology)).reshape(8, 1)
  tpu_mesh = jax.sharding.Mesh(devices, (ms.EXPERT, ms.DATA))
  cfg = ms.MoEConfig(d_model=2048, d_ff=4096, num_experts=64, top_k=2)
  assert chip_ridge(tpu_mesh, ms.EXPERT) == pytest.approx(ridge, rel=1e-9)
  assert ms.choose_impl(cfg, tpu_mesh, tokens=4096) == want
  assert ms.choose_impl(cfg, tpu_mesh) == want  # tokens not known: the rule for many
  assert ms.choose_impl(cfg, tpu_mesh, tokens=4096, replicated=True) == "ragged_all_to_all"
  assert chip_ridge(mesh("8x1-auto"), ms.EXPERT) is None  # CPU: no published figures


def test_auto_rule_takes_the_smaller_decode_estimate():
  from moe_shard.exchange_rule import auto_impl

  times = {"all_to_all": 1e-4, "ragged_all_to_all": 1e-4}
  assert auto_impl("tpu", 8, 8, decode_times=times) == "all_to_all"  # a tie: fewer collectives
  times["ragged_all_to_all"] = 1e-4 * (1 - 1e-9)
  assert auto_impl("tpu", 8, 8, decode_times=times) == "ragged_all_to_all"
  times = {"all_to_all": 1e-4, "ragged_all_to_all": 2e-4}
  # Whatever the padded rows: the estimate holds their FLOPs.
  got = auto_impl("tpu", 8, 64, rows_per_expert=1e6, weight_bytes=1, decode_times=times)
  assert got == "all_to_all"
  assert auto_impl("tpu", 8, 65, decode_times=times) == "ragged_all_to_all"  # not decode
  assert auto_impl("cpu", 8, 8, decode_times={"all_to_all": 1.0, "ragged_all_to_all": 0.0}) == (
    "all_to_all"  # no ragged collective on CPU
  )


@pytest.mark.parametrize("D, want", [(384, "all_to_all"), (512, "ragged_all_to_all")])
def test_decode_rule_at_and_past_its_threshold(D, want):
  """Qwen3-like routing (E=128, K=8) at 8 tokens per chip of a v5e 2x4: all_to_all sends and
  receives 8 x 24 slots, the ragged dispatch sends its 64 items and receives 96 rows, so it
  moves 224 rows fewer through `ROW_PASSES` passes and waits on one collective more (4 us:
  four ICI hops). Both read the same weights and are HBM-bound (the rows' FLOPs are far
  below the weights' bytes), so the ragged dispatch wins past 16 * 224 * D * 2 bytes =
  4 us * 819 GB/s, D = 457."""
  pytest.importorskip("libtpu")
  from bench.reading import tpu
  from moe_shard.exchange_rule import ROW_PASSES, decode_estimates

  assert ROW_PASSES == 16
  devices = np.array(tpu.devices("v5e:2x4")).reshape(8, 1)
  tpu_mesh = jax.sharding.Mesh(devices, (ms.EXPERT, ms.DATA))
  cfg = ms.MoEConfig(d_model=D, d_ff=128, num_experts=128, top_k=8, param_dtype=jnp.bfloat16)
  assert 8 * plan.default_chunks(8, 8, 8).first == 192
  assert plan.default_capacity(8, 8, None, 8, 16).first == 96
  t = decode_estimates(cfg, tpu_mesh, 8)
  saved = 16 * (2 * 192 - 64 - 96) * D * 2 / 819e9
  assert t["all_to_all"] - t["ragged_all_to_all"] == pytest.approx(saved - 4e-6, rel=1e-9)
  assert ms.choose_impl(cfg, tpu_mesh, tokens=8) == want
  # Past DECODE_TOKENS tokens per device the rule is not priced: the ragged dispatch.
  assert ms.choose_impl(cfg, tpu_mesh, tokens=65) == "ragged_all_to_all"


def test_decode_rule_is_priced_on_chips_with_published_figures_only():
  cfg = ms.MoEConfig(d_model=512, d_ff=128, num_experts=128, top_k=8)
  from moe_shard.exchange_rule import decode_estimates

  assert decode_estimates(cfg, mesh("8x1-auto"), 8) is None  # CPU: no figures
  assert ms.choose_impl(cfg, mesh("8x1-auto"), tokens=8) == "all_to_all"


def test_choose_impl_takes_tokens_per_device():
  cfg = ms.MoEConfig(d_model=8, d_ff=16, num_experts=8, top_k=2)
  assert ms.choose_impl(cfg, mesh("8x1-auto"), tokens=8) == "all_to_all"
  assert ms.choose_impl(cfg, tokens=8) == "ragged_dot"
  named = ms.MoEConfig(d_model=8, d_ff=16, num_experts=8, top_k=2, impl="ragged_all_to_all")
  assert ms.choose_impl(named, mesh("8x1-auto"), tokens=8) == "ragged_all_to_all"  # as named
  with pytest.raises(ValueError, match=re.escape("choose_impl: tokens must be >= 0 (got -1)")):
    ms.choose_impl(cfg, mesh("8x1-auto"), tokens=-1)
  with pytest.raises(TypeError, match=re.escape("choose_impl: tokens must be an int (got 1.5)")):
    ms.choose_impl(cfg, mesh("8x1-auto"), tokens=1.5)
  pytest.importorskip("libtpu")
  from bench.reading import tpu

  tpu_mesh = jax.sharding.Mesh(np.array(tpu.devices("v5e:2x4")), (ms.EXPERT,))
  assert ms.choose_impl(cfg, tpu_mesh, tokens=64) == "all_to_all"
  assert ms.choose_impl(cfg, tpu_mesh, tokens=65) == "ragged_all_to_all"


def test_choose_impl_at_decode_counts_the_buffer_rows_and_weight_bytes():
  # A Mixtral-like layer, one expert a chip: all_to_all's first receive buffer holds
  # 8 x plan.padded_load(64 * 2 / 8) = 8 x 32 = 256 rows at 64 tokens per chip.
  pytest.importorskip("libtpu")
  from bench.reading import tpu

  tpu_mesh = jax.sharding.Mesh(np.array(tpu.devices("v5e:2x4")).reshape(8, 1), (ms.EXPERT, ms.DATA))
  cfg = ms.MoEConfig(d_model=128, d_ff=128, num_experts=8, top_k=2, param_dtype=jnp.bfloat16)
  assert plan.default_chunks(64, 2, 8).first * 8 == 256
  assert ms.choose_impl(cfg, tpu_mesh, tokens=64) == "all_to_all"  # 256 <= 128 x 2 bytes
  int8 = dataclasses.replace(cfg, weights_format="int8")
  assert ms.choose_impl(int8, tpu_mesh, tokens=64) == "ragged_all_to_all"  # 256 > 128 x 1
  assert ms.choose_impl(int8, tpu_mesh, tokens=8) == "all_to_all"  # 128 rows
  f32 = dataclasses.replace(cfg, param_dtype=jnp.float32)
  assert ms.choose_impl(f32, tpu_mesh, tokens=64) == "all_to_all"


@pytest.mark.parametrize("tokens, ragged", [(8 * 8, False), (8 * 65, True)])
def test_layer_on_tpu_picks_by_tokens_per_device(tokens, ragged):
  """moe_layer passes its tokens per device to "auto": 8 per chip of a v5e 2x4 lowers the
  fixed-size exchange, 65 the ragged one."""
  pytest.importorskip("libtpu")
  from jax.sharding import NamedSharding

  from bench.reading import tpu

  tpu_mesh = jax.sharding.Mesh(np.array(tpu.devices("v5e:2x4")), (ms.EXPERT,))
  cfg = ms.MoEConfig(d_model=128, d_ff=128, num_experts=8, top_k=2, gmm_impl="ragged_dot")
  params = jax.eval_shape(lambda: ms.init_moe_params(jax.random.key(0), cfg))
  params = jax.tree.map(
    lambda a, spec: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=NamedSharding(tpu_mesh, spec)),
    params,
    ms.moe_param_specs(cfg),
  )
  x = jax.ShapeDtypeStruct(
    (tokens, 1, 128), jnp.float32, sharding=NamedSharding(tpu_mesh, P(ms.EXPERT))
  )
  text = (
    jax.jit(ms.moe_layer, static_argnames=("cfg", "mesh"))
    .lower(params, x, cfg=cfg, mesh=tpu_mesh)
    .as_text()
  )
  assert ("ragged_all_to_all" in text) == ragged
  assert "all_to_all" in text


@pytest.mark.parametrize(
  "platform, version, want",
  [
    ("gpu", "PJRT C API\ncuda 12080", "ragged_all_to_all"),
    ("gpu", "PJRT C API\nrocm 60300", "ragged_all_to_all"),
    ("gpu", "PJRT C API\noneapi", "all_to_all"),  # neither CUDA nor ROCm: emulated
    ("tpu", "PJRT C API\nTFRT TPU v5 lite", "ragged_all_to_all"),
    ("cpu", "PJRT C API\ncpu", "all_to_all"),
  ],
)
def test_auto_names_gpus_as_platform_dependent_does(platform, version, want):
  """A GPU device says platform "gpu" for CUDA and ROCm alike; "auto" takes the ragged
  dispatch where `lax.platform_dependent` (which names them "cuda", "rocm") runs the native
  exchange."""
  device = types.SimpleNamespace(
    platform=platform, client=types.SimpleNamespace(platform_version=version)
  )
  stand_in = types.SimpleNamespace(
    shape={ms.EXPERT: 4}, axis_names=(ms.EXPERT,), devices=np.array([device] * 4)
  )
  cfg = ms.MoEConfig(d_model=8, d_ff=16, num_experts=8, top_k=2)
  assert ms.choose_impl(cfg, stand_in) == want


# --------------------------------------------------------------------------- errors


def _args(E=8):
  return (
    np.zeros((8, 4), np.float32),
    np.zeros((E, 4, 6), np.float32),
    np.zeros((8, 2), np.int32),
    None,
  )


def test_errors():
  fn = ms.moe_ragged_all_to_all
  with pytest.raises(
    ValueError,
    match=re.escape(
      "moe_ragged_all_to_all: num_experts (6) must be divisible by the 'expert' axis size (4)"
    ),
  ):
    trace(fn, *_args(E=6), mesh=mesh("4x2-explicit"))
  with pytest.raises(
    ValueError, match=re.escape("moe_ragged_all_to_all: mesh must be given, or a mesh be in scope")
  ):
    trace(fn, *_args(), mesh=None)
  with pytest.raises(ValueError, match=re.escape("moe_ragged_all_to_all: ") + ".*'model'"):
    trace(fn, *_args(), mesh=mesh("4x2-auto"), expert_axis="model")
  for bad, err in [(0, ValueError), (2.0, TypeError), (True, TypeError)]:
    with pytest.raises(err, match=re.escape("moe_ragged_all_to_all: recv_capacity must be ")):
      trace(fn, *_args(), mesh=mesh("4x2-auto"), recv_capacity=bad)
  with pytest.raises(
    TypeError, match=re.escape("MoEConfig: recv_capacity must be an int (got 1.5)")
  ):
    ms.MoEConfig(d_model=8, d_ff=8, num_experts=8, top_k=2, recv_capacity=1.5)
  out = trace(fn, *_args(), mesh=mesh("4x2-auto"))
  assert out.shape == (8, 6) and out.dtype == jnp.float32


# --------------------------------------------------------------------------- TPU program


def test_tpu_program_has_ragged_all_to_all_and_no_emulation():
  """Compiled for v5e 2x4 (forward and gradient): the real primitive, and every all-to-all
  or all-gather left is of int32 offsets or counts, never of the padded data buffers; the
  forward waits on three collectives in turn (the counts' all-gather, the exchange there
  and back)."""
  pytest.importorskip("libtpu")
  from jax.sharding import NamedSharding

  from bench.reading import measure, tpu

  m = jax.sharding.Mesh(np.array(tpu.devices("v5e:2x4")).reshape(4, 2), (ms.EXPERT, ms.DATA))
  T, D, F, E, K = 256, 128, 256, 8, 2
  tok = NamedSharding(m, P((ms.EXPERT, ms.DATA)))
  args = (
    jax.ShapeDtypeStruct((T, D), jnp.bfloat16, sharding=tok),
    jax.ShapeDtypeStruct((E, D, F), jnp.bfloat16, sharding=NamedSharding(m, P(ms.EXPERT))),
    jax.ShapeDtypeStruct((T, K), jnp.int32, sharding=tok),
    jax.ShapeDtypeStruct((T, K), jnp.float32, sharding=tok),
  )

  def loss(x, w, e, g):
    return jnp.sum(ms.moe_ragged_all_to_all(x, w, e, g, mesh=m).astype(jnp.float32))

  for i, program in enumerate(
    (
      lambda x, w, e, g: ms.moe_ragged_all_to_all(x, w, e, g, mesh=m),
      jax.grad(loss, argnums=(0, 1, 3)),
    )
  ):
    text = jax.jit(program).lower(*args).compile().as_text()
    assert "ragged-all-to-all(" in text
    small = re.findall(r"= (\S+) (?:all-to-all|all-gather)(?:-start)?\(", text)
    assert small and all(t.startswith(("s32[", "(s32[")) for t in small), small
    coll = measure.collective_bytes(
      text, {"ragged_overflow_rounds": 1, "ragged_last_round:branch": 0}
    )
    assert coll["ragged-all-to-all"]["count"] >= 2
    if i == 0:
      trips = {"ragged_overflow_rounds": 0, "ragged_last_round:branch": 0}
      assert measure.dependent_collectives(text, trips) == 3
