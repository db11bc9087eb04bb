"""Training on slot-major parameters: replicas that get their expert's whole gradient.

On a 2x4 Explicit mesh (`jax.make_mesh`'s default axis type), E = 8 experts over S = 12
slots (`test_skew.PLACEMENTS`: every redundant slot to one expert, an expert's replicas all
on one chip, a chip holding only replicas):

  * an Adam step on `SlotParams` is the Adam step on the logical parameters: each slot's
    gradient is its expert's (against the float64 layer model's finite differences), the
    replicas stay equal, and `logical_params` of the stepped slots equals the logical step
    (float32, the same optax) and a float64 NumPy Adam step on the model's gradients;
  * moving parameters and Adam's state to a new placement mid-training, with the recipe of
    the skew guide and with `move_replicas`, then training on, stays the logical run;
  * `logical_params`, `logical_global_norm`; the review's cases (placements made inside jit
    on the local dispatches, a user's dispatch given a placement).
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from cases import TOL, Mismatches
from test_layer_oracle import DE, EXPLICIT, _mesh, _oracle_key, _place, config, reference
from test_skew import PLACEMENTS, E

import moe_shard as ms

LR, EPS = 1e-2, 1e-3  # eps large enough that Adam's first step is smooth in the gradient


def _adam_numpy(params, grads):
  """One float64 Adam step from zero moments (optax.adam(LR, eps=EPS)'s first step)."""
  m = (1 - 0.9) * grads
  v = (1 - 0.999) * grads**2
  return params - LR * (m / (1 - 0.9)) / (np.sqrt(v / (1 - 0.999)) + EPS)


def _placement(name):
  return ms.Placement.from_phy2log(np.array(PLACEMENTS[name]), E)


def _train_step(cfg, mesh, placement, tx):
  def loss(params, x, ct):
    y, aux = ms.moe_layer(params, x, cfg, mesh, placement=placement)
    return jnp.sum(y.astype(jnp.float32) * ct) + aux["aux_loss"]

  @jax.jit
  def step(params, opt_state, x, ct):
    grads = jax.grad(loss)(params, x, ct)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, grads

  return step


def _setup(impl, **overrides):
  overrides = dict(impl=impl, gmm_impl="ragged_dot", **overrides)
  cfg = config(**overrides)
  params, x, ct, *want = reference(_oracle_key(overrides, "float32"))
  mesh = _mesh((2, 4), DE, EXPLICIT)
  params, x = _place(jax.tree.map(jnp.asarray, params), jnp.asarray(x), cfg, mesh)
  return cfg, mesh, params, x, jnp.asarray(ct), want


@pytest.mark.parametrize(
  "impl, which",
  [
    ("masked_scan", "one_hot"),
    ("ragged_dot", "one_chip"),
    ("all_gather", "only_replicas"),
    ("all_to_all", "one_hot"),
    ("ragged_all_to_all", "one_chip"),
  ],
)
def test_adam_step_on_slots_is_the_logical_step(impl, which):
  cfg, mesh, params, x, ct, want = _setup(impl)
  _, _, want_dparams, _ = want
  placement = _placement(which)
  phy2log = np.asarray(placement.phy2log)
  tx = optax.adam(LR, eps=EPS)
  with jax.set_mesh(mesh):
    slots = ms.replicate_experts(params, placement, mesh=mesh)
    new_slots, _, grads = _train_step(cfg, mesh, placement, tx)(slots, tx.init(slots), x, ct)
    new_logical, _, _ = _train_step(cfg, mesh, None, tx)(params, tx.init(params), x, ct)
    back = ms.logical_params(new_slots, placement, mesh=mesh)
  m = Mismatches(f"{impl}-{which}")
  # Each slot's gradient: its expert's whole gradient, from the float64 model.
  want_slots = jax.tree.map(lambda g: np.asarray(g)[phy2log], want_dparams.experts)
  m.close_tree(grads.experts, want_slots)
  # The replicas of each expert stay equal after the step (bit for bit).
  for leaf in jax.tree.leaves(new_slots.experts):
    leaf = np.asarray(leaf)
    for e in range(E):
      same = leaf[phy2log == e]
      np.testing.assert_array_equal(same, np.broadcast_to(same[0], same.shape))
  # Back to logical: the logical step (float32), and a float64 Adam step on the model's.
  m.close_tree(back, new_logical)
  f64 = lambda p, g: _adam_numpy(np.asarray(p, np.float64), np.asarray(g, np.float64))
  m.close_tree(back.experts, jax.tree.map(f64, params.experts, want_dparams.experts))
  m.check()


def test_moving_parameters_and_adam_state_mid_training():
  cfg, mesh, params, x, ct, _ = _setup("all_to_all")
  first, second = _placement("one_hot"), _placement("only_replicas")
  tx = optax.adam(LR, eps=EPS)
  with jax.set_mesh(mesh):
    logical, logical_state = params, tx.init(params)
    log_step = _train_step(cfg, mesh, None, tx)
    for _ in range(4):
      logical, logical_state, _ = log_step(logical, logical_state, x, ct)

    def train(move):
      slots = ms.replicate_experts(params, first, mesh=mesh)
      opt_state = tx.init(slots)
      for _ in range(2):
        slots, opt_state, _ = _train_step(cfg, mesh, first, tx)(slots, opt_state, x, ct)
      slots, opt_state = move(slots, opt_state)
      for _ in range(2):
        slots, opt_state, _ = _train_step(cfg, mesh, second, tx)(slots, opt_state, x, ct)
      return slots, opt_state

    def recipe(slots, opt_state):  # the skew guide's, as written
      moved = lambda t: ms.replicate_experts(t, second, mesh=mesh, previous=first)
      is_slots = lambda t: isinstance(t, ms.ServedParams)
      opt_state = jax.tree.map(
        lambda t: moved(t) if is_slots(t) else t, opt_state, is_leaf=is_slots
      )
      return moved(slots), opt_state

    def helper(slots, opt_state):
      return ms.move_replicas((slots, opt_state), second, previous=first, mesh=mesh)

    runs = {"recipe": train(recipe), "move_replicas": train(helper)}
  phy2log = np.asarray(second.phy2log)
  m = Mismatches("moved mid-training")
  for name, (slots, opt_state) in runs.items():
    with jax.set_mesh(mesh):
      back = ms.logical_params(slots, second, mesh=mesh)
    m.close_tree(back, logical)
    # Adam's moments moved with the slots: each slot's, its expert's.
    mu = opt_state[0].mu.experts
    want_mu = jax.tree.map(lambda a: np.asarray(a)[phy2log], logical_state[0].mu.experts)
    m.close_tree(mu, want_mu)
    assert isinstance(opt_state[0].nu, ms.SlotParams), name
  m.check()


def test_logical_params_and_norm():
  cfg, mesh, params, x, ct, _ = _setup("ragged_all_to_all")
  placement = _placement("one_chip")
  with jax.set_mesh(mesh):
    slots = ms.replicate_experts(params, placement, mesh=mesh)
    back = ms.logical_params(slots, placement, mesh=mesh)
    for got, want in zip(jax.tree.leaves(back), jax.tree.leaves(params)):
      np.testing.assert_array_equal(got, want)
    assert jax.typeof(back.experts.gate_EDF).sharding.spec[0] == "expert"
    with pytest.raises(TypeError, match=r"logical_params: params must be slot-major SlotParams"):
      ms.logical_params(params, placement, mesh=mesh)
    grads = jax.grad(lambda p: jnp.sum(ms.moe_layer(p, x, cfg, mesh, placement=placement)[0] * ct))(
      slots
    )
    norm = jax.jit(ms.logical_global_norm)(grads, placement)  # the placement traced
    want = jax.jit(optax.tree.norm)(ms.logical_params(grads, placement, mesh=mesh))
    counted_per_slot = jax.jit(optax.tree.norm)(grads)
  np.testing.assert_allclose(norm, want, rtol=1e-5)
  assert float(counted_per_slot) > float(want) * 1.01  # replicas counted once per slot there
  assert isinstance(
    ms.ServedParams(**{f.name: None for f in dataclasses.fields(ms.MoEParams)}), ms.SlotParams
  )


@pytest.mark.parametrize("impl", ["ragged_dot", "masked_scan"])
def test_placements_made_in_jit_on_local_dispatches(impl):
  # A placement computed inside jit (the per-step plan, or one built from traced arrays)
  # on a local dispatch under `jax.make_mesh`'s Explicit mesh: the replica rule runs under
  # Auto axes with the placement as an argument (closed over, it crashed).
  cfg = config(impl=impl, gmm_impl="ragged_dot", num_shared_experts=0)
  mesh = _mesh((2, 4), DE, EXPLICIT)
  params = ms.init_moe_params(jax.random.key(0), cfg, mesh=mesh)
  x = jax.random.normal(jax.random.key(1), (8, 2, cfg.d_model))
  p = _placement("one_hot")

  def traced(params, x, phy2log):
    placement = ms.replica_rule.placement_arrays(phy2log, E, 5)
    return ms.moe_layer(params, x, cfg, mesh, placement=placement)

  with jax.set_mesh(mesh):
    y_step, _ = jax.jit(lambda p, x: ms.moe_layer(p, x, cfg, mesh, placement="step"))(params, x)
    y_traced, aux_traced = jax.jit(traced)(params, x, jnp.asarray(p.phy2log))
    y, aux = jax.jit(lambda p, x: ms.moe_layer(p, x, cfg, mesh))(params, x)
  tol = TOL["float32"]
  np.testing.assert_allclose(y_step, y, **tol)
  np.testing.assert_allclose(y_traced, y, **tol)
  assert int(aux_traced["device_load"].sum()) == int(aux["expert_load"].sum())


def test_a_users_dispatch_given_a_placement_is_checked():
  def no_keywords(x_TD, ffn, experts_TK, weights_TK, *, mesh, cfg):
    return ms.DISPATCHES["masked_scan"].fn(x_TD, ffn, experts_TK, weights_TK, mesh=mesh, cfg=cfg)

  def no_slot_load(
    x_TD, ffn, experts_TK, weights_TK, *, mesh, cfg, placement=None, slot_weights=False
  ):
    y, _ = no_keywords(x_TD, ffn, experts_TK, weights_TK, mesh=mesh, cfg=cfg)
    return y, {}

  placement = _placement("one_hot")
  x = jax.random.normal(jax.random.key(1), (2, 4, 16))
  for fn, error, match in [
    (no_keywords, TypeError, r"placement= and slot_weights=.*takes no placement or slot_weights"),
    (no_slot_load, ValueError, r"stats must hold 'slot_load'.*returned \[\]"),
  ]:
    cfg = ms.MoEConfig(d_model=16, d_ff=32, num_experts=E, top_k=2, impl=fn)
    params = ms.init_moe_params(jax.random.key(0), cfg)
    with pytest.raises(error, match=match):
      ms.moe_layer(params, x, cfg, placement=placement)
    ms.moe_layer(params, x, cfg)  # without a placement both are fine


def test_flax_nnx_module_trains_on_replicas_and_moves_its_optimizer_state():
  nnx = pytest.importorskip("flax.nnx")
  from moe_shard.nnx import MoE

  cfg = config(impl="all_to_all", gmm_impl="ragged_dot", num_shared_experts=0)
  mesh = _mesh((2, 4), DE, EXPLICIT)
  first, second = _placement("one_hot"), _placement("one_chip")

  class Model(nnx.Module):
    def __init__(self):
      self.moe = MoE(cfg, rngs=nnx.Rngs(0), mesh=mesh)

  @nnx.jit
  def step(model, optimizer, x, placement):
    grads = nnx.grad(lambda m: jnp.mean(m.moe(x, placement=placement)[0] ** 2))(model)
    optimizer.update(model, grads)

  with jax.set_mesh(mesh):
    x = jax.random.normal(jax.random.key(1), (8, 2, cfg.d_model))
    runs = {}
    for replicated in (False, True):
      model = Model()
      optimizer = nnx.Optimizer(model, optax.adam(LR, eps=EPS), wrt=nnx.Param)
      placements = [None, None, None]
      if replicated:
        model.moe.replicate_experts(first, optimizer=optimizer, model=model)
        placements = [first, first, second]
      for i, placement in enumerate(placements):
        if replicated and i == 2:
          model.moe.replicate_experts(second, previous=first, optimizer=optimizer, model=model)
        step(model, optimizer, x, placement)
      runs[replicated] = model, optimizer
    back = runs[True][0].moe.logical_params(second)
    want = runs[False][0].moe.moe_params()
  m = Mismatches("nnx")
  m.close_tree(back, want)
  phy2log = np.asarray(second.phy2log)
  for name in ("mu", "nu"):
    got = getattr(runs[True][1].opt_state[0], name)["moe"]["experts"]
    ref = getattr(runs[False][1].opt_state[0], name)["moe"]["experts"]
    for key in ("gate_EDF", "up_EDF", "down_EFD"):
      m.close(got[key][...], np.asarray(ref[key][...])[phy2log], f"{name}.{key}")
  m.check()


def test_equinox_module_trains_on_replicas():
  eqx = pytest.importorskip("equinox")
  from moe_shard.equinox import MoE

  cfg = config(impl="ragged_all_to_all", gmm_impl="ragged_dot", num_shared_experts=0)
  mesh = _mesh((2, 4), DE, EXPLICIT)
  first, second = _placement("only_replicas"), _placement("one_hot")
  tx = optax.adam(LR, eps=EPS)

  @eqx.filter_jit
  def step(moe, opt_state, x, placement):
    grads = eqx.filter_grad(lambda m: jnp.mean(m(x, placement=placement)[0] ** 2))(moe)
    updates, opt_state = tx.update(grads, opt_state, eqx.filter(moe, eqx.is_array))
    return eqx.apply_updates(moe, updates), opt_state

  with jax.set_mesh(mesh):
    x = jax.random.normal(jax.random.key(1), (8, 2, cfg.d_model))
    logical = MoE(cfg, key=jax.random.key(0), mesh=mesh)
    slots = logical.replicate_experts(first)
    states = [tx.init(eqx.filter(m, eqx.is_array)) for m in (logical, slots)]
    for i in range(3):
      logical, states[0] = step(logical, states[0], x, None)
      placement = first if i < 2 else second
      if i == 2:
        states[1] = ms.move_replicas(states[1], second, previous=first, mesh=mesh)
        slots = slots.replicate_experts(second, previous=first)
      slots, states[1] = step(slots, states[1], x, placement)
    back = slots.logical_params(second)
  m = Mismatches("equinox")
  m.close_tree(back, logical.params)
  m.check()


def test_leaders_spread_over_the_devices():
  # E=8 experts of near-equal load in 24 slots on 8 devices: 3 replicas each, 16 followers.
  # Each expert's leader is its replica on the device leading the fewest followers so far:
  # 2 a device, where the first slots would give one device 3 experts' (6 followers).
  from moe_shard.parallel import replicas

  load = np.array([1000, 990, 980, 970, 960, 950, 940, 930])
  placement = ms.plan_placement(load, num_slots=24, num_devices=8)
  leader = np.asarray(replicas.leader_slots(placement, 3))
  phy2log = np.asarray(placement.phy2log)
  np.testing.assert_array_equal(phy2log[leader], phy2log)  # a replica of the same expert
  followers = leader != np.arange(24)
  per_device = np.bincount(leader[followers] // 3, minlength=8)
  assert per_device.sum() == 16 and per_device.max() == 2, per_device
  assert replicas.tie_bounds(placement, 8)[0] == per_device.max()
  _, first = np.unique(phy2log, return_index=True)
  first_leader = first[np.searchsorted(np.unique(phy2log), phy2log)]
  firsts = np.bincount(first_leader[first_leader != np.arange(24)] // 3, minlength=8).max()
  assert firsts == 6


def test_slot_major_training_on_an_expert_axis_of_one_device():
  # Explicit mesh (8, 1): the replicas' gradient sum runs on one device of the expert axis,
  # on a cotangent typed sharded over it.
  cfg = config(impl="ragged_dot", gmm_impl="ragged_dot")
  params, x, ct, _, _, want_dparams, _ = reference(_oracle_key({"impl": "ragged_dot"}, "float32"))
  mesh = _mesh((8, 1), DE, EXPLICIT)
  params, x = _place(jax.tree.map(jnp.asarray, params), jnp.asarray(x), cfg, mesh)
  placement = _placement("one_hot")
  with jax.set_mesh(mesh):
    slots = ms.replicate_experts(params, placement, mesh=mesh)

    def loss(p):
      y, aux = ms.moe_layer(p, x, cfg, mesh, placement=placement)
      return jnp.sum(y * ct) + aux["aux_loss"]

    grads = jax.jit(jax.grad(loss))(slots)
  phy2log = np.asarray(placement.phy2log)
  m = Mismatches("expert axis of one")
  m.close_tree(grads.experts, jax.tree.map(lambda g: np.asarray(g)[phy2log], want_dparams.experts))
  m.check()


def test_replica_gradient_sum_of_a_traced_placement_with_an_unplaced_expert():
  # Expert 1 has no slot and expert 0 six: 5 followers, more than S - E = 4. The tie's
  # gradient of sum(w * c) is, in every slot, the sum of c over its expert's slots.
  from jax.sharding import PartitionSpec as P

  from moe_shard.parallel import tie_replicas

  mesh = _mesh((2, 4), DE, EXPLICIT)
  phy2log = np.array([0, 7, 2, 3, 0, 4, 5, 6, 0, 0, 0, 0], np.int32)
  logcnt = np.bincount(phy2log, minlength=E).astype(np.int32)
  log2phy = np.full((E, logcnt.max()), -1, np.int32)
  for e in range(E):
    log2phy[e, : logcnt[e]] = np.flatnonzero(phy2log == e)
  c = np.random.default_rng(0).normal(size=(12, 3, 2)).astype(np.float32)
  spec = P("expert")

  @jax.jit
  def grad(w, arrays):
    placement = ms.Placement(*arrays)  # traced: checked only where it can be
    tied = lambda w: tie_replicas(w, placement, mesh=mesh, expert_axis="expert", specs=spec)
    return jax.grad(lambda w: jnp.sum(tied(w) * c))(w)

  with jax.set_mesh(mesh):
    w = jax.device_put(jnp.zeros((12, 3, 2)), jax.NamedSharding(mesh, spec))
    got = grad(w, tuple(jnp.asarray(a) for a in (phy2log, log2phy, logcnt)))
  want = np.stack([c[phy2log == phy2log[s]].sum(0) for s in range(12)])
  np.testing.assert_allclose(np.asarray(got), want, rtol=1e-6, atol=1e-6)


def test_review_checks_of_the_replica_helpers():
  placement = _placement("one_hot")
  # logical_global_norm: slots stacked over layers with a one-layer placement would mix them.
  fields = {f.name: None for f in dataclasses.fields(ms.MoEParams)}
  stacked = ms.SlotParams(**dict(fields, experts=jnp.ones((2, 12, 3))))
  with pytest.raises(ValueError, match=r"logical_global_norm: .*slot axes \(12,\).*\(2, 12, 3\)"):
    ms.logical_global_norm(stacked, placement)
  # replicate_experts: a placement traced inside jit is refused, named.
  _, mesh, params, *_ = _setup("all_to_all")
  with (
    jax.set_mesh(mesh),
    pytest.raises(TypeError, match=r"replicate_experts: placement must be known on the host"),
  ):
    jax.jit(lambda *arrays: ms.replicate_experts(params, ms.Placement(*arrays), mesh=mesh))(
      *(jnp.asarray(a) for a in (placement.phy2log, placement.log2phy, placement.logcnt))
    )
  # LoadWindow: bfloat16 loads are floats; a full window names the step the load takes.
  window = ms.LoadWindow(4, window=2)
  window.record(jnp.array([0.5, 0.25, 0.125, 0.125], jnp.bfloat16))
  window.record(np.array([1, 2, 3, 4]))
  np.testing.assert_allclose(window.load(), [1.5, 2.25, 3.125, 4.125])
  with pytest.raises(ValueError, match=r"step 1 of the window holds -2"):
    window.record(np.array([1, -2, 3, 4]))
  # plan_placement: an all-zero load with E not divisible by N plans an even load's packing.
  planned = ms.plan_placement(np.zeros(6), 8, 4)
  assert sorted(np.bincount(np.asarray(planned.phy2log), minlength=6)) == [1, 1, 1, 1, 2, 2]


def test_nnx_optimizer_state_moves_only_with_its_model():
  pytest.importorskip("flax.nnx")
  from flax import nnx

  from moe_shard.nnx import MoE

  cfg = config(impl="all_to_all", gmm_impl="ragged_dot", num_shared_experts=0)
  mesh = _mesh((2, 4), DE, EXPLICIT)
  with jax.set_mesh(mesh):
    moe = MoE(cfg, rngs=nnx.Rngs(0), mesh=mesh)
    optimizer = nnx.Optimizer(moe, optax.adam(LR), wrt=nnx.Param)
    with pytest.raises(ValueError, match=r"optimizer= needs model=.*got model=None"):
      moe.replicate_experts(_placement("one_hot"), optimizer=optimizer)
    moe.replicate_experts(_placement("one_hot"), optimizer=optimizer, model=moe)
    assert optimizer.opt_state[0].mu["experts"]["gate_EDF"][...].shape[0] == 12
