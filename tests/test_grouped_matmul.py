"""`grouped_matmul`: the tiled kernel against `lax.ragged_dot`, its schedule, and its errors.

Every case compares outputs and gradients with respect to x and w (through a random
cotangent) with `lax.ragged_dot`, the semantics the tiled kernel must reproduce.
"""

import functools
import importlib
import re

import hypothesis
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from cases import assert_close
from jax.sharding import PartitionSpec as P

import moe_shard as ms

# The module (the package re-exports the function under the same name).
gmm = importlib.import_module("moe_shard.kernels.tiled")
from bench.reading import accounting  # noqa: E402


def _inputs(M, D, F, group_sizes, dtype=jnp.float32, seed=0):
  rng = np.random.default_rng(seed)
  G = len(group_sizes)
  x = jnp.asarray(rng.normal(size=(M, D)), dtype)
  w = jnp.asarray(rng.normal(size=(G, D, F)) / np.sqrt(D), dtype)
  dy = jnp.asarray(rng.normal(size=(M, F)), dtype)
  return x, w, jnp.asarray(group_sizes, jnp.int32), dy


@functools.cache
def _fwd_bwd(impl, max_tile=None, min_tile=None):
  """A jitted (x, w, gs, dy) -> (y, dx, dw), cached so equal shapes reuse the compile."""

  def f(x, w, gs, dy):
    y, vjp = jax.vjp(
      functools.partial(
        ms.grouped_matmul, group_sizes_G=gs, impl=impl, max_tile=max_tile, min_tile=min_tile
      ),
      x,
      w,
    )
    return (y, *vjp(dy))

  return jax.jit(f)


@jax.jit
def _reference(x, w, gs, dy):
  """lax.ragged_dot with float32 accumulation; rows past sum(gs) give zeros."""

  def f(x, w):
    return jax.lax.ragged_dot(x, w, gs, preferred_element_type=jnp.float32).astype(x.dtype)

  y, vjp = jax.vjp(f, x, w)
  return (y, *vjp(dy))


def check_against_ragged_dot(
  M, D, F, group_sizes, dtype=jnp.float32, max_tile=None, min_tile=None, seed=0
):
  x, w, gs, dy = _inputs(M, D, F, group_sizes, dtype, seed)
  got = _fwd_bwd("tiled", max_tile, min_tile)(x, w, gs, dy)
  want = _reference(x, w, gs, dy)
  for name, g, v in zip(("y", "dx", "dw"), got, want):
    assert g.dtype == v.dtype and g.shape == v.shape, name
    assert_close(g, v.astype(jnp.float32), dtype, err_msg=f"{name} {group_sizes}")
  # Rows past sum(group_sizes) are exactly zero, and so is their dx.
  end = min(M, int(np.sum(group_sizes)))
  np.testing.assert_array_equal(np.asarray(got[0][end:], np.float32), 0)
  np.testing.assert_array_equal(np.asarray(got[1][end:], np.float32), 0)


# Compiling the tiled kernel takes ~2 s on CPU, so the cases share a few shapes (M, D, F)
# with a fixed number of groups; group sizes are values and need no recompile.
SHAPES = {
  "M45_G6": (45, 8, 12),  # 45: not a multiple of any tile size
  "M29_G1": (29, 8, 12),
  "M3_G2": (3, 8, 12),  # fewer rows than the default smallest tile
}
NAMED = {
  # name: (shape, group_sizes)
  "random_with_empty": ("M45_G6", [10, 0, 20, 0, 3, 4]),
  "every_row_routed": ("M45_G6", [8, 8, 8, 8, 8, 5]),
  "single_nonempty_group": ("M45_G6", [0, 0, 45, 0, 0, 0]),
  "first_group_all_rows": ("M45_G6", [45, 0, 0, 0, 0, 0]),
  "last_group_all_rows": ("M45_G6", [0, 0, 0, 0, 0, 45]),
  "sum_below_m": ("M45_G6", [7, 0, 13, 5, 0, 0]),
  "all_empty": ("M45_G6", [0, 0, 0, 0, 0, 0]),
  "one_row_groups": ("M45_G6", [1, 1, 1, 1, 1, 1]),
  "group_rows_not_tile_multiples": ("M45_G6", [17, 19, 9, 0, 0, 0]),
  "one_group": ("M29_G1", [29]),
  "one_group_partial": ("M29_G1", [11]),
  "fewer_rows_than_min_tile": ("M3_G2", [1, 2]),
}


@pytest.mark.parametrize("name", sorted(NAMED))
def test_named_cases_match_ragged_dot(name):
  shape, group_sizes = NAMED[name]
  check_against_ragged_dot(*SHAPES[shape], group_sizes)


# (max_tile, min_tile): the defaults, a single tile size, many sizes down to one row, and a
# largest tile bigger than M (capped at M's power of two, so the rows are padded).
TILES = [(None, None), (8, 8), (16, 1), (4, 2), (256, 32)]


@pytest.mark.parametrize("max_tile,min_tile", TILES)
def test_tile_settings_match_ragged_dot(max_tile, min_tile):
  check_against_ragged_dot(
    *SHAPES["M45_G6"], [9, 0, 21, 1, 6, 0], max_tile=max_tile, min_tile=min_tile
  )


def test_bfloat16_matches_ragged_dot():
  check_against_ragged_dot(*SHAPES["M45_G6"], [10, 0, 20, 3, 0, 9], dtype=jnp.bfloat16)


@st.composite
def group_sizes(draw, M, G):
  """G group sizes with sum <= M: the gaps between 0 and G sorted cut points in [0, M].

  Every split of up to M rows into G groups can be drawn, and random draws split the rows
  over several non-empty groups (rejection sampling of independent sizes would keep
  almost only single-group draws). Repeated cuts give empty groups; the last cut is the
  number of routed rows (rows past it must come out zero).
  """
  cuts = sorted(draw(st.lists(st.integers(0, M), min_size=G, max_size=G)))
  return [b - a for a, b in zip([0] + cuts, cuts)]


# Every tile setting of TILES on the 6-group shape, and the default on the one-group shape:
# each is its own test, so every setting is reached whatever hypothesis draws.
PROPERTY_CASES = [("M45_G6", t) for t in TILES] + [("M29_G1", TILES[0])]


@pytest.mark.parametrize(
  "shape,tiles", PROPERTY_CASES, ids=[f"{s}-tiles{t[0]}_{t[1]}" for s, t in PROPERTY_CASES]
)
@hypothesis.given(data=st.data(), seed=st.integers(0, 2**16))
def test_random_group_sizes_match_ragged_dot(shape, tiles, data, seed):
  M, D, F = SHAPES[shape]
  G = int(shape.split("_G")[1])
  sizes = data.draw(group_sizes(M, G), label="group_sizes")
  # What was drawn, for `pytest --hypothesis-show-statistics`.
  hypothesis.event(f"non-empty groups: {sum(s > 0 for s in sizes)} of {G}")
  hypothesis.event(
    "rows routed: " + ("all" if sum(sizes) == M else "none" if sum(sizes) == 0 else "some, not all")
  )
  check_against_ragged_dot(M, D, F, sizes, max_tile=tiles[0], min_tile=tiles[1], seed=seed)


def test_preferred_element_type():
  x, w, gs, _ = _inputs(20, 8, 4, [5, 15], jnp.bfloat16)
  y = ms.grouped_matmul(x, w, gs, impl="tiled", preferred_element_type=jnp.float32)
  assert y.dtype == jnp.float32
  want = jax.lax.ragged_dot(x, w, gs, preferred_element_type=jnp.float32)
  assert_close(y, want, jnp.float32)


def test_auto_is_tiled_on_cpu():
  x, w, gs, dy = _inputs(*SHAPES["M45_G6"], [10, 0, 20, 3, 0, 5])
  got = _fwd_bwd("auto")(x, w, gs, dy)
  want = _fwd_bwd("tiled")(x, w, gs, dy)
  for g, v in zip(got, want):
    np.testing.assert_array_equal(g, v)


def test_group_sizes_beyond_m_are_clipped():
  x, w, _, dy = _inputs(*SHAPES["M45_G6"], [0] * 6)
  gs = jnp.asarray([30, 30, 0, 0, 0, 9], jnp.int32)  # sum 69 > M = 45: group 1 gets 15
  got = _fwd_bwd("tiled")(x, w, gs, dy)
  want = _reference(x, w, jnp.asarray([30, 15, 0, 0, 0, 0], jnp.int32), dy)
  for g, v in zip(got, want):
    assert_close(g, v, jnp.float32)


# --- the schedule -------------------------------------------------------------------------


def _covered_rows(group_sizes, M, tiles):
  """Host replay of the schedule: how many times each row is written for its own group."""
  sched = gmm.tile_schedule(np.asarray(group_sizes, np.int32), M, tiles)
  hits = np.zeros(M, np.int64)
  off = np.concatenate([[0], sched.end_G[:-1]])
  for g in range(len(group_sizes)):
    for l, t in enumerate(tiles):
      for j in range(sched.count_GL[g, l]):
        start = sched.first_GL[g, l] + j * t
        rows = np.arange(start, start + t)
        hits[rows[(rows >= off[g]) & (rows < sched.end_G[g])]] += 1
  return hits, sched


@hypothesis.given(
  sizes=st.lists(st.integers(0, 70), min_size=1, max_size=12),
  extra_rows=st.integers(0, 9),
  max_log=st.integers(0, 7),
  min_log=st.integers(0, 7),
)
def test_schedule_covers_each_row_once_within_the_row_bound(sizes, extra_rows, max_log, min_log):
  M = max(1, sum(sizes) + extra_rows)
  max_tile, min_tile = 2 ** max(max_log, min_log), 2 ** min(max_log, min_log)
  tiles = gmm.tile_sizes(M, max_tile, min_tile)
  hits, sched = _covered_rows(sizes, M, tiles)
  routed = min(M, sum(sizes))
  np.testing.assert_array_equal(hits[:routed], 1)
  np.testing.assert_array_equal(hits[routed:], 0)
  visits = accounting.schedule_rows(sizes, M, tiles)
  rows_computed = sum(t * n for t, n in visits.items())
  assert routed <= rows_computed <= M + len(sizes) * (tiles[-1] - 1)
  # Only non-empty groups are visited.
  assert int(sched.num_groups) == sum(1 for s in np.diff(np.r_[0, sched.end_G]) if s > 0)


def test_schedule_on_device_equals_host():
  sizes = np.array([9, 0, 21, 1, 6], np.int32)
  tiles = gmm.tile_sizes(45, 16, 2)
  host = gmm.tile_schedule(sizes, 45, tiles)
  dev = jax.jit(gmm.tile_schedule, static_argnums=(1, 2))(jnp.asarray(sizes), 45, tiles)
  for name in ("count_GL", "first_GL", "end_G"):
    np.testing.assert_array_equal(getattr(dev, name), getattr(host, name), err_msg=name)
  n = int(host.num_groups)
  assert int(dev.num_groups) == n
  np.testing.assert_array_equal(np.sort(dev.groups[:n]), np.sort(host.groups[:n]))


@pytest.mark.parametrize("M,G", [(8192, 8), (8192, 32), (8192, 128), (8192, 4096), (37, 4), (5, 1)])
def test_default_tiles_bound_padding_to_a_quarter_of_m(M, G):
  max_tile, min_tile = gmm.default_tiles(M, G)
  assert min_tile <= gmm.PREFERRED_MIN_TILE and min_tile & (min_tile - 1) == 0
  assert min_tile == 1 or G * (min_tile - 1) <= M / 4
  assert max_tile == gmm.DEFAULT_MAX_TILE


def test_tile_sizes():
  assert gmm.tile_sizes(8192, 256, 8) == (256, 128, 64, 32, 16, 8)
  assert gmm.tile_sizes(45, 256, 8) == (64, 32, 16, 8)  # capped at M's power of two
  assert gmm.tile_sizes(3, 256, 8) == (8,)  # never below min_tile


def test_loop_trip_counts_follow_the_schedule():
  counts = accounting.loop_trip_counts([300, 0, 40, 5], 400, (256, 64, 16))
  # Sizes need not be consecutive powers of two: 300 = 256 + 44 -> one 256, no 64, and
  # 44 -> two 16s and a masked 16; 40 -> three 16s (the last masked); 5 -> one masked 16.
  assert counts == {"gmm_groups": 3, "gmm_tile_256": 1, "gmm_tile_64": 0, "gmm_tile_16": 3 + 3 + 1}


def test_two_matmuls_of_one_shape_copy_no_whole_buffer():
  """A SwiGLU's gate and up are two grouped matmuls of one shape. XLA merges equal zero fills
  of their loop buffers, then copies the shared one whole for each loop (written in place);
  each call's buffers must be its own: no copy of a [G, D, F] or [M, F] array in the
  compiled forward+backward."""
  M, D, F, G = 64, 16, 24, 4
  x, w1, gs, dy = _inputs(M, D, F, [20, 0, 30, 10])
  w2 = w1 * 2

  def loss(x, w1, w2):
    mm = functools.partial(ms.grouped_matmul, group_sizes_G=gs, impl="tiled")
    return jnp.sum(mm(x, w1) * mm(x, w2) * dy)

  hlo = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(x, w1, w2).compile().as_text()
  copies = re.findall(r"= f32\[([\d,]+)\]\S* copy\(", hlo)
  assert not [c for c in copies if c in (f"{G},{D},{F}", f"{M},{F}")], copies


# --- inside shard_map -----------------------------------------------------------------------


@pytest.fixture(scope="module")
def mesh8(devices):
  return jax.make_mesh((8,), ("expert",), devices=devices)


def test_inside_shard_map_forward_and_grad(mesh8):
  """Per-device rows, local matrices and group sizes; and replicated matrices, whose
  gradient comes back summed over the devices."""
  N, M, D, F, L = 8, 24, 8, 6, 3
  rng = np.random.default_rng(0)
  x = jnp.asarray(rng.normal(size=(N * M, D)), jnp.float32)
  w_local = jnp.asarray(rng.normal(size=(N * L, D, F)), jnp.float32)
  w_shared = jnp.asarray(rng.normal(size=(L, D, F)), jnp.float32)
  gs = jnp.asarray(rng.integers(0, 10, size=(N * L,)), jnp.int32)
  gs = gs.at[:L].set(jnp.asarray([M, 0, 0]))  # device 0: one group holds every row
  dy = jnp.asarray(rng.normal(size=(N * M, F)), jnp.float32)

  def body(x_MD, w_LDF, w_shared_LDF, gs_L, dy_MF):
    # Per-device sizes: M rows, L groups.
    outs = []
    for w in (w_LDF, w_shared_LDF):
      y, vjp = jax.vjp(
        lambda x, w: ms.grouped_matmul(x, w, gs_L, impl="tiled", max_tile=8, min_tile=2), x_MD, w
      )
      dx, dw = vjp(dy_MF)
      outs += [y, dx, dw]
    # outs[-1], the gradient of the replicated w, is already the sum over devices: JAX
    # transposes the cast of w to varying (inside grouped_matmul) into a psum.
    return tuple(outs)

  row = P("expert")
  f = jax.jit(
    jax.shard_map(
      body,
      mesh=mesh8,
      in_specs=(row, row, P(), row, row),
      out_specs=(row, row, row, row, row, P()),
      check_vma=True,
    )
  )
  sharded = lambda a: jax.device_put(a, jax.sharding.NamedSharding(mesh8, row))
  replicated = jax.device_put(w_shared, jax.sharding.NamedSharding(mesh8, P()))
  got = [
    np.asarray(a) for a in f(sharded(x), sharded(w_local), replicated, sharded(gs), sharded(dy))
  ]
  dw_shared = 0
  for n in range(N):
    rows, groups = slice(n * M, (n + 1) * M), slice(n * L, (n + 1) * L)
    for k, w in enumerate((w_local[groups], w_shared)):
      y, dx, dw = _reference(x[rows], w, gs[groups], dy[rows])
      assert_close(got[3 * k][rows], y, jnp.float32, err_msg=f"y device {n}")
      assert_close(got[3 * k + 1][rows], dx, jnp.float32, err_msg=f"dx device {n}")
      if k == 0:
        assert_close(got[2][groups], dw, jnp.float32, err_msg=f"dw device {n}")
      else:
        dw_shared = dw_shared + dw
  assert_close(got[5], dw_shared, jnp.float32, err_msg="psum of dw")


# --- errors -------------------------------------------------------------------------------


def _args(M=8, D=4, F=3, G=2):
  return jnp.zeros((M, D)), jnp.zeros((G, D, F)), jnp.asarray([3, 5], jnp.int32)


def test_error_unknown_impl():
  with pytest.raises(ValueError, match=r"grouped_matmul: impl must be one of .*'dense'"):
    ms.grouped_matmul(*_args(), impl="dense")


def test_error_mismatched_d():
  x, _, gs = _args()
  with pytest.raises(ValueError, match=r"w_GDF's D \(5\) must equal x_MD's D \(4\)"):
    ms.grouped_matmul(x, jnp.zeros((2, 5, 3)), gs)


def test_error_group_sizes_shape():
  x, w, _ = _args()
  with pytest.raises(ValueError, match=r"group_sizes_G must have shape \(2,\).*got \(3,\)"):
    ms.grouped_matmul(x, w, jnp.asarray([1, 2, 3], jnp.int32))
  with pytest.raises(ValueError, match=r"group_sizes_G must have shape \(2,\).*got \(1, 2\)"):
    ms.grouped_matmul(x, w, jnp.asarray([[1, 2]], jnp.int32))


def test_error_non_integer_group_sizes():
  x, w, _ = _args()
  with pytest.raises(TypeError, match=r"group_sizes_G must have an integer dtype.*float32"):
    ms.grouped_matmul(x, w, jnp.asarray([3.0, 5.0]))


def test_error_non_float_x():
  _, w, gs = _args()
  with pytest.raises(TypeError, match=r"x_MD must have a floating-point dtype"):
    ms.grouped_matmul(jnp.zeros((8, 4), jnp.int32), w, gs)


def test_error_bad_rank():
  x, _, gs = _args()
  with pytest.raises(ValueError, match=r"w_GDF must be 3-D \(got shape \(4, 3\)\)"):
    ms.grouped_matmul(x, jnp.zeros((4, 3)), gs)


@pytest.mark.parametrize(
  "kw,match",
  [
    (dict(max_tile=24), r"max_tile must be a power of two \(got 24\)"),
    (dict(min_tile=3), r"min_tile must be a power of two \(got 3\)"),
    (dict(max_tile=0), r"max_tile must be a power of two \(got 0\)"),
    (dict(max_tile=8, min_tile=16), r"min_tile \(16\) must be <= max_tile \(8\)"),
  ],
)
def test_error_bad_tiles(kw, match):
  with pytest.raises(ValueError, match=match):
    ms.grouped_matmul(*_args(), impl="tiled", **kw)


def test_error_non_int_tile():
  with pytest.raises(TypeError, match=r"max_tile must be an int \(got float\)"):
    ms.grouped_matmul(*_args(), impl="tiled", max_tile=8.0)


def test_errors_raise_at_trace_time():
  x, w, gs = _args()
  spec = lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype)
  with pytest.raises(ValueError, match="impl must be one of"):
    jax.eval_shape(functools.partial(ms.grouped_matmul, impl="nope"), spec(x), spec(w), spec(gs))
