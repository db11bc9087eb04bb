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
