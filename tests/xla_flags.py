"""The XLA flags the suite sets, kept to those the installed jaxlib's XLA knows.

XLA aborts the process at the first backend start when XLA_FLAGS names a flag it does not
know ("Unknown flag in XLA_FLAGS: ..."), and flags come and go between XLA versions: jax
0.10.2's XLA:CPU has `--xla_cpu_use_fusion_emitters`, jax 0.12's does not (its fusion
emitters are the only ones). So `known` starts a Python with the candidate flags, reads the
names XLA refuses from its message and drops them, and checks the rest start a backend.
Imports nothing from jax: tests/conftest.py calls it before JAX is imported.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys

# What XLA prints before it aborts, then the refused flags, space-separated.
_UNKNOWN = re.compile(r"Unknown flags? in XLA_FLAGS: (.*)")
_PROBE = "import jax; jax.devices('cpu')"


def _refused(flags: list[str], env: dict[str, str]) -> list[str] | None:
  """The flags of `flags` that XLA refuses; None where the probe fails for another reason."""
  env = dict(env, XLA_FLAGS=" ".join(flags), JAX_PLATFORMS="cpu")
  run = subprocess.run(
    [sys.executable, "-c", _PROBE], env=env, capture_output=True, text=True, timeout=300
  )
  if run.returncode == 0:
    return []
  match = _UNKNOWN.search(run.stderr)
  if match is None:
    return None
  return [f for f in match.group(1).split() if f in flags]


def known(base: list[str], optional: list[str]) -> list[str]:
  """`base` + the flags of `optional` that this jaxlib's XLA knows.

  Args:
    base: flags that must be known (the device count, collective timeouts).
    optional: flags to keep where XLA knows them (compile-time savers).

  Returns:
    `base` followed by the known flags of `optional`, in order.

  Raises:
    RuntimeError: XLA refuses a flag of `base`, or does not start with the flags kept.
  """
  env = dict(os.environ)
  flags = base + optional
  refused = _refused(flags, env)
  if refused:
    if any(f in base for f in refused):
      raise RuntimeError(f"xla_flags.known: XLA refuses flags the suite needs: {refused}")
    flags = [f for f in flags if f not in refused]
    refused = _refused(flags, env)
  if refused != []:
    raise RuntimeError(
      f"xla_flags.known: a Python with XLA_FLAGS={' '.join(flags)!r} does not start a CPU "
      f"backend (refused: {refused})"
    )
  return flags
