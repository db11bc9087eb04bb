"""The mesh a call runs on: the mesh in scope (`jax.set_mesh`), an `AbstractMesh`, experts
split over a tuple of mesh axes, and partition specs with one entry per dimension."""

import re

import jax
import jax.numpy as jnp
import pytest
from cases import FAST_COMPILE, assert_close, assert_tree_close, cotangent, make_case
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import moe_shard as ms

D, F, E, K = 8, 16, 8, 2
CFG = ms.MoEConfig(
  d_model=D, d_ff=F, num_experts=E, top_k=K, gmm_impl="ragged_dot", num_shared_experts=1
)
TOKENS = (8, 2)  # B, S: T = 16 tokens, one sequence of 2 per device


def make_mesh(kind):
  types = {"auto": AxisType.Auto, "explicit": AxisType.Explicit}[kind]
  return jax.make_mesh((2, 4), (ms.DATA, ms.EXPERT), axis_types=(types, types))


def tokens(mesh=None):
  x = jax.random.normal(jax.random.key(1), (*TOKENS, D))
  if mesh is None:
    return x
  return jax.device_put(x, NamedSharding(mesh, P((ms.DATA, ms.EXPERT))))


def layer_fn(cfg, mesh=None):
  return jax.jit(lambda p, x: ms.moe_layer(p, x, cfg, mesh=mesh)[0], compiler_options=FAST_COMPILE)


# --------------------------------------------------------------------------- specs


def test_param_specs_have_one_entry_per_dimension():
  specs = ms.moe_param_specs(CFG)
  shapes = ms.moe_param_shapes(CFG)
  for spec, shape in zip(
    jax.tree.leaves(specs, is_leaf=lambda s: isinstance(s, P)), jax.tree.leaves(shapes)
  ):
    assert len(spec) == len(shape.shape), (spec, shape)
  assert specs.router_DE == P(None, None)
  assert specs.experts.gate_EDF == P(ms.EXPERT, None, None)
  assert specs.shared.down_EFD == P(None, None, None)
  tuple_cfg = ms.MoEConfig(
    d_model=D, d_ff=F, num_experts=E, top_k=K, expert_axis=[ms.DATA, ms.EXPERT]
  )
  assert tuple_cfg.expert_axis == (ms.DATA, ms.EXPERT)
  assert ms.moe_param_specs(tuple_cfg).experts.up_EDF == P((ms.DATA, ms.EXPERT), None, None)


@pytest.mark.parametrize(
  "value, error, message",
  [
    (
      "",
      TypeError,
      "MoEConfig: expert_axis must be a mesh axis name (a non-empty str) or a "
      "non-empty tuple of distinct names (got '')",
    ),
    ((), TypeError, "MoEConfig: expert_axis must be a mesh axis name"),
    (("data", 3), TypeError, "MoEConfig: expert_axis must be a mesh axis name"),
    (("data", "data"), ValueError, "MoEConfig: expert_axis must be a mesh axis name"),
  ],
)
def test_expert_axis_field(value, error, message):
  with pytest.raises(error, match="^" + re.escape(message)):
    ms.MoEConfig(d_model=D, d_ff=F, num_experts=E, top_k=K, expert_axis=value)
  # A 1-tuple is its one name: equal configs hash equally.
  assert (
    ms.MoEConfig(d_model=D, d_ff=F, num_experts=E, top_k=K, expert_axis=("ep",)).expert_axis == "ep"
  )


# --------------------------------------------------------------------------- mesh in scope


@pytest.mark.parametrize("kind", ["auto", "explicit"])
def test_init_uses_the_mesh_in_scope(kind):
  mesh = make_mesh(kind)
  with jax.set_mesh(mesh):
    assert ms.mesh_in_scope() == mesh
    params = ms.init_moe_params(jax.random.key(0), CFG)
  assert ms.mesh_in_scope() is None
  specs = ms.moe_param_specs(CFG)
  for leaf, spec in zip(
    jax.tree.leaves(params), jax.tree.leaves(specs, is_leaf=lambda s: isinstance(s, P))
  ):
    assert leaf.sharding == NamedSharding(mesh, spec)
  # The same values as with mesh= and without a mesh.
  assert_tree_close(params, ms.init_moe_params(jax.random.key(0), CFG), jnp.float32)


@pytest.mark.parametrize("kind", ["auto", "explicit"])
def test_layer_uses_the_mesh_in_scope(kind):
  # mesh=None inside jax.set_mesh: "auto" picks all_to_all; the compiled program holds it.
  mesh = make_mesh(kind)
  params = ms.init_moe_params(jax.random.key(0), CFG, mesh=mesh)
  x = tokens(mesh)
  f = layer_fn(CFG)
  with jax.set_mesh(mesh):
    hlo = f.lower(params, x).compile().as_text()
    got = f(params, x)
  assert "all-to-all" in hlo
  want = layer_fn(CFG)(ms.init_moe_params(jax.random.key(0), CFG), tokens())
  assert_close(got, want, jnp.float32)
  # Without a mesh in scope the same call runs the local ragged_dot: no collective.
  hlo = layer_fn(CFG).lower(params, x).compile().as_text()
  assert "all-to-all" not in hlo


def test_a_mesh_in_scope_without_the_expert_axis_is_not_used():
  # A data-parallel mesh: the layer runs locally (experts replicated), as without a mesh.
  mesh = jax.make_mesh((8,), (ms.DATA,), axis_types=(AxisType.Auto,))
  with jax.set_mesh(mesh):
    params = ms.init_moe_params(jax.random.key(0), CFG)
    assert params.experts.gate_EDF.sharding.is_fully_replicated
  with (
    pytest.raises(
      ValueError,
      match=re.escape(
        "moe_all_to_all: the mesh in scope (jax.set_mesh) must have the expert axis 'expert' "
        "(got axes ('data',))"
      ),
    ),
    jax.set_mesh(mesh),
  ):
    ms.moe_all_to_all(*make_case("uniform", T=16, D=D, F=F, E=E, K=K, seed=0)[:3])


@pytest.mark.parametrize("name", ["all_gather", "all_to_all"])
def test_functional_entry_points_use_the_mesh_in_scope(name):
  fn = getattr(ms, f"moe_{name}")
  x_TD, w, experts_TK, weights_TK = make_case("uniform", T=16, D=D, F=F, E=E, K=K, seed=0)
  mesh = make_mesh("explicit")
  f = jax.jit(lambda *a: fn(*a), compiler_options=FAST_COMPILE)
  with jax.set_mesh(mesh):
    hlo = f.lower(x_TD, w, experts_TK, weights_TK).compile().as_text()
    got = f(x_TD, w, experts_TK, weights_TK)
  assert ("all-to-all" if name == "all_to_all" else "all-gather") in hlo
  assert_close(got, ms.moe_masked_scan(x_TD, w, experts_TK, weights_TK), jnp.float32)
  with pytest.raises(
    ValueError,
    match=re.escape(
      f"moe_{name}: mesh must be given, or a mesh be in scope (`with jax.set_mesh(mesh):`) "
      f"(got mesh=None and no mesh in scope)"
    ),
  ):
    fn(x_TD, w, experts_TK, weights_TK)


# --------------------------------------------------------------------------- AbstractMesh


@pytest.mark.parametrize("kind", ["auto", "explicit"])
def test_abstract_mesh_under_jit_and_eval_shape(kind):
  mesh = make_mesh(kind)
  abstract = mesh.abstract_mesh
  # eval_shape: shapes and shardings of the parameters, nothing created.
  shapes = jax.eval_shape(lambda k: ms.init_moe_params(k, CFG, mesh=abstract), jax.random.key(0))
  assert jax.tree.map(lambda s: (s.shape, s.dtype), shapes) == jax.tree.map(
    lambda s: (s.shape, s.dtype), ms.moe_param_shapes(CFG)
  )
  # jit with inputs on the mesh: the same result as with the concrete mesh.
  params = ms.init_moe_params(jax.random.key(0), CFG, mesh=mesh)
  x = tokens(mesh)
  f = layer_fn(CFG, abstract)
  assert "all-to-all" in f.lower(params, x).compile().as_text()
  assert_close(f(params, x), layer_fn(CFG, mesh)(params, x), jnp.float32)
  # No devices to create arrays on, outside a trace.
  with pytest.raises(
    ValueError,
    match=re.escape(
      "init_moe_params: mesh must be a concrete jax.sharding.Mesh to create arrays (got an "
      "AbstractMesh outside jax.eval_shape or jax.jit)"
    ),
  ):
    ms.init_moe_params(jax.random.key(0), CFG, mesh=abstract)
  # Inside jax.set_mesh, an AbstractMesh is replaced by its concrete mesh.
  with jax.set_mesh(mesh):
    placed = ms.init_moe_params(jax.random.key(0), CFG, mesh=abstract)
  assert placed.experts.gate_EDF.sharding == params.experts.gate_EDF.sharding


# --------------------------------------------------------------------------- tuple axes


@pytest.mark.parametrize("name", ["all_gather", "all_to_all"])
def test_experts_over_two_mesh_axes(name):
  # E = 8 experts over data x expert = 2 x 4 devices: one expert per device, the linear
  # device index data * 4 + expert. Forward and every gradient against the masked scan.
  fn = getattr(ms, f"moe_{name}")
  mesh = make_mesh("explicit")
  axes = (ms.DATA, ms.EXPERT)
  x_TD, w, experts_TK, weights_TK = make_case(
    "uniform", T=16, D=D, F=F, E=E, K=K, seed=3, ffn="swiglu"
  )
  ct = cotangent((16, D), jnp.float32, seed=3)

  def run(f, *args):
    def loss(x, w, g):
      y = f(x, w, experts_TK, g)
      return jnp.sum(y * ct), y

    grads, y = jax.grad(loss, argnums=(0, 1, 2), has_aux=True)(*args)
    return y, grads

  with jax.set_mesh(mesh):
    got = jax.jit(
      lambda *a: run(lambda *b: fn(*b, expert_axis=axes), *a), compiler_options=FAST_COMPILE
    )(x_TD, w, weights_TK)
  want = run(ms.moe_masked_scan, x_TD, w, weights_TK)
  assert_tree_close(got, want, jnp.float32)
  # The weights are split over both axes, one expert per device.
  with jax.set_mesh(mesh):
    lowered = jax.jit(lambda *a: fn(*a, expert_axis=axes)).lower(x_TD, w, experts_TK, weights_TK)
  assert ("all-to-all" if name == "all_to_all" else "all-gather") in (lowered.compile().as_text())


def test_layer_with_experts_over_two_mesh_axes():
  cfg = ms.MoEConfig(
    d_model=D,
    d_ff=F,
    num_experts=E,
    top_k=K,
    gmm_impl="ragged_dot",
    expert_axis=(ms.DATA, ms.EXPERT),
  )
  mesh = make_mesh("auto")
  params = ms.init_moe_params(jax.random.key(0), cfg, mesh=mesh)
  assert params.experts.gate_EDF.sharding.spec == P((ms.DATA, ms.EXPERT), None, None)
  assert {s.data.shape[0] for s in params.experts.gate_EDF.addressable_shards} == {1}
  got = layer_fn(cfg, mesh)(params, tokens(mesh))
  want = layer_fn(cfg)(ms.init_moe_params(jax.random.key(0), cfg), tokens())
  assert_close(got, want, jnp.float32)
  with pytest.raises(
    ValueError,
    match=re.escape(
      "init_moe_params: num_experts (8) must be divisible by the ('data', 'expert') axis size (16)"
    ),
  ):
    # A 4 x 4 AbstractMesh: the divisibility check needs only its axis sizes.
    ms.init_moe_params(
      jax.random.key(0), cfg, mesh=jax.sharding.AbstractMesh((4, 4), (ms.DATA, ms.EXPERT))
    )
