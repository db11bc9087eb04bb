"""The least time a case can take on a chip: reading what the routing touches, or its FLOPs.

Each row's `bound_s` (a lower bound per device, where the platform's peaks are cited) is

    bound_s = max(bound_bytes / HBM bandwidth, bound_flops / peak FLOP/s)

  * bound_bytes: the parameters one device reads, as stored (quantized matrices as values
    and scales), with its routed experts' matrices counted only for the experts the routing
    is expected to touch (`expected_touched`), plus the activations it reads and writes:
    x read and y written, forward; with the backward also dy read, x read again and dx
    written, the touched weights read again and the gradients of the trainable ones written
    (a quantized matrix is frozen: no gradient).
  * bound_flops: the routed FLOPs (the router's, the K experts' of every token and the
    shared experts') over the devices, forward (x3 with the backward). A skewed routing's
    busiest device does more, so the even split stays a lower bound.

The peaks are `bench.reading.tpu.PEAKS` (cited per TPU generation). A CPU host has no published
HBM bandwidth or peak (and shares its cores with whatever else runs), and the GPU rows come
from `bench/gpu_runs/gpu.py`: there rows carry `bound_bytes` and `bound_flops`, and no `bound_s`.
"""

from __future__ import annotations

import numpy as np


def expected_touched(num_local, num_experts, top_k, tokens):
  """Expected distinct experts of one device that `tokens` tokens route to, uniformly.

  Each token picks K distinct experts of E, every K-subset alike. Expert e is missed by one
  token with probability C(E-1, K) / C(E, K) = (E - K) / E = 1 - K/E (the K-subsets
  without e, over all of them). Tokens choose independently, so e is missed by all T with
  probability (1 - K/E)^T, and by linearity of expectation the L experts a device holds
  are touched

      E[touched] = L * (1 - (1 - K/E)^T)

  times. T is every token of the layer, not the device's: any token may route to any
  device's experts.

  Args:
    num_local: L, the experts one device holds.
    num_experts: E.
    top_k: K, 1 <= K <= E.
    tokens: T, tokens in all.

  Returns:
    float, in [0, L].
  """
  return num_local * (1.0 - (1.0 - top_k / num_experts) ** tokens)


def touched_on_busiest(experts_TK, num_experts, num_devices):
  """The most distinct experts one device holds that `experts_TK` touches (experts split
  in order over `num_devices` devices; ids outside [0, E) touch none)."""
  e = np.asarray(experts_TK).ravel()
  e = np.unique(e[(e >= 0) & (e < num_experts)])
  per = num_experts // num_devices
  return int(np.bincount(e // per, minlength=num_devices).max()) if e.size else 0


def bound(case, stored, mode, peak=None):
  """The bound of one case and mode, per device.

  Args:
    case: a `bench.cases.build.Case`.
    stored: `bench.command.rows.param_bytes` of the layer's parameters (layer level), or of the
      kernel's expert matrices w (kernel level).
    mode: "fwd" or "fwd_bwd".
    peak: {"flops", "hbm"} (`bench.reading.tpu.PEAKS`), or None where the platform has none.

  Returns:
    dict: bound_bytes, bound_flops, touched_experts (per device; expected under uniform
    routing, the busiest device's count under the host routing otherwise), and with
    `peak`, bound_s.
  """
  from moe_shard import EXPERT

  size, mesh = case.size, case.mesh
  N, devices = mesh.shape[EXPERT], mesh.size
  L = case.E // N
  if case.routing == "uniform":
    touched = expected_touched(L, case.E, size.K, size.T)
  else:
    touched = touched_on_busiest(case.experts_TK, case.E, N)
  kernel = case.level == "kernel"
  experts = stored["bytes"] if kernel else stored["expert_bytes"]
  frozen = stored["frozen_bytes"]
  weights = stored["bytes"] - experts + experts * touched / L  # read once, forward
  trainable = weights - frozen * touched / L  # what the backward writes gradients of
  b = np.dtype(size.dtype).itemsize
  x_bytes = size.T // devices * size.D * b
  y_bytes = size.T // devices * (size.F if kernel else size.D) * b
  if mode == "fwd":
    total, passes = weights + x_bytes + y_bytes, 1
  else:  # forward; backward: weights again, gradients, dy and x read, dx written
    total, passes = 2 * weights + trainable + 2 * (x_bytes + y_bytes) + x_bytes, 3
  out = dict(
    bound_bytes=float(total),
    bound_flops=case.routed_flops * passes / devices,
    touched_experts=float(touched),
  )
  if peak is not None:
    out["bound_s"] = max(out["bound_bytes"] / peak["hbm"], out["bound_flops"] / peak["flops"])
  return out
