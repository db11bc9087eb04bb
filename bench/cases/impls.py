"""The benchmark's implementations: one table, each a dispatch with its host accounting.

An entry names a dispatch of the library (`ms.DISPATCHES`) or holds a dispatch function of
the library's signature `(x_TD, ffn, experts_TK, weights_TK, *, mesh, cfg) -> (y_TD, stats)`,
and beside it the function giving its host-side accounting (`bench/reading/accounting.py`: rounds,
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

import moe_shard as ms
from bench.cases import baselines
from bench.reading import accounting


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
      reference (it computes something else), unless `foreign`. It raises `NotRun` where
      the row cannot run (the row then says why).
    foreign: `programs` run outside JAX (PyTorch): timed in turns with the others, their
      forward checked against the reference, nothing compiled or read from XLA.
    quantized: it takes quantized expert matrices (`--weights-format int8,fp8,mxfp4`); an
      entry that does not runs for the float weights only and gets no row for the others.
  """

  dispatch: str | Callable | None
  accounting: Callable = accounting.unknown
  per_size: bool = False
  programs: Callable | None = None
  foreign: bool = False
  quantized: bool = True

  def resolve(self, size):
    """The dispatch for a size: a library name or a function."""
    return self.dispatch(size) if self.per_size else self.dispatch


class NotRun(Exception):
  """An entry that cannot run here (no PyTorch, no GPU, another level); says why."""


def _auto_accounting(case, on_tpu=False):
  """The accounting of the dispatch "auto" resolves to on the case's mesh and platform."""
  tokens = accounting._layout(case)[4]  # per device, as the layer passes them
  replicated = getattr(case, "placement", None) is not None
  resolved = ms.choose_impl(case.cfg, case.mesh, tokens=tokens, replicated=replicated)
  return _BY_DISPATCH.get(resolved, accounting.unknown)(case, on_tpu)


def _torch_moe(case):
  from bench.peers import torch_peer  # imports PyTorch only when the row runs

  try:
    return torch_peer.moe_programs(case)
  except torch_peer.NotRun as err:
    raise NotRun(str(err)) from None


_BY_DISPATCH = {
  "all_to_all": accounting.all_to_all,
  "ragged_all_to_all": accounting.ragged_all_to_all,
  "all_gather": accounting.all_gather,
  "ragged_dot": accounting.ragged_dot,
  "masked_scan": accounting.masked_scan,
}

BENCH_IMPLS = {
  # The library's default: what `MoEConfig(impl="auto")` picks on the case's mesh
  # (`ms.choose_impl`: one device "ragged_dot", else the exchange for the chip and the
  # tokens per device).
  "auto": Impl("auto", _auto_accounting),
  "all_to_all": Impl("all_to_all", accounting.all_to_all),
  # On CPU (no ragged-all-to-all in XLA) this runs the emulation: padded all_to_alls.
  "ragged_all_to_all": Impl("ragged_all_to_all", accounting.ragged_all_to_all),
  "all_gather": Impl("all_gather", accounting.all_gather),
  "jit_ragged_dot": Impl("ragged_dot", accounting.ragged_dot),
  "jit_masked_scan": Impl("masked_scan", accounting.masked_scan),
  # Float weights only: its einsums take the expert matrices as they are.
  "jit_gshard_einsum": Impl(
    lambda size: baselines.GShard(size.capacity_factor),
    accounting.gshard,
    per_size=True,
    quantized=False,
  ),
  # The limits and the PyTorch peer compute with float matrices of their own.
  "dense_limit": Impl(None, programs=baselines.dense_limit, quantized=False),
  "matmul_limit": Impl(None, programs=baselines.matmul_limit, quantized=False),
  # A torchtitan-style PyTorch layer (`bench/peers/torch_peer.py`): one CUDA device, layer level.
  "torch_moe": Impl(None, programs=_torch_moe, foreign=True, quantized=False),
}


def register(name, dispatch, accounting=accounting.unknown, quantized=True):
  """Adds a dispatch to the benchmark under `name` (replacing an entry of that name).

  Args:
    name: the name `--impls` and the results use.
    dispatch: a library dispatch name or a function of the dispatch signature. Make it
      hashable (a module-level function, or a frozen dataclass with `__call__`): it goes
      into a `MoEConfig`, a `jax.jit` static argument.
    accounting: `(case, on_tpu) -> accounting.Accounting` (default: no rounds, nothing
      dropped, its loops counted once and flagged).
    quantized: it takes an FFN whose matrices are `ms.QuantizedArray`s, as the library's
      dispatches do (default True); False runs it for float weights only.
  """
  BENCH_IMPLS[name] = Impl(dispatch, accounting, quantized=quantized)
