"""`megablox_gmm`: megablox's TPU kernels (interpret mode on CPU) against the float64 oracle.

A grouped matmul is the MoE of `tests/oracle.py` with one expert per row: row m goes to
its group, rows past sum(group_sizes) to no expert (id -1, zero). Outputs and the gradients
with respect to x and w are compared. Group sizes are values, so cases of one shape share a
compile (interpret mode traces every kernel: keep the shapes few and small).
"""

import functools
import re

import hypothesis
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import oracle
import pytest
from cases import assert_close
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from moe_shard.kernels import tpu as gmm_tpu


def _inputs(M, D, F, G, dtype, seed=0):
  rng = np.random.default_rng(seed)
  x = jnp.asarray(rng.normal(size=(M, D)), dtype)
  w = jnp.asarray(rng.normal(size=(G, D, F)) / np.sqrt(D), dtype)
  dy = jnp.asarray(rng.normal(size=(M, F)), dtype)
  return x, w, dy


def _group_ids(group_sizes, M):
  """int[M]: each row's group (sizes clipped to end by M), -1 past their total."""
  ids = np.repeat(np.arange(len(group_sizes)), group_sizes)[:M]
  return np.concatenate([ids, np.full(M - len(ids), -1)])


@functools.cache
def _fwd_bwd(preferred_element_type=None, tiling=None, vmem_limit_bytes=None):
  """A jitted (x, w, gs, dy) -> (y, dx, dw); one compile per shape and dtype."""

  def f(x, w, gs, dy):
    y, vjp = jax.vjp(
      lambda x, w: gmm_tpu.megablox_gmm(
        x,
        w,
        gs,
        preferred_element_type=preferred_element_type,
        tiling=tiling,
        vmem_limit_bytes=vmem_limit_bytes,
        interpret=True,
      ),
      x,
      w,
    )
    return (y, *vjp(dy))

  return jax.jit(f)


def check(
  M,
  D,
  F,
  group_sizes,
  dtype=jnp.float32,
  preferred_element_type=None,
  tiling=None,
  vmem_limit_bytes=None,
):
  out_dtype = dtype if preferred_element_type is None else preferred_element_type
  x, w, dy = _inputs(M, D, F, len(group_sizes), dtype)
  dy = dy.astype(out_dtype)  # the cotangent has y's dtype
  gs = jnp.asarray(group_sizes, jnp.int32)
  y, dx, dw = _fwd_bwd(preferred_element_type, tiling, vmem_limit_bytes)(x, w, gs, dy)
  ids = _group_ids(group_sizes, M)
  want_y = oracle.moe(x, w, ids)
  want_dx, want_dw, _ = oracle.moe_grads(x, w, ids, None, dy)
  assert (y.dtype, dx.dtype, dw.dtype) == (out_dtype, dtype, dtype)
  assert (y.shape, dx.shape, dw.shape) == ((M, F), (M, D), w.shape)
  for name, got, want in (("y", y, want_y), ("dx", dx, want_dx), ("dw", dw, want_dw)):
    assert_close(got, want, dtype, err_msg=f"{name} {group_sizes}")
  # Rows past the groups' total are exactly zero (megablox leaves them unwritten: NaN in
  # interpret mode), in y and in dx.
  past = ids < 0
  np.testing.assert_array_equal(np.asarray(y, np.float32)[past], 0)
  np.testing.assert_array_equal(np.asarray(dx, np.float32)[past], 0)


# M = 45 rows: one 128-row tile, padded; D = 8 and F = 12 in one partial 128-column tile.
NAMED = {
  "random_with_empty": [10, 0, 20, 0, 3, 4],  # sum 37: rows past the total
  "every_row_routed": [8, 8, 8, 8, 8, 5],
  "single_nonempty_group": [0, 0, 45, 0, 0, 0],
  "all_empty": [0, 0, 0, 0, 0, 0],
  # 140 > 128 padded rows: clipped to end at 45. (Unclipped, megablox would index a row
  # tile past the array: clamped in interpret mode, out of bounds on a TPU.)
  "sum_above_padded_m": [30, 90, 0, 0, 0, 20],
}


@pytest.mark.parametrize("name", sorted(NAMED))
def test_named_cases_match_oracle(name):
  check(45, 8, 12, NAMED[name])


@hypothesis.given(sizes=st.lists(st.integers(0, 20), min_size=6, max_size=6))
def test_random_group_sizes_match_oracle(sizes):
  check(45, 8, 12, sizes)  # the named cases' compile; sums above 45 are clipped


@pytest.mark.parametrize("group_sizes", [[29], [11]], ids=["all_rows", "partial"])
def test_one_group_matches_oracle(group_sizes):
  check(29, 8, 12, group_sizes)


def test_several_tiles_match_oracle():
  # 3 row tiles of 128 (300 rows padded to 384), two D tiles and two F tiles (200 and 130,
  # each ending in a partial tile); group 0 and group 2 share the first tile's boundary row 100.
  check(300, 200, 130, [100, 0, 150], tiling=(128, 128, 128))


def test_full_width_tiles_match_oracle():
  # One D tile and one F tile (200 and 130 in one partial 256-column tile), as the rule picks where VMEM
  # allows: consecutive row tiles of a group share w's block, the rows are read once.
  check(300, 200, 130, [100, 0, 150], tiling=(128, 256, 256))


def test_tiles_under_a_vmem_limit_match_oracle():
  # An explicit VMEM limit: the default tiles are then full width (256 x 256 x 256 here),
  # and megablox is traced with the limit in its compiler parameters.
  assert gmm_tpu.default_tiling(300, 200, 130, jnp.float32, num_groups=3, vmem_limit=96 << 20) == (
    256,
    256,
    256,
  )
  check(300, 200, 130, [100, 0, 150], vmem_limit_bytes=96 << 20)


def test_bfloat16_matches_oracle():
  check(45, 8, 12, [10, 0, 20, 3, 0, 9], dtype=jnp.bfloat16)


def test_bfloat16_in_float32_out():
  check(45, 8, 12, [10, 0, 20, 3, 0, 9], dtype=jnp.bfloat16, preferred_element_type=jnp.float32)


def test_inside_shard_map(devices):
  """Tokens split over 8 devices, w replicated: dw comes back summed over the devices."""
  mesh = jax.make_mesh((8,), ("x",), devices=devices)
  x, w, dy = _inputs(8 * 16, 8, 12, 3, jnp.float32)
  sizes_NG = np.array([[5, 0, 7], [16, 0, 0], [0, 0, 0], [1, 2, 3]] * 2, np.int32)

  def body(x, w, gs, dy):
    y, vjp = jax.vjp(lambda x, w: gmm_tpu.megablox_gmm(x, w, gs[0], interpret=True), x, w)
    return (y, *vjp(dy))

  split, rep = NamedSharding(mesh, P("x")), NamedSharding(mesh, P())
  f = jax.jit(
    jax.shard_map(
      body, mesh=mesh, in_specs=(P("x"), P(), P("x"), P("x")), out_specs=(P("x"), P("x"), P())
    )
  )
  y, dx, dw = f(
    jax.device_put(x, split),
    jax.device_put(w, rep),
    jax.device_put(sizes_NG, split),
    jax.device_put(dy, split),
  )
  ids = np.concatenate([_group_ids(s, 16) for s in sizes_NG])
  assert_close(y, oracle.moe(x, w, ids), jnp.float32)
  want_dx, want_dw, _ = oracle.moe_grads(x, w, ids, None, dy)
  assert_close(dx, want_dx, jnp.float32)
  assert_close(dw, want_dw, jnp.float32)


def test_platform_dependent_takes_default_branch_on_cpu():
  x, w, dy = _inputs(45, 8, 12, 6, jnp.float32)
  gs = jnp.asarray(NAMED["random_with_empty"], jnp.int32)

  def dense_masked(x, w, gs):
    return jax.lax.ragged_dot(x, w, gs)

  def f(x, w):
    return jax.lax.platform_dependent(x, w, gs, tpu=gmm_tpu.megablox_gmm, default=dense_masked)

  got = jax.jit(jax.value_and_grad(lambda x, w: jnp.sum(f(x, w) * dy), (0, 1)))(x, w)
  want = jax.value_and_grad(lambda x, w: jnp.sum(dense_masked(x, w, gs) * dy), (0, 1))(x, w)
  for g, v in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    np.testing.assert_array_equal(g, v)


def test_compiles_for_tpu_in_shard_map():
  """Compiled (not run) for 8 v5e chips: platform_dependent takes the megablox branch, Mosaic
  takes the odd shapes in partial tiles, the kernels trace under check_vma, dw is all-reduced."""
  pytest.importorskip("libtpu")
  from jax.experimental import topologies

  devs = topologies.get_topology_desc(platform="tpu", topology_name="v5e:2x4").devices
  mesh = jax.sharding.Mesh(np.array(devs), ("x",))

  def gmm(x, w, gs):
    return jax.lax.platform_dependent(
      x, w, gs, tpu=gmm_tpu.megablox_gmm, default=jax.lax.ragged_dot
    )

  def body(x, w, gs, dy):
    y, vjp = jax.vjp(lambda x, w: gmm(x, w, gs[0]), x, w)
    return (y, *vjp(dy))

  f = jax.jit(
    jax.shard_map(
      body, mesh=mesh, in_specs=(P("x"), P(), P("x"), P("x")), out_specs=(P("x"), P("x"), P())
    )
  )
  sds = lambda shape, dtype, spec: jax.ShapeDtypeStruct(
    shape, dtype, sharding=NamedSharding(mesh, spec)
  )
  text = (
    f.lower(
      sds((8 * 45, 8), jnp.bfloat16, P("x")),
      sds((6, 8, 12), jnp.bfloat16, P()),
      sds((8, 6), jnp.int32, P("x")),
      sds((8 * 45, 12), jnp.bfloat16, P("x")),
    )
    .compile()
    .as_text()
  )
  assert "all-reduce" in text
  # gmm, gmm^T, tgmm, each declaring 2*m*k*n FLOPs on the per-device problem, its rows
  # padded (45 -> 128) and its columns not (8 and 12: partial tiles, w is not copied):
  # what `bench.kernel_runs.gmm_tpu.kernel_costs` reads.
  from bench.kernel_runs.gmm_tpu import fetched_bytes, kernel_costs

  assert [f for f, _ in kernel_costs(text)] == [2 * 128 * 8 * 12] * 3
  assert set(re.findall(r"bf16\[6,\d+,\d+\]", text)) == {"bf16[6,8,12]"}  # w never padded
  # Their declared bytes are the formula `fetched_bytes` sets beside what is fetched (the
  # formula does not depend on the sizes' values; 6 groups, one 128-row tile).
  sizes, tiles = [10, 0, 20, 0, 3, 4], (128, 128, 128)
  calls = (("gmm", 8, 12), ("gmm", 12, 8), ("tgmm", 8, 12))
  want = [fetched_bytes(k, sizes, 128, K, N, tiles, 2, 2)[1] for k, K, N in calls]
  assert sorted(b for _, b in kernel_costs(text)) == sorted(want)


@pytest.mark.parametrize("impl", ["all_to_all", "ragged_all_to_all", "all_gather"])
def test_default_tpu_backend_in_scan_over_layers_training(impl):
  """Scan-over-layers training, compiled (not run) for 8 v5e chips with the default
  gmm_impl: "auto" takes megablox on TPU, whose group metadata fails shard_map's
  varying-axes check when JAX transforms the scan (the reason the dispatches' shard_maps
  run without it). The step must compile and hold megablox's kernels."""
  pytest.importorskip("libtpu")
  from jax.experimental import topologies

  import moe_shard as ms

  devs = topologies.get_topology_desc(platform="tpu", topology_name="v5e:2x4").devices
  mesh = jax.sharding.Mesh(np.array(devs).reshape(4, 2), ("expert", "data"))
  cfg = ms.MoEConfig(
    d_model=128, d_ff=128, num_experts=8, top_k=2, impl=impl, param_dtype="bfloat16"
  )
  shapes = jax.eval_shape(lambda k: ms.init_moe_params(k, cfg), jax.random.key(0))
  specs = ms.moe_param_specs(cfg)
  sds = lambda a, spec: jax.ShapeDtypeStruct(
    (2,) + a.shape, a.dtype, sharding=NamedSharding(mesh, P(None, *spec))
  )
  params = jax.tree.map(sds, shapes, specs)
  x = jax.ShapeDtypeStruct(
    (8, 32, 128), jnp.bfloat16, sharding=NamedSharding(mesh, P(("expert", "data")))
  )

  def loss(params, x):
    def block(x, p):
      y, aux = ms.moe_layer(p, x, cfg, mesh)
      return x + y, aux["aux_loss"]

    x, aux = jax.lax.scan(block, x, params)
    return jnp.sum(x.astype(jnp.float32)) + jnp.sum(aux)

  text = jax.jit(jax.grad(loss)).lower(params, x).compile().as_text()
  assert 'custom_call_target="tpu_custom_call"' in text  # megablox's kernels


# --- the tiling rule ------------------------------------------------------------------------


MIB = 2**20


@pytest.mark.parametrize(
  "M,D,F,dtype,G,limit,want",
  [
    # Mosaic's default limit (a target not known, e.g. interpret mode): 12 MiB of blocks.
    (8192, 2048, 4096, jnp.bfloat16, 1, None, (512, 1024, 1024)),
    (8192, 2048, 4096, jnp.bfloat16, 8, None, (512, 1024, 1024)),  # 7 * 512 <= 3/4 * 8192
    (8192, 2048, 4096, jnp.bfloat16, 13, None, (512, 1024, 1024)),
    (8192, 2048, 4096, jnp.bfloat16, 14, None, (256, 1024, 1024)),  # 13 * 512 > 3/4 * 8192
    (8192, 2048, 4096, jnp.bfloat16, 32, None, (256, 1024, 1024)),
    (8192, 2048, 4096, jnp.float32, 1, None, (512, 512, 1024)),  # f32: halve tk to fit VMEM
    (45, 8, 12, jnp.float32, 6, None, (128, 128, 128)),  # tiny: one padded tile each
    (300, 384, 640, jnp.bfloat16, 2, None, (256, 384, 640)),  # divisors of 3 and 5 lanes
    # v5e, v6e (96 MiB limit): full width; 1024 rows where boundaries and padding are few.
    (8192, 2048, 4096, jnp.bfloat16, 1, 96 * MIB, (1024, 2048, 4096)),
    (32768, 2048, 4096, jnp.bfloat16, 2, 96 * MIB, (1024, 2048, 4096)),
    (8192, 2048, 4096, jnp.bfloat16, 3, 96 * MIB, (512, 2048, 4096)),  # 2 * 1024 > 8192 / 8
    (9216, 2048, 4096, jnp.bfloat16, 8, 96 * MIB, (512, 2048, 4096)),
    (8192, 2048, 4096, jnp.bfloat16, 14, 96 * MIB, (256, 2048, 4096)),
    (8192, 2048, 4096, jnp.float32, 1, 96 * MIB, (1024, 2048, 2048)),
    # The down projection: tgmm's transposed x[1024, 4096] block does not fit beside its
    # blocks (compiled for v5e it ran out of VMEM), so 512 rows; the up projection keeps 1024.
    (65536, 4096, 2048, jnp.bfloat16, 8, 96 * MIB, (512, 4096, 2048)),
    (65536, 2048, 4096, jnp.bfloat16, 8, 96 * MIB, (1024, 2048, 4096)),
    # v5p, TPU7x (48 MiB): tgmm's [D, F] block does not fit whole; F halved.
    (9216, 2048, 4096, jnp.bfloat16, 8, 48 * MIB, (512, 2048, 2048)),
    (8192, 2048, 4096, jnp.bfloat16, 1, 48 * MIB, (512, 2048, 2048)),  # 1024 would lower tn
  ],
)
def test_default_tiling(M, D, F, dtype, G, limit, want):
  got = gmm_tpu.default_tiling(M, D, F, dtype, num_groups=G, vmem_limit=limit)
  assert got == want
  tm, tk, tn = got
  assert -(-D // 128) * 128 % tk == 0 and -(-F // 128) * 128 % tn == 0
  used = gmm_tpu.vmem_bytes(tm, tk, tn, jnp.dtype(dtype).itemsize)
  assert used <= gmm_tpu.vmem_budget(limit) and (limit is None or used < limit)
  assert gmm_tpu.tgmm_fits(tm, tk, tn, jnp.dtype(dtype).itemsize, limit)


@pytest.mark.parametrize(
  "M,D,F,G,limit,want,forward",
  [
    # DeepSeek-V3's gate at 256 tokens per chip on v5e: tgmm's whole [D, F] dw block narrows
    # the three kernels' tk to D/2; the forward alone keeps it whole (w once per group).
    (2232, 7168, 2048, 32, 96 * MIB, (256, 3584, 2048), (256, 7168, 2048)),
    (2232, 2048, 7168, 32, 96 * MIB, (256, 2048, 3584), (256, 2048, 7168)),
    (8192, 2048, 4096, 1, 96 * MIB, (1024, 2048, 4096), (1024, 2048, 4096)),
    (8192, 2048, 4096, 1, 48 * MIB, (512, 2048, 2048), (512, 2048, 2048)),
  ],
)
def test_default_tiling_forward(M, D, F, G, limit, want, forward):
  tiles = functools.partial(
    gmm_tpu.default_tiling, M, D, F, jnp.bfloat16, num_groups=G, vmem_limit=limit
  )
  assert tiles() == want and tiles(forward=True) == forward
  tm, tk, tn = forward
  assert gmm_tpu.vmem_bytes(tm, tk, tn, 2, ("fwd",)) <= gmm_tpu.vmem_budget(limit)


@pytest.mark.parametrize("sizes", [[300, 0, 724], [1024, 0, 0], [100, 200, 300, 424]])
@pytest.mark.parametrize("transpose", [False, True])
def test_fetched_once_bytes_bound_the_grid_walk(sizes, transpose):
  """With one contraction tile the declared bytes are x per output tile, each w[g] once
  and y: at least what the grid walk fetches (equal when no group is empty), and below
  megablox's formula; with two contraction tiles, None (megablox's own)."""
  from bench.kernel_runs.gmm_tpu import fetched_bytes

  M, K, N, b, G = 1024, 256, 512, 2, len(sizes)
  w_shape = (G, N, K) if transpose else (G, K, N)
  for tiling in [(256, K, N), (256, K, 256), (512, K, 128)]:
    got = gmm_tpu.fetched_once_bytes((M, K), w_shape, tiling, b, b, transpose)
    fetched, declared = fetched_bytes("gmm", sizes, M, K, N, tiling, b, b)
    assert got is not None and fetched <= got <= declared
    assert (got == fetched) == all(sizes)
  assert gmm_tpu.fetched_once_bytes((M, K), w_shape, (256, 128, N), b, b, transpose) is None


@pytest.mark.parametrize(
  "kind,want",
  [
    ("TPU v5 lite", 96 * MIB),
    ("TPU v6 lite", 96 * MIB),
    ("TPU v5", 48 * MIB),
    ("TPU7x", 48 * MIB),
    ("TPU v4", None),  # 16 MiB: Mosaic's default already
    ("cpu", None),
    (None, None),
  ],
)
def test_vmem_limit_per_generation(kind, want):
  assert gmm_tpu.vmem_limit(kind) == want


def _lowered_for(topology, tiling=None):
  """megablox_gmm's forward and backward in a shard_map over `topology`, lowered (not
  compiled): the StableHLO text."""
  pytest.importorskip("libtpu")
  from jax.experimental import topologies

  devs = topologies.get_topology_desc(platform="tpu", topology_name=topology).devices
  mesh = jax.sharding.Mesh(np.array(devs), ("x",))

  def body(x, w, gs, dy):
    assert gmm_tpu.target_device_kind() == devs[0].device_kind
    y, vjp = jax.vjp(lambda x, w: gmm_tpu.megablox_gmm(x, w, gs[0], tiling=tiling), x, w)
    return (y, *vjp(dy))

  f = jax.jit(
    jax.shard_map(
      body, mesh=mesh, in_specs=(P("x"), P(), P("x"), P("x")), out_specs=(P("x"), P("x"), P())
    )
  )
  n = len(devs)
  sds = lambda shape, dtype, spec: jax.ShapeDtypeStruct(
    shape, dtype, sharding=NamedSharding(mesh, spec)
  )
  return (
    f.lower(
      sds((n * 256, 256), jnp.bfloat16, P("x")),
      sds((4, 256, 512), jnp.bfloat16, P()),
      sds((n, 4), jnp.int32, P("x")),
      sds((n * 256, 512), jnp.bfloat16, P("x")),
    )
    .as_text()
    .replace("\\22", '"')
  )  # the custom calls' backend_config JSON, unescaped


def test_fetched_bytes_follow_the_block_indices():
  """`bench.kernel_runs.gmm_tpu.fetched_bytes`: a block is copied when its index changes between grid
  steps. M=1024 rows in 256-row tiles, K=256, N=512, bf16, groups [300, 0, 724]: tiles
  0, 1 (shared by groups 0 and 2), 1, 2, 3 are visited."""
  from bench.kernel_runs.gmm_tpu import fetched_bytes

  sizes, M, K, N, b = [300, 0, 724], 1024, 256, 512, 2
  x, y, w = M * K * b, M * N * b, K * N * b  # x and y whole, one group's w
  # Full width: x, y once (tile 1 twice in a row: kept), w once per non-empty group.
  fetched, declared = fetched_bytes("gmm", sizes, M, K, N, (256, K, N), b, b)
  assert fetched == x + 2 * w + y
  assert declared == x + w * (M // 256 + 3 - 1) + y  # megablox: w per possible row tile
  # Two K tiles: every step moves to a new x and w block; the output stays per row tile.
  fetched, _ = fetched_bytes("gmm", sizes, M, K, N, (256, 128, N), b, b)
  assert fetched == 5 * (256 * K * b) + 5 * w + y
  # Two N tiles, one K tile: x read twice over, w once per group and N tile.
  fetched, _ = fetched_bytes("gmm", sizes, M, K, N, (256, K, 256), b, b)
  assert fetched == 2 * x + 2 * w + y
  # tgmm, full width: x and dy once, each group's dw written once (the empty one too).
  fetched, declared = fetched_bytes("tgmm", sizes, M, K, N, (256, K, N), b, b)
  assert fetched == declared == x + y + 3 * w


def test_vmem_limit_reaches_the_kernels_of_the_generation_traced_for():
  """In a shard_map over v5e devices the three kernels carry v5e's VMEM limit (96 MiB);
  over v4 devices, the same shapes and tiles, none (Mosaic's default): the megablox trace
  made under one limit is not reused under the other."""
  limit = '"scoped_memory_configs": [{"memory_space":1, "offset": 0, "size": %d}]'
  v5e = _lowered_for("v5e:2x4", tiling=(128, 256, 512))
  assert v5e.count(limit % (96 * MIB)) == 3
  v4 = _lowered_for("v4:2x2x1", tiling=(128, 256, 512))
  assert v4.count("tpu_custom_call") >= 3 and "scoped_memory_configs" not in v4


def test_declared_bytes_reach_the_kernels():
  """The forward and dx kernels (one contraction tile each) declare `fetched_once_bytes`;
  tgmm keeps megablox's own figure."""
  text = _lowered_for("v5e:2x4", tiling=(128, 256, 512))
  declared = [int(b) for b in re.findall(r'"bytes_accessed":\s*"?(\d+)', text)]
  fwd = gmm_tpu.fetched_once_bytes((256, 256), (4, 256, 512), (128, 256, 512), 2, 2)
  dx = gmm_tpu.fetched_once_bytes((256, 512), (4, 256, 512), (128, 512, 256), 2, 2, True)
  assert fwd in declared and dx in declared and len(declared) == 3


# --- errors ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
  "kwargs,args,exc,match",
  [
    ({}, ((4, 8), jnp.float16, (2, 8, 4), (2,)), TypeError, "x_MD must be bfloat16"),
    ({}, ((4, 8), jnp.float32, (2, 6, 4), (2,)), ValueError, "w_GDF's D"),
    ({}, ((4, 8), jnp.float32, (2, 8, 4), (3,)), ValueError, "group_sizes_G must have"),
    (
      {"tiling": (100, 128, 128)},
      ((4, 8), jnp.float32, (2, 8, 4), (2,)),
      ValueError,
      "tiling must be",
    ),
    (
      {"tiling": (128, 64, 128)},
      ((4, 8), jnp.float32, (2, 8, 4), (2,)),
      ValueError,
      "tiling must be",
    ),
    (
      {"preferred_element_type": jnp.int32},
      ((4, 8), jnp.float32, (2, 8, 4), (2,)),
      TypeError,
      "preferred_element_type must be a float",
    ),
  ],
)
def test_errors(kwargs, args, exc, match):
  x_shape, dtype, w_shape, g_shape = args
  with pytest.raises(exc, match=f"megablox_gmm: {match}"):
    gmm_tpu.megablox_gmm(
      jnp.zeros(x_shape, dtype),
      jnp.zeros(w_shape, jnp.float32),
      jnp.zeros(g_shape, jnp.int32),
      **kwargs,
    )
