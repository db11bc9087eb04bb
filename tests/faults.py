"""Fault injection: do the tests catch known bugs?

    python tests/faults.py              # every fault (a few minutes on 2 cores)
    python tests/faults.py A G          # only these faults
    python tests/faults.py --control    # also run each selection on the unfaulted copy
    python tests/faults.py --list       # the faults and their test selections

For each fault the script copies the package (`moe_shard/`, `bench/`) and `tests/` into a
fresh temporary directory, applies the fault as exact source edits (each edit's old text
must occur exactly once in its file, or the script stops with an error: a fault that no
longer applies after a refactor cannot pass silently as "caught" or "missed"), and runs
the fault's pytest selection there with that copy first on PYTHONPATH. The copied
`conftest.py` asserts that the faulted copy is the one imported. A fault is `caught` when
pytest reports failing tests (exit code 1), `missed` when the selection passes; anything
else (a collection error, a crash) is `error`. With `--control` each selection is first
run on the unfaulted copy and must pass, so a failure can only be the fault's doing.

Exit code: 0 when every selected fault is caught (and every control passes), else 1.

Not collected by pytest (no `test_` prefix); run from anywhere.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path


@dataclasses.dataclass(frozen=True)
class Fault:
  what: str
  edits: tuple  # ((path relative to the repository, exact old text, new text), ...)
  tests: tuple  # pytest arguments, paths relative to the repository


# ------------------------------------------------------------------------------------------
# THE FAULTS. Snippets are exact text of the current sources: after a refactor, update them
# here (the script fails loudly when one is not found exactly once, and so does
# tests/test_faults.py, in CI).
# ------------------------------------------------------------------------------------------
FAULTS = {
  "A": Fault(
    "stop_gradient on the combine weights in the layer (no router gradient through y)",
    (
      (
        "moe_shard/layer.py",
        "run(x_TD, experts_TK=experts_TK, weights_TK=weights_TK)",
        "run(x_TD, experts_TK=experts_TK, weights_TK=jax.lax.stop_gradient(weights_TK))",
      ),
    ),
    ("tests/test_layer_oracle.py",),
  ),
  "B": Fault(
    "stop_gradient on x inside shared_experts (dx misses the shared experts)",
    (
      (
        "moe_shard/experts.py",
        "  return shared(x_TD, matmul)",
        "  return shared(jax.lax.stop_gradient(x_TD), matmul)",
      ),
    ),
    ("tests/test_layer_oracle.py",),
  ),
  "C": Fault(
    "capacity drops in slot-major order (all slot-0 items, then slot 1) not token order",
    (
      (
        "moe_shard/routing.py",
        "ids_I = experts_TK.reshape(T * K)  # I = T*K items",
        "ids_I = experts_TK.T.reshape(T * K)  # I = T*K items",
      ),
      (
        "moe_shard/routing.py",
        "return kept_I.reshape(T, K), dropped_I.reshape(T, K)",
        "return kept_I.reshape(K, T).T, dropped_I.reshape(K, T).T",
      ),
    ),
    ("tests/test_layer_oracle.py", "-k", "capacity"),
  ),
  "D": Fault(
    "all_to_all stops one overflow round early",
    (
      (
        "moe_shard/parallel/all_to_all.py",
        "return fori_while(1, rounds, body, acc)",
        "return fori_while(1, rounds - 1, body, acc)",
      ),
    ),
    ("tests/test_layer_oracle.py", "-k", "all_to_all"),
  ),
  "E": Fault(
    "the tile schedule skips a group's last (partial, masked) tile",
    (("moe_shard/kernels/tiled.py", "n_G = (rem_G + t - 1) // t", "n_G = rem_G // t"),),
    ("tests/test_grouped_matmul.py", "-k", "random_group_sizes"),
  ),
  "F": Fault(
    "the benchmark reports the overflow rounds (one fewer) as all_to_all's rounds",
    (
      (
        "bench/reading/accounting.py",
        "return 1 + -(-max(busiest_queue - first, 0) // overflow)",
        "return -(-max(busiest_queue - first, 0) // overflow)",
      ),
    ),
    ("tests/test_bench.py", "-k", "independent_host_model"),
  ),
  "G": Fault(
    "a bfloat16 layer rounds the router weights to bfloat16",
    (
      (
        "moe_shard/layer.py",
        "params.router_DE.astype(jnp.float32)\n",
        "params.router_DE.astype(compute_dtype).astype(jnp.float32)\n",
      ),
    ),
    ("tests/test_layer_oracle.py", "-k", "bf16"),
  ),
  "H": Fault(
    'the Equinox module resolves its mesh with the axis name "expert", not cfg.expert_axis',
    (
      (
        "moe_shard/equinox.py",
        "resolve_mesh(fn, mesh, cfg.expert_axis, cfg.num_experts, required=False)",
        'resolve_mesh(fn, mesh, "expert", cfg.num_experts, required=False)',
      ),
    ),
    ("tests/test_axis_names.py",),
  ),
  "I": Fault(
    "expert tensor parallelism adds the experts' output bias on every tensor rank",
    (
      (
        "moe_shard/parallel/common.py",
        'lambda a, ls: a if "F" in ls or len(ls) == 3 else jnp.where(first, a, jnp.zeros_like(a))',
        "lambda a, ls: a",
      ),
    ),
    ("tests/test_expert_split.py", "-k", "matches"),
  ),
  "J": Fault(
    "the shared experts' tensor parallelism sums partial outputs of different tokens (psum "
    "over the tensor axis without gathering the tokens first)",
    (
      (
        "moe_shard/parallel/dense.py",
        "x_TD = jax.lax.all_gather(x_TD, tensor_axis, axis=0, tiled=True)",
        "pass",
      ),
      (
        "moe_shard/parallel/dense.py",
        "y_TD = jax.lax.psum_scatter(y_TD, tensor_axis, scatter_dimension=0, tiled=True)",
        "y_TD = jax.lax.psum(y_TD, tensor_axis)",
      ),
    ),
    ("tests/test_expert_split.py", "-k", "matches"),
  ),
  "K": Fault(
    "DeepSeek's MoE layers counted from layer 1: (i + 1) % moe_layer_freq for i % moe_layer_freq",
    (("moe_shard/hf/families.py", "if i % freq != 0:", "if (i + 1) % freq != 0:"),),
    ("tests/test_hf.py", "-k", "moe_layer_freq"),
  ),
  "L": Fault(
    "block-FP8 rows that start inside a scale block take the scales from the block's first row",
    (
      (
        "moe_shard/hf/layouts.py",
        "row0 = 0 if lo is None else lo - first * block[0]",
        "row0 = 0",
      ),
    ),
    ("tests/test_hf.py", "-k", "fp8"),
  ),
  "M": Fault(
    "the benchmark's convolution FLOPs ignore feature_group_count",
    (("bench/reading/hlo_ops.py", "groups = int(g.group(1)) if g else 1", "groups = 1"),),
    ("tests/test_measure.py", "-k", "convolution"),
  ),
  "N": Fault(
    "MXFP4 decodes the high nibble of each byte as the even row",
    (
      (
        "moe_shard/quant.py",
        "codes = jnp.stack([values & 0x0F, values >> 4], axis=-2)",
        "codes = jnp.stack([values >> 4, values & 0x0F], axis=-2)",
      ),
    ),
    ("tests/test_quant.py", "-k", "decoders or checkpoint_quantizers"),
  ),
  "O": Fault(
    "the transposed TPU kernel's dx for a quantized w uses the forward kernel",
    (
      (
        "moe_shard/kernels/grouped_matmul.py",
        "    transpose_rhs=True,\n",
        "    transpose_rhs=False,\n",
      ),
    ),
    ("tests/test_quant.py", "-k", "megablox"),
  ),
}

REPO = Path(__file__).resolve().parent.parent
COPIED = ("moe_shard", "bench", "tests", "pyproject.toml")
IGNORE = shutil.ignore_patterns("__pycache__", ".hypothesis", ".pytest_cache", "*.pyc")

# Appended to the copied conftest.py: the tests must import the faulted copy.
GUARD = """

import moe_shard as _faulted  # noqa: E402  (appended by tests/faults.py)
assert _faulted.__file__.startswith(os.environ["MOE_SHARD_FAULT_ROOT"]), (
    f"faults.py: imported {_faulted.__file__}, not the faulted copy")
"""


class FaultError(Exception):
  """A fault that cannot be applied (its snippet is missing or ambiguous)."""


def apply(root, edits):
  """Applies (path, old, new) edits under `root`; each old text must occur exactly once."""
  for path, old, new in edits:
    file = root / path
    text = file.read_text()
    n = text.count(old)
    if n != 1:
      raise FaultError(
        f"{path}: expected the snippet exactly once, found it {n} times:\n    {old!r}"
      )
    file.write_text(text.replace(old, new))


def copy_repo(root):
  for name in COPIED:
    src = REPO / name
    if src.is_dir():
      shutil.copytree(src, root / name, ignore=IGNORE)
    else:
      shutil.copy2(src, root / name)
  with open(root / "tests" / "conftest.py", "a") as f:
    f.write(GUARD)


def run_pytest(root, tests):
  """Runs pytest on the copy at `root`; returns (exit code, summary lines, seconds)."""
  env = dict(
    os.environ,
    PYTHONPATH=os.pathsep.join(
      [str(root), str(root / "tests"), os.environ.get("PYTHONPATH", "")]
    ).rstrip(os.pathsep),
    MOE_SHARD_FAULT_ROOT=str(root),
  )
  t0 = time.perf_counter()
  proc = subprocess.run(
    [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", "-rf", *tests],
    cwd=root,
    env=env,
    capture_output=True,
    text=True,
  )
  out = proc.stdout.splitlines()
  # The first assertion's message (which quantity was wrong), then pytest's summary.
  first_error = [line for line in out if line.startswith("E ") and line[1:].strip()][:4]
  summary = [line for line in out if line.startswith(("FAILED", "ERROR"))] + out[-1:]
  return proc.returncode, first_error + summary, time.perf_counter() - t0


def run_fault(name, fault, control):
  """Returns "caught", "missed" or "error", printing what pytest said."""
  with tempfile.TemporaryDirectory(prefix=f"moe_shard_fault_{name}_") as tmp:
    root = Path(tmp)
    copy_repo(root)
    if control:
      code, lines, secs = run_pytest(root, fault.tests)
      if code != 0:
        print(f"  control (no fault) did not pass, exit code {code} ({secs:.0f} s):")
        print("    " + "\n    ".join(lines))
        return "error"
      print(f"  control (no fault): passed ({secs:.0f} s)")
    apply(root, fault.edits)
    code, lines, secs = run_pytest(root, fault.tests)
  verdict = {0: "missed", 1: "caught"}.get(code, "error")
  print(f"  {verdict} ({secs:.0f} s, pytest exit code {code})")
  print("    " + "\n    ".join(line[:160] for line in lines))
  return verdict


def main(argv):
  control = "--control" in argv
  names = [a for a in argv if not a.startswith("--")] or list(FAULTS)
  unknown = [n for n in names if n not in FAULTS]
  if unknown:
    print(f"faults.py: unknown fault(s) {unknown}; choose from {list(FAULTS)}")
    return 2
  if "--list" in argv:
    for n in names:
      print(f"{n}: {FAULTS[n].what}\n   pytest {' '.join(FAULTS[n].tests)}")
    return 0
  for n in names:  # every snippet must still be in the sources before anything runs
    for path, old, _ in FAULTS[n].edits:
      count = (REPO / path).read_text().count(old)
      if count != 1:
        raise FaultError(
          f"fault {n}: {path}: expected the snippet exactly once, found it "
          f"{count} times:\n    {old!r}"
        )
  verdicts = {}
  for n in names:
    print(f"{n}: {FAULTS[n].what}\n   pytest {' '.join(FAULTS[n].tests)}", flush=True)
    verdicts[n] = run_fault(n, FAULTS[n], control)
  print("\n" + "  ".join(f"{n}: {v}" for n, v in verdicts.items()))
  return 0 if all(v == "caught" for v in verdicts.values()) else 1


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
