"""`mosaic_gpu_gmm` on CPU: the wrapper against the float64 oracle with stand-in kernels, and
the real Mosaic GPU kernels traced (not run) where `grouped_matmul`'s "auto" traces them.

Mosaic GPU kernels run only on a Hopper GPU (tests/test_gpu.py runs them there). Here:

  * The wrapper (padding, clipping, zeroing of the rows past the groups, the custom_vjp,
    shard_map) runs with stand-in kernels that keep the real ones' contract: they check the
    same divisibility, write their inputs' dtype, and leave the rows past the groups
    unwritten (NaN here).
  * The real kernels are traced: in `grouped_matmul(impl="auto")` on CPU as where a CUDA
    backend is present (`cuda_present`; without one "auto" builds no CUDA branch), inside
    shard_map with check_vma, and in a bfloat16 `lax.scan` over expert-parallel layers under grad
    (the trace that broke megablox as TPU's default). `transposed_ragged_dot` reads the SM
    count of `jax.devices()[0]` while tracing; `fake_sm_count` gives it one so its trace is
    checked too (off a GPU the library traces `lax.ragged_dot_general` for dw instead).
"""

import dataclasses
import functools
import subprocess
import sys
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from cases import TOL
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import moe_shard as ms
from moe_shard.kernels import gpu as gmm_gpu
from moe_shard.kernels import grouped_matmul as gmm_module

BF16 = TOL["bfloat16"]  # float16 (10-bit mantissa) is checked to bfloat16's tolerance


def _close(got, want, err_msg=""):
  want = np.asarray(want, np.float64)
  scale = max(1.0, float(np.max(np.abs(want)))) if want.size else 1.0
  np.testing.assert_allclose(
    np.asarray(got, np.float64), want, rtol=BF16["rtol"], atol=BF16["atol"] * scale, err_msg=err_msg
  )


def _reference(x, w, sizes, dy):
  """y, dx, dw in float64; sizes clipped to end by M, rows past them zero."""
  x, w, dy = (np.asarray(a, np.float64) for a in (x, w, dy))
  y, dx, dw = np.zeros((x.shape[0], w.shape[2])), np.zeros_like(x), np.zeros_like(w)
  start = 0
  for g, n in enumerate(sizes):
    rows = slice(min(start, len(x)), min(start + n, len(x)))
    y[rows], dx[rows], dw[g] = x[rows] @ w[g], dy[rows] @ w[g].T, x[rows].T @ dy[rows]
    start += n
  return y, dx, dw


# --------------------------------------------------------------------------- stand-ins


def _fake_row_kernel(lhs, rhs, group_sizes, blocks, transpose_rhs=False):
  assert lhs.dtype == rhs.dtype, (lhs.dtype, rhs.dtype)
  (m, k), (_, k2, n) = lhs.shape, rhs.shape
  if transpose_rhs:
    k2, n = n, k2
  cols = blocks.block_n * (2 if blocks.warp_specialized else blocks.grid_block_n)
  assert k == k2 and k % blocks.block_k == 0, (k, k2, blocks)
  assert n % cols == 0 and m % blocks.block_m == 0, (m, n, blocks)
  rhs = rhs.swapaxes(1, 2) if transpose_rhs else rhs
  y = jax.lax.ragged_dot(lhs, rhs, group_sizes, preferred_element_type=jnp.float32)
  rows = jax.lax.broadcasted_iota(jnp.int32, (m, 1), 0) < jnp.sum(group_sizes)
  return jnp.where(rows, y, jnp.nan).astype(lhs.dtype)  # rows past the groups: unwritten


def _fake_dw_kernel(lhs, rhs, group_sizes, blocks):
  assert lhs.dtype == rhs.dtype
  (k, m), (k2, n) = lhs.shape, rhs.shape
  rows = blocks.block_m * (2 if blocks.warp_specialized else 1)
  assert k == k2 and k % blocks.block_k == 0 and m % rows == 0 and n % blocks.block_n == 0
  ends = jnp.cumsum(group_sizes)
  ids_K = jnp.searchsorted(ends, jnp.arange(k), side="right")
  onehot_GK = (ids_K[None] == jnp.arange(len(group_sizes))[:, None]).astype(jnp.float32)
  return jnp.einsum(
    "gk,km,kn->gmn", onehot_GK, lhs.astype(jnp.float32), rhs.astype(jnp.float32)
  ).astype(lhs.dtype)


@pytest.fixture
def stand_ins(monkeypatch):
  """Both kernel families (JAX's and the warp-specialized) replaced by stand-ins."""
  monkeypatch.setattr(gmm_gpu, "_row_kernel", _fake_row_kernel)
  monkeypatch.setattr(gmm_gpu, "_dw_kernel", _fake_dw_kernel)
  jax.clear_caches()  # no trace of the real kernels is reused, nor kept for later tests
  yield
  jax.clear_caches()


@pytest.fixture
def fake_sm_count(monkeypatch):
  """`jax.devices()[0].core_count` as `transposed_ragged_dot` sees it: 132 (an H100)."""
  _, trd = gmm_gpu._kernels()
  fake_jax = types.SimpleNamespace(
    **{k: getattr(jax, k) for k in dir(jax) if not k.startswith("__")}
  )
  fake_jax.devices = lambda *a: [types.SimpleNamespace(core_count=132)]
  monkeypatch.setattr(trd, "jax", fake_jax)
  monkeypatch.setattr(gmm_gpu, "_default_device_is_a_gpu", lambda: True)
  jax.clear_caches()
  yield
  jax.clear_caches()


@functools.cache
def _fwd_bwd(preferred_element_type=None, blocks=None):
  def f(x, w, gs, dy):
    y, vjp = jax.vjp(
      lambda x, w: gmm_gpu.mosaic_gpu_gmm(
        x, w, gs, preferred_element_type=preferred_element_type, blocks=blocks
      ),
      x,
      w,
    )
    return (y, *vjp(dy))

  return jax.jit(f)


def _inputs(M, D, F, G, dtype, seed=0):
  rng = np.random.default_rng(seed)
  x = jnp.asarray(rng.normal(size=(M, D)), dtype)
  w = jnp.asarray(rng.normal(size=(G, D, F)) / np.sqrt(D), dtype)
  dy = jnp.asarray(rng.normal(size=(M, F)), dtype)
  return x, w, dy


CASES = {
  "empty_groups_rows_past": (96, 32, 48, [0, 40, 3, 0, 17, 1, 0, 20]),  # 81 of 96 rows
  "one_group": (64, 128, 128, [50]),
  "all_rows_one_of_three": (128, 128, 256, [0, 128, 0]),
  "odd_sizes_clipped": (45, 40, 72, [30, 0, 40]),  # ends past M = 45: clipped
  "no_rows": (16, 64, 64, [0, 0]),
}


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("name", list(CASES))
def test_wrapper_matches_oracle(stand_ins, name, dtype):
  M, D, F, sizes = CASES[name]
  x, w, dy = _inputs(M, D, F, len(sizes), dtype)
  y, dx, dw = _fwd_bwd()(x, w, jnp.asarray(sizes, jnp.int32), dy)
  assert (y.dtype, dx.dtype, dw.dtype) == (jnp.dtype(dtype),) * 3
  assert (y.shape, dx.shape, dw.shape) == ((M, F), (M, D), w.shape)
  for what, got, want in zip(("y", "dx", "dw"), (y, dx, dw), _reference(x, w, sizes, dy)):
    _close(got, want, err_msg=f"{name} {dtype} {what}")
  past = min(sum(sizes), M)
  assert not np.any(np.asarray(y[past:], np.float32)) and not np.any(
    np.asarray(dx[past:], np.float32)
  )  # exactly zero, not the kernels' unwritten rows


def test_wrapper_float32_out_and_other_blocks(stand_ins):
  M, D, F, sizes = 100, 96, 160, [10, 0, 60, 20]
  x, w, dy = _inputs(M, D, F, len(sizes), jnp.bfloat16)
  blocks = gmm_gpu.BlockConfig(block_m=64, block_n=64, block_k=32, grid_block_n=2)
  assert gmm_gpu.padded_sizes(M, D, F, blocks) == (128, 128, 256)
  y, dx, dw = _fwd_bwd(jnp.float32, blocks)(
    x, w, jnp.asarray(sizes, jnp.int32), dy.astype(jnp.float32)
  )
  assert (y.dtype, dx.dtype, dw.dtype) == (jnp.float32, jnp.bfloat16, jnp.bfloat16)
  for got, want in zip((y, dx, dw), _reference(x, w, sizes, dy)):
    _close(got, want)


def test_wrapper_inside_shard_map(stand_ins, devices):
  """Rows split over 8 devices, w replicated: dw comes back summed over the devices."""
  mesh = jax.make_mesh((8,), ("x",), devices=devices)
  x, w, dy = _inputs(8 * 16, 64, 64, 3, jnp.bfloat16)
  sizes_NG = np.array([[5, 0, 7], [16, 0, 0], [0, 0, 0], [1, 2, 3]] * 2, np.int32)

  def body(x, w, gs, dy):
    y, vjp = jax.vjp(lambda x, w: gmm_gpu.mosaic_gpu_gmm(x, w, gs[0]), x, w)
    return (y, *vjp(dy))

  split, rep = NamedSharding(mesh, P("x")), NamedSharding(mesh, P())
  f = jax.jit(
    jax.shard_map(
      body, mesh=mesh, in_specs=(P("x"), P(), P("x"), P("x")), out_specs=(P("x"), P("x"), P())
    )
  )
  y, dx, dw = (
    np.asarray(a, np.float32)
    for a in f(
      jax.device_put(x, split),
      jax.device_put(w, rep),
      jax.device_put(sizes_NG, split),
      jax.device_put(dy, split),
    )
  )
  want_dw = 0
  for n, sizes in enumerate(sizes_NG):
    rows = slice(16 * n, 16 * (n + 1))
    wy, wdx, wdw = _reference(x[rows], w, sizes, dy[rows])
    _close(y[rows], wy)
    _close(dx[rows], wdx)
    want_dw = want_dw + wdw
  _close(dw, want_dw)


# --------------------------------------------------------------------------- real kernels


def _primitives(jaxpr, out=None):
  """Every primitive name in a jaxpr and the jaxprs in its equations' params."""
  out = [] if out is None else out
  for e in getattr(jaxpr, "jaxpr", jaxpr).eqns:
    out.append(e.primitive.name)
    for v in e.params.values():
      for u in v if isinstance(v, (tuple, list)) else (v,):
        if hasattr(getattr(u, "jaxpr", u), "eqns"):
          _primitives(u, out)
  return out


def _kernels_traced(fn, *args):
  """Warpgroup-MMA kernels (wgmma) and dense-dw fallbacks in the jaxpr of fn(*args)."""
  names = _primitives(jax.make_jaxpr(fn)(*args))
  return names.count("wgmma_ref"), names.count("ragged_dot_general")


JAX_KERNELS = gmm_gpu.BlockConfig(grid_block_n=1)  # JAX's single-warpgroup kernels


def _loss(impl, blocks=None):
  x, w, _ = _inputs(96, 32, 48, 8, jnp.bfloat16)
  sizes = jnp.asarray(CASES["empty_groups_rows_past"][3], jnp.int32)
  if impl == "blocks":
    mm = lambda x, w: gmm_gpu.mosaic_gpu_gmm(x, w, sizes, blocks=blocks)
  else:
    mm = lambda x, w: ms.grouped_matmul(x, w, sizes, impl=impl)
  fn = jax.grad(lambda x, w: jnp.sum(mm(x, w).astype(jnp.float32)), (0, 1))
  return fn, x, w


def test_kernels_trace_on_cpu():
  """The warp-specialized kernels (the default) trace anywhere: fwd and dx one MMA each,
  dw one per consumer warpgroup's half. JAX's: fwd and dx; dw (needing an SM count) as
  the fallback."""
  assert _kernels_traced(*_loss("mosaic_gpu")) == (4, 0)
  assert _kernels_traced(*_loss("blocks", JAX_KERNELS)) == (2, 1)


def test_all_three_kernels_trace_with_an_sm_count(fake_sm_count):
  assert _kernels_traced(*_loss("blocks", JAX_KERNELS)) == (3, 0)


@pytest.fixture
def cuda_present(monkeypatch):
  """ "auto" builds its CUDA branch as in a process with a CUDA backend (`auto_backends`)."""
  monkeypatch.setattr(gmm_module, "WHERE_PRESENT", ())


def test_auto_builds_no_cuda_branch_without_a_cuda_backend():
  """Off a CUDA host "auto" neither imports nor traces the Mosaic GPU kernels."""
  assert "cuda" not in jax.extend.backend.backends()
  assert gmm_module.auto_backends() == {"tpu": "megablox"}
  fn, x, w = _loss("auto")
  assert _kernels_traced(fn, x, w)[0] == 0


def test_auto_traces_the_cuda_branch_and_runs_tiled_on_cpu(cuda_present):
  fn, x, w = _loss("auto")
  assert _kernels_traced(fn, x, w)[0] == 4
  got = jax.jit(fn)(x, w)
  want = jax.jit(_loss("tiled")[0])(x, w)
  for g, v in zip(got, want):
    np.testing.assert_array_equal(np.asarray(g, np.float32), np.asarray(v, np.float32))


def test_import_loads_no_pallas_kernels():
  """`import moe_shard` loads neither Mosaic GPU (which needs absl-py) nor Pallas TPU."""
  code = (
    "import sys, moe_shard\n"
    "bad = [m for m in sys.modules if m.startswith(('jax._src.pallas.mosaic_gpu.core',"
    " 'jax.experimental.pallas.tpu', 'moe_shard.kernels.gpu', 'moe_shard.kernels.tpu'))"
    " and m != 'moe_shard.kernels.tpu_tiling']\n"
    "assert not bad, bad\n"
  )
  res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
  assert res.returncode == 0, res.stderr[-2000:]


def test_a_missing_kernel_dependency_is_named(monkeypatch):
  def missing(name):
    raise ModuleNotFoundError(f"No module named 'absl' (importing {name})", name="absl")

  monkeypatch.setattr(gmm_module.importlib, "import_module", missing)
  with pytest.raises(ImportError, match=r"import 'absl'.*pip install 'moe_shard\[gpu\]'"):
    gmm_module.kernel_module("gpu")


def test_float32_takes_ragged_dot():
  fn, x, w = _loss("mosaic_gpu")
  assert _kernels_traced(fn, x.astype(jnp.float32), w.astype(jnp.float32))[0] == 0


@pytest.mark.parametrize("impl", ["all_to_all", "ragged_all_to_all"])
def test_bf16_scan_over_expert_parallel_layers_grad(fake_sm_count, cuda_present, devices, impl):
  """The trace that broke megablox as TPU's default: a `lax.scan` over stacked layers,
  differentiated, each layer a shard_map dispatch on a 4 x 2 mesh, here in bfloat16 so that
  every grouped matmul traces the Mosaic GPU branch. Lowered for CPU (tiled branch)."""
  mesh = jax.make_mesh((4, 2), (ms.EXPERT, ms.DATA), devices=devices)
  cfg = ms.MoEConfig(
    d_model=64, d_ff=128, num_experts=8, top_k=2, impl=impl, param_dtype="bfloat16"
  )
  layers = [ms.init_moe_params(jax.random.key(i), cfg, mesh) for i in range(2)]
  stacked = jax.tree.map(lambda *a: jnp.stack(a), *layers)
  x_BSD = jax.device_put(
    jax.random.normal(jax.random.key(5), (8, 4, 64), jnp.bfloat16),
    NamedSharding(mesh, P((ms.DATA, ms.EXPERT))),
  )

  def loss(stacked, x_BSD):
    def body(x_BSD, params):
      y_BSD, aux = ms.moe_layer(params, x_BSD, cfg, mesh)
      return x_BSD + y_BSD, aux["aux_loss"]

    x_BSD, aux_L = jax.lax.scan(body, x_BSD, stacked)
    return jnp.sum(x_BSD.astype(jnp.float32) ** 2) + jnp.sum(aux_L)

  grad = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))
  assert _primitives(grad.trace(stacked, x_BSD).jaxpr).count("wgmma_ref") >= 3
  grad.lower(stacked, x_BSD)


# --------------------------------------------------------------------------- rule, errors


def test_default_blocks_and_padding():
  blocks = gmm_gpu.default_blocks(32768, 2048, 4096, jnp.bfloat16, num_groups=8)
  assert blocks == gmm_gpu.BlockConfig(128, 128, 64, 4, 4, warp_specialized=True, epi_block_n=64)
  assert gmm_gpu.padded_sizes(32768, 2048, 4096, blocks) == (32768, 2048, 4096)
  # A CTA tile of the warp-specialized kernels is 256 wide (dw: 256 rows of D).
  assert gmm_gpu.padded_sizes(45, 40, 72, blocks) == (128, 256, 256)
  assert gmm_gpu.padded_sizes(64, 1408, 1408, blocks) == (128, 1536, 1536)
  assert gmm_gpu.default_blocks(64, 2048, 4096, jnp.float16).block_k == 64
  # JAX's kernels: the snake's width divides the output columns.
  assert gmm_gpu.padded_sizes(45, 40, 72, JAX_KERNELS) == (128, 128, 128)
  wide = dataclasses.replace(JAX_KERNELS, grid_block_n=4)
  assert gmm_gpu.padded_sizes(64, 1280, 768, wide) == (128, 1536, 1024)


@pytest.mark.parametrize("seed", range(4))
def test_warp_specialized_tile_lists(seed):
  """The tiles `gpu_ws.ragged_dot` visits cover each group's rows once, no tile empty; the
  steps of `transposed_ragged_dot` keep exactly each group's rows (an empty group: one step,
  all rows masked), on sizes with empty groups, shared and exact tiles, rows past the groups."""
  from moe_shard.kernels import gpu_ws

  rng = np.random.default_rng(seed)
  for bm in (8, 16, 64):
    G, m = int(rng.integers(1, 12)), bm * int(rng.integers(1, 6))
    sizes = rng.integers(0, 2 * bm, G) * (rng.random(G) < 0.7)
    sizes[0] = bm * (seed % 2)  # an exact tile, or an empty first group
    sizes = np.diff(np.minimum(np.cumsum(sizes), m), prepend=0)
    want = np.repeat(np.arange(G), sizes)
    tiles = np.asarray(gpu_ws.row_tiles(jnp.asarray(sizes, jnp.int32), m, bm))
    num, tiles_T4 = tiles[0], tiles[1:].reshape(-1, 4)
    assert len(tiles_T4) == -(-m // bm) + G - 1 and not tiles_T4[num:].any()
    got = np.full(m, -1)
    for g, b, start, size in tiles_T4[:num]:
      assert size > 0 and start >= 0 and start + size <= bm
      rows = np.arange(b * bm + start, b * bm + start + size)
      assert (got[rows] == -1).all()
      got[rows] = g
    np.testing.assert_array_equal(got[: len(want)], want)
    assert (got[len(want) :] == -1).all()
    steps = np.asarray(gpu_ws.group_steps(jnp.asarray(sizes, jnp.int32), m, bm))
    for g, (first, count, lo, hi) in enumerate(steps):
      assert count >= 1 and first >= 0 and first + count <= m // bm
      kept = [
        (first + s) * bm + r
        for s in range(count)
        for r in range(bm)
        if not (s == 0 and r < lo) and not (s == count - 1 and r >= hi)
      ]
      np.testing.assert_array_equal(kept, np.flatnonzero(want == g))


@pytest.mark.parametrize(
  "kwargs,args,exc,match",
  [
    ({}, ((4, 8), jnp.float32, (2, 8, 4), (2,)), TypeError, "x_MD must be bfloat16"),
    ({}, ((4, 8), jnp.bfloat16, (2, 6, 4), (2,)), ValueError, "w_GDF's D"),
    ({}, ((4, 8), jnp.bfloat16, (2, 8, 4), (3,)), ValueError, "group_sizes_G must have"),
    (
      {"blocks": (128, 128, 64, 4, 1)},
      ((4, 8), jnp.bfloat16, (2, 8, 4), (2,)),
      ValueError,
      "blocks must be",
    ),
    (
      {"blocks": gmm_gpu.BlockConfig(block_k=0)},
      ((4, 8), jnp.bfloat16, (2, 8, 4), (2,)),
      ValueError,
      "blocks must be",
    ),
    (
      {"blocks": gmm_gpu.BlockConfig(warp_specialized=True, epi_block_n=48)},
      ((4, 8), jnp.bfloat16, (2, 8, 4), (2,)),
      ValueError,
      "blocks must be .*epi_block_n None or a divisor of block_n",
    ),
    (
      {"preferred_element_type": jnp.int32},
      ((4, 8), jnp.bfloat16, (2, 8, 4), (2,)),
      TypeError,
      "preferred_element_type must be a float",
    ),
  ],
)
def test_errors(kwargs, args, exc, match):
  x_shape, dtype, w_shape, g_shape = args
  with pytest.raises(exc, match=f"mosaic_gpu_gmm: {match}"):
    gmm_gpu.mosaic_gpu_gmm(
      jnp.zeros(x_shape, dtype),
      jnp.zeros(w_shape, jnp.float32),
      jnp.zeros(g_shape, jnp.int32),
      **kwargs,
    )


def test_block_config_is_hashable_and_replaceable():
  b = dataclasses.replace(gmm_gpu.BlockConfig(), block_m=64)
  assert hash(b) == hash(gmm_gpu.BlockConfig(block_m=64)) and b.kwargs()["block_m"] == 64
  assert "warp_specialized" not in b.kwargs()  # what JAX's kernels take
