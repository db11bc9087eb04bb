"""XLA:CPU crashes compiling when the process is near its limit of memory mappings.

    python tests/repro/xla_cpu_map_count.py          # crashes: SIGSEGV or SIGABRT
    python tests/repro/xla_cpu_map_count.py --count  # the mappings one compile adds

XLA:CPU's JIT maps the code and data of each compiled kernel into memory regions of their
own, about three per kernel, held as long as the executable lives (JAX's caches keep it).
Linux caps the mappings of a process at `vm.max_map_count` (65530 by default). A process
that keeps compiling, such as a test worker running hundreds of tests, reaches it; then
the mmap of the next kernel's sections fails ("LLVM compilation error: Cannot allocate
memory") and the compile dies in `backend_compile_and_load` with a segmentation fault, or
an abort ("LLVM ERROR: Unable to allocate section memory!"), where an error would be
expected. This program fills the mappings with one-page `mmap`s to a few hundred short of
the limit and compiles a function of a few hundred kernels. Pure JAX, no moe_shard.
`jax.clear_caches()` releases the executables' mappings.
"""

import faulthandler
import mmap
import os
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")
faulthandler.enable()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

STEPS = 100  # a dot and a cumsum each: about 3.5 mappings a step


def mappings():
  with open("/proc/self/maps") as f:
    return sum(1 for _ in f)


def program(x):
  for i in range(STEPS):
    x = jnp.cumsum(jnp.sin(x) @ x.T + i, axis=0)
  return x


def main():
  x = jnp.ones((16, 16))
  if "--count" in sys.argv:
    before = mappings()
    jax.block_until_ready(jax.jit(program)(x))
    print(f"jax {jax.__version__}: one compile of {STEPS} steps added {mappings() - before}")
    return
  with open("/proc/sys/vm/max_map_count") as f:
    limit = int(f.read())
  held, prot = [], (mmap.PROT_READ, mmap.PROT_READ | mmap.PROT_WRITE)  # alternate: no merging
  while mappings() < limit - 200:
    for _ in range(max(1, (limit - 200 - mappings()) // 2)):
      held.append(mmap.mmap(-1, mmap.PAGESIZE, prot=prot[len(held) % 2]))
  print(f"jax {jax.__version__}: {mappings()} of {limit} mappings; compiling", flush=True)
  jax.block_until_ready(jax.jit(program)(x))
  print("compiled: no crash")


if __name__ == "__main__":
  main()
