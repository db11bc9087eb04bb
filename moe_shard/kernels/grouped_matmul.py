"""Grouped matmul: rows sorted by group, group g multiplied by its own matrix w[g].

    y[m] = x[m] @ w[g(m)]   for m < sum(group_sizes), where rows of group g are contiguous
    y[m] = 0                for m >= sum(group_sizes)

`BACKENDS` is the table of implementations, each `(x_MD, w_GDF, group_sizes_G, *, out_dtype,
max_tile, min_tile) -> [M, F]` (products accumulated in float32, the result written in
`out_dtype`), differentiable in x and w, doing only the routed FLOPs where it can. Where w is a
`quant.QuantizedArray` (frozen: differentiable in x only), `QUANTIZED_WEIGHTS` says how
each backend takes it:

  * "tiled" (`kernels/tiled.py`): power-of-two row tiles in group-major `while_loop`s, routed
    FLOPs plus bounded padding, forward and backward, on any platform. The CPU backend.
  * "megablox" (`kernels/tpu.py`): JAX's megablox Pallas kernels (gmm forward and dx, tgmm dw):
    routed FLOPs forward and backward, the TPU backend. bfloat16 and float32 only; other
    dtypes, and a single group, take "ragged_dot". A quantized w runs the project's own
    kernel on megablox's grid (`kernels/tpu_quant.py`), which decodes each block of w in
    VMEM. Named explicitly, it runs anywhere: off
    TPU in Pallas interpret mode (slow; for tests).
  * "mosaic_gpu" (`kernels/gpu.py`): Mosaic GPU Pallas kernels for Hopper, warp-specialized
    (`kernels/gpu_ws.py`; JAX's ragged_dot_mgpu kernels on request): routed FLOPs forward
    and backward, the CUDA backend. bfloat16 and float16 only (y rounded to x's dtype
    before the cast to `out_dtype`); other dtypes, float32 included, take "ragged_dot". It does the routed
    FLOPs where `lax.ragged_dot` on GPU does G times them, so the gap grows with G (measured
    on an H100 against `lax.ragged_dot` and a dense matmul: bench/results/gpu_h100_gmm.md,
    `python -m bench.gpu`). It runs only on a Hopper GPU; elsewhere it is only traced (see
    `PLATFORM_BACKENDS`).
  * "ragged_dot": `lax.ragged_dot`. Native on TPU (forward); on CPU and GPU XLA lowers it to
    a masked dense product over all G groups: G times the routed FLOPs and a `[G, M, ...]`
    temporary. On TPU its weight gradient is such a dense product too, so its FLOPs
    forward+backward grow with G (compiled for v5e: bench/results/gmm_tpu_v5e.md,
    `python -m bench.gmm_tpu`).

`PLATFORM_BACKENDS` maps a platform to the backend "auto" picks there, through
`lax.platform_dependent`, so the choice follows the platform the program is compiled for
(an ahead-of-time TPU compile on a CPU host takes the TPU entry); platforms not listed take
`DEFAULT_BACKEND`. A new backend is one function and one entry. `platform_dependent` traces
every branch it is given on every host, so every entry must trace anywhere (the Mosaic GPU
kernels do, inside shard_map and under a differentiated `lax.scan` over layers:
tests/test_gmm_gpu.py); "auto" gives it the CUDA branch only in a process with a CUDA
backend (`auto_backends`). The Pallas kernel modules are imported when their backend is
first traced (`kernel_module`): `import moe_shard` needs neither Pallas TPU nor Mosaic GPU.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax.extend import backend as jax_backend
from jax.typing import DTypeLike
from jaxtyping import Array, Float, Int

from moe_shard import _checks
from moe_shard.frozen import stop_gradient, zero_cotangent
from moe_shard.kernels.tiled import default_tiles, gmm_tiled, gmm_tiled_frozen, tile_sizes
from moe_shard.kernels.tokamax import tokamax_gmm
from moe_shard.kernels.tpu_tiling import DTYPES as MEGABLOX_DTYPES
from moe_shard.quant import check_quantized, is_quantized
from moe_shard.sharding import match_vma

# What each Pallas kernel module needs beyond jax, named when its import fails.
_KERNEL_EXTRAS = {"gpu": "moe_shard[gpu]"}


def kernel_module(name):
  """The kernel module `moe_shard.kernels.<name>` ("tpu", "tpu_quant", "gpu"), imported when
  a backend is first traced, so that `import moe_shard` imports none of moe_shard's kernel
  modules (nor `jax.experimental.pallas.tpu` or `jax.experimental.mosaic.gpu`), and what a
  platform's kernels import (absl-py for Mosaic GPU) is needed only where they are used.

  Raises:
    ImportError: a module the kernels import is missing, naming it and the extra to install.
  """
  try:
    return importlib.import_module(f"moe_shard.kernels.{name}")
  except ModuleNotFoundError as err:
    extra = _KERNEL_EXTRAS.get(name)
    fix = f"pip install '{extra}'" if extra else "it ships with jax's Pallas: check the jax install"
    raise ImportError(
      f"grouped_matmul: the kernels of moe_shard.kernels.{name} import {err.name!r}, which "
      f"is not installed ({fix})"
    ) from err


def tiled(x_MD, w_GDF, group_sizes_G, *, out_dtype, max_tile=None, min_tile=None):
  """The "tiled" backend (`gmm_tiled`); tile sizes default to `default_tiles(M, G)`. A
  quantized w (`gmm_tiled_frozen`) is dequantized one group at a time in the group loop."""
  M, G = x_MD.shape[0], w_GDF.shape[0]
  tiles = tile_sizes(M, *_tiles_or_default(M, G, max_tile, min_tile))
  gmm = gmm_tiled_frozen if is_quantized(w_GDF) else gmm_tiled
  # JAX types a custom_vjp made with functools.partial as returning object.
  y_MF = gmm(x_MD, w_GDF, group_sizes_G, tiles)
  return y_MF.astype(out_dtype)  # pyright: ignore[reportAttributeAccessIssue]


def ragged_dot(x_MD, w_GDF, group_sizes_G, *, out_dtype, **_):
  """The "ragged_dot" backend: `lax.ragged_dot`, accumulating in float32 and writing
  `out_dtype` directly (its backward then writes dx and dw in the inputs' dtype too).

  A quantized w is dequantized whole first: correct, but it saves no memory (the float copy
  of every group's matrix exists while the product runs).
  """
  w_GDF = _dequantized(w_GDF, x_MD.dtype)
  return jax.lax.ragged_dot(x_MD, w_GDF, group_sizes_G, preferred_element_type=out_dtype)


def megablox(x_MD, w_GDF, group_sizes_G, *, out_dtype, **_):
  """The "megablox" backend: megablox's kernels on TPU, interpreted elsewhere. The kernels
  write `out_dtype` themselves (f32 accumulators inside).

  One group (G = 1, e.g. one expert per device) takes `lax.ragged_dot`: with a single group
  its gradient is no denser than it must be, and it accesses fewer HBM bytes than megablox,
  which re-reads w for every row tile (compiled for v5e: bench/results/gmm_tpu_v5e.md).
  """
  if is_quantized(w_GDF):
    return _megablox_quantized(x_MD, w_GDF, group_sizes_G, out_dtype)
  if x_MD.dtype not in MEGABLOX_DTYPES or w_GDF.shape[0] == 1:
    return ragged_dot(x_MD, w_GDF, group_sizes_G, out_dtype=out_dtype)

  megablox_gmm = kernel_module("tpu").megablox_gmm

  def run(interpret):
    return lambda x, w, gs: megablox_gmm(
      x, w, gs, preferred_element_type=out_dtype, interpret=interpret
    )

  return jax.lax.platform_dependent(x_MD, w_GDF, group_sizes_G, tpu=run(False), default=run(True))


def _megablox_quantized(x_MD, w_GDF, group_sizes_G, out_dtype):
  """megablox's grid with a quantized w: `kernels.tpu_quant`, which decodes each block of
  w in VMEM (no float copy of w), forward and (w frozen) dx; x in bfloat16 or float32."""
  if x_MD.dtype not in MEGABLOX_DTYPES:
    return ragged_dot(x_MD, w_GDF, group_sizes_G, out_dtype=out_dtype)

  def run(interpret):
    def call(x, values, scales, gs):
      w = dataclasses.replace(w_GDF, values=values, scales=scales)
      return frozen_quantized_gmm(x, w, gs, out_dtype, interpret)

    return call

  args = (x_MD, w_GDF.values, w_GDF.scales, group_sizes_G)
  return jax.lax.platform_dependent(*args, tpu=run(False), default=run(True))


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def frozen_quantized_gmm(x_MD, w_GDF, group_sizes_G, out_dtype, interpret):
  """`quantized_gmm` differentiable in x: dx = dy @ w^T by the transposed kernel; w's
  cotangent is zero (quantized matrices are frozen)."""
  return kernel_module("tpu_quant").quantized_gmm(
    x_MD, w_GDF, group_sizes_G, preferred_element_type=out_dtype, interpret=interpret
  )


def _frozen_fwd(x_MD, w_GDF, group_sizes_G, out_dtype, interpret):
  y = frozen_quantized_gmm(x_MD, w_GDF, group_sizes_G, out_dtype, interpret)
  return y, (jnp.zeros((), x_MD.dtype), w_GDF, group_sizes_G)  # a scalar: x's dtype


def _frozen_bwd(out_dtype, interpret, res, dy_MF):
  x_0, w_GDF, group_sizes_G = res
  x_dtype = x_0.dtype
  dx_MD = kernel_module("tpu_quant").quantized_gmm(
    dy_MF.astype(x_dtype),
    w_GDF,
    group_sizes_G,
    transpose_rhs=True,
    preferred_element_type=x_dtype,
    interpret=interpret,
  )
  return dx_MD, zero_cotangent(w_GDF), None


frozen_quantized_gmm.defvjp(_frozen_fwd, _frozen_bwd)


def mosaic_gpu(x_MD, w_GDF, group_sizes_G, *, out_dtype, **_):
  """The "mosaic_gpu" backend: JAX's Mosaic GPU kernels (`kernels.gpu`; Hopper, sm_90a) for
  bfloat16 and float16; other dtypes (float32) take "ragged_dot". The kernels write x's
  dtype (f32 accumulators inside), then cast to `out_dtype`.
  """
  gpu = kernel_module("gpu")
  if x_MD.dtype not in gpu.DTYPES:
    return ragged_dot(x_MD, w_GDF, group_sizes_G, out_dtype=out_dtype)
  w_GDF = _dequantized(w_GDF, x_MD.dtype)
  return gpu.mosaic_gpu_gmm(x_MD, w_GDF, group_sizes_G, preferred_element_type=out_dtype)


def _dequantized(w_GDF, dtype):
  """w as a float array: a `QuantizedArray` dequantized whole (frozen), floats as they are."""
  return jax.lax.stop_gradient(w_GDF.dequantize(dtype)) if is_quantized(w_GDF) else w_GDF


BACKENDS: dict[str, Callable[..., Array]] = {
  "megablox": megablox,
  "mosaic_gpu": mosaic_gpu,
  "ragged_dot": ragged_dot,
  "tiled": tiled,
  "tokamax": tokamax_gmm,  # tokamax.ragged_dot; needs `pip install tokamax`
}
# TPU takes megablox (one group: lax.ragged_dot). `platform_dependent` traces its branch on
# every host; megablox's group metadata would fail shard_map's varying-axes check when JAX
# transforms a `lax.scan` over layers (scan-over-layers training), so the dispatches' own
# shard_maps run without that check (`parallel.common.shard_map`). Inside a user's own
# shard_map with the check on, under such a scan, pass gmm_impl="ragged_dot".
# CUDA takes "mosaic_gpu": its kernels trace on any host (off a GPU its dw traces as
# lax.ragged_dot_general, see kernels/gpu.py), in shard_map and in scan-over-layers training.
# "auto" traces the CUDA branch only in a process with a CUDA backend (`auto_backends`).
# How each backend takes a quantized w (`quant.QuantizedArray`); a backend not listed raises.
# "blocks": a block or group at a time, no float copy of the whole w; "whole": dequantized
# whole first, correct but saving no memory.
QUANTIZED_WEIGHTS = {
  "megablox": "blocks",
  "mosaic_gpu": "whole",
  "ragged_dot": "whole",
  "tiled": "blocks",
}
PLATFORM_BACKENDS = {"tpu": "megablox", "cuda": "mosaic_gpu"}
DEFAULT_BACKEND = "tiled"
GMM_CHOICES = ("auto", *BACKENDS)
# Platforms whose branch "auto" builds only where this process has a backend for them.
# `platform_dependent` traces every branch it is given, lowered or not, and the Mosaic GPU
# branch is the costliest to trace (and needs absl-py). TPU's branch is always built: TPU
# programs are compiled ahead of time on CPU hosts, with no TPU backend in the process.
WHERE_PRESENT = ("cuda",)


def auto_backends() -> dict[str, str]:
  """The `PLATFORM_BACKENDS` entries "auto" builds a branch for in this process: all of
  them but those of `WHERE_PRESENT` whose platform has no backend here (a program lowered
  for such a platform takes `DEFAULT_BACKEND`, or name the backend with `impl`)."""
  present = jax_backend.backends()
  return {p: n for p, n in PLATFORM_BACKENDS.items() if p not in WHERE_PRESENT or p in present}


def grouped_matmul(
  x_MD: Float[Array, "M D"],
  w_GDF: Float[Array, "G D F"],
  group_sizes_G: Int[Array, " G"],
  *,
  impl: str = "auto",
  preferred_element_type: DTypeLike | None = None,
  max_tile: int | None = None,
  min_tile: int | None = None,
) -> Float[Array, "M F"]:
  """Multiplies each group of rows by its group's matrix.

  Args:
    x_MD: f[M, D] rows sorted by group.
    w_GDF: f[G, D, F] one matrix per group (cast to the dtype of `x_MD`).
    group_sizes_G: int[G] rows per group; rows past `sum(group_sizes_G)` give zeros.
    impl: "auto" (default; the backend of the platform compiled for, `PLATFORM_BACKENDS`,
      else `DEFAULT_BACKEND`) or a name of `BACKENDS` ("megablox", "mosaic_gpu",
      "ragged_dot", "tiled").
    preferred_element_type: output dtype (default: the dtype of `x_MD`). Products always
      accumulate in float32.
    max_tile, min_tile: tile sizes of "tiled", powers of two (default None: from
      `default_tiles(M, G)`: 256, and 32 or less so that G * (min_tile - 1) <= M / 4).
      Rows computed are at most M + G * (min_tile - 1).

  Returns:
    y_MF: [M, F] in `preferred_element_type`.

  Raises:
    TypeError: non-float `x_MD`/`w_GDF`, non-integer `group_sizes_G` or tile sizes.
    ValueError: bad ranks, mismatched D or G, unknown `impl`, tile sizes that are not
      powers of two.
  """
  fn = "grouped_matmul"
  x_MD = _checks.float_array(fn, "x_MD", x_MD, ndim=2)
  quantized = is_quantized(w_GDF)
  if quantized:
    _check_quantized(fn, w_GDF, impl)
  else:
    w_GDF = _checks.float_array(fn, "w_GDF", w_GDF, ndim=3)
  group_sizes_G = _checks.int_array(fn, "group_sizes_G", group_sizes_G)
  _checks.choice_field(fn, "impl", impl, GMM_CHOICES)
  if x_MD.shape[1] != w_GDF.shape[1]:
    raise ValueError(f"{fn}: w_GDF's D ({w_GDF.shape[1]}) must equal x_MD's D ({x_MD.shape[1]})")
  if group_sizes_G.shape != (w_GDF.shape[0],):
    raise ValueError(
      f"{fn}: group_sizes_G must have shape ({w_GDF.shape[0]},), one per "
      f"group of w_GDF (got {tuple(group_sizes_G.shape)})"
    )
  # Checked here, at trace time, for every backend (a platform branch is traced lazily).
  tile_sizes(x_MD.shape[0], *_tiles_or_default(x_MD.shape[0], w_GDF.shape[0], max_tile, min_tile))
  out_dtype = jnp.dtype(x_MD.dtype if preferred_element_type is None else preferred_element_type)
  group_sizes_G = group_sizes_G.astype(jnp.int32)
  if quantized:
    w = stop_gradient(w_GDF)
    x_MD, values, scales, group_sizes_G = match_vma(x_MD, w.values, w.scales, group_sizes_G)
    w_GDF = dataclasses.replace(w, values=values, scales=scales)
  else:
    x_MD, w_GDF, group_sizes_G = match_vma(x_MD, w_GDF.astype(x_MD.dtype), group_sizes_G)

  def backend(name):
    return lambda x, w, gs: BACKENDS[name](
      x, w, gs, out_dtype=out_dtype, max_tile=max_tile, min_tile=min_tile
    )

  if impl != "auto":
    y = backend(impl)(x_MD, w_GDF, group_sizes_G)
  else:
    y = jax.lax.platform_dependent(
      x_MD,
      w_GDF,
      group_sizes_G,
      default=backend(DEFAULT_BACKEND),
      **{platform: backend(name) for platform, name in auto_backends().items()},
    )
  return y


def _check_quantized(fn, w_GDF, impl):
  """Raises unless a quantized w is [G, D, F] with the values and scales of its format and
  every backend `impl` may run takes it."""
  check_quantized(fn, "w_GDF", w_GDF)
  if len(w_GDF.shape) != 3:
    raise ValueError(f"{fn}: w_GDF must be 3-D (got shape {tuple(w_GDF.shape)})")
  names = (DEFAULT_BACKEND, *auto_backends().values()) if impl == "auto" else (impl,)
  for name in names:
    if name in BACKENDS and name not in QUANTIZED_WEIGHTS:
      raise ValueError(
        f"{fn}: w_GDF is a QuantizedArray ({w_GDF.fmt!r}), which impl {name!r} cannot take; "
        f"use one of {tuple(QUANTIZED_WEIGHTS)}"
      )


def _tiles_or_default(M, G, max_tile, min_tile):
  default_max, default_min = default_tiles(M, G)
  if max_tile is None:
    max_tile = default_max if min_tile is None else max(default_max, min_tile)
  if min_tile is None:
    min_tile = min(default_min, max_tile)
  return max_tile, min_tile
