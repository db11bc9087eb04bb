"""Every notebook in notebooks/ runs top to bottom, and is committed with its outputs.

Each notebook executes in a fresh kernel started as a user's is (`notebooks/execute.py`:
working directory notebooks/, this interpreter, no PYTHONPATH and none of the XLA and JAX
settings conftest makes) on an in-memory copy: the committed files are never rewritten.
Refresh their outputs with `python notebooks/execute.py [names]`.
"""

import importlib.util
import os
import pathlib
import sys

import nbformat
import pytest

NOTEBOOKS = pathlib.Path(__file__).resolve().parents[1] / "notebooks"
PATHS = sorted(NOTEBOOKS.glob("*.ipynb"))
# Seconds per cell. The slowest cell (a compile of the all_to_all dispatch, or the training
# loop) takes about 20 s on an idle 2-core machine; 300 s leaves room for a loaded one.
CELL_TIMEOUT_S = 300


def _execute_module():
  spec = importlib.util.spec_from_file_location("notebooks_execute", NOTEBOOKS / "execute.py")
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def _code_cells(nb):
  """The code cells a kernel runs (nbclient skips empty ones)."""
  return [c for c in nb.cells if c.cell_type == "code" and c.source.strip()]


def test_kernel_env_is_a_users(monkeypatch):
  # conftest sets XLA_FLAGS and JAX_PLATFORMS, and a developer may have the clone on
  # PYTHONPATH; Jupyter, opened as the README says, gives the kernel none of them.
  monkeypatch.setenv("PYTHONPATH", str(NOTEBOOKS.parent))
  env = _execute_module().kernel_env()
  for name in ("PYTHONPATH", "XLA_FLAGS", "JAX_PLATFORMS"):
    assert name in os.environ and name not in env, name
  assert env["PATH"].split(os.pathsep)[0] == os.path.dirname(sys.executable)


def test_notebooks_exist():
  assert PATHS, f"no notebooks in {NOTEBOOKS}"


@pytest.mark.parametrize("path", PATHS, ids=[p.stem for p in PATHS])
def test_committed_with_outputs(path):
  # Outputs (plots included) are committed so the notebooks read well when browsing the
  # repository: every code cell has been run, in order.
  nb = nbformat.read(path, as_version=4)
  nbformat.validate(nb)
  counts = [c.execution_count for c in _code_cells(nb)]
  assert counts == list(range(1, len(counts) + 1)), (
    f"{path.name}: run it top to bottom (python notebooks/execute.py {path.stem}) and "
    f"commit the outputs; execution counts are {counts}"
  )


@pytest.mark.parametrize("path", PATHS, ids=[p.stem for p in PATHS])
def test_runs_top_to_bottom(path):
  # Raises CellExecutionError (with the cell and traceback) on the first cell that fails.
  nb = _execute_module().execute(path, timeout=CELL_TIMEOUT_S)
  assert all(c.execution_count for c in _code_cells(nb))
