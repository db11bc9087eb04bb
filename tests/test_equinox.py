"""`moe_shard.equinox.MoE` in an Equinox model: stacked blocks created with
`eqx.filter_vmap`, run with `lax.scan` over `jax.checkpoint`, trained with optax under
`eqx.filter_jit` on a 2 x 4 mesh; the losses equal the functional `moe_layer`'s and nothing
compiles after step 1."""

import contextlib
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

eqx = pytest.importorskip("equinox")
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
from moe_shard.equinox import MoE  # noqa: E402


class Block(eqx.Module):
  scale_D: jax.Array
  moe: MoE

  def __init__(self, key, mesh):
    self.scale_D = jnp.ones((D,))
    self.moe = MoE(CFG, key=key, mesh=mesh)

  def __call__(self, x_BSD):
    y_BSD, aux = self.moe(rms_norm(x_BSD) * self.scale_D)
    return x_BSD + y_BSD, aux["aux_loss"]


def make_blocks(mesh):
  """LAYERS blocks stacked on axis 0 of every array (one `lax.scan` over them)."""
  return eqx.filter_vmap(lambda key: Block(key, mesh))(jax.random.split(jax.random.key(0), LAYERS))


def forward(blocks, x_BSD):
  params, static = eqx.partition(blocks, eqx.is_array)

  def body(x_BSD, layer_params):
    return eqx.combine(layer_params, static)(x_BSD)

  x_BSD, aux_L = jax.lax.scan(jax.checkpoint(body), x_BSD, params)
  return x_BSD, jnp.sum(aux_L)


OPT = optax.adam(LEARNING_RATE)


@eqx.filter_jit
def train_step(blocks, opt_state, x_BSD, target_BSD):

  def loss_fn(blocks):
    y_BSD, aux = forward(blocks, x_BSD)
    return jnp.mean((y_BSD - target_BSD) ** 2) + aux

  loss, grads = eqx.filter_value_and_grad(loss_fn)(blocks)
  updates, opt_state = OPT.update(grads, opt_state, eqx.filter(blocks, eqx.is_array))
  return eqx.apply_updates(blocks, updates), opt_state, loss


def train(mesh, in_scope):
  """Trains; returns (blocks, losses, functional losses, compiles per step).

  The blocks and the optimizer state are created under `jax.set_mesh(mesh)`: arrays made
  with `jnp.ones`/`jnp.zeros` (the scales, optax's step count) are then replicated on the
  mesh, where the jitted step returns them; made outside, they would sit on one device and
  the second step would compile again. `in_scope`: the MoE modules take the mesh in scope
  (mesh=None) and training runs inside `jax.set_mesh` too; else they get `mesh=mesh` and
  training runs outside it.
  """
  with jax.set_mesh(mesh):
    blocks = make_blocks(None if in_scope else mesh)
    opt_state = OPT.init(eqx.filter(blocks, eqx.is_array))
  assert blocks.moe.mesh == mesh
  with jax.set_mesh(mesh) if in_scope else contextlib.nullcontext():
    losses, want, compiles = [], [], []
    for x_BSD, target_BSD in batches(mesh):
      want.append(
        float(functional_loss_jit(blocks.moe.params, blocks.scale_D, x_BSD, target_BSD, mesh))
      )
      with count_compiles() as n:
        blocks, opt_state, loss = train_step(blocks, opt_state, x_BSD, target_BSD)
        losses.append(float(loss))  # waits for the step
      compiles.append(n[0])
  return blocks, np.asarray(losses), np.asarray(want), compiles


def test_arrays_made_outside_set_mesh_sit_on_one_device():
  # Why train() creates the state under jax.set_mesh: optax's count (and jnp.ones) made
  # outside it is on one device, not on the mesh the jitted step returns it on.
  mesh = make_mesh("auto")
  params = eqx.filter(make_blocks(mesh), eqx.is_array)
  assert not isinstance(OPT.init(params)[0].count.sharding, NamedSharding)
  with jax.set_mesh(mesh):
    assert OPT.init(params)[0].count.sharding == NamedSharding(mesh, P())


@pytest.fixture(
  scope="module",
  params=[("auto", False), ("explicit", True)],
  ids=["auto-mesh-arg", "explicit-set_mesh"],
)
def run(request):
  kind, in_scope = request.param
  mesh = make_mesh(kind)
  return (mesh, *train(mesh, in_scope))


def test_params_are_sharded(run):
  mesh, blocks, *_ = run
  specs = ms.moe_param_specs(CFG)
  for leaf, spec in zip(
    jax.tree.leaves(blocks.moe.params), jax.tree.leaves(specs, is_leaf=lambda s: isinstance(s, P))
  ):
    want = NamedSharding(mesh, P(None, *spec))  # the stacked layer axis first
    assert leaf.sharding.is_equivalent_to(want, leaf.ndim), (leaf.sharding, want)


def test_losses_equal_the_functional_layer(run):
  _, _, losses, want, _ = run
  print("equinox losses", losses, "functional", want)
  np.testing.assert_allclose(losses, want, rtol=1e-5, atol=1e-6)
  assert losses[-1] < losses[0]


def test_no_compile_after_the_first_step(run):
  *_, compiles = run
  assert compiles[0] >= 1 and compiles[1:] == [0] * (len(compiles) - 1), compiles


def test_abstract_mesh_no_mesh_and_errors():
  mesh = make_mesh("explicit")
  abstract = eqx.filter_eval_shape(lambda: MoE(CFG, key=jax.random.key(0), mesh=mesh.abstract_mesh))
  assert abstract.mesh == mesh.abstract_mesh
  assert isinstance(abstract.params.experts.gate_EDF, jax.ShapeDtypeStruct)
  local = MoE(CFG, key=jax.random.key(0))
  assert local.mesh is None
  x_BSD = jnp.ones((2, 4, D))
  np.testing.assert_array_equal(local(x_BSD)[0], ms.moe_layer(local.params, x_BSD, CFG)[0])
  with pytest.raises(
    TypeError,
    match=r"^moe_shard\.equinox\.MoE: mesh must be a "
    r"jax\.sharding\.Mesh, an AbstractMesh or None \(got str\)",
  ):
    MoE(CFG, key=jax.random.key(0), mesh="mesh")


def test_from_params_wraps_given_params():
  # A module around given parameters (as from a checkpoint) computes what moe_layer does
  # with them, and keeps the arrays themselves.
  mesh = make_mesh("auto")
  params = ms.init_moe_params(jax.random.key(7), CFG, mesh=mesh)
  moe = MoE.from_params(CFG, params, mesh=mesh)
  assert moe.mesh == mesh
  assert all(a is b for a, b in zip(jax.tree.leaves(moe.params), jax.tree.leaves(params)))
  x_BSD = jax.random.normal(jax.random.key(1), (4, 4, D))
  np.testing.assert_array_equal(moe(x_BSD)[0], ms.moe_layer(params, x_BSD, CFG, mesh=mesh)[0])
  bad = dataclasses.replace(params, router_DE=params.router_DE[:, :4])
  with pytest.raises(
    ValueError,
    match=r"^moe_shard\.equinox\.MoE\.from_params: params\.router_DE must have shape \(8, 8\)",
  ):
    MoE.from_params(CFG, bad, mesh=mesh)
