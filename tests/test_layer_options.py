"""The layer options of real MoE families against the float64 layer model, on every dispatch.

    router_logit_bias   (gpt-oss)    a trained f32[E] bias on the router logits
    shared_expert_gate  (Qwen2-MoE)  the shared experts' output times sigmoid(x @ shared_gate_D)
    weights_on="input"  (Llama-4)    y = sum_j expert_j(w_j * x), not sum_j w_j * expert_j(x)
    normalize_p         (DBRX)       each token's K weights over their p-norm

One config turns all four on, with `bias_balancing` beside the logit bias (its selection bias
stays zero and must get a zero gradient) and capacity drops, and runs through every dispatch:
masked_scan and ragged_dot on one device, all_gather, all_to_all and ragged_all_to_all on a
2x4 mesh. Its logit bias makes the routing adversarial: experts 0 and 1 (both on the first
device of the expert axis) are everyone's favourites and overflow their capacity, some of
experts 4..7 get nothing. y, the aux losses and counts, and the gradient with respect to x
and every parameter leaf are compared with `layer_oracle` (central finite differences). A K=1
case (Llama-4 routes each token to one expert) runs the input weighting on ragged_dot.

`test_each_option_moves_the_model` shows that the model's output moves far beyond the
tolerance when any one option is turned off, so a layer that ignores an option fails the
comparison.
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
from cases import FAST_COMPILE, TOL, assert_close
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import moe_shard as ms

B, S, D, F, E, SHARED_F = 8, 2, 8, 8, 8, 8  # T = 16 tokens: 2 per device on 8 devices
# Experts 0, 1 favoured (the first device's on a 4-way expert axis), 4..7 shunned.
LOGIT_BIAS_E = np.array([1.5, 1.0, 0.0, 0.0, -3.0, -3.0, -3.0, -3.0])

ALL_OPTIONS = dict(
  top_k=2,
  router_logit_bias=True,
  shared_expert_gate=True,
  weights_on="input",
  normalize_p=2.0,
  bias_balancing=True,
  capacity_factor=1.0,  # C = ceil(16 * 2 / 8) = 4 items per expert
)
# Llama-4's shape of routing: one expert per token, its probability scaling the input.
K1_INPUT = dict(top_k=1, weights_on="input", normalize_top_k=False, router_logit_bias=True)

EXPLICIT, AUTO = AxisType.Explicit, AxisType.Auto
# name: (option set, MoEConfig overrides, mesh axis type or None for one device)
CASES = {
  "masked_scan": ("all", dict(impl="masked_scan"), None),
  "ragged_dot": ("all", dict(impl="ragged_dot"), None),
  "all_gather-2x4-auto": ("all", dict(impl="all_gather"), AUTO),
  "all_to_all-2x4-explicit": ("all", dict(impl="all_to_all"), EXPLICIT),
  "ragged_all_to_all-2x4-explicit": ("all", dict(impl="ragged_all_to_all"), EXPLICIT),
  "k1-ragged_dot": ("k1", dict(impl="ragged_dot"), None),
}
OPTION_SETS = {"all": ALL_OPTIONS, "k1": K1_INPUT}


def config(options, **overrides):
  base = dict(
    d_model=D,
    d_ff=F,
    num_experts=E,
    num_shared_experts=1,
    shared_d_ff=SHARED_F,
    load_balance_coef=0.1,
    z_loss_coef=0.01,
  )
  return ms.MoEConfig(**{**base, **OPTION_SETS[options], **overrides})


def _draw(cfg, seed):
  """MoEParams (every leaf the config asks for, the balancing bias zero), x and ct."""
  rng = np.random.default_rng(seed)

  def normal(*shape, scale=1.0):  # variance scale**2 / fan-in, float32-exact
    return np.float32(
      scale * rng.normal(size=shape) / math.sqrt(shape[-2 if len(shape) > 1 else 0])
    )

  params = ms.MoEParams(
    router_DE=normal(D, E, scale=2.0),  # decisive routing: few near-ties
    experts=ms.SwiGLU(normal(E, D, F), normal(E, D, F), normal(E, F, D)),
    shared=ms.SwiGLU(normal(1, D, SHARED_F), normal(1, D, SHARED_F), normal(1, SHARED_F, D)),
    router_bias=np.zeros(E, np.float32) if cfg.bias_balancing else None,
    router_logit_bias=np.float32(LOGIT_BIAS_E + 0.1 * rng.normal(size=E)),
    shared_gate_D=normal(D, scale=2.0) if cfg.shared_expert_gate else None,
  )
  x = np.float32(rng.normal(size=(B, S, D)))
  ct = np.float32(rng.normal(size=(B, S, D)))
  return params, x, ct


@functools.cache
def reference(options):
  """(params, x, ct, y, aux, dparams, dx) of the model, for the first seed with a routing
  margin of 0.05 (float32 logits then pick what float64 ones do; finite differences keep
  the choice)."""
  cfg = config(options)
  for seed in range(100):
    params, x, ct = _draw(cfg, seed)
    margin = layer_oracle.routing_margin(
      x.reshape(-1, D), params.router_DE, cfg.top_k, params.router_logit_bias
    )
    if margin >= 0.05:
      break
  else:
    raise AssertionError("no seed with a routing margin of 0.05")
  y, aux = layer_oracle.layer(params, x, cfg)
  dparams, dx = layer_oracle.fd_grads(params, x, ct, cfg)
  return params, x, ct, y, aux, dparams, dx


@functools.partial(jax.jit, static_argnames=("cfg", "mesh"), compiler_options=FAST_COMPILE)
def run_and_grad(params, x_BSD, ct_BSD, cfg, mesh=None):
  """(y, aux, (dparams, dx)) of `sum(y * ct) + aux_loss`, jitted once per (cfg, mesh)."""

  def loss(params, x_BSD):
    y, aux = ms.moe_layer(params, x_BSD, cfg, mesh)
    return jnp.sum(y * ct_BSD) + aux["aux_loss"], (y, aux)

  (_, (y, aux)), grads = jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)(params, x_BSD)
  return y, aux, grads


@pytest.mark.parametrize("name", list(CASES))
def test_layer_options_match_float64_model(name):
  options, overrides, axis_type = CASES[name]
  cfg = config(options, **overrides)
  params, x, ct, want_y, want_aux, want_dparams, want_dx = reference(options)
  params, x_in = jax.tree.map(jnp.asarray, params), jnp.asarray(x)
  mesh = None
  if axis_type is not None:
    mesh = jax.make_mesh((2, 4), ("data", "expert"), axis_types=(axis_type,) * 2)
    if axis_type == AUTO:  # an Explicit mesh's layer places the inputs itself
      put = lambda a, spec: jax.device_put(a, NamedSharding(mesh, spec))
      params = jax.tree.map(put, params, ms.moe_param_specs(cfg))
      x_in = put(x_in, P("data"))
  y, aux, (dparams, dx) = run_and_grad(params, x_in, jnp.asarray(ct), cfg, mesh)

  wrong = []  # every quantity is checked; the failure names each one that is wrong

  def close(got, want, what):
    try:
      assert_close(got, want, jnp.float32, err_msg=f"{name}: {what}")
    except AssertionError as e:
      wrong.append((what, str(e)))

  close(y, want_y, "y")
  for what in ("aux_loss", "load_balance_loss", "z_loss"):
    close(aux[what], want_aux[what], what)
  for what in ("expert_load", "dropped_items", "dropped_tokens"):
    if not np.array_equal(aux[what], want_aux[what]):
      wrong.append((what, f"{what}: got {aux[what]}, want {want_aux[what]}"))
  close(dx, want_dx, "dx")
  got_leaves = jax.tree_util.tree_leaves_with_path(dparams)
  want_leaves = jax.tree_util.tree_leaves_with_path(want_dparams)
  assert [p for p, _ in got_leaves] == [p for p, _ in want_leaves]
  for (path, got), (_, want) in zip(got_leaves, want_leaves):
    close(got, want, f"d{jax.tree_util.keystr(path)}")
  assert not wrong, f"{name}: wrong {[w for w, _ in wrong]}\n" + "\n".join(m for _, m in wrong)


def _y_without(options, what):
  """The model's y for the reference draw with one option turned off."""
  params, x, *_ = reference(options)
  cfg = config(options)
  if what == "router_logit_bias":
    params = dataclasses.replace(params, router_logit_bias=None)
  elif what == "shared_expert_gate":
    params = dataclasses.replace(params, shared_gate_D=None)
  elif what == "weights_on":
    cfg = dataclasses.replace(cfg, weights_on="output")
  else:
    cfg = dataclasses.replace(cfg, normalize_p=1.0)
  return layer_oracle.layer(params, x, cfg)[0]


@pytest.mark.parametrize(
  "options, what",
  [
    ("all", "router_logit_bias"),
    ("all", "shared_expert_gate"),
    ("all", "weights_on"),
    ("all", "normalize_p"),
    ("k1", "router_logit_bias"),
    ("k1", "weights_on"),
  ],
)
def test_each_option_moves_the_model(options, what):
  """Without the option the model's y moves by over 100x the float32 tolerance (no compile)."""
  y = reference(options)[3]
  scale = max(1.0, np.abs(y).max())
  assert np.abs(_y_without(options, what) - y).max() > 100 * TOL[jnp.float32]["atol"] * scale


def test_cases_are_what_they_claim():
  """The draws are adversarial as claimed and every gradient is non-trivial (no compile)."""
  for options in OPTION_SETS:
    _, _, _, _, aux, dparams, dx = reference(options)
    for path, g in jax.tree_util.tree_leaves_with_path((dparams, dx)):
      if "router_bias" in jax.tree_util.keystr(path):  # selection only: no gradient
        np.testing.assert_array_equal(g, 0.0)
      else:
        assert np.abs(g).max() > 1e-3, (options, jax.tree_util.keystr(path))
  aux = reference("all")[4]
  load_E = aux["expert_load"]
  assert load_E[0] == load_E[1] == 4 and np.sum(load_E[4:] == 0) >= 2, load_E  # full; empty
  assert aux["dropped_items"] > 2 * aux["dropped_tokens"] > 0  # tokens with one or two drops


# --------------------------------------------------------------------------- config and params

CONFIG = dict(d_model=4, d_ff=4, num_experts=4, top_k=2)
BAD_CONFIGS = [
  (
    dict(shared_expert_gate=True),
    ValueError,
    "MoEConfig: shared_expert_gate=True needs num_shared_experts >= 1, the experts it gates "
    "(got num_shared_experts=0)",
  ),
  (
    dict(shared_expert_gate=1, num_shared_experts=1),
    TypeError,
    "MoEConfig: shared_expert_gate must be a bool (got 1)",
  ),
  (dict(router_logit_bias="yes"), TypeError, "MoEConfig: router_logit_bias must be a bool"),
  (
    dict(weights_on="both"),
    ValueError,
    "MoEConfig: weights_on must be one of ('output', 'input') (got 'both')",
  ),
  (
    dict(normalize_p=0.5),
    ValueError,
    "MoEConfig: normalize_p must be >= 1, the p of a norm (got 0.5)",
  ),
  (dict(normalize_p=True), TypeError, "MoEConfig: normalize_p must be a real number (got True)"),
  (dict(normalize_p=math.inf), ValueError, "MoEConfig: normalize_p must be finite and > 0"),
  (
    dict(normalize_p=2.0, normalize_top_k=False),
    ValueError,
    "MoEConfig: normalize_p must be 1.0 when normalize_top_k is False, which leaves the "
    "weights unnormalised (got 2.0)",
  ),
]


@pytest.mark.parametrize(
  "overrides, error, match",
  BAD_CONFIGS,
  ids=[",".join(f"{k}={v!r}" for k, v in c[0].items()) for c in BAD_CONFIGS],
)
def test_config_rejects(overrides, error, match):
  with pytest.raises(error, match="^" + re.escape(match)):
    ms.MoEConfig(**CONFIG, **overrides)


# Every leaf on; the module test below shares its compiled init.
OPTIONS_ON = dict(router_logit_bias=True, shared_expert_gate=True, bias_balancing=True)


def test_option_leaves_shapes_specs_and_init():
  plain = ms.MoEConfig(**CONFIG, num_shared_experts=2)
  cfg = dataclasses.replace(plain, **OPTIONS_ON)
  assert cfg.normalize_p == 1.0 and cfg.weights_on == "output"
  for c in (plain, dataclasses.replace(cfg, normalize_p=2, weights_on="input")):
    assert hash(c) == hash(dataclasses.replace(c))
  shapes, specs = ms.moe_param_shapes(cfg), ms.moe_param_specs(cfg)
  assert shapes.router_logit_bias == jax.ShapeDtypeStruct((4,), jnp.float32)
  assert shapes.shared_gate_D == jax.ShapeDtypeStruct((4,), jnp.float32)
  assert specs.router_logit_bias == specs.shared_gate_D == P(None)
  for off in (ms.moe_param_shapes(plain), ms.moe_param_specs(plain)):
    assert off.router_logit_bias is None and off.shared_gate_D is None
  key = jax.random.key(0)
  params, base = ms.init_moe_params(key, cfg), ms.init_moe_params(key, plain)
  np.testing.assert_array_equal(params.router_logit_bias, 0.0)
  assert params.shared_gate_D.dtype == jnp.float32 and np.abs(params.shared_gate_D).min() > 0
  # Turning the options on changes no other leaf.
  same = dataclasses.replace(params, router_bias=None, router_logit_bias=None, shared_gate_D=None)
  jax.tree.map(np.testing.assert_array_equal, same, base)


def test_params_without_an_option_leaf_are_rejected():
  cfg = ms.MoEConfig(**CONFIG, num_shared_experts=1, router_logit_bias=True)
  params = ms.moe_param_shapes(dataclasses.replace(cfg, router_logit_bias=False))
  x = jax.ShapeDtypeStruct((1, 2, 4), jnp.float32)
  with pytest.raises(
    ValueError,
    match=re.escape(
      "moe_layer: params must have the leaves of this MoEConfig (expert_type='swiglu', "
      "num_shared_experts=1, router_logit_bias=True): missing ['params.router_logit_bias'], "
      "unexpected []"
    ),
  ):
    jax.eval_shape(lambda p, x: ms.moe_layer(p, x, cfg), params, x)
  gated = dataclasses.replace(cfg, router_logit_bias=False, shared_expert_gate=True)
  with pytest.raises(ValueError, match=re.escape("shared_expert_gate=True): missing")):
    jax.eval_shape(lambda p, x: ms.moe_layer(p, x, gated), params, x)


def test_nnx_and_equinox_modules_hold_the_option_leaves():
  nnx = pytest.importorskip("flax.nnx")
  from moe_shard.equinox import MoE as EqxMoE
  from moe_shard.nnx import MoE as NnxMoE
  from moe_shard.nnx import RouterBias

  cfg = ms.MoEConfig(**CONFIG, num_shared_experts=2, **OPTIONS_ON)
  want = ms.moe_param_shapes(cfg)
  x = jax.ShapeDtypeStruct((1, 2, 4), jnp.float32)
  nnx_moe = NnxMoE(cfg, rngs=nnx.Rngs(0))
  eqx_moe = EqxMoE(cfg, key=jax.random.key(0))
  for params in (nnx_moe.moe_params(), eqx_moe.params):
    assert jax.tree.map(jax.typeof, params) == jax.tree.map(jax.typeof, want)
    jax.eval_shape(lambda p, x: ms.moe_layer(p, x, cfg), params, x)  # the layer takes them
  # The trained leaves are nnx.Params; the balancing bias is not (the optimizer skips it).
  trained = nnx.to_flat_state(nnx.state(nnx_moe, nnx.Param))
  names = {path[0] for path, _ in trained}
  assert {"router_logit_bias", "shared_gate_D"} <= names and "router_bias" not in names
  assert isinstance(nnx_moe.router_bias, RouterBias)
