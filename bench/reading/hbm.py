"""Where a compiled program's HBM traffic goes: a table of ops by bytes accessed.

For each instruction that runs as its own kernel (in the entry computation, a while body or
condition, or a called computation; not the instructions inside a fusion), the bytes it
reads (its operands) and writes (its result), times the number of times its computation
runs (loop bodies scaled by their trip counts, as `measure.executed_flops` does). Ops that
move no data (parameters, tuples, bitcasts, the control flow itself) count zero; an async
copy or slice counts once, at its `-done`, as the data it moves read and written. This is
the model behind XLA's "bytes accessed" (`cost_analysis()`), written out per op so that the
big ones can be named; XLA's own total is reported beside it. A Pallas TPU kernel
(`tpu_custom_call`, e.g. megablox's) counts the bytes it declares in its cost estimate, as
XLA does. An in-place update (a dynamic-update-slice into a loop carry) is counted whole
here, so the model over-counts such ops: read their rows as an upper bound.

Executed bytes (`executed_bytes`). XLA's cost analysis visits every computation once, so a
`while_loop` body counts once whatever its trip count: once too few for a loop that runs
twice, once too many for one that never runs (the dispatches' overflow rounds under even
routing). The same rule as `measure.executed_flops` corrects it, with this module's bytes
for the body:

    executed = cost_analysis()["bytes accessed"] + sum_ops bytes(op) * (runs(op) - 1)

(only ops in loop bodies have runs != 1).

Bytes in VMEM (`vmem`, and `executed_bytes`'s "no_prefetch"). XLA's memory-space assignment
prefetches whole operands into VMEM (`copy-start`/`copy-done` whose result is in memory
space `S(1)`); its "bytes accessed" counts such a copy as bytes read and written, and the op
that then reads the copy as reading HBM again. At decode, where one weight matrix is the
step's traffic, that counts the prefetched matrix up to three times. Each op's `vmem` is the
part of its bytes that is VMEM's: what it writes to, or reads from, a value of memory space
`S(1)` (an eviction, a copy out of VMEM, reads it there); the second count is XLA's
executed bytes less every op's `vmem` times its runs.

    python -m bench --tpu v5e:2x4 --hbm-table 15 ...
"""

from __future__ import annotations

import collections
import re

from bench.reading import hlo_ops, measure

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


def op_bytes(compiled_or_text, trip_counts=None):
  """Per-op HBM bytes of one run: a list of dicts, largest first.

  Each: scope (named-scope path), opcode, name, shape (result type), runs (executions; 0
  for the ops of a loop that never runs), read and written (bytes per run), total (bytes
  over the run), vmem (of read + written, the bytes of values in VMEM, per run).
  """
  mod = measure._module(compiled_or_text)
  runs = mod.executions(trip_counts, default_trip_count=1)
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
      vmem = 0.0
      if ins.opcode in ("copy-done", "slice-done"):  # the slice or copy: read, then written
        read = written = measure.shape_bytes(ins.type)
        vmem = written if _VMEM_RE.search(ins.type) else 0.0  # a prefetch into VMEM
        # An eviction out of VMEM reads VMEM: its start's (destination, source, context)
        # tuple holds the source's memory space second.
        start = measure._split_top_level(types.get(ins.operands[0], "()")[1:-1])
        if ins.opcode == "copy-done" and len(start) > 1 and _VMEM_RE.search(start[1]):
          vmem += read
      elif declared and 'custom_call_target="tpu_custom_call"' in ins.attrs:
        written = measure.shape_bytes(ins.type)
        read = max(float(declared.group(1)) - written, 0.0)
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
          total=n * (read + written),
          vmem=vmem,
        )
      )
  return sorted(rows, key=lambda r: -r["total"])


def grouped_kernels(compiled_or_text, trip_counts=None):
  """The grouped matmuls' Pallas calls of a program, with what their grids skip.

  A grouped-matmul kernel (megablox's `gmm`, `kernels.tpu_quant`'s) takes its grid's
  metadata first: the number of grid steps (s32[]) and the G + 1 group offsets
  (s32[G + 1]); its matrices are the operands of rank 3 with G leading (w, or a quantized
  matrix's values and scales). Its grid (`make_group_metadata(visit_empty_groups=False)`)
  has no step for an empty group, so the pipeline never fetches that group's blocks; its
  declared bytes (what XLA counts) hold every group's matrix once.

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
      if not declared or 'custom_call_target="tpu_custom_call"' not in ins.attrs:
        continue
      shapes = [hlo_ops._dims(types.get(o, "")) for o in ins.operands]
      kinds = [types.get(o, "")[:4] for o in ins.operands]
      if len(shapes) < 3 or shapes[0] != [] or len(shapes[1]) != 1 or kinds[:2] != ["s32[", "s32["]:
        continue
      G = shapes[1][0] - 1
      weights = [
        measure.shape_bytes(types[o])
        for o, dims in zip(ins.operands, shapes)
        if len(dims) == 3 and dims[0] == G
      ]
      if G >= 1 and weights:
        out.append(
          dict(
            name=ins.name,
            groups=G,
            weight_bytes=float(sum(weights)),
            declared=float(declared.group(1)),
            runs=runs.get(comp, 0.0),
          )
        )
  return out


def executed_bytes(compiled, trip_counts=None, rows=None):
  """HBM bytes one run of `compiled` accesses, loop bodies times their trip counts.

  executed = XLA's "bytes accessed" + sum over ops of bytes per run * (runs - counted); see
  the module docstring (counted: 1, or 0 in a conditional branch XLA did not count). A loop with no trip count known or given counts once (as XLA does).
  `rows`: `op_bytes(compiled, trip_counts)` when the caller has it already.

  Returns:
    dict: "executed" (that), "xla" (XLA's figure, bodies once), "no_prefetch" (executed
    less the bytes of values in VMEM: the prefetches' writes and the reads of them).
  """
  xla = measure.bytes_accessed(compiled)
  rows = op_bytes(compiled, trip_counts) if rows is None else rows
  per_comp = collections.Counter()
  for r in rows:
    per_comp[r["computation"]] += r["read"] + r["written"]
  # XLA counts one branch of a conditional (its costliest), every other computation once.
  counted = measure.xla_counted(measure._module(compiled), per_comp)
  executed = xla + sum(
    (r["read"] + r["written"]) * (r["runs"] - counted.get(r["computation"], 1.0)) for r in rows
  )
  return {
    "executed": executed,
    "xla": xla,
    "no_prefetch": executed - sum(r["vmem"] * r["runs"] for r in rows),
  }


def by_scope(rows, depth=2):
  """Bytes per named-scope prefix of `depth` parts, largest first: [(scope, bytes)]."""
  out = collections.Counter()
  for r in rows:
    out["/".join(r["scope"].split("/")[:depth]) or "(no scope)"] += r["total"]
  return out.most_common()


def table(compiled, trip_counts=None, top=15):
  """A Markdown report: the totals, per-scope totals and the `top` ops."""
  every = op_bytes(compiled, trip_counts)
  xla = executed_bytes(compiled, trip_counts, every)
  rows = [r for r in every if r["total"] > 0]
  total = sum(r["total"] for r in rows)
  gb = 1e9
  lines = [
    f"HBM bytes by this model: {total / gb:.2f} GB per device per step (XLA's bytes "
    f"accessed: {xla['xla'] / gb:.2f} GB with loop bodies once, "
    f"{xla['executed'] / gb:.2f} GB with loop bodies times their trip counts)\n",
    "| scope | GB | share |",
    "|---|---|---|",
  ]
  lines += [f"| {s} | {b / gb:.3f} | {b / total:.1%} |" for s, b in by_scope(rows)[:top]]
  lines += ["", "| op | scope | shape | runs | GB | share |", "|---|---|---|---|---|---|"]
  for r in rows[:top]:
    lines.append(
      f"| {r['opcode']} {r['name']} | {r['scope'] or '-'} | {r['shape'][:60]} | "
      f"{r['runs']:g} | {r['total'] / gb:.3f} | {r['total'] / total:.1%} |"
    )
  return "\n".join(lines) + "\n"
