"""Re-executes notebooks in place, so that their committed outputs (plots included) are fresh.

    python notebooks/execute.py                          # every notebooks/*.ipynb
    python notebooks/execute.py 02_expert_parallelism    # by name, with or without .ipynb

Each notebook runs top to bottom in a fresh kernel (the interpreter running this script)
started as Jupyter starts a user's: in notebooks/, with none of the settings that the test
suite or a developer's shell may add (`KERNEL_ENV_DROPPED`). A notebook sets what it needs
itself (8 simulated CPU devices; the clone's root on the path where it imports `bench`). Each
is written back with its outputs. `tests/test_notebooks.py` runs them the same way
(`execute`) without writing anything.
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


# Set by tests/conftest.py (and often by a developer's shell), not by a user opening the
# notebooks: a kernel with them would hide a notebook that fails without them.
KERNEL_ENV_DROPPED = ("PYTHONPATH", "XLA_FLAGS", "JAX_PLATFORMS", "ALLOW_MULTIPLE_LIBTPU_LOAD")


def kernel_env():
  """The kernel's environment: this one less `KERNEL_ENV_DROPPED`, with this interpreter."""
  env = {k: v for k, v in os.environ.items() if k not in KERNEL_ENV_DROPPED}
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
