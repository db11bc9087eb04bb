"""What a new user gets: the package and each extra the README names, each in a fresh venv.

    python .ci/fresh_install.py            # every check, in order; exit 1 at the first failure
    python .ci/fresh_install.py core flax  # those checks only

Each check makes a `python -m venv` of its own (its own pip and setuptools, no PYTHONPATH,
nothing from this environment), installs what the check names and runs what that install
promises:

  core       `pip install .`: import moe_shard, a forward and backward of `moe_layer` on a
             2x4 mesh of simulated CPU devices (`jax.make_mesh`'s default, Explicit axes)
  readme     the README's first command as written (`pip install -e ".[bench]" && python -m
             bench`), in the clone's root
  flax       `.[flax]`: `moe_shard.nnx.MoE` made and called on the mesh
  equinox    `.[equinox]`: `moe_shard.equinox.MoE` made and called on the mesh
  notebooks  `.[notebooks]`: every module the notebooks import, and `jupyter lab --version`
  gpu        `.[gpu]`, added to core's venv: the Mosaic GPU kernels imported and traced (not
             run) on CPU

Installs go through pip's cache (wheels built once are reused). The non-editable ones take
one wheel of the package, built first. CI (`.ci/run`) runs this before the test suite.
"""

from __future__ import annotations

import ast
import json
import os
import pathlib
import re
import shutil
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
MESH = """
import os
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
import jax, jax.numpy as jnp
import moe_shard as ms
mesh = jax.make_mesh((2, 4), (ms.DATA, ms.EXPERT))
cfg = ms.MoEConfig(d_model=16, d_ff=32, num_experts=8, top_k=2)
x = jax.random.normal(jax.random.key(1), (8, 4, 16))
"""
CORE = (
  MESH
  + """
import sys
with jax.set_mesh(mesh):
  p = ms.init_moe_params(jax.random.key(0), cfg, mesh=mesh)
  loss = lambda p, x: jnp.sum(ms.moe_layer(p, x, cfg, mesh=mesh)[0] ** 2)
  v, (dp, dx) = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))(p, x)
assert jnp.isfinite(v) and float(jnp.abs(dx).sum()) > 0, v
kernels = [m for m in sys.modules if m.startswith("jax._src.pallas.mosaic_gpu.core")]
assert not kernels, f"the layer on CPU imported the Mosaic GPU kernels: {kernels}"
print("moe_layer forward and backward on a 2x4 mesh:", float(v))
"""
)
FLAX = (
  MESH
  + """
from flax import nnx
from moe_shard.nnx import MoE
with jax.set_mesh(mesh):
  y, aux = MoE(cfg, rngs=nnx.Rngs(0), mesh=mesh)(x)
assert y.shape == x.shape and bool(jnp.isfinite(y).all())
print("moe_shard.nnx.MoE on a 2x4 mesh:", y.shape)
"""
)
EQUINOX = (
  MESH
  + """
from moe_shard.equinox import MoE
with jax.set_mesh(mesh):
  y, aux = MoE(cfg, key=jax.random.key(0), mesh=mesh)(x)
assert y.shape == x.shape and bool(jnp.isfinite(y).all())
print("moe_shard.equinox.MoE on a 2x4 mesh:", y.shape)
"""
)
GPU = """
import jax, jax.numpy as jnp
from moe_shard.kernels import gpu
x = jax.ShapeDtypeStruct((256, 256), jnp.bfloat16)
w = jax.ShapeDtypeStruct((2, 256, 256), jnp.bfloat16)
gs = jax.ShapeDtypeStruct((2,), jnp.int32)
jax.jit(gpu.mosaic_gpu_gmm).trace(x, w, gs)
print("Mosaic GPU kernels traced")
"""


def notebook_imports():
  """The modules the notebooks import (bench's from the clone, as their first cell does)."""
  names = set()
  for nb in sorted((ROOT / "notebooks").glob("*.ipynb")):
    for cell in json.loads(nb.read_text())["cells"]:
      if cell["cell_type"] != "code":
        continue
      src = "\n".join(
        line for line in "".join(cell["source"]).splitlines() if not line.startswith(("%", "!"))
      )
      for node in ast.walk(ast.parse(src)):
        if isinstance(node, ast.Import):
          names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
          names.add(node.module)
  return sorted(names)


def readme_first_command():
  """The first command of the README's first bash block (its comments aside)."""
  block = re.search(r"```bash\n(.*?)```", (ROOT / "README.md").read_text(), re.S)
  assert block, "README.md has no bash block"
  lines = [ln for ln in block.group(1).splitlines() if ln.strip() and not ln.startswith("#")]
  return lines[0]


def notebooks_script(clone):
  names = notebook_imports()
  return (
    f"import importlib, sys\nsys.path.insert(0, {str(clone)!r})\n"
    f"for name in {names!r}:\n  importlib.import_module(name)\n"
    f"print('the notebooks import', {len(names)}, 'modules')\n"
  )


class Venv:
  """A fresh virtual environment in a temporary folder."""

  def __init__(self, tmp, name):
    self.path = pathlib.Path(tmp) / name
    subprocess.run([sys.executable, "-m", "venv", str(self.path)], check=True)
    self.bin = self.path / "bin"
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env.pop("XLA_FLAGS", None)
    env.pop("JAX_PLATFORMS", None)
    self.env = dict(env, VIRTUAL_ENV=str(self.path), PATH=f"{self.bin}:{env['PATH']}")

  def run(self, command, cwd, timeout=900):
    """Runs a shell command in the venv; its output is printed, its exit status returned."""
    print(f"$ {command}", flush=True)
    res = subprocess.run(
      ["bash", "-c", command], cwd=cwd, env=self.env, text=True, timeout=timeout,
      stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
    )  # fmt: skip
    out = res.stdout.strip().splitlines()
    quiet = [ln for ln in out if "is ignored: it is neither a file nor a directory" not in ln]
    print("\n".join(quiet[-40:]), flush=True)
    return res.returncode


def pip_install(what):
  return f"python -m pip install -q --disable-pip-version-check {what}"


def checks(wheel, tmp, clone):
  """name -> (commands, run in the clone's root); `wheel` the package's wheel, scripts
  written to `tmp`, `clone` the copy of the clone. A check's venv is fresh unless it extends the one before it ("+")."""

  def script(name, src):
    path = pathlib.Path(tmp) / "checks" / f"check_{name}.py"  # not named like a module
    path.parent.mkdir(exist_ok=True)
    path.write_text(src)
    return f"python {path}"

  return {
    "core": ([pip_install(wheel), script("core", CORE)], False),
    # The [gpu] extra on top of the package alone: what `pip install "moe_shard[gpu]"` gives.
    "+gpu": ([pip_install(f"'{wheel}[gpu]'"), script("gpu", GPU)], False),
    "readme": ([readme_first_command()], True),
    "flax": ([pip_install(f"'{wheel}[flax]'"), script("flax", FLAX)], False),
    "equinox": ([pip_install(f"'{wheel}[equinox]'"), script("equinox", EQUINOX)], False),
    "notebooks": (
      [
        pip_install(f"'{wheel}[notebooks]'"),
        script("notebooks", notebooks_script(clone)),
        "jupyter lab --version",
      ],
      False,
    ),
  }


def main(argv):
  with tempfile.TemporaryDirectory(prefix="fresh-install-") as tmp:
    # A copy of the clone's tracked files, so that an editable install and the wheel's build
    # leave nothing in the checkout, and nothing untracked goes along.
    src = pathlib.Path(tmp) / "clone"
    files = subprocess.run(
      ["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout.split("\0")
    for name in filter(None, files):
      (src / name).parent.mkdir(parents=True, exist_ok=True)
      if (ROOT / name).is_file():
        shutil.copy2(ROOT / name, src / name)
    build = Venv(tmp, "build")
    if build.run(
      pip_install(f"--no-deps --no-cache-dir -w {tmp}/dist .").replace("install", "wheel", 1), src
    ):
      return 1
    (wheel,) = pathlib.Path(tmp, "dist").glob("moe_shard-*.whl")
    table = checks(wheel, tmp, src)
    names = [n for n in table if not argv or n.lstrip("+") in argv]
    unknown = sorted(set(argv) - {n.lstrip("+") for n in table})
    if unknown:
      print(f"fresh_install: unknown checks {unknown}; choose from {list(table)}")
      return 2
    venv = None
    for name in names:
      commands, in_clone = table[name]
      fresh = venv is None or not name.startswith("+")
      print(f"\n== {'fresh venv' if fresh else 'the same venv'}: {name.lstrip('+')}", flush=True)
      t0 = time.perf_counter()
      if fresh:
        venv = Venv(tmp, name)
      assert venv is not None
      cwd = src if in_clone else pathlib.Path(tmp)
      for command in commands:
        if venv.run(command, cwd):
          print(f"\nfresh_install: FAILED: {name.lstrip('+')}: {command}")
          return 1
      print(f"== {name.lstrip('+')}: passed in {time.perf_counter() - t0:.0f} s", flush=True)
  return 0


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
