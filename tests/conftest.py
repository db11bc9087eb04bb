"""Test setup: 8 simulated CPU devices, set before JAX is imported anywhere."""

import os
import sys

import xla_flags

# libtpu (for the ahead-of-time TPU compile tests) lives in a folder of its own, `.tpu-libs/`,
# which the README's test command fills (`pip install --target .tpu-libs`): installed next to
# a CPU jax it would make every `import jax` of the user's environment print a libtpu error.
# Only the test process puts it on its path; JAX finds it with `import libtpu`.
_TPU_LIBS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), ".tpu-libs")
if os.path.isdir(_TPU_LIBS) and _TPU_LIBS not in sys.path:
  sys.path.append(_TPU_LIBS)

_flags = os.environ.get("XLA_FLAGS", "")
if "xla_force_host_platform_device_count" not in _flags:
  _flags += " --xla_force_host_platform_device_count=8"
# The 8 simulated devices are threads of one process on 2 cores, shared with the other test
# worker: a device can wait long at a collective's rendezvous for a peer that is not
# scheduled. XLA:CPU aborts the whole process after 40 s there by default; wait up to 10
# minutes instead.
if "xla_cpu_collective_call_terminate_timeout_seconds" not in _flags:
  _flags += (
    " --xla_cpu_collective_call_terminate_timeout_seconds=600"
    " --xla_cpu_collective_call_warn_stuck_timeout_seconds=120"
    " --xla_cpu_collective_timeout_seconds=600"
  )
# Compiling dominates the suite's time (XLA:CPU spends much of it in LLVM), while its programs
# run on a few rows: every program compiles as `cases.FAST_COMPILE`'s do, LLVM's optimisation
# off and its expensive passes skipped. XLA's own HLO passes, which set what the programs
# compute and what the benchmark counts, still run. Where XLA:CPU still has its older
# elemental emitters (jax 0.10), they replace its MLIR fusion emitters: the same HLO,
# compiled in about a fifth less time. XLA aborts on a flag it does not know, and these come
# and go between versions: `xla_flags.known` keeps those the installed XLA accepts, checked
# once per run (the xdist workers inherit the result). On a GPU (JAX_PLATFORMS=cuda) the
# compiler keeps its defaults.
_optional = [
  flag
  for flag in (
    "--xla_backend_optimization_level=0",
    "--xla_llvm_disable_expensive_passes=true",
    "--xla_cpu_use_fusion_emitters=false",
  )
  if os.environ.get("JAX_PLATFORMS", "cpu") == "cpu" and flag.split("=")[0] not in _flags
]
if _optional and os.environ.get("MOE_SHARD_TEST_XLA_FLAGS") != _flags.strip():
  _flags = " ".join(xla_flags.known(_flags.split(), _optional))
  os.environ["MOE_SHARD_TEST_XLA_FLAGS"] = _flags
os.environ["XLA_FLAGS"] = _flags.strip()

# The tests run on CPU devices. With libtpu installed (the tpu extra, for the ahead-of-time
# TPU compile tests) every JAX process would also try to open a TPU and hold libtpu's
# lockfile, failing any other process's TPU compile: skip the TPU backend and allow several
# processes to load libtpu. Subprocesses (notebook kernels, multi-process workers) inherit.
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")

import jax  # noqa: E402
import pytest  # noqa: E402
import xla_maps  # noqa: E402
from hypothesis import settings  # noqa: E402

jax.config.update("jax_enable_x64", False)

# XLA:CPU crashes compiling once the process holds as many memory mappings as the kernel
# allows, and a worker's cached executables hold them: `xla_maps.MappingGuard` drops JAX's
# caches after a test when they pass half the limit (docs/guides/testing.md).
_MAP_LIMIT = xla_maps.max_map_count()
_map_guard = xla_maps.MappingGuard(_MAP_LIMIT) if _MAP_LIMIT else None


def pytest_runtest_teardown(item, nextitem):
  if _map_guard is not None:
    _map_guard.after_test()


settings.register_profile("ci", max_examples=15, deadline=None, derandomize=True)
settings.load_profile("ci")


@pytest.fixture(scope="session")
def devices():
  devs = jax.devices()
  assert len(devs) == 8, f"expected 8 simulated CPU devices, got {len(devs)}"
  return devs
