"""Which updates of a compiled program run in place, and the HBM bytes such an update moves.

A `dynamic-update-slice` or `scatter` writes part of a buffer. When its output shares its
operand's buffer (a loop carry, a donated argument, a fusion whose root is the update), it
reads and writes only the slice it updates: the update (and a scatter's indices) read, the
update's rows written; the rest of the buffer is not touched. When it cannot share the
buffer, XLA's copy insertion puts an explicit `copy` of the whole buffer before it, which
`bench.reading.hbm` counts whole like any op. So in the optimised (scheduled) module every
update that XLA's buffer-sharing rule admits is in place, and this module decides it from
the module's structure, by XLA's rule (`HloDataflowAnalysis::CanShareOperandBufferWithUser`),
not from names:

  * an unfused `dynamic-update-slice` or `scatter`: in place on its buffer operand(s);
  * a fusion whose root (or an element of its root tuple) is a `dynamic-update-slice` or
    `scatter` whose buffer operand is a parameter of the fusion (seen through bitcasts): in
    place on that fusion operand (XLA's `GetInPlaceInputOutputPairs`; copy insertion makes
    the pair share one buffer). Other uses of the parameter in the fusion read what they
    read: a dynamic-slice (the read of a read-modify-write, `buf[i] += g`) its slice, any
    other op the whole buffer. An update of anything else (an elementwise op's result, say)
    writes a new buffer: the fusion counts whole.

`update_bytes` gives (read, written) of such an op; `table` lists a program's updates and
whether each runs in place.

    python -m bench --tpu v5e:2x4 ... --hbm-table 15   # the HBM table names in-place updates
"""

from __future__ import annotations

import re

from bench.reading import hlo_ops

_UPDATES = ("dynamic-update-slice", "scatter")
_CALLS_RE = re.compile(r"\bcalls=%?([\w.\-]+)")
_TO_APPLY_RE = re.compile(r"\bto_apply=%?([\w.\-]+)")


def _scatter_parts(operands):
  """(buffers, indices, updates) of a scatter's operands: n buffers, indices, n updates."""
  n = (len(operands) - 1) // 2
  return operands[:n], operands[n], operands[n + 1 :]


def _assigns(mod, ins):
  """Whether a scatter's combiner keeps the update (root is its second parameter): then the
  buffer's rows are written, not read."""
  m = _TO_APPLY_RE.search(ins.attrs)
  instrs = mod.comps.get(m.group(1), ()) if m else ()
  root = next((i for i in instrs if i.root), None)
  params = [i.name for i in instrs if i.opcode == "parameter"]
  return root is not None and root.opcode == "parameter" and root.name != (params or [""])[0]


def _slice_bytes(mod, ins, types):
  """(read, written) of one update that runs in place, besides its buffer: a
  dynamic-update-slice reads its update and offsets and writes the update; a scatter reads
  its indices and updates (and, unless its combiner assigns, the rows it combines with) and
  writes the updated rows."""
  size = lambda names: sum(hlo_ops.shape_bytes(types.get(o, "")) for o in names)
  if ins.opcode == "dynamic-update-slice":
    update = size(ins.operands[1:2])
    return update + size(ins.operands[2:]), update
  _, indices, updates = _scatter_parts(ins.operands)
  update = size(updates)
  return size([indices]) + update + (0 if _assigns(mod, ins) else update), update


def _operand_bytes(ins, types):
  """The bytes of an update's operands other than its buffers (update, offsets, indices)."""
  buffers = _buffer_operands(ins)
  return sum(hlo_ops.shape_bytes(types.get(o, "")) for o in ins.operands if o not in buffers)


def _buffer_operands(ins):
  if ins.opcode == "dynamic-update-slice":
    return ins.operands[:1]
  return _scatter_parts(ins.operands)[0]


def _fusion_updates(mod, ins):
  """{fusion operand index: (read, written) of its in-place update} of a fusion, and the
  bytes of the root elements those updates are (their whole size, replaced)."""
  called = _CALLS_RE.search(ins.attrs)
  instrs = mod.comps.get(called.group(1), ()) if called else ()
  by_name = {i.name: i for i in instrs}
  types = {i.name: i.type for i in instrs}
  users = {}
  for i in instrs:
    for o in i.operands:
      users.setdefault(o, []).append(i)
  root = next((i for i in instrs if i.root), None)
  if root is None:
    return {}, 0.0
  elements = [by_name.get(o) for o in root.operands] if root.opcode == "tuple" else [root]
  found, replaced = {}, 0.0
  for el in elements:
    if el is None or el.opcode not in _UPDATES:
      continue
    params, seen = [], set()
    for buf in _buffer_operands(el):
      src = by_name.get(buf)
      seen.add(buf)
      while src is not None and src.opcode == "bitcast":
        seen.add(src.operands[0])
        src = by_name.get(src.operands[0])
      if src is None or src.opcode != "parameter":
        params = []
        break
      params.append((int(src.args), src.name))
    if not params:
      continue
    # The update and offsets are the fusion's other operands (read whole there); of the
    # buffer, a combining scatter reads the rows it updates, a dynamic-slice beside the
    # update (a read-modify-write) the slice it takes, any other use the whole buffer.
    read, written = _slice_bytes(mod, el, types)
    combined = read - _operand_bytes(el, types)
    for k, (p, name) in enumerate(params):  # a variadic scatter's bytes go to its first
      beside = 0.0
      around = {u.name: u for b in seen | {name} for u in users.get(b, ())}
      for u in around.values():
        if u is el or u.name in seen:
          continue
        whole = u.opcode != "dynamic-slice"
        beside += hlo_ops.shape_bytes(types[name] if whole else u.type)
      found[p] = (combined + beside, written) if k == 0 else (beside, 0.0)
    replaced += hlo_ops.shape_bytes(el.type)
  return found, replaced


def update_bytes(mod, ins, types):
  """(read, written) HBM bytes of `ins` when it updates a buffer in place, else None.

  Args:
    mod: the parsed module (`hlo.parse_hlo`).
    ins: an instruction of a kernel computation (not one inside a fusion).
    types: {name: type} of its computation.

  Returns:
    None, or (read, written): the bytes of its operands other than the updated buffers and
    of the slices it writes (a fusion's other outputs and operands whole).
  """
  size = lambda names: sum(hlo_ops.shape_bytes(types.get(o, "")) for o in names)
  if ins.opcode in _UPDATES:
    return _slice_bytes(mod, ins, types)
  if ins.opcode != "fusion":
    return None
  found, replaced = _fusion_updates(mod, ins)
  if not found:
    return None
  others = [o for i, o in enumerate(ins.operands) if i not in found]
  read = size(others) + sum(r for r, _ in found.values())
  written = hlo_ops.shape_bytes(ins.type) - replaced + sum(w for _, w in found.values())
  return read, written


def table(compiled_or_text, trip_counts=None, min_bytes=0.0):
  """A Markdown table of a program's updates (dynamic-update-slice and scatter, unfused or a
  fusion's root) whose operands and result come to `min_bytes` or more: each op, its
  computation, whether it runs in place, and its bytes per run by this rule and counted
  whole."""
  from bench.reading import hbm, measure

  mod = measure._module(compiled_or_text)
  runs = mod.executions(trip_counts, default_trip_count=1)
  lines = [
    "| op | computation | result | runs | in place | MB per run | MB whole |",
    "|---|---|---|---|---|---|---|",
  ]
  for comp in sorted(hbm._kernel_computations(mod)):
    instrs = mod.comps.get(comp, ())
    types = {i.name: i.type for i in instrs}
    for ins in instrs:
      kind = ins.opcode if ins.opcode in _UPDATES else _fused_update(mod, ins)
      if kind is None:
        continue
      whole = sum(hlo_ops.shape_bytes(types.get(o, "")) for o in ins.operands)
      whole += hlo_ops.shape_bytes(ins.type)
      if whole < min_bytes:
        continue
      got = update_bytes(mod, ins, types)
      lines.append(
        f"| {kind} {ins.name} | {comp} | {ins.type.split('{')[0][:48]} | "
        f"{runs.get(comp, 0.0):g} | {'yes' if got else 'no'} | "
        f"{(sum(got) if got else whole) / 1e6:.2f} | {whole / 1e6:.2f} |"
      )
  return "\n".join(lines) + "\n"


def _fused_update(mod, ins):
  """The update opcode at a fusion's root (or in its root tuple), else None."""
  if ins.opcode != "fusion":
    return None
  called = _CALLS_RE.search(ins.attrs)
  instrs = mod.comps.get(called.group(1), ()) if called else ()
  root = next((i for i in instrs if i.root), None)
  if root is None:
    return None
  by_name = {i.name: i for i in instrs}
  elements = [by_name.get(o) for o in root.operands] if root.opcode == "tuple" else [root]
  kinds = [e.opcode for e in elements if e is not None and e.opcode in _UPDATES]
  return f"fusion ({kinds[0]})" if kinds else None


def main(argv=None):
  """`python -m bench.reading.inplace`: the updates of 1 MB or more of a layer's training
  step compiled for a TPU (T=32768, D=2048, F=4096, K=2, bfloat16, uniform routing,
  impl="auto", forward+backward), or of a saved HLO text (`--hlo`)."""
  import argparse
  import os
  import sys

  p = argparse.ArgumentParser(prog="python -m bench.reading.inplace", description=main.__doc__)
  p.add_argument("--tpu", default="v5e:2x4")
  p.add_argument("-E", "--experts", type=int, default=64)
  p.add_argument("--placement", default="served")
  p.add_argument("--replicas", type=int, default=8)
  p.add_argument("--hlo", help="read this optimised HLO text instead of compiling")
  p.add_argument("--save-hlo", help="write the compiled program's HLO text here")
  a = p.parse_args(argv)
  trips = {}
  if a.hlo:
    with open(a.hlo) as f:
      text = f.read()
  else:
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    from bench.cases import build, impls
    from bench.cases import programs as progs
    from bench.command import run as bench_run
    from bench.reading import tpu

    mesh = bench_run.make_mesh(None, tpu.devices(a.tpu))
    size = build.Size(
      T=32768, D=2048, F=4096, K=2, dtype="bfloat16", placement=a.placement, replicas=a.replicas
    )
    case = build.make_case("layer", a.experts, "uniform", size, mesh, abstract=True)
    text = progs.programs(case, "auto")["fwd_bwd"].lower(*case.args).compile().as_text()
    trips = impls.BENCH_IMPLS["auto"].accounting(case, on_tpu=True).trips[0]
    if a.save_hlo:
      with open(a.save_hlo, "w") as f:
        f.write(text)
  sys.stdout.write(table(text, trips, min_bytes=1e6))
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
