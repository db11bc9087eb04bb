"""Quantized expert matrices: values plus block scales, held as pytree leaves.

A `QuantizedArray` stands where an expert matrix `f[..., I, O]` (input, output: `gate_EDF`,
`down_EFD`) would: its two array children, `values` and `scales`, keep the leading axes (the
expert axis first, so every dispatch splits and slices them like the matrix), and its format
and logical dtype are static. Three formats (`FORMATS`):

    format   values                               scales                          block
    "int8"   int8[..., I, O], symmetric           f32[..., 1, O]                  I x 1
    "fp8"    float8_e4m3fn[..., I, O]             f32[..., I/128, O/128]          128 x 128
    "mxfp4"  u8[..., I/2, O], two e2m1 codes a    u8[..., I/32, O], exponents     32 x 1
             byte, row 2i in the low nibble,      biased by 127 (e8m0)
             row 2i + 1 in the high one

    value[..., i, o] = decode(values)[..., i, o] * scale[..., i // bi, o // bo]

computed in float32 and cast to the logical dtype (`QuantizedArray.dtype`). "fp8" is the
block-FP8 of DeepSeek-V3/R1 and Qwen3-FP8 (`weight_scale_inv`), and "mxfp4" gpt-oss's MXFP4,
both transposed from the checkpoints' [out, in] to the library's [in, out]: the bytes are the
checkpoint's own, one for one (`hf.load_moe_layer(..., keep_quantized=True)`). "int8" has one
scale per output channel, as a matmul's per-column scale.

`quantize(w, fmt)` and `QuantizedArray.dequantize()` go each way; `quantize_experts` and
`dequantize_experts` apply them to the routed experts' matrices of a `MoEParams` or an FFN.
The grouped matmuls take a `QuantizedArray` where they take a matrix and dequantize it a
block at a time (`matmuls.py`, `kernels/`). The layer computes with exactly the values
`dequantize()` gives, cast to the compute dtype. Quantized matrices are frozen: the matmuls
stop their gradient (a direct call gives scales and FP8 values zeros, integer values JAX's
float0), and `moe_layer` raises when differentiated in one (`frozen.freeze`): train the other
leaves (`trainable.split_trainable`).

qwix's `QArray` is not used: it imports Flax (an optional extra of this package), holds FP4
codes one per element rather than gpt-oss's two per byte, and its dequantization broadcasts
scales over whole tiles, while the kernels here decode a block of packed codes in VMEM.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.core
import jax.numpy as jnp
import numpy as np

from moe_shard.sharding import auto

FORMATS = ("int8", "fp8", "mxfp4")
# Rows (input channels) x columns (output channels) of one scale, per format; None: the
# whole axis. The values' storage rows per logical row: 1/2 for mxfp4's packed codes.
BLOCKS = {"int8": (None, 1), "fp8": (128, 128), "mxfp4": (32, 1)}
# Bytes held per element of the matrix, values and scales (int8's and fp8's scales round to
# nothing; mxfp4: half a byte of code and an 8-bit scale per 32 elements).
ELEMENT_BYTES = {"int8": 1.0, "fp8": 1.0, "mxfp4": 0.5 + 1 / 32}
INT8_MAX = 127.0
E4M3_MAX = float(jnp.finfo(jnp.float8_e4m3fn).max)  # 448
FP4_MAX = 6.0
# The 16 values of an e2m1 code: sign bit 3, exponent bits 2..1, mantissa bit 0.
FP4_VALUES = np.array(
  [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0],
  np.float32,
)
E8M0_BIAS = 127
E8M0_NAN = 255  # the OCP MX spec's NaN scale


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class QuantizedArray:
  """A matrix `f[..., I, O]` held as quantized values and block scales (module docstring).

  Attributes:
    values: int8[..., I, O] ("int8"), float8_e4m3fn[..., I, O] ("fp8") or u8[..., I/2, O]
      ("mxfp4", two codes a byte).
    scales: f32[..., 1, O] ("int8"), f32[..., I/128, O/128] ("fp8") or u8[..., I/32, O]
      ("mxfp4", exponents biased by 127).
    fmt: "int8", "fp8" or "mxfp4" (static).
    dtype: the dtype of the dequantized values (static; default float32).
  """

  values: jax.Array
  scales: jax.Array
  fmt: str = dataclasses.field(metadata=dict(static=True))
  dtype: Any = dataclasses.field(default=np.dtype(np.float32), metadata=dict(static=True))

  @property
  def shape(self) -> tuple[int, ...]:
    """The logical shape [..., I, O] of the matrix it stands for."""
    *lead, rows, cols = self.values.shape
    return (*lead, 2 * rows if self.fmt == "mxfp4" else rows, cols)

  @property
  def ndim(self) -> int:
    return len(self.shape)

  @property
  def nbytes(self) -> int:
    """Bytes held: values and scales."""
    return sum(int(np.prod(a.shape)) * jnp.dtype(a.dtype).itemsize for a in self.arrays())

  def arrays(self) -> tuple[jax.Array, jax.Array]:
    return self.values, self.scales

  def __getitem__(self, index) -> QuantizedArray:
    """Indexes the leading (non-matrix) axes: `q[e]` is expert e's matrix."""
    index = index if isinstance(index, tuple) else (index,)
    if len(index) > self.ndim - 2 or any(i is Ellipsis for i in index):
      raise IndexError(
        f"QuantizedArray: only the axes before the matrix's last two can be indexed "
        f"(shape {self.shape}, got index {index})"
      )
    return dataclasses.replace(self, values=self.values[index], scales=self.scales[index])

  def dequantize(self, dtype: Any = None) -> jax.Array:
    """The values it stands for: f[..., I, O] in `dtype` (default: `self.dtype`).

    Computed in float32 and cast to `self.dtype` first, so a wider `dtype` adds no bits.
    """
    out = (_decode(self.values, self.fmt) * _scale_grid(self)).astype(self.dtype)
    return out if dtype is None else out.astype(dtype)


def _decode(values, fmt):
  """f32 of the stored codes, [..., I, O] (mxfp4: the two nibbles of each byte unpacked)."""
  if fmt != "mxfp4":
    return values.astype(jnp.float32)
  codes = jnp.stack([values & 0x0F, values >> 4], axis=-2)  # [..., I/2, 2, O]
  *lead, half, _, cols = codes.shape
  table = jnp.asarray(FP4_VALUES)
  return table[codes.astype(jnp.int32)].reshape(*lead, 2 * half, cols)


def scale_values(scales, fmt):
  """f32 scales from the stored ones (mxfp4: 2 ** (exponent - 127); 0xFF is NaN)."""
  if fmt != "mxfp4":
    return scales.astype(jnp.float32)
  s = scales.astype(jnp.int32)
  return jnp.where(s == E8M0_NAN, jnp.nan, jnp.ldexp(jnp.float32(1), s - E8M0_BIAS))


def _scale_grid(q):
  """The scales broadcast against the decoded values: f32[..., I/bi, bi, O/bo, bo]-shaped
  products reshaped back to [..., I, O], as an array that broadcasts to [..., I, O]."""
  *lead, rows, cols = q.shape
  s = scale_values(q.scales, q.fmt)
  n_i, n_o = s.shape[-2:]
  s = jnp.broadcast_to(s[..., :, None, :, None], (*lead, n_i, rows // n_i, n_o, cols // n_o))
  return s.reshape(*lead, rows, cols)


def check_format(fn: str, name: str, fmt: Any) -> str:
  """Returns `fmt` if it is one of `FORMATS`, else raises ValueError naming `name`."""
  if not isinstance(fmt, str) or fmt not in FORMATS:
    raise ValueError(f"{fn}: {name} must be one of {FORMATS} (got {fmt!r})")
  return fmt


def check_blocks(fn: str, name: str, shape: tuple[int, ...], fmt: str) -> None:
  """Raises ValueError unless the blocks of `fmt` divide the matrix `shape` [..., I, O]."""
  if len(shape) < 2:
    raise ValueError(f"{fn}: {name} must be a matrix [..., in, out] (got shape {tuple(shape)})")
  for axis, size, block in zip(("input", "output"), shape[-2:], BLOCKS[fmt]):
    if block is not None and size % block:
      raise ValueError(
        f"{fn}: {name}'s {axis} dimension ({size}) must be divisible by the {fmt!r} "
        f"block ({block}) (got shape {tuple(shape)})"
      )


# The stored dtypes of each format: (values, scales).
STORED_DTYPES = {
  "int8": (jnp.dtype(jnp.int8), jnp.dtype(jnp.float32)),
  "fp8": (jnp.dtype(jnp.float8_e4m3fn), jnp.dtype(jnp.float32)),
  "mxfp4": (jnp.dtype(jnp.uint8), jnp.dtype(jnp.uint8)),
}


def scales_shape(fmt: str, values_shape: tuple[int, ...]) -> tuple[int, ...]:
  """The shape of the scales that go with values of `values_shape` in `fmt`."""
  *lead, rows, cols = values_shape
  rows = 2 * rows if fmt == "mxfp4" else rows
  bi, bo = BLOCKS[fmt]
  return (*lead, 1 if bi is None else rows // bi, cols // bo)


def check_quantized(fn: str, name: str, q: Any) -> None:
  """Raises unless `q` is a `QuantizedArray` whose values and scales have the dtypes and
  shapes of its format (module docstring): checked where one enters the layer, a dispatch
  or the grouped matmul, at trace time.

  Raises:
    ValueError: an unknown format, values of rank below 2, a matrix the format's blocks do
      not divide, or scales of another shape than the values imply (another number of
      experts, [E, F] for int8's [E, 1, F], ...).
    TypeError: values or scales of another dtype than the format stores (int8 values held
      as uint8, ...), or a logical dtype that is not a float.
  """
  fmt = check_format(fn, f"{name}.fmt", q.fmt)
  values, scales = q.values, q.scales
  want_v, want_s = STORED_DTYPES[fmt]
  for part, a, want in (("values", values, want_v), ("scales", scales, want_s)):
    if jnp.dtype(a.dtype) != want:
      raise TypeError(
        f"{fn}: {name}.{part} of a {fmt!r} QuantizedArray must have dtype {want.name} "
        f"(got {jnp.dtype(a.dtype).name})"
      )
  if not jnp.issubdtype(jnp.dtype(q.dtype), jnp.floating):
    raise TypeError(f"{fn}: {name}.dtype must be a float dtype (got {q.dtype})")
  if len(values.shape) < 2:
    raise ValueError(
      f"{fn}: {name}.values must be a matrix [..., I, O] (got shape {tuple(values.shape)})"
    )
  check_blocks(fn, name, q.shape, fmt)
  want = scales_shape(fmt, tuple(values.shape))
  if tuple(scales.shape) != want:
    raise ValueError(
      f"{fn}: {name}.scales must have shape {want} for {fmt!r} values of shape "
      f"{tuple(values.shape)} (got {tuple(scales.shape)})"
    )


def quantize(w: jax.Array, fmt: str, *, name: str = "w") -> QuantizedArray:
  """Quantizes a matrix f[..., I, O] (its last two axes; leading axes kept).

  int8: scale = max |w| over the input axis / 127, values rounded to nearest. fp8: scale =
  max |w| over each 128 x 128 block / 448, values rounded to the nearest e4m3. mxfp4: per
  32 input rows, the smallest power of two 2^e with max |w| / 2^e <= 6, values rounded to
  the nearest e2m1, ties to the even code (as `hf.mxfp4.quantize`). An all-zero block gets
  scale 1 (exponent 0 for mxfp4). A block holding a NaN or an Inf gets a NaN scale (mxfp4:
  e8m0's NaN, 0xFF) and zero codes: it dequantizes to NaN, which the layer propagates
  (`quantize_experts` raises on such weights when they are concrete).

  Args:
    w: f[..., I, O].
    fmt: "int8", "fp8" or "mxfp4".
    name: the argument's name in error messages (default "w").

  Returns:
    `QuantizedArray` with `dtype` w's dtype.

  Raises:
    ValueError: an unknown `fmt`, or a block that does not divide the shape.
  """
  fn = "quantize_experts"
  check_format(fn, "fmt", fmt)
  check_blocks(fn, name, w.shape, fmt)
  *lead, rows, cols = w.shape
  bi, bo = BLOCKS[fmt]
  bi = rows if bi is None else bi
  v = w.astype(jnp.float32).reshape(*lead, rows // bi, bi, cols // bo, bo)
  amax = jnp.max(jnp.abs(v), axis=(-3, -1))  # [..., I/bi, O/bo]
  # A NaN or Inf in the block makes its scale NaN (docstring). Counted apart from amax:
  # XLA:CPU's max may drop a NaN.
  finite = jnp.all(jnp.isfinite(v), axis=(-3, -1))
  if fmt == "mxfp4":
    exp = jnp.ceil(jnp.log2(jnp.maximum(amax, jnp.finfo(jnp.float32).tiny) / FP4_MAX))
    exp = jnp.where(amax > 0, jnp.clip(exp, -E8M0_BIAS, E8M0_BIAS), 0).astype(jnp.int32)
    scales = jnp.where(finite, exp + E8M0_BIAS, E8M0_NAN).astype(jnp.uint8)
  else:
    top = INT8_MAX if fmt == "int8" else E4M3_MAX
    scales = jnp.where(amax > 0, amax / top, 1.0).astype(jnp.float32)
    scales = jnp.where(finite, scales, jnp.nan)
  q = v / jnp.where(finite, scale_values(scales, fmt), 1.0)[..., :, None, :, None]
  q = jnp.where(jnp.isfinite(q), q, 0.0)  # a non-finite block's codes: zeros
  q = q.reshape(*lead, rows, cols)
  if fmt == "int8":
    values = jnp.clip(jnp.round(q), -INT8_MAX, INT8_MAX).astype(jnp.int8)
  elif fmt == "fp8":
    values = jnp.clip(q, -E4M3_MAX, E4M3_MAX).astype(jnp.float8_e4m3fn)
  else:
    codes = round_to_fp4(q)
    values = (codes[..., 0::2, :] | (codes[..., 1::2, :] << 4)).astype(jnp.uint8)
  return QuantizedArray(values, scales, fmt, jnp.dtype(w.dtype))


def round_to_fp4(q: jax.Array) -> jax.Array:
  """The e2m1 codes nearest to q (|q| <= 6), ties to the even code, the sign kept: u8."""
  mags = jnp.asarray(FP4_VALUES[:8])
  a = jnp.abs(q)
  hi = jnp.clip(jnp.searchsorted(mags, a), 1, 7)
  lo = hi - 1
  d_lo, d_hi = a - mags[lo], mags[hi] - a
  code = jnp.where((d_hi < d_lo) | ((d_hi == d_lo) & (hi % 2 == 0)), hi, lo)
  return (code | jnp.where(jnp.signbit(q), 8, 0)).astype(jnp.uint8)


def is_quantized(x: Any) -> bool:
  return isinstance(x, QuantizedArray)


def expand(prefix: Any, tree: Any) -> Any:
  """`prefix` (a tree with one value where `tree` holds a `QuantizedArray`, such as a
  `PartitionSpec` or shape letters) with that value given to both values and scales (and,
  where `tree` holds an `adapters.Adapter`, to its matrix, its a and its b by
  `Adapter.expand_prefix`).

  A `PartitionSpec` for the scales names no axis on a dimension where the scales have one
  block for the whole axis (int8's input axis): that dimension is not split.
  """

  def one(p, a):
    if hasattr(a, "expand_prefix"):  # an `adapters.Adapter`: its matrix, a and b
      return a.expand_prefix(p, one)
    if not is_quantized(a):
      return p
    s = p
    if isinstance(p, jax.sharding.PartitionSpec):
      s = jax.sharding.PartitionSpec(
        *[None if n == 1 and m > 1 else d for d, n, m in zip(p, a.scales.shape, a.values.shape)]
      )
    return dataclasses.replace(a, values=p, scales=s)

  return jax.tree.map(
    one, prefix, tree, is_leaf=lambda x: isinstance(x, jax.sharding.PartitionSpec)
  )


def _matrix_fields(ffn):
  """Names of an FFN dataclass's matrix fields: three shape letters after the last '_'."""
  if not dataclasses.is_dataclass(ffn) or isinstance(ffn, type):
    raise TypeError(
      f"quantize_experts: the experts must be an FFN dataclass such as SwiGLU (got "
      f"{type(ffn).__name__})"
    )
  return [
    f.name
    for f in dataclasses.fields(ffn)
    if not f.metadata.get("static")
    and "_" in f.name
    and len(f.name.rsplit("_", 1)[1]) == 3
    and getattr(ffn, f.name) is not None
  ]


def _map_experts(fn, params, f):
  """`params` (an `MoEParams`, or an FFN) with f applied to each routed-expert matrix."""
  experts = getattr(params, "experts", params)
  new = dataclasses.replace(
    experts, **{k: f(k, getattr(experts, k)) for k in _matrix_fields(experts)}
  )
  return dataclasses.replace(params, experts=new) if experts is not params else new


def quantize_experts(params: Any, fmt: str) -> Any:
  """Quantizes the routed experts' matrices of `params` in `fmt`.

  The biases, the router and the shared experts stay as they are. Leading axes are kept,
  so a stack of layers (`hf.load_moe_layers`) quantizes too, and arrays placed on a mesh
  keep their expert-axis split. Already quantized matrices are left as they are.

  Args:
    params: an `MoEParams` (or a stack of them), or an expert FFN such as `SwiGLU`.
    fmt: "int8", "fp8" or "mxfp4" (`FORMATS`).

  Returns:
    `params` with each routed-expert matrix a `QuantizedArray`.

  Raises:
    ValueError: an unknown `fmt`, a matrix whose shape the format's blocks do not divide, or
      (concrete arrays) a matrix holding a NaN or an Inf, named with the first index; traced
      (under jit), a block holding one is quantized to NaN (`quantize`).
    TypeError: `params` holds no FFN dataclass.
  """
  check_format("quantize_experts", "fmt", fmt)

  def one(name, w):
    if hasattr(w, "expand_prefix"):  # an `adapters.Adapter`: its base matrix quantized
      return dataclasses.replace(w, w=one(name, w.w))
    if is_quantized(w):
      return w
    check_blocks("quantize_experts", f"experts.{name}", w.shape, fmt)
    _check_finite(name, w)
    return _quantize_jit(w, fmt)

  return _map_experts("quantize_experts", params, one)


def _check_finite(name, w):
  """Raises ValueError if a concrete `w` holds a NaN or an Inf (traced: `quantize` marks the
  block NaN instead)."""
  if isinstance(w, jax.core.Tracer):
    return
  bad = int(_count_not_finite(w))
  if bad:
    first = tuple(int(i) for i in np.argwhere(~np.isfinite(np.asarray(jax.device_get(w))))[0])
    raise ValueError(
      f"quantize_experts: experts.{name} must be finite to be quantized (got {bad} NaN or "
      f"Inf values, the first at index {first})"
    )


@jax.jit
def _count_not_finite(w):
  return jnp.sum(~jnp.isfinite(w), dtype=jnp.int32)


@functools.partial(jax.jit, static_argnums=1)
def _quantize_jit(w, fmt):
  # On an Explicit mesh the blocks' reshapes have no sharding JAX can infer: XLA picks them
  # (`auto`), and the values and scales come out split like w (`expand`).
  shapes = jax.eval_shape(lambda w: quantize(w, fmt), jax.ShapeDtypeStruct(w.shape, w.dtype))
  return auto(lambda w: quantize(w, fmt), w, lambda spec: expand(spec, shapes))(w)


def dequantize_experts(params: Any) -> Any:
  """Returns `params` with every `QuantizedArray` replaced by the values it stands for.

  These are exactly the values the layer computes with (cast to the compute dtype), in
  each matrix's logical dtype: the float model a quantized one is checked against.

  Args:
    params: an `MoEParams`, an FFN, or any pytree holding `QuantizedArray`s.

  Returns:
    the same pytree with float arrays in place of the quantized ones.
  """
  return jax.tree.map(
    lambda x: _dequantize_jit(x) if is_quantized(x) else x, params, is_leaf=is_quantized
  )


@jax.jit
def _dequantize_jit(q):
  # The matrix split like the values (`_quantize_jit`).
  return auto(lambda q: q.dequantize(), q.values, lambda spec: spec)(q)


def expert_bytes(params: Any) -> int:
  """Bytes of the routed experts' matrices as held (values and scales, or floats)."""
  experts = getattr(params, "experts", params)
  total = 0
  for name in _matrix_fields(experts):
    w = getattr(experts, name)
    total += w.nbytes if is_quantized(w) else int(np.prod(w.shape)) * jnp.dtype(w.dtype).itemsize
  return total
