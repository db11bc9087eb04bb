"""Re-executes notebooks in place, so that their committed outputs (plots included) are fresh.

    python notebooks/execute.py                          # every notebooks/*.ipynb
    python notebooks/execute.py 02_expert_parallelism    # by name, with or without .ipynb

Each notebook runs top to bottom in a fresh kernel (the interpreter running this script),
with the working directory notebooks/, 8 simulated CPU devices and the repository on
PYTHONPATH, and is written back with its outputs. `tests/test_notebooks.py` runs them the
same way (`execute`) without writing anything.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import sys
import time

import nbformat
from nbclient import NotebookClient

NOTEBOOKS = pathlib.Path(__file__).resolve().parent
CELL_TIMEOUT_S = 300


def kernel_env():
  """The kernel's environment: this one, plus 8 CPU devices and the repository importable."""
  env = dict(os.environ)
  flags = env.get("XLA_FLAGS", "")
  if "xla_force_host_platform_device_count" not in flags:
    env["XLA_FLAGS"] = (flags + " --xla_force_host_platform_device_count=8").strip()
  env["JAX_PLATFORMS"] = "cpu"
  repo = str(NOTEBOOKS.parent)
  env["PYTHONPATH"] = os.pathsep.join(p for p in (repo, env.get("PYTHONPATH")) if p)
  # The "python3" kernel runs `python`: make that the interpreter running this script.
  env["PATH"] = os.pathsep.join((os.path.dirname(sys.executable), env.get("PATH", "")))
  return env


def execute(path, *, timeout=CELL_TIMEOUT_S):
  """Runs the notebook at `path` in a fresh kernel and returns it with its outputs.

  Args:
    path: an .ipynb file.
    timeout: seconds allowed per cell (default `CELL_TIMEOUT_S`).

  Returns:
    the executed `nbformat.NotebookNode` (the file is not written).

  Raises:
    nbclient.exceptions.CellExecutionError: a cell raised.
    nbclient.exceptions.CellTimeoutError: a cell ran past `timeout`.
  """
  nb = nbformat.read(path, as_version=4)
  client = NotebookClient(
    nb,
    timeout=timeout,
    kernel_name="python3",
    record_timing=False,
    resources={"metadata": {"path": str(NOTEBOOKS)}},
  )
  client.execute(env=kernel_env())
  return nb


def resolve(names):
  """Notebook paths for names given with or without ".ipynb"; all of them for none."""
  if not names:
    return sorted(NOTEBOOKS.glob("*.ipynb"))
  paths = []
  for name in names:
    path = NOTEBOOKS / pathlib.Path(name).name
    path = path if path.suffix == ".ipynb" else path.with_name(path.name + ".ipynb")
    if not path.exists():
      raise SystemExit(f"execute.py: no notebook {path}")
    paths.append(path)
  return paths


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("names", nargs="*", help="notebooks to run (default: all)")
  parser.add_argument(
    "--timeout",
    type=int,
    default=CELL_TIMEOUT_S,
    help=f"seconds per cell (default {CELL_TIMEOUT_S})",
  )
  args = parser.parse_args(argv)
  for path in resolve(args.names):
    t0 = time.perf_counter()
    nb = execute(path, timeout=args.timeout)
    nbformat.write(nb, path)
    print(f"{path.name}: executed in {time.perf_counter() - t0:.1f} s", flush=True)


if __name__ == "__main__":
  main()
