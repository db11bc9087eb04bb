"""The documentation: its Python examples run, its API reference is complete, its benchmarks
page is current.

* Every ```python block of README.md and docs/**/*.md runs as written. The blocks of one
  page run in order in one namespace (a later block may use an earlier block's names), one
  test per page; 8 simulated CPU devices come from conftest. A block whose first line is
  "# Needs libtpu" (an ahead-of-time TPU compile) runs when libtpu is importable (from
  `.tpu-libs/`, `python tests/install_tpu_libs.py`), and the page's test is skipped after
  its other blocks otherwise. They run with JAX's "rbg" PRNG instead of the default
  threefry: XLA:CPU takes longer to compile threefry's sharded programs than the examples
  themselves, and no example depends on the values drawn (each checks relations, such as
  two dispatches agreeing).
* Blocks fenced as ```py are not run in a page's namespace: the multi-host script of
  docs/guides/sharding.md runs as written on 2 local processes
  (`test_multihost_script_runs_on_two_processes`), and docs/guides/huggingface.md's first
  block lists call signatures (`path`, `layer`, `out` are placeholders), run with real
  values by that page's next block. docs/guides/maxtext.md's ```py block needs MaxText,
  which CI does not install: tests/test_maxtext_block.py makes the same calls where it is.
* The site builds with `mkdocs build --strict`, and its API page documents every name of
  `moe_shard.__all__` and of the `__all__` of `moe_shard.hf`, `moe_shard.nnx`,
  `moe_shard.equinox` and `moe_shard.maxtext`.
* docs/benchmarks.md is what `python -m bench.docs_page` writes from bench/results/.
"""

import ast
import os
import pathlib
import pkgutil
import re
import signal
import socket
import subprocess
import sys

import jax
import numpy as np
import pytest
from cases import assert_close

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
  text = (ROOT / "README.md").read_text()
  lines = text.splitlines()
  assert len(lines) <= 200, f"README.md has {len(lines)} lines: move detail into docs/"
  # A newcomer finds the working quickstart (run by test_page_examples_run) on the first screen.
  quickstart = BLOCK.search(text)
  assert quickstart, "the README's quickstart is a ```python block"
  last = text[: quickstart.end()].count("\n") + 1  # the line of its closing fence
  assert last <= 60, f"the README's first ```python block ends on line {last}: keep it by line 60"
  # ... and how to load a Hugging Face checkpoint, the first thing many look for.
  assert "hf.load_moe_layer(" in "\n".join(lines[:100]), "show moe_shard.hf by README line 100"


def test_readme_links_every_guide():
  text = (ROOT / "README.md").read_text()
  missing = [
    g.name for g in sorted((DOCS / "guides").glob("*.md")) if f"(docs/guides/{g.name})" not in text
  ]
  assert not missing, f"the README's documentation table lists no {missing}"


def test_no_history_wording():
  # Docs describe the code as it is; what changed and when belongs in CHANGELOG.md.
  history = re.compile(r"this turn|last turn|issue \d+", flags=re.I)
  found = [
    f"{_name(p)}:{i}: {line.strip()}"
    for p in PAGES
    for i, line in enumerate(p.read_text().splitlines(), 1)
    if history.search(line)
  ]
  assert not found, "history wording in the docs:\n" + "\n".join(found)


@pytest.fixture
def rbg_prng():
  before = jax.config.jax_default_prng_impl
  jax.config.update("jax_default_prng_impl", "rbg")
  yield
  jax.config.update("jax_default_prng_impl", before)


@pytest.mark.usefixtures("rbg_prng")
@pytest.mark.parametrize("page", [p for p in PAGES if _blocks(p)], ids=_name)
def test_page_examples_run(page, monkeypatch):
  monkeypatch.chdir(ROOT)  # paths in the examples are relative to the repository root
  namespace = {"__name__": f"docs_{page.stem}"}
  skipped = []
  for i, code in enumerate(_blocks(page)):
    if code.startswith(NEEDS_LIBTPU) and not _has_libtpu():
      skipped.append(i)
      continue
    exec(compile(code, f"{_name(page)}[python block {i}]", "exec"), namespace)
  if skipped:
    why = f"ran every block but {skipped}, which need libtpu (tests/install_tpu_libs.py)"
    if os.environ.get("CI"):  # .ci/run installs libtpu: there a missing one is a failure
      pytest.fail(why)
    pytest.skip(why)


NEEDS_LIBTPU = "# Needs libtpu"


def _has_libtpu():
  try:
    import libtpu  # noqa: F401
  except ImportError:
    return False
  return True


MULTIHOST = re.compile(r"^```py\n(.*?)^```", flags=re.S | re.M)


def test_multihost_script_runs_on_two_processes(tmp_path, monkeypatch):
  # The ```py script of docs/guides/sharding.md as shown, on 2 processes x 4 CPU devices
  # joined by jax.distributed (gloo collectives); its gathered output equals the same
  # layer in this process.
  page = DOCS / "guides" / "sharding.md"
  (script,) = [c for c in MULTIHOST.findall(page.read_text()) if "jax.distributed" in c]
  (tmp_path / "train.py").write_text(script)
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
  # No PYTHONPATH of the test's own: train.py imports the installed moe_shard, as a user's does.
  env = dict(
    os.environ,
    XLA_FLAGS="--xla_force_host_platform_device_count=4",
    JAX_PLATFORMS="cpu",
    JAX_CPU_COLLECTIVES_IMPLEMENTATION="gloo",
    JAX_COORDINATOR_ADDRESS=f"127.0.0.1:{port}",
    JAX_NUM_PROCESSES="2",
  )
  procs = [
    subprocess.Popen(
      [sys.executable, "train.py"],
      env=dict(env, JAX_PROCESS_ID=str(i)),
      cwd=tmp_path,
      stdout=subprocess.PIPE,
      stderr=subprocess.STDOUT,
      text=True,
      start_new_session=True,
    )
    for i in range(2)
  ]
  try:
    # While they run: the script in this process (8 devices, jax.distributed left out),
    # for its parameters, config and mesh. It runs in a folder of its own: its train_out.npz
    # must not race with the one process 0 writes.
    (tmp_path / "in_process").mkdir()
    monkeypatch.chdir(tmp_path / "in_process")
    monkeypatch.setattr(jax.distributed, "initialize", lambda **kwargs: None)
    for name in ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID"):
      monkeypatch.setenv(name, "0")
    here = {"__name__": "docs_multihost"}
    exec(compile(script, f"{_name(page)}[multi-host script]", "exec"), here)
    outs = [p.communicate(timeout=120)[0] for p in procs]
  finally:
    for p in procs:
      if p.poll() is None:
        os.killpg(p.pid, signal.SIGKILL)
        p.wait()
  for i, (p, out) in enumerate(zip(procs, outs)):
    assert p.returncode == 0, f"process {i} exit code {p.returncode}:\n{out[-3000:]}"
  assert "(8, 16, 64)" in outs[0] and "(8, 16, 64)" not in outs[1]  # process 0 prints
  with np.load(tmp_path / "train_out.npz") as got:
    x_BSD, y_BSD = got["x_BSD"], got["y_BSD"]
  assert not np.array_equal(x_BSD[:4], x_BSD[4:])  # each process's own rows
  want_BSD, _ = moe_shard.moe_layer(here["params"], x_BSD, here["cfg"], mesh=here["mesh"])
  assert_close(y_BSD, want_BSD, np.float32)


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
  for module, path in (
    ("hf", "hf/__init__.py"),
    ("nnx", "nnx.py"),
    ("equinox", "equinox.py"),
    ("maxtext", "maxtext.py"),
  ):
    names = [f"moe_shard.{module}.{n}" for n in _all_of(ROOT / "moe_shard" / path)]
    missing += [n for n in names if n not in ids]
  assert not missing, f"docs/api.md documents no heading for {missing}"


def _all_of(path):
  """A module's `__all__`, read from its source (importing them needs safetensors, Flax and
  Equinox)."""
  for node in ast.parse(path.read_text()).body:
    if isinstance(node, ast.Assign) and any(
      isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets
    ):
      return ast.literal_eval(node.value)
  raise AssertionError(f"{path.relative_to(ROOT)} has no __all__")


def test_benchmarks_page_is_generated():
  from bench.reports import docs_page

  assert (DOCS / "benchmarks.md").read_text() == docs_page.page(), (
    "docs/benchmarks.md is out of date: run `python -m bench.docs_page`"
  )


def _run(load, times_s, settings=None, temp_bytes=100):
  """A layer results file: all_to_all, two jit-only rows and the dense limit, per mode, with
  median seconds `times_s[mode][impl]`."""
  rows = []
  for mode, times in times_s.items():
    for impl, median in times.items():
      rows.append(
        dict(
          level="layer", T=64, E=8, routing="uniform", mode=mode, impl=impl,
          time_s=dict(median=median, min=median * 0.9, max=median * 1.2),
          efficiency=times["dense_limit"] / median,
          executed_flops=10, wire_bytes=20, temp_bytes=temp_bytes, rounds=1, dropped=0,
        )
      )  # fmt: skip
  machine = dict(cpu="CPU", cores=2, load_average_1min=load)
  return dict(machine=machine, settings=settings or dict(tokens=[64]), rows=rows)


def test_run_to_run_tabulates_every_run_and_the_ranges():
  from bench.reports import docs_page

  def times(a2a, gshard, scan, dense):
    return dict(all_to_all=a2a, jit_gshard_einsum=gshard, jit_masked_scan=scan, dense_limit=dense)

  a = _run(0.5, dict(fwd=times(1.0, 2.5, 4.0, 0.8), fwd_bwd=times(2.0, 4.4, 3.0, 1.9)))
  b = _run(3.0, dict(fwd=times(2.0, 4.2, 8.0, 1.2), fwd_bwd=times(4.0, 8.0, 9.0, 3.2)))
  text = docs_page.run_to_run([("one", a), ("two", b)])
  # fwd: efficiency 0.8/1.0 and 1.2/2.0, speed-up 2.5/1.0 and 4.2/2.0; fwd_bwd: the
  # fastest jit-only row is the masked scan in run one (3.0 s), the einsum in run two.
  for line in (
    "| one | CPU, 2 cores | 0.5 | fwd | 1000 (900-1200) | 0.80 | jit_gshard_einsum 2500 | 2.5x |",
    "| two | CPU, 2 cores | 3.0 | fwd_bwd | 4000 (3600-4800) | 0.80 | jit_gshard_einsum 8000 "
    "| 2.0x |",
    "| one | CPU, 2 cores | 0.5 | fwd_bwd | 2000 (1800-2400) | 0.95 | jit_masked_scan 3000 "
    "| 1.5x |",
    "fwd: efficiency 0.60-0.80, speed-up over the fastest jit-only version 2.1-2.5x;",
    "fwd_bwd: efficiency 0.80-0.95, speed-up over the fastest jit-only version 1.5-2.0x.",
  ):
    assert line in text, line
  assert text.endswith("are the same in every run.")
  c = _run(
    1.0, dict(fwd=times(1.0, 2.5, 4.0, 0.8), fwd_bwd=times(2.0, 4.4, 3.0, 1.9)), temp_bytes=7
  )
  text = docs_page.run_to_run([("one", a), ("three", c)])
  want = "differ between the runs, as only another tree or JAX version makes them: all_to_all"
  assert want + " fwd temp_bytes, all_to_all fwd_bwd temp_bytes, dense_limit fwd" in text, text
  d = _run(1.0, dict(fwd=times(1.0, 2.5, 4.0, 0.8)), settings=dict(tokens=[128]))
  with pytest.raises(ValueError, match=r"run_to_run: runs must share their settings; four has"):
    docs_page.run_to_run([("one", a), ("four", d)])
