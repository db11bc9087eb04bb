"""`quantized_gmm`: the Pallas TPU kernel on quantized weights (interpret mode on CPU) against a
float64 oracle made from `QuantizedArray.dequantize`, and compiled ahead of time for TPU v5e.

The oracle multiplies each group's rows by `dequantize(float32)` in float64 (with x rounded
to its dtype first, as the kernel sees it); rows past the groups' total are zeros. Group
sizes are values: cases of one shape, format and direction share a compile.
"""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from moe_shard import quant
from moe_shard.kernels import tpu as gmm_tpu
from moe_shard.kernels import tpu_quant

FORMATS = ("int8", "fp8", "mxfp4")
# Against the float64 oracle on the same dequantized values: float32 sums of 256 products
# (relative error a few 1e-7); the brief's bound for the layer is 2e-5. bf16 x: the products
# are exact in float32 (bf16 x bf16), so the same bound holds for a float32 result.
RTOL = 2e-5
M, D, F, G = 64, 256, 256, 3


@functools.cache
def _weights(fmt, dtype, seed=0):
  w = np.random.default_rng(seed).normal(size=(G, D, F)) / np.sqrt(D)
  return quant.quantize(jnp.asarray(w, dtype), fmt)


def _oracle(x_MK, q, group_sizes, transpose):
  """float64 [M, N]: row m of group g times deq(w)[g] (transposed: deq(w)[g]^T); zeros past
  the groups' total (sizes clipped to end by M)."""
  w = np.asarray(q.dequantize(jnp.float32), np.float64)
  x = np.asarray(x_MK.astype(jnp.float32), np.float64)
  out = np.zeros((x.shape[0], w.shape[1] if transpose else w.shape[2]))
  start = 0
  for g, size in enumerate(group_sizes):
    end = min(start + size, x.shape[0])
    out[start:end] = x[start:end] @ (w[g].T if transpose else w[g])
    start = end
  return out


def check(fmt, transpose, dtype, group_sizes, tiling=None, out_dtype=jnp.float32, seed=0, rows=M):
  q = _weights(fmt, dtype, seed)
  x = np.random.default_rng(seed + 1).normal(size=(rows, F if transpose else D))
  x = jnp.asarray(x, dtype)
  got = tpu_quant.quantized_gmm(
    x,
    q,
    jnp.asarray(group_sizes, jnp.int32),
    transpose_rhs=transpose,
    preferred_element_type=out_dtype,
    tiling=tiling,
    interpret=True,
  )
  want = _oracle(x, q, group_sizes, transpose)
  assert got.shape == want.shape and got.dtype == out_dtype
  got = np.asarray(got.astype(jnp.float32), np.float64)
  scale = np.max(np.abs(want)) if np.any(want) else 1.0
  # A bfloat16 result is the float32 one rounded: 2^-9 relative.
  rtol = RTOL if out_dtype == jnp.float32 else 2.0**-8
  np.testing.assert_allclose(got, want, rtol=rtol, atol=rtol * scale, err_msg=f"{group_sizes}")
  # Rows past the groups' total are exactly zero (the kernel leaves them unwritten).
  np.testing.assert_array_equal(got[min(sum(group_sizes), rows) :], 0)


def _random_sizes(seed):
  """G sizes with an empty group and a total below M: rows past it belong to no group."""
  rng = np.random.default_rng(seed)
  sizes = rng.multinomial(int(rng.integers(M // 2, M)), np.ones(G - 1) / (G - 1)).tolist()
  sizes.insert(int(rng.integers(0, G)), 0)
  return sizes


# Several row tiles (32 rows: group boundaries inside tiles, the group's block decoded once
# and reused by its next row tile), contraction tiles (the block decoded every step) and
# output column tiles. mxfp4 tiles D whole (256 < 1024) and F in 128s.
TILINGS = {
  ("int8", False): (32, 128, 128),
  ("int8", True): (32, 128, 128),
  ("fp8", False): (32, 128, 128),
  ("fp8", True): (32, 128, 128),
  ("mxfp4", False): (32, 256, 128),
  ("mxfp4", True): (32, 128, 256),
}


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("transpose", [False, True], ids=["fwd", "transposed"])
@pytest.mark.parametrize("fmt", FORMATS)
def test_matches_oracle(fmt, transpose, dtype):
  # float32 x: the default tiles (one 128-row tile, 64 rows padded; D and F whole);
  # bfloat16 x: several tiles of each kind (TILINGS).
  tiling = TILINGS[fmt, transpose] if dtype == jnp.bfloat16 else None
  for sizes in (_random_sizes(FORMATS.index(fmt)), [5, 40, 19]):
    check(fmt, transpose, dtype, sizes, tiling=tiling)


@pytest.mark.parametrize("fmt", FORMATS)
def test_named_group_sizes(fmt):
  for sizes in (
    [0, 0, 0],  # nothing routed: all zeros
    [0, M, 0],  # every row in one group
    [40, 30, 10],  # total above M: clipped to end at M
    [1, 0, 62],
  ):
    check(fmt, False, jnp.float32, sizes)


@pytest.mark.parametrize("fmt", FORMATS)
def test_partial_last_row_tile(fmt):
  """M = 50 rows in tiles of 32: the last row tile runs past x, and the rows past the
  groups are zeros; with every row in a group, and with a row tile past all of them."""
  for sizes in ([20, 0, 30], [10, 5, 3]):
    check(fmt, False, jnp.float32, sizes, tiling=TILINGS[fmt, False], rows=50)


def test_the_grid_never_visits_an_empty_group():
  """The kernel's grid steps and the w block each one fetches (its group, `group_ids`):
  every row tile once, the empty groups' matrices never (`bench.reading.hbm.grouped_kernels`
  counts the weights the grid skips from this)."""
  sizes = jnp.array([40, 0, 0, 24, 0, 64], jnp.int32)  # 128 rows, tm 32: 4 row tiles
  (_, group_ids, m_tile_ids), steps = tpu_quant._visit_every_tile(sizes, 160, 32)
  steps = int(steps)
  assert sorted(set(np.asarray(group_ids)[:steps].tolist())) == [0, 3, 5]
  assert sorted(set(np.asarray(m_tile_ids)[:steps].tolist())) == [0, 1, 2, 3, 4]  # 4 and a past one


def test_bfloat16_result():
  check("int8", False, jnp.bfloat16, [20, 0, 30], out_dtype=jnp.bfloat16)


def test_float32_weights_with_bfloat16_x():
  """w.dtype float32, x bfloat16: values are decoded in float32 and rounded to bf16 once."""
  q = _weights("fp8", jnp.float32)
  x = jnp.asarray(np.random.default_rng(1).normal(size=(M, D)), jnp.bfloat16)
  got = tpu_quant.quantized_gmm(
    x, q, jnp.asarray([M, 0, 0]), preferred_element_type=jnp.float32, interpret=True
  )
  want = np.asarray(x.astype(np.float32), np.float64) @ np.asarray(
    q.dequantize(jnp.bfloat16)[0].astype(jnp.float32), np.float64
  )
  np.testing.assert_allclose(np.asarray(got), want, rtol=RTOL, atol=RTOL * np.abs(want).max())


# --- the tiling rule and errors ---------------------------------------------------------------

MIB = 2**20


@pytest.mark.parametrize(
  "fmt,transpose,shape,limit,want",
  [
    # v5e's 96 MiB: full width, each group's block decoded once per row-tile run.
    ("int8", False, (4096, 2048, 4096, 8), 96 * MIB, (256, 2048, 4096)),
    ("mxfp4", True, (4096, 2048, 4096, 8), 96 * MIB, (256, 4096, 2048)),
    # Mosaic's default limit: narrower tiles; mxfp4's D tile a multiple of 1024.
    ("fp8", False, (4096, 2048, 4096, 8), None, (256, 512, 1024)),
    ("mxfp4", False, (4096, 2048, 4096, 8), None, (256, 1024, 512)),
    # gpt-oss: 2880 is no multiple of 128, so D and F stay whole.
    ("mxfp4", False, (4096, 2880, 2880, 16), 96 * MIB, (256, 2880, 2880)),
    ("int8", False, (8192, 2048, 4096, 2), 96 * MIB, (512, 2048, 4096)),
    # Decode: one row tile of all M rows, M rounded up to 16 (no padding to 128).
    ("int8", False, (192, 2048, 768, 16), 96 * MIB, (192, 2048, 768)),
    ("fp8", False, (40, 7168, 2048, 32), 96 * MIB, (48, 7168, 2048)),
  ],
)
def test_default_tiling(fmt, transpose, shape, limit, want):
  M_, D_, F_, G_ = shape
  got = tpu_quant.default_tiling(
    M_, D_, F_, jnp.bfloat16, fmt, num_groups=G_, transpose_rhs=transpose, vmem_limit=limit
  )
  assert got == want
  assert tpu_quant.vmem_bytes(fmt, *got, 2, transpose_rhs=transpose) <= gmm_tpu.vmem_budget(limit)


def test_errors():
  q = _weights("mxfp4", jnp.float32)
  x = jnp.zeros((M, D), jnp.float32)
  gs = jnp.asarray([M, 0, 0])
  with pytest.raises(TypeError, match="quantized_gmm: w must be a QuantizedArray"):
    tpu_quant.quantized_gmm(x, q.dequantize(), gs, interpret=True)
  with pytest.raises(ValueError, match=r"x_MD's columns \(128\) must equal w's D \(256\)"):
    tpu_quant.quantized_gmm(x[:, :128], q, gs, interpret=True)
  with pytest.raises(ValueError, match=r"group_sizes_G must have shape \(3,\)"):
    tpu_quant.quantized_gmm(x, q, gs[:2], interpret=True)
  with pytest.raises(ValueError, match=r"the tile along D \(128\) must divide D \(256\) and be"):
    tpu_quant.quantized_gmm(x, q, gs, tiling=(32, 128, 128), interpret=True)
  with pytest.raises(TypeError, match="x_MD must be bfloat16 or float32"):
    tpu_quant.quantized_gmm(x.astype(jnp.float16), q, gs, interpret=True)


# --- compiled for TPU v5e -------------------------------------------------------------------


def _v5e_chip():
  """(one v5e device's mesh, sds(shape, dtype): a replicated ShapeDtypeStruct on it)."""
  pytest.importorskip("libtpu")
  from jax.experimental import topologies

  devs = topologies.get_topology_desc(platform="tpu", topology_name="v5e:2x4").devices
  mesh = jax.sharding.Mesh(np.array(devs[:1]), ("x",))
  return mesh, lambda shape, dtype: jax.ShapeDtypeStruct(
    shape, dtype, sharding=NamedSharding(mesh, P())
  )


def _abstract_weights(sds, shape, fmt):
  """A `QuantizedArray` of ShapeDtypeStructs standing for f[shape] in `fmt`."""
  w = jax.eval_shape(lambda: quant.quantize(jnp.zeros(shape, jnp.bfloat16), fmt))
  values, scales = sds(w.values.shape, w.values.dtype), sds(w.scales.shape, w.scales.dtype)
  return quant.QuantizedArray(values, scales, fmt, w.dtype)  # pyright: ignore[reportArgumentType]


@pytest.mark.parametrize("fmt", FORMATS)
def test_compiles_for_tpu_v5e(fmt):
  """Mosaic lowers both kernels for a v5e chip at M=4096, D=1024, F=2048, G=8, bf16 x, with
  v5e's VMEM limit (full-width tiles); XLA's temp holds no float copy of w (a bf16 one would
  be 32 MiB) and the kernel declares its FLOPs. (D=2048, F=4096 compiles too, in twice the
  time.)"""
  pytest.importorskip("libtpu")
  from jax.experimental import topologies

  devs = topologies.get_topology_desc(platform="tpu", topology_name="v5e:2x4").devices
  mesh = jax.sharding.Mesh(np.array(devs[:1]), ("x",))
  sds = lambda shape, dtype: jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, P()))
  M_, D_, F_, G_ = 4096, 1024, 2048, 8
  w = jax.eval_shape(lambda: quant.quantize(jnp.zeros((G_, D_, F_), jnp.bfloat16), fmt))
  q = quant.QuantizedArray(
    sds(w.values.shape, w.values.dtype), sds(w.scales.shape, w.scales.dtype), fmt, w.dtype
  )
  limit = gmm_tpu.vmem_limit(devs[0].device_kind)
  for transpose in (False, True):
    f = jax.jit(
      functools.partial(tpu_quant.quantized_gmm, transpose_rhs=transpose, vmem_limit_bytes=limit)
    )
    x = sds((M_, F_ if transpose else D_), jnp.bfloat16)
    compiled = f.lower(x, q, sds((G_,), jnp.int32)).compile()
    assert 'custom_call_target="tpu_custom_call"' in compiled.as_text()
    temp = compiled.memory_analysis().temp_size_in_bytes
    assert temp < G_ * D_ * F_ * 2 // 8, f"{fmt} transposed={transpose}: temp {temp} bytes"
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost
    assert cost["flops"] >= 2 * M_ * D_ * F_


def test_weights_stay_in_hbm_for_tpu_v5e():
  """Compiled for v5e at decode size (M=64, w: int8 [4, 2048, 2048], 16 MiB), one call and a
  loop of more calls on the same w: XLA keeps the values in HBM as the kernels' operand (no
  prefetch of the whole matrix into VMEM, memory space S(1)), and the kernel declares x read
  once over its 4 column tiles (one row tile, one contraction tile)."""
  mesh, sds = _v5e_chip()
  M_, D_, G_ = 64, 2048, 4
  q = _abstract_weights(sds, (G_, D_, D_), "int8")
  gmm = functools.partial(
    tpu_quant.quantized_gmm,
    tiling=(M_, D_, D_ // 4),
    vmem_limit_bytes=gmm_tpu.vmem_limit(mesh.devices.flat[0].device_kind),
  )

  def f(x, q, gs):  # the loop runs while the data says so: XLA cannot drop it
    n = gs[0] // 1000
    y = gmm(x, q, gs)
    return jax.lax.while_loop(lambda c: c[0] < n, lambda c: (c[0] + 1, gmm(c[1], q, gs)), (0, y))

  x = sds((M_, D_), jnp.bfloat16)
  compiled = jax.jit(f).lower(x, q, sds((G_,), jnp.int32)).compile()
  text = str(compiled.as_text())
  assert not re.findall(r"s8\[[\d,]+\]\{[^}]*S\(1\)\}", text)
  kernels = re.findall(r'"bytes_accessed":"(\d+)"', text)
  w_bytes = G_ * D_ * D_ + G_ * D_ * 4
  assert kernels and all(int(b) == w_bytes + 2 * M_ * D_ * 2 for b in kernels), kernels


def test_mxfp4_forward_splits_x_in_one_pass_for_tpu_v5e():
  """The mxfp4 forward takes x's even and odd columns (against w's low and high nibbles) as
  two strided slices of x: no [M, D/2, 2] array, whose minor dimension of 2 XLA lays out as
  a relayout copy of x on TPU."""
  mesh, sds = _v5e_chip()
  M_, D_, F_, G_ = 64, 1024, 256, 2
  q = _abstract_weights(sds, (G_, D_, F_), "mxfp4")
  gmm = functools.partial(
    tpu_quant.quantized_gmm, vmem_limit_bytes=gmm_tpu.vmem_limit(mesh.devices.flat[0].device_kind)
  )
  text = jax.jit(gmm).lower(sds((M_, D_), jnp.bfloat16), q, sds((G_,), jnp.int32)).compile()
  text = text.as_text()
  assert 'custom_call_target="tpu_custom_call"' in text
  assert not re.findall(rf"bf16\[{M_},{D_ // 2},2\]", text)
  assert len(re.findall(rf"bf16\[{M_},{D_ // 2}\]", text)) >= 2  # the two halves
