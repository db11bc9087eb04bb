"""`impl="auto"`'s rule: the dispatch for a mesh and a number of tokens per device.

One device on the expert axis: "ragged_dot". Otherwise the rule picks between the two
exchanges, `moe_all_to_all` (padded slots per (source, destination) pair) and
`moe_ragged_all_to_all` (exact rows, where XLA has the ragged collective):

- at decode sizes (`DECODE_TOKENS`), by each one's estimated time on the chip
  (`decode_estimates`: the weights and rows it reads, its FLOPs, the collectives it waits
  on), where the chip's figures are published (`chips.CHIPS`);
- past them, by the chip's ridge point (`STEP_RIDGE`): the ragged dispatch's exact rows save
  FLOPs, all_to_all's programs move fewer HBM bytes, and which one the step is bound by
  depends on the chip's FLOP/s per byte/s of HBM;
- on a placement, the ragged dispatch (its replicas even out devices, not pairs).

`choose_impl` applies it to an `MoEConfig` and a mesh; `moe_layer` calls it once per trace.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AbstractMesh, Mesh

from moe_shard import _checks, chips, parallel, plan, quant
from moe_shard.sharding import axis_size

if TYPE_CHECKING:  # annotations only
  from moe_shard.config import MoEConfig
  from moe_shard.dispatch import DispatchFn

# At most this many tokens per device, "auto" treats the call as decode (see `auto_impl`):
# the layer is bound by reading the experts' weights there, and a collective's fixed latency
# weighs as much as its bytes.
DECODE_TOKENS = 64
# Where decode sizes are not priced (one expert per device; chips without published
# figures, `chips.CHIPS`: GPUs, other TPUs), "auto" keeps "all_to_all" at decode sizes only
# while its receive buffer holds at most this many rows per local expert per byte of a
# weight element: its matmuls cost 2 FLOPs per row and
# weight, the read of the weights their bytes, and this is about half the FLOPs per HBM
# byte where TPU v5e (240) and an H100 (295) turn compute-bound, so the buffer's padded rows
# cost no time. Past it (one int8 expert per chip at 64 tokens: 256 rows for 128 routed,
# compiled for TPU v5e 2.0x the routed FLOPs against the ragged dispatch's 1.4x) the padding
# is paid in FLOPs.
DECODE_ROWS_PER_WEIGHT_BYTE = 128
# Passes over HBM that each row of a dispatch's buffers makes in a decode call, counted on
# its send side (the rows it sorts and sends: all_to_all's padded slots, the ragged
# dispatch's items) and its receive side (the rows it receives, runs through the experts and
# returns) (`decode_estimates`): a buffer written, read by the exchange, written by it at the
# other end, sorted, read by the matmuls, their outputs written, and back. A figure fitted
# to XLA's counts of the compiled programs, which charge the row scatters of sorting several
# times the bytes they move: compiled for TPU v5e and v6e 2x4 with several experts a chip,
# all_to_all's time less the ragged dispatch's (the counts less VMEM prefetches) over the
# bytes of the rows it moves more is 17 to 27 passes at 8 tokens per chip, and from none
# (Qwen3-30B-A3B on v5e) to 26 at 64 (bench/results/tpu_v5e_2x4_decode_dispatches.md,
# tpu_v6e_2x4_decode_dispatches.md).
ROW_PASSES = 16
# Device kinds whose compiled ragged dispatch makes more passes over each row than
# `ROW_PASSES` at decode sizes, and their passes. Compiled for TPU7x, its program moves more
# than twice all_to_all's bytes per row at 64 tokens per chip, where v5e's and v6e's move
# about as many (bench/results/tpu_tpu7x_2x2x1_decode.md, docs/guides/tpu_gpu.md). The
# value lies between the two sides that file's rows pin: all_to_all, the faster, at 64
# tokens per chip, and the ragged dispatch, the faster, at 8.
RAGGED_ROW_PASSES = {"TPU7x": 24}
# Collectives each dispatch waits on one after another in a decode call (one round): the
# exchange there and back; the ragged dispatch first all-gathers its queues' counts. Each
# one costs `chips.collective_latency_s` whatever its bytes. (all_to_all's pmax of the
# rounds and the stats' psums run beside them.) The compiled programs' chains,
# `bench.reading.measure.dependent_collectives`, count the same.
DEPENDENT_COLLECTIVES = {"all_to_all": 2, "ragged_all_to_all": 3}
# Past decode sizes, on a chip with published figures (`chips.CHIPS`) whose peak FLOP/s per
# byte/s of HBM (its ridge point) is above this, "auto" takes "all_to_all"; at or below
# it, "ragged_all_to_all". The ragged dispatch computes the routed rows exactly (its receive
# buffer's margin: 1.06x the FLOPs at 1024 rows a pair) where all_to_all pads each pair
# (1.13x); all_to_all's compiled programs move fewer HBM bytes (the ragged collective's
# buffers are laid out, copied and masked around it). A chip that is compute-bound under the
# ragged dispatch's bytes is faster with its exact rows; one that is not, with all_to_all's
# bytes. Set between the measured chips (compiled training steps, T=32768, D=2048, F=4096,
# K=2, uniform, E=8 and 64, the counts less VMEM prefetches, bench/results/tpu_*_step): the
# ragged dispatch faster on TPU v5p (ridge 166) and v5e (240), all_to_all on TPU7x (313)
# and v6e (560).
STEP_RIDGE = 275.0


def auto_impl(
  platform: str,
  expert_devices: int,
  tokens: int | None = None,
  *,
  rows_per_expert: float | None = None,
  weight_bytes: float = 2.0,
  decode_times: dict[str, float] | None = None,
  ridge: float | None = None,
) -> str:
  """The rule of `impl="auto"`: the dispatch for a platform, expert axis and token count.

  - One device on the expert axis (or no mesh): "ragged_dot".
  - At most `DECODE_TOKENS` tokens per device (decode), on a platform with the ragged
    collective and estimated times for both exchanges (`decode_times`, from
    `decode_estimates`, which `choose_impl` gives with several experts per device on a
    chip with published figures): the one with the smaller estimate, "all_to_all" on a
    tie (it waits on fewer collectives).
  - At decode sizes otherwise: "all_to_all" while its receive buffer holds at most
    `DECODE_ROWS_PER_WEIGHT_BYTE * weight_bytes` rows per local expert. Few tokens per
    chip make the layer a read of the experts' weights; all_to_all's padded slots cost no
    time there, its exchange is one `lax.all_to_all` each way, where the ragged dispatch
    first all-gathers its queue counts, and its receive buffer holds every routing in one
    round at up to `plan.DECODE_ROWS` rows.
  - Past decode sizes, where XLA has the ragged-all-to-all collective (TPU, CUDA and ROCm
    GPUs: `parallel.RAGGED_PLATFORMS`): on TPU, "all_to_all" on a chip whose ridge point is
    above `STEP_RIDGE` (its step is bound by HBM bytes, which all_to_all's programs move
    fewer of), else "ragged_all_to_all" (exact rows, fewer FLOPs; also where the ridge is
    not known, and on GPUs whatever their ridge: `STEP_RIDGE` is set between TPUs'
    compiled programs). "all_to_all" where XLA has no ragged collective (CPU).

  Args:
    platform: the mesh's devices' platform in `lax.platform_dependent`'s names ("tpu",
      "cuda", "rocm", "cpu", ...).
    expert_devices: N, devices on the expert axis.
    tokens: tokens per device (T over the mesh's size), or None (default: not known; the
      rule for many tokens).
    rows_per_expert: rows of all_to_all's first receive buffer per local expert at these
      tokens (`choose_impl` computes them), or None (default: not known; decode sizes take
      all_to_all).
    weight_bytes: bytes of one expert weight element as held (default 2.0, bfloat16;
      `quant.ELEMENT_BYTES` for the quantized formats).
    decode_times: {"all_to_all": s, "ragged_all_to_all": s}, each dispatch's estimated
      seconds at these tokens (`decode_estimates`), or None (default: not priced).
    ridge: the chip's peak FLOP/s over its HBM bytes/s (`chip_ridge`), or None (default:
      not known); read on "tpu" only.

  Returns:
    A name of `DISPATCHES`.
  """
  if expert_devices <= 1:
    return "ragged_dot"
  ragged = "ragged_all_to_all" if platform in parallel.RAGGED_PLATFORMS else "all_to_all"
  if tokens is None or tokens > DECODE_TOKENS:
    above = platform == "tpu" and ridge is not None and ridge > STEP_RIDGE
    return "all_to_all" if above else ragged
  if decode_times is not None and ragged == "ragged_all_to_all":
    return ragged if decode_times[ragged] < decode_times["all_to_all"] else "all_to_all"
  pays_no_flops = (
    rows_per_expert is None or rows_per_expert <= DECODE_ROWS_PER_WEIGHT_BYTE * weight_bytes
  )
  return "all_to_all" if pays_no_flops else ragged


def decode_estimates(
  cfg: MoEConfig, mesh: Mesh | AbstractMesh, tokens: int
) -> dict[str, float] | None:
  """Each exchange's estimated seconds per call at `tokens` per device, on the mesh's chips.

      t = max((W + ROW_PASSES * (S + R) * D * b) / HBM, R * flops_per_row / FLOP/s)
          + n * latency

  per device: W the bytes of its experts' weights (as held: `cfg.weights_format` or
  `cfg.param_dtype`) that the routing is expected to touch (each of L local experts is
  missed by all tokens of the call with probability (1 - K/E)^(tokens * devices), under
  uniform routing); S the rows it sends (all_to_all: N times its slots per pair,
  `plan.default_chunks`; ragged_all_to_all: its tokens * K items) and R the rows it
  receives (all_to_all: the same N slots; ragged_all_to_all: `plan.default_capacity`),
  each of D elements of b bytes (`cfg.compute_dtype`, else bfloat16) through `ROW_PASSES`
  passes (the ragged dispatch's: `RAGGED_ROW_PASSES` of the chip, where listed), the
  received ones through the FFN's matmuls (2 FLOPs per row and weight); n its
  `DEPENDENT_COLLECTIVES`, each `chips.collective_latency_s` of one expert-axis group of
  devices. HBM and FLOP/s are the chip's published peaks (`chips.CHIPS`). A model of the
  benchmark's roofline with its latency term (`python -m bench --tpu`), not a measurement.

  Args:
    cfg: `MoEConfig`.
    mesh: the mesh the layer runs on (its devices' kind and coordinates).
    tokens: tokens per device.

  Returns:
    {"all_to_all": s, "ragged_all_to_all": s}, or None where the devices are not TPUs
    with published figures, have no coordinates (an `AbstractMesh`), or the expert axis
    has one device.
  """
  n = axis_size(mesh, cfg.expert_axis)
  devices, spec = _group_chip(mesh, cfg.expert_axis)
  latency = chips.collective_latency_s(devices) if spec is not None else None
  if spec is None or latency is None or n <= 1:
    return None
  E, K, D = cfg.num_experts, cfg.top_k, cfg.d_model
  L = E // n
  ffn = cfg.expert_class.param_shapes(cfg)
  per_row = sum(math.prod(a.shape[1:]) for a in jax.tree.leaves(ffn) if a.ndim == 3)
  fmt = cfg.weights_format
  weight_bytes = cfg.param_dtype.itemsize if fmt is None else quant.ELEMENT_BYTES[fmt]
  touched = L * (1.0 - (1.0 - K / E) ** (tokens * mesh.size))
  weights = touched * per_row * weight_bytes
  b = jnp.dtype(cfg.compute_dtype or jnp.bfloat16).itemsize
  slots = n * plan.default_chunks(tokens, K, n, cfg.chunk_size).first
  ragged_passes = RAGGED_ROW_PASSES.get(devices[0].device_kind, ROW_PASSES)
  rows = {  # (sent, received, passes)
    "all_to_all": (slots, slots, ROW_PASSES),
    "ragged_all_to_all": (
      tokens * K,
      plan.default_capacity(tokens, K, cfg.recv_capacity, n, L).first,
      ragged_passes,
    ),
  }
  return {
    impl: max((weights + passes * (s + r) * D * b) / spec.hbm, 2 * r * per_row / spec.flops)
    + DEPENDENT_COLLECTIVES[impl] * latency
    for impl, (s, r, passes) in rows.items()
  }


def choose_impl(
  cfg: MoEConfig,
  mesh: Mesh | AbstractMesh | None = None,
  *,
  tokens: int | None = None,
  replicated: bool = False,
) -> str | DispatchFn:
  """Resolves `cfg.impl` for a mesh and a number of tokens per device.

  Args:
    cfg: `MoEConfig`.
    mesh: None (default) or a `jax.sharding.Mesh`.
    tokens: tokens per device of the call, T / mesh size rounded up (`moe_layer` passes
      it); None (default): not known, the rule for many tokens.
    replicated: the call runs on a placement (default False). Its replicas even out each
      device's rows, which set the ragged dispatch's rounds, but not the (source,
      destination) pairs that set all_to_all's: a device's own replicas take its items.
      So where XLA has ragged-all-to-all (TPU, GPU) "auto" takes "ragged_all_to_all"
      whatever the tokens and the chip (docs/guides/skew.md).

  Returns:
    `cfg.impl` unless it is "auto" (a name of `DISPATCHES`, or the user's function); for
    "auto", `auto_impl` of the mesh's platform, the size of its `cfg.expert_axis`,
    `tokens`, the rows per local expert of all_to_all's first receive buffer
    (`plan.default_chunks`), the bytes of a weight element (`cfg.weights_format`, else
    `cfg.param_dtype`) and, at decode sizes with several experts per device on chips
    with published figures, both exchanges' estimated times (`decode_estimates`):
    "ragged_dot" without an expert axis of several devices; on a placement
    (`replicated`) "ragged_all_to_all" where XLA has it, whatever the tokens; at up to
    `DECODE_TOKENS` tokens per device the exchange with the smaller estimate where there
    is one, else "all_to_all" while its buffer's matmuls cost less than reading the
    weights; past them, on TPUs and GPUs (XLA has ragged-all-to-all there),
    "all_to_all" where the devices' chip has a ridge point above `STEP_RIDGE`
    (`chip_ridge`: TPU v6e, TPU7x) and "ragged_all_to_all" elsewhere (TPU v5e, v5p, v4,
    GPUs); "all_to_all" where XLA has no ragged collective (CPU). One expert per device
    is not priced at decode sizes: its
    buffers hold the same rows either way at 8 tokens per chip, and compiled for TPU v5e
    the ragged program's dense matmuls (Mixtral-8x7B in bfloat16) have XLA prefetch their
    weights into VMEM, 2.7x the bound against all_to_all's 1.05x
    (bench/results/tpu_v5e_2x4_decode_dispatches.md).
    The platform and chip are the mesh's devices' (`jax.default_backend()` says "cpu" on a
    CPU host compiling ahead of time for TPU devices); for an `AbstractMesh`, which has no
    devices, its abstract device's where it carries one (`Mesh.abstract_mesh` does), else
    the default device's, for both (`_mesh_device`).

  Raises:
    TypeError, ValueError: `tokens` not None or an int >= 0.
  """
  if tokens is not None:
    tokens = _checks.int_field("choose_impl", "tokens", tokens, 0)
  if cfg.impl != "auto":
    return cfg.impl
  if mesh is None:
    return "ragged_dot"
  n = axis_size(mesh, cfg.expert_axis)
  rows = times = None
  if tokens is not None and n > 1:
    chunks = plan.default_chunks(tokens, cfg.top_k, n, cfg.chunk_size)
    rows = chunks.first * n / (cfg.num_experts / n)
    if tokens <= DECODE_TOKENS and cfg.num_experts > n:
      times = decode_estimates(cfg, mesh, tokens)
  fmt = cfg.weights_format
  weight_bytes = cfg.param_dtype.itemsize if fmt is None else quant.ELEMENT_BYTES[fmt]
  platform = _platform(mesh)
  if replicated and n > 1 and platform in parallel.RAGGED_PLATFORMS:
    return "ragged_all_to_all"
  return auto_impl(
    platform,
    n,
    tokens,
    rows_per_expert=rows,
    weight_bytes=weight_bytes,
    decode_times=times,
    ridge=chip_ridge(mesh, cfg.expert_axis),
  )


def chip_ridge(mesh: Mesh | AbstractMesh, expert_axis: str | tuple[str, ...]) -> float | None:
  """The ridge point of the mesh's chips: peak FLOP/s over HBM bytes/s (`chips.CHIPS`),
  the FLOPs per byte above which a program is bound by its FLOPs; None where the devices
  are not TPUs with published figures (CPU, GPUs, TPUs not listed). For an `AbstractMesh`
  the chip of the device `_platform` reads (`_mesh_device`)."""
  _, spec = _group_chip(mesh, expert_axis)
  return None if spec is None else spec.flops / spec.hbm


def _group_chip(mesh, expert_axis):
  """(`_expert_group`'s devices, their `chips.Chip` or None): the chip of the group's
  first device, else of `_mesh_device`; None unless it is a TPU (the figures and the rules
  that read them, `STEP_RIDGE` and `ROW_PASSES`, are TPUs')."""
  devices = _expert_group(mesh, expert_axis)
  device = devices[0] if devices else _mesh_device(mesh)
  if _device_platform(device) != "tpu":
    return devices, None
  return devices, chips.chip(getattr(device, "device_kind", None))


def _expert_group(mesh, expert_axis):
  """The devices of one group of the expert axis (the other axes at index 0), which the
  dispatches' collectives span; [] for a mesh without devices (an `AbstractMesh`)."""
  axes = expert_axis if isinstance(expert_axis, tuple) else (expert_axis,)
  try:
    devices = mesh.devices
    index = tuple(slice(None) if name in axes else 0 for name in mesh.axis_names)
  except (AttributeError, ValueError):
    return []
  return list(np.asarray(devices)[index].flat)


def _default_device():
  """The default backend's first device."""
  return jax.devices()[0]


def _mesh_device(mesh):
  """The device that stands for the mesh's: its first; for an `AbstractMesh`, which has no
  devices, its abstract device (kind and platform) where it carries one, else the default
  device."""
  try:
    return mesh.devices.flat[0]
  except (AttributeError, IndexError, TypeError, ValueError):
    pass
  abstract = getattr(mesh, "abstract_device", None)
  return abstract if abstract is not None else _default_device()


def _device_platform(device):
  """A device's platform in `lax.platform_dependent`'s names ("tpu", "cuda", "rocm",
  "cpu", ...)."""
  platform = device.platform.lower()
  if platform == "gpu":  # a device says "gpu" for CUDA and ROCm alike; its client tells which
    client = getattr(device, "client", None) or _default_device().client
    version = client.platform_version.lower()
    platform = next((p for p in ("cuda", "rocm") if p in version), platform)
  return platform


def _platform(mesh):
  """The platform of a mesh's devices (`_mesh_device`'s) in `lax.platform_dependent`'s
  names."""
  return _device_platform(_mesh_device(mesh))
