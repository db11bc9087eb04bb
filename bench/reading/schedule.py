"""How much of a program's link time its schedule leaves exposed.

The whole-step lower bound (`bench.reading.estimate`'s `lower_bound_s`) takes the largest
of compute, HBM and link time: it assumes every collective runs under independent compute. The compiled schedule
says whether one can. A TPU runs a scheduled module's ops one after another, in the order
of the optimised HLO text (`is_scheduled=true`); a collective there is one of:

- synchronous (`all-to-all(...)`, `ragged-all-to-all(...)`, ...): the core waits for it;
  nothing covers it;
- asynchronous: a `<kind>-start` ... `<kind>-done` pair, or `async-start` ... `async-done`
  wrapping one; the ops scheduled between start and done run while it moves;
- split (a collective fused with the compute beside it: fusions whose computation holds
  the collective under one `channel_id` and `chain_id`, `measure.dependent_collectives`):
  the ops between its first and last piece run while it moves.

Each op's time is the larger of its FLOPs over the chip's peak and its HBM bytes
(`hbm.op_bytes`'s one count, VMEM's bytes left out) over the chip's bandwidth; a while loop,
call or conditional scheduled in a window covers with its callees' ops (a loop's body times
its iterations). A collective's link time is its wire bytes (`hlo_ops._wire_bytes`) over the
link bandwidth; the exposed part is what the ops in its window do not cover (all of it for
a synchronous one). Summed over the program, each collective times the runs of its
computation (`HloModule.executions`).

    python -m bench --tpu v6e:2x4 -E 64 --levels layer --modes fwd_bwd   # "ICI exposed"
"""

from __future__ import annotations

import re

from bench.reading import hbm, hlo, hlo_ops, measure

_CHAIN_RE = re.compile(r'chain_id="?(\w+)')
_CHANNEL_RE = re.compile(r"\bchannel_id=(\d+)")


def _callees(ins):
  names = [name for _, name in hlo._CALLED_RE.findall(ins.attrs)]
  for group in hlo._BRANCHES_RE.findall(ins.attrs):
    names += [b.strip().lstrip("%") for b in group.split(",") if b.strip()]
  return names


def _wire(ins, types):
  """The wire bytes of one collective instruction (as `hlo.parse_hlo` counts them)."""
  kind = hlo_ops._collective_kind(ins.opcode)
  operand = sum(hlo_ops.shape_bytes(types.get(o, "")) for o in ins.operands)
  if kind == "ragged-all-to-all":  # what may leave: its first operand, the data
    operand = hlo_ops.shape_bytes(types.get(ins.operands[0], "")) if ins.operands else 0
  result = hlo_ops._result_bytes(ins)
  return hlo_ops._wire_bytes(kind, operand, result, hlo_ops._group_size(ins.attrs))


def exposed_link(compiled_or_text, peak, trip_counts=None, rows=None):
  """The link time of one run of a program, the part of it its schedule leaves exposed,
  and the time of its ops.

  Args:
    compiled_or_text: a `jax.stages.Compiled` for TPU (or its HLO text, or an `HloModule`).
    peak: the chip's peaks, {"flops", "hbm", "ici"} per second (`bench.reading.tpu.PEAKS`).
    trip_counts: as in `measure.executed_flops`, for loops and conditionals.
    rows: `hbm.op_bytes(compiled_or_text, trip_counts, ...)` when the caller has it (default
      None: made here, grouped kernels at their declared cost).

  Returns:
    {"link_s": every collective's link time, "exposed_s": the part no independent op
    covers, "ops_s": the sum over the program's ops, loop bodies times their runs, of each
    op's larger of FLOPs over peak and HBM bytes (the one count) over bandwidth}, per
    device. `bench.reading.estimate.step_estimate` applies exposed_s / link_s to a row's
    link time where the caller knows its bytes (a ragged exchange's run-time sizes).
  """
  mod = measure._module(compiled_or_text)
  runs = mod.executions(trip_counts, default_trip_count=1)
  rows = hbm.op_bytes(mod, trip_counts) if rows is None else rows
  op_s = {  # (computation, op) -> seconds of one run
    (r["computation"], r["name"]): max(r["flops"] / peak["flops"], r["hbm"] / peak["hbm"])
    for r in rows
  }
  memo = {}

  def comp_s(comp):
    """One run of a kernel computation: its ops' time, nested loops and calls included."""
    if comp not in memo:
      memo[comp] = 0.0  # a guard: the call graph is a DAG
      memo[comp] = sum(_op_s(comp, ins) for ins in mod.comps.get(comp, ()))
    return memo[comp]

  def _op_s(comp, ins):
    if ins.opcode in ("while", "call", "conditional"):
      per = runs.get(comp, 0.0)
      nested = [(c, runs.get(c, 0.0) / per if per else 0.0) for c in _callees(ins)]
      return sum(n * comp_s(c) for c, n in nested)
    return op_s.get((comp, ins.name), 0.0)

  link = exposed = 0.0
  for comp in hbm._kernel_computations(mod):
    n = runs.get(comp, 0.0)
    if not n:
      continue
    got = _windows(mod, comp, lambda ins, c=comp: _op_s(c, ins))
    link += n * sum(w for w, _ in got) / peak["ici"]
    exposed += n * sum(max(w / peak["ici"] - cover, 0.0) for w, cover in got)
  return {"link_s": link, "exposed_s": exposed, "ops_s": comp_s(mod.entry)}


def _piece(mod, ins):
  """(key, wire bytes) when `ins` is a fusion holding a piece of a split collective."""
  if ins.opcode != "fusion":
    return None
  for callee in _callees(ins):
    instrs = mod.comps.get(callee, ())
    types = {i.name: i.type for i in instrs}
    for inner in instrs:
      chain = _CHAIN_RE.search(inner.attrs)
      if hlo_ops._collective_kind(inner.opcode) and chain:
        channel = _CHANNEL_RE.search(inner.attrs)
        key = (channel and channel.group(1), chain.group(1), inner.type.split("{")[0])
        return key, _wire(inner, types)
  return None


def _async_wire(mod, ins, types):
  """The wire bytes of an async start: `<kind>-start`, or `async-start` wrapping one."""
  if hlo_ops._collective_kind(ins.opcode):
    return _wire(ins, types)
  for callee in _callees(ins):
    instrs = mod.comps.get(callee, ())
    inner_types = {i.name: i.type for i in instrs}
    for inner in instrs:
      if hlo_ops._collective_kind(inner.opcode):
        return _wire(inner, inner_types)
  return None


def _windows(mod, comp, seconds):
  """[(wire bytes, seconds of the ops in its window)] for each collective of `comp`."""
  instrs = mod.comps.get(comp, ())
  types = {ins.name: ins.type for ins in instrs}
  done, open_ = [], {}  # open_: the handle the window's done will name -> [wire, cover]
  pieces = {}  # a split collective's key -> [wire, cover, cover at its last piece]
  for ins in instrs:
    piece = _piece(mod, ins)
    if piece is not None:
      key, wire = piece
      w = pieces.setdefault(key, [wire, 0.0, 0.0])
      w[2] = w[1]  # what ran between its first piece and this one
      continue
    wire = _async_wire(mod, ins, types) if ins.opcode.endswith("-start") else None
    if wire is not None:
      open_[ins.name] = [wire, 0.0]
      continue
    handle = ins.operands[0] if ins.operands else None
    if ins.opcode == "async-update" and handle in open_:
      open_[ins.name] = open_.pop(handle)
      continue
    if ins.opcode.endswith("-done") and handle in open_:
      done.append(tuple(open_.pop(handle)))
      continue
    if hlo_ops._collective_kind(ins.opcode):  # synchronous: covers nothing, covered by nothing
      done.append((_wire(ins, types), 0.0))
      continue
    t = seconds(ins)
    for w in open_.values():
      w[1] += t
    for w in pieces.values():
      w[1] += t
  done += [(wire, cover) for wire, _, cover in pieces.values()]
  done += [tuple(w) for w in open_.values()]  # a start with no done here: covered to the end
  return done
