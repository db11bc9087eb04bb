"""The optimised HLO text of a compiled program, parsed: computations, their instructions and
calls, while loops and conditionals (`parse_hlo`), and how often each computation runs in
one run of the program (`HloModule.executions`, loops scaled by their trip counts, the
branch of a conditional that runs picked by `branch_key`)."""

from __future__ import annotations

import dataclasses
import re

from bench.reading.hlo_ops import (
  _collective_kind,
  _conv_flops,
  _dot_flops,
  _group_size,
  _result_bytes,
  _wire_bytes,
  custom_call_flops,
  instruction_lines,
  shape_bytes,
)

_HEADER_RE = re.compile(r"^(ENTRY\s+)?%?([\w.\-]+)\s*\(.*\)\s*->\s*.*\{\s*$")


_INSTR_RE = re.compile(r"^\s*(ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*)$")


_CALLED_RE = re.compile(
  r"\b(calls|body|condition|to_apply|true_computation|false_computation)=%?([\w.\-]+)"
)


_BRANCHES_RE = re.compile(r"branch_computations=\{([^}]*)\}")


_TRIP_RE = re.compile(r'"known_trip_count":\{"n":"(\d+)"\}')


_OPNAME_RE = re.compile(r'op_name="([^"]*)"')


@dataclasses.dataclass
class Instruction:
  name: str
  type: str  # result type, e.g. "f32[8,4]{1,0}"
  opcode: str
  operands: list  # operand instruction names
  attrs: str  # everything after the operand list
  args: str = ""  # the text between the opcode's parentheses (a constant's value)
  root: bool = False


@dataclasses.dataclass
class WhileLoop:
  """One while instruction: where it is, what it runs, and its scope."""

  name: str  # the while instruction
  parent: str  # the computation that contains it
  body: str
  condition: str
  op_name: str  # metadata op_name, e.g. "jit(f)/gmm_tile_64/while"
  known_trip_count: int | None  # XLA's static trip count, if it knows one

  def scope(self):
    """The named scope just around the loop ("gmm_tile_64"), or "" if none.

    Transformation wrappers that JAX adds to scope names ("jvp(gmm_tile_64)",
    "transpose(jvp(gmm_tile_64))") are removed.
    """
    path = self.scope_path()
    return path[-1] if path else ""

  def scope_path(self):
    """The scopes around the loop, outermost first, wrappers removed; [] if unscoped.

    E.g. ["jit(f)", "shard_map", "a2a_overflow_rounds", "while", "body", "gmm_tile_64"].
    """
    parts = self.op_name.split("/")
    if len(parts) < 2 or parts[-1] != "while":
      return []
    return [_unwrap(p) for p in parts[:-1]]

  def matches(self, key):
    """Whether a `trip_counts` key names this loop: "scope" or "outer/.../scope".

    A plain key matches the scope just around the loop; a path key also needs its outer
    scopes, in order, among the loop's enclosing ones (not necessarily adjacent).
    """
    *outer, last = key.split("/")
    path = self.scope_path()
    if not path or path[-1] != last:
      return False
    rest = iter(path[:-1])
    return all(any(p == o for p in rest) for o in outer)


@dataclasses.dataclass
class Conditional:
  """One conditional instruction: its branches in index order, and its scope."""

  name: str
  parent: str
  branches: list  # branch computations; a pred conditional: [false, true]
  op_name: str  # metadata op_name, e.g. "jit(f)/step_placement/cond"

  def matches(self, key):
    """Whether a `branch_key(scope)` key names this conditional: its scope (or a path of
    scopes, as for loops) around it."""
    if not key.endswith(BRANCH):
      return False
    parts = [_unwrap(p) for p in self.op_name.split("/")[:-1]]
    *outer, last = key[: -len(BRANCH)].split("/")
    if not parts or parts[-1] != last:
      return False
    rest = iter(parts[:-1])
    return all(any(p == o for p in rest) for o in outer)


BRANCH = ":branch"


def branch_key(scope):
  """The `trip_counts` key that says which branch the conditionals under `scope` take: its
  value is the branch index (a `lax.cond`'s: 0 false, 1 true). Without one, every branch
  counts as running as often as its caller."""
  return scope + BRANCH


def _unwrap(scope):
  # "transpose(jvp(gmm_tile_64))" -> "gmm_tile_64".
  while m := re.fullmatch(r"[\w]+\((.*)\)", scope):
    scope = m.group(1)
  return scope


@dataclasses.dataclass
class HloModule:
  """Per-computation summary of an optimised HLO module.

  Attributes:
    entry: name of the entry computation.
    calls: computation -> list of (callee, kind): kind is "while" for a while body, "cond"
      for a while condition, "branch" for a conditional's branch, "call" for anything else
      (fusion, call, reducer).
    dot_flops: computation -> FLOPs of its own dot instructions.
    collectives: computation -> {kind: {"count", "operand_bytes", "result_bytes",
      "wire_bytes"}} for its own collective instructions.
    loops: the while instructions, in text order.
    comps: computation -> its `Instruction`s (for per-instruction tables, `bench/reading/hbm.py`).
    conditionals: the conditional instructions (`Conditional`), in text order.
  """

  entry: str
  calls: dict
  dot_flops: dict
  collectives: dict
  loops: list
  comps: dict = dataclasses.field(default_factory=dict)
  conditionals: list = dataclasses.field(default_factory=list)

  def executions(self, trip_counts=None, default_trip_count=None):
    """Returns computation -> how many times it runs in one run of the program.

    Args:
      trip_counts: {scope: total iterations} for loops under `jax.named_scope(scope)`;
        the count is the total over the whole run; and {`branch_key(scope)`: index} for
        the conditionals under a scope: only that branch runs. Default None.
      default_trip_count: iterations per entry for a loop that has neither a known trip
        count nor a `trip_counts` entry (default None: raise).

    Raises:
      ValueError: a loop whose trip count is unknown and not given.
    """
    trip_counts = dict(trip_counts or {})
    by_body = {lp.body: lp for lp in self.loops}
    taken = {}  # (conditional's computation, branch computation) -> runs with its caller
    for cond in self.conditionals:
      keys = [k for k in trip_counts if cond.matches(k)]
      for i, branch in enumerate(cond.branches):
        runs_it = not keys or int(trip_counts[max(keys, key=lambda k: k.count("/"))]) == i
        taken[(cond.parent, branch)] = taken.get((cond.parent, branch), False) or runs_it
    # Kahn's order over the call graph (a DAG): a computation's count is final before
    # its callees get theirs.
    indegree = {}
    for callees in self.calls.values():
      for callee, _ in callees:
        indegree[callee] = indegree.get(callee, 0) + 1
    runs = {self.entry: 1.0}
    ready = [self.entry]
    while ready:
      comp = ready.pop()
      for callee, kind in self.calls.get(comp, ()):
        n = runs.get(comp, 0.0)
        # A branch not taken, or a loop inside one (a computation that never runs).
        if (kind == "branch" and not taken.get((comp, callee), True)) or (
          kind == "while" and n == 0.0
        ):
          n = 0.0
        elif kind == "while":
          lp = by_body[callee]
          key = _best_key(lp, trip_counts)
          if key is not None:
            n = float(trip_counts[key])
          elif lp.known_trip_count is not None:
            n = lp.known_trip_count * runs.get(comp, 0.0)
          elif default_trip_count is not None:
            n = default_trip_count * runs.get(comp, 0.0)
          else:
            raise ValueError(
              f"measure: while loop {lp.name} (scope {lp.scope()!r}, op_name "
              f"{lp.op_name!r}) has no known trip count; pass trip_counts="
              f"{{{lp.scope()!r}: total iterations}} or default_trip_count"
            )
        runs[callee] = runs.get(callee, 0.0) + n
        indegree[callee] -= 1
        if indegree[callee] == 0:
          ready.append(callee)
    return runs


def _best_key(loop, trip_counts):
  """The most specific `trip_counts` key naming `loop` (most path parts), or None."""
  keys = [k for k in trip_counts if loop.matches(k)]
  return max(keys, key=lambda k: k.count("/")) if keys else None


def parse_hlo(text):
  """Parses `compiled.as_text()` into an `HloModule`."""
  comps = {}  # name -> list[Instruction]
  entry = None
  current = None
  for line in instruction_lines(text):  # an instruction's continuation lines joined
    if current is None:
      m = _HEADER_RE.match(line)
      if m:
        current = m.group(2)
        comps[current] = []
        if m.group(1):
          entry = current
      continue
    if line.startswith("}"):  # "}", or "}, execution_thread=..." (TPU7x's SparseCore)
      current = None
      continue
    ins = _parse_instruction(line)
    if ins is not None:
      comps[current].append(ins)
  if entry is None:
    raise ValueError("measure: no ENTRY computation in the HLO text")

  calls, dot_flops, collectives, loops, conditionals = {}, {}, {}, [], []
  for comp, instrs in comps.items():
    types = {ins.name: ins.type for ins in instrs}
    flops = 0.0
    coll = {}
    callees = []
    for ins in instrs:
      if ins.opcode == "dot":
        flops += _dot_flops(ins, types)
      elif ins.opcode == "convolution":  # TPU writes matmuls as convolutions
        flops += _conv_flops(ins, types)
      elif ins.opcode == "custom-call":  # a Pallas TPU kernel: the cost it declares
        flops += custom_call_flops(ins.attrs)
      kind = _collective_kind(ins.opcode)
      if kind:
        c = coll.setdefault(
          kind, {"count": 0, "operand_bytes": 0, "result_bytes": 0, "wire_bytes": 0}
        )
        operand = sum(shape_bytes(types.get(o, "")) for o in ins.operands)
        result = _result_bytes(ins)
        c["count"] += 1
        c["operand_bytes"] += operand
        c["result_bytes"] += result
        if kind == "ragged-all-to-all":  # what may leave: its first operand, the data
          operand = shape_bytes(types.get(ins.operands[0], "")) if ins.operands else 0
        c["wire_bytes"] += _wire_bytes(kind, operand, result, _group_size(ins.attrs))
      branches = []
      for key, callee in _CALLED_RE.findall(ins.attrs):
        if key in ("true_computation", "false_computation"):
          branches.insert(0 if key == "false_computation" else len(branches), callee)
          continue
        kind_call = {"body": "while", "condition": "cond"}.get(key, "call")
        callees.append((callee, kind_call))
      for group in _BRANCHES_RE.findall(ins.attrs):
        branches += [b.strip().lstrip("%") for b in group.split(",") if b.strip()]
      if branches:
        callees.extend((b, "branch") for b in branches)
        op_name = _OPNAME_RE.search(ins.attrs)
        conditionals.append(
          Conditional(ins.name, comp, branches, op_name.group(1) if op_name else "")
        )
      if ins.opcode == "while":
        body = re.search(r"\bbody=%?([\w.\-]+)", ins.attrs).group(1)
        cond = re.search(r"\bcondition=%?([\w.\-]+)", ins.attrs).group(1)
        trip = _TRIP_RE.search(ins.attrs)
        op_name = _OPNAME_RE.search(ins.attrs)
        loops.append(
          WhileLoop(
            ins.name,
            comp,
            body,
            cond,
            op_name.group(1) if op_name else "",
            int(trip.group(1)) if trip else None,
          )
        )
    calls[comp] = callees
    dot_flops[comp] = flops
    if coll:
      collectives[comp] = coll
  for lp in loops:
    if lp.known_trip_count is None:
      lp.known_trip_count = _counted_loop_trips(lp, comps)
  for cond in conditionals:
    if not cond.op_name:
      cond.op_name = _cond_op_name(cond, comps)
  return HloModule(entry, calls, dot_flops, collectives, loops, comps, conditionals)


_BRANCH_FUN_RE = re.compile(r"^(.*)/cond/branch_(\d+)_fun/")


def _cond_op_name(cond, comps):
  """A conditional's op_name when XLA left it none (seen on TPU for a `lax.cond`'s
  forward): from its branches' own ops, which JAX names ".../cond/branch_<i>_fun/..."."""
  for branch in cond.branches:
    for ins in comps.get(branch, ()):
      m = _OPNAME_RE.search(ins.attrs)
      inner = _BRANCH_FUN_RE.match(m.group(1)) if m else None
      if inner:
        return inner.group(1) + "/cond"
  return ""


def _counted_loop_trips(loop, comps):
  """The trip count of a counted loop XLA wrote without `known_trip_count`, or None.

  Recognises `i = a; while (i < n) {...; i = i + s}` on one tuple element, a, n and s
  constants (s > 0): the condition's root compares that element with n (LT), the while's
  initial tuple holds a there and the body's root tuple holds element + s (the element
  possibly seen through a copy). Such loops come
  from XLA itself, e.g. the TPU partitioner's windowed einsums.
  """

  def by_name(comp):
    return {ins.name: ins for ins in comps.get(comp, ())}

  def root(comp):
    return next((ins for ins in comps.get(comp, ()) if ins.root), None)

  def constant(ins, instrs):
    while ins is not None and ins.opcode in ("copy", "bitcast", "convert") and ins.operands:
      ins = instrs.get(ins.operands[0])
    if ins is None or ins.opcode != "constant" or not re.fullmatch(r"-?\d+", ins.args):
      return None
    return int(ins.args)

  def element(ins, instrs=None):
    while instrs and ins is not None and ins.opcode in ("copy", "bitcast") and ins.operands:
      ins = instrs.get(ins.operands[0])
    m = re.search(r"\bindex=(\d+)", ins.attrs) if ins is not None else None
    return int(m.group(1)) if m and ins.opcode == "get-tuple-element" else None

  def unfused(ins, instrs):
    """(opcode, attrs, operand instructions) of `ins`, seen through a one-op fusion."""
    if ins is None:
      return None, "", []
    called = re.search(r"\bcalls=%?([\w.\-]+)", ins.attrs)
    inner = root(called.group(1)) if ins.opcode == "fusion" and called else None
    if inner is None:
      return ins.opcode, ins.attrs, [instrs.get(o) for o in ins.operands]
    params = {i.name: i for i in comps.get(called.group(1), ()) if i.opcode == "parameter"}
    if not all(o in params for o in inner.operands):
      return ins.opcode, ins.attrs, [instrs.get(o) for o in ins.operands]
    operands = [instrs.get(ins.operands[int(params[o].args)]) for o in inner.operands]
    return inner.opcode, inner.attrs, operands

  cond_ins = by_name(loop.condition)
  opcode, attrs, operands = unfused(root(loop.condition), cond_ins)
  if opcode != "compare" or "direction=LT" not in attrs or len(operands) != 2:
    return None
  k = element(operands[0])
  limit = constant(operands[1], cond_ins)
  parent = by_name(loop.parent)
  init = parent.get(parent[loop.name].operands[0]) if loop.name in parent else None
  if k is None or limit is None or init is None or init.opcode != "tuple":
    return None
  start = constant(parent.get(init.operands[k]), parent)
  body, body_ins = root(loop.body), by_name(loop.body)
  if start is None or body is None or body.opcode != "tuple":
    return None
  opcode, _, operands = unfused(body_ins.get(body.operands[k]), body_ins)
  if opcode != "add" or len(operands) != 2:
    return None
  a, b = operands
  step = (
    constant(b, body_ins)
    if element(a, body_ins) == k
    else constant(a, body_ins)
    if element(b, body_ins) == k
    else None
  )
  if not step or step < 1:
    return None
  return max(0, -(-(limit - start) // step))


def _parse_instruction(line):
  m = _INSTR_RE.match(line)
  if not m:
    return None
  name, rest = m.group(2), m.group(3)
  if rest.startswith("("):  # tuple type: up to the matching parenthesis
    depth = 0
    for i, ch in enumerate(rest):  # noqa: B007 (i, where the loop stops, is read after it)
      depth += ch == "("
      depth -= ch == ")"
      if depth == 0:
        break
    type_str, rest = rest[: i + 1], rest[i + 1 :].lstrip()
  else:
    type_str, _, rest = rest.partition(" ")
  op = re.match(r"([\w\-]+)\((.*)$", rest)
  if not op:
    return None
  opcode, tail = op.group(1), op.group(2)
  depth, i = 1, 0
  for i, ch in enumerate(tail):  # noqa: B007 (i, where the loop stops, is read after it)
    depth += ch in "({"
    depth -= ch in ")}"
    if depth == 0:
      break
  operand_str, attrs = tail[:i], tail[i + 1 :]
  operands = [o.group(1) for o in re.finditer(r"%([\w.\-]+)", operand_str)]
  return Instruction(name, type_str, opcode, operands, attrs, operand_str.strip(), bool(m.group(1)))


def _module(compiled_or_text):
  if isinstance(compiled_or_text, HloModule):
    return compiled_or_text
  text = compiled_or_text if isinstance(compiled_or_text, str) else compiled_or_text.as_text()
  return parse_hlo(text)
