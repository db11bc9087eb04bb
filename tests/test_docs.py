"""The documentation: its Python examples run, its API reference is complete, its benchmarks
page is current.

* Every ```python block of README.md and docs/**/*.md runs as written. The blocks of one
  page run in order in one namespace (a later block may use an earlier block's names), one
  test per page; 8 simulated CPU devices come from conftest. Blocks fenced as ```py or
  ```text are shown, not run (e.g. multi-host set-up with addresses). They run with JAX's
  "rbg" PRNG instead of the default threefry: XLA:CPU takes longer to compile threefry's
  sharded programs than the examples themselves, and no example depends on the values
  drawn (each checks relations, such as two dispatches agreeing).
* The site builds with `mkdocs build --strict`, and its API page documents every name of
  `moe_shard.__all__` and of `moe_shard.hf.__all__`, `moe_shard.nnx.MoE` and
  `moe_shard.equinox.MoE`.
* docs/benchmarks.md is what `python -m bench.docs_page` writes from bench/results/.
"""

import ast
import pathlib
import pkgutil
import re
import subprocess
import sys

import jax
import pytest

import moe_shard

ROOT = pathlib.Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
# docs/results links to bench/results: benchmark output, not documentation.
PAGES = [ROOT / "README.md"] + sorted(
  p for p in DOCS.rglob("*.md") if (DOCS / "results") not in p.parents
)
BLOCK = re.compile(r"^```python\n(.*?)^```", flags=re.S | re.M)


def _blocks(page):
  return BLOCK.findall(page.read_text())


def _name(page):
  return str(page.relative_to(ROOT))


def test_pages_have_examples():
  assert _blocks(ROOT / "README.md"), "the README's quickstart is a ```python block"
  assert sum(len(_blocks(p)) for p in PAGES) >= 10


def test_readme_is_short():
  lines = (ROOT / "README.md").read_text().splitlines()
  assert len(lines) <= 200, f"README.md has {len(lines)} lines: move detail into docs/"


@pytest.fixture
def rbg_prng():
  before = jax.config.jax_default_prng_impl
  jax.config.update("jax_default_prng_impl", "rbg")
  yield
  jax.config.update("jax_default_prng_impl", before)


@pytest.mark.usefixtures("rbg_prng")
@pytest.mark.parametrize("page", [p for p in PAGES if _blocks(p)], ids=_name)
def test_page_examples_run(page):
  namespace = {"__name__": f"docs_{page.stem}"}
  for i, code in enumerate(_blocks(page)):
    exec(compile(code, f"{_name(page)}[python block {i}]", "exec"), namespace)


@pytest.fixture(scope="module")
def site(tmp_path_factory):
  out = tmp_path_factory.mktemp("site")
  run = subprocess.run(
    [sys.executable, "-m", "mkdocs", "build", "--strict", "-q", "-d", str(out)],
    cwd=ROOT,
    capture_output=True,
    text=True,
  )
  assert run.returncode == 0, f"mkdocs build --strict failed:\n{run.stdout}\n{run.stderr}"
  return out


def test_api_reference_lists_every_public_name(site):
  html = (site / "api" / "index.html").read_text()
  ids = set(re.findall(r'id="(moe_shard\.[\w.]+)"', html))
  modules = {m.name for m in pkgutil.iter_modules(moe_shard.__path__)}
  missing = [
    name
    for name in moe_shard.__all__
    if f"moe_shard.{name}" not in ids and not any(f"moe_shard.{m}.{name}" in ids for m in modules)
  ]
  missing += [n for n in ("moe_shard.nnx.MoE", "moe_shard.equinox.MoE") if n not in ids]
  missing += [f"moe_shard.hf.{n}" for n in _hf_all() if f"moe_shard.hf.{n}" not in ids]
  assert not missing, f"docs/api.md documents no heading for {missing}"


def _hf_all():
  """`moe_shard.hf.__all__`, read from its source (importing it needs safetensors)."""
  path = ROOT / "moe_shard" / "hf" / "__init__.py"
  if not path.exists():
    return []
  for node in ast.parse(path.read_text()).body:
    if isinstance(node, ast.Assign) and any(
      isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets
    ):
      return ast.literal_eval(node.value)
  raise AssertionError("moe_shard/hf/__init__.py has no __all__")


def test_benchmarks_page_is_generated():
  from bench import docs_page

  assert (DOCS / "benchmarks.md").read_text() == docs_page.page(), (
    "docs/benchmarks.md is out of date: run `python -m bench.docs_page`"
  )
