"""Experts split past the expert axis: expert tensor parallelism and FSDP of expert weights.

`MoEConfig(expert_tensor_axis=...)` splits each routed and shared expert's hidden dimension
F over an axis; `expert_fsdp_axis=...` stores the last dimension of each of their matrices
split over an axis, gathered inside the layer. Checked here:

  * the layer against the float64 layer model (`layer_oracle`), y, aux and the gradient of
    x and every parameter leaf (finite differences), on 3-axis meshes (data x expert x
    tensor) and 2-axis ones with FSDP, for every dispatch (all_gather, all_to_all,
    ragged_all_to_all with overflow rounds, and the local ones on a mesh), both grouped
    matmuls, Auto and Explicit axes, an expert axis that is a tuple, and the user's axis
    names. Every routed expert has biases: the output bias must be added once, not once
    per tensor rank.
  * the per-device bytes of every weight: the full size over the product of the axes that
    split it, as `init_moe_params` creates it;
  * the compiled gradient program: FSDP gathers each weight once and reduce-scatters its
    gradient (no all-reduce of a weight-sized gradient); the tensor axis gathers rows and
    reduce-scatters partial outputs;
  * the errors: a split that does not divide, a name that is not a mesh axis, an axis used
    twice, tensor parallelism of experts without a hidden dimension.
"""

import functools
import math
import re

import jax
import jax.numpy as jnp
import layer_oracle
import numpy as np
import pytest
from cases import FAST_COMPILE, Mismatches
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import moe_shard as ms

B, S, D, F, E, K, SHARED_F = 8, 2, 8, 16, 8, 2, 8  # T = 16 tokens: 2 per device
EXPLICIT, AUTO = AxisType.Explicit, AxisType.Auto
DET = ("data", "expert", "tensor")

# name: (MoEConfig overrides, mesh shape, axis names, axis type)
CASES = {
  "etp-all_gather-tiled-2x2x2-auto": (
    dict(impl="all_gather", gmm_impl="tiled", expert_tensor_axis="tensor"),
    (2, 2, 2),
    DET,
    AUTO,
  ),
  # chunk_size=1 and recv_capacity=2: overflow rounds run, each through the tensor axis.
  "etp-all_to_all-2x2x2-explicit": (
    dict(impl="all_to_all", chunk_size=1, expert_tensor_axis="tensor"),
    (2, 2, 2),
    DET,
    EXPLICIT,
  ),
  "etp-ragged_all_to_all-2x2x2-auto": (
    dict(impl="ragged_all_to_all", recv_capacity=2, expert_tensor_axis="tensor"),
    (2, 2, 2),
    DET,
    AUTO,
  ),
  "fsdp-all_to_all-2x4-explicit": (
    dict(impl="all_to_all", expert_fsdp_axis="data"),
    (2, 4),
    ("data", "expert"),
    EXPLICIT,
  ),
  "fsdp-ragged_all_to_all-2x4-auto": (
    dict(impl="ragged_all_to_all", expert_fsdp_axis="data"),
    (2, 4),
    ("data", "expert"),
    AUTO,
  ),
  "etp_fsdp-all_gather-2x2x2-explicit": (
    dict(impl="all_gather", expert_tensor_axis="tensor", expert_fsdp_axis="data"),
    (2, 2, 2),
    DET,
    EXPLICIT,
  ),
  # The user's names, none of them the defaults.
  "etp_fsdp-ragged_all_to_all-tiled-names-explicit": (
    dict(
      impl="ragged_all_to_all",
      gmm_impl="tiled",
      recv_capacity=2,
      expert_axis="ep",
      expert_tensor_axis="tp",
      expert_fsdp_axis="dp",
    ),
    (2, 2, 2),
    ("dp", "ep", "tp"),
    EXPLICIT,
  ),
  # Experts over a tuple of axes (one per device on 4), F over the third.
  "etp-tuple_expert-all_to_all-auto": (
    dict(impl="all_to_all", expert_axis=("data", "ep"), expert_tensor_axis="tp"),
    (2, 2, 2),
    ("data", "ep", "tp"),
    AUTO,
  ),
  # The local dispatches on a mesh: XLA shards them from the weights' specs.
  "etp_fsdp-ragged_dot-2x2x2-auto": (
    dict(impl="ragged_dot", expert_tensor_axis="tensor", expert_fsdp_axis="data"),
    (2, 2, 2),
    DET,
    AUTO,
  ),
  "etp-masked_scan-2x2x2-explicit": (
    dict(impl="masked_scan", expert_tensor_axis="tensor"),
    (2, 2, 2),
    DET,
    EXPLICIT,
  ),
}


def config(**overrides):
  base = dict(
    d_model=D,
    d_ff=F,
    num_experts=E,
    top_k=K,
    expert_bias=True,
    num_shared_experts=1,
    shared_d_ff=SHARED_F,
    gmm_impl="ragged_dot",
    load_balance_coef=0.1,
    z_loss_coef=0.01,
  )
  return ms.MoEConfig(**{**base, **overrides})


def mesh_of(shape, names, kind):
  return jax.make_mesh(shape, names, axis_types=(kind,) * len(shape))


@functools.cache
def reference():
  """(params, x, ct) as NumPy, the model's outputs and finite-difference gradients.

  Every leaf is drawn, the biases too (nonzero: an output bias added once per tensor rank
  moves y by a multiple of itself). The first seed with a routing margin of 0.05 is used,
  so that float32 and float64 pick the same experts.
  """
  for seed in range(100):
    rng = np.random.default_rng(seed)
    normal = lambda *shape, s=1.0, rng=rng: (
      rng.normal(size=shape) * s / math.sqrt(shape[-2])
    ).astype(np.float32)
    experts = ms.SwiGLU(
      normal(E, D, F),
      normal(E, D, F),
      normal(E, F, D),
      gate_b_EF=normal(E, 2, F)[:, 0],
      up_b_EF=normal(E, 2, F)[:, 0],
      down_b_ED=normal(E, 2, D)[:, 0],
    )
    shared = ms.SwiGLU(normal(1, D, SHARED_F), normal(1, D, SHARED_F), normal(1, SHARED_F, D))
    params = ms.MoEParams(router_DE=normal(D, E, s=2.0), experts=experts, shared=shared)
    x = rng.normal(size=(B, S, D)).astype(np.float32)
    ct = rng.normal(size=(B, S, D)).astype(np.float32)
    if layer_oracle.routing_margin(x.reshape(-1, D), params.router_DE, K) >= 0.05:
      break
  else:
    raise AssertionError("no seed with a routing margin of 0.05")
  cfg = config()
  y, aux = layer_oracle.layer(params, x, cfg)
  dparams, dx = layer_oracle.fd_grads(params, x, ct, cfg)
  return params, x, ct, y, aux, dparams, dx


@functools.partial(jax.jit, static_argnames=("cfg", "mesh"), compiler_options=FAST_COMPILE)
def run_and_grad(params, x_BSD, ct_BSD, cfg, mesh):
  """(y, aux, (dparams, dx)) of `sum(y * ct) + aux_loss`, jitted once per (cfg, mesh)."""

  def loss(params, x_BSD):
    y, aux = ms.moe_layer(params, x_BSD, cfg, mesh)
    return jnp.sum(y * ct_BSD) + aux["aux_loss"], (y, aux)

  (_, (y, aux)), grads = jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)(params, x_BSD)
  return y, aux, grads


def placed(params, cfg, mesh):
  """`params` put on the mesh as `moe_param_specs(cfg)` says."""
  return jax.tree.map(
    lambda a, spec: jax.device_put(a, NamedSharding(mesh, spec)), params, ms.moe_param_specs(cfg)
  )


@pytest.mark.parametrize("name", list(CASES))
def test_split_layer_matches_float64_model(name):
  overrides, shape, names, kind = CASES[name]
  cfg = config(**overrides)
  mesh = mesh_of(shape, names, kind)
  params, x, ct, want_y, want_aux, want_dparams, want_dx = reference()
  params = placed(jax.tree.map(jnp.asarray, params), cfg, mesh)
  y, aux, (dparams, dx) = run_and_grad(params, jnp.asarray(x), jnp.asarray(ct), cfg, mesh)
  m = Mismatches(name)
  m.close(y, want_y, "y")
  for what in ("aux_loss", "load_balance_loss", "z_loss"):
    m.close(aux[what], want_aux[what], what)
  np.testing.assert_array_equal(aux["expert_load"], want_aux["expert_load"])
  if "chunk_size" in overrides or "recv_capacity" in overrides:
    assert int(aux["rounds"]) >= 2, f"{name}: no overflow round ran"
  m.close(dx, want_dx, "dx")
  paths = lambda t: [p for p, _ in jax.tree_util.tree_leaves_with_path(t)]
  assert paths(dparams) == paths(want_dparams)
  m.close_tree(dparams, want_dparams)
  m.check()


def test_output_bias_counts_once():
  """The model moves far beyond the tolerance with the output bias doubled: a layer that
  adds it once per tensor rank (2 here) fails the comparison above."""
  params, x, _, want_y, _, _, _ = reference()
  doubled = ms.MoEParams(
    router_DE=params.router_DE,
    experts=ms.SwiGLU(
      params.experts.gate_EDF,
      params.experts.up_EDF,
      params.experts.down_EFD,
      params.experts.gate_b_EF,
      params.experts.up_b_EF,
      2 * params.experts.down_b_ED,
    ),
    shared=params.shared,
  )
  y, _ = layer_oracle.layer(doubled, x, config())
  assert np.max(np.abs(y - want_y)) > 100 * 1e-5 * max(1.0, np.max(np.abs(want_y)))


# --------------------------------------------------------------------------- bytes per device


@pytest.mark.parametrize(
  "overrides, shape, names",
  [
    (dict(expert_tensor_axis="tensor"), (2, 2, 2), DET),
    (dict(expert_fsdp_axis="data"), (2, 4), ("data", "expert")),
    (dict(expert_tensor_axis="tensor", expert_fsdp_axis="data"), (2, 2, 2), DET),
    (
      dict(expert_axis="ep", expert_tensor_axis="tp", expert_fsdp_axis="dp"),
      (2, 2, 2),
      ("dp", "ep", "tp"),
    ),
  ],
)
def test_each_device_holds_its_share_of_every_weight(overrides, shape, names):
  """Each device's shard of each weight is the full size over the product of the sizes of
  the axes that split it (expert axis on E, tensor axis on F, FSDP axis on each matrix's
  last dimension), as written out by hand here; the router and the biases' D stay whole."""
  cfg = config(**overrides)
  mesh = mesh_of(shape, names, AUTO)
  params = ms.init_moe_params(jax.random.key(0), cfg, mesh)
  size = dict(zip(names, shape))
  ep = size[cfg.expert_axis]
  tp = size.get(cfg.expert_tensor_axis, 1)
  dp = size.get(cfg.expert_fsdp_axis, 1)
  divisor = {
    "router_DE": 1,
    "experts.gate_EDF": ep * dp * tp,
    "experts.up_EDF": ep * dp * tp,
    "experts.down_EFD": ep * tp * dp,
    "experts.gate_b_EF": ep * tp,
    "experts.up_b_EF": ep * tp,
    "experts.down_b_ED": ep,
    "shared.gate_EDF": dp * tp,
    "shared.up_EDF": dp * tp,
    "shared.down_EFD": tp * dp,
  }
  for path, a in jax.tree_util.tree_leaves_with_path(params):
    name = jax.tree_util.keystr(path)[1:]
    for shard in a.addressable_shards:
      assert shard.data.size * divisor[name] == a.size, (name, shard.data.shape, a.shape)


# --------------------------------------------------------------------------- compiled program


def _collectives(hlo, op):
  """The result shapes (dtype[dims]) of every `op` instruction of an HLO text."""
  return re.findall(rf"= (\w+\[[\d,]*\])[^=]*? {op}(?:-start)?\(", hlo)


@pytest.mark.parametrize("impl", ["all_to_all", "ragged_all_to_all"])
def test_fsdp_gathers_weights_once_and_reduce_scatters_their_gradients(impl):
  """The compiled gradient of the layer with FSDP over "data" (2 x 4 mesh, F = 16, D = 8):
  each routed weight [2, 8, 16] / [2, 16, 8] (2 local experts) is all-gathered exactly
  once on its last dimension, its gradient reduce-scattered back to [2, 8, 8] / [2, 16, 4],
  and no all-reduce carries a weight-sized array (the expert weights are split over every
  axis, so nothing is summed whole)."""
  cfg = config(impl=impl, expert_fsdp_axis="data", num_shared_experts=0, expert_bias=False)
  mesh = mesh_of((2, 4), ("data", "expert"), AUTO)
  params = ms.init_moe_params(jax.random.key(0), cfg, mesh)
  x = jax.device_put(jnp.ones((B, S, D)), NamedSharding(mesh, P(("data", "expert"))))

  def loss(params, x):
    y, aux = ms.moe_layer(params, x, cfg, mesh)
    return jnp.sum(y**2) + aux["aux_loss"]

  hlo = jax.jit(jax.grad(loss)).lower(params, x).compile().as_text()
  gathered = _collectives(hlo, "all-gather")
  assert sorted(s for s in gathered if s in ("f32[2,8,16]", "f32[2,16,8]")) == [
    "f32[2,16,8]",
    "f32[2,8,16]",
    "f32[2,8,16]",
  ], gathered
  scattered = _collectives(hlo, "reduce-scatter")
  assert sorted(s for s in scattered if s in ("f32[2,8,8]", "f32[2,16,4]")) == [
    "f32[2,16,4]",
    "f32[2,8,8]",
    "f32[2,8,8]",
  ], scattered
  reduced = _collectives(hlo, "all-reduce")
  sizes = [math.prod(int(n) for n in s[s.index("[") + 1 : -1].split(",") if n) for s in reduced]
  weight_sized = [s for s, n in zip(reduced, sizes) if n >= 2 * 8 * 8]
  assert not weight_sized, reduced


def test_tensor_axis_gathers_rows_and_reduce_scatters_partial_outputs():
  """The all_to_all's forward with a tensor axis: the received rows are all-gathered over
  it and the expert outputs reduce-scattered before the return trip; the weights are not
  gathered (each device computes with its own F / 2 columns)."""
  cfg = config(impl="all_to_all", expert_tensor_axis="tensor", num_shared_experts=0)
  mesh = mesh_of((2, 2, 2), DET, AUTO)
  params = ms.init_moe_params(jax.random.key(0), cfg, mesh)
  x = jax.device_put(jnp.ones((B, S, D)), NamedSharding(mesh, P(DET)))
  hlo = jax.jit(lambda p, x: ms.moe_layer(p, x, cfg, mesh)[0]).lower(params, x).compile().as_text()
  gathered = _collectives(hlo, "all-gather")
  assert not [s for s in gathered if s.count(",") == 2], f"a weight was gathered: {gathered}"
  assert any(s.startswith("f32[") and s.endswith(",8]") for s in gathered), gathered
  assert any(s.endswith(",8]") for s in _collectives(hlo, "reduce-scatter")), hlo[-2000:]


# --------------------------------------------------------------------------- errors


@pytest.mark.parametrize(
  "overrides, shape, names, match",
  [
    (
      dict(expert_tensor_axis="tensor", d_ff=10),
      (2, 1, 4),
      DET,
      r"moe_layer: d_ff \(10\) must be divisible by the size of expert_tensor_axis "
      r"'tensor' \(4\)",
    ),
    (
      dict(expert_tensor_axis="tensor", shared_d_ff=5),
      (2, 2, 2),
      DET,
      r"moe_layer: shared_d_ff \(5\) must be divisible by the size of expert_tensor_axis "
      r"'tensor' \(2\)",
    ),
    (
      dict(expert_tensor_axis="tensor", expert_fsdp_axis="data", d_ff=6),
      (2, 2, 2),
      DET,
      r"moe_layer: d_ff \(6\) must be divisible by the sizes of expert_tensor_axis 'tensor' "
      r"times expert_fsdp_axis 'data' \(4\)",
    ),
    (
      dict(expert_fsdp_axis="data", d_model=6),
      (4, 2),
      ("data", "expert"),
      r"moe_layer: d_model \(6\) must be divisible by the size of expert_fsdp_axis 'data' \(4\)",
    ),
    (
      dict(expert_tensor_axis="tp"),
      (2, 4),
      ("data", "expert"),
      r"moe_layer: expert_tensor_axis must be an axis of the mesh \(got 'tp'; mesh axes "
      r"\('data', 'expert'\)\)",
    ),
    (
      dict(num_experts=6, top_k=2),
      (2, 4),
      ("data", "expert"),
      r"moe_layer: num_experts \(6\) must be divisible by the 'expert' axis size \(4\)",
    ),
  ],
)
def test_layer_rejects_a_split_that_does_not_fit_the_mesh(overrides, shape, names, match):
  cfg = config(**overrides)
  mesh = mesh_of(shape, names, AUTO)
  params = jax.eval_shape(lambda: ms.init_moe_params(jax.random.key(0), cfg))
  x = jax.ShapeDtypeStruct((B, S, cfg.d_model), jnp.float32)
  with pytest.raises(ValueError, match=match):
    jax.eval_shape(lambda p, x: ms.moe_layer(p, x, cfg, mesh), params, x)
  with pytest.raises(ValueError, match=match.replace("moe_layer", "init_moe_params")):
    ms.init_moe_params(jax.random.key(0), cfg, mesh)


@pytest.mark.parametrize(
  "overrides, error, match",
  [
    (
      dict(expert_fsdp_axis="expert"),
      ValueError,
      r"MoEConfig: expert_fsdp_axis must be an axis that expert_axis does not use: one mesh "
      r"axis splits one dimension \(got expert_fsdp_axis='expert', expert_axis='expert'\)",
    ),
    (
      dict(expert_axis=("data", "ep"), expert_tensor_axis="data"),
      ValueError,
      r"expert_tensor_axis must be an axis that expert_axis does not use.*"
      r"\(got expert_tensor_axis='data', expert_axis=\('data', 'ep'\)\)",
    ),
    (
      dict(expert_tensor_axis="t", expert_fsdp_axis="t"),
      ValueError,
      r"expert_fsdp_axis must be an axis that expert_tensor_axis does not use.*"
      r"\(got expert_fsdp_axis='t', expert_tensor_axis='t'\)",
    ),
    (
      dict(expert_tensor_axis=("a", "b")),
      TypeError,
      r"MoEConfig: expert_tensor_axis must be None or a mesh axis name \(a non-empty str\) "
      r"\(got \('a', 'b'\)\)",
    ),
    (
      dict(expert_fsdp_axis=""),
      TypeError,
      r"MoEConfig: expert_fsdp_axis must be None or a mesh axis name",
    ),
    (
      dict(expert_type="linear", d_ff=D, expert_tensor_axis="tensor"),
      ValueError,
      r"MoEConfig: expert_tensor_axis needs experts with a hidden dimension F between their "
      r"input and output matrices; expert_type 'linear' outputs F",
    ),
  ],
)
def test_config_rejects_axes(overrides, error, match):
  with pytest.raises(error, match=match):
    config(**overrides)


def test_dispatch_rejects_a_weight_the_axis_does_not_divide():
  """The dispatch functions check the leaves they are given: F = 6 over a tensor axis of 4."""
  mesh = mesh_of((2, 1, 4), DET, AUTO)
  w = ms.SwiGLU(jnp.ones((E, D, 6)), jnp.ones((E, D, 6)), jnp.ones((E, 6, D)))
  x, ids = jnp.ones((16, D)), jnp.zeros((16, K), jnp.int32)
  with pytest.raises(
    ValueError,
    match=r"moe_all_to_all: the dimension 6 of w.gate_EDF must be divisible by the axes that "
    r"split it: 'tensor' \(4\)",
  ):
    ms.moe_all_to_all(x, w, ids, mesh=mesh, expert_tensor_axis="tensor")
