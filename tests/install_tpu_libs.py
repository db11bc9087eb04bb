"""Installs libtpu into `.tpu-libs/` for the ahead-of-time TPU compile tests.

    python tests/install_tpu_libs.py

The version is the one the installed jax asks for in its `tpu` extra (`jax[tpu]`). It goes
into a folder of its own, which only the test process puts on its path (`tests/conftest.py`):
libtpu installed next to a CPU jax makes every `import jax` in that environment print a
libtpu error (TPU_WORKER_HOSTNAMES). Does nothing when the folder already holds that version.
"""

from __future__ import annotations

import importlib.metadata
import pathlib
import re
import subprocess
import sys

TARGET = pathlib.Path(__file__).resolve().parent.parent / ".tpu-libs"


def libtpu_requirement():
  """`libtpu==...` from jax's `tpu` extra, e.g. "libtpu==0.0.42.*"."""
  for req in importlib.metadata.requires("jax") or ():
    name, _, marker = req.partition(";")
    if name.strip().startswith("libtpu") and re.search(r"extra\s*==\s*['\"]tpu['\"]", marker):
      return name.strip()
  raise SystemExit("install_tpu_libs: the installed jax has no libtpu in its tpu extra")


def main():
  req = libtpu_requirement()
  stamp = TARGET / ".requirement"
  if stamp.exists() and stamp.read_text() == req:
    print(f"install_tpu_libs: {req} already in {TARGET}")
    return
  subprocess.run(
    [
      sys.executable,
      "-m",
      "pip",
      "install",
      "--quiet",
      "--disable-pip-version-check",
      "--no-deps",
      "--upgrade",
      "--target",
      str(TARGET),
      req,
    ],
    check=True,
  )
  stamp.write_text(req)
  print(f"install_tpu_libs: {req} installed in {TARGET}")


if __name__ == "__main__":
  main()
