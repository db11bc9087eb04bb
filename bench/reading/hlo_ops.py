"""What one HLO instruction costs: the bytes of its types, the FLOPs of a dot, a convolution or
a Pallas kernel (the cost it declares; splash attention's, which declares none, from its
shapes, counted by the one estimate's `hbm.op_flops`), and the wire bytes of a collective.
`hlo.parse_hlo` reads them into each computation's totals; `measure` scales those by how
often it runs. `instruction_lines` puts an instruction written over several lines back on
one."""

from __future__ import annotations

import math
import re

import numpy as np

COLLECTIVES = (
  "all-to-all",
  "all-gather",
  "reduce-scatter",
  "all-reduce",
  "collective-permute",
  "ragged-all-to-all",
)


_DTYPE_BYTES = {
  "pred": 1,
  "s8": 1,
  "u8": 1,
  "s16": 2,
  "u16": 2,
  "f16": 2,
  "bf16": 2,
  "s32": 4,
  "u32": 4,
  "f32": 4,
  "s64": 8,
  "u64": 8,
  "f64": 8,
  "c64": 8,
  "c128": 16,
  "s4": 0.5,
  "u4": 0.5,
  "f8e4m3fn": 1,
  "f8e4m3fnuz": 1,
  "f8e4m3b11fnuz": 1,
  "f8e5m2": 1,
  "f8e5m2fnuz": 1,
  "f8e8m0fnu": 1,
  "f4e2m1fn": 0.5,
}


_ARRAY_RE = re.compile(r"\b([a-z]+[0-9]*[a-z0-9]*)\[([0-9,]*)\]")


def shape_bytes(type_str):
  """Bytes of an HLO type string, e.g. "f32[8,4]{1,0}" or a tuple "(f32[2], s32[])"."""
  total = 0
  for dtype, dims in _ARRAY_RE.findall(type_str):
    if dtype not in _DTYPE_BYTES:
      continue
    n = int(np.prod([int(d) for d in dims.split(",") if d])) if dims else 1
    total += n * _DTYPE_BYTES[dtype]
  return int(total)


def _dims(type_str):
  m = _ARRAY_RE.search(type_str)
  return [int(d) for d in m.group(2).split(",") if d] if m else []


def _dot_flops(ins, types):
  out = _dims(ins.type)
  lhs = _dims(types.get(ins.operands[0], "")) if ins.operands else []
  m = re.search(r"lhs_contracting_dims=\{([0-9,]*)\}", ins.attrs)
  contract = [int(d) for d in m.group(1).split(",") if d] if m else []
  k = int(np.prod([lhs[d] for d in contract])) if lhs and contract else 1
  return 2.0 * float(np.prod(out)) * k


_COST_RE = re.compile(r'"cost_estimate":\{"flops":"(\d+)"')

_COMP_END_RE = re.compile(r"^\}(,|\s*$)")  # "}", or "}, execution_thread=..."


def instruction_lines(text):
  """The lines of HLO text, each instruction on one line.

  A Pallas kernel's backend config can hold strings with raw newlines (megablox's and
  splash attention's `kernel_metadata` in libtpu's `as_text()`), so its instruction
  continues on lines that start with neither blank space nor "%" (`"xprof_metadata":...`,
  `}}, metadata=...`). Such a line after an instruction (an indented line) is joined to
  it, unless it closes the computation ("}" or "}, ..."); read on its own, a "}}" line
  would end the computation and lose the rest of it.
  """
  out = []
  for line in text.splitlines():
    if (
      out
      and out[-1][:1].isspace()
      and line
      and not line[0].isspace()
      and line[0] != "%"
      and not _COMP_END_RE.match(line)
    ):
      out[-1] += line
    else:
      out.append(line)
  return out


def custom_call_flops(attrs):
  """FLOPs a `tpu_custom_call` (a Pallas TPU kernel) declares in its backend_config's
  `cost_estimate` (XLA's cost analysis counts the same); 0 for other custom calls.

  For megablox's grouped matmuls the declaration is 2*m*k*n over the whole (padded) row
  buffer, whatever the group sizes: an upper bound on the tiles it visits.
  """
  if 'custom_call_target="tpu_custom_call"' not in attrs:
    return 0.0
  m = _COST_RE.search(attrs)
  return float(m.group(1)) if m else 0.0


# The matmuls of Sq x Skv per (batch, head) each splash-attention kernel runs, as (those
# over q and k's head dim, those over v's): the forward QK^T and PV; dkv recomputes QK^T and
# forms dP = dO V^T, dV = P^T dO, dK = dS^T Q; dq recomputes QK^T and forms dP, dQ = dS K;
# a fused backward does both without the second recompute.
SPLASH_MATMULS = {"fwd": (1, 1), "dkv": (2, 2), "dq": (2, 1), "bwd": (3, 2)}
_SPLASH_RE = re.compile(r'op_name="[^"]*splash_mha_(fwd|dkv|dq|bwd)[^"/]*/pallas_call"')


def splash_role(ins):
  """The splash-attention kernel an instruction is ("fwd", "dkv", "dq", "bwd"), else None."""
  if ins.opcode != "custom-call" or 'custom_call_target="tpu_custom_call"' not in ins.attrs:
    return None
  m = _SPLASH_RE.search(ins.attrs)
  return m.group(1) if m else None


def causal_share(nq, nkv):
  """The share of an nq x nkv grid of blocks a causal mask leaves, q and kv of one length:
  q block i reaches kv blocks 0 .. ceil((i + 1) nkv / nq) - 1."""
  return sum(-(-(i + 1) * nkv // nq) for i in range(nq)) / (nq * nkv)


def splash_flops(ins, types):
  """FLOPs of one run of a splash-attention kernel, which declares none, from its shapes and
  the blocks its grid visits; 0 for any other instruction.

  The kernel multiplies q [B, H, Sq, dq] against k [B, Hkv, Skv, dq] and v [B, Hkv, Skv,
  dv] (its first three rank-4 operands; DeepSeek's MLA has dq 192, dv 128) block by block,
  `SPLASH_MATMULS` by its role, skipping the blocks its mask rules out: with a mask operand
  s8[1, nq, nkv] (MaxText's causal mask) the share `causal_share(nq, nkv)` of them;
  without one, all.
  """
  role = splash_role(ins)
  if role is None:
    return 0.0
  shapes = [(types.get(o, "")[:3], _dims(types.get(o, ""))) for o in ins.operands]
  qkv = [d for _, d in shapes if len(d) == 4]
  grid = [d for kind, d in shapes if kind == "s8[" and len(d) == 3 and d[0] == 1]
  if len(qkv) < 2:
    return 0.0
  (b, h, sq, d_qk), skv = qkv[0], qkv[1][2]
  d_v = qkv[2][3] if len(qkv) > 2 else d_qk
  visited = causal_share(grid[0][1], grid[0][2]) if grid else 1.0
  over_qk, over_v = SPLASH_MATMULS[role]
  return 2.0 * b * h * sq * skv * (over_qk * d_qk + over_v * d_v) * visited


def _conv_flops(ins, types):
  """2 * (input features / feature groups) * prod(non-spatial result dims) * valid taps.

  Counts as XLA's `HloCostAnalysis::GetConvolutionFlops` does: one FMA per output feature,
  input feature in its group, batch element and valid (output position, kernel position)
  pair, where valid taps = prod over spatial dims of `_valid_taps`. Taps that land in lhs
  dilation holes or in padding multiply zeros and are not counted (a transposed batched
  matmul written with `lhs_dilate` would otherwise count its whole dilated window).
  """
  out = _dims(ins.type)
  lhs = _dims(types.get(ins.operands[0], "")) if ins.operands else []
  m = re.search(r"dim_labels=(\w+)_(\w+)->(\w+)", ins.attrs)
  if not m or not lhs or len(m.group(1)) != len(lhs) or len(m.group(3)) != len(out):
    return 0.0
  lhs_labels, out_labels = m.group(1), m.group(3)
  if "f" not in lhs_labels:
    return 0.0
  features = lhs[lhs_labels.index("f")]
  window = _conv_window(ins.attrs)
  spatial = [str(i) for i in range(len(window))]
  if any(d not in lhs_labels or d not in out_labels for d in spatial):
    return 0.0
  taps = 1
  for d, (size, stride, pad_lo, lhs_dilate, rhs_dilate) in zip(spatial, window, strict=True):
    taps *= _valid_taps(
      out[out_labels.index(d)],
      lhs[lhs_labels.index(d)],
      size,
      stride,
      pad_lo,
      lhs_dilate,
      rhs_dilate,
    )
  # Batch (already divided by batch groups) times output features.
  rest = int(np.prod([n for n, label in zip(out, out_labels, strict=True) if label in "bf"]))
  g = re.search(r"feature_group_count=(\d+)", ins.attrs)
  groups = int(g.group(1)) if g else 1
  return 2.0 * rest * (features // groups) * float(taps)


def _conv_window(attrs):
  """Per spatial dim (size, stride, pad_lo, lhs_dilate, rhs_dilate) from a convolution's
  `window={size=3x3 stride=2x1 pad=1_1x0_0 lhs_dilate=2x1 rhs_dilate=1x1}` (absent fields
  take XLA's defaults: stride and dilations 1, no padding); [] when there is no window."""
  w = re.search(r"window=\{([^}]*)\}", attrs)
  fields = dict(f.split("=", 1) for f in w.group(1).split() if "=" in f) if w else {}
  if "size" not in fields:
    return []
  sizes = [int(v) for v in fields["size"].split("x")]
  n = len(sizes)

  def ints(key):
    return [int(v) for v in fields[key].split("x")] if key in fields else [1] * n

  pads = [int(p.split("_")[0]) for p in fields["pad"].split("x")] if "pad" in fields else [0] * n
  return list(zip(sizes, ints("stride"), pads, ints("lhs_dilate"), ints("rhs_dilate"), strict=True))


def _valid_taps(n_out, n_in, size, stride, pad_lo, lhs_dilate, rhs_dilate):
  """Number of (output o, kernel k) pairs, 0 <= o < n_out and 0 <= k < size, whose input
  position u = o * stride - pad_lo + k * rhs_dilate falls on an input element: u is a
  multiple of lhs_dilate and 0 <= u / lhs_dilate < n_in (XLA's `valid_position_count`).

  Counted in closed form per kernel position: the o that keep u in range form an interval,
  and those with u = 0 (mod lhs_dilate) an arithmetic progression of period
  lhs_dilate / gcd(stride, lhs_dilate) (none when gcd does not divide k * rhs_dilate - pad_lo).
  """
  c = np.arange(size, dtype=np.int64) * rhs_dilate - pad_lo  # u = o * stride + c
  lo = np.maximum(0, -(c // stride))  # smallest o with u >= 0
  hi = np.minimum(n_out - 1, ((n_in - 1) * lhs_dilate - c) // stride)  # largest in range
  g = math.gcd(stride, lhs_dilate)
  period = lhs_dilate // g
  # o * stride = -c (mod lhs_dilate)  <=>  o = o0 (mod period), if g divides c.
  o0 = ((-c // g) * pow(stride // g, -1, period)) % period
  count = (hi - o0) // period - (lo - 1 - o0) // period
  return int(np.where(c % g == 0, np.maximum(count, 0), 0).sum())


def _group_size(attrs):
  """Devices in one replica group: `replica_groups={{0,1},{2,3}}`, the iota form
  `replica_groups=[4,2]<=[8]` (4 groups of 2), or the mesh form
  `replica_groups=mesh['axis_0'=4,'axis_1'=2] {'axis_0'}` (groups of 4); 1 when absent."""
  m = re.search(r"replica_groups=\{\{([0-9,]*)\}", attrs)
  if m:
    return len([d for d in m.group(1).split(",") if d])
  m = re.search(r"replica_groups=\[(\d+),(\d+)\]", attrs)
  if m:
    return int(m.group(2))
  # Mesh form: replica_groups=mesh['axis_0'=8,'axis_1'=2] {'axis_0'}: the braced axes.
  m = re.search(r"replica_groups=mesh\[([^\]]*)\]\s*\{([^}]*)\}", attrs)
  if m:
    sizes = dict(re.findall(r"'([^']+)'=(\d+)", m.group(1)))
    return int(np.prod([int(sizes[a]) for a in re.findall(r"'([^']+)'", m.group(2))]))
  return 1


def _wire_bytes(kind, operand, result, n):
  """Bytes one device sends over links with the usual (ring / pairwise) algorithms.

  all-to-all: the (n-1)/n of its operand bound for other devices; all-gather: its shard to
  n-1 devices, (n-1)/n of the result; reduce-scatter: (n-1)/n of the operand; all-reduce
  (reduce-scatter then all-gather): 2(n-1)/n of the operand; collective-permute: the
  operand.
  """
  if kind == "collective-permute":
    return operand
  if n <= 1:
    return 0
  frac = (n - 1) / n
  if kind == "all-gather":
    return int(result * frac)
  if kind == "all-reduce":
    return int(2 * operand * frac)
  return int(operand * frac)


def _collective_kind(opcode):
  for kind in COLLECTIVES:
    if opcode == kind or opcode == kind + "-start":
      return kind
  return None


def _result_bytes(ins):
  if ins.opcode.endswith("-start"):
    # Async start ops return ((operands), (results), ...); count the results only.
    inner = ins.type[1:-1] if ins.type.startswith("(") else ins.type
    parts = _split_top_level(inner)
    return shape_bytes(parts[1]) if len(parts) > 1 else shape_bytes(ins.type)
  return shape_bytes(ins.type)


def _split_top_level(s):
  parts, depth, start = [], 0, 0
  for i, ch in enumerate(s):
    depth += ch in "([{"
    depth -= ch in ")]}"
    if ch == "," and depth == 0:
      parts.append(s[start:i])
      start = i + 1
  parts.append(s[start:])
  return [p.strip() for p in parts]
