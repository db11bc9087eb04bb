"""tests/xla_flags.py: the suite's XLA flags kept to those the installed XLA knows."""

import os

import pytest
import xla_flags

DEVICES = "--xla_force_host_platform_device_count=2"


def test_known_drops_the_flags_xla_refuses():
  optional = ["--xla_moe_shard_no_such_flag=1", "--xla_backend_optimization_level=0"]
  assert xla_flags.known([DEVICES], optional) == [DEVICES, "--xla_backend_optimization_level=0"]


def test_known_refuses_an_unknown_base_flag():
  with pytest.raises(RuntimeError, match="refuses flags the suite needs"):
    xla_flags.known(["--xla_moe_shard_no_such_flag=1"], [])


def test_the_suite_runs_with_what_the_installed_xla_accepts():
  # conftest.py has set them: each flag it sets is one this XLA knows, so no flag of the
  # candidates is left that XLA refuses.
  flags = os.environ["XLA_FLAGS"].split()
  if os.environ["JAX_PLATFORMS"] == "cpu":  # on a GPU the compiler keeps its defaults
    assert "--xla_backend_optimization_level=0" in flags
  assert xla_flags.known(flags, []) == flags
