"""The benchmark's implementations: one table, each a dispatch with its host accounting.

An entry names a dispatch of the library (`ms.DISPATCHES`) or holds a dispatch function of
the library's signature `(x_TD, ffn, experts_TK, weights_TK, *, mesh, cfg) -> (y_TD, stats)`,
and beside it the function giving its host-side accounting (`bench/accounting.py`: rounds,
items dropped, loop trip counts). The benchmark runs every entry the same way: the layer
with `MoEConfig(impl=dispatch)`, the kernel level through the dispatch with one matrix per
expert. "jit_" entries are the local algorithms under `jax.jit` on sharded inputs (XLA
inserts the collectives); the shard_map ones place their inputs themselves.

A dispatch defined anywhere joins with `register(name, dispatch, accounting=...)`; its
figures are then measured like the built-in ones (loops it runs are counted once unless it
brings an accounting function).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from bench import accounting, baselines


@dataclasses.dataclass(frozen=True)
class Impl:
  """An implementation the benchmark runs.

  Attributes:
    dispatch: a name of `ms.DISPATCHES`, or a dispatch function, or (`per_size`) a function
      of the benchmark's `Size` that returns one (e.g. the GShard baseline's capacity
      factor comes from the command line).
    accounting: `(case, on_tpu) -> accounting.Accounting`.
    per_size: `dispatch` is a factory of the size.
    programs: for a row that is not a dispatch (the dense limit): `case -> (programs,
      args)`, replacing the dispatch path; its forward is not checked against the MoE
      reference (it computes something else).
  """

  dispatch: str | Callable | None
  accounting: Callable = accounting.unknown
  per_size: bool = False
  programs: Callable | None = None

  def resolve(self, size):
    """The dispatch for a size: a library name or a function."""
    return self.dispatch(size) if self.per_size else self.dispatch


BENCH_IMPLS = {
  "all_to_all": Impl("all_to_all", accounting.all_to_all),
  # On CPU (no ragged-all-to-all in XLA) this runs the emulation: padded all_to_alls.
  "ragged_all_to_all": Impl("ragged_all_to_all", accounting.ragged_all_to_all),
  "all_gather": Impl("all_gather", accounting.all_gather),
  "jit_ragged_dot": Impl("ragged_dot", accounting.ragged_dot),
  "jit_masked_scan": Impl("masked_scan", accounting.masked_scan),
  "jit_gshard_einsum": Impl(
    lambda size: baselines.GShard(size.capacity_factor), accounting.gshard, per_size=True
  ),
  "dense_limit": Impl(None, accounting.unknown, programs=baselines.dense_limit),
}


def register(name, dispatch, accounting=accounting.unknown):
  """Adds a dispatch to the benchmark under `name` (replacing an entry of that name).

  Args:
    name: the name `--impls` and the results use.
    dispatch: a library dispatch name or a function of the dispatch signature. Make it
      hashable (a module-level function, or a frozen dataclass with `__call__`): it goes
      into a `MoEConfig`, a `jax.jit` static argument.
    accounting: `(case, on_tpu) -> accounting.Accounting` (default: no rounds, nothing
      dropped, its loops counted once and flagged).
  """
  BENCH_IMPLS[name] = Impl(dispatch, accounting)
