"""Slot-major parameters around the layer: the conversion helpers and the frameworks.

On `jax.make_mesh`'s default (Explicit) 2x4 mesh, E = 8 experts over S = 12 slots:

  * gradients through `replicate_experts` (logical and between placements) and
    `logical_params` keep the slot convention: the logical run's gradient, every slot of an
    expert holding the expert's whole gradient;
  * slot parameters are tied to their placement: another placement of the same S is refused
    by every function that knows it on the host;
  * bfloat16 gradients of an expert with 25 replicas are summed in float32 (no worse than
    the logical bfloat16 gradient against float32) and float64 ones in float64, on every
    path that sums replicas;
  * stacked slots: a layer taken with `layer_slots` (a plain slice is refused), layers of
    different placements stacked with `stack_slots`, layers of one placement stacked by
    `jax.tree.map`; an orbax checkpoint of slots restored into a target made for the
    placement saved beside it; optax labels given as the `trainable_mask` function;
  * `trainable_mask` / `split_trainable`, `eqx.partition`, `optax.multi_transform` on
    `SlotParams`, and `move_replicas` on a state whose slot parameters hold no expert leaves;
  * the helpers without `mesh=` outside `jax.set_mesh`, on arrays of an Explicit mesh;
    stacked layers (a scanned model); `LoadWindow.record` inside jit; `hf.save_moe_layers`;
  * NNX: the optimizer state of another module with the same path ending stays; quantized
    experts with a bias and adapters move with their optimizer state.
"""

import contextlib
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from test_skew import PLACEMENTS, E

import moe_shard as ms

S, N = 12, 4
CFG = ms.MoEConfig(
  d_model=16, d_ff=32, num_experts=E, top_k=2, impl="all_to_all", gmm_impl="ragged_dot"
)


def _placement(name):
  return ms.Placement.from_phy2log(np.array(PLACEMENTS[name]), E)


A, B = _placement("one_hot"), _placement("one_chip")


@pytest.fixture(scope="module")
def mesh():
  return jax.make_mesh((2, N), ("data", "expert"))  # the default: Explicit axes


@pytest.fixture(scope="module")
def setup(mesh):
  params = ms.init_moe_params(jax.random.key(0), CFG, mesh=mesh)
  with jax.set_mesh(mesh):
    x = jax.random.normal(jax.random.key(1), (8, 2, CFG.d_model))
    ct = jax.random.normal(jax.random.key(2), (8, 2, CFG.d_model))
  return params, x, ct


@pytest.fixture(scope="module")
def grads(mesh, setup):
  """The compiled gradients: logical, through replicate_experts, and of the slots."""
  params, x, ct = setup

  def loss(p, placement):
    y, aux = ms.moe_layer(p, x, CFG, mesh, placement=placement)
    return jnp.sum(y * ct) + aux["aux_loss"]

  with jax.set_mesh(mesh):
    logical = jax.jit(jax.grad(lambda p: loss(p, None)))(params)
    through = jax.jit(jax.grad(lambda p: loss(ms.replicate_experts(p, A, mesh=mesh), A)))(params)
    slots_a = ms.replicate_experts(params, A, mesh=mesh)
    moved = lambda s: ms.replicate_experts(s, B, mesh=mesh, previous=A)
    between = jax.jit(jax.grad(lambda s: loss(moved(s), B)))(slots_a)
  return dict(logical=logical, through=through, between=between, slots_a=slots_a)


def _close(got, want, rtol=2e-5, atol=2e-6):
  for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
    np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=rtol, atol=atol)


def test_grad_through_replicate_experts_is_the_logical_gradient(grads):
  # The tie gives each slot the whole gradient; replicate_experts' rule takes the mean of
  # its expert's slots (the gather's transpose alone would add the replicas again).
  _close(grads["through"], grads["logical"])


def test_grad_through_a_move_gives_every_old_slot_its_experts_gradient(grads):
  phy2log = np.asarray(A.phy2log)
  want = jax.tree.map(lambda g: np.asarray(g)[phy2log], grads["logical"].experts)
  _close(grads["between"].experts, want)
  _close(grads["between"].router_DE, grads["logical"].router_DE)


def test_a_term_on_logical_params_reaches_every_slot(mesh, grads):
  # An L2 penalty on the logical experts: every slot of expert e gets 2 * w_e, so the
  # replicas stay equal (it reached only each expert's first slot).
  slots = grads["slots_a"]
  with jax.set_mesh(mesh):
    penalty = lambda s: sum(
      jnp.sum(a**2) for a in jax.tree.leaves(ms.logical_params(s, A, mesh=mesh).experts)
    )
    got = jax.jit(jax.grad(penalty))(slots)
  _close(got.experts, jax.tree.map(lambda w: 2 * np.asarray(w), slots.experts))


def test_slots_are_refused_with_another_placement(mesh, setup, grads):
  _, x, _ = setup
  slots = grads["slots_a"]
  assert slots.placement_id == ms.slot_moves.placement_id(A) != ms.slot_moves.placement_id(B)
  rule = r"placement must be the placement the SlotParams were made for.*fingerprint"
  with jax.set_mesh(mesh):
    with pytest.raises(ValueError, match=r"moe_layer: " + rule):
      ms.moe_layer(slots, x, CFG, mesh, placement=B)
    with pytest.raises(ValueError, match=r"logical_params: " + rule):
      ms.logical_params(slots, B, mesh=mesh)
    with pytest.raises(ValueError, match=r"logical_global_norm: " + rule):
      ms.logical_global_norm(slots, B)
    with pytest.raises(
      ValueError,
      match=r"replicate_experts: previous must be the placement.*"
      r"pass the placement the slots were made for as previous=$",
    ):
      ms.replicate_experts(slots, A, mesh=mesh, previous=B)
    with pytest.raises(ValueError, match=r"replicate_experts: previous must be the placement"):
      ms.move_replicas((slots, {"mu": slots}), A, previous=B, mesh=mesh)
    # Their own placement, and a placement traced inside jit (nothing known to check), pass.
    assert float(ms.logical_global_norm(slots, A)) > 0
    arrays = tuple(jnp.asarray(a) for a in (A.phy2log, A.log2phy, A.logcnt))
    norm = jax.jit(lambda s, arrays: ms.logical_global_norm(s, ms.Placement(*arrays)))
    np.testing.assert_allclose(norm(slots, arrays), ms.logical_global_norm(slots, A), rtol=1e-6)
    # Gradients and optimizer moments carry the placement; moved, the new one.
    assert grads["between"].placement_id == slots.placement_id
    state = optax.adam(1e-2).init(slots)
    moved = ms.move_replicas(state, B, previous=A, mesh=mesh)
    assert moved[0].mu.placement_id == ms.slot_moves.placement_id(B)


# Expert 0 in 25 of 32 slots and the router sending it most items: its slot gradient is the
# sum of 25 replicas' gradients, summed in float32 (float64 under x64) and rounded once.
MANY = np.array([0] * 6 + [1, 2] + [0] * 6 + [3, 4] + [0] * 6 + [5, 6] + [0] * 7 + [7])
# The replica sums' paths: the tie on a mesh (`_sum_replicas`), logical parameters on a
# placement (the fetch's backward), the tie on one device (a segment sum), and (x64 only)
# the gradient through replicate_experts (the mean over an expert's slots).
SUM_PATHS = ["slot params, mesh", "logical params, mesh", "slot params, one device"]


def _setting(path, mesh, cfg):
  """(mesh, cfg) of `path`: no mesh and the one-device dispatch for the one-device sum."""
  if path == "slot params, one device":
    return None, dataclasses.replace(cfg, impl="ragged_dot")
  return mesh, cfg


def _expert0_grad(path, mesh, cfg, dtype, logical=False):
  """Expert 0's gate gradient [D, F] in float64, with parameters in `dtype` (the router
  leaning to expert 0): on `path`, or (`logical`) the logical run in `path`'s setting."""
  many = ms.Placement.from_phy2log(MANY, E)
  mesh, cfg = _setting(path, mesh, cfg)
  wide = jnp.promote_types(dtype, jnp.float32)  # the weights drawn in it, then rounded
  path = None if logical else path
  with jax.set_mesh(mesh) if mesh is not None else contextlib.nullcontext():
    p = ms.init_moe_params(jax.random.key(3), dataclasses.replace(cfg, param_dtype=wide), mesh=mesh)
    p = dataclasses.replace(p, router_DE=p.router_DE.at[:, 0].add(1.0))
    p = jax.tree.map(lambda a: a.astype(dtype), p)
    cfg = dataclasses.replace(cfg, param_dtype=dtype)
    x = jax.random.normal(jax.random.key(4), (32, 8, cfg.d_model), wide).astype(dtype)
    ct = jax.random.normal(jax.random.key(5), x.shape, wide)
    placement = None if path is None else many
    if path == "through replicate_experts":
      prepare = lambda p: ms.replicate_experts(p, many, mesh=mesh)
    else:
      prepare = lambda p: p
      if path is not None and path.startswith("slot params"):
        p = ms.replicate_experts(p, many, mesh=mesh)

    def loss(p):
      y, _ = ms.moe_layer(prepare(p), x, cfg, mesh, placement=placement)
      return jnp.sum(y.astype(ct.dtype) * ct)

    gate = np.asarray(jax.jit(jax.grad(loss))(p).experts.gate_EDF, np.float64)
  if path is not None and path.startswith("slot params"):  # every replica: the same sum
    np.testing.assert_array_equal(gate[MANY == 0], np.broadcast_to(gate[0], (25,) + gate.shape[1:]))
  return gate[0]


@pytest.mark.parametrize("path", SUM_PATHS)
def test_bfloat16_replica_sums_are_as_exact_as_the_logical_gradient(mesh, path):
  cfg = dataclasses.replace(CFG, d_model=32, d_ff=64)
  want = _expert0_grad(path, mesh, cfg, jnp.float32, logical=True)
  err_logical = np.linalg.norm(_expert0_grad(path, mesh, cfg, jnp.bfloat16, logical=True) - want)
  err_path = np.linalg.norm(_expert0_grad(path, mesh, cfg, jnp.bfloat16) - want)
  print(f"bf16 error against float32: {path} {err_path:.3e}, logical {err_logical:.3e}")
  assert err_path <= 1.1 * err_logical, (err_path, err_logical)


@pytest.mark.parametrize("path", SUM_PATHS + ["through replicate_experts"])
def test_float64_replica_sums_stay_float64(mesh, path):
  # Under x64 the replica sums (and the mean over an expert's slots) are float64: rounded
  # to float32 they were about 1e-7 off the logical float64 gradient.
  with jax.enable_x64(True):
    want = _expert0_grad(path, mesh, CFG, jnp.float64, logical=True)
    got = _expert0_grad(path, mesh, CFG, jnp.float64)
  err = np.linalg.norm(got - want) / np.linalg.norm(want)
  assert err < 1e-12, (path, err)


def _quantized_adapters(mesh, cfg):
  params = ms.init_moe_params(jax.random.key(0), cfg, mesh=mesh)
  params = ms.quantize_experts(params, "int8")
  return ms.add_adapters(params, rank=2, key=jax.random.key(1), targets=("gate_EDF",))


def test_trainable_mask_and_optimizers_on_slot_params(mesh):
  eqx = pytest.importorskip("equinox")
  with jax.set_mesh(mesh):
    slots = ms.replicate_experts(_quantized_adapters(mesh, CFG), A, mesh=mesh)
    mask = ms.trainable_mask(slots)
    assert isinstance(mask, ms.SlotParams) and mask.placement_id == slots.placement_id
    trainable, frozen = ms.split_trainable(slots)
    assert jax.tree.structure(ms.merge_trainable(trainable, frozen)) == jax.tree.structure(slots)
    assert jax.tree.structure(eqx.partition(slots, mask)[0]) == jax.tree.structure(trainable)
    tx = optax.multi_transform({True: optax.adam(1e-2), False: optax.set_to_zero()}, mask)
    state = tx.init(slots)
    updates, state = tx.update(jax.tree.map(jnp.zeros_like, slots), state, slots)
    assert jax.tree.structure(updates) == jax.tree.structure(slots)


def test_grad_through_replicate_experts_with_frozen_quantized_experts(mesh, setup):
  # int8 experts (frozen) with an expert bias and adapters on gate (trained): the trained
  # leaves get the logical gradient through replicate_experts, the frozen ones none.
  _, x, _ = setup
  cfg = dataclasses.replace(CFG, expert_bias=True)
  with jax.set_mesh(mesh):
    params = _quantized_adapters(mesh, cfg)
    gate = params.experts.gate_EDF
    gate = dataclasses.replace(gate, b=gate.b + 0.1)  # b = 0 would hide a's gradient
    params = dataclasses.replace(params, experts=dataclasses.replace(params.experts, gate_EDF=gate))
    trainable, frozen = ms.split_trainable(params)

    def loss(t, placement):
      p = ms.merge_trainable(t, frozen)
      p = p if placement is None else ms.replicate_experts(p, placement, mesh=mesh)
      return jnp.sum(ms.moe_layer(p, x, cfg, mesh, placement=placement)[0] ** 2)

    got = jax.jit(jax.grad(lambda t: loss(t, A)))(trainable)
    want = jax.jit(jax.grad(lambda t: loss(t, None)))(trainable)
  _close(got, want, 2e-4, 2e-5)


def test_move_replicas_passes_slot_states_with_no_expert_leaves(mesh, grads):
  # The experts frozen under optax.multi_transform: the optimizer's SlotParams hold no
  # expert leaves; move_replicas passes them through with the new placement's fingerprint.
  slots = grads["slots_a"]
  labels = lambda p: dataclasses.replace(jax.tree.map(lambda _: False, p), router_DE=True)
  tx = optax.multi_transform({True: optax.adam(1e-2), False: optax.set_to_zero()}, labels)
  with jax.set_mesh(mesh):
    moved = ms.move_replicas((slots, tx.init(slots)), B, previous=A, mesh=mesh)
    fresh = tx.init(moved[0])
  assert jax.tree.structure(moved[1]) == jax.tree.structure(fresh)
  _close(moved[1], fresh, 0, 0)


def test_helpers_without_a_mesh_take_the_arrays_mesh(mesh, setup):
  # Outside jax.set_mesh, no mesh=: the arrays' own (Explicit) mesh, not the default device.
  params, _, _ = setup
  slots = ms.replicate_experts(params, A)
  gate = slots.experts.gate_EDF
  assert gate.sharding.spec[0] == "expert" and gate.sharding.mesh == mesh
  np.testing.assert_array_equal(gate, np.asarray(params.experts.gate_EDF)[np.asarray(A.phy2log)])
  moved = ms.move_replicas(slots, B, previous=A)
  np.testing.assert_array_equal(
    moved.experts.gate_EDF, np.asarray(params.experts.gate_EDF)[np.asarray(B.phy2log)]
  )
  back = ms.logical_params(moved, B)
  np.testing.assert_array_equal(back.experts.gate_EDF, params.experts.gate_EDF)


def test_stacked_layers_move_and_scan(mesh):
  # Two layers stacked ([L, ...], a scanned model) on a placement of two layers.
  layers = [ms.init_moe_params(jax.random.key(i), CFG, mesh=mesh) for i in range(2)]
  stack = jax.tree.map(lambda *a: jnp.stack(a), *layers)
  two = ms.Placement.from_phy2log(np.stack([PLACEMENTS["one_hot"], PLACEMENTS["one_chip"]]), E)
  other = ms.Placement.from_phy2log(np.stack([PLACEMENTS["only_replicas"]] * 2), E)
  with jax.set_mesh(mesh):
    slots = ms.replicate_experts(stack, two, mesh=mesh)
    for i in range(2):
      one = ms.replicate_experts(layers[i], two[i], mesh=mesh)
      _close(jax.tree.map(lambda a, i=i: a[i], slots.experts), one.experts, 0, 0)
    x = jax.random.normal(jax.random.key(1), (8, 2, CFG.d_model))

    def run(params, placement):
      def layer(x, args):
        p, pl = args
        return ms.moe_layer(p, x, CFG, mesh, placement=pl)[0], None

      return jax.lax.scan(layer, x, (params, placement))[0]

    y = jax.jit(run)(slots, two)
    y_logical = jax.jit(
      lambda p: jax.lax.scan(lambda x, p: (ms.moe_layer(p, x, CFG, mesh)[0], None), x, p)[0]
    )(stack)
    _close(y, y_logical, 1e-5, 1e-5)
    moved = ms.move_replicas(slots, other, previous=two, mesh=mesh)
    back = ms.logical_params(moved, other, mesh=mesh)
  _close(back, stack, 0, 0)


def test_a_layer_of_stacked_slots_takes_its_own_placement(mesh):
  # A layer sliced with jax.tree.map keeps the fingerprints of every layer: refused on a
  # one-layer placement (any layer's was accepted); ms.layer_slots takes layer i's.
  layers = [ms.init_moe_params(jax.random.key(i), CFG, mesh=mesh) for i in range(2)]
  two = ms.Placement.from_phy2log(np.stack([PLACEMENTS["one_hot"], PLACEMENTS["one_chip"]]), E)
  with jax.set_mesh(mesh):
    slots = ms.replicate_experts(jax.tree.map(lambda *a: jnp.stack(a), *layers), two, mesh=mesh)
    x = jax.random.normal(jax.random.key(1), (8, 2, CFG.d_model))
    sliced = jax.tree.map(lambda a: a[0], slots)
    for i in range(2):
      with pytest.raises(
        ValueError,
        match=r"moe_layer: params must be the slots of one layer.*"
        r"stack of 2 layers.*ms.layer_slots\(params, i\)",
      ):
        ms.moe_layer(sliced, x, CFG, mesh, placement=two[i])
    for i in range(2):
      layer = ms.layer_slots(slots, i)
      assert layer.placement_id == ms.slot_moves.placement_id(two[i])
      y = ms.moe_layer(layer, x, CFG, mesh, placement=two[i])[0]
      _close(y, ms.moe_layer(layers[i], x, CFG, mesh)[0], 1e-5, 1e-5)
      with pytest.raises(ValueError, match=r"moe_layer: placement must be the placement"):
        ms.moe_layer(layer, x, CFG, mesh, placement=two[1 - i])
    with pytest.raises(ValueError, match=r"layer_slots: i must be a layer of the 2"):
      ms.layer_slots(slots, 2)


def test_stacked_layers_of_one_placement_and_of_several(mesh):
  # Layers of one placement stacked with jax.tree.map carry its single fingerprint: the
  # placement of L layers that is it in each layer is theirs (it was refused).
  layers = [ms.init_moe_params(jax.random.key(i), CFG, mesh=mesh) for i in range(2)]
  stack = jax.tree.map(lambda *a: jnp.stack(a), *layers)
  two = ms.Placement.from_phy2log(np.stack([PLACEMENTS["one_hot"], PLACEMENTS["one_chip"]]), E)
  two_a = ms.Placement.from_phy2log(np.stack([PLACEMENTS["one_hot"]] * 2), E)
  with jax.set_mesh(mesh):
    per_layer = [ms.replicate_experts(p, A, mesh=mesh) for p in layers]
    stacked = jax.tree.map(lambda *a: jnp.stack(a), *per_layer)
    assert stacked.placement_id == ms.slot_moves.placement_id(A)
    _close(ms.logical_params(stacked, two_a, mesh=mesh), stack, 0, 0)
    want = ms.logical_global_norm(ms.replicate_experts(stack, two_a, mesh=mesh), two_a)
    np.testing.assert_allclose(ms.logical_global_norm(stacked, two_a), want, rtol=1e-6)
    moved = ms.move_replicas(stacked, two, previous=two_a, mesh=mesh)
    _close(ms.logical_params(moved, two, mesh=mesh), stack, 0, 0)
    with pytest.raises(ValueError, match=r"logical_params: placement must be the placement"):
      ms.logical_params(stacked, two, mesh=mesh)  # layer 1 is not A
    # Layers of different placements: jax.tree.map refuses them (their fingerprints are
    # pytree structure); ms.stack_slots stacks them with a fingerprint per layer.
    mixed = [ms.replicate_experts(p, two[i], mesh=mesh) for i, p in enumerate(layers)]
    with pytest.raises(ValueError):
      jax.tree.map(lambda *a: jnp.stack(a), *mixed)
    both = ms.stack_slots(mixed)
    assert both.placement_id == ms.slot_moves.placement_id(two)
    _close(ms.logical_params(both, two, mesh=mesh), stack, 0, 0)
    with pytest.raises(TypeError, match=r"stack_slots: layers must be SlotParams of one layer"):
      ms.stack_slots([both, both])


def test_load_window_record_inside_jit_is_named():
  window = ms.LoadWindow(num_experts=E)
  with pytest.raises(TypeError, match=r"LoadWindow.record: .*runs on the host"):
    jax.jit(window.record)(jnp.ones(E, jnp.int32))


def test_save_moe_layers_refuses_slot_params(tmp_path, mesh, setup):
  from moe_shard import hf

  params, _, _ = setup
  slots = ms.replicate_experts(params, A, mesh=mesh)
  with pytest.raises(TypeError, match=r"save_moe_layers: .*SlotParams.*logical_params"):
    hf.save_moe_layers(tmp_path / "out", CFG, slots, like=tmp_path / "like")


def test_nnx_moves_only_its_own_modules_optimizer_state(mesh):
  nnx = pytest.importorskip("flax.nnx")
  from moe_shard.nnx import MoE

  class Inner(nnx.Module):
    def __init__(self):
      self.moe = MoE(CFG, rngs=nnx.Rngs(1), mesh=mesh)

  class Model(nnx.Module):
    def __init__(self):
      self.moe = MoE(CFG, rngs=nnx.Rngs(0), mesh=mesh)
      self.sub = Inner()

  with jax.set_mesh(mesh):
    model = Model()
    optimizer = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)
    model.moe.replicate_experts(A, optimizer=optimizer, model=model)
  mu = optimizer.opt_state[0].mu
  assert mu["moe"]["experts"]["gate_EDF"][...].shape[0] == S
  assert mu["sub"]["moe"]["experts"]["gate_EDF"][...].shape[0] == E  # another module's


def test_nnx_quantized_experts_with_bias_and_adapters_move_their_state(mesh):
  nnx = pytest.importorskip("flax.nnx")
  from moe_shard.nnx import MoE

  cfg = dataclasses.replace(CFG, expert_bias=True)
  with jax.set_mesh(mesh):
    moe = MoE.from_params(cfg, _quantized_adapters(mesh, cfg), mesh=mesh)
    optimizer = nnx.Optimizer(moe, optax.adam(1e-2), wrt=nnx.Param)
    moe.replicate_experts(A, optimizer=optimizer, model=moe)
    moe.replicate_experts(B, previous=A, optimizer=optimizer, model=moe)
  experts = optimizer.opt_state[0].mu["experts"]
  is_var = lambda v: isinstance(v, nnx.Variable)
  leaves = jax.tree_util.tree_leaves_with_path(experts, is_leaf=is_var)
  shapes = {jax.tree_util.keystr(k): v[...].shape[0] for k, v in leaves}
  assert shapes and set(shapes.values()) == {S}, shapes
  assert moe.experts.gate_EDF.w.values[...].shape[0] == S


def test_orbax_checkpoint_of_slots_is_saved_with_its_placement(tmp_path, mesh, setup, grads):
  # orbax stores the arrays, not the static fingerprint: the restored SlotParams take the
  # target's. So the placement's phy2log is saved beside the checkpoint and the target is
  # made for it; a target made for another placement would relabel the slots silently.
  ocp = pytest.importorskip("orbax.checkpoint")
  params, x, _ = setup
  slots = grads["slots_a"]
  checkpointer = ocp.StandardCheckpointer()
  checkpointer.save(tmp_path / "slots", slots)
  checkpointer.wait_until_finished()
  np.save(tmp_path / "phy2log.npy", np.asarray(A.phy2log))

  like = lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding)
  fresh = ms.init_moe_params(jax.random.key(7), CFG, mesh=mesh)  # a restarted run's
  placement = ms.Placement.from_phy2log(np.load(tmp_path / "phy2log.npy"), E)
  with jax.set_mesh(mesh):
    target = jax.tree.map(like, ms.replicate_experts(fresh, placement, mesh=mesh))
    restored = checkpointer.restore(tmp_path / "slots", target)
    assert restored.placement_id == slots.placement_id
    _close(restored, slots, 0, 0)
    y = ms.moe_layer(restored, x, CFG, mesh, placement=placement)[0]
    _close(y, ms.moe_layer(params, x, CFG, mesh)[0], 1e-5, 1e-5)
    # The hazard: a target of another placement takes A's slots as B's, with no error.
    wrong = jax.tree.map(like, ms.replicate_experts(fresh, B, mesh=mesh))
    relabelled = checkpointer.restore(tmp_path / "slots", wrong)
  assert relabelled.placement_id == ms.slot_moves.placement_id(B)
  _close(relabelled.experts, slots.experts, 0, 0)


def test_trainable_mask_as_a_function_survives_a_move(mesh):
  # optax's labels and masks given as the function ms.trainable_mask are made from the
  # parameters each step; a tree made before a move has the old placement's fingerprint.
  with jax.set_mesh(mesh):
    slots = ms.replicate_experts(_quantized_adapters(mesh, CFG), A, mesh=mesh)
    fixed = ms.trainable_mask(slots)
    txs = {
      "multi_transform": lambda labels: optax.multi_transform(
        {True: optax.adam(1e-2), False: optax.set_to_zero()}, labels
      ),
      "masked": lambda mask: optax.masked(optax.add_decayed_weights(1e-2), mask),
    }
    for name, make in txs.items():
      for labels in (ms.trainable_mask, fixed):
        tx = make(labels)
        state = tx.init(slots)
        moved, state = ms.move_replicas((slots, state), B, previous=A, mesh=mesh)
        grads = jax.tree.map(jnp.zeros_like, moved)
        if labels is fixed:  # made for A: refused after the move
          with pytest.raises(ValueError):
            tx.update(grads, state, moved)
          continue
        updates, state = tx.update(grads, state, moved)
        assert jax.tree.structure(updates) == jax.tree.structure(moved), name
