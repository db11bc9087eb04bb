"""What a compiled program executes: FLOPs, memory and collective bytes, read from XLA.

Three sources, all from `jax.jit(f).lower(*args).compile()` (nothing is run):

  * `compiled.cost_analysis()["flops"]`: XLA's FLOP count. It visits every computation of
    the module once, so a `while_loop` body counts once whatever its trip count.
  * `compiled.memory_analysis()`: temp / argument / output / alias bytes.
  * `compiled.as_text()`: the optimised HLO, parsed by `hlo.parse_hlo` into computations,
    the FLOPs of their dots, their collectives (`hlo_ops`: the costs of one instruction),
    and the while loops and conditionals that run them.

Executed FLOPs (`executed_flops`). Each computation c of the module runs `executions(c)`
times: the entry once; a computation called by a fusion or call, or a conditional's branch
that runs (all of them unless `branch_key` names one), as often as
its caller; a while body `n` times per run of its caller, where n is XLA's
`known_trip_count` when the trip count is static, or the caller's number otherwise
(`trip_counts`, keyed by the `jax.named_scope` around the loop; see below). Then

    executed = cost_analysis()["flops"] + sum_c dot_flops(c) * (executions(c) - counted(c))

counted(c) = 1, but 0 for a branch of a conditional that XLA's count leaves out (it counts
a conditional's costliest branch, `xla_counted`),

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

import re

import jax
import numpy as np

from bench.reading.hlo import (  # noqa: F401 - re-exported: what callers read from measure
  _BRANCHES_RE,
  _CALLED_RE,
  BRANCH,
  Conditional,
  HloModule,
  Instruction,
  WhileLoop,
  _module,
  _unwrap,
  branch_key,
  parse_hlo,
)
from bench.reading.hlo_ops import (  # noqa: F401 - re-exported
  COLLECTIVES,
  _collective_kind,
  _conv_flops,
  _split_top_level,
  custom_call_flops,
  shape_bytes,
)


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
  once; a reference column beside `bench.reading.hbm.step_bytes`' one count)."""
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
  call, fusion or conditional its callee's (the longest branch of those that run, by the
  `branch_key`s in `trip_counts`). One collective that
  XLA splits into pieces (an async collective fused with the compute it overlaps: a start,
  continuations and a done, each holding the collective, with one `channel_id` and
  `chain_id`) counts once. The count a fixed latency per collective multiplies (`bench.reading.tpu.estimates`).

  Args:
    compiled: a `jax.stages.Compiled` (or its HLO text, or an `HloModule`).
    trip_counts, default_trip_count: as in `executed_flops`, for loops.

  Returns:
    float: collectives on the longest chain (loop iterations may make it fractional where
    a loop runs a different number of times per entry).
  """
  mod = _module(compiled)
  runs = (
    mod.executions(trip_counts, default_trip_count)
    if mod.loops or mod.conditionals
    else {mod.entry: 1.0}
  )
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
        if ins.opcode == "conditional":  # the branches that run (`hlo.branch_key`)
          callees = [c for c in callees if runs.get(c, 1.0) > 0] or callees
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
