"""`moe_layer` against the float64 layer model of `tests/layer_oracle.py`, gradients included.

Each case runs `jax.value_and_grad` of `sum(y * ct) + aux["aux_loss"]` through the layer
(jitted once per config and mesh) and compares, with the independent model:

  * y, the aux losses (always at float32 tolerance: the router is float32 in every dtype),
    expert_load, dropped_items, dropped_tokens and rounds (a host count for all_to_all);
  * the gradient with respect to x and every parameter leaf (router, every routed-expert
    leaf, every shared-expert leaf) with the model's central finite differences.

So a gradient path that is cut or wrong (the combine weights' path to the router, the
shared experts' path to x, a capacity drop in the wrong order) fails here even when every
implementation agrees with every other.

Cases cover each implementation with both grouped matmuls, on one device and on 2x2 and
2x4 meshes with the expert axis first and second, Auto and Explicit axis types, capacity
drops with K = 2, Linear experts with unnormalised weights, bfloat16 tokens and weights,
and bfloat16 matmuls on float32 inputs (compute_dtype).
"""

import functools
import math

import jax
import jax.numpy as jnp
import layer_oracle
import numpy as np
import pytest
from cases import FAST_COMPILE, assert_close
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import moe_shard as ms

B, S, D, F, E, K = 8, 2, 8, 16, 8, 2  # T = 16 tokens: 2 per device on 8 devices
SHARED_F = 8

# Tolerances: `TOL` of the dtype of x and the expert weights, for y and every gradient.
# bfloat16 (TOL 3e-2): the layer rounds y, the shared experts' matmuls and the gradients
# to bfloat16 on top of one dispatch's roundings; measured <= 7e-3 (of the largest entry)
# on every quantity here, so TOL[bfloat16] holds with 5x margin and still catches a
# missing or misrouted term, O(0.1) or more of the largest entry. The aux losses are
# always checked at float32 tolerance: the router runs in float32 whatever the dtype.


def _mesh(shape, names, kind):
  return jax.make_mesh(
    shape, names, axis_types=(kind,) * 2, devices=jax.devices()[: math.prod(shape)]
  )


EXPLICIT, AUTO = AxisType.Explicit, AxisType.Auto
DE, ED = ("data", "expert"), ("expert", "data")
# name: (MoEConfig overrides, mesh (shape, axis names, axis type) or None, dtype of x and
# of the expert weights)
CASES = {
  # One device: the local implementations.
  "masked_scan": (dict(impl="masked_scan"), None, "float32"),
  "ragged_dot-tiled": (dict(impl="ragged_dot", gmm_impl="tiled"), None, "float32"),
  "ragged_dot-ragged_dot": (dict(impl="ragged_dot", gmm_impl="ragged_dot"), None, "float32"),
  # Meshes. chunk_size=1 and (2, 1): overflow rounds run (2 tokens, 4 items per device).
  # The tiled grouped matmul compiles ~3x slower than lax.ragged_dot: each implementation
  # runs it in one or two cases.
  "all_to_all-tiled-2x4-data_expert-explicit": (
    dict(impl="all_to_all", gmm_impl="tiled", chunk_size=1),
    ((2, 4), DE, EXPLICIT),
    "float32",
  ),
  "all_to_all-ragged_dot-2x2-expert_data-auto": (
    dict(impl="all_to_all", gmm_impl="ragged_dot", chunk_size=(2, 1)),
    ((2, 2), ED, AUTO),
    "float32",
  ),
  "all_to_all-ragged_dot-2x4-expert_data-explicit": (
    dict(impl="all_to_all", gmm_impl="ragged_dot"),
    ((2, 4), ED, EXPLICIT),
    "float32",
  ),
  "all_gather-tiled-2x2-data_expert-explicit": (
    dict(impl="all_gather", gmm_impl="tiled"),
    ((2, 2), DE, EXPLICIT),
    "float32",
  ),
  "all_gather-ragged_dot-2x4-expert_data-auto": (
    dict(impl="all_gather", gmm_impl="ragged_dot"),
    ((2, 4), ED, AUTO),
    "float32",
  ),
  "ragged_dot-ragged_dot-2x4-data_expert-auto": (
    dict(impl="ragged_dot", gmm_impl="ragged_dot"),
    ((2, 4), DE, AUTO),
    "float32",
  ),
  # Capacity 0.5: C = ceil(0.5 * 16 * 2 / 8) = 2 items per expert, half the items drop.
  "capacity-masked_scan": (dict(impl="masked_scan", capacity_factor=0.5), None, "float32"),
  "capacity-all_to_all-ragged_dot-2x4-data_expert-explicit": (
    dict(impl="all_to_all", gmm_impl="ragged_dot", capacity_factor=0.5, chunk_size=(2, 1)),
    ((2, 4), DE, EXPLICIT),
    "float32",
  ),
  "capacity-all_gather-ragged_dot-2x2-expert_data-auto": (
    dict(impl="all_gather", gmm_impl="ragged_dot", capacity_factor=0.5),
    ((2, 2), ED, AUTO),
    "float32",
  ),
  # Linear experts, the router's probabilities as weights, no shared experts.
  "linear-all_to_all-tiled-2x2-expert_data-explicit": (
    dict(
      impl="all_to_all",
      gmm_impl="tiled",
      expert_type="linear",
      d_ff=D,
      normalize_top_k=False,
      num_shared_experts=0,
      chunk_size=1,
    ),
    ((2, 2), ED, EXPLICIT),
    "float32",
  ),
  # float32 tokens and weights, bfloat16 matmuls (compute_dtype): bfloat16 tolerance.
  "bf16_compute-all_gather-tiled-2x2-data_expert-auto": (
    dict(impl="all_gather", gmm_impl="tiled", compute_dtype="bfloat16"),
    ((2, 2), DE, AUTO),
    "float32",
  ),
  # bfloat16 tokens and expert weights.
  "bf16-ragged_dot-tiled": (
    dict(impl="ragged_dot", gmm_impl="tiled", param_dtype="bfloat16"),
    None,
    "bfloat16",
  ),
  "bf16-all_to_all-ragged_dot-2x4-data_expert-explicit": (
    dict(impl="all_to_all", gmm_impl="ragged_dot", param_dtype="bfloat16", chunk_size=1),
    ((2, 4), DE, EXPLICIT),
    "bfloat16",
  ),
}


def config(**overrides):
  base = dict(
    d_model=D,
    d_ff=F,
    num_experts=E,
    top_k=K,
    num_shared_experts=1,
    shared_d_ff=SHARED_F,
    load_balance_coef=0.1,
    z_loss_coef=0.01,
  )
  return ms.MoEConfig(**{**base, **overrides})


def _draw(cfg, dtype, seed):
  """Params (router float32, the rest in `dtype`), x and ct, as NumPy, for one seed."""
  rng = np.random.default_rng(seed)

  def normal(*shape, dt=dtype):  # variance 1 / fan-in, rounded to the dtype it will have
    return np.asarray(jnp.asarray(rng.normal(size=shape) / math.sqrt(shape[-2]), dt))

  if cfg.expert_type == "swiglu":
    experts = ms.SwiGLU(normal(E, D, cfg.d_ff), normal(E, D, cfg.d_ff), normal(E, cfg.d_ff, D))
  else:
    experts = ms.Linear(normal(E, D, D))
  shared = None
  if cfg.num_shared_experts:
    H = cfg.num_shared_experts
    shared = ms.SwiGLU(normal(H, D, SHARED_F), normal(H, D, SHARED_F), normal(H, SHARED_F, D))
  # A router twice the usual scale: decisive routing, so that few seeds have near-ties.
  params = ms.MoEParams(router_DE=2 * normal(D, E, dt="float32"), experts=experts, shared=shared)
  x = np.asarray(jnp.asarray(rng.normal(size=(B, S, D)), dtype))
  ct = np.asarray(jnp.asarray(jnp.asarray(rng.normal(size=(B, S, D)), dtype), jnp.float32))
  return params, x, ct


@functools.cache
def reference(oracle_key):
  """The case (params, x, ct), the model's outputs and its finite-difference gradients.

  `oracle_key` holds only the config fields the model reads, so cases that differ in impl
  or mesh share one draw and one set of finite differences. The first seed whose routing
  has a margin of at least 0.05 between each token's K-th and (K+1)-th logit is used:
  float32 logits are then certain to pick the same experts as float64 ones, and the
  finite-difference steps cannot change the choice.
  """
  overrides, dtype = dict(oracle_key[0]), oracle_key[1]
  cfg = config(**overrides)
  for seed in range(100):
    params, x, ct = _draw(cfg, dtype, seed)
    if layer_oracle.routing_margin(x.reshape(-1, D), params.router_DE, K) >= 0.05:
      break
  else:
    raise AssertionError("no seed with a routing margin of 0.05")
  y, aux = layer_oracle.layer(params, x, cfg)
  dparams, dx = layer_oracle.fd_grads(params, x, ct, cfg)
  return params, x, ct, y, aux, dparams, dx


ORACLE_FIELDS = (
  "expert_type",
  "d_ff",
  "normalize_top_k",
  "num_shared_experts",
  "capacity_factor",
  "param_dtype",
)


def _oracle_key(overrides, dtype):
  return (tuple(sorted((k, v) for k, v in overrides.items() if k in ORACLE_FIELDS)), dtype)


@functools.partial(jax.jit, static_argnames=("cfg", "mesh"), compiler_options=FAST_COMPILE)
def run_and_grad(params, x_BSD, ct_BSD, cfg, mesh=None):
  """(y, aux, (dparams, dx)) of `sum(y * ct) + aux_loss`, jitted once per (cfg, mesh)."""

  def loss(params, x_BSD):
    y, aux = ms.moe_layer(params, x_BSD, cfg, mesh)
    return jnp.sum(y.astype(jnp.float32) * ct_BSD) + aux["aux_loss"], (y, aux)

  (_, (y, aux)), grads = jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)(params, x_BSD)
  return y, aux, grads


def _place(params, x_BSD, cfg, mesh):
  """Params as documented (routed experts split over the expert axis, the rest replicated).

  x is placed (batch over "data") on Auto meshes and left to the layer on Explicit ones.
  """
  put = lambda a, spec: jax.device_put(a, NamedSharding(mesh, spec))
  params = ms.MoEParams(
    router_DE=put(params.router_DE, P()),
    experts=jax.tree.map(lambda a: put(a, P(cfg.expert_axis)), params.experts),
    shared=jax.tree.map(lambda a: put(a, P()), params.shared),
  )
  if mesh.axis_types[0] == AxisType.Auto:
    x_BSD = put(x_BSD, P("data"))
  return params, x_BSD


def expected_rounds(experts_TK, cfg, mesh):
  """all_to_all rounds by the documented rule, from the kept ids (dropped items are -1).

  Tokens are split in order over the devices (block s on the s-th device of the mesh);
  the busiest (source device, destination expert-axis position) queue sets the rounds:
  1 + ceil(max(0, busiest - C_first) / C_overflow).
  """
  n_dev, N = mesh.size, mesh.shape[cfg.expert_axis]
  ids_SI = np.asarray(experts_TK).reshape(n_dev, -1)
  busiest = max(
    int(np.sum((ids_SI[s] >= 0) & (ids_SI[s] // (E // N) == n)))
    for s in range(n_dev)
    for n in range(N)
  )
  chunk = cfg.chunk_size
  if chunk is None:  # the mean queue T_dev*K/N + 4 sqrt of it, up to 8s; overflow as many
    mean = math.ceil(ids_SI.shape[1] / N)
    first = max(8, 8 * math.ceil((mean + math.ceil(4 * math.sqrt(mean))) / 8))
    overflow = first
  else:
    first, overflow = (chunk, chunk) if isinstance(chunk, int) else chunk
  return 1 + math.ceil(max(0, busiest - first) / overflow)


@pytest.mark.parametrize("name", list(CASES))
def test_layer_matches_float64_model(name):
  overrides, mesh_spec, dtype = CASES[name]
  cfg = config(**overrides)
  params, x, ct, want_y, want_aux, want_dparams, want_dx = reference(_oracle_key(overrides, dtype))
  mesh = _mesh(*mesh_spec) if mesh_spec else None
  params, x_in = jax.tree.map(jnp.asarray, params), jnp.asarray(x)
  if mesh is not None:
    params, x_in = _place(params, x_in, cfg, mesh)
  y, aux, (dparams, dx) = run_and_grad(params, x_in, jnp.asarray(ct), cfg, mesh)
  assert y.dtype == jnp.dtype(dtype) and y.shape == (B, S, D)
  tol_dtype = jnp.dtype(cfg.compute_dtype or dtype)

  # Every quantity is checked; the failure lists all that are wrong (e.g. "d.router_DE").
  wrong = []

  def close(got, want, what, dtype=tol_dtype):
    try:
      assert_close(jnp.asarray(got, jnp.float32), want, dtype, err_msg=f"{name}: {what}")
    except AssertionError as e:
      wrong.append((what, str(e)))

  def equal(got, want, what):
    if not np.array_equal(np.asarray(got), np.asarray(want)):
      wrong.append((what, f"{name}: {what}: got {np.asarray(got)}, want {np.asarray(want)}"))

  close(y, want_y, "y")
  for what in ("aux_loss", "load_balance_loss", "z_loss"):
    close(aux[what], want_aux[what], what, jnp.float32)
  for what in ("expert_load", "dropped_items", "dropped_tokens"):
    equal(aux[what], want_aux[what], what)
  equal(
    aux["rounds"],
    expected_rounds(want_aux["experts_TK"], cfg, mesh) if cfg.impl == "all_to_all" else 1,
    "rounds",
  )
  close(dx, want_dx, "dx")
  got_leaves = jax.tree_util.tree_leaves_with_path(dparams)
  want_leaves = jax.tree_util.tree_leaves_with_path(want_dparams)
  assert [p for p, _ in got_leaves] == [p for p, _ in want_leaves]
  for (path, got), (_, want) in zip(got_leaves, want_leaves):
    close(got, want, f"d{jax.tree_util.keystr(path)}")
  assert not wrong, f"{name}: wrong {[w for w, _ in wrong]}\n" + "\n".join(
    message for _, message in wrong
  )


def test_cases_are_what_they_claim():
  """The draws exercise what the cases are for (checked on the model, no compile)."""
  for name, (overrides, mesh_spec, dtype) in CASES.items():
    _, _, _, _, aux, dparams, dx = reference(_oracle_key(overrides, dtype))
    cfg = config(**overrides)
    # Every gradient is non-trivial: a zero want would let a zero got pass.
    for path, g in jax.tree_util.tree_leaves_with_path((dparams, dx)):
      assert np.abs(g).max() > 1e-3, (name, jax.tree_util.keystr(path))
    if cfg.capacity_factor is not None:
      # Real drops, including tokens whose two slots both dropped, and tokens with one.
      assert aux["dropped_items"] > 2 * aux["dropped_tokens"] > 0, name
    else:
      assert aux["dropped_items"] == 0
    if cfg.impl == "all_to_all" and cfg.chunk_size is not None:
      assert expected_rounds(aux["experts_TK"], cfg, _mesh(*mesh_spec)) >= 2, name
