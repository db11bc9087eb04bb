"""`moe_shard.measure` against programs whose FLOPs and bytes are known by construction."""

import importlib
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import moe_shard as ms
from bench.reading import hlo_ops, measure

gmm = importlib.import_module("moe_shard.kernels.tiled")
from bench.reading import accounting  # noqa: E402

N = 8  # simulated devices (tests/conftest.py)


def _spec(shape, dtype=jnp.float32, sharding=None):
  return jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)


def test_shape_bytes():
  assert measure.shape_bytes("f32[8,4]{1,0}") == 128
  assert measure.shape_bytes("bf16[3,5]") == 30
  assert measure.shape_bytes("pred[]") == 1
  assert measure.shape_bytes("f8e4m3fn[32,7168,2048]{2,1,0}") == 32 * 7168 * 2048
  assert measure.shape_bytes("f4e2m1fn[4,8]") == 16
  assert measure.shape_bytes("(f32[2]{0}, s32[], /*index=2*/u8[4])") == 8 + 4 + 4
  assert measure.shape_bytes("token[]") == 0


def test_matmul_flops_and_memory():
  M, K, N_ = 64, 32, 48
  compiled = measure.compile_fn(lambda a, b: a @ b, _spec((M, K)), _spec((K, N_)))
  flops = measure.executed_flops(compiled)
  assert flops["executed"] == flops["xla"] == flops["dot_executed"] == 2 * M * K * N_
  mem = measure.memory_bytes(compiled)
  assert mem["argument"] == 4 * (M * K + K * N_)
  assert mem["output"] == 4 * M * N_


def test_static_loop_counts_its_trip_count():
  M, K, n = 16, 8, 5

  def f(a, b):
    return jax.lax.fori_loop(0, n, lambda i, c: jnp.tanh(c @ b), a)

  compiled = measure.compile_fn(f, _spec((M, K)), _spec((K, K)))
  flops = measure.executed_flops(compiled)
  (loop,) = [lp for lp in flops["loops"] if lp["dot_flops_per_iteration"]]
  assert loop["iterations"] == n
  assert flops["dot_executed"] == n * 2 * M * K * K
  # XLA's count has the body once; the executed count adds the other n - 1 dots.
  assert flops["executed"] == pytest.approx(flops["xla"] + (n - 1) * 2 * M * K * K)


def _dynamic_loops(a, b, count):
  """An outer loop of 3 (static) around a named inner loop of `count` steps per entry."""

  def inner(c):
    with jax.named_scope("inner_steps"):
      return jax.lax.while_loop(
        lambda s: s[0] < count, lambda s: (s[0] + 1, jnp.tanh(s[1] @ b)), (0, c)
      )[1]

  return jax.lax.fori_loop(0, 3, lambda i, c: inner(c), a)


def test_dynamic_loop_needs_and_uses_trip_counts():
  M, K = 16, 8
  compiled = measure.compile_fn(_dynamic_loops, _spec((M, K)), _spec((K, K)), _spec((), jnp.int32))
  with pytest.raises(ValueError, match=r"scope 'inner_steps'.*no known trip count"):
    measure.executed_flops(compiled)
  # 3 entries x 4 steps: the count given is the total over the run.
  flops = measure.executed_flops(compiled, {"inner_steps": 12})
  assert flops["dot_executed"] == 12 * 2 * M * K * K
  # default_trip_count is per entry of the enclosing loop: 3 x 4 again.
  assert measure.executed_flops(compiled, default_trip_count=4)["dot_executed"] == (
    12 * 2 * M * K * K
  )
  assert {lp.scope() for lp in measure.parse_hlo(compiled.as_text()).loops} >= {"inner_steps"}


@pytest.fixture(scope="module")
def mesh8(devices):
  return jax.make_mesh((N,), ("x",), devices=devices)


def _compile_shard_map(body, mesh, shape, out_specs=P("x")):
  f = jax.shard_map(body, mesh=mesh, in_specs=P("x"), out_specs=out_specs)
  return measure.compile_fn(f, _spec(shape, sharding=NamedSharding(mesh, P("x"))))


ROWS, COLS = 16, 4  # per device f32[16, 4] = 256 bytes
LOCAL = ROWS * COLS * 4


def test_all_to_all_bytes(mesh8):
  c = _compile_shard_map(
    lambda a: jax.lax.all_to_all(a, "x", 0, 0, tiled=True), mesh8, (N * ROWS, COLS)
  )
  got = measure.collective_bytes(c)
  assert got == {
    "all-to-all": {
      "count": 1,
      "operand_bytes": LOCAL,
      "result_bytes": LOCAL,
      "wire_bytes": LOCAL * (N - 1) // N,
    }
  }


def test_all_gather_bytes(mesh8):
  c = _compile_shard_map(lambda a: jax.lax.all_gather(a, "x", tiled=True), mesh8, (N * ROWS, COLS))
  got = measure.collective_bytes(c)
  assert got == {
    "all-gather": {
      "count": 1,
      "operand_bytes": LOCAL,
      "result_bytes": N * LOCAL,
      "wire_bytes": (N - 1) * LOCAL,
    }
  }


def test_psum_bytes(mesh8):
  c = _compile_shard_map(lambda a: jax.lax.psum(a, "x"), mesh8, (N * ROWS, COLS), out_specs=P())
  got = measure.collective_bytes(c)
  assert got == {
    "all-reduce": {
      "count": 1,
      "operand_bytes": LOCAL,
      "result_bytes": LOCAL,
      "wire_bytes": 2 * LOCAL * (N - 1) // N,
    }
  }


def test_reduce_scatter_bytes(mesh8):
  c = _compile_shard_map(
    lambda a: jax.lax.psum_scatter(a, "x", tiled=True), mesh8, (N * ROWS, COLS)
  )
  got = measure.collective_bytes(c)
  assert got == {
    "reduce-scatter": {
      "count": 1,
      "operand_bytes": LOCAL,
      "result_bytes": LOCAL // N,
      "wire_bytes": LOCAL * (N - 1) // N,
    }
  }


def test_collective_permute_bytes(mesh8):
  perm = [(i, (i + 1) % N) for i in range(N)]
  c = _compile_shard_map(lambda a: jax.lax.ppermute(a, "x", perm), mesh8, (N * ROWS, COLS))
  got = measure.collective_bytes(c)
  assert got == {
    "collective-permute": {
      "count": 1,
      "operand_bytes": LOCAL,
      "result_bytes": LOCAL,
      "wire_bytes": LOCAL,
    }
  }


def test_collective_in_loop_is_attributed_and_scaled(mesh8):
  def body(a):
    with jax.named_scope("rounds"):
      return jax.lax.fori_loop(
        0, 3, lambda i, c: jnp.sin(jax.lax.all_to_all(c, "x", 0, 0, tiled=True)), a
      )

  c = _compile_shard_map(body, mesh8, (N * ROWS, COLS))
  mod = measure.parse_hlo(c.as_text())
  (home,) = mod.collectives  # one computation holds the all-to-all: the loop body
  assert home in {lp.body for lp in mod.loops}
  assert mod.collectives[home]["all-to-all"]["operand_bytes"] == LOCAL
  got = measure.collective_bytes(c)
  assert got["all-to-all"] == {
    "count": 3,
    "operand_bytes": 3 * LOCAL,
    "result_bytes": 3 * LOCAL,
    "wire_bytes": 3 * (LOCAL * (N - 1) // N),
  }


def test_dependent_collectives_follow_the_data(mesh8):
  """Two all-to-alls in turn, then a loop of three: five collectives on the longest chain;
  the psum beside them is on none of it (six collectives run in all, seven with it)."""

  def body(a):
    b = jax.lax.all_to_all(a, "x", 0, 0, tiled=True)
    c = jax.lax.all_to_all(jnp.sin(b), "x", 0, 0, tiled=True)
    s = jax.lax.psum(jnp.sum(jnp.cos(a)), "x")
    with jax.named_scope("rounds"):
      d = jax.lax.fori_loop(
        0, 3, lambda i, v: jnp.sin(jax.lax.all_to_all(v, "x", 0, 0, tiled=True)), c
      )
    return d + s

  c = _compile_shard_map(body, mesh8, (N * ROWS, COLS))
  counts = measure.collective_bytes(c)
  assert counts["all-to-all"]["count"] == 5 and counts["all-reduce"]["count"] == 1
  assert measure.dependent_collectives(c) == 5
  assert measure.dependent_collectives(c.as_text()) == 5


# XLA:TPU splits an async collective it overlaps with compute into fusions: a start, a
# continuation and a done, each holding the collective with one channel_id and chain_id.
_PIECE = """
%{name} (p.{name}: s32[2,8]) -> s32[2,64] {{
  %p.{name} = s32[2,8]{{1,0}} parameter(0)
  ROOT %ag.{name} = s32[2,64]{{1,0:T(8,128){space}}} all-gather(%p.{name}), channel_id={channel}, \
replica_groups={{{{0,1,2,3,4,5,6,7}}}}, dimensions={{1}}, frontend_attributes={{chain_id="{chain}"}}
}}
"""


def _split_collective_hlo(second):
  """A start, continuation and done of one all-gather, then `second` on its result."""
  pieces = "".join(
    _PIECE.format(name=n, space=sp, channel=8, chain=0)
    for n, sp in (("start", ""), ("cont", "S(1)"), ("done", "S(1)"))
  )
  return (
    pieces
    + """
ENTRY %main (x: s32[2,8]) -> s32[2,64] {
  %x = s32[2,8]{1,0} parameter(0)
  %start = s32[2,64]{1,0} fusion(%x), kind=kCustom, calls=%start
  %s = s32[2,8]{1,0} slice(%start), slice={[0:2], [0:8]}
  %cont = s32[2,64]{1,0} fusion(%s), kind=kCustom, calls=%cont
  %c = s32[2,8]{1,0} slice(%cont), slice={[0:2], [0:8]}
  %done = s32[2,64]{1,0} fusion(%c), kind=kCustom, calls=%done
"""
    + second
    + "\n}\n"
  )


def test_dependent_collectives_count_a_split_collective_once():
  """The pieces of one split collective are one collective on the chain; a second all-gather
  on the same channel and chain id but a different shape, or an all-to-all, is another."""
  alone = "  ROOT %y = s32[2,64]{1,0} negate(%done)"
  assert measure.dependent_collectives(_split_collective_hlo(alone)) == 1
  then_a2a = (
    "  %d = s32[2,64]{1,0} negate(%done)\n"
    "  ROOT %y = s32[2,64]{1,0} all-to-all(%d), channel_id=9, "
    "replica_groups={{0,1,2,3,4,5,6,7}}, dimensions={1}"
  )
  assert measure.dependent_collectives(_split_collective_hlo(then_a2a)) == 2
  # Another split collective after the first (its pieces share channel 8 and chain 0 but
  # gather another shape) waits on it: two in turn.
  other = _PIECE.format(name="again", space="", channel=8, chain=0).replace(
    "s32[2,64]", "s32[2,128]"
  )
  text = _split_collective_hlo(
    "  %d = s32[2,8]{1,0} slice(%done), slice={[0:2], [0:8]}\n"
    "  ROOT %y = s32[2,128]{1,0} fusion(%d), kind=kCustom, calls=%again"
  )
  assert measure.dependent_collectives(other + text) == 2
  # Two independent split collectives beside each other: one on the longest chain.
  beside = (
    "  %b = s32[2,128]{1,0} fusion(%x), kind=kCustom, calls=%again\n"
    "  ROOT %y = (s32[2,64]{1,0}, s32[2,128]{1,0}) tuple(%done, %b)"
  )
  assert measure.dependent_collectives(other + _split_collective_hlo(beside)) == 1


@pytest.mark.parametrize("mode", ["fwd", "fwd+bwd"])
@pytest.mark.parametrize(
  "M, sizes",
  [
    (100, [40, 0, 37, 3, 11]),
    (32, [20, 0, 3, 0, 0]),  # M = the largest tile: its matmul must stay inside its loop
  ],
)
def test_tiled_grouped_matmul_executed_flops(mode, M, sizes):
  """Executed dot FLOPs = 2 * D * F * (rows the schedule computes), x3 with the backward."""
  D, F = 32, 64
  sizes = np.array(sizes, np.int32)
  tiles = gmm.tile_sizes(M, 32, 4)
  args = [_spec((M, D)), _spec((len(sizes), D, F)), _spec(sizes.shape, jnp.int32)]

  def fwd(x, w, gs):
    return ms.grouped_matmul(x, w, gs, impl="tiled", max_tile=32, min_tile=4)

  def fwd_bwd(x, w, gs, dy):
    y, vjp = jax.vjp(lambda x, w: fwd(x, w, gs), x, w)
    return (y, *vjp(dy))

  fn, passes = (fwd, 1) if mode == "fwd" else (fwd_bwd, 3)
  if mode != "fwd":
    args.append(_spec((M, F)))
  compiled = measure.compile_fn(fn, *args)
  rows = sum(t * n for t, n in accounting.schedule_rows(sizes, M, tiles).items())
  flops = measure.executed_flops(compiled, accounting.loop_trip_counts(sizes, M, tiles))
  assert flops["dot_executed"] == passes * 2 * D * F * rows
  # XLA's count adds elementwise work outside the dots (masks, the dw additions).
  assert flops["dot_executed"] <= flops["executed"] <= 1.2 * flops["dot_executed"]
  scopes = {lp["scope"] for lp in flops["loops"]}
  assert scopes == {gmm.GROUP_SCOPE} | {f"{gmm.TILE_SCOPE}{t}" for t in tiles}


def test_wire_bytes_use_the_replica_group_size():
  # On a 4 x 2 mesh an all_to_all over "a" runs in groups of 4, one over "b" in groups of 2.
  mesh = jax.make_mesh((4, 2), ("a", "b"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
  spec = P(("a", "b"))

  def body(x):
    return (
      jax.lax.all_to_all(x, "a", 0, 0, tiled=True),
      jax.lax.all_to_all(x, "b", 0, 0, tiled=True),
    )

  f = jax.shard_map(body, mesh=mesh, in_specs=spec, out_specs=(spec, spec))
  c = measure.compile_fn(f, _spec((N * ROWS, COLS), sharding=NamedSharding(mesh, spec)))
  got = measure.collective_bytes(c)["all-to-all"]
  assert got["operand_bytes"] == 2 * LOCAL
  assert got["wire_bytes"] == LOCAL * 3 // 4 + LOCAL * 1 // 2


@pytest.mark.parametrize(
  "attrs, size",
  [
    ("replica_groups={{0,1,2}}, dimensions={0}", 3),
    ("replica_groups=[4,2]<=[8], dimensions={0}", 2),
    ("replica_groups=mesh['axis_0'=4,'axis_1'=2] {'axis_0'}, use_global_device_ids=true", 4),
    ("replica_groups=mesh['axis_0'=4,'axis_1'=2] {'axis_0','axis_1'}, x=1", 8),
    ("source_target_pairs={{0,1}}", 1),
  ],
)
def test_group_size_forms(attrs, size):
  # The three ways XLA prints replica groups (explicit, iota, mesh axes).
  assert hlo_ops._group_size(attrs) == size


def test_path_keys_tell_nested_loops_with_the_same_scope_apart():
  """Two loops scoped "steps", one inside "outer": a path key counts the nested one only."""
  D = 8

  def steps(a, w, n):
    with jax.named_scope("steps"):
      return jax.lax.while_loop(lambda c: c[0] < n, lambda c: (c[0] + 1, c[1] @ w), (0, a))[1]

  def f(a, w, n, m):
    a = steps(a, w, n)
    with jax.named_scope("outer"):
      return jax.lax.while_loop(
        lambda c: c[0] < m, lambda c: (c[0] + 1, steps(c[1], w, n)), (0, a)
      )[1]

  compiled = measure.compile_fn(
    f, _spec((D, D)), _spec((D, D)), _spec((), jnp.int32), _spec((), jnp.int32)
  )
  mod = measure.parse_hlo(compiled.as_text())
  by_path = {lp.matches("outer/steps"): lp for lp in mod.loops if lp.scope() == "steps"}
  assert set(by_path) == {True, False}  # one nested, one not
  dot = 2 * D * D * D
  flops = measure.executed_flops(compiled, {"steps": 3, "outer/steps": 10, "outer": 5})
  assert flops["dot_executed"] == (3 + 10) * dot
  flops = measure.executed_flops(compiled, {"steps": 3, "outer": 5})
  assert flops["dot_executed"] == (3 + 3) * dot


def test_convolution_flops_are_counted():
  """TPU programs write matmuls as convolutions: 2 * output * input features * window."""
  x = _spec((2, 8, 16, 16))  # N, C_in, H, W
  w = _spec((4, 8, 3, 3))  # C_out, C_in, kh, kw
  compiled = measure.compile_fn(
    lambda x, w: jax.lax.conv_general_dilated(x, w, (1, 1), "VALID"), x, w
  )
  out = 2 * 4 * 14 * 14
  assert measure.executed_flops(compiled)["dot_executed"] == 2 * out * 8 * 3 * 3


def test_grouped_convolution_counts_the_input_features_of_one_group():
  """With feature_group_count G each output feature sees C_in / G input features."""
  x = _spec((2, 8, 10, 10))  # N, C_in, H, W
  w = _spec((12, 2, 3, 3))  # C_out, C_in / G, kh, kw; G = 4 groups of 2 input features
  compiled = measure.compile_fn(
    lambda x, w: jax.lax.conv_general_dilated(x, w, (1, 1), "VALID", feature_group_count=4), x, w
  )
  (line,) = [ln for ln in compiled.as_text().splitlines() if " convolution(" in ln]
  assert "feature_group_count=4" in line
  out = 2 * 12 * 8 * 8
  flops = measure.executed_flops(compiled)
  assert flops["dot_executed"] == flops["xla"] == 2 * out * 2 * 3 * 3


def _xla_valid_taps(n_out, n_in, size, stride, pad_lo, lhs_dilate, rhs_dilate):
  """XLA's `valid_position_count` loop (HloCostAnalysis::GetConvolutionFlops), transcribed."""
  count = 0
  for k in range(size):
    for o in range(n_out):
      u = o * stride - pad_lo + k * rhs_dilate
      i = int(u / lhs_dilate)  # C++ division truncates toward zero
      count += u == i * lhs_dilate and 0 <= i < n_in
  return count


def test_valid_taps_match_xlas_loop():
  rng = np.random.default_rng(0)
  for _ in range(2000):
    n_in, size, stride, lhs_dilate, rhs_dilate = rng.integers(1, 7, 5)
    pad_lo, pad_hi = rng.integers(-3, 8, 2)
    dilated = (n_in - 1) * lhs_dilate + 1 + pad_lo + pad_hi
    n_out = max(0, (dilated - (size - 1) * rhs_dilate - 1) // stride + 1)
    args = [int(a) for a in (n_out, n_in, size, stride, pad_lo, lhs_dilate, rhs_dilate)]
    assert hlo_ops._valid_taps(*args) == _xla_valid_taps(*args), args


def _conv(x, w, i=None):
  """A transposed-style convolution: stride, padding, lhs and rhs dilation all at once."""
  if i is not None:  # inside a loop: depend on the counter, so XLA cannot hoist the conv
    x = x * i.astype(x.dtype)
  return jax.lax.conv_general_dilated(
    x, w, (2, 1), ((1, 2), (0, 1)), lhs_dilation=(3, 1), rhs_dilation=(1, 2)
  )


def test_dilated_convolution_flops_match_xla():
  """Taps in lhs-dilation holes and padding multiply zeros: XLA leaves them out, so do we."""
  x, w = _spec((2, 8, 7, 9)), _spec((4, 8, 3, 3))
  compiled = measure.compile_fn(_conv, x, w)
  (line,) = [ln for ln in compiled.as_text().splitlines() if " convolution(" in ln]
  assert "lhs_dilate=3x1" in line and "rhs_dilate=1x2" in line and "pad=1_2x0_1" in line
  flops = measure.executed_flops(compiled)
  # Full window: 2 * 2*4*10*6 outputs * 8 features * 9 taps = 69120; valid taps only: 21760.
  assert flops["dot_executed"] == flops["xla"] == 21760

  n = 5

  def looped(x, w):
    y0 = jnp.zeros((2, 4, 10, 6), x.dtype)
    return jax.lax.fori_loop(0, n, lambda i, y: y + _conv(x, w, i), y0)

  flops = measure.executed_flops(measure.compile_fn(looped, x, w))
  (loop,) = [lp for lp in flops["loops"] if lp["dot_flops_per_iteration"]]
  assert loop["dot_flops_per_iteration"] == 21760
  assert flops["dot_executed"] == n * 21760


def test_batched_matmul_as_dilated_convolution_counts_one_tap_per_batch():
  """How TPU programs write a batched matmul's transpose: the batch B is a spatial dim with
  window size B, lhs_dilate B and stride B - 1, so each output meets one real input; B x
  (M, K) @ (K, N) is 2 * B * M * K * N FLOPs, not B times that."""
  B, M, K, N_ = 6, 4, 8, 5

  def f(x, w):  # x: [B, M, K] (spatial, batch, feature), w: [B, K, N] (spatial, in, out)
    return jax.lax.conv_general_dilated(
      x, w, (B - 1,), ((0, 0),), lhs_dilation=(B,), dimension_numbers=("WNC", "WIO", "WNC")
    )

  compiled = measure.compile_fn(f, _spec((B, M, K)), _spec((B, K, N_)))
  (line,) = [ln for ln in compiled.as_text().splitlines() if " convolution(" in ln]
  assert f"window={{size={B} stride={B - 1} lhs_dilate={B}}}" in line
  flops = measure.executed_flops(compiled)
  assert flops["dot_executed"] == flops["xla"] == 2 * B * M * K * N_


@pytest.mark.parametrize("start, stop", [(0, 5), (3, 10)])
def test_counted_loop_without_annotation_gets_its_trip_count(start, stop):
  """XLA's own loops on TPU (e.g. windowed einsums) carry no known_trip_count; a counted
  loop `i = a; while i < n: i += 1` is recognised from its condition, init and step."""

  def f(a, b):
    return jax.lax.fori_loop(start, stop, lambda i, c: jnp.sin(c @ b), a)

  text = measure.compile_fn(f, _spec((8, 8)), _spec((8, 8))).as_text()
  assert '"known_trip_count"' in text
  stripped = re.sub(r'"known_trip_count":\{"n":"\d+"\},?', "", text)
  (lp,) = measure.parse_hlo(stripped).loops
  assert lp.known_trip_count == stop - start


def test_counted_loop_whose_counter_is_copied_gets_its_trip_count():
  """Seen in megablox's group metadata on TPU: the body adds the step to a copy of the
  counter (`add(copy(get-tuple-element(p), index=0), 1)`)."""
  text = """HloModule m

%cond (p: (s32[], f32[4])) -> pred[] {
  %p = (s32[], f32[4]) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %n = s32[] constant(5)
  ROOT %lt = pred[] compare(%i, %n), direction=LT
}

%body (q: (s32[], f32[4])) -> (s32[], f32[4]) {
  %q = (s32[], f32[4]) parameter(0)
  %i = s32[] get-tuple-element(%q), index=0
  %c = s32[] copy(%i)
  %one = s32[] constant(1)
  %next = s32[] add(%c, %one)
  %x = f32[4] get-tuple-element(%q), index=1
  %y = f32[4] sine(%x)
  ROOT %t = (s32[], f32[4]) tuple(%next, %y)
}

ENTRY %main (a: f32[4]) -> f32[4] {
  %a = f32[4] parameter(0)
  %z = s32[] constant(1)
  %init = (s32[], f32[4]) tuple(%z, %a)
  %w = (s32[], f32[4]) while(%init), condition=%cond, body=%body
  ROOT %r = f32[4] get-tuple-element(%w), index=1
}
"""
  (lp,) = measure.parse_hlo(text).loops
  assert lp.known_trip_count == 4


def test_pallas_tpu_kernel_flops_are_its_declared_cost():
  """A tpu_custom_call is not a dot: its FLOPs come from the cost it declares."""
  line = (
    'custom_call_target="tpu_custom_call", backend_config={"custom_call_config":'
    '{"body":"xyz","cost_estimate":{"flops":"137438953472","transcendentals":"0",'
    '"bytes_accessed":"855638016"}}}'
  )
  assert measure.custom_call_flops(line) == 137438953472.0
  assert measure.custom_call_flops('custom_call_target="SomethingElse"') == 0.0


def _copy_loop(x, count):
  """A named loop whose body reads and writes one [M, K] f32 buffer per step."""
  with jax.named_scope("copy_steps"):
    return jax.lax.while_loop(
      lambda s: s[0] < count, lambda s: (s[0] + 1, jnp.sin(s[1]) * 2.0), (0, x)
    )[1]


@pytest.mark.parametrize("trips", [0, 1, 5])
def test_step_bytes_scale_loop_bodies_by_their_trip_counts(trips):
  from bench.reading import hbm

  M, K = 128, 256
  compiled = measure.compile_fn(_copy_loop, _spec((M, K)), _spec((), jnp.int32))
  got = hbm.step_bytes(compiled, {"copy_steps": trips})
  assert got["xla"] == measure.bytes_accessed(compiled) > 0  # a reference column
  # The body's kernel reads and writes M*K f32 per step (plus the 4-byte counter), once
  # per trip, by the one model.
  step = 2 * 4 * M * K
  never = hbm.step_bytes(compiled, {"copy_steps": 0})["hbm"]
  assert got["hbm"] - never == pytest.approx(trips * step, rel=0.01)
  (body,) = [
    r
    for r in hbm.op_bytes(compiled, {"copy_steps": trips})
    if r["written"] == 4 * M * K and r["scope"].startswith("copy_steps")
  ]
  assert body["runs"] == trips and body["total"] == trips * step
  # The table lists no op of a loop that never runs.
  text = hbm.table(compiled, {"copy_steps": trips}, top=20)
  assert (body["name"] in text) == (trips > 0)


def test_pallas_tpu_kernel_bytes_are_its_declared_cost():
  from bench.reading import hbm

  text = """HloModule m

ENTRY %main (p0: bf16[512,256], p1: bf16[2,256,128]) -> bf16[512,128] {
  %p0 = bf16[512,256]{1,0} parameter(0)
  %p1 = bf16[2,256,128]{2,1,0} parameter(1)
  ROOT %gmm.1 = bf16[512,128]{1,0} custom-call(%p0, %p1), custom_call_target="tpu_custom_call", backend_config={"custom_call_config":{"cost_estimate":{"flops":"33554432","transcendentals":"0","bytes_accessed":"1000000","remote_bytes_transferred":"0"}}}
}
"""
  (row,) = hbm.op_bytes(text)
  assert row["read"] + row["written"] == 1_000_000
  assert row["written"] == 512 * 128 * 2


def test_a_prefetch_into_vmem_is_counted_apart():
  from bench.reading import hbm

  # A weight copied into VMEM (memory space S(1)), then read by the matmul from there.
  text = """HloModule m

ENTRY %main (x: bf16[8,256], w: s8[256,512]) -> bf16[8,512] {
  %x = bf16[8,256]{1,0} parameter(0)
  %w = s8[256,512]{1,0} parameter(1)
  %cs = (s8[256,512]{1,0:S(1)}, s8[256,512]{1,0}, u32[]) copy-start(%w)
  %cd = s8[256,512]{1,0:S(1)} copy-done(%cs)
  ROOT %dot = bf16[8,512]{1,0} fusion(%x, %cd), kind=kOutput, calls=%f
}
"""
  rows = {r["opcode"]: r for r in hbm.op_bytes(text)}
  w = 256 * 512
  # The copy reads HBM and writes VMEM; the matmul reads x from HBM and w from VMEM.
  assert rows["copy-done"]["read"] == rows["copy-done"]["written"] == rows["copy-done"]["vmem"] == w
  assert rows["fusion"]["read"] == 8 * 256 * 2 + w and rows["fusion"]["vmem"] == w
  # The one count: the weight read from HBM once (by its prefetch), x read, y written.
  assert hbm.step_bytes(text)["hbm"] == w + 8 * 256 * 2 + 8 * 512 * 2


def test_an_eviction_out_of_vmem_reads_vmem():
  from bench.reading import hbm

  # A value made in VMEM and copied out to HBM (for a later use): the copy writes HBM only.
  text = """HloModule m

ENTRY %main (x: bf16[8,256]) -> bf16[8,256] {
  %x = bf16[8,256]{1,0} parameter(0)
  %y = bf16[8,256]{1,0:S(1)} negate(%x)
  %cs = (bf16[8,256]{1,0}, bf16[8,256]{1,0:S(1)}, u32[]) copy-start(%y)
  ROOT %cd = bf16[8,256]{1,0} copy-done(%cs)
}
"""
  rows = {r["opcode"]: r for r in hbm.op_bytes(text)}
  b = 8 * 256 * 2
  assert rows["copy-done"]["read"] == rows["copy-done"]["written"] == b
  assert rows["copy-done"]["vmem"] == b  # its read, from VMEM
  assert rows["negate"]["vmem"] == b  # its write, to VMEM


def test_grouped_kernels_are_told_by_their_grid_metadata():
  from bench.reading import hbm

  # A grouped matmul's Pallas call: grid steps, 4 + 1 group offsets, group and row-tile ids,
  # then x and an int8 matrix per group with its scales; and another Pallas call.
  cost = '"cost_estimate":{"flops":"1","transcendentals":"0","bytes_accessed":"%d"}'
  text = f"""HloModule m

ENTRY %main (n: s32[], o: s32[5], g: s32[6], t: s32[6], x: bf16[64,128], v: s8[4,128,256], s: f32[4,1,256]) -> bf16[64,256] {{
  %n = s32[] parameter(0)
  %o = s32[5]{{0}} parameter(1)
  %g = s32[6]{{0}} parameter(2)
  %t = s32[6]{{0}} parameter(3)
  %x = bf16[64,128]{{1,0}} parameter(4)
  %v = s8[4,128,256]{{2,1,0}} parameter(5)
  %s = f32[4,1,256]{{2,1,0}} parameter(6)
  %k = bf16[64,128]{{1,0}} custom-call(%x), custom_call_target="tpu_custom_call", backend_config={{{cost % 99}}}
  ROOT %y = bf16[64,256]{{1,0}} custom-call(%n, %o, %g, %t, %k, %v, %s), custom_call_target="tpu_custom_call", backend_config={{{cost % 200000}}}
}}
"""
  (got,) = hbm.grouped_kernels(text)
  assert got == dict(
    name="y", groups=4, weight_bytes=4 * 128 * 256 + 4 * 256 * 4, declared=200000.0, runs=1.0
  )


def test_conditional_counts_the_branch_named_taken():
  # A lax.cond under a scope, one matmul against three, and a loop inside the cheap
  # branch: XLA's own count takes the costlier branch once; `branch_key` says which runs.
  n = 64

  def f(pred, x):
    def cheap(x):
      with jax.named_scope("inner"):
        return jax.lax.fori_loop(0, jnp.int32(x[0, 0] > 0) + 2, lambda i, y: y @ x, x)

    with jax.named_scope("pick"):
      return jax.lax.cond(pred, lambda x: x @ x @ x @ x, cheap, x)

  x = jnp.ones((n, n))
  compiled = jax.jit(f).lower(True, x).compile()
  mm = 2 * n**3
  mod = measure._module(compiled)
  assert [len(c.branches) for c in mod.conditionals] == [2]
  expensive = measure.executed_flops(compiled, {measure.branch_key("pick"): 1, "inner": 5})
  cheap = measure.executed_flops(compiled, {measure.branch_key("pick"): 0, "inner": 5})
  assert expensive["dot_executed"] == 3 * mm
  assert cheap["dot_executed"] == 5 * mm
  assert expensive["executed"] == pytest.approx(expensive["xla"] - 0 * mm, rel=0.01)
  assert cheap["executed"] == pytest.approx(cheap["xla"] - 3 * mm + 5 * mm, rel=0.01)
  runs = mod.executions({measure.branch_key("pick"): 1, "inner": 5})
  (loop,) = mod.loops
  assert runs[loop.body] == 0.0  # the loop of the branch not taken never runs


def test_a_computation_on_another_execution_thread_ends_where_its_brace_does():
  """TPU7x's programs hold SparseCore computations, closed by `}, execution_thread=...`: the
  computation after one is parsed on its own (here a dot in the entry would otherwise be
  read as the SparseCore copy's)."""
  text = """HloModule m

%sc_copy (p: bf16[8,128]) -> bf16[8,128] {
  ROOT %p = bf16[8,128]{1,0} parameter(0)
}, execution_thread="sparsecore"

%fused_dot (a: f32[64,32], b: f32[32,16]) -> f32[64,16] {
  %a = f32[64,32]{1,0} parameter(0)
  %b = f32[32,16]{1,0} parameter(1)
  ROOT %d = f32[64,16]{1,0} dot(%a, %b), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

ENTRY %main (x: f32[64,32], w: f32[32,16]) -> f32[64,16] {
  %x = f32[64,32]{1,0} parameter(0)
  %w = f32[32,16]{1,0} parameter(1)
  ROOT %f = f32[64,16]{1,0} fusion(%x, %w), kind=kOutput, calls=%fused_dot
}
"""
  mod = measure.parse_hlo(text)
  assert set(mod.comps) == {"sc_copy", "fused_dot", "main"}
  assert mod.dot_flops["fused_dot"] == 2 * 64 * 32 * 16
  assert mod.calls["main"] == [("fused_dot", "call")]


def test_parse_hlo_keeps_an_instruction_whose_metadata_spans_lines_in_its_computation():
  """libtpu's `as_text()` writes a Pallas kernel's `kernel_metadata` with raw newlines: the
  instruction continues on lines starting `"xprof_metadata":` and `}}, metadata=`. The
  `}}` line is no computation's end: the rest of the computation, and the next one, parse."""
  text = """HloModule m

%body (a: f32[64,32], b: f32[32,16]) -> f32[64,16] {
  %a = f32[64,32]{1,0} parameter(0)
  %b = f32[32,16]{1,0} parameter(1)
  %k = f32[64,32]{1,0} custom-call(%a), custom_call_target="tpu_custom_call", backend_config={"custom_call_config":{"cost_estimate":{"flops":"1000"}}, "kernel_metadata":"{
"xprof_metadata":"{}"
}}, metadata={op_name="jit(f)/gmm/pallas_call"}
  ROOT %d = f32[64,16]{1,0} dot(%k, %b), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

ENTRY %main (x: f32[64,32], w: f32[32,16]) -> f32[64,16] {
  %x = f32[64,32]{1,0} parameter(0)
  %w = f32[32,16]{1,0} parameter(1)
  ROOT %f = f32[64,16]{1,0} call(%x, %w), to_apply=%body
}
"""
  mod = measure.parse_hlo(text)
  assert set(mod.comps) == {"body", "main"}
  assert [i.name for i in mod.comps["body"]] == ["a", "b", "k", "d"]
  (k,) = [i for i in mod.comps["body"] if i.name == "k"]
  assert 'op_name="jit(f)/gmm/pallas_call"' in k.attrs
  assert mod.dot_flops["body"] == 1000 + 2 * 64 * 32 * 16
  assert mod.calls["main"] == [("body", "call")]
  assert mod.executions()["body"] == 1.0
