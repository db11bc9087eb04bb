"""The wheel installs the `moe_shard` package alone, typed; `bench/` runs from a clone."""

import pathlib
import shutil
import subprocess
import sys
import zipfile

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def wheel(tmp_path_factory):
  """Builds the wheel from a copy of the sources (a build in the checkout would leave build/
  and *.egg-info there, and stale files in build/lib would end up in the wheel)."""
  src = tmp_path_factory.mktemp("src")
  for name in ("pyproject.toml", "README.md", "LICENSE"):
    if (ROOT / name).exists():
      shutil.copy(ROOT / name, src / name)
  # bench/ goes along so that the test sees it left out, as from a clone.
  skip = shutil.ignore_patterns("__pycache__", "*.pyc", "results")
  for name in ("moe_shard", "bench"):
    shutil.copytree(ROOT / name, src / name, ignore=skip)
  out = tmp_path_factory.mktemp("wheel")
  subprocess.run(
    [sys.executable, "-m", "pip", "wheel", str(src), "--no-deps", "--no-build-isolation"]
    + ["--no-index", "--disable-pip-version-check", "-q", "-w", str(out)],
    check=True,
    capture_output=True,
    timeout=300,
  )
  (whl,) = out.glob("moe_shard-*.whl")
  with zipfile.ZipFile(whl) as z:
    return z.namelist()


def test_wheel_holds_moe_shard_only(wheel):
  top = {n.split("/")[0] for n in wheel if not n.split("/")[0].endswith(".dist-info")}
  assert top == {"moe_shard"}
  assert not [n for n in wheel if n.endswith("entry_points.txt")]


def test_wheel_is_typed_and_holds_every_module(wheel):
  assert "moe_shard/py.typed" in wheel
  modules = {p.relative_to(ROOT).as_posix() for p in (ROOT / "moe_shard").rglob("*.py")}
  assert modules <= set(wheel), sorted(modules - set(wheel))


def test_bench_runs_from_a_clone():
  res = subprocess.run(
    [sys.executable, "-m", "bench", "--help"],
    cwd=ROOT,
    capture_output=True,
    text=True,
    timeout=120,
  )
  assert res.returncode == 0, res.stderr
  assert res.stdout.startswith("usage: python -m bench")
