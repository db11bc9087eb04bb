"""The "tokamax" grouped-matmul backend (`kernels/tokamax.py`) against the float64 oracle.

tokamax is optional (`pip install tokamax`): without it every test here but the error one
skips, with the reason printed. On CPU tokamax runs its "xla" implementation; on a GPU
`tests/test_gpu.py` runs the backend through `grouped_matmul` with its GPU kernels.
"""

import importlib
import sys

import jax
import jax.numpy as jnp
import numpy as np
import oracle
import pytest
from cases import assert_close

import moe_shard as ms

tokamax_backend = importlib.import_module("moe_shard.kernels.tokamax")

needs_tokamax = pytest.mark.skipif(
  not tokamax_backend.available(),
  reason="tokamax is not installed (pip install tokamax): the 'tokamax' backend is optional",
)

# Empty groups, one big group, rows past the groups' total (81 of 96 rows).
SIZES = [0, 40, 3, 0, 17, 1, 0, 20]


def _case(dtype, M=96, D=32, F=48, sizes=SIZES):
  rng = np.random.default_rng(4)
  x = jnp.asarray(rng.normal(size=(M, D)), dtype)
  w = jnp.asarray(rng.normal(size=(len(sizes), D, F)) / np.sqrt(D), dtype)
  dy = jnp.asarray(rng.normal(size=(M, F)), dtype)
  return x, w, jnp.asarray(sizes, jnp.int32), dy


def _oracle(x, w, sizes, dy):
  """y, dx, dw in float64: each row a token routed to its group (rows past the groups to an
  id out of range, which the oracle leaves out), with weight 1."""
  ids = np.repeat(np.arange(len(sizes) + 1), [*sizes, x.shape[0] - sum(sizes)])[:, None]
  y = oracle.moe(x, w, ids)
  dx, dw, _ = oracle.moe_grads(x, w, ids, None, oracle.f64(dy))
  return y, dx, dw


@needs_tokamax
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_tokamax_matches_the_oracle(dtype):
  x, w, gs, dy = _case(dtype)

  @jax.jit
  def run(x, w, dy):
    y, vjp = jax.vjp(lambda x, w: ms.grouped_matmul(x, w, gs, impl="tokamax"), x, w)
    return y, *vjp(dy)

  got = run(x, w, dy)
  for what, g, want in zip(("y", "dx", "dw"), got, _oracle(x, w, SIZES, dy)):
    assert g.dtype == jnp.dtype(dtype), what
    assert_close(g.astype(jnp.float32), want, dtype, err_msg=f"tokamax {dtype} {what}")
  assert not np.any(np.asarray(got[0][81:], np.float32))  # rows past the groups: zeros


@needs_tokamax
def test_tokamax_in_the_layer():
  """`MoEConfig(gmm_impl="tokamax")`: the local dispatch against the float64 oracle."""
  cfg = ms.MoEConfig(d_model=16, d_ff=32, num_experts=4, top_k=2, gmm_impl="tokamax")
  params = ms.init_moe_params(jax.random.key(0), cfg)
  x = jax.random.normal(jax.random.key(1), (24, 16), jnp.float32)
  routing = ms.top_k_routing(x @ params.router_DE, 2)
  got = ms.moe_ragged_dot(
    x, params.experts, routing.experts_TK, routing.weights_TK, gmm_impl="tokamax"
  )
  want = oracle.moe(x, params.experts, routing.experts_TK, routing.weights_TK)
  assert_close(got, want, jnp.float32)


def test_tokamax_missing_names_the_package(monkeypatch):
  monkeypatch.setitem(sys.modules, "tokamax", None)  # `import tokamax` raises ImportError
  x, w, gs, _ = _case("float32")
  with pytest.raises(ImportError, match=r"impl 'tokamax' needs the tokamax package"):
    ms.grouped_matmul(x, w, gs, impl="tokamax")
