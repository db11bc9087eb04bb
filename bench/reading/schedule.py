"""How much of a program's link time its schedule leaves exposed.

The roofline (`bench.reading.tpu.estimates`) takes the largest of compute, HBM and link
time: it assumes every collective runs under independent compute. The compiled schedule
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
(`hbm.op_bytes`, less the bytes of values in VMEM) over the chip's bandwidth; a while loop,
call or conditional scheduled in a window covers with its callees' ops (a loop's body times
its iterations). A collective's link time is its wire bytes (`hlo_ops._wire_bytes`) over the
link bandwidth; the exposed part is what the ops in its window do not cover (all of it for
a synchronous one). Summed over the program, each collective times the runs of its
computation (`HloModule.executions`).

    python -m bench --tpu v6e:2x4 -E 64 --levels layer --modes fwd_bwd   # "ICI exposed"
"""

from __future__ import annotations

import re

from bench.reading import hbm, hlo, hlo_ops, measure, tpu

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


def exposed_link(compiled_or_text, peak, trip_counts=None):
  """The link time of one run of a program, and the part of it its schedule leaves exposed.

  Args:
    compiled_or_text: a `jax.stages.Compiled` for TPU (or its HLO text).
    peak: the chip's peaks, {"flops", "hbm", "ici"} per second (`bench.reading.tpu.PEAKS`).
    trip_counts: as in `measure.executed_flops`, for loops and conditionals.

  Returns:
    {"link_s": every collective's link time, "exposed_s": the part no independent op
    covers}, per device, loops scaled. Their ratio is what `run` applies to a row's
    `ici_s` (whose ragged exchange's bytes are the run's own, not the HLO's bound).
  """
  mod = measure._module(compiled_or_text)
  runs = mod.executions(trip_counts, default_trip_count=1)
  op_s = {}  # (computation, op) -> seconds of one run
  for row in hbm.op_bytes(mod, trip_counts):
    op_s[(row["computation"], row["name"])] = (row["read"] + row["written"] - row["vmem"]) / peak[
      "hbm"
    ]
  flops_of = _flops(mod)
  types_of = {comp: {i.name: i.type for i in instrs} for comp, instrs in mod.comps.items()}
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
    flops = flops_of(ins, types_of[comp])
    return max(flops / peak["flops"], op_s.get((comp, ins.name), 0.0))

  link = exposed = 0.0
  for comp in hbm._kernel_computations(mod):
    n = runs.get(comp, 0.0)
    if not n:
      continue
    got = _windows(mod, comp, lambda ins, c=comp: _op_s(c, ins))
    link += n * sum(w for w, _ in got) / peak["ici"]
    exposed += n * sum(max(w / peak["ici"] - cover, 0.0) for w, cover in got)
  return {"link_s": link, "exposed_s": exposed}


def _flops(mod):
  """FLOPs of one kernel op: a dot or convolution, a Pallas kernel's declared cost, or the
  dots of the computations a fusion calls."""
  own = {}

  def inside(comp):
    if comp not in own:
      own[comp] = mod.dot_flops.get(comp, 0.0) + sum(
        inside(c) for c, kind in mod.calls.get(comp, ()) if kind == "call"
      )
    return own[comp]

  def of(ins, types):
    if ins.opcode == "fusion":
      return sum(inside(c) for c in _callees(ins))
    if ins.opcode == "dot":
      return hlo_ops._dot_flops(ins, types)
    if ins.opcode == "convolution":
      return hlo_ops._conv_flops(ins, types)
    if ins.opcode == "custom-call":
      return hlo_ops.custom_call_flops(ins.attrs)
    return 0.0

  return of


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


def exposed_row(compiled, row, topology, trip_counts=None):
  """{"ici_exposed_s"}: the row's link time (`ici_s`, whose ragged exchanges' bytes are the
  run's own) times the share of the program's link time its schedule leaves exposed; {}
  for a chip without cited peaks or a row without link time."""
  peak = tpu.PEAKS.get(tpu.generation(topology))
  if peak is None or "ici_s" not in row:
    return {}
  got = exposed_link(compiled, peak, trip_counts)
  share = got["exposed_s"] / got["link_s"] if got["link_s"] else 0.0
  return {"ici_exposed_s": row["ici_s"] * share}
