"""On a GPU: the native `ragged_all_to_all`, the grouped-matmul backends (the Mosaic GPU one,
"auto" there, on a Hopper GPU) and every dispatch against the float64 oracles, outputs and
gradients.

CI has no GPU, so every test here is skipped there, with the reason printed. On a machine
with one (docs/guides/tpu_gpu.md):

    JAX_PLATFORMS=cuda python -m pytest -q -rs tests/test_gpu.py

One GPU is one device: the expert-parallel dispatches run on a 1x1 mesh. There
`all_to_all` exchanges with the device itself and `ragged_all_to_all` exchanges nothing
(every expert is local); XLA:GPU's own `ragged-all-to-all` (the CPU tests run an emulation
of it) is run directly, and the emulation's semantics checked against it.
float32 matmuls run at "highest" precision here (XLA:GPU would otherwise use TF32, whose
10-bit mantissa is outside the float32 tolerance); bfloat16 cases keep the default.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import oracle
import pytest
from cases import ROUTINGS, assert_close, assert_tree_close, cotangent, feasible, make_case
from jax.sharding import PartitionSpec as P

import moe_shard as ms
from moe_shard.kernels import tokamax as tokamax_backend
from moe_shard.kernels.grouped_matmul import GMM_CHOICES
from moe_shard.parallel import ragged_all_to_all_emulated

pytestmark = pytest.mark.skipif(
  jax.default_backend() != "gpu",
  reason="needs a GPU (CI has none): run `JAX_PLATFORMS=cuda python -m pytest "
  "tests/test_gpu.py` on a machine with one",
)


@pytest.fixture(autouse=True)
def _highest_precision():
  with jax.default_matmul_precision("highest"):
    yield


_needs_tokamax = pytest.mark.skipif(
  not tokamax_backend.available(),
  reason="tokamax is not installed: bench/gpu_h100.sh installs it from .whl/ "
  "(bench/gpu_wheels.sh fetches the wheels)",
)


def _mesh(names=("data", "expert")):
  return jax.make_mesh((1,) * len(names), names, devices=jax.devices()[:1])


# --------------------------------------------------------------------------- the primitive


def test_native_ragged_all_to_all_matches_the_emulation_and_the_model():
  """`lax.ragged_all_to_all` as XLA:GPU runs it, against the CPU emulation and NumPy."""
  rng = np.random.default_rng(0)
  J, rows, D = 6, 48, 4
  send = rng.integers(0, 7, J).astype(np.int32)
  send[2] = 0  # an empty slice
  in_off = (np.cumsum(send) - send + rng.integers(0, 3, J)).astype(np.int32)
  order = rng.permutation(J)  # slices land in another order, with gaps between them
  out_off = np.zeros(J, np.int32)
  at = 0
  for i in order:
    at += int(rng.integers(0, 2))
    out_off[i], at = at, at + send[i]
  operand = rng.normal(size=(rows, D)).astype(np.float32)
  output = np.full((rows, D), -7.0, np.float32)
  want = output.copy()
  for i in range(J):
    want[out_off[i] : out_off[i] + send[i]] = operand[in_off[i] : in_off[i] + send[i]]

  def exchange(fn):
    body = functools.partial(fn, axis_name="x")
    f = jax.shard_map(body, mesh=_mesh(("x",)), in_specs=P(), out_specs=P(), check_vma=False)
    return np.asarray(jax.jit(f)(operand, output, in_off, send, out_off, send))

  np.testing.assert_array_equal(exchange(jax.lax.ragged_all_to_all), want)
  np.testing.assert_array_equal(exchange(ragged_all_to_all_emulated), want)


def test_one_gpu_ragged_dispatch_exchanges_nothing():
  # One device on the expert axis holds every expert: no exchange, native or emulated.
  x, w, experts, weights = make_case("uniform", T=16, D=8, F=16, E=4, K=2, seed=0)
  fn = functools.partial(ms.moe_ragged_all_to_all, mesh=_mesh())
  # The compiled program's ops (the module's name, jit_moe_ragged_all_to_all, is no op).
  text = jax.jit(fn).lower(x, w, experts, weights).compile().as_text()
  assert "all-to-all" not in text  # neither all-to-all nor ragged-all-to-all


# --------------------------------------------------------------------------- grouped matmul


def _gmm_reference(x, w, sizes, dy):
  """y, dx, dw of the grouped matmul in float64 (rows past the groups: zeros)."""
  x, w, dy = (np.asarray(a, np.float64) for a in (x, w, dy))
  y, dx, dw = np.zeros((x.shape[0], w.shape[2])), np.zeros_like(x), np.zeros_like(w)
  start = 0
  for g, n in enumerate(sizes):
    rows = slice(start, start + n)
    y[rows], dx[rows], dw[g] = x[rows] @ w[g], dy[rows] @ w[g].T, x[rows].T @ dy[rows]
    start += n
  return y, dx, dw


# Every backend that runs on a GPU, in both dtypes, but for what other tests cover: megablox
# here runs its TPU kernels in Pallas' interpret mode (slow to compile, and checked on CPU by
# tests/test_grouped_matmul.py), and mosaic_gpu in float32 is lax.ragged_dot.
GPU_GMM = [
  pytest.param(impl, dtype, marks=_needs_tokamax) if impl == "tokamax" else (impl, dtype)
  for impl in GMM_CHOICES
  if impl != "megablox"
  for dtype in ("float32", "bfloat16")
  if (impl, dtype) != ("mosaic_gpu", "float32")
]


@pytest.mark.parametrize(("impl", "dtype"), GPU_GMM)
def test_grouped_matmul_backends(impl, dtype):
  """Empty groups, one big group and rows past the groups' total, forward and backward."""
  rng = np.random.default_rng(1)
  M, D, F = 96, 32, 48
  sizes = np.array([0, 40, 3, 0, 17, 1, 0, 20], np.int32)  # 81 of 96 rows
  x = jnp.asarray(rng.normal(size=(M, D)), dtype)
  w = jnp.asarray(rng.normal(size=(len(sizes), D, F)) / np.sqrt(D), dtype)
  dy = jnp.asarray(rng.normal(size=(M, F)), dtype)

  @jax.jit
  def run(x, w, dy):
    y, vjp = jax.vjp(lambda x, w: ms.grouped_matmul(x, w, sizes, impl=impl), x, w)
    return y, *vjp(dy)

  got = run(x, w, dy)
  for what, g, want in zip(("y", "dx", "dw"), got, _gmm_reference(x, w, sizes, dy)):
    assert g.dtype == jnp.dtype(dtype)
    assert_close(g.astype(jnp.float32), want, dtype, err_msg=f"{impl} {dtype} {what}")


# Mosaic GPU backend (`kernels.gpu`): empty groups, one group, rows past the groups' total, sizes
# clipped by M, D and F that are not multiples of the blocks (padded), many groups.
MOSAIC_CASES = {
  "empty_groups_rows_past": (96, 32, 48, [0, 40, 3, 0, 17, 1, 0, 20]),
  "one_group": (256, 128, 256, [200]),
  "odd_d_f_clipped": (300, 200, 130, [100, 0, 250]),
  "many_groups": (1000, 256, 384, [0, 1, 63, 64, 65, 127, 128, 129, 0, 0, 300, 2] * 2),
  "no_rows": (128, 128, 128, [0, 0, 0]),
}


# The kernels: the default (warp-specialized, `kernels.gpu_ws`), JAX's single-warpgroup
# kernels, and the warp-specialized ones with a 3-step pipeline and one 128-column epilogue.
def _blocks(name):
  from moe_shard.kernels import gpu as gmm_gpu

  return {
    "default": None,
    "jax": gmm_gpu.BlockConfig(grid_block_n=1),
    "ws_3_steps": gmm_gpu.BlockConfig(
      max_concurrent_steps=3, grid_block_n=2, warp_specialized=True
    ),
  }[name]


# Every case in bfloat16 with the default and JAX's kernels, two with the other configs;
# float16 (the same kernels at another dtype) on two with the default.
@pytest.mark.parametrize(
  ("case", "dtype", "kernels"),
  [(case, "bfloat16", k) for case in MOSAIC_CASES for k in ("default", "jax")]
  + [
    (case, dtype, k)
    for case in ("many_groups", "odd_d_f_clipped")
    for dtype, k in (("bfloat16", "ws_3_steps"), ("float16", "default"))
  ],
)
def test_mosaic_gpu_gmm_matches_the_oracle(case, dtype, kernels):
  from moe_shard.kernels import gpu as gmm_gpu

  M, D, F, sizes = MOSAIC_CASES[case]
  rng = np.random.default_rng(2)
  x = jnp.asarray(rng.normal(size=(M, D)), dtype)
  w = jnp.asarray(rng.normal(size=(len(sizes), D, F)) / np.sqrt(D), dtype)
  dy = jnp.asarray(rng.normal(size=(M, F)), dtype)
  blocks = _blocks(kernels)

  @jax.jit
  def run(x, w, dy):
    y, vjp = jax.vjp(
      lambda x, w: gmm_gpu.mosaic_gpu_gmm(x, w, jnp.asarray(sizes), blocks=blocks), x, w
    )
    return y, *vjp(dy)

  got = run(x, w, dy)
  ends = np.minimum(np.cumsum(sizes), M)
  clipped = np.diff(ends, prepend=0)
  for what, g, want in zip(("y", "dx", "dw"), got, _gmm_reference(x, w, clipped, dy)):
    assert g.dtype == jnp.dtype(dtype) and g.shape == want.shape
    # float16 (10-bit mantissa) to bfloat16's tolerance
    assert_close(
      g.astype(jnp.float32), want, jnp.bfloat16, err_msg=f"{case} {dtype} {kernels} {what}"
    )
  assert not np.any(np.asarray(got[0][ends[-1] :], np.float32))  # zeros, not unwritten rows
  assert not np.any(np.asarray(got[1][ends[-1] :], np.float32))


def test_auto_runs_the_mosaic_gpu_kernels():
  """auto on a GPU: three Mosaic GPU kernels (y, dx, dw) in the compiled program."""
  x = jnp.ones((256, 128), jnp.bfloat16)
  w = jnp.ones((4, 128, 128), jnp.bfloat16)
  gs = jnp.asarray([64, 0, 100, 50], jnp.int32)

  def f(x, w):
    y, vjp = jax.vjp(lambda x, w: ms.grouped_matmul(x, w, gs), x, w)
    return y, *vjp(jnp.ones_like(y))

  assert jax.jit(f).lower(x, w).as_text().count("@mosaic_gpu") == 3
  _, dx, dw = jax.jit(f)(x, w)
  np.testing.assert_array_equal(np.asarray(dx[214:], np.float32), 0)
  np.testing.assert_array_equal(np.asarray(dw[1], np.float32), 0)
  np.testing.assert_array_equal(np.asarray(dw[0], np.float32), 64)


# --------------------------------------------------------------------------- dispatches


DISPATCHES = {
  "ragged_dot": ms.moe_ragged_dot,
  "ragged_all_to_all": functools.partial(ms.moe_ragged_all_to_all, mesh=_mesh()),
  "all_to_all": functools.partial(ms.moe_all_to_all, mesh=_mesh()),
  "all_gather": functools.partial(ms.moe_all_gather, mesh=_mesh()),
}


@functools.partial(jax.jit, static_argnums=0)
def _outputs_and_grads(name, x, w, experts, weights, ct):
  def loss(x, w, weights):
    y = DISPATCHES[name](x, w, experts, weights)
    return jnp.sum(y.astype(jnp.float32) * ct), y

  grads, y = jax.grad(loss, argnums=(0, 1, 2), has_aux=True)(x, w, weights)
  return y, grads


@pytest.mark.parametrize("routing", [r for r in ROUTINGS if r != "one_device"])
@pytest.mark.parametrize("name", list(DISPATCHES))
def test_dispatch_matches_the_oracle(name, routing):
  """SwiGLU, float32, T = 13 (not a multiple of anything), on the adversarial routings
  ("one_device" is "uniform" on one device)."""
  T, D, F, E = 13, 8, 16, 4
  K = E if routing == "k_equals_e" else 2
  assert feasible(routing, E=E, K=K)
  x, w, experts, weights = make_case(
    routing, T=T, D=D, F=F, E=E, K=K, seed=3, ffn="swiglu", num_devices=1
  )
  ct = cotangent((T, D), jnp.float32, seed=3)
  y, grads = _outputs_and_grads(name, x, w, experts, weights, ct)
  assert_close(y, oracle.moe(x, w, experts, weights), jnp.float32, err_msg=f"{name} y")
  assert_tree_close(
    grads, oracle.moe_grads(x, w, experts, weights, ct), jnp.float32, err_msg=f"{name} grads"
  )


_LAYER = jax.jit(ms.moe_layer, static_argnums=(2, 3))


@functools.cache
def _layer_reference(cfg):
  """The float32 masked-scan layer on `cfg`'s bf16 parameters and input (every impl of
  `test_layer_in_bfloat16` shares it: one compile, one run)."""
  ref_cfg = ms.MoEConfig(**{**cfg.__dict__, "impl": "masked_scan", "param_dtype": "float32"})
  params = ms.init_moe_params(jax.random.key(0), cfg)
  x = jax.random.normal(jax.random.key(1), (4, 32, 64), jnp.bfloat16)
  params32 = jax.tree.map(lambda a: a.astype(jnp.float32), params)
  return _LAYER(params32, x.astype(jnp.float32), ref_cfg, None)[0]


@pytest.mark.parametrize("impl", ["auto", "ragged_all_to_all", "all_to_all"])
def test_layer_in_bfloat16(impl):
  """The whole layer (router, dispatch, shared expert) on the GPU mesh, bf16, against the
  local masked-scan reference run in float32 on the same bf16 inputs."""
  cfg = ms.MoEConfig(
    d_model=64,
    d_ff=128,
    num_experts=8,
    top_k=2,
    num_shared_experts=1,
    shared_d_ff=64,
    impl=impl,
    param_dtype="bfloat16",
  )
  params = ms.init_moe_params(jax.random.key(0), cfg)
  x = jax.random.normal(jax.random.key(1), (4, 32, 64), jnp.bfloat16)
  y, aux = _LAYER(params, x, cfg, _mesh())
  want = _layer_reference(dataclasses.replace(cfg, impl="auto"))  # one per test module
  assert y.dtype == jnp.bfloat16
  assert_close(y.astype(jnp.float32), want, jnp.bfloat16, err_msg=impl)
  assert int(jnp.sum(aux["expert_load"])) == 4 * 32 * 2


# Last in the file: a one-tile grid (M and F within one block, one group) is the one shape
# whose kernel crashed Pallas' GPU interpreter on CPU (a division by zero while compiling);
# here it runs on the GPU itself.
def test_mosaic_gpu_gmm_single_tile():
  from moe_shard.kernels import gpu as gmm_gpu

  rng = np.random.default_rng(3)
  x = jnp.asarray(rng.normal(size=(64, 128)), jnp.bfloat16)
  w = jnp.asarray(rng.normal(size=(1, 128, 128)) / np.sqrt(128), jnp.bfloat16)
  dy = jnp.asarray(rng.normal(size=(64, 128)), jnp.bfloat16)
  y, vjp = jax.vjp(lambda x, w: gmm_gpu.mosaic_gpu_gmm(x, w, jnp.asarray([50])), x, w)
  for what, g, want in zip(("y", "dx", "dw"), (y, *vjp(dy)), _gmm_reference(x, w, [50], dy)):
    assert_close(g.astype(jnp.float32), want, jnp.bfloat16, err_msg=what)
