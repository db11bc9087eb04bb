"""Quantized expert matrices (`quant.py`) against independent float64 models.

* The decoded values: MXFP4 and block-FP8 against the NumPy decoders of the checkpoint
  formats (`hf.mxfp4`, `hf.fp8`, written for the loader from the formats' specs), int8
  against `values * scale` by hand; the bytes held per weight.
* The grouped matmul on a quantized w, every backend that takes one, forward and dx,
  against a float64 grouped matmul of the decoded values.
* The layer on quantized experts, every dispatch on one device and on 8, against the
  float64 layer model of `tests/layer_oracle.py` on the decoded values: y within 2e-5 of
  the largest entry, and the gradients of x, the router and the expert biases against the
  model's central differences. The quantized leaves' gradients are
  zero (float0 for integer values).
* Expert tensor and FSDP axes, `init_moe_params` / `moe_param_specs` with
  `weights_format`, the NNX and Equinox modules, and every error path.
"""

import dataclasses
import math
import re

import jax
import jax.numpy as jnp
import layer_oracle
import numpy as np
import pytest
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

import moe_shard as ms
from moe_shard import matmuls, quant
from moe_shard.hf import fp8 as hf_fp8
from moe_shard.hf import mxfp4 as hf_mxfp4
from moe_shard.kernels.grouped_matmul import QUANTIZED_WEIGHTS

# The accuracy bound for float32: y and gradients within 2e-5 of the largest entry.
RTOL = 2e-5
# (d_model, d_ff) per format: the smallest sizes the format's blocks divide.
DIMS = {"int8": (16, 32), "fp8": (128, 128), "mxfp4": (32, 64)}
B, S, E, K = 2, 4, 8, 2  # T = 8 tokens: 1 per device on 8 devices


def np_decode(q):
  """The values of q by the checkpoint formats' NumPy decoders: f64[..., I, O]."""
  v, s = np.asarray(q.values), np.asarray(q.scales)
  if q.fmt == "int8":  # the product rounded to float32, as the format defines it
    return (v.astype(np.float32) * s.astype(np.float32)).astype(np.float64)
  if q.fmt == "fp8":  # hf.fp8 decodes one [out, in] matrix with [out/bo, in/bi] scales
    return np.stack(
      [hf_fp8.dequantize(vi.T, si.T, (128, 128), np.float64).T for vi, si in zip(v, s)]
    )
  # mxfp4: ours [E, I/2, O] and [E, I/32, O]; the checkpoint's [E, O, I/32, 16] and [E, O, I/32]
  E_, half, O = v.shape
  blocks = v.transpose(0, 2, 1).reshape(E_, O, half // 16, 16)
  return hf_mxfp4.dequantize(blocks, s.transpose(0, 2, 1), np.float64).transpose(0, 2, 1)


@pytest.mark.parametrize("fmt", quant.FORMATS)
def test_dequantize_matches_the_formats_decoders(fmt):
  w = jax.random.normal(jax.random.key(0), (3, 256, 128)) * 0.3
  q = quant.quantize(w, fmt)
  np.testing.assert_array_equal(np.asarray(q.dequantize(), np.float64), np_decode(q))
  # Quantization error within half a step of the format (int8: 1/254 of the column's max;
  # fp8 e4m3: 2^-4 relative; mxfp4: half the largest gap, 1.0, times the block's scale,
  # which is below a third of the block's max since max / scale > 3).
  err = np.abs(np.asarray(q.dequantize()) - np.asarray(w))
  bound = {"int8": 0.51 / 127, "fp8": 2**-4, "mxfp4": 0.34}[fmt]
  assert err.max() <= bound * np.abs(np.asarray(w)).max()


def test_mxfp4_bytes_are_the_checkpoint_quantizers():
  """gpt-oss's own encoding (hf.mxfp4.quantize, NumPy) gives the same bytes, transposed."""
  w = np.asarray(jax.random.normal(jax.random.key(1), (2, 64, 96)), np.float32)
  q = quant.quantize(jnp.asarray(w), "mxfp4")
  blocks, scales = hf_mxfp4.quantize(w.transpose(0, 2, 1))
  np.testing.assert_array_equal(
    np.asarray(q.values).transpose(0, 2, 1).reshape(blocks.shape), blocks
  )
  np.testing.assert_array_equal(np.asarray(q.scales).transpose(0, 2, 1), scales)


@pytest.mark.parametrize(("fmt", "most"), [("int8", 1.07), ("fp8", 1.07), ("mxfp4", 0.56)])
def test_bytes_per_weight_as_held(fmt, most):
  """Values and scales per weight, at a model's size (shapes only, nothing allocated)."""
  for shape in [(8, 2048, 4096), (8, 4096, 2048), (128, 2944, 2944)]:
    if fmt == "fp8" and any(n % 128 for n in shape[1:]):
      continue
    q = jax.eval_shape(lambda w: quant.quantize(w, fmt), jax.ShapeDtypeStruct(shape, jnp.bfloat16))
    per_weight = q.nbytes / math.prod(shape)
    assert per_weight <= most, (shape, per_weight)


# --------------------------------------------------------------------------- grouped matmul


@pytest.mark.parametrize("fmt", quant.FORMATS)
# Every backend that takes a quantized w and runs off a GPU (mosaic_gpu decodes the whole w,
# then runs its Hopper kernel: tests/test_gpu.py).
@pytest.mark.parametrize("impl", sorted(set(QUANTIZED_WEIGHTS) - {"mosaic_gpu"}))
def test_grouped_matmul_on_quantized_weights(fmt, impl):
  D, F = DIMS[fmt]
  G, M = 4, 48
  sizes = np.array([10, 0, 25, 9])  # an empty group, and rows past the groups' sum
  x = jax.random.normal(jax.random.key(2), (M, D))
  q = quant.quantize(jax.random.normal(jax.random.key(3), (G, D, F)), fmt)
  w64, x64 = np_decode(q), np.asarray(x, np.float64)
  ct = np.asarray(jax.random.normal(jax.random.key(4), (M, F)), np.float64)
  want, want_dx = np.zeros((M, F)), np.zeros((M, D))
  for g, (lo, hi) in enumerate(zip(np.cumsum(sizes) - sizes, np.cumsum(sizes))):
    want[lo:hi] = x64[lo:hi] @ w64[g]
    want_dx[lo:hi] = ct[lo:hi] @ w64[g].T

  def f(x):
    return ms.grouped_matmul(x, q, jnp.asarray(sizes, jnp.int32), impl=impl)

  y, vjp = jax.vjp(f, x)
  (dx,) = vjp(jnp.asarray(ct, jnp.float32))
  np.testing.assert_allclose(y, want, atol=RTOL * np.abs(want).max(), rtol=0)
  np.testing.assert_allclose(dx, want_dx, atol=RTOL * np.abs(want_dx).max(), rtol=0)


# --------------------------------------------------------------------------- the layer


def _config(fmt, **overrides):
  D, F = DIMS[fmt]
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


def _case(fmt, seed=0):
  """Quantized params (biases drawn nonzero), x, ct, and the float64 params the model sees."""
  cfg = _config(fmt)
  params = ms.init_moe_params(jax.random.key(seed), cfg)
  rng = np.random.default_rng(seed)
  experts = params.experts
  biases = {
    f: jnp.asarray(0.1 * rng.normal(size=getattr(experts, f).shape), jnp.float32)
    for f in ("gate_b_EF", "up_b_EF", "down_b_ED")
  }
  router = jnp.asarray(rng.normal(size=params.router_DE.shape) * 2.0, jnp.float32)
  params = dataclasses.replace(
    params, experts=dataclasses.replace(experts, **biases), router_DE=router
  )
  q = ms.quantize_experts(params, fmt)
  decoded = {
    f.name: np_decode(getattr(q.experts, f.name))
    for f in dataclasses.fields(q.experts)
    if quant.is_quantized(getattr(q.experts, f.name))
  }
  p64 = layer_oracle.to_f64(
    dataclasses.replace(params, experts=dataclasses.replace(experts, **biases, **decoded))
  )
  D = cfg.d_model
  x = rng.normal(size=(B, S, D)).astype(np.float32)
  ct = rng.normal(size=(B, S, D)).astype(np.float32)
  return cfg, q, p64, x, ct


def _fd(p64, x, ct, cfg, h=1e-6):
  """Central differences of the model's loss in x, the router and two expert biases (one
  before the quantized matrices' activation, one after; not the quantized matrices, which
  are frozen, nor the float shared experts, which tests/test_layer_oracle.py covers)."""
  x = np.asarray(x, np.float64)

  def loss(p, x):
    return layer_oracle.loss(p, x, ct, cfg)

  def grad_of(get, put):
    a = np.array(get(), np.float64)
    g = np.zeros_like(a)
    for i in np.ndindex(a.shape):
      for sign in (1, -1):
        b = a.copy()
        b[i] += sign * h
        g[i] += sign * put(b) / (2 * h)
    return g

  out = {"x": grad_of(lambda: x, lambda b: loss(p64, b))}
  out["router_DE"] = grad_of(
    lambda: p64.router_DE, lambda b: loss(dataclasses.replace(p64, router_DE=b), x)
  )
  for f in ("gate_b_EF", "down_b_ED"):
    out[f] = grad_of(
      lambda f=f: getattr(p64.experts, f),
      lambda b, f=f: loss(
        dataclasses.replace(p64, experts=dataclasses.replace(p64.experts, **{f: b})), x
      ),
    )
  return out


_ORACLE = {}


def _oracle(fmt):
  """(cfg, q, x, ct, y64, grads64) of a format, built once per test process."""
  if fmt not in _ORACLE:
    cfg, q, p64, x, ct = _case(fmt)
    y64, _ = layer_oracle.layer(p64, x, cfg)
    _ORACLE[fmt] = (cfg, q, x, ct, y64, _fd(p64, x, ct, cfg))
  return _ORACLE[fmt]


def _mesh8():
  return jax.make_mesh((2, 4), ("data", "expert"), axis_types=(AxisType.Auto,) * 2)


# Every dispatch, on one device and on 8, each format on several: the formats differ only
# in the decode, which every grouped-matmul backend is checked for above.
DISPATCHES = [
  ("masked_scan", False, "int8"),
  ("ragged_dot", False, "fp8"),
  ("ragged_dot", True, "mxfp4"),
  ("all_gather", True, "int8"),
  ("all_to_all", True, "mxfp4"),
  ("all_to_all", True, "int8"),
  ("ragged_all_to_all", True, "mxfp4"),
]


def _assert_rel(got, want, what):
  want = np.asarray(want, np.float64)
  err = np.abs(np.asarray(got, np.float64) - want).max() / np.abs(want).max()
  assert err <= RTOL, f"{what}: {err:.2e} of the largest entry"


@pytest.mark.parametrize(("impl", "on_mesh", "fmt"), DISPATCHES)
def test_layer_on_quantized_experts_matches_the_float64_model(impl, on_mesh, fmt):
  cfg, q, x, ct, y64, g64 = _oracle(fmt)
  cfg = dataclasses.replace(cfg, impl=impl)
  mesh = _mesh8() if on_mesh else None

  def loss(trainable, frozen, x):
    y, aux = ms.moe_layer(ms.merge_trainable(trainable, frozen), x, cfg, mesh=mesh)
    return jnp.sum(y * ct) + aux["aux_loss"], y

  trainable, frozen = ms.split_trainable(q)
  (_, y), (gp, gx) = jax.jit(jax.value_and_grad(loss, argnums=(0, 2), has_aux=True))(
    trainable, frozen, jnp.asarray(x)
  )
  _assert_rel(y, y64, "y")
  _assert_rel(gx, g64["x"], "dx")
  _assert_rel(gp.router_DE, g64["router_DE"], "d router_DE")
  for f in ("gate_b_EF", "down_b_ED"):
    _assert_rel(getattr(gp.experts, f), g64[f], f"d experts.{f}")
  assert np.any(np.asarray(gp.shared.down_EFD))  # the shared experts train
  for f in ("gate_EDF", "up_EDF", "down_EFD"):  # split off: no gradient at all
    assert getattr(gp.experts, f).values is None and getattr(gp.experts, f).scales is None


@pytest.mark.parametrize("fmt", ["int8", "mxfp4"])
def test_expert_tensor_and_fsdp_axes_split_quantized_matrices(fmt):
  """Values and scales split over the tensor axis (F) and FSDP axis (each matrix's last
  dimension) like the matrices; the layer equals the model."""
  cfg, q, x, _, y64, _ = _oracle(fmt)
  mesh = _mesh8()
  for split in (dict(expert_tensor_axis="data"), dict(expert_fsdp_axis="data")):
    c = dataclasses.replace(cfg, impl="all_to_all", **split)
    y, _ = jax.jit(lambda q, x, c=c: ms.moe_layer(q, x, c, mesh=mesh))(q, jnp.asarray(x))
    _assert_rel(y, y64, f"y with {split}")


def test_init_and_specs_with_weights_format():
  cfg = _config("mxfp4", weights_format="mxfp4")
  mesh = jax.make_mesh((2, 4), ("data", "expert"))
  with jax.set_mesh(mesh):
    params = ms.init_moe_params(jax.random.key(0), cfg, mesh=mesh)
  float_params = ms.init_moe_params(
    jax.random.key(0), dataclasses.replace(cfg, weights_format=None)
  )
  gate = params.experts.gate_EDF
  assert isinstance(gate, ms.QuantizedArray) and gate.fmt == "mxfp4"
  assert gate.values.dtype == jnp.uint8 and gate.values.shape == (E, 16, 64)
  # The same draws as the float init, quantized.
  want = ms.quantize_experts(float_params, "mxfp4").experts.gate_EDF
  np.testing.assert_array_equal(gate.values, want.values)
  np.testing.assert_array_equal(gate.scales, want.scales)
  specs = ms.moe_param_specs(cfg)
  assert specs.experts.gate_EDF.values == jax.P("expert", None, None)
  assert gate.values.sharding.spec == specs.experts.gate_EDF.values
  assert gate.scales.sharding.spec == specs.experts.gate_EDF.scales
  shapes = ms.moe_param_shapes(cfg)
  assert shapes.experts.down_EFD.scales.shape == (E, 2, 32)
  # A float params tree does not fit a quantized config.
  with pytest.raises(ValueError, match=re.escape("must be a QuantizedArray ('mxfp4')")):
    ms.moe_layer(float_params, jnp.zeros((1, 2, 32)), cfg)


def test_int8_scales_are_not_split_over_the_input_axis():
  """int8's one scale per output channel: splitting down's F over a tensor axis leaves its
  [E, 1, D] scales whole on that axis."""
  cfg = _config("int8", weights_format="int8", expert_tensor_axis="data")
  specs = ms.moe_param_specs(cfg)
  assert specs.experts.down_EFD.values == jax.P("expert", "data", None)
  assert specs.experts.down_EFD.scales == jax.P("expert", None, None)


def test_nnx_and_equinox_modules_hold_quantized_experts():
  import equinox as eqx
  from flax import nnx as flax_nnx

  from moe_shard.equinox import MoE as EqxMoE
  from moe_shard.nnx import MoE as NnxMoE
  from moe_shard.nnx import Quantized

  cfg = _config("int8", weights_format="int8")
  x = jax.random.normal(jax.random.key(5), (2, 4, cfg.d_model))
  m = NnxMoE(cfg, rngs=flax_nnx.Rngs(0))
  assert isinstance(m.experts.gate_EDF.values, Quantized)
  grads = flax_nnx.grad(lambda m: jnp.sum(m(x)[0] ** 2))(m)
  paths = {".".join(map(str, p)) for p, _ in flax_nnx.to_flat_state(flax_nnx.state(grads))}
  assert "router_DE" in paths and "experts.down_b_ED" in paths
  assert not [p for p in paths if "values" in p or "scales" in p], paths
  e = EqxMoE.from_params(cfg, m.moe_params())
  np.testing.assert_array_equal(e(x)[0], m(x)[0])
  # The whole module: its float scales would be differentiated, which the layer refuses.
  with pytest.raises(TypeError, match=re.escape("params.experts.gate_EDF, params.experts.up_EDF")):
    eqx.filter_grad(lambda e: jnp.sum(e(x)[0] ** 2))(e)
  trainable, frozen = eqx.partition(e, ms.trainable_mask(e))
  ge = eqx.filter_grad(lambda t: jnp.sum(eqx.combine(t, frozen)(x)[0] ** 2))(trainable)
  assert ge.params.experts.gate_EDF.values is None and ge.params.experts.gate_EDF.scales is None
  assert np.any(np.asarray(ge.params.router_DE))


# --------------------------------------------------------------------------- errors


def test_errors_name_the_argument():
  params = ms.init_moe_params(jax.random.key(0), _config("int8"))
  with pytest.raises(
    ValueError,
    match=re.escape("quantize_experts: fmt must be one of ('int8', 'fp8', 'mxfp4') (got 'int4')"),
  ):
    ms.quantize_experts(params, "int4")
  with pytest.raises(
    ValueError,
    match=re.escape(
      "experts.gate_EDF's input dimension (16) must be divisible by the 'fp8' block (128)"
    ),
  ):
    ms.quantize_experts(params, "fp8")
  with pytest.raises(ValueError, match=re.escape("MoEConfig: weights_format must be one of")):
    _config("int8", weights_format="nf4")
  with pytest.raises(
    ValueError,
    match=re.escape(
      "MoEConfig: weights_format 'mxfp4': gate_EDF's input dimension (48) must be divisible by the 'mxfp4' block (32)"
    ),
  ):
    _config("int8", weights_format="mxfp4", d_model=48)
  q = ms.quantize_experts(params, "int8").experts.gate_EDF
  with pytest.raises(
    ValueError,
    match=re.escape(
      "grouped_matmul: w_GDF is a QuantizedArray ('int8'), which impl 'tokamax' cannot take"
    ),
  ):
    ms.grouped_matmul(jnp.zeros((4, 16)), q, jnp.array([1] * E), impl="tokamax")
  with pytest.raises(
    IndexError,
    match=re.escape("QuantizedArray: only the axes before the matrix's last two can be indexed"),
  ):
    q[0, 1]


@pytest.mark.parametrize(
  "fmt,M",
  [(fmt, 12) for fmt in quant.FORMATS] + [("int8", matmuls.KERNEL_ROWS + 1)],
  ids=lambda v: str(v),
)
def test_masked_matmul_on_quantized_weights(fmt, M):
  """One local expert: valid rows get x @ w[0] by the grouped matmul's decode (int8 past
  `KERNEL_ROWS` rows: as the operand of an XLA dot), padding rows zeros; dx likewise (the
  rows in any order)."""
  D, F = DIMS[fmt]
  valid = np.arange(M) % 3 != 0
  x = jax.random.normal(jax.random.key(6), (M, D))
  q = quant.quantize(jax.random.normal(jax.random.key(7), (1, D, F)), fmt)
  w64 = np_decode(q)[0]
  ct = np.asarray(jax.random.normal(jax.random.key(8), (M, F)), np.float64)
  y, vjp = jax.vjp(lambda x: ms.MaskedMatmul(jnp.asarray(valid))(x, q), x)
  (dx,) = vjp(jnp.asarray(ct, jnp.float32))
  want = np.where(valid[:, None], np.asarray(x, np.float64) @ w64, 0.0)
  want_dx = np.where(valid[:, None], ct, 0.0) @ w64.T
  np.testing.assert_allclose(y, want, atol=RTOL * np.abs(want).max(), rtol=0)
  np.testing.assert_allclose(dx, want_dx, atol=RTOL * np.abs(want_dx).max(), rtol=0)


@pytest.mark.parametrize("M", [matmuls.KERNEL_ROWS, matmuls.KERNEL_ROWS + 1])
def test_masked_matmul_int8_takes_the_kernel_at_decode_rows(M):
  """int8 goes through the grouped matmul's kernel (a pallas_call in its TPU branch) at up to
  `KERNEL_ROWS` rows, where XLA:TPU would copy the s8 matrix into VMEM before its dot; past
  them, through XLA's dot."""
  D, F = DIMS["int8"]
  q = quant.quantize(jnp.ones((1, D, F)), "int8")
  mm = ms.MaskedMatmul(jnp.ones((M,), bool))
  jaxpr = str(jax.make_jaxpr(lambda x: mm(x, q))(jnp.zeros((M, D), jnp.bfloat16)))
  assert ("pallas_call" in jaxpr) == (M <= matmuls.KERNEL_ROWS)


# --------------------------------------------------------------------------- fine-tuning


@pytest.mark.parametrize("fmt", quant.FORMATS)
def test_an_optimizer_cannot_corrupt_quantized_experts(fmt):
  """The whole tree differentiated: a TypeError naming the frozen matrices whose float
  scales or values would be differentiated (int8, fp8; MXFP4's arrays are integers, which
  JAX gives float0 under allow_int without tracing them: documented). The recipe (split by
  `trainable_mask`, adam on the trainable part) leaves every quantized array as it was, the
  shared experts quantized too."""
  import optax

  cfg = _config(fmt)
  q = ms.quantize_experts(ms.init_moe_params(jax.random.key(0), cfg), fmt)
  q = dataclasses.replace(q, shared=ms.quantize_experts(q.shared, "int8"))
  x = jax.random.normal(jax.random.key(1), (B, S, cfg.d_model))

  def loss(params, x):
    y, aux = ms.moe_layer(params, x, cfg)
    return jnp.mean(y**2) + aux["aux_loss"]

  if fmt == "mxfp4":  # its routed matrices are integer arrays only: the int8 shared raise
    with pytest.raises(TypeError, match=re.escape("moe_layer: params.shared.gate_EDF, ")):
      jax.grad(loss, allow_int=True)(q, x)
  else:
    names = "params.experts.gate_EDF, params.experts.up_EDF, params.experts.down_EFD"
    with pytest.raises(TypeError, match=re.escape(names) + ".*ms.split_trainable"):
      jax.grad(loss, allow_int=True)(q, x)
  mask = ms.trainable_mask(q)
  assert mask.experts.gate_EDF == dataclasses.replace(
    q.experts.gate_EDF, values=False, scales=False
  )
  assert mask.router_DE is True and mask.experts.gate_b_EF is True
  tx = optax.adam(1e-2)

  @jax.jit
  def step(trainable, frozen, opt_state, x):
    value, grads = jax.value_and_grad(lambda t: loss(ms.merge_trainable(t, frozen), x))(trainable)
    updates, opt_state = tx.update(grads, opt_state, trainable)
    return optax.apply_updates(trainable, updates), opt_state, value

  trainable, frozen = ms.split_trainable(q)
  opt_state = tx.init(trainable)
  for _ in range(2):
    trainable, opt_state, value = step(trainable, frozen, opt_state, x)
  new = ms.merge_trainable(trainable, frozen)
  assert np.isfinite(float(value))
  for a, b in zip(jax.tree.leaves(ms.split_trainable(new)[1]), jax.tree.leaves(frozen)):
    np.testing.assert_array_equal(np.asarray(a).view(np.uint8), np.asarray(b).view(np.uint8))
  assert not np.array_equal(new.router_DE, q.router_DE)


def test_trainable_mask_freezes_the_router_bias():
  cfg = _config("int8", bias_balancing=True, num_shared_experts=0)
  params = ms.init_moe_params(jax.random.key(0), cfg)
  mask = ms.trainable_mask({"moe": params, "embed": jnp.zeros(3)})
  assert mask["moe"].router_bias is False and mask["moe"].router_DE is True
  assert mask["embed"] is True
  trainable, frozen = ms.split_trainable(params)
  assert trainable.router_bias is None and frozen.router_bias is params.router_bias


@pytest.mark.parametrize(
  ("axis_type", "fmt"), [(AxisType.Explicit, f) for f in quant.FORMATS] + [(AxisType.Auto, "fp8")]
)
def test_quantize_and_dequantize_on_either_axis_type(axis_type, fmt):
  """On jax.make_mesh's default Explicit axes (and Auto): quantize_experts and
  dequantize_experts run, the values, scales and dequantized matrices split like the
  matrix, the values bit for bit what they are off the mesh (init_moe_params with a
  weights_format on the default mesh: test_init_and_specs_with_weights_format)."""
  mesh = jax.make_mesh((2, 4), ("data", "expert"), axis_types=(axis_type,) * 2)
  cfg = _config(fmt, num_shared_experts=0)
  params = ms.init_moe_params(jax.random.key(0), cfg, mesh=mesh)
  want = ms.quantize_experts(jax.device_get(params), fmt).experts.down_EFD
  q = ms.quantize_experts(params, fmt)
  got = q.experts.down_EFD
  for a in got.arrays():
    assert a.sharding.spec == P("expert", None, None)
  np.testing.assert_array_equal(
    np.asarray(got.values).view(np.uint8), np.asarray(want.values).view(np.uint8)
  )
  # XLA may round the float scales' division differently in the sharded program: 1 ulp.
  np.testing.assert_allclose(got.scales, want.scales, rtol=2**-22)
  d = ms.dequantize_experts(q).experts.down_EFD
  assert d.sharding.spec == P("expert", None, None)
  np.testing.assert_allclose(d, want.dequantize(), rtol=2**-21)


# --------------------------------------------------------------------------- bad input


@pytest.mark.parametrize("fmt", quant.FORMATS)
def test_non_finite_weights_raise_or_stay_nan(fmt):
  """A NaN or Inf in the float weights: concrete, quantize_experts raises naming the leaf and
  the first index; traced (under jit), the block holding it dequantizes to NaN (int8: its
  column; fp8: its 128 x 128 block; mxfp4: its 32 rows of one column, e8m0's NaN scale) and
  no other value changes."""
  params = ms.init_moe_params(jax.random.key(0), _config(fmt, num_shared_experts=0))
  up = params.experts.up_EDF
  for bad in (jnp.nan, -jnp.inf):
    p = dataclasses.replace(
      params, experts=dataclasses.replace(params.experts, up_EDF=up.at[1, 3, 5].set(bad))
    )
    with pytest.raises(
      ValueError,
      match=re.escape(
        "quantize_experts: experts.up_EDF must be finite to be quantized (got 1 NaN or Inf values, the first at index (1, 3, 5))"
      ),
    ):
      ms.quantize_experts(p, fmt)
  got = jax.jit(lambda p: ms.quantize_experts(p, fmt))(p).experts.up_EDF.dequantize()
  want = ms.quantize_experts(params, fmt).experts.up_EDF.dequantize()
  block = {
    "int8": (slice(None), 5),
    "fp8": (slice(0, 128), slice(0, 128)),
    "mxfp4": (slice(0, 32), 5),
  }[fmt]
  nan = np.zeros(got.shape, bool)
  nan[(1, *block)] = True
  np.testing.assert_array_equal(np.isnan(got), nan)
  np.testing.assert_array_equal(np.asarray(got)[~nan], np.asarray(want)[~nan])


def test_malformed_quantized_arrays_raise_where_they_enter():
  """Scales or values of the wrong shape or dtype for their format raise, naming the leaf, in
  moe_layer, in a dispatch called directly and in grouped_matmul."""
  cfg = _config("int8", num_shared_experts=0)
  q = ms.quantize_experts(ms.init_moe_params(jax.random.key(0), cfg), "int8")
  g = q.experts.gate_EDF
  x = jnp.zeros((B, S, cfg.d_model))
  cases = [
    (
      dict(scales=g.scales[:, 0]),
      ValueError,
      "scales must have shape (8, 1, 32) for 'int8' values of shape (8, 16, 32) (got (8, 32))",
    ),
    (
      dict(scales=g.scales[:-1]),
      ValueError,
      "scales must have shape (8, 1, 32) for 'int8' values of shape (8, 16, 32) (got (7, 1, 32))",
    ),
    (
      dict(values=g.values.astype(jnp.uint8)),
      TypeError,
      "values of a 'int8' QuantizedArray must have dtype int8 (got uint8)",
    ),
    (
      dict(scales=g.scales.astype(jnp.bfloat16)),
      TypeError,
      "scales of a 'int8' QuantizedArray must have dtype float32 (got bfloat16)",
    ),
    (
      dict(fmt="int4"),
      ValueError,
      "gate_EDF.fmt must be one of ('int8', 'fp8', 'mxfp4') (got 'int4')",
    ),
  ]
  for change, kind, message in cases:
    bad = dataclasses.replace(g, **change)
    qq = dataclasses.replace(q, experts=dataclasses.replace(q.experts, gate_EDF=bad))
    with pytest.raises(
      kind,
      match=re.escape(f"moe_layer: params.experts.gate_EDF{'.' if 'fmt' not in change else ''}"),
    ):
      ms.moe_layer(qq, x, cfg)
    with pytest.raises(kind, match=re.escape(message)):
      ms.moe_layer(qq, x, cfg)
    with pytest.raises(kind, match=re.escape("moe_ragged_dot: w.gate_EDF")):
      ms.moe_ragged_dot(x[0], qq.experts, jnp.zeros((S, K), jnp.int32))
  mx = quant.quantize(jnp.ones((2, 64, 16)), "mxfp4")
  with pytest.raises(
    TypeError,
    match=re.escape(
      "grouped_matmul: w_GDF.scales of a 'mxfp4' QuantizedArray must have dtype uint8 (got float32)"
    ),
  ):
    ms.grouped_matmul(
      jnp.ones((4, 64)),
      dataclasses.replace(mx, scales=mx.scales.astype(jnp.float32)),
      jnp.array([2, 2]),
    )


# --------------------------------------------------------------------------- shared experts


def test_quantized_shared_experts_match_the_float64_model():
  """Shared experts quantized too (int8): the layer on one device and on 8 equals the
  float64 model on the decoded values, y and the gradients of x and the router; the
  quantized shared matrices are frozen like the routed ones."""
  cfg, q, p64, x, ct = _case("int8", seed=1)
  q = dataclasses.replace(q, shared=ms.quantize_experts(q.shared, "int8"))
  decoded = {f: np_decode(getattr(q.shared, f)) for f in ("gate_EDF", "up_EDF", "down_EFD")}
  p64 = dataclasses.replace(p64, shared=dataclasses.replace(p64.shared, **decoded))
  y64, _ = layer_oracle.layer(p64, x, cfg)
  g64 = _fd(p64, x, ct, cfg)
  trainable, frozen = ms.split_trainable(q)
  assert frozen.shared.gate_EDF.values is q.shared.gate_EDF.values

  for impl, mesh in (("ragged_dot", None), ("all_to_all", _mesh8())):
    c = dataclasses.replace(cfg, impl=impl)

    def loss(t, x, c=c, mesh=mesh):
      y, aux = ms.moe_layer(ms.merge_trainable(t, frozen), x, c, mesh=mesh)
      return jnp.sum(y * ct) + aux["aux_loss"], y

    (_, y), (gp, gx) = jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))(
      trainable, jnp.asarray(x)
    )
    _assert_rel(y, y64, f"{impl}: y")
    _assert_rel(gx, g64["x"], f"{impl}: dx")
    _assert_rel(gp.router_DE, g64["router_DE"], f"{impl}: d router_DE")
