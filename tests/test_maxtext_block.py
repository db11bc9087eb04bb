"""moe_shard's block inside MaxText models (`moe_shard.maxtext`) equals MaxText's own.

Needs MaxText 0.2.5 (Python 3.12, jax >= 0.11.1), which CI does not install: the module is
skipped without it. Run it with MaxText's environment, e.g.

    /work/venvs/mt/bin/python -m pytest -q -p no:randomly tests/test_maxtext_block.py

Tiny Mixtral-like and DeepSeek-V3-like models (2 layers, D = 32, F = 64, 8 experts, top-2,
8 sequences of 16 tokens, float32), built twice with the same initialisation: with MaxText's
block, on its dropless path (`sparse_matmul=True`, `megablox=False`, `capacity_factor=-1`),
and with moe_shard's (`moe_shard.maxtext.installed()`). Each runs on a 2x4 mesh of the 8
simulated CPU devices: moe_shard's on fsdp 2 x expert 4 (its expert-parallel dispatch),
MaxText's on data 2 x fsdp 4, because with experts split MaxText's dropless path needs
`ragged-all-to-all`, which XLA:CPU does not implement. The parameters are MaxText's in both
(the same paths, shapes, dtypes and values); the logits and every parameter's gradient of
MaxText's `loss_fn`, and the losses of 5 steps of MaxText's own `train_step` (adamw, with
DeepSeek's bias updates), agree to a relative error of 1e-5: max |a - b| / max |a| per
array, |a - b| / |a| per loss. The load-balance loss is off there (MaxText's default): MaxText's
sparse path takes it per shard of the batch, the block over the whole batch
(`test_load_balance_loss_is_maxtexts_on_the_whole_batch`).
"""

import functools
import os
import types

import numpy as np
import pytest

pytest.importorskip(
  "maxtext",
  reason="MaxText is not installed (Python 3.12: pip install maxtext==0.2.5 and moe_shard)",
)

import jax
import jax.numpy as jnp
import maxtext
from flax import nnx
from flax.linen import logical_axis_rules
from maxtext.configs import pyconfig
from maxtext.trainers.pre_train import train
from maxtext.utils import maxtext_utils, model_creation_utils, train_utils

import moe_shard as ms
from moe_shard import maxtext as ms_maxtext

RTOL = 1e-5  # float32 throughout; the two blocks sum the same products in other orders

COMMON = dict(
  run_name="moe_shard_test",
  enable_checkpointing=False,
  override_model_config=True,
  attention="dot_product",
  base_emb_dim=32,
  base_mlp_dim=64,
  base_moe_mlp_dim=64,
  base_num_decoder_layers=2,
  base_num_query_heads=4,
  base_num_kv_heads=4,
  head_dim=8,
  vocab_size=128,
  max_target_length=16,
  per_device_batch_size=1,
  dtype="float32",
  weight_dtype="float32",
  matmul_precision="highest",
  num_experts=8,
  num_experts_per_tok=2,
  sparse_matmul=True,
  megablox=False,
  capacity_factor=-1.0,
  dataset_type="synthetic",
  steps=5,
  learning_rate=1e-2,
  enable_goodput_recording=False,
)

MODELS = {
  "mixtral": dict(model_name="mixtral-8x7b"),
  "deepseek": dict(
    model_name="deepseek3-test",
    first_num_dense_layers=1,
    n_routing_groups=4,
    topk_routing_group=2,
    routed_bias_update_rate=0.01,
    q_lora_rank=0,
    kv_lora_rank=16,
    qk_nope_head_dim=8,
    qk_rope_head_dim=8,
    v_head_dim=8,
  ),
}

MESHES = {  # 2x4 each
  "maxtext": dict(ici_data_parallelism=2, ici_fsdp_parallelism=4),
  "moe_shard": dict(ici_fsdp_parallelism=2, ici_expert_parallelism=4),
}

BASE_YML = os.path.join(os.path.dirname(maxtext.__file__), "configs", "base.yml")


def _config(model, block, **fields):
  fields = {**COMMON, **MODELS[model], **MESHES[block], **fields}
  return pyconfig.initialize([None, BASE_YML], **fields)


def _batch(cfg, seed=0):
  B, S = cfg.global_batch_size_to_train_on, cfg.max_target_length
  tokens = np.asarray(jax.random.randint(jax.random.key(seed), (B, S + 1), 0, cfg.vocab_size))
  positions = np.broadcast_to(np.arange(S, dtype=np.int32), (B, S))
  ones = np.ones((B, S), np.int32)
  return dict(
    inputs=tokens[:, :S],
    inputs_position=positions,
    inputs_segmentation=ones,
    targets=tokens[:, 1:],
    targets_position=positions,
    targets_segmentation=ones,
  )


def _set_router_bias(rest, seed=1):
  """DeepSeek's selection bias (`gate.bias`, not a parameter) set to random values, so the
  bias moves the choices (it is zeros at initialisation)."""

  def set_bias(path, a):
    if "gate" in jax.tree_util.keystr(path) and "bias" in jax.tree_util.keystr(path):
      return 0.1 * jax.random.normal(jax.random.key(seed), a.shape, a.dtype)
    return a

  return jax.tree_util.tree_map_with_path(set_bias, rest)


def _has_block(model, cls):
  return any(isinstance(node, cls) for _, node in nnx.iter_graph(model))


def _logits_and_grads(model_name, block):
  """MaxText's model of `block`'s mesh: (params, logits, loss, grads) of `train.loss_fn`."""
  cfg = _config(model_name, block)
  mesh = maxtext_utils.get_mesh_from_config(cfg)
  with logical_axis_rules(cfg.logical_axis_rules), jax.set_mesh(mesh):
    model = model_creation_utils.create_model(cfg, mesh, rngs=nnx.Rngs(params=0, dropout=1))
    assert _has_block(model, ms_maxtext.routed_moe_class()) == (block == "moe_shard")
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    rest = _set_router_bias(rest)
    batch = _batch(cfg)

    def loss(params):
      m = nnx.merge(graphdef, params, rest, copy=True)
      logits = m(
        decoder_input_tokens=batch["inputs"],
        decoder_positions=batch["inputs_position"],
        decoder_segment_ids=batch["inputs_segmentation"],
        enable_dropout=False,
      )
      nnx.pop(m, nnx.Intermediate)
      m = nnx.merge(graphdef, params, rest, copy=True)
      value, _ = train.loss_fn(m, cfg, dict(batch), None, None, is_train=True)
      return value, logits

    (value, logits), grads = jax.jit(jax.value_and_grad(loss, has_aux=True))(params)
  return params, logits, value, grads


def _rel(want, got):
  want, got = np.asarray(want, np.float64), np.asarray(got, np.float64)
  return float(np.max(np.abs(want - got)) / np.max(np.abs(want)))


@pytest.mark.parametrize("model_name", ["mixtral", "deepseek"])
def test_logits_and_grads_match_maxtext(model_name):
  p_mt, logits_mt, loss_mt, grads_mt = _logits_and_grads(model_name, "maxtext")
  with ms_maxtext.installed():
    p_ms, logits_ms, loss_ms, grads_ms = _logits_and_grads(model_name, "moe_shard")
  # MaxText's parameters, unchanged: the same paths, shapes, dtypes and values
  assert jax.tree.structure(p_mt) == jax.tree.structure(p_ms)
  for a, b in zip(jax.tree.leaves(p_mt), jax.tree.leaves(p_ms), strict=True):
    assert a.dtype == b.dtype
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  errors = {"logits": _rel(logits_mt, logits_ms), "loss": _rel(loss_mt, loss_ms)}
  for (path, a), b in zip(
    jax.tree_util.tree_leaves_with_path(grads_mt), jax.tree.leaves(grads_ms), strict=True
  ):
    errors[jax.tree_util.keystr(path)] = _rel(a, b)
  print(f"\n{model_name}: max relative errors", {k: f"{v:.1e}" for k, v in errors.items()})
  assert max(errors.values()) <= RTOL, errors
  assert any("MoeBlock_0']['wi_0" in k for k in errors), "the routed experts get gradients"


def _train_losses(model_name, block, steps=5):
  """Losses of `steps` calls of MaxText's jitted `train_step` on one batch."""
  cfg = _config(model_name, block, steps=steps)
  (_, _, shardings, _, mesh, *_, state) = train_utils.setup_train_loop(cfg, None)
  jit_model, state = nnx.split(state)
  params_shardings, shardings = maxtext_utils.sharding.maybe_update_params_sharding_with_opt(
    cfg, shardings
  )
  p_train_step, _ = train_utils.jit_train_and_eval_step(
    cfg,
    jit_model,
    mesh,
    state,
    shardings,
    train.train_step,
    train.eval_step,
    None,
    params_shardings,
  )
  batch = _batch(cfg)
  losses = []
  with jax.set_mesh(mesh), logical_axis_rules(cfg.logical_axis_rules):
    for _ in range(steps):
      state, metrics = p_train_step(state, batch)
      losses.append(float(metrics["scalar"]["learning/loss"]))
  return losses


@pytest.mark.parametrize("model_name", ["mixtral", "deepseek"])
def test_train_step_losses_match_maxtext(model_name):
  want = _train_losses(model_name, "maxtext")
  with ms_maxtext.installed():
    got = _train_losses(model_name, "moe_shard")
  print(f"\n{model_name}: losses maxtext {want}\n{model_name}: losses moe_shard {got}")
  assert len(set(want)) == len(want), "the steps change the loss"
  np.testing.assert_allclose(got, want, rtol=RTOL)


def test_install_and_uninstall_swap_the_block():
  from maxtext.layers import moe

  original = moe.RoutedMoE
  with ms_maxtext.installed(impl="all_to_all") as cls:
    assert moe.RoutedMoE is cls and issubclass(cls, original)
    ms_maxtext.install(impl="ragged_all_to_all")  # a second install replaces the first
    assert moe.RoutedMoE is ms_maxtext.routed_moe_class("ragged_all_to_all")
  assert moe.RoutedMoE is original


def test_split_options():
  argv = ["train", "base.yml", "moe_shard_impl=all_to_all", "steps=5", "moe_shard_gmm_impl=tiled"]
  options, rest = ms_maxtext.split_options(argv)
  assert options == {"impl": "all_to_all", "gmm_impl": "tiled", "chunk_size": None}
  assert rest == ["train", "base.yml", "steps=5"]
  options, _ = ms_maxtext.split_options(["train", "moe_shard_chunk_size=14080,3520"])
  assert options["chunk_size"] == (14080, 3520)
  assert ms_maxtext.split_options(["train", "moe_shard_chunk_size=64"])[0]["chunk_size"] == 64
  with pytest.raises(ValueError, match="moe_shard_chunk_size must be C or C_FIRST,C_OVERFLOW"):
    ms_maxtext.split_options(["train", "moe_shard_chunk_size=1,2,3"])


@pytest.mark.parametrize(
  ("fields", "match"),
  [
    (dict(capacity_factor=1.25), "capacity_factor must be <= 0"),
    (dict(mlp_activations=["gelu", "linear"]), "mlp_activations must be"),
    (dict(routed_score_func="sigmoid"), "routed_score_func / routed_bias"),
  ],
)
def test_unmapped_settings_raise(fields, match):
  cfg = _config("mixtral", "moe_shard", **fields)
  with pytest.raises(ValueError, match=f"moe_shard.maxtext: {match}"):
    ms_maxtext.moe_config(cfg, num_experts=8, top_k=2, d_model=32, d_ff=64)


def test_config_maps_deepseek_routing():
  cfg = ms_maxtext.moe_config(
    _config("deepseek", "moe_shard"), num_experts=8, top_k=2, d_model=32, d_ff=64
  )
  assert (cfg.score_func, cfg.normalize_top_k, cfg.num_groups, cfg.top_k_groups) == (
    "sigmoid",
    True,
    4,
    2,
  )
  assert cfg.routed_scaling == 2.5 and cfg.bias_balancing and cfg.capacity_factor is None
  assert jnp.dtype(cfg.compute_dtype) == jnp.float32 and cfg.chunk_size is None
  sized = ms_maxtext.moe_config(
    _config("mixtral", "moe_shard"),
    num_experts=8,
    top_k=2,
    d_model=32,
    d_ff=64,
    chunk_size=(40, 8),
  )
  assert sized.chunk_size == (40, 8)


def test_load_balance_loss_is_maxtexts_on_the_whole_batch():
  # MaxText's `load_balance_loss` (per sequence: E^2 * mean over (B, E) of the fraction of
  # the sequence's items at e times its mean softmax probability of e) of moe_shard's top-k.
  from maxtext.layers import moe

  cfg = _config("mixtral", "moe_shard", load_balance_loss_weight=0.01)
  block = types.SimpleNamespace(config=cfg, num_experts=8, num_experts_per_tok=2)
  block.load_balance_loss = functools.partial(moe.RoutedMoE.load_balance_loss, block)
  block.should_update_load_balance = lambda: False
  B, S, D, E = 3, 5, 4, 8
  x_BSD = jax.random.normal(jax.random.key(0), (B, S, D))
  router_DE = jax.random.normal(jax.random.key(1), (D, E))
  params = ms.MoEParams(router_DE=router_DE, experts=None, shared=None)
  moe_cfg = ms_maxtext.moe_config(cfg, num_experts=E, top_k=2, d_model=D, d_ff=6)
  lb_loss, bias_updates = ms_maxtext._maxtext_aux(block, x_BSD, params, moe_cfg, None)
  logits_BSE = np.einsum("bsd,de->bse", np.asarray(x_BSD, np.float64), np.asarray(router_DE))
  top_BSK = np.argsort(-logits_BSE, axis=-1)[..., :2]
  fraction_BE = np.stack([np.bincount(t.ravel(), minlength=E) for t in top_BSK]) / (S * 2)
  probs_BSE = np.exp(logits_BSE) / np.exp(logits_BSE).sum(-1, keepdims=True)
  want = np.mean(fraction_BE * probs_BSE.mean(1)) * E**2 * 0.01
  np.testing.assert_allclose(float(lb_loss), want, rtol=1e-5)
  assert bias_updates is None
