"""The benchmark's PyTorch peers (`bench/peers/torch_peer.py`) and the rows that carry them.

PyTorch is never a dependency: where it does not import, the peer rows of `python -m bench`
and `python -m bench.gpu` say "not run" with the reason (checked here with PyTorch hidden),
and the tests of the peer's arithmetic skip. Where PyTorch imports (the GPU machine's image;
on CPU its `_grouped_mm` falls back to a loop of matmuls) the torchtitan-style layer is
checked against the float64 oracle, outputs and weight gradients.
"""

import importlib
import json
import sys

import jax
import jax.numpy as jnp
import numpy as np
import oracle
import pytest
from cases import assert_close

import moe_shard as ms
from bench.peers import torch_peer

try:
  torch = importlib.import_module("torch")
except ImportError:
  torch = None

# On the GPU machine the peer's arithmetic runs where the benchmark runs it, on the GPU.
DEVICE = "cuda" if torch is not None and torch.cuda.is_available() else "cpu"

needs_torch = pytest.mark.skipif(
  torch is None, reason="PyTorch is not installed: the PyTorch peers are optional"
)


@pytest.fixture
def no_torch(monkeypatch):
  monkeypatch.setitem(sys.modules, "torch", None)  # `import torch` raises ImportError


def test_unavailable_names_the_reason(no_torch):
  assert torch_peer.unavailable().startswith("PyTorch is not installed")
  with pytest.raises(torch_peer.NotRun, match="PyTorch is not installed"):
    torch_peer.grouped_mm_programs(None, None, np.zeros(2, np.int32), None)


def test_the_layer_row_says_why_it_did_not_run(no_torch, tmp_path):
  from bench.command import cli

  out = tmp_path / "rows.json"
  args = ["-T", "64", "-D", "16", "-F", "32", "-E", "4", "--mesh", "1x1", "--repeats", "1"]
  args += ["--impls", "torch_moe", "--no-progress", "--json", str(out)]
  assert cli.main(args) == 0
  rows = json.loads(out.read_text())["rows"]
  assert [r["mode"] for r in rows] == ["fwd", "fwd_bwd"]
  for r in rows:
    assert r["impl"] == "torch_moe"
    assert r["error"].startswith("not run: PyTorch is not installed")


def _case(E=4, T=40, D=16, F=32, K=2, seed=0):
  cfg = ms.MoEConfig(d_model=D, d_ff=F, num_experts=E, top_k=K)
  params = ms.init_moe_params(jax.random.key(seed), cfg)
  x_TD = np.asarray(jax.random.normal(jax.random.key(seed + 1), (T, D)))
  return cfg, params, x_TD


@needs_torch
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_torchtitan_layer_matches_the_oracle(dtype):
  """Output and the gate, up and down gradients (which the router's path does not reach)."""
  cfg, params, x_TD = _case()
  tdt = getattr(torch, dtype)
  x_TD = np.asarray(jnp.asarray(x_TD, dtype).astype(jnp.float32))  # the rounded inputs
  ffn = params.experts
  mats = [
    np.asarray(jnp.asarray(a, dtype).astype(jnp.float32))
    for a in (ffn.gate_EDF, ffn.up_EDF, ffn.down_EFD)
  ]
  leaves = [torch.tensor(a).to(DEVICE, tdt).requires_grad_() for a in mats]
  x = torch.tensor(x_TD).to(DEVICE, tdt)
  router = torch.tensor(np.asarray(params.router_DE, np.float32)).to(DEVICE)
  y = torch_peer.moe_layer(torch, x, router, *leaves, top_k=cfg.top_k, normalize=True)
  ct = np.random.default_rng(1).normal(size=y.shape).astype(np.float32)
  grads = torch.autograd.grad(y, leaves, torch.tensor(ct).to(DEVICE, tdt))

  logits = np.asarray(x_TD, np.float64) @ np.asarray(params.router_DE, np.float64)  # not TF32
  routing = ms.top_k_routing(jnp.asarray(logits, jnp.float32), cfg.top_k)
  ffn64 = ms.SwiGLU(gate_EDF=mats[0], up_EDF=mats[1], down_EFD=mats[2])
  want_y = oracle.moe(x_TD, ffn64, routing.experts_TK, routing.weights_TK)
  _, want_dw, _ = oracle.moe_grads(x_TD, ffn64, routing.experts_TK, routing.weights_TK, ct)
  assert y.dtype == tdt
  assert_close(torch_peer.to_numpy(y), want_y, dtype, err_msg="y")
  for name, g in zip(("gate_EDF", "up_EDF", "down_EFD"), grads):
    assert_close(torch_peer.to_numpy(g), getattr(want_dw, name), dtype, err_msg=name)


@needs_torch
def test_groups_are_padded_to_aligned_starts():
  """Every expert's group starts at a multiple of ALIGN_ROWS, whatever the counts (one
  expert taking every token, empty experts)."""
  seen = []
  real = torch._grouped_mm

  def spy(x, w, *, offs):
    seen.append(offs.clone())
    return real(x, w, offs=offs)

  _, params, x_TD = _case(E=4, T=37)
  router = np.asarray(params.router_DE, np.float32).copy()
  router[:, 0] += 50.0  # expert 0 first for every token: experts 2 and 3 stay nearly empty
  torch._grouped_mm = spy
  try:
    ffn = params.experts
    mats = [
      torch.tensor(np.asarray(a)).to(DEVICE, torch.bfloat16)
      for a in (ffn.gate_EDF, ffn.up_EDF, ffn.down_EFD)
    ]
    x = torch.tensor(np.abs(x_TD)).to(DEVICE, torch.bfloat16)
    torch_peer.moe_layer(torch, x, torch.tensor(router).to(DEVICE), *mats, top_k=2, normalize=True)
  finally:
    torch._grouped_mm = real
  assert len(seen) == 3
  offs = seen[0].cpu().numpy()
  assert np.all(offs % torch_peer.ALIGN_ROWS == 0) and offs[-1] >= 37 * 2
