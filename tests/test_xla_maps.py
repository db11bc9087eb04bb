"""tests/xla_maps.py: a test process's memory mappings kept away from the kernel's limit."""

import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import pytest
import xla_maps

if xla_maps.max_map_count() is None:
  pytest.skip("no /proc/sys/vm/max_map_count (not Linux)", allow_module_level=True)


def program(steps, shift):
  """A function of about `steps` dots and cumsums: XLA:CPU compiles each into kernels of
  their own, each with mappings of its own."""

  def f(x):
    for i in range(steps):
      x = jnp.cumsum(jnp.sin(x) @ x.T + i + shift, axis=0)
    return x

  return f


def test_each_compile_holds_mappings_until_the_caches_drop():
  jax.clear_caches()
  before = xla_maps.mappings()
  f = jax.jit(program(20, 0.5))  # held, as a test module's jitted functions are
  jax.block_until_ready(f(jnp.ones((8, 8))))
  compiled = xla_maps.mappings()
  assert compiled - before >= 20  # a few a step
  jax.clear_caches()
  assert compiled - xla_maps.mappings() >= 20


def test_guard_keeps_the_mappings_under_its_limit():
  """Compiles that each add mappings, a check after each "test": with the guard the
  process stays under a limit set a few compiles above where it starts. In a process of
  its own: in a test worker that dropped executables before, XLA:CPU's code allocator may
  place new kernels in the pages the dropped ones left, adding no mappings."""
  code = "import sys; sys.path[:0] = [sys.argv[1]]; import test_xla_maps as t; t.guard_run()"
  tests = os.path.dirname(os.path.abspath(__file__))
  run = subprocess.run([sys.executable, "-c", code, tests], capture_output=True, text=True)
  assert run.returncode == 0, run.stderr[-3000:]


def guard_run():
  """The body of `test_guard_keeps_the_mappings_under_its_limit`, run in a fresh process."""
  x = jnp.ones((8, 8))
  held = [jax.jit(program(20, 0.25))]  # held, as a test module's jitted functions are
  jax.block_until_ready(held[0](x))  # what the first compile of its kind sets up
  # One compile's mappings, from a program not compiled before (a rerun of a program whose
  # executable was dropped may find its mappings where the dropped one's were).
  before = xla_maps.mappings()
  held.append(jax.jit(program(20, 0.125)))
  jax.block_until_ready(held[-1](x))
  start = xla_maps.mappings()
  per_compile = start - before
  assert per_compile >= 20
  limit = start + 10 * per_compile  # the guard clears past start + 4 compiles' worth
  guard = xla_maps.MappingGuard(limit, every=1, fraction=(start + 4 * per_compile) / limit)
  most = 0
  for n in range(20):
    held.append(jax.jit(program(20, n)))
    jax.block_until_ready(held[-1](x))
    most = max(most, xla_maps.mappings())
    guard.after_test()
  assert guard.clears >= 2, (start, per_compile, most)
  assert most < limit, (start, per_compile, most)
