"""The one-command GPU run (`bench/gpu_h100.sh`) and its summary (`bench/gpu_runs/gpu_summary.py`),
on CPU: the steps the script runs and their time limits, and the ratios the summary reads
from result rows."""

import json
import os
import re
import subprocess

from bench.gpu_runs import gpu_summary

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_dry_run_lists_every_step_within_nine_minutes():
  out = subprocess.run(
    ["bash", os.path.join(ROOT, "bench", "gpu_h100.sh"), "--dry-run"],
    capture_output=True,
    text=True,
    check=True,
    timeout=60,
  ).stdout
  steps = re.findall(r"^\[(\d+)s\] ([^:]+): (.*)$", out, re.M)
  names = [name for _, name, _ in steps]
  assert sorted(names) == sorted(["tests", "sweep", "gmm", "layer E=8", "layer E=64"]), out
  assert sum(int(limit) for limit, _, _ in steps) <= 9 * 60 - 20  # setup within the rest
  commands = dict((name, cmd) for _, name, cmd in steps)
  assert "tests/test_gpu.py" in commands["tests"]
  assert "torch" in commands["gmm"] and "--sizes uniform" in commands["gmm"]
  assert "--sweep 8,32,128" in commands["sweep"]
  for E in ("8", "64"):
    assert "--impls auto,torch_moe" in commands[f"layer E={E}"]


def _layer_row(E, mode, impl, ms, **kw):
  return dict(level="layer", E=E, mode=mode, impl=impl, time_s={"median": ms / 1e3}, **kw)


def test_summary_reads_the_ratios(tmp_path):
  gmm = [
    dict(G=8, skew="uniform", impl="auto", mode="fwd+bwd", impl_ms=4.0),
    dict(G=8, skew="uniform", impl="torch", mode="fwd+bwd", impl_ms=2.0),
    dict(G=8, skew="uniform", impl="tokamax", mode="fwd+bwd", error="ImportError: no tokamax"),
  ]
  layer = [
    _layer_row(8, "fwd", "auto", 14.0, rel_err=3e-3),
    _layer_row(8, "fwd", "torch_moe", 7.0, rel_err=2e-3),
    _layer_row(8, "fwd", "ragged_all_to_all", 28.0),
  ]
  (tmp_path / "gpu_h100_gmm.json").write_text(json.dumps(dict(rows=gmm)))
  (tmp_path / "gpu_h100_layer.json").write_text(json.dumps(dict(rows=layer)))
  log = tmp_path / "tests.log"
  log.write_text(
    "12.50s call     tests/test_gpu.py::test_x\n==== 40 passed, 2 skipped in 99s ====\n"
  )
  text = gpu_summary.summary(str(tmp_path), str(log))
  assert "tests: 40 passed, 2 skipped in 99s" in text
  assert "12.50s call     tests/test_gpu.py::test_x" in text
  assert "auto 4.00 (0.50x)" in text  # half torch's speed
  assert "tokamax: ImportError: no tokamax" in text
  assert "auto 14.0 [3.0e-03]" in text
  assert "auto/torch_moe speed 0.50" in text
  assert "ragged_all_to_all time / auto 2.00" in text


def test_summary_without_results(tmp_path):
  text = gpu_summary.summary(str(tmp_path))
  assert "grouped matmul: no results file" in text and "layer: no results file" in text


def test_sweep_checks_every_config_against_the_first(monkeypatch):
  """`python -m bench.gpu --sweep` on CPU, the Mosaic kernel replaced by `lax.ragged_dot`
  (one config's by a wrong product): every row carries its error against the first config,
  forward and forward+backward, and the wrong config's is large."""
  import jax

  from bench.gpu_runs import gpu

  def fake_gmm(x, w, gs, blocks):
    y = jax.lax.ragged_dot(x, w, gs)
    return 2 * y if blocks == gpu.SWEEP[1] else y

  monkeypatch.setattr(gpu, "SHAPE", (64, 16, 32))
  monkeypatch.setattr(gpu.gmm_gpu, "mosaic_gpu_gmm", fake_gmm)
  monkeypatch.setattr(gpu, "SWEEP", gpu.SWEEP[:3])
  rows = []
  gpu.sweep([4], repeats=1, on_row=rows.append, peer=False)
  assert [r["mode"] for r in rows] == ["fwd", "fwd+bwd"] * 3
  assert all("error" not in r for r in rows), rows
  errs = [r["max_err_vs_first"] for r in rows]
  assert errs[:2] == [0.0, 0.0] and errs[4:] == [0.0, 0.0], errs
  assert min(errs[2:4]) > 0.5, errs  # 2y against y; its dx and dw twice as large too
