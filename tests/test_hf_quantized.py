"""`hf.load_moe_layer(s)(..., keep_quantized=True)`: MXFP4 and block-FP8 experts kept as stored.

Three checkpoints: gpt-oss's MXFP4 as transformers wrote it (tests/fixtures/hf/gpt_oss_mxfp4:
`*_blocks` u8[E, out, in/32, 16], `*_scales` u8[E, out, in/32], gate/up interleaved), and
block-FP8 in blocks of 128 x 128 written here as DeepSeek-V3's release stores it (one
F8_E4M3 [out, in] tensor per expert with its f32 `weight_scale_inv`) and in DBRX's [E*F, D]
rows. What is checked: the kept `QuantizedArray`s dequantize to exactly what the float load
gives, hold the checkpoint's bytes (no more), are read without decoding, save back byte for
byte, split on a mesh as the float matrices do, and run the layer as transformers' block.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import hf_checkpoints
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from cases import FAST_COMPILE
from hf_checkpoints import MOE_LAYERS, PREFIX
from jax.sharding import PartitionSpec as P
from safetensors.numpy import save_file

import moe_shard as ms
from moe_shard import hf
from moe_shard.hf import fp8, layouts
from moe_shard.quant import QuantizedArray, expand, expert_bytes, is_quantized, quantize_experts

FIXTURES = Path(__file__).parent / "fixtures" / "hf"
FP8_128 = dict(
  quant_method="fp8", fmt="e4m3", activation_scheme="dynamic", weight_block_size=[128, 128]
)
MOE_LAYERS = dict(MOE_LAYERS, dbrx_fp8=MOE_LAYERS["dbrx"])
PREFIX = dict(PREFIX, dbrx_fp8=PREFIX["dbrx"])
# The stored tensors a kept matrix holds, by their name's ending.
KEPT_SUFFIXES = ("_blocks", "_scales", "_proj.weight", "_scale_inv", ".w1", ".v1", ".w2")


def write_fp8(folder, model_type, *, d=128, f=256, experts=8, seed=0, quantized=True):
  """Writes a block-FP8 checkpoint in blocks of 128 x 128 into `folder`.

  "deepseek_v3_fp8": DeepSeek-V3 (layer 0 dense, 1 and 2 MoE), every `*_proj.weight`
  F8_E4M3 [out, in] with a f32 `weight_scale_inv` [out/128, in/128] (the shared experts and
  the dense MLP too); "dbrx_fp8": DBRX's `experts.mlp.{w1,v1,w2}` [E*F, D], each F8_E4M3.
  Hidden size d, expert hidden size f. `quantized=False`: the same values in float32, without
  quantization_config.

  Returns:
    tensors: name -> the array written.
  """
  folder.mkdir(parents=True, exist_ok=True)
  rng = np.random.default_rng(seed)
  proj = ("gate_proj", "up_proj", "down_proj")
  if model_type == "deepseek_v3_fp8":
    config = dict(
      hf_checkpoints.CONFIGS["deepseek_v3"], model_type="deepseek_v3", hidden_size=d,
      intermediate_size=f, moe_intermediate_size=f, n_routed_experts=experts, n_shared_experts=1
    )  # fmt: skip
    n = config["num_hidden_layers"]
    block = {"gate.weight": (experts, d), "gate.e_score_correction_bias": (experts,)}
    for j in range(experts):
      block.update(
        {f"experts.{j}.{p}.weight": (d, f) if p == "down_proj" else (f, d) for p in proj}
      )
    block.update(
      {f"shared_experts.{p}.weight": (d, f) if p == "down_proj" else (f, d) for p in proj}
    )
    dense = {f"{p}.weight": (d, f) if p == "down_proj" else (f, d) for p in proj}
  else:
    ffn = dict(
      hf_checkpoints.CONFIGS["dbrx"]["ffn_config"], ffn_hidden_size=f, moe_num_experts=experts
    )
    config = dict(
      hf_checkpoints.CONFIGS["dbrx"], model_type="dbrx", d_model=d, ffn_config=ffn
    )  # fmt: skip
    n = config["n_layers"]
    block = {"router.layer.weight": (experts, d)}
    block.update({f"experts.mlp.{w}": (experts * f, d) for w in ("w1", "v1", "w2")})
    dense = {}
  shapes = {"model.embed_tokens.weight": (11, d)}
  for i in range(n):
    p = PREFIX[model_type].format(i=i)
    shapes.update({p + k: s for k, s in (block if i in MOE_LAYERS[model_type] else dense).items()})
  tensors = {}
  for name, shape in shapes.items():
    if name.endswith(("_proj.weight", ".w1", ".v1", ".w2")):
      codes, scale, values = hf_checkpoints._fp8_matrix(rng, shape, (128, 128))
      if quantized:
        tensors[name], tensors[name + "_scale_inv"] = codes, scale
      else:
        tensors[name] = values
    else:
      tensors[name] = (rng.normal(size=shape) * 0.5).astype(np.float32)
  if quantized:
    config["quantization_config"] = FP8_128
  (folder / "config.json").write_text(json.dumps(config, indent=2))
  save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
  return tensors


def checkpoint(name, tmp_path):
  """The folder of a case: the transformers-made MXFP4 fixture, or an FP8 one written here."""
  if name == "gpt_oss_mxfp4":
    return FIXTURES / name
  write_fp8(tmp_path / name, name)
  return tmp_path / name


CASES = {"gpt_oss_mxfp4": "mxfp4", "deepseek_v3_fp8": "fp8", "dbrx_fp8": "fp8"}


def raw_tensors(folder):
  """name -> (dtype, shape, bytes) of every tensor of a folder's safetensors files."""
  out = {}
  for f in sorted(Path(folder).glob("*.safetensors")):
    raw = f.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8 : 8 + n])
    header.pop("__metadata__", None)
    for k, m in header.items():
      begin, end = m["data_offsets"]
      out[k] = (m["dtype"], tuple(m["shape"]), raw[8 + n + begin : 8 + n + end])
  return out


def named(tree, is_leaf=None):
  leaves = jax.tree_util.tree_leaves_with_path(tree, is_leaf=is_leaf)
  return {jax.tree_util.keystr(p, simple=True, separator="."): a for p, a in leaves}


def bits(a):
  """The bytes of an array (float8 and bfloat16 compared bit for bit)."""
  a = np.ascontiguousarray(np.asarray(a))
  return a.view(np.uint8).reshape(*a.shape, -1)


def kept_bytes(folder, layers, prefix):
  """Bytes the checkpoint stores for the routed experts' matrices of `layers`."""
  return sum(
    len(b)
    for k, (_, _, b) in raw_tensors(folder).items()
    for i in layers
    if k.startswith(prefix.format(i=i)) and "shared" not in k and k.endswith(KEPT_SUFFIXES)
  )


@pytest.fixture(scope="module")
def mesh24(devices):
  del devices  # conftest's fixture asserts the 8 simulated devices
  return jax.make_mesh((2, 4), ("data", "expert"))


# --------------------------------------------------------------------------- load


@pytest.mark.parametrize("dtype", [None, np.float32], ids=["stored", "f32"])
@pytest.mark.parametrize("name", CASES)
def test_kept_dequantizes_to_the_float_load(tmp_path, monkeypatch, name, dtype):
  folder = checkpoint(name, tmp_path)
  cfg, want = hf.load_moe_layers(folder, dtype=dtype)
  boom = lambda *a, **k: pytest.fail("a kept matrix was decoded on load")
  monkeypatch.setattr(layouts, "dequantize", boom)
  monkeypatch.setattr(fp8, "dequantize", boom)
  cfg_q, got = hf.load_moe_layers(folder, dtype=dtype, keep_quantized=True)
  assert cfg_q == dataclasses.replace(cfg, weights_format=CASES[name])
  got, want = named(got, is_quantized), named(want)
  assert sorted(got) == sorted(want)
  # DeepSeek-V3's shared experts are block-FP8 too: kept as well.
  kept = ("experts.", "shared.") if name == "deepseek_v3_fp8" else ("experts.",)
  matrices = [k for k in want if k.startswith(kept) and want[k].ndim == 4]
  assert len(matrices) == 3 * len(kept)
  assert matrices and all(is_quantized(got[k]) for k in matrices)
  for k, w in want.items():
    a = got[k]
    if is_quantized(a):
      assert a.fmt == CASES[name] and a.dtype == cfg.param_dtype and a.shape == w.shape, k
      a = a.dequantize()
    assert a.dtype == w.dtype, k
    np.testing.assert_array_equal(bits(a), bits(w), err_msg=k)


@pytest.mark.parametrize("name", CASES)
def test_kept_holds_the_checkpoint_bytes(tmp_path, name):
  folder = checkpoint(name, tmp_path)
  layers = MOE_LAYERS[name]
  hf.reset_bytes_read()
  _, params = hf.load_moe_layers(folder, keep_quantized=True)
  read = hf.bytes_read()
  held = expert_bytes(params)
  stored = kept_bytes(folder, layers, PREFIX[name])
  assert held <= 1.05 * stored, (held, stored)
  assert held == stored  # values and scales are the stored tensors, one for one
  hf.reset_bytes_read()
  hf.load_moe_layers(folder)
  assert read == hf.bytes_read()  # the same bytes as the float load, each once


@pytest.mark.parametrize("name", CASES)
def test_save_of_kept_gives_back_the_bytes(tmp_path, name):
  folder, out = checkpoint(name, tmp_path), tmp_path / "out"
  cfg, params = hf.load_moe_layers(folder, keep_quantized=True)
  hf.save_moe_layers(out, cfg, params, like=folder)
  before, after = raw_tensors(folder), raw_tensors(out)
  assert sorted(after) == sorted(before)
  for k, (dtype, shape, b) in before.items():
    assert after[k][:2] == (dtype, shape), k
    assert after[k][2] == b, k
  assert json.loads((out / "config.json").read_text()) == json.loads(
    (folder / "config.json").read_text()
  )


@pytest.mark.parametrize("name", ["deepseek_v3_fp8", "gpt_oss_mxfp4"])
def test_round_trips_on_the_default_mesh(tmp_path, name):
  """On jax.make_mesh's default (Explicit) mesh, what a user does: a float load (bfloat16,
  the default) saved back, and a kept load dequantized (the guide's route) saved back, each
  give the checkpoint's bytes, FP8's 448 codes included (bfloat16's rounding carries them a
  little past 448 times their scale; they saturate back); the dequantized matrices keep the
  experts' split."""
  folder = checkpoint(name, tmp_path)
  if name == "deepseek_v3_fp8":  # the fixture holds 448 codes, as real releases do
    tensors = write_fp8(tmp_path / "again", name)
    assert any(np.any(np.abs(t.astype(np.float32)) == 448) for t in tensors.values())
  mesh = jax.make_mesh((2, 4), ("data", "expert"))
  cfg, floats = hf.load_moe_layers(folder, mesh=mesh)
  _, kept = hf.load_moe_layers(folder, mesh=mesh, keep_quantized=True)
  deq = ms.dequantize_experts(kept)
  assert deq.experts.down_EFD.sharding.spec == P(None, "expert", None, None)
  assert deq.experts.down_EFD.dtype == cfg.param_dtype
  assert name != "deepseek_v3_fp8" or cfg.param_dtype == jnp.bfloat16
  before = raw_tensors(folder)
  for i, params in enumerate((floats, deq)):
    hf.save_moe_layers(tmp_path / f"out{i}", cfg, params, like=folder)
    after = raw_tensors(tmp_path / f"out{i}")
    assert sorted(after) == sorted(before)
    for k, t in before.items():
      assert after[k] == t, k


def test_float_checkpoint_loads_as_float(tmp_path):
  hf_checkpoints.write(tmp_path, "mixtral")
  cfg, want = hf.load_moe_layer(tmp_path, 1)
  cfg_q, got = hf.load_moe_layer(tmp_path, 1, keep_quantized=True)
  assert cfg_q == cfg and cfg_q.weights_format is None
  assert jax.tree.structure(got) == jax.tree.structure(want)
  for a, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    np.testing.assert_array_equal(a, w)


# --------------------------------------------------------------------------- mesh


@pytest.mark.parametrize("tensor_axis", [None, "data"], ids=["expert", "expert+tensor"])
@pytest.mark.parametrize("name", ["gpt_oss_mxfp4", "deepseek_v3_fp8"])
def test_kept_on_a_mesh_matches_one_device(tmp_path, name, tensor_axis, mesh24):
  folder = checkpoint(name, tmp_path)
  _, one = hf.load_moe_layers(folder, keep_quantized=True)
  cfg, got = hf.load_moe_layers(
    folder, mesh=mesh24, keep_quantized=True, expert_tensor_axis=tensor_axis
  )
  float_specs = named(ms.moe_param_specs(dataclasses.replace(cfg, weights_format=None)))
  got_q, one = named(got, is_quantized), named(one, is_quantized)
  for k, a in got_q.items():
    spec = P(None, *float_specs[k])
    for part, w in zip(("values", "scales"), a.arrays() if is_quantized(a) else [a]):
      x = getattr(a, part) if is_quantized(a) else a
      w = getattr(one[k], part) if is_quantized(a) else one[k]
      assert x.sharding.spec == spec, (k, part, x.sharding.spec, spec)
      assert x.shape == w.shape and x.dtype == w.dtype, (k, part)
      for shard in x.addressable_shards:
        np.testing.assert_array_equal(bits(shard.data), bits(np.asarray(w)[shard.index]))
  # The library's own specs of the matrices, given to values and scales alike (the routed
  # experts', and DeepSeek-V3's kept shared experts'), agree.
  is_spec = lambda x: isinstance(x, P)
  specs = ms.moe_param_specs(dataclasses.replace(cfg, weights_format=None))
  specs = expand(jax.tree.map(lambda s: P(None, *s), specs, is_leaf=is_spec), got)
  for a, spec in zip(jax.tree.leaves(got), jax.tree.leaves(specs, is_leaf=is_spec), strict=True):
    assert a.sharding.spec == spec


@pytest.mark.parametrize("name", CASES)
def test_kept_on_a_mesh_reads_each_byte_once(tmp_path, name, mesh24):
  folder = checkpoint(name, tmp_path)
  layer = MOE_LAYERS[name][0]
  p = PREFIX[name].format(i=layer)
  block = sum(len(b) for k, (_, _, b) in raw_tensors(folder).items() if k.startswith(p))
  for mesh in (None, mesh24):
    hf.reset_bytes_read()
    hf.load_moe_layer(folder, layer, mesh=mesh, keep_quantized=True)
    assert hf.bytes_read() == block, mesh


# --------------------------------------------------------------------------- the layer


def rel_err(a, b):
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  return float(np.abs(a - b).max() / np.abs(b).max())


@pytest.mark.parametrize("impl", ["one_device", "all_to_all"])
def test_layer_on_kept_mxfp4_matches_transformers(impl, mesh24):
  # transformers' GptOssMLP on the fixture (tests/test_hf_models.py): y and dx within 1e-5.
  folder = FIXTURES / "gpt_oss_mxfp4"
  io = np.load(folder / "moe_io.npz")
  mesh = None if impl == "one_device" else mesh24
  cfg, params = hf.load_moe_layer(folder, int(io["layer"]), mesh=mesh, keep_quantized=True)
  assert isinstance(params.experts.gate_EDF, QuantizedArray)
  if mesh is not None:
    cfg = dataclasses.replace(cfg, impl=impl)

  def loss(x_BSD):
    y_BSD, _ = ms.moe_layer(params, x_BSD, cfg, mesh=mesh)
    return jnp.sum(y_BSD * io["r_BSD"]), y_BSD

  grad = jax.jit(jax.grad(loss, has_aux=True), compiler_options=FAST_COMPILE)
  dx_BSD, y_BSD = grad(jnp.asarray(io["x_BSD"]))
  err_y, err_dx = rel_err(y_BSD, io["y_BSD"]), rel_err(dx_BSD, io["dx_BSD"])
  assert err_y <= 1e-5 and err_dx <= 1e-5, f"y {err_y:.2e}, dx {err_dx:.2e}"


def test_layer_on_kept_deepseek_v3_fp8_shared_experts(tmp_path):
  """DeepSeek-V3 with keep_quantized=True: routed and shared experts FP8 as stored, the layer
  equals the layer on the float load (the same values: the float load's bytes dequantized)."""
  folder = checkpoint("deepseek_v3_fp8", tmp_path)
  cfg, floats = hf.load_moe_layer(folder, 1, dtype=jnp.float32)
  cfg_q, kept = hf.load_moe_layer(folder, 1, dtype=jnp.float32, keep_quantized=True)
  assert isinstance(kept.shared.down_EFD, QuantizedArray) and kept.shared.down_EFD.fmt == "fp8"
  assert cfg_q.weights_format == "fp8"
  x = jax.random.normal(jax.random.key(0), (2, 4, cfg.d_model))
  cfg, cfg_q = (dataclasses.replace(c, gmm_impl="ragged_dot") for c in (cfg, cfg_q))
  y, _ = ms.moe_layer(floats, x, cfg)
  y_q, _ = ms.moe_layer(kept, x, cfg_q)
  assert rel_err(y_q, y) <= 1e-6


# --------------------------------------------------------------------------- errors


def test_error_fp8_blocks_other_than_128(tmp_path):
  hf_checkpoints.write(tmp_path, "deepseek_v3_fp8")  # blocks of 3 x 5
  with pytest.raises(
    ValueError,
    match=r"load_moe_layer: keep_quantized=True cannot keep block-FP8 tensor "
    r"'model\.layers\.1\.mlp\.experts\.0\.gate_proj\.weight': its blocks are \[3, 5\].*"
    r"pass keep_quantized=False",
  ):
    hf.load_moe_layer(tmp_path, 1, keep_quantized=True)


def test_error_fp8_block_that_does_not_divide(tmp_path):
  write_fp8(tmp_path, "deepseek_v3_fp8", f=192)  # a partial block of 64 rows at the edge
  hf.load_moe_layers(tmp_path)  # loads dequantized
  with pytest.raises(
    ValueError,
    match=r"load_moe_layers: keep_quantized=True cannot keep block-FP8 tensor "
    r"'model\.layers\.1\.mlp\.experts\.0\.gate_proj\.weight' of shape \(192, 128\): its out "
    r"dimension \(192\) is not a multiple of the block \(128\).*keep_quantized=False",
  ):
    hf.load_moe_layers(tmp_path, keep_quantized=True)


def test_error_dbrx_rows_of_one_expert_across_a_block(tmp_path):
  write_fp8(tmp_path, "dbrx_fp8", f=64)  # [E*F, D] = [512, 128]: expert 1 starts mid-block
  with pytest.raises(
    ValueError,
    match=r"cannot keep block-FP8 tensor 'transformer\.blocks\.0\.ffn\.experts\.mlp\.w1' "
    r"of shape \(512, 128\): its one expert's rows dimension \(64\) is not a multiple",
  ):
    hf.load_moe_layer(tmp_path, 0, keep_quantized=True)


def test_error_experts_stored_in_mixed_formats(tmp_path):
  T = write_fp8(tmp_path, "deepseek_v3_fp8")
  name = "model.layers.1.mlp.experts.3.up_proj.weight"
  T[name] = T[name].astype(np.float32) * np.float32(T.pop(name + "_scale_inv")[0, 0])
  save_file(T, tmp_path / "model.safetensors", metadata={"format": "pt"})
  with pytest.raises(
    ValueError,
    match=r"cannot keep fp8 tensor 'model\.layers\.1\.mlp\.experts\.0\.up_proj\.weight': one "
    r"tensor per expert, some of them not fp8",
  ):
    hf.load_moe_layer(tmp_path, 1, keep_quantized=True)


def test_error_mesh_axis_that_does_not_divide_the_scales(tmp_path):
  write_fp8(tmp_path, "deepseek_v3_fp8")  # F = 256: two FP8 blocks of columns
  mesh = jax.make_mesh((4, 2), ("data", "expert"))
  hf.load_moe_layer(tmp_path, 1, mesh=mesh, expert_tensor_axis="data")  # F / 4 = 64 columns
  with pytest.raises(
    ValueError,
    match=r"load_moe_layer: keep_quantized=True cannot split params\.experts\.gate_EDF\.scales "
    r"of shape \(8, 1, 2\) over the mesh axes \('data',\) \(size 4\): its dimension 2 \(2\)",
  ):
    hf.load_moe_layer(tmp_path, 1, mesh=mesh, expert_tensor_axis="data", keep_quantized=True)


def test_error_save_int8_into_an_mxfp4_checkpoint(tmp_path):
  folder = FIXTURES / "gpt_oss_mxfp4"
  cfg, params = hf.load_moe_layers(folder)
  q = quantize_experts(params, "int8")
  with pytest.raises(
    ValueError,
    match=r"save_moe_layers: params\.experts\.gate_EDF is a QuantizedArray in 'int8', but "
    r".* stores tensor 'model\.layers\.0\.mlp\.experts\.gate_up_proj' as 'mxfp4'.*"
    r"dequantize_experts",
  ):
    hf.save_moe_layers(tmp_path / "out", cfg, q, like=folder)


def test_error_save_mxfp4_into_an_fp8_checkpoint(tmp_path):
  write_fp8(tmp_path / "src", "deepseek_v3_fp8")
  cfg, params = hf.load_moe_layers(tmp_path / "src")
  q = quantize_experts(params, "mxfp4")
  with pytest.raises(
    ValueError,
    match=r"params\.experts\.gate_EDF is a QuantizedArray in 'mxfp4', but .* stores tensor "
    r"'model\.layers\.1\.mlp\.experts\.0\.gate_proj\.weight' as 'fp8'",
  ):
    hf.save_moe_layers(tmp_path / "out", cfg, q, like=tmp_path / "src")


def test_error_save_quantized_into_a_float_checkpoint(tmp_path):
  write_fp8(tmp_path / "src", "deepseek_v3_fp8")
  cfg, params = hf.load_moe_layers(tmp_path / "src", keep_quantized=True)
  write_fp8(tmp_path / "float", "deepseek_v3_fp8", quantized=False)
  with pytest.raises(
    ValueError,
    match=r"params\.experts\.gate_EDF is a QuantizedArray in 'fp8', but .* stores tensor "
    r"'model\.layers\.1\.mlp\.experts\.0\.gate_proj\.weight' as F32 floats",
  ):
    hf.save_moe_layers(tmp_path / "out", cfg, params, like=tmp_path / "float")
