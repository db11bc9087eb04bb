"""Keeps a test process's memory mappings away from the kernel's limit.

XLA:CPU maps the code and data of each compiled kernel into memory regions of their own,
held as long as the executable lives, and JAX's caches keep every executable a test worker
compiles. A worker compiles thousands of programs; at `vm.max_map_count` the mmap of the
next kernel fails and XLA:CPU's compile crashes the process (a segmentation fault in
`backend_compile_and_load`, `tests/repro/xla_cpu_map_count.py`). `MappingGuard` counts
the backend compiles; every `every` of them, after the test that ran them, it reads the
process's mappings and drops JAX's caches (`jax.clear_caches()`, which frees the
executables no object holds) when they pass `fraction` of the limit.
"""

from __future__ import annotations

import jax

COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"


def mappings() -> int:
  """The memory mappings of this process (lines of /proc/self/maps)."""
  with open("/proc/self/maps") as f:
    return sum(1 for _ in f)


def max_map_count() -> int | None:
  """The kernel's limit of mappings per process; None where /proc does not say (not Linux)."""
  try:
    with open("/proc/sys/vm/max_map_count") as f:
      return int(f.read())
  except OSError:
    return None


class MappingGuard:
  """Drops JAX's caches when the mappings pass `fraction * limit`, checked every `every`
  backend compiles (`after_test`).

  Args:
    limit: the mappings a process may hold (`max_map_count()`).
    every: backend compiles between two reads of /proc/self/maps.
    fraction: of `limit`, past which `after_test` clears the caches.
  """

  def __init__(self, limit: int, every: int = 10, fraction: float = 0.5):
    self.limit, self.every, self.fraction = limit, every, fraction
    self.compiles = 0
    self.clears = 0
    jax.monitoring.register_event_duration_secs_listener(self._on_event)

  def _on_event(self, name, secs, **kwargs):
    if name == COMPILE_EVENT:
      self.compiles += 1

  def after_test(self) -> bool:
    """Clears JAX's caches if `every` compiles ran since the last check and the mappings
    pass `fraction * limit`; True when it cleared them."""
    if self.compiles < self.every:
      return False
    self.compiles = 0
    if mappings() <= self.fraction * self.limit:
      return False
    jax.clear_caches()
    self.clears += 1
    return True
