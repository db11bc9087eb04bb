"""The layer on a placement (replicated experts) against the float64 layer model.

Each case runs `jax.value_and_grad` of `sum(y * ct) + aux["aux_loss"]` through `moe_layer`
with a placement and compares y, the aux losses, expert_load and the gradient of x and of
every parameter with `tests/layer_oracle.py` (which has no notion of placements: replicas
must change nothing). Placements are adversarial, on E = 8 experts over S = 12 slots of a
4-device expert axis (3 slots a device):

  * "one_hot": every redundant slot to expert 0, two of them on one device;
  * "one_chip": expert 5's three replicas all on device 2;
  * "only_replicas": device 1 holds replicas only (of device 0's experts), so in training
    all its weights are fetched, and its gradients summed back.

Logical parameters (fetched inside the layer) and slot-major ones (`replicate_experts`),
placements passed as jit arguments (traced) and closed over (constants), each dispatch,
tensor and FSDP axes, the per-step placement, and int8 experts. `device_load` is checked against a NumPy model
of the replica rule written here from its documentation.
"""

import contextlib
import dataclasses
import functools

import jax
import jax.numpy as jnp
import layer_oracle
import numpy as np
import pytest
from cases import FAST_COMPILE, Mismatches, assert_close
from test_layer_oracle import AUTO, DE, ED, EXPLICIT, _mesh, _oracle_key, _place, config, reference

import moe_shard as ms
from moe_shard import replica_rule as rule_lib
from moe_shard import sharding, slot_moves

PLACEMENTS = {
  "one_hot": [0, 1, 2, 3, 4, 0, 5, 6, 0, 7, 0, 0],
  "one_chip": [0, 1, 2, 3, 4, 6, 5, 5, 5, 7, 0, 1],
  "only_replicas": [0, 1, 2, 0, 1, 2, 3, 4, 5, 6, 7, 3],
}
E = 8

# name: (MoEConfig overrides, mesh spec, placement name or "step", slot-major params,
# placement traced (a jit argument) or closed over)
CASES = {
  "all_to_all-one_hot-logical-traced": (
    dict(impl="all_to_all", gmm_impl="ragged_dot", chunk_size=1),
    ((2, 4), DE, EXPLICIT),
    "one_hot",
    False,
    True,
  ),
  "ragged-one_chip-logical-constant": (
    dict(impl="ragged_all_to_all", gmm_impl="ragged_dot", recv_capacity=4),
    ((4, 2), ED, AUTO),
    "one_chip",
    False,
    False,
  ),
  "all_gather-only_replicas-logical-traced": (
    dict(impl="all_gather", gmm_impl="ragged_dot"),
    ((2, 4), DE, EXPLICIT),
    "only_replicas",
    False,
    True,
  ),
  "all_to_all-only_replicas-served-constant": (
    dict(impl="all_to_all", gmm_impl="ragged_dot"),
    ((2, 4), DE, EXPLICIT),
    "only_replicas",
    True,
    False,
  ),
  "ragged-one_hot-served-traced": (
    dict(impl="ragged_all_to_all", gmm_impl="ragged_dot"),
    ((4, 2), ED, AUTO),
    "one_hot",
    True,
    True,
  ),
  "ragged_dot-one_chip-served-local": (
    dict(impl="ragged_dot", gmm_impl="ragged_dot"),
    None,
    "one_chip",
    True,
    False,
  ),
  # A placement closed over holds NumPy arrays, which the local dispatches and all_gather
  # index with traced ids.
  "masked_scan-one_hot-logical-mesh-constant": (
    dict(impl="masked_scan"),
    ((2, 4), DE, EXPLICIT),
    "one_hot",
    False,
    False,
  ),
  "all_gather-one_chip-served-constant": (
    dict(impl="all_gather", gmm_impl="ragged_dot"),
    ((2, 4), DE, EXPLICIT),
    "one_chip",
    True,
    False,
  ),
  # Each expert's F split over "data" (tensor parallel), or its matrices stored split there
  # (FSDP): the slots' shards move over the expert axis.
  "ragged-tensor-one_hot-logical-traced": (
    dict(impl="ragged_all_to_all", gmm_impl="ragged_dot", expert_tensor_axis="data"),
    ((2, 4), DE, EXPLICIT),
    "one_hot",
    False,
    True,
  ),
  "all_to_all-fsdp-only_replicas-logical-traced": (
    dict(impl="all_to_all", gmm_impl="ragged_dot", expert_fsdp_axis="data"),
    ((2, 4), DE, EXPLICIT),
    "only_replicas",
    False,
    True,
  ),
  # Slot-major on the same axes: each slot's gradient, summed over its expert's replicas,
  # moves as the shards it is stored in.
  "ragged-tensor-one_chip-served-traced": (
    dict(impl="ragged_all_to_all", gmm_impl="ragged_dot", expert_tensor_axis="data"),
    ((2, 4), DE, EXPLICIT),
    "one_chip",
    True,
    True,
  ),
  "all_to_all-fsdp-one_hot-served-constant": (
    dict(impl="all_to_all", gmm_impl="ragged_dot", expert_fsdp_axis="data"),
    ((2, 4), DE, EXPLICIT),
    "one_hot",
    True,
    False,
  ),
  "step-all_to_all": (
    dict(impl="all_to_all", gmm_impl="ragged_dot"),
    ((2, 4), DE, EXPLICIT),
    "step",
    False,
    False,
  ),
}


def replica_rule(experts_TK, phy2log, positions, rows, per_device):
  """The documented rule in NumPy. Tokens are split in order over the devices; the devices
  of one row (one per expert-axis position) share each expert's load: replica x of e (its
  slots in increasing order) takes load // count, the first load % count one more. Each
  device's items for e (token-major) first fill its own replicas of e in order up to their
  shares; the rest, device by device in position order, fill the replicas' remaining room
  in order. Returns the slot of each item (-1 invalid)."""
  T, K = experts_TK.shape
  G = len(positions)
  per_token = T // G
  out = np.full((T, K), -1)
  E = max(phy2log) + 1
  for row in set(rows):
    members = sorted((p, g) for g, (p, r) in enumerate(zip(positions, rows)) if r == row)
    for e in range(E):
      slots = [s for s in range(len(phy2log)) if phy2log[s] == e]
      items = {
        g: [
          (t, k)
          for t in range(g * per_token, (g + 1) * per_token)
          for k in range(K)
          if experts_TK[t, k] == e
        ]
        for _, g in members
      }
      total = sum(len(v) for v in items.values())
      q, extra = divmod(total, len(slots))
      room = [q + (x < extra) for x in range(len(slots))]
      rest = []
      for p, g in members:
        mine = [x for x, s in enumerate(slots) if s // per_device == p]
        left = list(items[g])
        for x in mine:
          while room[x] and left:
            t, k = left.pop(0)
            out[t, k] = slots[x]
            room[x] -= 1
        rest += left
      for x in range(len(slots)):
        while room[x] and rest:
          t, k = rest.pop(0)
          out[t, k] = slots[x]
          room[x] -= 1
  return out


@functools.partial(jax.jit, static_argnames=("cfg", "mesh", "fixed"), compiler_options=FAST_COMPILE)
def _run(params, x_BSD, ct_BSD, placement, cfg, mesh, fixed=None):
  placement = placement if fixed is None else fixed.placement

  def loss(params, x_BSD):
    y, aux = ms.moe_layer(params, x_BSD, cfg, mesh, placement=placement)
    return jnp.sum(y.astype(jnp.float32) * ct_BSD) + aux["aux_loss"], (y, aux)

  (_, (y, aux)), grads = jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)(params, x_BSD)
  return y, aux, grads


class _Fixed:
  """A placement closed over (hashable by identity: one compile per case)."""

  def __init__(self, placement):
    self.placement = placement


@pytest.mark.parametrize("name", list(CASES))
def test_layer_on_placement_matches_float64_model(name):
  overrides, mesh_spec, which, served, traced = CASES[name]
  cfg = config(**overrides)
  params, x, ct, want_y, want_aux, want_dparams, want_dx = reference(
    _oracle_key(overrides, "float32")
  )
  mesh = _mesh(*mesh_spec) if mesh_spec else None
  params, x_in = jax.tree.map(jnp.asarray, params), jnp.asarray(x)
  if mesh is not None:
    params, x_in = _place(params, x_in, cfg, mesh)
  if which == "step":
    placement = ms.StepPlacement(spare_slots=1, rows_per_moved_expert=0)
  else:
    placement = ms.Placement.from_phy2log(np.array(PLACEMENTS[which]), E)
  if served:
    assert isinstance(placement, ms.Placement)
    params = ms.replicate_experts(params, placement, mesh=mesh)
  fixed = None
  if which == "step" or not traced:
    fixed, placement = _Fixed(placement), None
  with jax.set_mesh(mesh) if mesh is not None else contextlib.nullcontext():
    y, aux, (dparams, dx) = _run(params, x_in, jnp.asarray(ct), placement, cfg, mesh, fixed)
  m = Mismatches(name)
  m.close(y, want_y, "y")
  m.close(aux["aux_loss"], want_aux["aux_loss"], "aux_loss")
  np.testing.assert_array_equal(aux["expert_load"], want_aux["expert_load"])
  m.close(dx, want_dx, "dx")
  if served:  # every slot's gradient is its expert's whole gradient (replicas tied)
    phy2log = np.asarray(PLACEMENTS[which])
    fields = {f.name: getattr(want_dparams, f.name) for f in dataclasses.fields(ms.MoEParams)}
    slots = jax.tree.map(lambda g: np.asarray(g)[phy2log], want_dparams.experts)
    want_dparams = ms.ServedParams(**dict(fields, experts=slots))
  m.close_tree(dparams, want_dparams)
  m.check()

  # device_load: the rule's count, from the model's routing.
  n = 1 if mesh is None else mesh.shape["expert"]
  if which == "step":  # the plan's own balance is tested in test_step_plan_balances_zipf
    assert int(aux["step_placement"]) == 1
    return
  phy2log = PLACEMENTS[which]
  if mesh is None:  # one device: every slot is elsewhere, nothing to balance against
    positions, rows = [0], [0]
  else:
    positions = list(sharding.expert_positions(mesh, "expert"))
    rows = list(sharding.data_rows(mesh, "expert"))
  slots = replica_rule(np.asarray(want_aux["experts_TK"]), phy2log, positions, rows, 3)
  per_slot = np.bincount(slots[slots >= 0], minlength=len(phy2log))
  want_device = per_slot.reshape(n, -1).sum(1) if mesh is not None else [per_slot.sum()]
  np.testing.assert_array_equal(aux["device_load"], want_device)
  assert float(aux["balancedness"]) == pytest.approx(_balancedness(np.asarray(want_device)))


def _balancedness(load):
  return float(np.mean(load) / np.max(load))


def test_step_plan_balances_zipf():
  # 8 devices, E = 64, 4096 tokens a device, K = 2, Zipf(1.2) popularity: the step's plan
  # with 2 redundant slots a device, then the replica rule, against no placement.
  N, T, K, E = 8, 4096, 2, 64
  rng = np.random.default_rng(0)
  logp = -1.2 * np.log(rng.permutation(E) + 1)
  experts = np.argsort(-(logp + rng.gumbel(size=(N * T, E))), axis=1)[:, :K].astype(np.int32)
  load = np.bincount(experts.ravel(), minlength=E)
  before = load.reshape(N, -1).sum(1)
  placement, pays = jax.jit(lambda a: ms.StepPlacement(spare_slots=2).plan(a, N))(load)
  assert bool(pays)
  slots = jax.jit(lambda e, p: rule_lib.assign_slots(e, p, np.arange(N)))(experts, placement)
  after = np.bincount(np.asarray(slots).ravel(), minlength=E + 2 * N).reshape(N, -1).sum(1)
  assert after.sum() == before.sum()
  assert _balancedness(before) < 0.45 and _balancedness(after) > 0.85
  # The same load over 64 devices a position (a data axis): each device saves 1/64 of the
  # rows and still fetches its own replicas, so the plan does not pay.
  _, pays = ms.StepPlacement(spare_slots=2).plan(load, N, 64)
  assert not bool(pays)
  # A uniform routing does not pay for moving weights: nothing is replicated.
  flat = jnp.full((E,), N * T * K // E, jnp.int32)
  kept, pays = ms.StepPlacement().plan(flat, N)
  assert not bool(pays)
  assert np.all(np.asarray(kept.phy2log).reshape(N, -1) // (E // N) == np.arange(N)[:, None])


def test_replicate_experts_and_moving_between_placements():
  mesh = _mesh((2, 4), DE, EXPLICIT)
  cfg = config(num_shared_experts=0)
  params = ms.init_moe_params(jax.random.key(0), cfg, mesh=mesh)
  q = ms.quantize_experts(params, "int8")
  first = ms.Placement.from_phy2log(np.array(PLACEMENTS["one_hot"]), E)
  second = ms.Placement.from_phy2log(np.array(PLACEMENTS["only_replicas"]), E)
  for p in (params, q):
    served = ms.replicate_experts(p, first, mesh=mesh)
    assert isinstance(served, ms.ServedParams)
    moved = ms.replicate_experts(served, second, mesh=mesh, previous=first)
    for got, want in zip(jax.tree.leaves(moved.experts), jax.tree.leaves(p.experts)):
      np.testing.assert_array_equal(got, np.asarray(want)[np.array(PLACEMENTS["only_replicas"])])
      assert got.sharding.spec[0] == "expert"
  # Slots whose expert stays come from themselves (0-2); slot 3 (expert 0, device 1) from
  # slot 5, which held expert 0 on device 1; slot 4 (expert 1: none on device 1) from the
  # first slot that held it, 1.
  dev, row = slot_moves.sources(second, first, 4, 3)
  src = dev * 3 + row
  assert list(src[:3]) == [0, 1, 2] and src[3] == 5 and src[4] == 1


def test_layer_placement_errors():
  cfg = config()
  mesh = _mesh((2, 4), DE, EXPLICIT)
  params = ms.init_moe_params(jax.random.key(0), cfg, mesh=mesh)
  x = jnp.zeros((8, 2, cfg.d_model))
  six = ms.Placement.from_phy2log(np.array([0, 1, 2, 3, 4, 5, 6, 7, 0, 0]), E)
  with pytest.raises(
    ValueError, match=r"slots \(10\) must be divisible by the expert axis size \(4\)"
  ):
    ms.moe_layer(params, x, cfg, mesh, placement=six)
  with pytest.raises(ValueError, match=r"num_experts \(8\)"):
    ms.moe_layer(params, x, cfg, mesh, placement=ms.Placement.from_phy2log(np.arange(4), 4))
  with pytest.raises(ValueError, match="'step'"):
    ms.moe_layer(params, x, cfg, mesh, placement="steps")
  p = ms.Placement.from_phy2log(np.array(PLACEMENTS["one_hot"]), E)
  served = ms.replicate_experts(params, p, mesh=mesh)
  with pytest.raises(ValueError, match="slot-major"):
    ms.moe_layer(served, x, cfg, mesh)
  with pytest.raises(ValueError, match="logical parameters"):
    ms.moe_layer(served, x, cfg, mesh, placement="step")
  with pytest.raises(ValueError, match="previous="):
    ms.replicate_experts(served, p, mesh=mesh)
  with pytest.raises(ValueError, match=r"must hold the placement's 16 slots on axis 0 \(got 12\)"):
    ms.moe_layer(served, x, cfg, mesh, placement=ms.Placement.from_phy2log(np.arange(16) % 8, E))
  with pytest.raises(ValueError, match="params are logical"):
    ms.replicate_experts(params, p, mesh=mesh, previous=p)


@pytest.mark.parametrize("impl", ["all_to_all", "ragged_dot"])
def test_traced_placement_without_a_slot_counts_the_dropped_items(impl):
  # A placement passed to jit is data, not checked: expert 3 given no slot (its row of
  # log2phy all -1) drops its items. With top-1 routing each of them is a token that
  # reaches no routed expert: counted in dropped_items and dropped_tokens, not in
  # expert_load (nothing computed them), and their routed output is zero.
  cfg = config(num_shared_experts=0, impl=impl, gmm_impl="ragged_dot", top_k=1)
  mesh = _mesh((2, 4), DE, EXPLICIT)
  params = ms.init_moe_params(jax.random.key(0), cfg, mesh=mesh)
  x = jax.random.normal(jax.random.key(1), (8, 2, cfg.d_model))
  p = ms.Placement.from_phy2log(np.array(PLACEMENTS["one_hot"]), E)
  phy2log = np.where(p.phy2log == 3, 0, p.phy2log).astype(np.int32)
  log2phy, logcnt = p.log2phy.copy(), p.logcnt.copy()
  log2phy[3], logcnt[3] = -1, 0
  run = jax.jit(lambda p, x, placement: ms.moe_layer(p, x, cfg, mesh, placement=placement))
  with jax.set_mesh(mesh):
    y, aux = jax.jit(
      lambda p, x, a, b, c: ms.moe_layer(p, x, cfg, mesh, placement=ms.Placement(a, b, c))
    )(params, x, phy2log, log2phy, logcnt)
    y_base, base = run(params, x, None)
  routed_to_3 = int(base["expert_load"][3])
  assert routed_to_3 > 0
  assert int(aux["expert_load"][3]) == 0
  np.testing.assert_array_equal(np.delete(aux["expert_load"], 3), np.delete(base["expert_load"], 3))
  assert int(aux["dropped_items"]) == routed_to_3
  assert int(aux["dropped_tokens"]) == routed_to_3
  assert int(base["dropped_items"]) == int(base["dropped_tokens"]) == 0
  zero_rows = np.all(np.asarray(y) == 0, axis=-1)
  assert int(zero_rows.sum()) == routed_to_3
  np.testing.assert_allclose(
    np.asarray(y)[~zero_rows], np.asarray(y_base)[~zero_rows], rtol=1e-5, atol=1e-6
  )


def test_placement_from_arrays_numpy_converts():
  # EPLB returns torch tensors: anything with __array__ is converted and checked.
  class Tensor:
    def __init__(self, a):
      self.a = np.asarray(a)

    def __array__(self, dtype=None, copy=None):
      return self.a if dtype is None else self.a.astype(dtype)

  p = ms.Placement.from_phy2log(np.array(PLACEMENTS["one_chip"]), E)
  q = ms.Placement(Tensor(p.phy2log), Tensor(p.log2phy.astype(np.int64)), Tensor(p.logcnt))
  assert isinstance(q.log2phy, np.ndarray) and q.log2phy.dtype == np.int32
  np.testing.assert_array_equal(q.log2phy, p.log2phy)
  with pytest.raises(ValueError, match="every expert needs at least one slot"):
    ms.Placement(Tensor(p.phy2log % 7), Tensor(p.log2phy), Tensor(p.logcnt))


def test_quantized_experts_on_a_placement():
  # int8 experts: the slots' values and scales fetched frozen; y as the float64 model of
  # the decoded matrices, the trainable gradients (router, x) as without a placement.
  mesh = _mesh((2, 4), DE, EXPLICIT)
  cfg = config(num_shared_experts=0, impl="ragged_all_to_all", gmm_impl="ragged_dot")
  params = ms.quantize_experts(ms.init_moe_params(jax.random.key(0), cfg, mesh=mesh), "int8")
  x = jax.random.normal(jax.random.key(1), (8, 2, cfg.d_model))
  p = ms.Placement.from_phy2log(np.array(PLACEMENTS["only_replicas"]), E)

  def loss(router, x, placement):
    y, aux = ms.moe_layer(
      dataclasses.replace(params, router_DE=router), x, cfg, mesh, placement=placement
    )
    return jnp.sum(jnp.sin(y)) + aux["aux_loss"]

  with jax.set_mesh(mesh):
    grad = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)), compiler_options=FAST_COMPILE)
    want = grad(params.router_DE, x, None)
    got = grad(params.router_DE, x, p)
    y, _ = jax.jit(lambda x: ms.moe_layer(params, x, cfg, mesh, placement=p))(x)
  for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    assert_close(g, w, jnp.float32)
  # y against the float64 layer model of the decoded int8 matrices.
  p64 = layer_oracle.to_f64(jax.device_get(ms.dequantize_experts(params)))
  x64 = np.asarray(x, np.float64)
  assert layer_oracle.routing_margin(x64.reshape(-1, cfg.d_model), p64.router_DE, cfg.top_k) > 1e-4
  assert_close(y, layer_oracle.layer(p64, x64, cfg)[0], jnp.float32)


def test_load_window_sums_the_last_steps():
  w = ms.LoadWindow(num_experts=3, num_layers=2, window=2)
  for step in range(3):
    w.record(jnp.full((2, 3), step + 1))
  assert len(w) == 2
  np.testing.assert_array_equal(w.load(), np.full((2, 3), 5))
  with pytest.raises(ValueError, match=r"shape \(2, 3\)"):
    w.record(np.zeros(3))
  p = ms.plan_placement(w.load(), num_slots=4, num_devices=2)
  assert p.num_layers == 2


def test_scan_over_layers_with_a_placement_per_layer():
  # Two layers stacked, a [2, S] placement scanned with them (traced inside the scan): the
  # loss and dx of the float64 model, and the parameters' gradients of the layers without
  # a placement.
  mesh = _mesh((2, 4), DE, EXPLICIT)
  cfg = config(num_shared_experts=0, impl="all_to_all", gmm_impl="ragged_dot")
  with jax.set_mesh(mesh):
    layers = [ms.init_moe_params(jax.random.key(i), cfg, mesh=mesh) for i in range(2)]
    stacked = jax.tree.map(lambda *a: jnp.stack(a), *layers)
    x = jax.random.normal(jax.random.key(2), (8, 2, cfg.d_model))
    placements = ms.plan_placement(np.array([[9, 1, 1, 1, 1, 1, 1, 1], [1] * 7 + [9]]), 12, 4)

    def loss(stacked, x, placements):
      def body(h, layer):
        params, placement = layer
        y, _ = ms.moe_layer(params, h, cfg, mesh, placement=placement)
        return h + y, None

      h, _ = jax.lax.scan(body, x, (stacked, placements))
      return jnp.sum(h**2)

    grad = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)), compiler_options=FAST_COMPILE)
    want = grad(stacked, x, None)
    got = grad(stacked, x, placements)
  for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    assert_close(g, w, jnp.float32)
  # The loss and dx against the float64 model of the two layers (central differences).
  p64 = [layer_oracle.to_f64(jax.device_get(p)) for p in layers]

  def model(x64):
    h = x64
    for p in p64:
      D = cfg.d_model
      assert layer_oracle.routing_margin(h.reshape(-1, D), p.router_DE, cfg.top_k) > 1e-3
      h = h + layer_oracle.layer(p, h, cfg)[0]
    return float(np.sum(h**2))

  x64 = np.asarray(x, np.float64)
  dx64 = np.zeros_like(x64)
  for i in np.ndindex(x64.shape):
    up, down = x64.copy(), x64.copy()
    up[i] += 1e-6
    down[i] -= 1e-6
    dx64[i] = (model(up) - model(down)) / 2e-6
  assert_close(got[0], model(x64), jnp.float32)
  assert_close(got[1][1], dx64, jnp.float32)


def test_all_gather_counts_slots_as_its_devices_split_the_tokens():
  # T = 12 tokens over 8 devices: padded to 16, two a device, the last four padding. The
  # slots' load is the replica rule's on that split (padding ids -1), counted in the body.
  mesh = _mesh((2, 4), DE, EXPLICIT)
  rng = np.random.default_rng(3)
  experts = rng.choice([0, 0, 0, 5, 5, 1, 2, 3, 4, 6, 7], size=(12, 2)).astype(np.int32)
  x = jnp.asarray(rng.normal(size=(12, 8)), jnp.float32)
  w = jnp.asarray(rng.normal(size=(E, 8, 4)), jnp.float32)
  phy2log = PLACEMENTS["one_chip"]
  p = ms.Placement.from_phy2log(np.array(phy2log), E)
  with jax.set_mesh(mesh):
    _, stats = ms.moe_all_gather(
      x, w, jnp.asarray(experts), mesh=mesh, placement=p, gmm_impl="ragged_dot", return_stats=True
    )
  padded = np.concatenate([experts, np.full((4, 2), -1, np.int32)])
  positions = list(sharding.expert_positions(mesh, "expert"))
  rows = list(sharding.data_rows(mesh, "expert"))
  slots = replica_rule(padded, phy2log, positions, rows, 3)
  want = np.bincount(slots[slots >= 0], minlength=len(phy2log))
  np.testing.assert_array_equal(stats["slot_load"], want)
  np.testing.assert_array_equal(stats["expert_load"], np.bincount(experts.ravel(), minlength=E))
