"""Mesh axis names are the user's: every entry point with an expert axis other than "expert".

`MoEConfig(expert_axis="ep")` on a `("data", "ep")` mesh (experts over "ep") and
`expert_axis=("data", "ep")` (experts over both axes, one per device), each given as
`mesh=` and as the mesh in scope (`with jax.set_mesh(mesh):`), for the Flax NNX and Equinox
modules, `init_moe_params` / `moe_param_specs` and `moe_shard.hf.load_moe_layer`; and the
same with `expert_tensor_axis="tp"` and `expert_fsdp_axis="dp"` on a ("dp", "ep", "tp")
mesh. The modules' outputs are compared with the float64 layer oracle and with `moe_layer` on the same
mesh with the same parameters (one case also its gradients), the parameters' shardings with
the specs written out by hand, and each compiled program must hold its dispatch's collective
(all_to_all, ragged_all_to_all, all_gather). No mesh here has an axis named "expert", so a
hard-coded default name fails.
"""

import dataclasses

import hf_checkpoints
import jax
import jax.numpy as jnp
import layer_oracle
import numpy as np
import pytest
from cases import FAST_COMPILE, assert_close, assert_tree_close, cotangent
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import moe_shard as ms
from moe_shard import hf

nnx = pytest.importorskip("flax.nnx")
eqx = pytest.importorskip("equinox")

from moe_shard.equinox import MoE as EqxMoE  # noqa: E402
from moe_shard.nnx import MoE as NnxMoE  # noqa: E402

D, F, E, K = 8, 16, 8, 2
B, S = 8, 2  # T = 16 tokens, 2 per device
AXES = ("data", "ep")
# The expert axis and how many experts each device holds on the 2 x 4 mesh.
EXPERT_AXES = {"ep": 2, AXES: 1}
MODES = ("mesh_arg", "set_mesh")


def make_cfg(expert_axis, impl="auto"):
  return ms.MoEConfig(
    d_model=D,
    d_ff=F,
    num_experts=E,
    top_k=K,
    impl=impl,
    gmm_impl="ragged_dot",
    num_shared_experts=1,
    shared_d_ff=D,
    expert_axis=expert_axis,
  )


def make_mesh(mode):
  # mesh= on Auto axes, the mesh in scope on Explicit ones: both axis types are covered.
  kind = AxisType.Explicit if mode == "set_mesh" else AxisType.Auto
  return jax.make_mesh((2, 4), AXES, axis_types=(kind, kind))


def scope(mesh, mode):
  """(the `mesh` argument to pass, a function returning the context to run in) for a mode."""
  if mode == "set_mesh":
    return None, lambda: jax.set_mesh(mesh)
  return mesh, _NoScope


class _NoScope:
  def __enter__(self):
    assert ms.mesh_in_scope() is None

  def __exit__(self, *exc):
    return False


def tokens(mesh):
  x = jax.random.normal(jax.random.key(1), (B, S, D))
  return jax.device_put(x, NamedSharding(mesh, P(AXES)))


def leaves_and_specs(params, cfg):
  specs = ms.moe_param_specs(cfg)
  spec_leaves = jax.tree.leaves(specs, is_leaf=lambda s: isinstance(s, P))
  leaves = jax.tree.leaves(params)
  assert len(leaves) == len(spec_leaves)
  return zip(leaves, spec_leaves)


def check_placed(params, cfg, mesh):
  """Every leaf on `mesh` as `moe_param_specs(cfg)` says, experts over `cfg.expert_axis`."""
  specs = ms.moe_param_specs(cfg)
  assert specs.experts.gate_EDF == P(cfg.expert_axis, None, None)
  assert specs.experts.down_EFD == P(cfg.expert_axis, None, None)
  assert specs.router_DE == P(None, None)
  assert specs.shared.up_EDF == P(None, None, None)
  for leaf, spec in leaves_and_specs(params, cfg):
    assert leaf.sharding == NamedSharding(mesh, spec), (leaf.sharding, spec)
  per_device = EXPERT_AXES[cfg.expert_axis]
  assert {s.data.shape[0] for s in params.experts.gate_EDF.addressable_shards} == {per_device}


# --------------------------------------------------------------------------- params


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("expert_axis", list(EXPERT_AXES), ids=["ep", "data-ep"])
def test_init_moe_params(expert_axis, mode):
  cfg = make_cfg(expert_axis)
  mesh = make_mesh(mode)
  arg, context = scope(mesh, mode)
  with context():
    params = ms.init_moe_params(jax.random.key(0), cfg, mesh=arg)
  check_placed(params, cfg, mesh)
  # The values of the unsharded init (which has no expert axis to use).
  assert_tree_close(params, ms.init_moe_params(jax.random.key(0), make_cfg("expert")), jnp.float32)


# --------------------------------------------------------------------------- modules


def build(framework, cfg, mesh_arg):
  """(module, its parameters as a `MoEParams`, its array state, state -> module)."""
  if framework == "nnx":
    moe = NnxMoE(cfg, rngs=nnx.Rngs(0), mesh=mesh_arg)
    graphdef, state = nnx.split(moe)
    return moe, moe.moe_params(), state, lambda s: nnx.merge(graphdef, s)
  moe = EqxMoE(cfg, key=jax.random.key(0), mesh=mesh_arg)
  arrays, static = eqx.partition(moe, eqx.is_array)
  return moe, moe.params, arrays, lambda a: eqx.combine(a, static)


def module_params(framework, module):
  return module.moe_params() if framework == "nnx" else module.params


# (framework, expert axis, mode, dispatch, collective in the compiled program, gradients)
CASES = [
  ("nnx", "ep", "mesh_arg", "all_to_all", "all-to-all", False),
  ("nnx", "ep", "set_mesh", "all_gather", "all-gather", False),
  ("nnx", AXES, "mesh_arg", "ragged_all_to_all", "all-to-all", False),
  ("nnx", AXES, "set_mesh", "all_to_all", "all-to-all", False),
  ("equinox", "ep", "mesh_arg", "ragged_all_to_all", "all-to-all", False),
  ("equinox", "ep", "set_mesh", "all_to_all", "all-to-all", False),
  ("equinox", AXES, "mesh_arg", "all_gather", "all-gather", False),
  ("equinox", AXES, "set_mesh", "all_to_all", "all-to-all", True),
]


def case_id(case):
  framework, axis, mode, impl, *_ = case
  return f"{framework}-{'-'.join(axis) if isinstance(axis, tuple) else axis}-{mode}-{impl}"


@pytest.mark.parametrize("case", CASES, ids=[case_id(c) for c in CASES])
def test_module(case):
  framework, expert_axis, mode, impl, collective, grads = case
  cfg = make_cfg(expert_axis, impl)
  mesh = make_mesh(mode)
  arg, context = scope(mesh, mode)
  with context():
    moe, params, state, rebuild = build(framework, cfg, arg)
  assert moe.mesh == mesh
  check_placed(params, cfg, mesh)
  assert_tree_close(params, module_params(framework, rebuild(state)), jnp.float32)
  x = tokens(mesh)
  ct = cotangent((B, S, D), jnp.float32, seed=2)

  def outputs(state, params, x):
    """(module's y, aux_loss), then `moe_layer`'s with mesh=mesh; with gradients of
    sum(y * ct) + aux_loss w.r.t. (parameters, x) for each."""

    def module_loss(state, x):
      y, aux = rebuild(state)(x)
      return jnp.sum(y * ct) + aux["aux_loss"], (y, aux["aux_loss"])

    def layer_loss(params, x):
      y, aux = ms.moe_layer(params, x, cfg, mesh=mesh)
      return jnp.sum(y * ct) + aux["aux_loss"], (y, aux["aux_loss"])

    if not grads:
      return module_loss(state, x)[1], layer_loss(params, x)[1]
    grad = jax.grad(module_loss, argnums=(0, 1), has_aux=True)
    module_grads, module_out = grad(state, x)
    layer_grads, layer_out = jax.grad(layer_loss, argnums=(0, 1), has_aux=True)(params, x)
    return module_out, layer_out, module_grads, layer_grads

  # The module holds its mesh: with mesh= it runs outside any mesh context.
  with context():
    compiled = jax.jit(outputs, compiler_options=FAST_COMPILE).lower(state, params, x).compile()
    got = compiled(state, params, x)
  assert collective in compiled.as_text()
  (y, aux_loss), (want_y, want_aux_loss) = got[:2]
  assert_close(y, want_y, jnp.float32)
  assert_close(aux_loss, want_aux_loss, jnp.float32)
  oracle_y, oracle_aux = layer_oracle.layer(params, x, cfg)
  assert_close(y, oracle_y, jnp.float32)
  assert_close(aux_loss, oracle_aux["aux_loss"], jnp.float32)
  if grads:
    (state_grads, dx), (param_grads, want_dx) = got[2:]
    assert_tree_close(module_params(framework, rebuild(state_grads)), param_grads, jnp.float32)
    assert_close(dx, want_dx, jnp.float32)


# --------------------------------------------------------------------------- checkpoints


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
  """A tiny deepseek_v3 checkpoint (8 experts: one per device over both axes)."""
  path = tmp_path_factory.mktemp("deepseek_v3")
  hf_checkpoints.write(path, "deepseek_v3")
  layer = hf_checkpoints.MOE_LAYERS["deepseek_v3"][0]
  return path, layer, hf.load_moe_layer(path, layer)[1]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("expert_axis", list(EXPERT_AXES), ids=["ep", "data-ep"])
def test_load_moe_layer(checkpoint, expert_axis, mode):
  path, layer, want = checkpoint
  mesh = make_mesh(mode)
  arg, context = scope(mesh, mode)
  with context():
    cfg, params = hf.load_moe_layer(path, layer, mesh=arg, expert_axis=expert_axis)
  assert cfg.expert_axis == expert_axis
  check_placed(params, cfg, mesh)
  for got, value in zip(jax.tree.leaves(params), jax.tree.leaves(want)):
    np.testing.assert_array_equal(np.asarray(got), np.asarray(value))


# --------------------------------------------------------------------------- split axes

# Experts over "ep", each expert's F over "tp", every weight's D over "dp": no default name.
SPLIT_AXES = ("dp", "ep", "tp")
SPLIT = dict(expert_axis="ep", expert_tensor_axis="tp", expert_fsdp_axis="dp")


def split_mesh(mode):
  kind = AxisType.Explicit if mode == "set_mesh" else AxisType.Auto
  return jax.make_mesh((2, 2, 2), SPLIT_AXES, axis_types=(kind,) * 3)


def check_split_placed(params, cfg, mesh):
  """Every leaf on `mesh` as the specs written out here say."""
  want = dict(
    router_DE=P(None, None),
    gate_EDF=P("ep", None, ("tp", "dp")),
    down_EFD=P("ep", "tp", "dp"),
    shared_gate=P(None, None, ("tp", "dp")),
  )
  specs = ms.moe_param_specs(cfg)
  assert specs.router_DE == want["router_DE"]
  assert specs.experts.gate_EDF == specs.experts.up_EDF == want["gate_EDF"]
  assert specs.experts.down_EFD == want["down_EFD"]
  assert specs.shared.gate_EDF == want["shared_gate"]
  for leaf, spec in leaves_and_specs(params, cfg):
    assert leaf.sharding == NamedSharding(mesh, spec), (leaf.sharding, spec)


# (framework, mode, dispatch)
SPLIT_CASES = [
  ("nnx", "mesh_arg", "all_to_all"),
  ("nnx", "set_mesh", "ragged_all_to_all"),
  ("equinox", "mesh_arg", "all_gather"),
  ("equinox", "set_mesh", "all_to_all"),
]


@pytest.mark.parametrize("case", SPLIT_CASES, ids=["-".join(c) for c in SPLIT_CASES])
def test_module_with_tensor_and_fsdp_axes(case):
  """The NNX and Equinox modules with every axis field set to a name of the user's: their
  parameters placed as the specs say, their output that of `moe_layer` on the same mesh
  and of the float64 model."""
  framework, mode, impl = case
  cfg = dataclasses.replace(make_cfg("ep", impl), **SPLIT)
  mesh = split_mesh(mode)
  arg, context = scope(mesh, mode)
  with context():
    moe, params, state, rebuild = build(framework, cfg, arg)
  assert moe.mesh == mesh
  check_split_placed(params, cfg, mesh)
  x = jax.device_put(
    jax.random.normal(jax.random.key(1), (B, S, D)), NamedSharding(mesh, P(SPLIT_AXES))
  )

  def outputs(state, params, x):
    y, aux = rebuild(state)(x)
    want_y, want_aux = ms.moe_layer(params, x, cfg, mesh=mesh)
    return y, aux["aux_loss"], want_y, want_aux["aux_loss"]

  with context():
    y, aux_loss, want_y, want_aux_loss = jax.jit(outputs, compiler_options=FAST_COMPILE)(
      state, params, x
    )
  assert_close(y, want_y, jnp.float32)
  assert_close(aux_loss, want_aux_loss, jnp.float32)
  oracle_y, _ = layer_oracle.layer(params, x, cfg)
  assert_close(y, oracle_y, jnp.float32)


@pytest.mark.parametrize("mode", MODES)
def test_load_moe_layer_with_tensor_and_fsdp_axes(checkpoint, mode):
  """The loader places (and reads) each device's slice of E, F and D as the specs say."""
  path, layer, want = checkpoint
  mesh = split_mesh(mode)
  arg, context = scope(mesh, mode)
  with context():
    cfg, params = hf.load_moe_layer(path, layer, mesh=arg, **SPLIT)
  assert (cfg.expert_axis, cfg.expert_tensor_axis, cfg.expert_fsdp_axis) == ("ep", "tp", "dp")
  check_split_placed(params, cfg, mesh)
  for got, value in zip(jax.tree.leaves(params), jax.tree.leaves(want)):
    np.testing.assert_array_equal(np.asarray(got), np.asarray(value))
