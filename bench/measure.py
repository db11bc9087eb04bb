"""What a compiled program executes: FLOPs, memory and collective bytes, read from XLA.

Three sources, all from `jax.jit(f).lower(*args).compile()` (nothing is run):

  * `compiled.cost_analysis()["flops"]`: XLA's FLOP count. It visits every computation of
    the module once, so a `while_loop` body counts once whatever its trip count.
  * `compiled.memory_analysis()`: temp / argument / output / alias bytes.
  * `compiled.as_text()`: the optimised HLO, parsed here (`parse_hlo`) into computations,
    the FLOPs of their dots, their collectives, and the while loops that run them.

Executed FLOPs (`executed_flops`). Each computation c of the module runs `executions(c)`
times: the entry once; a computation called by a fusion, call or conditional as often as
its caller; a while body `n` times per run of its caller, where n is XLA's
`known_trip_count` when the trip count is static, or the caller's number otherwise
(`trip_counts`, keyed by the `jax.named_scope` around the loop; see below). Then

    executed = cost_analysis()["flops"] + sum_c dot_flops(c) * (executions(c) - 1)

that is, XLA's own count, plus each computation's dots once more for every extra run (or
minus once for a loop body that never runs). dot_flops(c) = 2 * prod(result dims) *
prod(contracting dims) over the `dot` instructions of c and of the fusions it calls (not of
nested loop bodies, which are computations of their own); a `convolution` (how TPU programs
write matmuls) counts 2 * prod(result dims) * input features * window size, less the window
taps that fall into lhs-dilation holes or padding, as XLA counts it (`_conv_flops`); a
`tpu_custom_call` (a Pallas kernel such as megablox's) counts the FLOPs it declares
(`custom_call_flops`), so a kernel inside a loop is scaled like a dot. Other custom calls
are not parsed: XLA's own count includes them, once per computation. Elementwise FLOPs
inside loop
bodies stay counted once; for matmul-heavy loops they are well under 1%.

Naming loops. Put the loop under a scope, `with jax.named_scope("gmm_tile_64"):
lax.while_loop(...)`: XLA keeps the scope in the while instruction's metadata
(`op_name=".../gmm_tile_64/while"`), and `trip_counts={"gmm_tile_64": 37}` says that loop's
body runs 37 times in total over the whole program run (not per entry of the enclosing
loop). Every while instruction whose scope matches gets that count (e.g. the forward and
the backward loops of a custom_vjp). A key may also be a path of scopes, outermost first:
`{"gmm_tile_64": 10, "a2a_overflow_rounds/gmm_tile_64": 25}` gives the loops under
`a2a_overflow_rounds` 25 and the others 10 (the most specific matching key wins).

Collective bytes (`collective_bytes`). For each all-to-all, all-gather, reduce-scatter,
all-reduce, collective-permute and ragged-all-to-all (also their async `-start` forms;
a ragged-all-to-all's wire bytes are an upper bound, see `_wire_bytes`), the bytes of its
operands and of its result, per device: an all-to-all prints a tuple of N operands and N
results, an all-gather's result is N times its operand, a reduce-scatter's result is 1/N of
its operand. Totals are kept per computation (`HloModule.collectives`) so a caller can see
which ones sit in a while body (`HloModule.loops`) and scale them by its trip count;
`collective_bytes(..., trip_counts)` does that scaling with the same rule as FLOPs.
"""

from __future__ import annotations

import dataclasses
import math
import re

import jax
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
_HEADER_RE = re.compile(r"^(ENTRY\s+)?%?([\w.\-]+)\s*\(.*\)\s*->\s*.*\{\s*$")
_INSTR_RE = re.compile(r"^\s*(ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*)$")
_CALLED_RE = re.compile(
  r"\b(calls|body|condition|to_apply|true_computation|false_computation)=%?([\w.\-]+)"
)
_BRANCHES_RE = re.compile(r"branch_computations=\{([^}]*)\}")
_TRIP_RE = re.compile(r'"known_trip_count":\{"n":"(\d+)"\}')
_OPNAME_RE = re.compile(r'op_name="([^"]*)"')


def compile_fn(fn, *args, **jit_kwargs):
  """Lowers and compiles `jax.jit(fn, **jit_kwargs)` for `args` (arrays or ShapeDtypeStructs).

  Returns:
    the `jax.stages.Compiled` executable (not run).
  """
  return jax.jit(fn, **jit_kwargs).lower(*args).compile()


def _cost(compiled):
  cost = compiled.cost_analysis()
  if isinstance(cost, (list, tuple)):  # older JAX: one dict per program
    cost = cost[0]
  return cost


def cost_flops(compiled):
  """XLA's FLOP count (`cost_analysis()["flops"]`); loop bodies counted once."""
  return float(_cost(compiled).get("flops", 0.0))


def bytes_accessed(compiled):
  """XLA's memory-traffic count (`cost_analysis()["bytes accessed"]`); loop bodies counted
  once (`bench.hbm.executed_bytes` scales them)."""
  return float(_cost(compiled).get("bytes accessed", 0.0))


def memory_bytes(compiled):
  """Returns {"temp", "argument", "output", "alias", "generated_code"}: bytes from XLA.

  `temp` is the scratch the program allocates besides its arguments and outputs.
  """
  m = compiled.memory_analysis()
  return {
    "temp": int(m.temp_size_in_bytes),
    "argument": int(m.argument_size_in_bytes),
    "output": int(m.output_size_in_bytes),
    "alias": int(m.alias_size_in_bytes),
    "generated_code": int(m.generated_code_size_in_bytes),
  }


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
    comps: computation -> its `Instruction`s (for per-instruction tables, `bench/hbm.py`).
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
  for line in text.splitlines():
    if current is None:
      m = _HEADER_RE.match(line)
      if m:
        current = m.group(2)
        comps[current] = []
        if m.group(1):
          entry = current
      continue
    if line.strip() == "}":
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


def _dot_flops(ins, types):
  out = _dims(ins.type)
  lhs = _dims(types.get(ins.operands[0], "")) if ins.operands else []
  m = re.search(r"lhs_contracting_dims=\{([0-9,]*)\}", ins.attrs)
  contract = [int(d) for d in m.group(1).split(",") if d] if m else []
  k = int(np.prod([lhs[d] for d in contract])) if lhs and contract else 1
  return 2.0 * float(np.prod(out)) * k


_COST_RE = re.compile(r'"cost_estimate":\{"flops":"(\d+)"')


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


def _module(compiled_or_text):
  if isinstance(compiled_or_text, HloModule):
    return compiled_or_text
  text = compiled_or_text if isinstance(compiled_or_text, str) else compiled_or_text.as_text()
  return parse_hlo(text)


def executed_flops(compiled, trip_counts=None, *, default_trip_count=None):
  """FLOPs one run of `compiled` executes, loop bodies times their trip counts.

  executed = cost_analysis()["flops"] + sum_c dot_flops(c) * (executions(c) - counted(c));
  see the module docstring (counted(c): 1, or 0 for a conditional branch XLA did not count).

  Args:
    compiled: a `jax.stages.Compiled`.
    trip_counts: {scope: total iterations} for loops with a data-dependent trip count
      (default None).
    default_trip_count: iterations per entry for other unknown loops (default None: raise).

  Returns:
    dict with "executed" (the count above), "xla" (cost_analysis, bodies once),
    "dot_executed" (dot FLOPs only, times executions) and "loops": [{scope, body,
    dot_flops_per_iteration, iterations}].
  """
  mod = _module(compiled)
  runs = mod.executions(trip_counts, default_trip_count)
  own = _own_dot_flops(mod)
  xla = cost_flops(compiled)
  counted = xla_counted(mod, own)
  executed = xla + sum(f * (runs.get(c, 0.0) - counted.get(c, 0.0)) for c, f in own.items())
  loops = [
    {
      "scope": lp.scope(),
      "body": lp.body,
      "dot_flops_per_iteration": own[lp.body],
      "iterations": runs.get(lp.body, 0.0),
    }
    for lp in mod.loops
  ]
  return {
    "executed": executed,
    "xla": xla,
    "dot_executed": sum(f * runs.get(c, 0.0) for c, f in own.items()),
    "loops": loops,
  }


def xla_counted(mod, own):
  """{computation: 1 or 0}: whether XLA's `cost_analysis` counted a computation of `own`
  ({computation: its cost}) once. It counts every computation once, and of a conditional
  only its costliest branch (here: the one whose computations cost the most in `own`)."""

  def reach(start, through):
    seen, stack = {start}, [start]
    while stack:
      for callee, kind in mod.calls.get(stack.pop(), ()):
        if callee not in seen and kind in through:
          seen.add(callee)
          stack.append(callee)
    return seen

  every = ("call", "while", "cond", "branch")
  skipped = set()
  for cond in mod.conditionals:
    cost = [sum(own.get(c, 0.0) for c in reach(b, every)) for b in cond.branches]
    best = int(np.argmax(cost))
    skipped |= {b for i, b in enumerate(cond.branches) if i != best}
  counted = reach(mod.entry, ("call", "while", "cond"))
  stack = [c for c in counted]
  while stack:  # into the branches XLA counted
    for callee, kind in mod.calls.get(stack.pop(), ()):
      if callee not in counted and (kind != "branch" or callee not in skipped):
        counted.add(callee)
        stack.append(callee)
  return {c: 1.0 if c in counted else 0.0 for c in own}


def _own_dot_flops(mod):
  """Dot FLOPs of each unit (an entry, loop body or conditional branch), including the
  fusions and calls it reaches without crossing a while loop or a conditional."""
  roots = {mod.entry} | {lp.body for lp in mod.loops} | {lp.condition for lp in mod.loops}
  roots |= {b for cond in mod.conditionals for b in cond.branches}
  out = {}
  for root in roots:
    total, stack, seen = 0.0, [root], {root}
    while stack:
      c = stack.pop()
      total += mod.dot_flops.get(c, 0.0)
      for callee, kind in mod.calls.get(c, ()):
        if kind == "call" and callee not in seen:
          seen.add(callee)
          stack.append(callee)
    out[root] = total
  return out


def collective_bytes(compiled, trip_counts=None, *, default_trip_count=None):
  """Collective bytes per device that one run of `compiled` moves, per kind.

  Args:
    compiled: a `jax.stages.Compiled` (or its HLO text, or an `HloModule`).
    trip_counts, default_trip_count: as in `executed_flops`, for collectives in loops.

  Returns:
    {kind: {"count", "operand_bytes", "result_bytes", "wire_bytes"}} (wire bytes: what
    the device sends on links, see `_wire_bytes`), each multiplied by how often its
    computation runs (fractional counts never occur for integer trip counts).
  """
  mod = _module(compiled)
  runs = mod.executions(trip_counts, default_trip_count) if mod.collectives else {}
  # A collective inside a fusion or call runs as often as the nearest entry/loop body.
  home = _home_computations(mod)
  total = {}
  for comp, kinds in mod.collectives.items():
    n = runs.get(comp, runs.get(home.get(comp, mod.entry), 1.0))
    for kind, c in kinds.items():
      t = total.setdefault(
        kind, {"count": 0, "operand_bytes": 0, "result_bytes": 0, "wire_bytes": 0}
      )
      for key in t:
        t[key] += c[key] * n
  return {k: {key: int(v) for key, v in t.items()} for k, t in total.items()}


_NO_CHAIN = (0.0, frozenset())


def dependent_collectives(compiled, trip_counts=None, *, default_trip_count=None):
  """The most collectives one run of `compiled` issues one after another.

  The longest chain of collectives through the program's data dependencies: a collective
  waits for its operands, so two collectives on one chain cannot overlap, while
  independent ones (a statistic's psum beside the exchange) can. Within a computation the
  chain follows operands in the HLO text's order (operands first); a while loop adds its
  body's chain once per iteration (its carry makes each iteration wait for the last), a
  call, fusion or conditional its callee's (the longest branch's). One collective that
  XLA splits into pieces (an async collective fused with the compute it overlaps: a start,
  continuations and a done, each holding the collective, with one `channel_id` and
  `chain_id`) counts once. The count a fixed latency per collective multiplies (`bench.tpu.estimates`).

  Args:
    compiled: a `jax.stages.Compiled` (or its HLO text, or an `HloModule`).
    trip_counts, default_trip_count: as in `executed_flops`, for loops.

  Returns:
    float: collectives on the longest chain (loop iterations may make it fractional where
    a loop runs a different number of times per entry).
  """
  mod = _module(compiled)
  runs = mod.executions(trip_counts, default_trip_count) if mod.loops else {mod.entry: 1.0}
  home = _home_computations(mod)
  loops = {lp.name: (lp.body, lp.condition) for lp in mod.loops}
  memo = {}

  def chain(comp):
    """(collectives on the longest chain of one run of comp, the split ones on it)."""
    if comp in memo:
      return memo[comp]
    memo[comp] = _NO_CHAIN  # a guard: the call graph is a DAG
    depth, longest = {}, _NO_CHAIN
    for ins in mod.comps.get(comp, ()):
      # What ins adds to a chain: `own` collectives, less the `pieces` already on it.
      own, pieces = 0.0, frozenset()
      if _collective_kind(ins.opcode):
        own, piece = 1.0, re.search(r'chain_id="?(\w+)', ins.attrs)
        if piece:  # a piece of a split collective
          channel = re.search(r"\bchannel_id=(\d+)", ins.attrs)
          pieces = frozenset(
            {(channel and channel.group(1), piece.group(1), ins.type.split("{")[0])}
          )
      elif ins.opcode == "while":
        body, cond = loops[ins.name]
        entries = runs.get(comp, runs.get(home.get(comp, mod.entry), 1.0))
        iterations = runs.get(body, 0.0) / entries if entries else 0.0
        own = iterations * chain(body)[0] + (iterations + 1) * chain(cond)[0]
      else:
        callees = [c for key, c in _CALLED_RE.findall(ins.attrs) if key != "body"]
        for group in _BRANCHES_RE.findall(ins.attrs):
          callees += [b.strip().lstrip("%") for b in group.split(",") if b.strip()]
        own, pieces = max((chain(c) for c in callees), key=lambda d: d[0], default=_NO_CHAIN)
      # The longest chain through ins, over its operands'.
      best = _NO_CHAIN
      for count, seen in [depth.get(o, _NO_CHAIN) for o in ins.operands] or [_NO_CHAIN]:
        n = count + own - len(pieces & seen)
        if n > best[0]:
          best = (n, seen | pieces)
        elif n == best[0]:
          best = (n, best[1] | seen | pieces)
      depth[ins.name] = best
      if best[0] > longest[0]:
        longest = best
    memo[comp] = longest
    return longest

  return chain(mod.entry)[0]


def _home_computations(mod):
  home = {}
  roots = [mod.entry] + [lp.body for lp in mod.loops]
  roots += [b for cond in mod.conditionals for b in cond.branches]
  for root in roots:
    stack = [root]
    while stack:
      c = stack.pop()
      for callee, kind in mod.calls.get(c, ()):
        if kind == "call" and callee not in home:
          home[callee] = root
          stack.append(callee)
  return home
