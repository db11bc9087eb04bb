"""`moe_shard.nnx.MoE` in a Flax NNX model: stacked blocks created with `nnx.vmap`, run with
`nnx.scan` and `nnx.remat`, trained with `nnx.Optimizer` under `nnx.jit` on a 2 x 4 mesh;
the losses equal the functional `moe_layer`'s, nothing compiles after step 1, and the
sharded state survives an orbax round trip."""

import dataclasses
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

nnx = pytest.importorskip("flax.nnx")
optax = pytest.importorskip("optax")

from tiny_model import (  # noqa: E402
  CFG,
  LAYERS,
  LEARNING_RATE,
  D,
  batches,
  count_compiles,
  functional_loss_jit,
  make_mesh,
  rms_norm,
)

import moe_shard as ms  # noqa: E402
from moe_shard.nnx import MoE, RouterBias  # noqa: E402

SCAN_METADATA = {nnx.PARTITION_NAME: None}  # the layer axis is not split


class Block(nnx.Module):
  def __init__(self, rngs, mesh):
    self.scale_D = nnx.Param(jnp.ones((D,)), out_sharding=P(None), eager_sharding=False)
    self.moe = MoE(CFG, rngs=rngs, mesh=mesh)

  def __call__(self, x_BSD):
    y_BSD, aux = self.moe(rms_norm(x_BSD) * self.scale_D[...])
    return x_BSD + y_BSD, aux["aux_loss"]


class Model(nnx.Module):
  def __init__(self, rngs, mesh=None):

    @nnx.split_rngs(splits=LAYERS)
    @nnx.vmap(in_axes=(0,), out_axes=0, transform_metadata=SCAN_METADATA)
    def blocks(rngs):
      return Block(rngs, mesh)

    self.blocks = blocks(rngs)

  def __call__(self, x_BSD):

    @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=(nnx.Carry, 0), transform_metadata=SCAN_METADATA)
    @nnx.remat
    def body(x_BSD, block):
      return block(x_BSD)

    x_BSD, aux_L = body(x_BSD, self.blocks)
    return x_BSD, jnp.sum(aux_L)


@nnx.jit
def train_step(model, optimizer, x_BSD, target_BSD):

  def loss_fn(model):
    y_BSD, aux = model(x_BSD)
    return jnp.mean((y_BSD - target_BSD) ** 2) + aux

  loss, grads = nnx.value_and_grad(loss_fn)(model)
  optimizer.update(model, grads)
  return loss


def train(mesh, in_scope):
  """Trains; returns (model, losses, functional losses, compiles per step).

  The model and optimizer are created under `jax.set_mesh(mesh)`: arrays made with
  `jnp.ones`/`jnp.zeros` (the scales, optax's step count) are then replicated on the mesh,
  where the jitted step returns them; made outside, they would sit on one device and the
  second step would compile again. `in_scope`: the MoE modules take the mesh in scope
  (mesh=None) and training runs inside `jax.set_mesh` too; else they get `mesh=mesh` and
  training runs outside it.
  """
  with jax.set_mesh(mesh):
    model = Model(nnx.Rngs(0), None if in_scope else mesh)
    optimizer = nnx.Optimizer(model, optax.adam(LEARNING_RATE), wrt=nnx.Param)
  assert model.blocks.moe.mesh == mesh
  if in_scope:
    with jax.set_mesh(mesh):
      return _train(model, optimizer, mesh)
  return _train(model, optimizer, mesh)


def _train(model, optimizer, mesh):
  losses, want, compiles = [], [], []
  for x_BSD, target_BSD in batches(mesh):
    want.append(
      float(
        functional_loss_jit(
          model.blocks.moe.moe_params(), model.blocks.scale_D[...], x_BSD, target_BSD, mesh
        )
      )
    )
    with count_compiles() as n:
      losses.append(float(train_step(model, optimizer, x_BSD, target_BSD)))  # waits
    compiles.append(n[0])
  return model, np.asarray(losses), np.asarray(want), compiles


@pytest.fixture(
  scope="module",
  params=[("auto", False), ("explicit", True)],
  ids=["auto-mesh-arg", "explicit-set_mesh"],
)
def run(request):
  kind, in_scope = request.param
  mesh = make_mesh(kind)
  return (mesh, in_scope, *train(mesh, in_scope))


def test_params_are_sharded_with_partition_metadata(run):
  mesh, _, model, *_ = run
  state = nnx.state(model, nnx.Param)
  specs = nnx.get_partition_spec(state)
  # The layer axis (nnx.vmap) first, then moe_param_specs: one entry per dimension.
  assert specs["blocks"]["moe"]["experts"]["gate_EDF"].get_value() == P(None, ms.EXPERT, None, None)
  assert specs["blocks"]["moe"]["router_DE"].get_value() == P(None, None, None)
  for path, var in nnx.to_flat_state(state):
    spec = nnx.get_partition_spec(var).get_value()
    assert len(spec) == var.get_value().ndim, path
    if path[1] == "moe":
      assert var.get_value().sharding.is_equivalent_to(NamedSharding(mesh, spec), len(spec)), path


def test_losses_equal_the_functional_layer(run):
  *_, losses, want, _ = run
  print("nnx losses", losses, "functional", want)
  # The same float32 program traced two ways (nnx.scan + nnx.remat vs lax.scan +
  # jax.checkpoint): equal up to XLA's fusion choices.
  np.testing.assert_allclose(losses, want, rtol=1e-5, atol=1e-6)
  assert losses[-1] < losses[0]


def test_no_compile_after_the_first_step(run):
  *_, compiles = run
  assert compiles[0] >= 1 and compiles[1:] == [0] * (len(compiles) - 1), compiles


def test_orbax_round_trip_keeps_values_and_shardings(run, tmp_path):
  ocp = pytest.importorskip("orbax.checkpoint")
  mesh, _, model, *_ = run
  _, state = nnx.split(model)
  checkpointer = ocp.StandardCheckpointer()
  checkpointer.save(tmp_path / "state", state)
  checkpointer.wait_until_finished()
  # The restore target: shapes from nnx.eval_shape, shardings from the partition metadata.
  abstract_model = nnx.eval_shape(lambda: Model(nnx.Rngs(1), mesh))
  graphdef, abstract_state = nnx.split(abstract_model)
  shardings = nnx.get_named_sharding(abstract_state, mesh)
  target = jax.tree.map(
    lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract_state, shardings
  )
  restored = nnx.merge(graphdef, checkpointer.restore(tmp_path / "state", target))
  for (path, want), (_, got) in zip(
    nnx.to_flat_state(nnx.state(model)), nnx.to_flat_state(nnx.state(restored))
  ):
    want, got = want.get_value(), got.get_value()
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want), err_msg=str(path))
    assert got.sharding.is_equivalent_to(want.sharding, want.ndim), path


def test_importing_moe_shard_does_not_import_flax():
  import subprocess

  code = "import moe_shard, sys; print('flax' in sys.modules, 'equinox' in sys.modules)"
  out = subprocess.run(
    [sys.executable, "-c", code],
    capture_output=True,
    text=True,
    check=True,
    cwd=str(__import__("pathlib").Path(ms.__file__).parents[1]),
  )
  assert out.stdout.split() == ["False", "False"]


def test_abstract_mesh_no_mesh_and_errors():
  mesh = make_mesh("explicit")
  # nnx.eval_shape with an AbstractMesh: shapes and partition metadata, no arrays.
  abstract = nnx.eval_shape(lambda: MoE(CFG, rngs=nnx.Rngs(0), mesh=mesh.abstract_mesh))
  assert abstract.mesh == mesh.abstract_mesh
  assert nnx.get_partition_spec(abstract.experts.gate_EDF).get_value() == P(ms.EXPERT, None, None)
  assert isinstance(abstract.experts.gate_EDF.get_value(), jax.ShapeDtypeStruct)
  # No mesh given and none in scope: the local layer.
  local = MoE(CFG, rngs=nnx.Rngs(0))
  assert local.mesh is None
  x_BSD = jnp.ones((2, 4, D))
  y_BSD, _ = local(x_BSD)
  np.testing.assert_array_equal(y_BSD, ms.moe_layer(local.moe_params(), x_BSD, CFG)[0])
  with pytest.raises(TypeError, match=r"^moe_shard\.nnx\.MoE: cfg must be a MoEConfig"):
    MoE(dict(d_model=D), rngs=nnx.Rngs(0))
  with pytest.raises(
    ValueError,
    match=r"^moe_shard\.nnx\.MoE: mesh must have the expert "
    r"axis 'ep'",
  ):
    MoE(dataclasses.replace(CFG, expert_axis="ep"), rngs=nnx.Rngs(0), mesh=mesh)


def test_from_params_wraps_given_params():
  # A module around given parameters (as from a checkpoint) computes what moe_layer does
  # with them, and keeps the arrays themselves; RouterBias holds the balancing bias.
  mesh = make_mesh("auto")
  cfg = dataclasses.replace(CFG, bias_balancing=True)
  params = ms.init_moe_params(jax.random.key(7), cfg, mesh=mesh)
  moe = MoE.from_params(cfg, params, mesh=mesh)
  assert moe.mesh == mesh and moe.experts.gate_EDF.get_value() is params.experts.gate_EDF
  assert isinstance(moe.router_bias, RouterBias)
  assert nnx.get_partition_spec(moe.experts.gate_EDF).get_value() == P(ms.EXPERT, None, None)
  x_BSD = jax.random.normal(jax.random.key(1), (4, 4, D))
  np.testing.assert_array_equal(moe(x_BSD)[0], ms.moe_layer(params, x_BSD, cfg, mesh=mesh)[0])
  bad = dataclasses.replace(params, router_DE=params.router_DE[:, :4])
  with pytest.raises(
    ValueError,
    match=r"^moe_shard\.nnx\.MoE\.from_params: params\.router_DE must have shape \(8, 8\)",
  ):
    MoE.from_params(cfg, bad, mesh=mesh)
  with pytest.raises(TypeError, match=r"^moe_shard\.nnx\.MoE\.from_params: params must be"):
    MoE.from_params(cfg, dict(router_DE=params.router_DE), mesh=mesh)
