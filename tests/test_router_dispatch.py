"""Every router through every dispatch: `moe_layer` on a 2 x 4 (data x expert) mesh.

For each router (softmax top-k; DeepSeek-V3-like sigmoid top-k with groups, a selection bias
and scaling; expert choice) the layer's output on the mesh, with each of the four
dispatches, must equal the masked scan on one device with the same routing groups, and a
NumPy float64 forward built from the NumPy router oracle (`router_oracle.py`), routed group
by group. The aux losses are checked against the oracle too. Every layer result is computed
once, in a module fixture (compiling dominates).
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import router_oracle as oracle
from cases import FAST_COMPILE, assert_close
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import moe_shard as ms

B, S, D, E, K = 4, 8, 8, 8, 2  # T = 32 tokens: 4 per device, 8 routing groups on the mesh
IMPLS = ("masked_scan", "ragged_dot", "all_gather", "all_to_all")
BASE = dict(
  d_model=D,
  d_ff=D,
  num_experts=E,
  top_k=K,
  expert_type="linear",
  gmm_impl="ragged_dot",
  load_balance_coef=1.0,
  z_loss_coef=0.0,
)
ROUTER_CFGS = {
  "top_k": ms.MoEConfig(**BASE),
  "deepseek_like": ms.MoEConfig(
    **BASE,
    score_func="sigmoid",
    num_groups=4,
    top_k_groups=2,
    routed_scaling=2.5,
    bias_balancing=True,
  ),
  # capacity ceil(1.5 * 4 * 2 / 8) = 2 of each group's 4 tokens per expert.
  "expert_choice": ms.MoEConfig(**BASE, router="expert_choice", capacity_factor=1.5),
}
# Routing groups of expert choice with a grouping that does not follow the devices: the
# router then runs on the whole array (vmap over groups), not under shard_map.
ROUTER_CFGS["expert_choice_4_groups"] = dataclasses.replace(
  ROUTER_CFGS["expert_choice"], routing_groups=4
)
MESH_GROUPS = dict(top_k=8, deepseek_like=8, expert_choice=8, expert_choice_4_groups=4)


@functools.partial(jax.jit, static_argnames=("cfg", "mesh"), compiler_options=FAST_COMPILE)
def run(params, x_BSD, cfg, mesh=None):
  return ms.moe_layer(params, x_BSD, cfg, mesh)


def params_for(cfg, seed):
  params = ms.init_moe_params(jax.random.key(seed), cfg)
  if cfg.bias_balancing:  # a bias that changes the selection
    bias_E = np.random.default_rng(seed).normal(size=E) * 0.3
    params = dataclasses.replace(params, router_bias=jnp.asarray(bias_E, jnp.float32))
  return params


def oracle_layer(params, x_BSD, cfg, groups):
  """(y f64[B, S, D], load_balance_loss) from the NumPy router and a NumPy forward."""
  x_TD = oracle.f64(x_BSD).reshape(B * S, D)
  logits_TE = x_TD @ oracle.f64(params.router_DE)
  if cfg.router == "expert_choice":
    C = ms.capacity(cfg.capacity_factor, B * S // groups, K, E)
    w, experts, s = oracle.in_groups(oracle.expert_choice, logits_TE, groups, C)
    loss = 0.0
  else:
    bias = None if params.router_bias is None else oracle.f64(params.router_bias)
    w, experts, s = oracle.in_groups(
      oracle.top_k,
      logits_TE,
      groups,
      K,
      score_func=cfg.score_func,
      num_groups=cfg.num_groups,
      top_k_groups=cfg.top_k_groups,
      bias_E=bias,
      scaling=cfg.routed_scaling,
    )
    loss = (
      oracle.sequence_loss(experts, s, S)
      if cfg.score_func == "sigmoid"
      else oracle.switch_loss(experts, s)
    )
  y_TD = oracle.moe_linear(x_TD, params.experts.w_EDF, experts, w)
  return y_TD.reshape(B, S, D), loss, experts


@pytest.fixture(scope="module")
def results():
  mesh = jax.make_mesh((2, 4), (ms.DATA, ms.EXPERT))
  x_BSD = jnp.asarray(np.random.default_rng(0).normal(size=(B, S, D)), jnp.float32)
  out = {}
  for i, (name, cfg) in enumerate(ROUTER_CFGS.items()):
    params = params_for(cfg, seed=i)
    groups = MESH_GROUPS[name]
    local_cfg = dataclasses.replace(cfg, impl="masked_scan", routing_groups=groups)
    want = oracle_layer(params, x_BSD, cfg, groups)
    local = run(params, x_BSD, local_cfg)
    placed = jax.device_put(
      params, jax.tree.map(lambda s: NamedSharding(mesh, s), ms.moe_param_specs(cfg))
    )
    x_placed = jax.device_put(x_BSD, NamedSharding(mesh, P(ms.DATA)))
    impls = ("masked_scan",) if name == "expert_choice_4_groups" else IMPLS
    on_mesh = {
      impl: run(placed, x_placed, dataclasses.replace(cfg, impl=impl), mesh) for impl in impls
    }
    out[name] = dict(oracle=want, local=local, mesh=on_mesh)
  return out


CASES = [
  (r, i) for r in ROUTER_CFGS for i in IMPLS if r != "expert_choice_4_groups" or i == "masked_scan"
]


@pytest.mark.parametrize("router, impl", CASES, ids=[f"{r}-{i}" for r, i in CASES])
def test_router_through_dispatch(router, impl, results):
  res = results[router]
  want_y, want_loss, experts = res["oracle"]
  local_y, local_aux = res["local"]
  y, aux = res["mesh"][impl]
  assert_close(local_y, want_y, jnp.float32, "local masked_scan vs oracle")
  assert_close(y, want_y, jnp.float32, f"{impl} on the mesh vs oracle")
  np.testing.assert_allclose(y, local_y, rtol=1e-5, atol=1e-5)
  load_E = np.array([np.sum(experts == e) for e in range(E)])
  np.testing.assert_array_equal(aux["expert_load"], load_E)
  np.testing.assert_array_equal(local_aux["expert_load"], load_E)
  assert_close(aux["load_balance_loss"], want_loss, jnp.float32)
  assert_close(local_aux["load_balance_loss"], want_loss, jnp.float32)
  unrouted = int(np.sum(np.all(experts < 0, axis=1)))
  assert int(aux["dropped_tokens"]) == unrouted and int(aux["dropped_items"]) == 0
  if router.startswith("expert_choice"):
    C = ms.capacity(1.5, B * S // MESH_GROUPS[router], K, E)
    np.testing.assert_array_equal(load_E, C * MESH_GROUPS[router])


def test_expert_choice_grouping_matters(results):
  # The same tokens routed in 8 groups (one per device) and in 4 choose differently; each
  # is reproduced by its own grouping on one device (the tests above).
  assert not np.array_equal(
    results["expert_choice"]["oracle"][2], results["expert_choice_4_groups"]["oracle"][2]
  )


@functools.partial(jax.jit, static_argnames=("cfg", "mesh"), compiler_options=FAST_COMPILE)
def run_and_grad(params, x_BSD, ct_BSD, cfg, mesh=None):
  """(y, (dparams, dx)) of `sum(y * ct) + aux_loss`."""

  def loss(params, x_BSD):
    y, aux = ms.moe_layer(params, x_BSD, cfg, mesh)
    return jnp.sum(y * ct_BSD) + aux["aux_loss"], y

  (_, y), grads = jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)(params, x_BSD)
  return y, grads


@pytest.mark.parametrize("router", ["deepseek_like", "expert_choice"])
def test_router_gradients_all_to_all_match_local(router, results):
  # Gradients with respect to every parameter and x: the all_to_all dispatch on the mesh
  # against the masked scan on one device with the same routing groups. The router bias
  # gets none (it is moved by update_router_bias).
  del results  # computed first: the same compiled inits
  cfg = ROUTER_CFGS[router]
  mesh = jax.make_mesh((2, 4), (ms.DATA, ms.EXPERT))
  params = params_for(cfg, seed=list(ROUTER_CFGS).index(router))
  rng = np.random.default_rng(1)
  x_BSD, ct_BSD = (jnp.asarray(rng.normal(size=(B, S, D)), jnp.float32) for _ in range(2))
  want_y, want = run_and_grad(
    params, x_BSD, ct_BSD, dataclasses.replace(cfg, impl="masked_scan", routing_groups=8)
  )
  placed = jax.device_put(
    params, jax.tree.map(lambda s: NamedSharding(mesh, s), ms.moe_param_specs(cfg))
  )
  put = lambda a: jax.device_put(a, NamedSharding(mesh, P(ms.DATA)))
  y, got = run_and_grad(
    placed, put(x_BSD), put(ct_BSD), dataclasses.replace(cfg, impl="all_to_all"), mesh
  )
  assert_close(y, want_y, jnp.float32)
  for (path, g), w in zip(jax.tree_util.tree_leaves_with_path(got), jax.tree.leaves(want)):
    assert_close(g, w, jnp.float32, jax.tree_util.keystr(path))
  assert float(jnp.abs(want[0].router_DE).max()) > 1e-3
  if cfg.bias_balancing:
    np.testing.assert_array_equal(got[0].router_bias, 0.0)


def test_expert_choice_tokens_no_expert_takes():
  # 8 tokens, E = 4, top_k 1, capacity_factor 0.5: each expert takes ceil(0.5 * 8 / 4) = 1
  # token, so at least 4 tokens get no routed expert: their output is exactly zero (no
  # shared experts) and aux counts them as dropped tokens, with no dropped items.
  cfg = ms.MoEConfig(
    d_model=4,
    d_ff=4,
    num_experts=4,
    top_k=1,
    expert_type="linear",
    router="expert_choice",
    capacity_factor=0.5,
    impl="masked_scan",
  )
  params = ms.init_moe_params(jax.random.key(3), cfg)
  x_BSD = jnp.asarray(np.random.default_rng(3).normal(size=(1, 8, 4)), jnp.float32)
  y_BSD, aux = run(params, x_BSD, cfg)
  _, experts, _ = oracle.expert_choice(oracle.f64(x_BSD[0]) @ oracle.f64(params.router_DE), 1)
  unrouted = np.all(experts < 0, axis=1)
  assert unrouted.sum() >= 4
  np.testing.assert_array_equal(y_BSD[0, unrouted], 0.0)
  assert np.all(np.abs(np.asarray(y_BSD[0, ~unrouted])).max(axis=1) > 0)
  assert int(aux["dropped_tokens"]) == unrouted.sum() and int(aux["dropped_items"]) == 0
  np.testing.assert_array_equal(aux["expert_load"], 1)
