"""The MoE layer: config, parameters and placement, composition, impl agreement, capacity.

Meshes are 4 x 2 (expert x data) over the 8 simulated CPU devices, with JAX's default
Explicit axes unless a test says otherwise. Every layer call is jitted through `run` or
`run_and_grad`, once per (config, mesh, shape).
"""

import dataclasses
import functools
import math
import re

import jax
import jax.numpy as jnp
import layer_oracle
import numpy as np
import pytest
from cases import FAST_COMPILE, assert_close, assert_tree_close
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import moe_shard as ms

B, S, D, F, E, K = 8, 3, 8, 12, 8, 2  # T = 24 tokens: 3 per device on the 4 x 2 mesh
IMPLS = ("masked_scan", "ragged_dot", "all_gather", "all_to_all")


def config(**overrides):
  """The test config: two shared experts of width 6 unless overridden.

  Tests share as few parameter shapes as they can: each new one compiles an init (threefry
  compiles slowly on CPU); `init_moe_params` caches its compiled init per shape and mesh.
  """
  base = dict(d_model=D, d_ff=F, num_experts=E, top_k=K, num_shared_experts=2, shared_d_ff=6)
  return ms.MoEConfig(**{**base, **overrides})


def without_shared(cfg, params):
  """The same layer without its shared experts (no new init)."""
  return (
    dataclasses.replace(cfg, num_shared_experts=0, shared_d_ff=None),
    dataclasses.replace(params, shared=None),
  )


@pytest.fixture(scope="module")
def mesh():
  return jax.make_mesh((4, 2), (ms.EXPERT, ms.DATA))


@functools.partial(jax.jit, static_argnames=("cfg", "mesh"), compiler_options=FAST_COMPILE)
def run(params, x_BSD, cfg, mesh=None):
  return ms.moe_layer(params, x_BSD, cfg, mesh)


@functools.partial(jax.jit, static_argnames=("cfg", "mesh"), compiler_options=FAST_COMPILE)
def run_and_grad(params, x_BSD, ct_BSD, cfg, mesh=None):
  """(y, aux, (dparams, dx)) of `sum(y * ct) + aux_loss`."""

  def loss(params, x_BSD):
    y, aux = ms.moe_layer(params, x_BSD, cfg, mesh)
    return jnp.sum(y.astype(jnp.float32) * ct_BSD) + aux["aux_loss"], (y, aux)

  (_, (y, aux)), grads = jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)(params, x_BSD)
  return y, aux, grads


def tokens(seed, shape=(B, S, D), dtype=jnp.float32):
  return jnp.asarray(np.random.default_rng(seed).normal(size=shape), dtype)


def put(a, mesh, spec):
  return jax.device_put(a, NamedSharding(mesh, spec))


def swiglu64(w, x_TD):
  """float64 NumPy SwiGLU summed over the leading (expert) axis of w's leaves."""
  x = np.asarray(x_TD, np.float64)
  g, u, d = (np.asarray(a, np.float64) for a in (w.gate_EDF, w.up_EDF, w.down_EFD))
  g_TEF, u_TEF = np.einsum("td,edf->tef", x, g), np.einsum("td,edf->tef", x, u)
  h_TEF = g_TEF / (1 + np.exp(-g_TEF)) * u_TEF
  return np.einsum("tef,efd->td", h_TEF, d)


# --------------------------------------------------------------------------- config

BAD_CONFIGS = [
  (dict(d_model=0), ValueError, "MoEConfig: d_model must be >= 1 (got 0)"),
  (dict(d_ff=2.5), TypeError, "MoEConfig: d_ff must be an int (got 2.5)"),
  (dict(num_experts=True), TypeError, "MoEConfig: num_experts must be an int (got True)"),
  (dict(top_k=0), ValueError, "MoEConfig: top_k must be >= 1 (got 0)"),
  (dict(top_k=9), ValueError, "MoEConfig: top_k must be <= num_experts (8) (got 9)"),
  (
    dict(expert_type="relu"),
    ValueError,
    "MoEConfig: expert_type must be one of ('linear', 'swiglu', 'gelu', 'geglu', "
    "'clamped_swiglu') or an expert FFN class (got 'relu')",
  ),
  (
    dict(impl="fast"),
    ValueError,
    "MoEConfig: impl must be one of ('auto', 'masked_scan', "
    "'ragged_dot', 'all_gather', 'all_to_all', 'ragged_all_to_all') or a callable "
    "(got 'fast')",
  ),
  (
    dict(gmm_impl="dense"),
    ValueError,
    "MoEConfig: gmm_impl must be one of ('auto', 'megablox', 'mosaic_gpu', 'ragged_dot', 'tiled', 'tokamax') (got 'dense')",
  ),
  (
    dict(expert_type="linear"),
    ValueError,
    "MoEConfig: the experts of expert_type 'linear' must map d_model (8) to d_model "
    "(got d_in 8, d_out 12; 'linear' maps d_model to d_ff)",
  ),
  (
    dict(capacity_factor=0.0),
    ValueError,
    "MoEConfig: capacity_factor must be finite and > 0 (got 0.0)",
  ),
  (
    dict(capacity_factor=float("inf")),
    ValueError,
    "MoEConfig: capacity_factor must be finite and > 0 (got inf)",
  ),
  (
    dict(capacity_factor="1.25"),
    TypeError,
    "MoEConfig: capacity_factor must be a real number (got '1.25')",
  ),
  (
    dict(chunk_size=0),
    ValueError,
    "MoEConfig: chunk_size must be None, an int >= 1 or a pair of ints >= 1 (got 0)",
  ),
  (
    dict(chunk_size=(8, 0)),
    ValueError,
    "MoEConfig: chunk_size must be None, an int >= 1 or a pair of ints >= 1 (got (8, 0))",
  ),
  (
    dict(chunk_size=(8, 4, 2)),
    TypeError,
    "MoEConfig: chunk_size must be None, an int >= 1 or a pair of ints >= 1 (got (8, 4, 2))",
  ),
  (
    dict(chunk_size="8"),
    TypeError,
    "MoEConfig: chunk_size must be None, an int >= 1 or a pair of ints >= 1 (got '8')",
  ),
  (dict(num_shared_experts=-1), ValueError, "MoEConfig: num_shared_experts must be >= 0 (got -1)"),
  (dict(shared_d_ff=0), ValueError, "MoEConfig: shared_d_ff must be >= 1 (got 0)"),
  (dict(normalize_top_k=1), TypeError, "MoEConfig: normalize_top_k must be a bool (got 1)"),
  (
    dict(load_balance_coef=-0.1),
    ValueError,
    "MoEConfig: load_balance_coef must be finite and >= 0 (got -0.1)",
  ),
  (
    dict(z_loss_coef=float("nan")),
    ValueError,
    "MoEConfig: z_loss_coef must be finite and >= 0 (got nan)",
  ),
  (
    dict(param_dtype=jnp.int32),
    ValueError,
    "MoEConfig: param_dtype must be a floating-point dtype (got <class ",
  ),
  (
    dict(compute_dtype="float33"),
    TypeError,
    "MoEConfig: compute_dtype must be a dtype (got 'float33')",
  ),
  (
    dict(expert_axis=""),
    TypeError,
    "MoEConfig: expert_axis must be a mesh axis name (a "
    "non-empty str) or a non-empty tuple of distinct names (got '')",
  ),
]


@pytest.mark.parametrize(
  "overrides, error, message",
  BAD_CONFIGS,
  ids=[next(iter(c[0])) + f"={next(iter(c[0].values()))!r}" for c in BAD_CONFIGS],
)
def test_config_rejects(overrides, error, message):
  with pytest.raises(error, match="^" + re.escape(message)):
    config(**overrides)


def test_config_is_frozen_hashable_and_canonical():
  a = config(
    param_dtype=jnp.float32, compute_dtype="bfloat16", chunk_size=[8, 4], capacity_factor=1
  )
  b = config(
    param_dtype="float32", compute_dtype=jnp.bfloat16, chunk_size=(8, 4), capacity_factor=1.0
  )
  assert a == b and hash(a) == hash(b)
  assert a.compute_dtype == jnp.dtype(jnp.bfloat16) and a.chunk_size == (8, 4)
  assert {a: 1}[b] == 1
  with pytest.raises(dataclasses.FrozenInstanceError):
    a.top_k = 1
  with pytest.raises(ValueError, match="top_k must be <= num_experts"):
    dataclasses.replace(a, top_k=E + 1)  # replace re-validates
  with pytest.raises(TypeError):
    ms.MoEConfig(D, F, E, K)  # keyword-only


def test_capacity_is_exact_ceiling():
  # ceil(c * T * K / E): 1.1 * 40 * 2 / 8 = 11 exactly (floating point would give 12).
  assert config(capacity_factor=1.1).capacity(40) == 11
  assert config(capacity_factor=1.0).capacity(24) == 6
  assert config(capacity_factor=1.0).capacity(25) == 7
  assert config(capacity_factor=0.01).capacity(24) == 1
  assert config().capacity(24) is None


# --------------------------------------------------------------------------- parameters


def test_param_shapes_and_specs():
  cfg = config(shared_d_ff=5)
  shapes = ms.moe_param_shapes(cfg)
  assert shapes.router_DE.shape == (D, E) and shapes.router_DE.dtype == jnp.float32
  assert shapes.experts == ms.SwiGLU(
    jax.ShapeDtypeStruct((E, D, F), jnp.float32),
    jax.ShapeDtypeStruct((E, D, F), jnp.float32),
    jax.ShapeDtypeStruct((E, F, D), jnp.float32),
  )
  assert shapes.shared.gate_EDF.shape == (2, D, 5) and shapes.shared.down_EFD.shape == (2, 5, D)
  # One entry per array dimension (Flax's partition metadata needs them).
  split, whole = P("expert", None, None), P(None, None, None)
  assert ms.moe_param_specs(cfg) == ms.MoEParams(
    router_DE=P(None, None),
    experts=ms.SwiGLU(split, split, split),
    shared=ms.SwiGLU(whole, whole, whole),
  )
  lin = config(expert_type="linear", d_ff=D, expert_axis="ep", num_shared_experts=0)
  assert ms.moe_param_specs(lin) == ms.MoEParams(
    P(None, None), ms.Linear(P("ep", None, None)), None
  )
  assert ms.moe_param_shapes(lin).experts.w_EDF.shape == (E, D, D)


def test_init_shapes_dtypes_and_scale():
  cfg = config()
  params = ms.init_moe_params(jax.random.key(0), cfg)
  want = ms.moe_param_shapes(cfg)
  assert jax.tree.structure(params) == jax.tree.structure(want)
  scaled = []
  for (path, leaf), s in zip(jax.tree_util.tree_leaves_with_path(params), jax.tree.leaves(want)):
    name = jax.tree_util.keystr(path)
    assert leaf.shape == s.shape and leaf.dtype == s.dtype == jnp.float32, name
    scaled.append(np.asarray(leaf, np.float64).ravel() * math.sqrt(s.shape[-2]))
  # Normal with variance 1 / fan-in (the second-to-last axis): the 2,656 draws scaled back
  # have std 1 within 10% (the sample std's standard error is 1.4%).
  scaled = np.concatenate(scaled)
  assert abs(np.std(scaled) - 1) < 0.1 and abs(np.mean(scaled)) < 0.1
  firsts = [tuple(np.asarray(a, np.float32).ravel()[:8]) for a in jax.tree.leaves(params)]
  assert len(set(firsts)) == len(firsts), "every leaf must get its own key"
  # param_dtype applies to the experts, never to the router (traced only, not compiled).
  bf16 = jax.eval_shape(
    functools.partial(ms.init_moe_params, cfg=config(param_dtype="bfloat16")), jax.random.key(0)
  )
  assert bf16.router_DE.dtype == jnp.float32
  assert {a.dtype for a in jax.tree.leaves((bf16.experts, bf16.shared))} == {jnp.dtype("bfloat16")}


def test_init_on_mesh_is_placed_and_equals_unplaced(mesh):
  cfg = config()
  params = ms.init_moe_params(jax.random.key(1), cfg, mesh)
  specs = ms.moe_param_specs(cfg)
  for (path, leaf), spec in zip(
    jax.tree_util.tree_leaves_with_path(params), jax.tree.leaves(specs)
  ):
    name = jax.tree_util.keystr(path)
    assert leaf.sharding.mesh == mesh and leaf.sharding.spec == spec, name
    per_device = {tuple(s.data.shape) for s in leaf.addressable_shards}
    want = (leaf.shape[0] // 4, *leaf.shape[1:]) if spec[0] == "expert" else leaf.shape
    assert per_device == {want}, name
  # The values do not depend on where they were generated.
  assert_tree_close(params, ms.init_moe_params(jax.random.key(1), cfg), jnp.float32)


def test_init_errors(mesh):
  with pytest.raises(TypeError, match=r"^init_moe_params: cfg must be a MoEConfig \(got dict\)"):
    ms.init_moe_params(jax.random.key(0), dict(d_model=D))
  with pytest.raises(
    ValueError,
    match=r"^init_moe_params: mesh must have the expert axis "
    r"'ep' \(got axes \('expert', 'data'\)\)",
  ):
    ms.init_moe_params(jax.random.key(0), config(expert_axis="ep"), mesh)
  with pytest.raises(
    ValueError,
    match=r"^init_moe_params: num_experts \(6\) must be divisible "
    r"by the 'expert' axis size \(4\)",
  ):
    ms.init_moe_params(jax.random.key(0), config(num_experts=6), mesh)
  with pytest.raises(TypeError, match=r"^init_moe_params: mesh must be a jax.sharding.Mesh"):
    ms.init_moe_params(jax.random.key(0), config(), mesh="mesh")


# --------------------------------------------------------------------------- composition


def test_layer_equals_hand_composition():
  cfg, params = without_shared(config(), ms.init_moe_params(jax.random.key(2), config()))
  cfg = dataclasses.replace(cfg, impl="masked_scan", load_balance_coef=0.3, z_loss_coef=0.02)
  x_BSD = tokens(2)
  y_BSD, aux = run(params, x_BSD, cfg)

  @functools.partial(jax.jit, static_argnums=2, compiler_options=FAST_COMPILE)
  def by_hand(params, x_BSD, normalize):
    x_TD = x_BSD.reshape(B * S, D)
    logits_TE = x_TD @ params.router_DE
    r = ms.top_k_routing(logits_TE, K, normalize=normalize)
    y_TD = ms.moe_masked_scan(x_TD, params.experts, r.experts_TK, r.weights_TK)
    return (
      y_TD.reshape(B, S, D),
      ms.load_balancing_loss(r),
      ms.router_z_loss(logits_TE),
      ms.expert_load(r.experts_TK, E),
    )

  want_y, lb, z, load = by_hand(params, x_BSD, True)
  assert y_BSD.shape == x_BSD.shape and y_BSD.dtype == x_BSD.dtype
  assert_close(y_BSD, want_y, jnp.float32)
  assert_close(aux["load_balance_loss"], lb, jnp.float32)
  assert_close(aux["z_loss"], z, jnp.float32)
  assert_close(aux["aux_loss"], 0.3 * lb + 0.02 * z, jnp.float32)
  np.testing.assert_array_equal(aux["expert_load"], load)
  assert int(aux["rounds"]) == 1
  assert int(aux["dropped_items"]) == 0 and int(aux["dropped_tokens"]) == 0
  # normalize_top_k=False: the weights are the router probabilities themselves.
  y_BSD, _ = run(params, x_BSD, dataclasses.replace(cfg, normalize_top_k=False))
  assert_close(y_BSD, by_hand(params, x_BSD, False)[0], jnp.float32)


def test_shared_experts_are_added():
  cfg = config(impl="masked_scan")
  params = ms.init_moe_params(jax.random.key(4), cfg)
  x_BSD = tokens(4)
  y_BSD, _ = run(params, x_BSD, cfg)
  routed_cfg, routed_params = without_shared(cfg, params)
  routed_BSD, _ = run(routed_params, x_BSD, routed_cfg)
  shared_TD = swiglu64(params.shared, x_BSD.reshape(-1, D))  # the sum of the two experts
  assert np.abs(shared_TD).max() > 0.1
  assert_close(y_BSD - routed_BSD, shared_TD.reshape(B, S, D), jnp.float32)


# --------------------------------------------------------------------------- mesh


# The default grouped matmul on CPU (the tiled kernel) takes ~3x longer to compile than
# lax.ragged_dot; both are checked against the oracle in test_local.py, so one case here
# runs the default and the other lax.ragged_dot. The linear case runs in capacity mode.
CASES = [("swiglu", None, "auto"), ("linear", 1.0, "ragged_dot")]


@pytest.mark.parametrize(
  "ffn, capacity_factor, gmm_impl", CASES, ids=[f"{f}-cap{c}-gmm_{g}" for f, c, g in CASES]
)
def test_impls_agree_on_mesh(ffn, capacity_factor, gmm_impl, mesh):
  # Reference: the masked scan on one device. Every impl runs on the 4 x 2 mesh with x split
  # over "data" only, so the output must come back to that sharding.
  cfg = config(
    expert_type=ffn,
    d_ff=F if ffn == "swiglu" else D,
    gmm_impl=gmm_impl,
    capacity_factor=capacity_factor,
    chunk_size=1,
  )
  x_BSD, ct_BSD = tokens(5), tokens(6)
  want_y, want_aux, want_grads = run_and_grad(
    ms.init_moe_params(jax.random.key(5), cfg),
    x_BSD,
    ct_BSD,
    dataclasses.replace(cfg, impl="masked_scan"),
  )
  if capacity_factor is not None:
    cap = cfg.capacity(B * S)
    assert int(want_aux["dropped_items"]) > 0
    assert int(want_aux["dropped_items"]) + int(want_aux["expert_load"].sum()) == B * S * K
    assert int(want_aux["expert_load"].max()) == cap
  params = jax.device_put(
    ms.init_moe_params(jax.random.key(5), cfg),
    jax.tree.map(lambda s: NamedSharding(mesh, s), ms.moe_param_specs(cfg)),
  )
  x_sharded = put(x_BSD, mesh, P(ms.DATA))
  for impl in IMPLS:
    y, aux, grads = run_and_grad(
      params, x_sharded, put(ct_BSD, mesh, P(ms.DATA)), dataclasses.replace(cfg, impl=impl), mesh
    )
    assert y.sharding.is_equivalent_to(x_sharded.sharding, y.ndim), impl
    assert_close(y, want_y, jnp.float32, f"{impl} y")
    assert_tree_close(grads, want_grads, jnp.float32, f"{impl} grads")
    for name, value in aux.items():
      if name in ("device_load", "balancedness"):  # per device of this mesh's expert axis
        load = np.asarray(want_aux["expert_load"]).reshape(mesh.shape[ms.EXPERT], -1).sum(1)
        want = load if name == "device_load" else load.mean() / load.max()
        assert_close(value, want, jnp.float32, f"{impl} {name}")
      elif name == "rounds":
        # chunk_size=1 and 6 items per device over 4 destinations: some pair has 2 or more.
        assert int(value) >= (2 if impl == "all_to_all" else 1), impl
        assert int(value) == 1 or impl == "all_to_all"
      elif jnp.issubdtype(value.dtype, jnp.integer):
        np.testing.assert_array_equal(value, want_aux[name], err_msg=f"{impl} {name}")
      else:
        assert_close(value, want_aux[name], jnp.float32, f"{impl} {name}")


def test_auto_axis_mesh():
  auto = jax.make_mesh((4, 2), (ms.EXPERT, ms.DATA), axis_types=(AxisType.Auto,) * 2)
  cfg = config(impl="all_to_all")
  params = ms.init_moe_params(jax.random.key(7), cfg)
  x_BSD = tokens(7)
  want, _ = run(params, x_BSD, dataclasses.replace(cfg, impl="masked_scan"))
  got, _ = run(params, put(x_BSD, auto, P(ms.DATA)), cfg, auto)
  assert_close(got, want, jnp.float32)


# Found by tests/test_layer_oracle.py. Trace only (jax.eval_shape): both fail
# while tracing, before any compile. strict: once fixed, these fail until unmarked.
def test_grad_with_params_not_on_the_explicit_mesh(mesh):
  # The layer places params that are not on an Explicit mesh (as moe_param_specs says):
  # the router gradient then contracts the split token axis with a placed array.
  cfg = config(impl="all_to_all", num_shared_experts=0)
  params = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), ms.moe_param_shapes(cfg))
  jax.eval_shape(
    jax.grad(lambda p, x: jnp.sum(ms.moe_layer(p, x, cfg, mesh)[0])), params, tokens(0)
  )


def test_x_not_on_the_explicit_mesh_with_fewer_batch_rows_than_devices():
  # The B*S tokens of an unplaced x are split over all 8 devices; the output reshape to
  # [B=4, S=4, D] is told its sharding (B=4 cannot carry an 8-way split).
  mesh = jax.make_mesh((2, 4), (ms.DATA, ms.EXPERT))  # Explicit
  cfg = config(impl="all_to_all")
  params = jax.tree.map(
    lambda s, spec: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=NamedSharding(mesh, spec)),
    ms.moe_param_shapes(cfg),
    ms.moe_param_specs(cfg),
  )
  jax.eval_shape(lambda p, x: ms.moe_layer(p, x, cfg, mesh), params, tokens(0, (4, 4, D)))


def test_scan_over_stacked_layers(mesh):
  L = 2
  cfg = config(impl="all_to_all")
  layers = [ms.init_moe_params(jax.random.key(10 + i), cfg, mesh) for i in range(L)]
  stacked = jax.tree.map(lambda *a: jnp.stack(a), *layers)
  stacked_sharding = NamedSharding(mesh, P(None, "expert"))
  assert stacked.experts.up_EDF.sharding.is_equivalent_to(stacked_sharding, 4)
  x_BSD = put(tokens(8), mesh, P((ms.DATA, ms.EXPERT)))

  def scanned(stacked, x_BSD):
    def body(x_BSD, params):
      y_BSD, aux = ms.moe_layer(params, x_BSD, cfg, mesh)
      return x_BSD + y_BSD, aux["aux_loss"]

    x_BSD, aux_L = jax.lax.scan(body, x_BSD, stacked)
    return jnp.sum(x_BSD**2) + jnp.sum(aux_L)

  def unrolled(layers, x_BSD):
    aux = 0.0
    for params in layers:
      y_BSD, a = ms.moe_layer(params, x_BSD, dataclasses.replace(cfg, impl="masked_scan"))
      x_BSD, aux = x_BSD + y_BSD, aux + a["aux_loss"]
    return jnp.sum(x_BSD**2) + aux

  grad = functools.partial(jax.value_and_grad, argnums=(0, 1))
  fast = functools.partial(jax.jit, compiler_options=FAST_COMPILE)
  loss, (dstacked, dx) = fast(grad(scanned))(stacked, x_BSD)
  want_loss, (dlayers, want_dx) = fast(grad(unrolled))(
    [jax.device_get(p) for p in layers], jax.device_get(x_BSD)
  )
  assert_close(loss, want_loss, jnp.float32)
  assert_close(dx, want_dx, jnp.float32)
  assert_tree_close(dstacked, jax.tree.map(lambda *a: jnp.stack(a), *dlayers), jnp.float32)
  assert dstacked.experts.gate_EDF.sharding.is_equivalent_to(stacked_sharding, 4)


def test_bf16_compute_dtype():
  # Output dtypes, and bfloat16 against the float32 run of the same code; the float64 layer
  # model checks bfloat16 outputs and gradients (tests/test_layer_oracle.py).
  cfg = config(impl="masked_scan")
  params = ms.init_moe_params(jax.random.key(9), cfg)
  x_BSD = tokens(9, dtype=jnp.bfloat16)
  want, _ = run(params, x_BSD.astype(jnp.float32), cfg)
  # float32 tokens and parameters, bfloat16 matmuls: a float32 output.
  got, _ = run(
    params, x_BSD.astype(jnp.float32), dataclasses.replace(cfg, compute_dtype=jnp.bfloat16)
  )
  assert got.dtype == jnp.float32
  assert_close(got, want, jnp.bfloat16)
  # bfloat16 tokens and expert parameters: a bfloat16 output. The router stays float32.
  bf16 = dataclasses.replace(cfg, param_dtype=jnp.bfloat16)
  p16 = dataclasses.replace(
    params,
    experts=jax.tree.map(lambda a: a.astype(jnp.bfloat16), params.experts),
    shared=jax.tree.map(lambda a: a.astype(jnp.bfloat16), params.shared),
  )
  got, _ = run(p16, x_BSD, bf16)
  assert got.dtype == jnp.bfloat16
  assert_close(got, want, jnp.bfloat16)


def test_auto_impl_choice(mesh):
  cfg = config()
  one = jax.make_mesh((1, 8), (ms.EXPERT, ms.DATA))
  assert ms.choose_impl(cfg) == "ragged_dot"
  assert ms.choose_impl(cfg, one) == "ragged_dot"
  assert ms.choose_impl(cfg, mesh) == "all_to_all"
  assert ms.choose_impl(config(impl="all_gather"), mesh) == "all_gather"
  params = ms.init_moe_params(jax.random.key(0), cfg)
  x_BSD = tokens(0)

  def primitives(mesh):
    jaxpr = jax.make_jaxpr(lambda p, x: ms.moe_layer(p, x, cfg, mesh))(params, x_BSD)
    return str(jaxpr)

  assert "all_to_all" in primitives(mesh)
  assert "all_to_all" not in primitives(None) and "shard_map" not in primitives(None)
  assert "all_to_all" not in primitives(one)


# --------------------------------------------------------------------------- capacity


def test_drop_over_capacity_by_token_order():
  # Queues (token, slot) in token order, then slot order; capacity 2:
  #   expert 0: (0,0) (1,0) | (2,1) (3,0) dropped
  #   expert 1: (0,1) (2,0) | (3,1) dropped
  #   expert 2: (1,1)
  #   token 4 repeats expert 3 in both slots: (4,0) (4,1) kept, (5,0) (5,1) dropped.
  experts_TK = jnp.array([[0, 1], [0, 2], [1, 0], [0, 1], [3, 3], [3, 3]], jnp.int32)
  kept, dropped = jax.jit(ms.drop_over_capacity, static_argnums=(1, 2))(experts_TK, 4, 2)
  np.testing.assert_array_equal(kept, [[0, 1], [0, 2], [1, -1], [-1, -1], [3, 3], [-1, -1]])
  np.testing.assert_array_equal(dropped, np.asarray(kept) == -1)
  # Ids already invalid stay as they are and are not counted as dropped.
  kept, dropped = ms.drop_over_capacity(jnp.array([[-1, 0], [0, 7], [0, 0]]), 4, 1)
  np.testing.assert_array_equal(kept, [[-1, 0], [-1, 7], [-1, -1]])
  np.testing.assert_array_equal(dropped, [[False, False], [True, False], [True, True]])
  kept, dropped = ms.drop_over_capacity(experts_TK, 4, 0)
  assert np.all(np.asarray(kept) == -1) and np.all(dropped)


@pytest.mark.parametrize("impl", ["masked_scan", "ragged_dot"])
def test_capacity_drops_later_tokens_through_the_layer(impl):
  # Token t is e_t * 10 (one-hot) and the router the identity: token t goes to expert e_t.
  # 6 tokens, K = 1, E = 4, capacity ceil(1.0 * 6 * 1 / 4) = 2: expert 0 takes tokens 0 and
  # 1; tokens 3 and 5 (its 3rd and 4th) are dropped and come out exactly zero.
  route_T = np.array([0, 0, 1, 0, 2, 0])
  cfg = ms.MoEConfig(
    d_model=4,
    d_ff=4,
    num_experts=4,
    top_k=1,
    expert_type="linear",
    capacity_factor=1.0,
    impl=impl,
    gmm_impl="ragged_dot",
  )
  assert cfg.capacity(6) == 2
  w_EDF = jnp.asarray(np.random.default_rng(0).normal(size=(4, 4, 4)) / 2, jnp.float32)
  params = ms.MoEParams(router_DE=jnp.eye(4), experts=ms.Linear(w_EDF), shared=None)
  x_BSD = jnp.asarray(10.0 * np.eye(4)[route_T])[None]  # [1, 6, 4]
  y_BSD, aux = run(params, x_BSD, cfg)
  dropless, aux0 = run(params, x_BSD, dataclasses.replace(cfg, capacity_factor=None))
  kept = np.array([True, True, True, False, True, False])
  np.testing.assert_array_equal(y_BSD[0, ~kept], 0.0)
  np.testing.assert_array_equal(y_BSD[0, kept], dropless[0, kept])
  # Each kept token is its expert's matrix times itself (weight 1: K = 1, normalized).
  want = np.einsum("td,tdf->tf", np.asarray(x_BSD[0]), np.asarray(params.experts.w_EDF)[route_T])
  assert_close(y_BSD[0, kept], want[kept], jnp.float32)
  assert int(aux["dropped_items"]) == 2 and int(aux["dropped_tokens"]) == 2
  np.testing.assert_array_equal(aux["expert_load"], [2, 1, 1, 0])
  np.testing.assert_array_equal(aux0["expert_load"], [4, 1, 1, 0])
  # The load-balancing loss sees the router's choices, before the drop.
  assert_close(aux["load_balance_loss"], aux0["load_balance_loss"], jnp.float32)


# --------------------------------------------------------------------------- errors


def test_aux_loss_trains_the_router():
  cfg = config(impl="masked_scan")
  params = ms.init_moe_params(jax.random.key(11), cfg)
  d = jax.jit(jax.grad(lambda p: ms.moe_layer(p, tokens(11), cfg)[1]["aux_loss"]))(params)
  assert float(jnp.abs(d.router_DE).max()) > 0
  for leaf in jax.tree.leaves((d.experts, d.shared)):
    np.testing.assert_array_equal(leaf, 0.0)


def test_layer_input_errors(mesh):
  cfg = config()
  params = ms.moe_param_shapes(cfg)
  x_BSD = jax.ShapeDtypeStruct((B, S, D), jnp.float32)

  def call(params=params, x_BSD=x_BSD, cfg=cfg, mesh=None):
    jax.eval_shape(lambda p, x: ms.moe_layer(p, x, cfg, mesh), params, x_BSD)

  call()  # the good call traces
  bad_experts = dataclasses.replace(
    params.experts, down_EFD=jax.ShapeDtypeStruct((E, F + 1, D), jnp.float32)
  )
  cases = [
    (
      dict(x_BSD=jax.ShapeDtypeStruct((B * S, D), jnp.float32)),
      ValueError,
      "moe_layer: x_BSD must have shape [B, S, d_model=8] (got shape (24, 8))",
    ),
    (
      dict(x_BSD=jax.ShapeDtypeStruct((B, S, D + 1), jnp.float32)),
      ValueError,
      "moe_layer: x_BSD must have shape [B, S, d_model=8] (got shape (8, 3, 9))",
    ),
    (
      dict(x_BSD=jax.ShapeDtypeStruct((B, S, D), jnp.int32)),
      TypeError,
      "moe_layer: x_BSD must have a floating-point dtype (got int32)",
    ),
    (
      dict(params=dataclasses.replace(params, experts=bad_experts)),
      ValueError,
      "moe_layer: params.experts.down_EFD must have shape (8, 12, 8) for this MoEConfig "
      "(got (8, 13, 8))",
    ),
    (
      dict(
        params=dataclasses.replace(params, router_DE=jax.ShapeDtypeStruct((D, E // 2), jnp.float32))
      ),
      ValueError,
      "moe_layer: params.router_DE must have shape (8, 8) for this MoEConfig (got (8, 4))",
    ),
    (
      dict(params=dataclasses.replace(params, shared=None)),
      ValueError,
      "moe_layer: params must have the leaves of this MoEConfig (expert_type='swiglu', "
      "num_shared_experts=2): missing ['params.shared.gate_EDF', 'params.shared.up_EDF', "
      "'params.shared.down_EFD'], unexpected []",
    ),
    (
      dict(params=ms.moe_param_shapes(config(expert_type="linear", d_ff=D))),
      ValueError,
      "moe_layer: params must have the leaves of this MoEConfig (expert_type='swiglu', "
      "num_shared_experts=2): missing ['params.experts.gate_EDF', 'params.experts.up_EDF', "
      "'params.experts.down_EFD'], unexpected ['params.experts.w_EDF']",
    ),
    (
      dict(
        params=dataclasses.replace(
          params,
          experts=dataclasses.replace(
            params.experts, up_EDF=jax.ShapeDtypeStruct((E, D, F), jnp.int32)
          ),
        )
      ),
      TypeError,
      "moe_layer: params.experts.up_EDF must have a floating-point dtype (got int32)",
    ),
    (
      dict(params={"router_DE": params.router_DE}),
      TypeError,
      "moe_layer: params must be a MoEParams from init_moe_params (got dict)",
    ),
    (dict(cfg=dict(d_model=D)), TypeError, "moe_layer: cfg must be a MoEConfig (got dict)"),
    (
      dict(cfg=dataclasses.replace(cfg, impl="all_to_all")),
      ValueError,
      "moe_layer: impl 'all_to_all' needs a mesh with the expert axis 'expert' "
      "(got mesh=None, and no mesh in scope with that axis)",
    ),
    (
      dict(cfg=dataclasses.replace(cfg, impl="all_gather", expert_axis="ep"), mesh=mesh),
      ValueError,
      "moe_layer: mesh must have the expert axis 'ep' (got axes ('expert', 'data'))",
    ),
    (
      dict(mesh=mesh, cfg=config(num_experts=6)),
      ValueError,
      "moe_layer: num_experts (6) must be divisible by the 'expert' axis size (4)",
    ),
    (
      dict(mesh="mesh"),
      TypeError,
      "moe_layer: mesh must be a jax.sharding.Mesh, an AbstractMesh or None (got str)",
    ),
  ]
  for kwargs, error, message in cases:
    if "cfg" in kwargs and isinstance(kwargs["cfg"], ms.MoEConfig) and "params" not in kwargs:
      kwargs["params"] = ms.moe_param_shapes(kwargs["cfg"])
    with pytest.raises(error, match="^" + re.escape(message)):
      call(**kwargs)


# --------------------------------------------------------------------------- any (B, S)

# B * S not dividing the device count, B below it, S of one: the layer flattens [B, S] into
# tokens and back on both axis types (on an Explicit mesh a reshape must be told its output
# sharding when B alone cannot carry the tokens' split). Shapes that divide evenly are in
# every other test of this file.
BATCH_SHAPES = [(3, 5), (1, 8), (16, 1)]


@pytest.mark.parametrize("axis_type", ["explicit", "auto"])
def test_every_batch_shape_on_both_axis_types(axis_type):
  kind = AxisType.Explicit if axis_type == "explicit" else AxisType.Auto
  mesh2x4 = jax.make_mesh((2, 4), (ms.DATA, ms.EXPERT), axis_types=(kind,) * 2)
  cfg = config(num_shared_experts=0)
  params = ms.init_moe_params(jax.random.key(0), cfg, mesh=mesh2x4)
  on_mesh = jax.jit(lambda p, x: ms.moe_layer(p, x, cfg, mesh=mesh2x4)[0])
  for i, (b, s) in enumerate(BATCH_SHAPES):
    x_BSD = tokens(i, (b, s, D))
    want = layer_oracle.layer(jax.device_get(params), x_BSD, cfg)[0]
    ys = [on_mesh(params, x_BSD)]
    if i == 0:  # outside jit too (op by op: slow, so one shape)
      ys.append(ms.moe_layer(params, x_BSD, cfg, mesh=mesh2x4)[0])
    for y in ys:
      assert y.shape == (b, s, D) and y.dtype == x_BSD.dtype, (b, s)
      assert_close(y, want, jnp.float32, f"B={b} S={s} {axis_type}")
