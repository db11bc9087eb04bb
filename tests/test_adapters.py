"""Expert adapters (`adapters.py`) against the float64 layer model with each adapter folded
into its matrix.

* The layer with LoRA adapters on every matrix of quantized (int8) experts, every dispatch on
  one device and on jax.make_mesh's default (Explicit) 8-device mesh, with the expert tensor
  and FSDP axes: y, dx and the gradients of every adapter's a and b within 2e-5 of the
  largest entry of the float64 model's (`tests/layer_oracle.py` on w + scale * a @ b; its
  gradients are central differences of the model in x and in each entry of a and b). The
  quantized matrices are split off by `trainable_mask` and get no gradient.
* `add_adapters` (shapes, b zero: the layer unchanged; placement), `merge_adapters` (the
  folded matrix), `MaskedMatmul` on an adapter, the masks, and the error paths.
"""

import dataclasses
import re

import jax
import jax.numpy as jnp
import layer_oracle
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

import moe_shard as ms

RTOL = 2e-5  # as tests/test_quant.py: y and gradients within 2e-5 of the largest entry
B, S, E, K, D, F, R = 2, 4, 8, 2, 16, 32, 2
TARGETS = ("gate_EDF", "up_EDF", "down_EFD")
SCALE = 2.0  # alpha / rank


def _cfg(**overrides):
  base = dict(
    d_model=D,
    d_ff=F,
    num_experts=E,
    top_k=K,
    expert_bias=True,
    num_shared_experts=1,
    shared_d_ff=8,
    load_balance_coef=0.1,
    z_loss_coef=0.01,
    gmm_impl="ragged_dot",
  )
  return ms.MoEConfig(**{**base, **overrides})


def _fold(base, a, b):
  return base + SCALE * np.einsum("...ir,...ro->...io", a, b)


def _fd(f, a, h=1e-6):
  """Central differences of the scalar f at every entry of the float64 array a (in place)."""
  g = np.zeros_like(a)
  for i in np.ndindex(a.shape):
    old = a[i]
    a[i] = old + h
    up = f()
    a[i] = old - h
    down = f()
    a[i] = old
    g[i] = (up - down) / (2 * h)
  return g


_CASE = {}


def _case():
  """(cfg, adapted params, x, ct, y64, grads64), built once per test process: int8 experts
  with biases and a shared expert, an adapter of rank R on each matrix with b drawn nonzero."""
  if _CASE:
    return _CASE["case"]
  cfg = _cfg()
  rng = np.random.default_rng(0)
  params = ms.init_moe_params(jax.random.key(0), cfg)
  experts = dataclasses.replace(
    params.experts,
    **{
      f: jnp.asarray(0.1 * rng.normal(size=getattr(params.experts, f).shape), jnp.float32)
      for f in ("gate_b_EF", "up_b_EF", "down_b_ED")
    },
  )
  router = jnp.asarray(rng.normal(size=params.router_DE.shape) * 2.0, jnp.float32)
  params = dataclasses.replace(params, experts=experts, router_DE=router)
  ad = ms.add_adapters(
    ms.quantize_experts(params, "int8"), rank=R, key=jax.random.key(1), alpha=SCALE * R
  )
  ad = dataclasses.replace(
    ad,
    experts=dataclasses.replace(
      ad.experts,
      **{
        t: dataclasses.replace(
          getattr(ad.experts, t),
          b=jnp.asarray(0.3 * rng.normal(size=getattr(ad.experts, t).b.shape), jnp.float32),
        )
        for t in TARGETS
      },
    ),
  )
  # The model's parameters: the decoded int8 matrices, the adapters' a and b in float64.
  base = {}
  for t in TARGETS:
    q = getattr(ad.experts, t).w
    base[t] = (np.asarray(q.values, np.float32) * np.asarray(q.scales)).astype(np.float64)
  ab = {t: [layer_oracle.f64(getattr(ad.experts, t).a), layer_oracle.f64(getattr(ad.experts, t).b)] for t in TARGETS}  # fmt: skip
  p64 = layer_oracle.to_f64(
    dataclasses.replace(params, experts=dataclasses.replace(experts, **dict.fromkeys(TARGETS)))
  )
  x = rng.normal(size=(B, S, D))
  ct = rng.normal(size=(B, S, D))

  def model(x=x):
    folded = {t: _fold(base[t], *ab[t]) for t in TARGETS}
    p = dataclasses.replace(p64, experts=dataclasses.replace(p64.experts, **folded))
    return p, x

  p, _ = model()
  y64, _ = layer_oracle.layer(p, x, cfg)
  margin = layer_oracle.routing_margin(x.reshape(-1, D), p.router_DE, K)
  assert margin > 200 * 1e-6 * max(np.abs(x).max(), np.abs(p.router_DE).max())
  loss = lambda: layer_oracle.loss(*model(), ct, cfg)
  g64 = {"x": _fd(lambda: layer_oracle.loss(*model(x), ct, cfg), x)}
  for t in TARGETS:
    g64[t] = [_fd(loss, ab[t][0]), _fd(loss, ab[t][1])]
  _CASE["case"] = (cfg, ad, x.astype(np.float32), ct.astype(np.float32), y64, g64)
  return _CASE["case"]


def _assert_rel(got, want, what):
  want = np.asarray(want, np.float64)
  err = np.abs(np.asarray(got, np.float64) - want).max() / np.abs(want).max()
  assert err <= RTOL, f"{what}: {err:.2e} of the largest entry"


# Device 1 of the 4-device expert axis holds replicas only: its adapters are fetched with
# their matrices, and their gradients summed back to the owners; the per-step plan made to
# move experts at any load.
ONLY_REPLICAS = ms.Placement.from_phy2log(np.array([0, 1, 2, 0, 1, 2, 3, 4, 5, 6, 7, 3]), E)

# The default mesh: jax.make_mesh's Explicit axes, as users build it; the last entry the
# layer's placement (docs/guides/skew.md).
DISPATCHES = [
  ("masked_scan", False, {}, None),
  ("ragged_dot", False, {}, None),
  ("all_gather", True, dict(expert_fsdp_axis="data"), None),
  ("all_to_all", True, {}, None),
  ("all_to_all", True, dict(expert_tensor_axis="data"), None),
  ("ragged_all_to_all", True, {}, None),
  ("ragged_all_to_all", True, {}, ONLY_REPLICAS),
  ("all_to_all", True, {}, ms.StepPlacement(spare_slots=1, rows_per_moved_expert=0)),
]


@pytest.mark.parametrize(
  ("impl", "on_mesh", "split", "placement"),
  DISPATCHES,
  ids=lambda v: {ms.Placement: "only_replicas", ms.StepPlacement: "step"}.get(type(v), str(v)),
)
def test_adapters_match_the_float64_model(impl, on_mesh, split, placement):
  cfg, ad, x, ct, y64, g64 = _case()
  cfg = dataclasses.replace(cfg, impl=impl, **split)
  mesh = jax.make_mesh((2, 4), ("data", "expert")) if on_mesh else None
  trainable, frozen = ms.split_trainable(ad)

  def loss(trainable, x):
    y, aux = ms.moe_layer(
      ms.merge_trainable(trainable, frozen), x, cfg, mesh=mesh, placement=placement
    )
    return jnp.sum(y * ct) + aux["aux_loss"], y

  (_, y), (gp, gx) = jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))(
    trainable, jnp.asarray(x)
  )
  _assert_rel(y, y64, "y")
  _assert_rel(gx, g64["x"], "dx")
  for t in TARGETS:
    got = getattr(gp.experts, t)
    assert got.w.values is None and got.w.scales is None  # the quantized matrix: frozen
    _assert_rel(got.a, g64[t][0], f"d {t}.a")
    _assert_rel(got.b, g64[t][1], f"d {t}.b")


def test_add_and_merge_adapters():
  """Shapes, placement and init (b zero: the layer is unchanged); merge_adapters folds each
  adapter into a float matrix, which the layer computes with as it does with the adapter;
  the mask freezes a float base matrix too."""
  cfg = _cfg(num_shared_experts=0)
  mesh = jax.make_mesh((2, 4), ("data", "expert"))
  params = ms.init_moe_params(jax.random.key(0), cfg, mesh=mesh)
  ad = ms.add_adapters(params, rank=4, key=jax.random.key(1), targets=("gate_EDF", "down_EFD"))
  gate, down = ad.experts.gate_EDF, ad.experts.down_EFD
  assert isinstance(gate, ms.Adapter) and ad.experts.up_EDF is params.experts.up_EDF
  assert gate.a.shape == (E, D, 4) and gate.b.shape == (E, 4, F) and gate.scale == 1.0
  assert down.a.shape == (E, F, 4) and down.b.shape == (E, 4, D)
  assert gate.a.sharding.spec == P("expert", None, None) == down.b.sharding.spec
  assert not np.any(np.asarray(gate.b)) and np.std(np.asarray(gate.a)) > 0.1
  x = jax.random.normal(jax.random.key(2), (B, S, D))
  layer = jax.jit(lambda p, x: ms.moe_layer(p, x, cfg, mesh=mesh)[0])
  np.testing.assert_allclose(layer(ad, x), layer(params, x), rtol=1e-6, atol=1e-6)
  mask = ms.trainable_mask(ad)
  assert mask.experts.gate_EDF == ms.Adapter(False, True, True)
  # As optax labels: the float base matrix under an adapter does not move.
  tx = optax.multi_transform({True: optax.adam(1e-2), False: optax.set_to_zero()}, mask)
  updates, _ = tx.update(jax.tree.map(jnp.ones_like, ad), tx.init(ad), ad)
  assert not np.any(np.asarray(updates.experts.gate_EDF.w))
  assert np.all(np.asarray(updates.experts.gate_EDF.b) != 0) and np.any(
    np.asarray(updates.router_DE)
  )
  # Trained: b nonzero. Folded, the layer computes the same outputs.
  b = jax.random.normal(jax.random.key(3), gate.b.shape) * 0.1
  ad = dataclasses.replace(ad, experts=dataclasses.replace(ad.experts, gate_EDF=dataclasses.replace(gate, b=b)))  # fmt: skip
  merged = ms.merge_adapters(ad)
  want = np.asarray(params.experts.gate_EDF) + np.einsum(
    "eir,ero->eio", np.asarray(gate.a), np.asarray(b)
  )
  np.testing.assert_allclose(merged.experts.gate_EDF, want, rtol=1e-6, atol=1e-6)
  assert merged.experts.gate_EDF.sharding.spec == P("expert", None, None)
  np.testing.assert_allclose(layer(ad, x), layer(merged, x), rtol=2e-5, atol=2e-6)


def test_masked_matmul_on_an_adapter():
  """One local expert (the TPU's one-expert path): valid rows get x @ (w + scale a b), with
  w quantized; padding rows zeros."""
  M = 12
  valid = np.arange(M) % 3 != 0
  w = ms.quantize_experts(ms.Linear(jax.random.normal(jax.random.key(0), (1, D, F))), "int8").w_EDF
  a = jax.random.normal(jax.random.key(1), (1, D, R))
  b = jax.random.normal(jax.random.key(2), (1, R, F))
  x = jax.random.normal(jax.random.key(3), (M, D))
  y = ms.MaskedMatmul(jnp.asarray(valid))(x, ms.Adapter(w, a, b, SCALE))
  w64 = _fold(np.asarray(w.dequantize(), np.float64), np.asarray(a, np.float64), np.asarray(b, np.float64))[0]  # fmt: skip
  want = np.where(valid[:, None], np.asarray(x, np.float64) @ w64, 0.0)
  np.testing.assert_allclose(y, want, atol=RTOL * np.abs(want).max(), rtol=0)


def test_errors_name_the_argument():
  cfg = _cfg(num_shared_experts=0)
  params = ms.init_moe_params(jax.random.key(0), cfg)
  key = jax.random.key(1)
  with pytest.raises(
    ValueError,
    match=re.escape(
      "add_adapters: targets must be matrix fields of SwiGLU ('gate_EDF', 'up_EDF', 'down_EFD') (got 'gate_b_EF')"
    ),
  ):
    ms.add_adapters(params, rank=2, key=key, targets=("gate_b_EF",))
  with pytest.raises(ValueError, match=re.escape("add_adapters: rank must be in [1, 16] (got 17)")):
    ms.add_adapters(params, rank=17, key=key)
  ad = ms.add_adapters(params, rank=2, key=key, targets=("up_EDF",))
  with pytest.raises(
    ValueError, match=re.escape("add_adapters: experts.up_EDF already has an adapter")
  ):
    ms.add_adapters(ad, rank=2, key=key, targets=("up_EDF",))
  bad = dataclasses.replace(ad.experts.up_EDF, a=ad.experts.up_EDF.a[:, :, :1])
  bad = dataclasses.replace(ad, experts=dataclasses.replace(ad.experts, up_EDF=bad))
  with pytest.raises(
    ValueError,
    match=re.escape(
      "moe_layer: params.experts.up_EDF is an Adapter of a matrix (8, 16, 32): a must be [..., I, R] and b [..., R, O] with the matrix's leading axes (got a (8, 16, 1), b (8, 2, 32))"
    ),
  ):
    ms.moe_layer(bad, jnp.zeros((B, S, D)), cfg)
