"""How checkpoint tensors map onto `MoEParams` leaves, both ways.

Each layout covers one checkpoint tensor (or one per expert) and the leaves it holds. Torch
`nn.Linear` weights are stored [out, in]: a router `gate.weight` f[E, D] is the leaf
`router_DE` transposed, an expert's `w1.weight` f[F, D] is one expert of `gate_EDF`
transposed. Leaf names are the `MoEParams` paths, e.g. "experts.gate_EDF".

    Whole(name, leaf, op)        a replicated tensor; op "T" [a, b] <-> [b, a], "T1"
                                 [a, b] <-> [1, b, a] (one shared expert), "row" [1, D] <-> [D],
                                 "id"
    PerExpert(template, leaf)    E tensors `template.format(j=j)`, each [out, in] of one expert
    Stacked(name, leaf, t)       one [E, a, b] (or [E, a]) tensor; t: swap its last two axes
    Fused(name, (gate, up), how, t)
                                 one [E, ..., 2F] tensor (after swapping its last two axes when
                                 t) holding gate and up: how "halves" (gate = [..., :F]) or
                                 "interleave" (gate = [..., 0::2], up = [..., 1::2])
    Rows(name, leaf, t)          DBRX's [E*F, D]: expert j is rows [j F, (j + 1) F)

Every read takes the rows [lo, hi) of the expert axis only (replicated tensors are read
whole), and caches what it read in `cache` so that two leaves of one fused tensor, or
several devices holding the same experts, read the bytes once. A tensor stored as MXFP4
(`name_blocks`, `name_scales`, gpt-oss), or as block-FP8 (`name` F8_E4M3 with
`name_scale_inv`, DeepSeek-V3 and Qwen3 FP8 releases), is dequantized on read; `write` gives
it unquantized under `name`, and `save_moe_layers` quantizes it back.

With `keep_quantized=True` the routed experts' matrices stored quantized, and the shared
experts' stored as block-FP8 (DeepSeek-V3's), are kept as stored:
`kept` says which leaves can be (or raises ValueError saying why not), `read_kept` gives a
leaf's (values, scales) in the [in, out] layout of `QuantizedArray`, the checkpoint's bytes
rearranged and never decoded, and `write_kept` is its inverse:

    mxfp4  name_blocks u8[E, out, in/32, 16] -> values u8[E, in/2, out] (blocks reshaped to
           [E, out, in/2], then transposed); name_scales u8[E, out, in/32] -> scales
           u8[E, in/32, out]. gpt-oss's interleaved gate_up_proj splits on the out axis,
           whose rows (and their scales) are whole.
    fp8    name f8e4m3[out, in] -> values f8e4m3[in, out]; name_scale_inv f32[out/128, in/128]
           -> scales f32[in/128, out/128]: blocks of 128 x 128 only, dividing the matrix (and
           DBRX's rows of one expert).
"""

from __future__ import annotations

import dataclasses

import ml_dtypes
import numpy as np

from moe_shard.hf import fp8
from moe_shard.hf.mxfp4 import dequantize

BF16 = np.dtype(ml_dtypes.bfloat16)


def _swap(a):
  return np.swapaxes(a, -1, -2)


def fp8_block(ckpt):
  """(bo, bi): the block of a block-FP8 checkpoint's scales (`weight_block_size`)."""
  q = ckpt.config.get("quantization_config") or {}
  return tuple(q.get("weight_block_size") or (128, 128))


def read_rows(ckpt, name, lo, hi, cache, mx_dtype):
  """Rows [lo, hi) of tensor `name` in its unquantized layout (MXFP4 and block-FP8
  dequantized to mx_dtype)."""
  key = (name, lo, hi)
  if key not in cache:
    how = stored(ckpt, name)[1]
    if how == "mxfp4":
      blocks = ckpt.read(name + "_blocks", (lo, hi))
      scales = ckpt.read(name + "_scales", (lo, hi))
      cache[key] = _swap(dequantize(blocks, scales, mx_dtype))
    elif how == "fp8":
      block = fp8_block(ckpt)
      w = ckpt.read(name, None if lo is None else (lo, hi))
      first = 0 if lo is None else lo // block[0]
      last = None if hi is None else -(-hi // block[0])
      s = ckpt.read(name + "_scale_inv", None if lo is None else (first, last))
      row0 = 0 if lo is None else lo - first * block[0]
      cache[key] = fp8.dequantize(w, s, block, mx_dtype, row0)
    else:
      cache[key] = ckpt.read(name, None if lo is None else (lo, hi))
  return cache[key]


# The block of a kept "fp8" `QuantizedArray` (`quant.BLOCKS["fp8"]`).
KEPT_FP8_BLOCK = (128, 128)


def kept_shapes(fmt, shape):
  """((shape, dtype) of values, (shape, dtype) of scales) of a matrix f[..., I, O] kept in
  `fmt` ("mxfp4" or "fp8"), as `QuantizedArray` holds them."""
  *lead, I, O = shape
  if fmt == "mxfp4":
    return ((*lead, I // 2, O), np.dtype(np.uint8)), ((*lead, I // 32, O), np.dtype(np.uint8))
  bi, bo = KEPT_FP8_BLOCK
  return ((*lead, I, O), fp8.E4M3), ((*lead, I // bi, O // bo), np.dtype(np.float32))


def _kept_format(ckpt, name, rows=None):
  """The format tensor `name` is kept in ("mxfp4" or "fp8"), or None when stored as floats.

  Raises ValueError (the reason, without the function's name) for block-FP8 whose blocks are
  not 128 x 128 or do not divide the tensor, or (`rows`) the rows of one expert.
  """
  shape, how = stored(ckpt, name)
  if how == "fp8":
    block = fp8_block(ckpt)
    if block != KEPT_FP8_BLOCK:
      raise ValueError(
        f"block-FP8 tensor {name!r}: its blocks are {list(block)} (quantization_config "
        f"weight_block_size), and a kept 'fp8' matrix has blocks of {list(KEPT_FP8_BLOCK)}"
      )
    dims = [("out", shape[0]), ("in", shape[1])] + ([("one expert's rows", rows)] if rows else [])
    for what, n in dims:
      if n % KEPT_FP8_BLOCK[0]:
        raise ValueError(
          f"block-FP8 tensor {name!r} of shape {tuple(shape)}: its {what} dimension ({n}) is "
          f"not a multiple of the block ({KEPT_FP8_BLOCK[0]}), so the scales cannot follow "
          f"the matrix block for block"
        )
  return how or None


def _cannot(name, fmt, layout):
  return ValueError(f"{fmt} tensor {name!r}: {layout}, which the {fmt} block grid cannot follow")


def read_kept_rows(ckpt, name, lo, hi, cache):
  """Rows [lo, hi) of a quantized tensor as stored, (values, scales) in `read_rows`'s
  orientation: MXFP4 [..., in/2, out] and [..., in/32, out] (the stored bytes rearranged);
  block-FP8 [out, in] and [out/128, in/128] as stored (lo and hi multiples of 128)."""
  key = ("kept", name, lo, hi)
  if key not in cache:
    rows = None if lo is None else (lo, hi)
    if stored(ckpt, name)[1] == "mxfp4":
      blocks = ckpt.read(name + "_blocks", rows)
      *lead, n, g, b = blocks.shape
      values = _swap(blocks.reshape(*lead, n, g * b))
      scales = _swap(ckpt.read(name + "_scales", rows))
    else:
      bo = KEPT_FP8_BLOCK[0]
      values = ckpt.read(name, rows)
      scales = ckpt.read(name + "_scale_inv", None if lo is None else (lo // bo, hi // bo))
    cache[key] = (values, scales)
  return cache[key]


def stored_kept(name, fmt, values, scales):
  """The checkpoint's tensors of one kept matrix given in `read_kept_rows`'s orientation."""
  if fmt == "mxfp4":
    blocks = _swap(values)
    *lead, out, half = blocks.shape
    return {
      name + "_blocks": blocks.reshape(*lead, out, half // 16, 16),
      name + "_scales": _swap(scales),
    }
  return {name: values, name + "_scale_inv": scales}


def stored(ckpt, name):
  """(shape, how) of tensor `name`: how is "", "mxfp4" (then the unquantized shape) or
  "fp8" (an F8_E4M3 tensor with its `name_scale_inv` block scales)."""
  if name not in ckpt and name + "_blocks" in ckpt:
    shape, _ = ckpt.meta(name + "_blocks")
    *lead, n, g, b = shape
    return (*lead, g * b * 2, n), "mxfp4"
  shape, kind = ckpt.meta(name)
  if kind == "F8_E4M3" and name + "_scale_inv" in ckpt:
    return shape, "fp8"
  return shape, ""


class _Layout:
  """What every layout shares: one leaf (`Fused` has two), expert axis first unless replicated.

  Subclasses are frozen dataclasses whose first field is the tensor name (or template).
  """

  leaf: str
  expert_axis = True

  @property
  def leaves(self) -> tuple[str, ...]:
    return (self.leaf,)


@dataclasses.dataclass(frozen=True)
class Whole(_Layout):
  """A replicated tensor (router, bias, shared expert) and its one leaf."""

  name: str
  leaf: str
  op: str = "T"
  expert_axis = False

  def tensors(self, shapes):
    s = shapes[self.leaf]
    return {self.name: {"T": s[::-1], "T1": s[1:][::-1], "row": (1, *s), "id": s}[self.op]}

  def read(self, ckpt, leaf, shapes, lo, hi, cache, mx_dtype):
    a = read_rows(ckpt, self.name, None, None, cache, mx_dtype)
    return {"T": a.T, "T1": a.T[None], "row": a.reshape(-1), "id": a}[self.op]

  def write(self, arrays):
    a = arrays[self.leaf]
    return {self.name: {"T": a.T, "T1": a[0].T, "row": a[None], "id": a}[self.op]}

  def kept(self, ckpt, shapes):
    # A shared expert's block-FP8 matrix ("T1": one [out, in] tensor, the leaf [1, in, out])
    # is kept; other replicated tensors (the router, biases) load as floats.
    if self.op != "T1" or _kept_format(ckpt, self.name) != "fp8":
      return {}
    return {self.leaf: "fp8"}

  def read_kept(self, ckpt, leaf, shapes, lo, hi, cache):
    return tuple(a.T[None] for a in read_kept_rows(ckpt, self.name, None, None, cache))

  def write_kept(self, arrays):
    values, scales = arrays[self.leaf]
    return {self.name: (values[0].T, scales[0].T)}


@dataclasses.dataclass(frozen=True)
class PerExpert(_Layout):
  """E tensors, one `nn.Linear` weight [out, in] per expert, and their stacked leaf."""

  template: str
  leaf: str

  def tensors(self, shapes):
    E, *s = shapes[self.leaf]
    return {self.template.format(j=j): tuple(s[::-1]) for j in range(E)}

  def read(self, ckpt, leaf, shapes, lo, hi, cache, mx_dtype):
    parts = [
      read_rows(ckpt, self.template.format(j=j), None, None, cache, mx_dtype) for j in range(lo, hi)
    ]
    return _swap(np.stack(parts))

  def write(self, arrays):
    return {self.template.format(j=j): a.T for j, a in enumerate(arrays[self.leaf])}

  def kept(self, ckpt, shapes):
    names = [self.template.format(j=j) for j in range(shapes[self.leaf][0])]
    fmts = {_kept_format(ckpt, name) for name in names}
    if fmts == {None}:
      return {}
    if len(fmts) > 1 or "mxfp4" in fmts:
      fmt = "mxfp4" if "mxfp4" in fmts else "fp8"
      raise _cannot(names[0], fmt, "one tensor per expert, some of them not " + fmt)
    return {self.leaf: fmts.pop()}

  def read_kept(self, ckpt, leaf, shapes, lo, hi, cache):
    parts = [
      read_kept_rows(ckpt, self.template.format(j=j), None, None, cache) for j in range(lo, hi)
    ]
    return tuple(_swap(np.stack(p)) for p in zip(*parts))

  def write_kept(self, arrays):
    values, scales = arrays[self.leaf]
    return {self.template.format(j=j): (v.T, s.T) for j, (v, s) in enumerate(zip(values, scales))}


@dataclasses.dataclass(frozen=True)
class Stacked(_Layout):
  """One [E, a, b] (or [E, a]) tensor and its leaf, the last two axes swapped if `transpose`."""

  name: str
  leaf: str
  transpose: bool = False

  def tensors(self, shapes):
    s = shapes[self.leaf]
    return {self.name: (s[0], *s[1:][::-1]) if self.transpose else s}

  def read(self, ckpt, leaf, shapes, lo, hi, cache, mx_dtype):
    a = read_rows(ckpt, self.name, lo, hi, cache, mx_dtype)
    return _swap(a) if self.transpose else a

  def write(self, arrays):
    a = arrays[self.leaf]
    return {self.name: _swap(a) if self.transpose else a}

  def kept(self, ckpt, shapes):
    fmt = _kept_format(ckpt, self.name) if len(shapes[self.leaf]) == 3 else None
    if fmt is not None and (fmt != "mxfp4" or self.transpose):
      raise _cannot(self.name, fmt, "a stacked tensor transposed into [E, in, out]")
    return {} if fmt is None else {self.leaf: fmt}

  def read_kept(self, ckpt, leaf, shapes, lo, hi, cache):
    return read_kept_rows(ckpt, self.name, lo, hi, cache)

  def write_kept(self, arrays):
    return {self.name: arrays[self.leaf]}


@dataclasses.dataclass(frozen=True)
class Fused(_Layout):
  """One tensor holding the gate and up leaves, by halves or interleaved on the last axis."""

  name: str
  pair: tuple[str, str]
  how: str = "halves"
  transpose: bool = False

  @property
  def leaves(self) -> tuple[str, ...]:
    return self.pair

  def tensors(self, shapes):
    E, *mid, F = shapes[self.pair[0]]
    s = (E, *mid, 2 * F)
    return {self.name: (E, *s[1:][::-1]) if self.transpose else s}

  def read(self, ckpt, leaf, shapes, lo, hi, cache, mx_dtype):
    a = read_rows(ckpt, self.name, lo, hi, cache, mx_dtype)
    a = _swap(a) if self.transpose else a
    part = self.pair.index(leaf)
    if self.how == "interleave":
      return a[..., part::2]
    F = a.shape[-1] // 2
    return a[..., part * F : (part + 1) * F]

  def write(self, arrays):
    gate, up = (arrays[k] for k in self.pair)
    if self.how == "interleave":
      a = np.stack([gate, up], axis=-1).reshape(*gate.shape[:-1], 2 * gate.shape[-1])
    else:
      a = np.concatenate([gate, up], axis=-1)
    return {self.name: _swap(a) if self.transpose else a}

  def kept(self, ckpt, shapes):
    fmt = _kept_format(ckpt, self.name) if len(shapes[self.pair[0]]) == 3 else None
    if fmt is not None and (fmt != "mxfp4" or self.transpose):
      raise _cannot(self.name, fmt, f"gate and up fused ({self.how}) in a transposed tensor")
    return {} if fmt is None else dict.fromkeys(self.pair, fmt)

  def read_kept(self, ckpt, leaf, shapes, lo, hi, cache):
    # MXFP4 scales have one column per output column: both split on the out axis alike.
    part = self.pair.index(leaf)
    arrays = read_kept_rows(ckpt, self.name, lo, hi, cache)
    if self.how == "interleave":
      return tuple(a[..., part::2] for a in arrays)
    F = arrays[0].shape[-1] // 2
    return tuple(a[..., part * F : (part + 1) * F] for a in arrays)

  def write_kept(self, arrays):
    (gv, gs), (uv, us) = (arrays[k] for k in self.pair)
    if self.how == "interleave":
      fuse = lambda g, u: np.stack([g, u], axis=-1).reshape(*g.shape[:-1], 2 * g.shape[-1])
    else:
      fuse = lambda g, u: np.concatenate([g, u], axis=-1)
    return {self.name: (fuse(gv, uv), fuse(gs, us))}


@dataclasses.dataclass(frozen=True)
class Rows(_Layout):
  """DBRX's [E*F, D] tensor: expert j is rows [j F, (j + 1) F)."""

  name: str
  leaf: str
  transpose: bool = False

  def _fd(self, shapes):
    _, a, b = shapes[self.leaf]
    return (b, a) if self.transpose else (a, b)

  def tensors(self, shapes):
    F, D = self._fd(shapes)
    return {self.name: (shapes[self.leaf][0] * F, D)}

  def read(self, ckpt, leaf, shapes, lo, hi, cache, mx_dtype):
    F, D = self._fd(shapes)
    a = read_rows(ckpt, self.name, lo * F, hi * F, cache, mx_dtype).reshape(hi - lo, F, D)
    return _swap(a) if self.transpose else a

  def write(self, arrays):
    a = arrays[self.leaf]
    a = _swap(a) if self.transpose else a
    return {self.name: a.reshape(-1, a.shape[-1])}

  def kept(self, ckpt, shapes):
    F, _ = self._fd(shapes)
    fmt = _kept_format(ckpt, self.name, rows=F)
    if fmt == "mxfp4":
      raise _cannot(self.name, fmt, "the rows of every expert in one [E*F, D] tensor")
    return {} if fmt is None else {self.leaf: fmt}

  def read_kept(self, ckpt, leaf, shapes, lo, hi, cache):
    F, D = self._fd(shapes)
    b = KEPT_FP8_BLOCK[0]
    values, scales = read_kept_rows(ckpt, self.name, lo * F, hi * F, cache)
    values, scales = values.reshape(hi - lo, F, D), scales.reshape(hi - lo, F // b, D // b)
    return (_swap(values), _swap(scales)) if self.transpose else (values, scales)

  def write_kept(self, arrays):
    arrays = tuple(_swap(a) if self.transpose else a for a in arrays[self.leaf])
    return {self.name: tuple(a.reshape(-1, a.shape[-1]) for a in arrays)}
