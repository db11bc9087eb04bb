"""The dispatch table: how tokens reach their experts and come back.

A dispatch is a function

    dispatch(x_TD, ffn, experts_TK, weights_TK, *, mesh, cfg) -> (y_TD, stats)

  x_TD: f[T, D] tokens (the compute dtype); ffn: the expert FFN, expert axis first;
  experts_TK: i32[T, K] expert ids (outside [0, E): contributes zero); weights_TK: f32[T, K];
  mesh: a `jax.sharding.Mesh` or None; cfg: the `MoEConfig`.
  y_TD: f[T, F] = sum_j weights[t, j] * ffn(experts[t, j], x[t]); stats: a dict of
  dispatch statistics (possibly empty), merged into the layer's `aux`.

`DISPATCHES` maps a name to a `Dispatch` (the function and whether it needs a mesh);
`MoEConfig(impl=...)` takes a name from it or any function of the signature above. A new
dispatch is one function and one entry.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import jax
from jax.sharding import AbstractMesh, Mesh
from jaxtyping import Array, Float

from moe_shard import local, parallel
from moe_shard.sharding import auto, axis_size

if TYPE_CHECKING:  # config.py imports this module
  from moe_shard.config import MoEConfig

# A dispatch function: (x_TD, ffn, experts_TK, weights_TK, *, mesh, cfg) -> (y_TF, stats).
DispatchFn = Callable[..., tuple[Float[Array, "T F"], dict[str, Any]]]


def masked_scan(x_TD, ffn, experts_TK, weights_TK, *, mesh, cfg):
  """`moe_masked_scan` (XLA shards it as it likes on a mesh)."""
  del mesh, cfg
  fn = auto(local.moe_masked_scan, x_TD, lambda spec: spec)
  return fn(x_TD, ffn, experts_TK, weights_TK), {}


def ragged_dot(x_TD, ffn, experts_TK, weights_TK, *, mesh, cfg):
  """`moe_ragged_dot` with `cfg.gmm_impl` (XLA shards it as it likes on a mesh)."""
  del mesh
  fn = auto(functools.partial(local.moe_ragged_dot, gmm_impl=cfg.gmm_impl), x_TD, lambda spec: spec)
  return fn(x_TD, ffn, experts_TK, weights_TK), {}


def all_gather(x_TD, ffn, experts_TK, weights_TK, *, mesh, cfg):
  """`moe_all_gather` over `cfg.expert_axis`."""
  return parallel.moe_all_gather(
    x_TD,
    ffn,
    experts_TK,
    weights_TK,
    mesh=mesh,
    expert_axis=cfg.expert_axis,
    gmm_impl=cfg.gmm_impl,
    expert_tensor_axis=cfg.expert_tensor_axis,
    expert_fsdp_axis=cfg.expert_fsdp_axis,
  ), {}


def all_to_all(x_TD, ffn, experts_TK, weights_TK, *, mesh, cfg):
  """`moe_all_to_all` over `cfg.expert_axis`; stats: rounds, items sent, invalid ids."""
  return parallel.moe_all_to_all(
    x_TD,
    ffn,
    experts_TK,
    weights_TK,
    mesh=mesh,
    expert_axis=cfg.expert_axis,
    chunk_size=cfg.chunk_size,
    return_stats=True,
    gmm_impl=cfg.gmm_impl,
    expert_tensor_axis=cfg.expert_tensor_axis,
    expert_fsdp_axis=cfg.expert_fsdp_axis,
  )


def ragged_all_to_all(x_TD, ffn, experts_TK, weights_TK, *, mesh, cfg):
  """`moe_ragged_all_to_all` over `cfg.expert_axis` (receive buffer `cfg.recv_capacity`);
  stats: rounds, items sent and received, invalid ids."""
  return parallel.moe_ragged_all_to_all(
    x_TD,
    ffn,
    experts_TK,
    weights_TK,
    mesh=mesh,
    expert_axis=cfg.expert_axis,
    recv_capacity=cfg.recv_capacity,
    return_stats=True,
    gmm_impl=cfg.gmm_impl,
    expert_tensor_axis=cfg.expert_tensor_axis,
    expert_fsdp_axis=cfg.expert_fsdp_axis,
  )


@dataclasses.dataclass(frozen=True)
class Dispatch:
  """An entry of the dispatch table.

  Attributes:
    fn: the dispatch function (signature in the module docstring).
    needs_mesh: it splits experts over the mesh's expert axis (a mesh is required).
  """

  fn: DispatchFn
  needs_mesh: bool = False


DISPATCHES: dict[str, Dispatch] = {
  "masked_scan": Dispatch(masked_scan),
  "ragged_dot": Dispatch(ragged_dot),
  "all_gather": Dispatch(all_gather, needs_mesh=True),
  "all_to_all": Dispatch(all_to_all, needs_mesh=True),
  "ragged_all_to_all": Dispatch(ragged_all_to_all, needs_mesh=True),
}


def choose_impl(cfg: MoEConfig, mesh: Mesh | AbstractMesh | None = None) -> str | DispatchFn:
  """Resolves `cfg.impl` for a mesh.

  Args:
    cfg: `MoEConfig`.
    mesh: None (default) or a `jax.sharding.Mesh`.

  Returns:
    `cfg.impl` unless it is "auto" (a name of `DISPATCHES`, or the user's function); for
    "auto", when the mesh's `cfg.expert_axis` has more than one device,
    "ragged_all_to_all" if the mesh's devices are TPUs or GPUs (XLA has ragged-all-to-all
    there) and "all_to_all" otherwise (CPU); "ragged_dot" without such a mesh. The
    platform is the mesh's devices' (`jax.default_backend()` says "cpu" on a CPU host
    compiling ahead of time for TPU devices).
  """
  if cfg.impl != "auto":
    return cfg.impl
  if mesh is not None and axis_size(mesh, cfg.expert_axis) > 1:
    ragged = _platform(mesh) in parallel.RAGGED_PLATFORMS
    return "ragged_all_to_all" if ragged else "all_to_all"
  return "ragged_dot"


def _platform(mesh):
  """The platform of a mesh's devices in `lax.platform_dependent`'s names ("tpu", "cuda",
  "rocm", "cpu", ...); for an AbstractMesh, which has no devices, the default device's."""
  try:
    device = mesh.devices.flat[0]
  except (AttributeError, IndexError, TypeError, ValueError):
    device = jax.devices()[0]
  platform = device.platform.lower()
  if platform == "gpu":  # a device says "gpu" for CUDA and ROCm alike; its client tells which
    version = device.client.platform_version.lower()
    platform = next((p for p in ("cuda", "rocm") if p in version), platform)
  return platform


def get_dispatch(impl: str | DispatchFn) -> Dispatch:
  """The `Dispatch` of a resolved impl: a table entry, or a user's function (no mesh rule)."""
  return DISPATCHES[impl] if isinstance(impl, str) else Dispatch(impl)
