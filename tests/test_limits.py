"""The benchmark's limit rows (`bench/cases/baselines.py`): what they compute and in which dtype.

* `dense_limit` in bfloat16: every matmul touching the expert weights, forward and
  backward, is bfloat16 x bfloat16 in the lowered program (a float32 result would make the
  backward's cotangents, and so its matmuls, float32).
* `matmul_limit`: its executed FLOPs are the routed FLOPs exactly (x3 with the backward),
  its outputs in the case's dtype, and its values those of the matmuls it stands for.
"""

import re

import jax
import numpy as np
import pytest

from bench.cases import build
from bench.cases import programs as progs
from bench.command.run import make_mesh
from bench.reading import measure

T, D, F, E, K = 64, 32, 48, 8, 2  # F appears in no other dimension: it marks expert matmuls


def _case(level, dtype, devices=None):
  mesh = make_mesh(None, devices or jax.devices())
  size = build.Size(T=T, D=D, F=F, K=K, dtype=dtype)
  return build.make_case(level, E, "uniform", size, mesh)


def _dots(text):
  """(lhs type, rhs type, result type) of every dot_general in a lowered StableHLO text."""
  return re.findall(
    r"stablehlo\.dot_general.*?\((tensor<[^>]*>), (tensor<[^>]*>)\) -> (tensor<[^>]*>)", text
  )


@pytest.mark.parametrize("level", ["layer", "kernel"])
def test_dense_limit_backward_stays_in_bfloat16(level):
  case = _case(level, "bfloat16")
  fns, args = progs.programs_and_args(case, "dense_limit")
  dots = _dots(fns["fwd_bwd"].lower(*args).as_text())
  expert = [d for d in dots if any(f"{F}x" in t or f"x{F}x" in t for t in d)]
  assert len(expert) == (9 if level == "layer" else 3), dots  # three per forward matmul
  for lhs, rhs, out in expert:
    assert lhs.endswith("xbf16>") and rhs.endswith("xbf16>") and out.endswith("xbf16>"), dots
  # Only the router's float32 matmul (forward, and its two transposes) stays float32.
  f32 = [d for d in dots if d not in expert]
  assert len(f32) == (3 if level == "layer" else 0), dots
  assert all(f"x{E}xf32>" in " ".join(d) for d in f32), dots


@pytest.mark.parametrize("level", ["layer", "kernel"])
def test_matmul_limit_executes_the_routed_flops(level):
  """float32 (XLA:CPU adds converts around bfloat16 dots, which its FLOP count includes)."""
  case = _case(level, "float32")
  fns, args = progs.programs_and_args(case, "matmul_limit")
  for mode, passes in (("fwd", 1), ("fwd_bwd", 3)):
    compiled = fns[mode].lower(*args).compile()
    executed = measure.executed_flops(compiled, {})["executed"] * case.mesh.size
    # At layer level dx sums three matmuls' parts (gate, up, router): two [T*K, D] adds.
    adds = 2 * T * K * D if (level, mode) == ("layer", "fwd_bwd") else 0
    assert executed == passes * case.routed_flops + adds, mode


@pytest.mark.parametrize("level", ["layer", "kernel"])
def test_matmul_limit_stays_in_the_case_dtype(level):
  case = _case(level, "bfloat16")
  fns, args = progs.programs_and_args(case, "matmul_limit")
  for mode, count in (("fwd", 1), ("fwd_bwd", 3)):
    dots = _dots(fns[mode].lower(*args).as_text())
    assert len(dots) == count * (4 if level == "layer" else 1), dots
    assert all(t.endswith("xbf16>") for d in dots for t in d), dots
    assert all(leaf.dtype == np.dtype("bfloat16") for leaf in jax.tree.leaves(fns[mode](*args)))


def test_matmul_limit_values():
  """The layer's matmuls on one device: y = (x @ gate) @ down, x @ up, x[::K] @ router."""
  case = _case("layer", "float32", jax.devices()[:1])
  fns, (x, dy, router, gate, up, down) = progs.programs_and_args(case, "matmul_limit")
  y, u, logits = (np.asarray(a, np.float64) for a in fns["fwd"](x, dy, router, gate, up, down))
  x, router, gate, up, down = (np.asarray(a, np.float64) for a in (x, router, gate, up, down))
  np.testing.assert_allclose(y, x @ gate[0] @ down[0], rtol=1e-4, atol=1e-4)
  np.testing.assert_allclose(u, x @ up[0], rtol=1e-4, atol=1e-4)
  np.testing.assert_allclose(logits, x[::K] @ router[0], rtol=1e-4, atol=1e-4)
