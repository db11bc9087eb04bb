"""The wheel installs the `moe_shard` package alone, typed; `bench/` runs from a clone."""

import pathlib
import shutil
import subprocess
import sys
import tomllib
import zipfile

import pytest
from packaging.requirements import Requirement

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
  # Offline, with the installed build backend (the test extra brings one that fits).
  run = subprocess.run(
    [sys.executable, "-m", "pip", "wheel", str(src), "--no-deps", "--no-build-isolation"]
    + ["--no-index", "--disable-pip-version-check", "-q", "-w", str(out)],
    capture_output=True,
    text=True,
    timeout=300,
  )
  assert run.returncode == 0, (
    f'pip wheel failed (is the test extra installed? pip install -e ".[test]"):\n'
    f"{run.stdout[-3000:]}\n{run.stderr[-3000:]}"
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


def test_test_extra_brings_the_build_backend():
  # The wheel fixture builds without build isolation, so `pip install -e ".[test]"` must
  # install a setuptools that [build-system] accepts and that has bdist_wheel built in
  # (70.1): a fresh `python3 -m venv` may hold an older one and no `wheel` package.
  meta = tomllib.loads((ROOT / "pyproject.toml").read_text())
  (build,) = [
    r for r in map(Requirement, meta["build-system"]["requires"]) if r.name == "setuptools"
  ]
  extra = meta["project"]["optional-dependencies"]["test"]
  (test,) = [r for r in map(Requirement, extra) if r.name == "setuptools"]
  (spec,) = test.specifier
  assert spec.operator == ">=", test
  assert build.specifier.contains(spec.version), (test, build)
  assert not test.specifier.contains("70.0"), test
