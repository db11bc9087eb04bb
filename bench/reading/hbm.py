"""Where a compiled program's HBM traffic goes: the one count of HBM bytes, op by op.

For each instruction that runs as its own kernel (in the entry computation, a while body or
condition, or a called computation; not the instructions inside a fusion), the HBM bytes it
reads (its operands) and writes (its result) per run, times the number of times its
computation runs (loop bodies scaled by their trip counts, `HloModule.executions`). The
same rules serve every TPU row, the project's and the peers' (`bench/peers`):

  * ops that move no data (parameters, tuples, bitcasts, the control flow itself) count
    zero; an async copy or slice counts once, at its `-done`;
  * an update that runs in place (a dynamic-update-slice or scatter whose output shares its
    operand's buffer: a loop carry, a donated argument, a fusion whose root is the update;
    decided from the module's structure, `bench.reading.inplace`) counts the slice it reads
    and writes, not the whole buffer; a real `copy` counts whole;
  * bytes in VMEM are not HBM's. XLA's memory-space assignment prefetches operands into
    VMEM (`copy-start`/`copy-done` whose result is in memory space `S(1)`): the prefetch
    counts once, as the HBM bytes it reads; the op that reads the prefetched copy reads
    VMEM; an eviction out of VMEM counts the HBM bytes it writes. Each op's `vmem` is the
    part of its bytes in VMEM (what it writes to, or reads from, a value of memory space
    `S(1)`), left out of its `hbm`;
  * a Pallas TPU kernel (`tpu_custom_call`) counts the bytes it declares, except a grouped
    matmul's (megablox's `gmm` and `tgmm`, `kernels.tpu_quant`'s; `grouped_kernels` tells
    them by their grid metadata), which counts what its grid visits when the rows per group
    are given (`groups`): its grid (`make_group_metadata`) holds the row tiles of the
    non-empty groups (megablox's `num_active_tiles`), each group's matrix block fetched once
    while consecutive tiles of the group ask for it (one contraction tile, as
    `moe_shard.kernels.tpu_tiling.default_tiling` picks). So the rows of the visited tiles
    are read and written, the matrices of non-empty groups read, and a `tgmm`'s per-group
    result written whole (it visits empty groups to zero them); its FLOPs scale with the
    visited rows. The group sizes are known only at run time: the benchmark passes the
    expected rows per group of its host routing (uniform, Zipf), from which the visited
    tiles follow. Without `groups` a kernel counts what it declares (its whole row buffer
    and a matrix block per possible tile: an upper bound). Splash attention declares no
    FLOPs: its FLOPs are the blocks of its grid that its mask leaves
    (`hlo_ops.splash_flops`), its bytes its operands and result.

The program's HBM bytes are each op's `hbm` times its runs (`step_bytes`): one model on
both sides, loop bodies included. XLA's own "bytes accessed" (`cost_analysis()`, every
computation once, prefetches and whole-buffer updates counted as XLA counts them) stays
beside it as a reference column.

    python -m bench --tpu v5e:2x4 --hbm-table 15 ...
"""

from __future__ import annotations

import collections
import re

from bench.reading import hlo, hlo_ops, inplace, measure

_VMEM_RE = re.compile(r"S\(1\)")  # memory space 1 (VMEM) in a layout, e.g. {1,0:T(8,128)S(1)}
_DECLARED_RE = re.compile(r'"cost_estimate":\{[^}]*"bytes_accessed":"(\d+)"')

_FREE = {
  "parameter",
  "constant",
  "get-tuple-element",
  "tuple",
  "bitcast",
  "while",
  "call",
  "conditional",
  "after-all",
  "partition-id",
  "replica-id",
  "opt-barrier",
  "add-dependency",
  "recv-done",
  "send-done",
  "all-gather-done",
  "all-reduce-done",
  "collective-permute-done",
  "async-done",
  "domain",
}


def _scope(attrs):
  """The named-scope path of an op, JAX's transformation wrappers removed."""
  m = re.search(r'op_name="([^"]*)"', attrs)
  if not m:
    return ""
  parts = [measure._unwrap(p) for p in m.group(1).split("/")]
  return "/".join(
    p for p in parts[1:] if p and p not in ("shard_map", "while", "body", "cond", "checkpoint")
  )


def _kernel_computations(mod):
  """Computations whose instructions are kernels: the entry, loop bodies and conditions,
  and what `call`/`conditional` instructions run (not fusion bodies or reducers)."""
  out = {mod.entry} | {lp.body for lp in mod.loops} | {lp.condition for lp in mod.loops}
  stack = list(out)
  while stack:
    comp = stack.pop()
    for ins in mod.comps.get(comp, ()):
      if ins.opcode in ("call", "conditional"):
        names = re.findall(
          r"(?:to_apply|true_computation|false_computation)=%?([\w.\-]+)", ins.attrs
        )
        for group in re.findall(r"branch_computations=\{([^}]*)\}", ins.attrs):
          names += [b.strip().lstrip("%") for b in group.split(",") if b.strip()]
        for n in names:
          if n not in out:
            out.add(n)
            stack.append(n)
  return out


ROW_TILE = 512  # a grouped kernel's row tile where none is given (megablox's usual tm)


def op_bytes(compiled_or_text, trip_counts=None, groups=None, row_tile=ROW_TILE):
  """Per-op HBM bytes and FLOPs of one run: a list of dicts, largest first.

  Args:
    compiled_or_text: a `jax.stages.Compiled`, its HLO text, or an `HloModule`.
    trip_counts: as in `measure.executed_flops` (loops with no count known run once).
    groups: {G: expected rows per group (a sequence of G numbers)} for the grouped-matmul
      kernels of G groups (default None: they count what they declare).
    row_tile: those kernels' row tile (default `ROW_TILE`).

  Returns:
    [dict]: scope (named-scope path), opcode, name, computation, shape (result type), runs
    (executions; 0 for the ops of a loop that never runs), read and written (bytes per run,
    VMEM's included), vmem (of read + written, the bytes of values in VMEM), hbm (read +
    written - vmem: the one count per run), flops (per run), inplace (an update counted by
    its slice), total (hbm times runs).
  """
  mod = measure._module(compiled_or_text)
  runs = mod.executions(trip_counts, default_trip_count=1)
  flops_of = op_flops(mod)
  rows = []
  for comp in _kernel_computations(mod):
    n = runs.get(comp, 0.0)
    instrs = mod.comps.get(comp, ())
    types = {ins.name: ins.type for ins in instrs}
    for ins in instrs:
      if ins.opcode in _FREE:
        continue
      if ins.opcode.endswith("-start"):
        continue  # an async op's data moves at its -done (its result tuple holds the source)
      declared = _DECLARED_RE.search(ins.attrs) if ins.opcode == "custom-call" else None
      vmem, flops = 0.0, flops_of(ins, types)
      update = inplace.update_bytes(mod, ins, types)
      kernel = _grouped(ins, types) if declared else None
      if ins.opcode in ("copy-done", "slice-done"):  # the slice or copy: read, then written
        read = written = measure.shape_bytes(ins.type)
        vmem = written if _VMEM_RE.search(ins.type) else 0.0  # a prefetch into VMEM
        # An eviction out of VMEM reads VMEM: its start's (destination, source, context)
        # tuple holds the source's memory space second.
        start = measure._split_top_level(types.get(ins.operands[0], "()")[1:-1])
        if ins.opcode == "copy-done" and len(start) > 1 and _VMEM_RE.search(start[1]):
          vmem += read
      elif kernel and groups and kernel["groups"] in groups:
        read, written, vmem, share = _visited(
          ins, types, kernel, groups[kernel["groups"]], row_tile
        )
        flops *= share
      elif declared and 'custom_call_target="tpu_custom_call"' in ins.attrs:
        written = measure.shape_bytes(ins.type)
        read = max(float(declared.group(1)) - written, 0.0)
        # What it reads of operands in VMEM (the prefetches counted their HBM bytes).
        vmem = min(read, sum(measure.shape_bytes(types[o]) for o in _in_vmem(ins, types)))
        vmem += written if _VMEM_RE.search(ins.type) else 0.0
      elif update is not None:
        read, written = update
        vmem = min(read, sum(measure.shape_bytes(types[o]) for o in _in_vmem(ins, types)))
        vmem += written if _VMEM_RE.search(ins.type) else 0.0
      else:
        read = sum(measure.shape_bytes(types.get(o, "")) for o in ins.operands)
        written = measure.shape_bytes(ins.type)
        vmem = sum(
          measure.shape_bytes(types[o]) for o in ins.operands if _VMEM_RE.search(types.get(o, ""))
        ) + (written if _VMEM_RE.search(ins.type) else 0.0)
      rows.append(
        dict(
          scope=_scope(ins.attrs),
          opcode=ins.opcode,
          name=ins.name,
          computation=comp,
          shape=ins.type.split("{")[0],
          runs=n,
          read=read,
          written=written,
          vmem=vmem,
          hbm=read + written - vmem,
          flops=flops,
          inplace=update is not None,
          total=n * (read + written - vmem),
        )
      )
  return sorted(rows, key=lambda r: -r["total"])


def op_flops(mod):
  """A function (instruction, {name: type} of its computation) -> FLOPs of one run: a dot or
  convolution, a Pallas kernel's declared cost (splash attention's, which declares none, the
  blocks its grid visits: `hlo_ops.splash_flops`), or the dots of what a fusion calls."""
  own = {}

  def inside(comp):
    if comp not in own:
      own[comp] = mod.dot_flops.get(comp, 0.0) + sum(
        inside(c) for c, kind in mod.calls.get(comp, ()) if kind == "call"
      )
    return own[comp]

  def of(ins, types):
    if ins.opcode == "fusion":
      return sum(inside(c) for _, c in hlo._CALLED_RE.findall(ins.attrs))
    if ins.opcode == "dot":
      return hlo_ops._dot_flops(ins, types)
    if ins.opcode == "convolution":
      return hlo_ops._conv_flops(ins, types)
    if ins.opcode == "custom-call":
      return hlo_ops.custom_call_flops(ins.attrs) or hlo_ops.splash_flops(ins, types)
    return 0.0

  return of


def _grouped(ins, types):
  """What a grouped matmul's Pallas call holds, else None: {"groups" G, "weights" (bytes of
  its per-group matrices, operands of rank 3 with G leading), "rows" (bytes of its row
  operands, rank 2), "other" (the rest of its operands), "m" (rows of its row buffer),
  "per_group_result" (a tgmm: its result holds a matrix per group)}.

  Such a kernel (megablox's `gmm`/`tgmm`, `kernels.tpu_quant`'s) takes its grid's metadata
  first: the number of grid steps (s32[]) and the G + 1 group offsets (s32[G + 1])."""
  if 'custom_call_target="tpu_custom_call"' not in ins.attrs:
    return None
  shapes = [hlo_ops._dims(types.get(o, "")) for o in ins.operands]
  kinds = [types.get(o, "")[:4] for o in ins.operands]
  if len(shapes) < 3 or shapes[0] != [] or len(shapes[1]) != 1 or kinds[:2] != ["s32[", "s32["]:
    return None
  G = shapes[1][0] - 1
  out = hlo_ops._dims(ins.type)
  weights = rows = other = 0.0
  row_dims = []
  for o, dims, kind in zip(ins.operands, shapes, kinds):
    b = measure.shape_bytes(types.get(o, ""))
    if len(dims) == 3 and dims[0] == G:
      weights += b
    elif len(dims) == 2 and kind != "s32[":
      rows += b
      row_dims.append(set(dims))
    else:
      other += b
  if G < 1 or not (weights or len(out) == 3):
    return None
  tgmm = len(out) == 3 and out[0] == G
  common = set.intersection(*row_dims) if row_dims else set()
  m = out[0] if not tgmm and len(out) == 2 else max(common, default=0)
  return dict(
    groups=G,
    weights=weights,
    rows=rows,
    other=other,
    m=m,
    result=measure.shape_bytes(ins.type),
    per_group_result=tgmm,
  )


def _in_vmem(ins, types):
  return [o for o in ins.operands if _VMEM_RE.search(types.get(o, ""))]


def _visited(ins, types, kernel, sizes, row_tile):
  """(read, written, vmem of those, share of the row buffer visited) of a grouped kernel
  whose groups hold `sizes` rows (in order from row 0): the row tiles that hold a group's
  rows (a tile across a group boundary visited once per group), the matrices of the
  non-empty groups; an operand or result in VMEM at those rates too."""
  sizes = [max(float(x), 0.0) for x in sizes]
  start, tiles = 0.0, 0
  for rows in sizes:
    if rows > 0:
      tiles += int((start + rows - 1) // row_tile) - int(start // row_tile) + 1
    start += rows
  G = kernel["groups"]
  share = min(tiles * row_tile / (kernel["m"] or 1), 1.0)
  nonempty = sum(1 for x in sizes if x > 0) / G
  read = vmem = 0.0
  in_vmem = set(_in_vmem(ins, types))
  for o in ins.operands:
    dims, b = hlo_ops._dims(types.get(o, "")), measure.shape_bytes(types.get(o, ""))
    if len(dims) == 3 and dims[0] == G:
      b *= nonempty  # a matrix per group: the non-empty groups'
    elif len(dims) == 2 and not types.get(o, "").startswith("s32["):
      b *= share  # the row buffer: its visited tiles
    read += b
    vmem += b if o in in_vmem else 0.0
  # tgmm's result, a matrix per group, is written whole (it zeroes the empty groups').
  written = kernel["result"] * (1.0 if kernel["per_group_result"] else share)
  vmem += written if _VMEM_RE.search(ins.type) else 0.0
  return read, written, vmem, share


def grouped_kernels(compiled_or_text, trip_counts=None):
  """The grouped matmuls' Pallas calls of a program (`_grouped`), with what their grids skip.

  Its grid (`make_group_metadata(visit_empty_groups=False)`, gmm) has no step for an empty
  group, so the pipeline never fetches that group's blocks; its declared bytes (what XLA
  counts) hold every group's matrix once.

  Returns:
    [{"name", "groups" (G), "weight_bytes" (its matrices' bytes), "declared" (its declared
    bytes), "runs"}], one per call.
  """
  mod = measure._module(compiled_or_text)
  runs = mod.executions(trip_counts, default_trip_count=1)
  out = []
  for comp in _kernel_computations(mod):
    instrs = mod.comps.get(comp, ())
    types = {ins.name: ins.type for ins in instrs}
    for ins in instrs:
      declared = _DECLARED_RE.search(ins.attrs) if ins.opcode == "custom-call" else None
      kernel = _grouped(ins, types) if declared else None
      if kernel and kernel["weights"]:
        out.append(
          dict(
            name=ins.name,
            groups=kernel["groups"],
            weight_bytes=kernel["weights"],
            declared=float(declared.group(1)),
            runs=runs.get(comp, 0.0),
          )
        )
  return out


def step_bytes(compiled_or_text, trip_counts=None, rows=None, cost=None, **visit):
  """HBM bytes one run of a program accesses, by the one count, with XLA's beside it.

  Args:
    compiled_or_text: a `jax.stages.Compiled`, its HLO text, or an `HloModule`.
    trip_counts: as in `op_bytes`.
    rows: `op_bytes(...)` when the caller has it already.
    cost: XLA's `cost_analysis()` dict for text input (default None: the compiled's own).
    **visit: `groups`, `row_tile` of `op_bytes`.

  Returns:
    dict: "hbm" (the sum over ops of their `hbm` times their runs), "xla" (XLA's "bytes
    accessed", every computation once; None when not known).
  """
  rows = op_bytes(compiled_or_text, trip_counts, **visit) if rows is None else rows
  if cost is None and hasattr(compiled_or_text, "cost_analysis"):
    cost = measure._cost(compiled_or_text)
  xla = float(cost["bytes accessed"]) if cost and "bytes accessed" in cost else None
  return {"hbm": sum(r["total"] for r in rows), "xla": xla}


def by_scope(rows, depth=2):
  """Bytes per named-scope prefix of `depth` parts, largest first: [(scope, bytes)]."""
  out = collections.Counter()
  for r in rows:
    out["/".join(r["scope"].split("/")[:depth]) or "(no scope)"] += r["total"]
  return out.most_common()


def table(compiled, trip_counts=None, top=15, **visit):
  """A Markdown report: the one count, per-scope totals, the `top` ops (an in-place update
  marked "in place") and the program's updates of 1 MB or more, in place or not."""
  every = op_bytes(compiled, trip_counts, **visit)
  counts = step_bytes(compiled, trip_counts, every)
  rows = [r for r in every if r["total"] > 0]
  total = sum(r["total"] for r in rows) or 1.0
  gb = 1e9
  xla = f"{counts['xla'] / gb:.2f} GB" if counts["xla"] is not None else "not known"
  lines = [
    f"HBM bytes by the one count: {counts['hbm'] / gb:.2f} GB per device per step (XLA's "
    f"bytes accessed, loop bodies once: {xla})\n",
    "| scope | GB | share |",
    "|---|---|---|",
  ]
  lines += [f"| {s} | {b / gb:.3f} | {b / total:.1%} |" for s, b in by_scope(rows)[:top]]
  lines += ["", "| op | scope | shape | runs | GB | share |", "|---|---|---|---|---|---|"]
  for r in rows[:top]:
    mark = " (in place)" if r["inplace"] else ""
    lines.append(
      f"| {r['opcode']} {r['name']}{mark} | {r['scope'] or '-'} | {r['shape'][:60]} | "
      f"{r['runs']:g} | {r['total'] / gb:.3f} | {r['total'] / total:.1%} |"
    )
  updates = inplace.table(compiled, trip_counts, min_bytes=1e6)
  lines += ["", "Updates of 1 MB or more (`bench.reading.inplace`):", "", updates]
  return "\n".join(lines)
