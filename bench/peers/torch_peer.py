"""PyTorch peers of the GPU benchmarks: `torch._grouped_mm` and a torchtitan-style MoE layer.

Both run only where PyTorch imports and sees a CUDA device (the H100 image has PyTorch
2.11); elsewhere `unavailable()` gives the reason and the rows say "not run: ...". PyTorch
is never a dependency of moe_shard, of its tests or of CI: it is imported here, lazily.

  * `grouped_mm_programs`: `torch._grouped_mm(x [M, D], w [G, D, F], offs=i32[G])`, offs
    the cumulative ends of the groups (bfloat16 on sm90 takes its CUTLASS kernel), forward
    and forward+backward through autograd, for `python -m bench.gpu`'s "torch" row.
  * `moe_programs`: the layer as torchtitan's `MoE` computes it (`torchtitan/models/moe`):
    softmax router and top-k, tokens sorted by expert into groups padded to 16 rows (its
    `indices_padding_wrapper`; `_grouped_mm` wants 16-byte aligned group starts), three
    `_grouped_mm`s for gate, up and down with SwiGLU between, the combine weights applied
    to the outputs in float32 (torchtitan's `score_before_experts=False`), and a scatter-add
    back to the tokens. No shared experts, no load-balancing term. For the layer
    benchmark's "torch_moe" row (`bench/cases/impls.py`), on the case's own weights and inputs.

Every program ends with `torch.cuda.synchronize()`, so the benchmark's wall-clock timing
(`common.time_in_turns`, which blocks on JAX arrays only) times finished GPU work.
"""

from __future__ import annotations

import importlib

import numpy as np

ALIGN_ROWS = 16  # torchtitan's ALIGN_SIZE_M for bfloat16 groups


class NotRun(Exception):
  """A peer that cannot run here; the message says why."""


def unavailable():
  """Why the PyTorch peers cannot run here (None when they can): no torch, no CUDA device,
  or no `torch._grouped_mm`."""
  try:
    torch = importlib.import_module("torch")
  except ImportError as err:
    return f"PyTorch is not installed ({err})"
  if not torch.cuda.is_available():
    return f"PyTorch {torch.__version__} sees no CUDA device"
  if not hasattr(torch, "_grouped_mm"):
    return f"PyTorch {torch.__version__} has no torch._grouped_mm"
  return None


def _torch():
  why = unavailable()
  if why:
    raise NotRun(why)
  return importlib.import_module("torch")


def to_torch(a, dtype="bfloat16"):
  """A JAX or NumPy array as a CUDA tensor of `dtype` (through float32, exact for bf16)."""
  torch = _torch()
  host = np.asarray(np.asarray(a).astype(np.float32))
  return torch.from_numpy(host).to("cuda").to(getattr(torch, dtype))


def to_numpy(t):
  """A tensor (or a Python number) as float32 NumPy."""
  if hasattr(t, "detach"):
    return t.detach().float().cpu().numpy()
  return np.asarray(t, np.float32)


def _synced(fn):
  torch = _torch()

  def run(*args):
    out = fn(*args)
    torch.cuda.synchronize()
    return out

  return run


def grouped_mm_programs(x, w, group_sizes, dy):
  """`torch._grouped_mm` on the inputs of one `bench.gpu_runs.gpu` case.

  Args:
    x: bf16[M, D]; w: bf16[G, D, F]; group_sizes: i32[G]; dy: bf16[M, F] (JAX arrays).

  Returns:
    ({"fwd": fn, "fwd+bwd": fn}, args): fwd -> y; fwd+bwd -> (y, dx, dw), through autograd.

  Raises:
    NotRun: no torch, no CUDA device, or no `torch._grouped_mm` here.
  """
  torch = _torch()
  xt, wt, dyt = to_torch(x), to_torch(w), to_torch(dy)
  offs = torch.from_numpy(np.cumsum(np.asarray(group_sizes)).astype(np.int32)).to("cuda")

  def fwd(x, w, offs, dy):
    with torch.no_grad():
      return torch._grouped_mm(x, w, offs=offs)

  def fwd_bwd(x, w, offs, dy):
    x, w = x.detach().requires_grad_(), w.detach().requires_grad_()
    y = torch._grouped_mm(x, w, offs=offs)
    dx, dw = torch.autograd.grad(y, (x, w), dy)
    return y, dx, dw

  return {"fwd": _synced(fwd), "fwd+bwd": _synced(fwd_bwd)}, (xt, wt, offs, dyt)


def moe_layer(torch, x_TD, router_DE, gate_EDF, up_EDF, down_EFD, *, top_k, normalize):
  """The torchtitan-style layer on torch tensors; y: [T, D] in x's dtype."""
  T, D = x_TD.shape
  E = gate_EDF.shape[0]
  # Router: float32 logits (torch keeps float32 matmuls in float32 by default), softmax.
  probs_TE = torch.softmax(x_TD.float() @ router_DE, dim=1)
  weights_TK, experts_TK = torch.topk(probs_TE, top_k, dim=1)
  if normalize:
    weights_TK = weights_TK / weights_TK.sum(dim=1, keepdim=True)
  # Permute: items sorted by expert, each expert's group padded to ALIGN_ROWS rows. The
  # buffer is sized for the worst padding, so nothing waits on the host.
  experts_I = experts_TK.reshape(-1)
  order_I = torch.argsort(experts_I, stable=True)
  counts_E = torch.bincount(experts_I, minlength=E)
  padded_E = (counts_E + ALIGN_ROWS - 1) // ALIGN_ROWS * ALIGN_ROWS
  ends_E = torch.cumsum(padded_E, 0)
  starts_E = ends_E - padded_E
  firsts_E = torch.cumsum(counts_E, 0) - counts_E
  expert_sorted_I = experts_I[order_I]
  rank_I = torch.arange(order_I.numel(), device=x_TD.device) - firsts_E[expert_sorted_I]
  slot_I = starts_E[expert_sorted_I] + rank_I
  token_I = order_I // top_k
  rows = T * top_k + E * (ALIGN_ROWS - 1)
  x_RD = x_TD.new_zeros((rows, D))
  x_RD[slot_I] = x_TD[token_I]
  offs = ends_E.to(torch.int32)
  # Experts: three grouped matmuls and the SwiGLU (padding rows stay zero: no biases).
  g_RF = torch._grouped_mm(x_RD, gate_EDF, offs=offs)
  u_RF = torch._grouped_mm(x_RD, up_EDF, offs=offs)
  y_RD = torch._grouped_mm(torch.nn.functional.silu(g_RF) * u_RF, down_EFD, offs=offs)
  # Unpermute: each item's output times its weight (float32), scatter-added to its token.
  w_I = weights_TK.reshape(-1)[order_I]
  items_ID = (y_RD[slot_I].float() * w_I[:, None]).to(x_TD.dtype)
  return x_TD.new_zeros((T, D)).index_add_(0, token_I, items_ID)


def moe_programs(case):
  """The "torch_moe" row of the layer benchmark: `moe_layer` on the case's weights and x.

  Returns:
    ({"fwd": fn, "fwd_bwd": fn}, args) in the form of the benchmark's programs: fwd ->
    (y, 0.0, 1, 0) (y, aux loss, rounds, items dropped: it is dropless and has no aux
    loss); fwd_bwd -> (y, dx, gradients of the router, gate, up and down).

  Raises:
    NotRun: not the layer level, more than one device, or no PyTorch with CUDA here.
  """
  if case.level != "layer":
    raise NotRun("torch_moe runs the layer level only")
  if case.mesh.size != 1:
    raise NotRun(f"torch_moe runs on one device (the mesh has {case.mesh.size})")
  if case.size.num_shared_experts or case.size.score_func != "softmax":
    raise NotRun("torch_moe runs the softmax top-k layer without shared experts")
  torch = _torch()
  params, x, dy = case.args
  dtype = str(np.dtype(case.size.dtype))
  B, S, D = x.shape
  ffn = params.experts
  args = (
    to_torch(np.asarray(x).reshape(B * S, D), dtype),
    to_torch(params.router_DE, "float32"),
    to_torch(ffn.gate_EDF, dtype),
    to_torch(ffn.up_EDF, dtype),
    to_torch(ffn.down_EFD, dtype),
    to_torch(np.asarray(dy).reshape(B * S, D), dtype),
  )
  opts = dict(top_k=case.size.K, normalize=case.cfg.normalize_top_k)

  def fwd(x, router, gate, up, down, dy):
    with torch.no_grad():
      y = moe_layer(torch, x, router, gate, up, down, **opts)
    return y.reshape(B, S, D), 0.0, 1, 0

  def fwd_bwd(x, router, gate, up, down, dy):
    leaves = [a.detach().requires_grad_() for a in (x, router, gate, up, down)]
    y = moe_layer(torch, *leaves, **opts)
    grads = torch.autograd.grad(y, leaves, dy)
    return y.reshape(B, S, D), *grads

  return {"fwd": _synced(fwd), "fwd_bwd": _synced(fwd_bwd)}, args
