"""Test setup: 8 simulated CPU devices, set before JAX is imported anywhere."""

import os

_flags = os.environ.get("XLA_FLAGS", "")
if "xla_force_host_platform_device_count" not in _flags:
  os.environ["XLA_FLAGS"] = (_flags + " --xla_force_host_platform_device_count=8").strip()

# The tests run on CPU devices. With libtpu installed (the tpu extra, for the ahead-of-time
# TPU compile tests) every JAX process would also try to open a TPU and hold libtpu's
# lockfile, failing any other process's TPU compile: skip the TPU backend and allow several
# processes to load libtpu. Subprocesses (notebook kernels, multi-process workers) inherit.
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")

import jax  # noqa: E402
import pytest  # noqa: E402
from hypothesis import settings  # noqa: E402

jax.config.update("jax_enable_x64", False)
settings.register_profile("ci", max_examples=15, deadline=None, derandomize=True)
settings.load_profile("ci")


@pytest.fixture(scope="session")
def devices():
  devs = jax.devices()
  assert len(devs) == 8, f"expected 8 simulated CPU devices, got {len(devs)}"
  return devs
