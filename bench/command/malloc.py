"""The C allocator for timing on CPU: freed memory is reused, not returned to the kernel.

XLA:CPU allocates each program's temporaries when the program is called and frees them when
it returns. glibc's malloc serves a request above its mmap threshold (at most 32 MiB by
default) with a fresh `mmap`, and a thread other than the main one from an arena of at most
64 MiB, so every page of a large temp buffer is new memory on every call: the first write
to each 4 KiB page faults and the kernel zeroes it. Measured on this repository's 2-core
host: one [2560, 1024] f32 fill (10 MiB) took 4.9 ms in a program with 40 MiB of temp and
0.33 ms with the settings below; the all_to_all layer's forward at the default case
(T=8192, E=8, 50 MiB of temp per device) 444-486 ms against 338-358 ms, the dense limit's
(16 MiB) 277-288 against 264-270 ms.

`reuse_freed_memory()` sets, through `mallopt`, one arena for all threads, an mmap threshold
of 512 MiB and a trim threshold of 2 GiB, what a long-running training process on CPU
settles into, so the benchmark times each program in steady state (buffers above 512 MiB
per device still come from a fresh mmap; see MMAP_THRESHOLD). It is process-wide and
changes no result, only where memory comes from; `python -m bench --system-malloc` keeps
glibc's defaults. The same settings from the shell, for any program:

    GLIBC_TUNABLES=glibc.malloc.arena_max=1:glibc.malloc.mmap_threshold=536870912:glibc.malloc.trim_threshold=2147483647
"""

from __future__ import annotations

import ctypes
import ctypes.util
import sys

# glibc's mallopt parameters (malloc.h).
M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
M_ARENA_MAX = -8
# Requests above 512 MiB keep glibc's fresh mmap: a case's programs are timed in turns, and
# with every temp buffer kept in the heap their sum stays resident (at T=32768, E=64 the
# jit-only programs' buffers, 0.7-1.2 GiB per device, took this 24 GiB host out of memory).
MMAP_THRESHOLD = 512 * 2**20
TRIM_THRESHOLD = 2**31 - 1  # mallopt takes an int
SETTINGS = (
  (M_ARENA_MAX, 1, "arena_max=1"),
  (M_MMAP_THRESHOLD, MMAP_THRESHOLD, "mmap_threshold=512 MiB"),
  (M_TRIM_THRESHOLD, TRIM_THRESHOLD, "trim_threshold=2 GiB"),
)
SYSTEM = "system default"


def reuse_freed_memory():
  """Sets glibc's malloc to keep and reuse freed memory (see the module docstring).

  Call it before JAX starts its threads (their arenas are created on first use).

  Returns:
    str: what was set, e.g. "glibc mallopt: arena_max=1, mmap_threshold=512 MiB,
    trim_threshold=2 GiB", or why nothing was ("system default (not Linux)", "system
    default (no glibc mallopt)", ...).
  """
  if not sys.platform.startswith("linux"):
    return f"{SYSTEM} (not Linux)"
  mallopt = _libc("mallopt", (ctypes.c_int, ctypes.c_int))
  if mallopt is None:
    return f"{SYSTEM} (no glibc mallopt)"
  done = [name for param, value, name in SETTINGS if mallopt(param, value) == 1]
  if not done:
    return f"{SYSTEM} (mallopt refused every setting)"
  return "glibc mallopt: " + ", ".join(done)


def release_freed_memory():
  """Gives the memory glibc's malloc holds freed back to the kernel (`malloc_trim(0)`), so
  that the host's free memory counts it again. The benchmark calls it between cases; a
  program's next call then takes fresh pages once (its warm-up call does).

  Returns:
    bool: whether malloc_trim ran and released something.
  """
  trim = _libc("malloc_trim", (ctypes.c_size_t,))
  return trim is not None and trim(0) == 1


def _libc(name, argtypes):
  """The C library's function `name` (returning int) on Linux, or None."""
  if not sys.platform.startswith("linux"):
    return None
  try:
    fn = getattr(ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6"), name)
  except (OSError, AttributeError):
    return None
  fn.argtypes, fn.restype = argtypes, ctypes.c_int
  return fn
