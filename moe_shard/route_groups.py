"""The router run on the tokens of a call: per routing group, token-parallel on a mesh.

`num_routing_groups` says how many runs of consecutive tokens a router sees on their own
(one per device on a mesh, by default), and `route` runs the router of `MoEConfig.router`
on each, under `shard_map` over the tokens where the mesh divides them (no
communication), else on the whole array.
"""

from __future__ import annotations

import functools

import jax
from jax.sharding import AbstractMesh, Mesh
from jax.sharding import PartitionSpec as P

from moe_shard import _checks
from moe_shard.config import MoEConfig
from moe_shard.routing import Routing, get_router, route_in_groups
from moe_shard.sharding import auto, place, token_spec


def num_routing_groups(
  cfg: MoEConfig, num_tokens: int, mesh: Mesh | AbstractMesh | None = None
) -> int:
  """Returns G, the routing groups of a call: runs of consecutive tokens routed on their own.

  A router sees the tokens of one group at a time (`routing.route_in_groups`). Top-k is per
  token, so G changes nothing there; expert choice ranks each group's tokens on its own, so
  its result depends on G. `cfg.routing_groups` when set; by default (None) one group per
  device on a mesh whose size divides the tokens (the router then runs per device, with no
  communication), else 1 (all the tokens of the call). Group g is tokens [g*T/G, (g+1)*T/G)
  of the flattened `x_BSD` (batch-major), which on a mesh is the g-th device's share of the
  tokens, in the order of the mesh's devices. So a mesh result is reproduced on one device by
  `routing_groups=mesh.size`.

  Args:
    cfg: `MoEConfig`.
    num_tokens: T, the tokens of the call (B * S).
    mesh: None (default) or the layer's mesh.

  Returns:
    int G, dividing T.

  Raises:
    ValueError: `cfg.routing_groups` does not divide T.
  """
  if cfg.routing_groups is not None:
    _checks.divisible("moe_layer", "tokens B*S", num_tokens, "routing_groups", cfg.routing_groups)
    return cfg.routing_groups
  if mesh is not None and num_tokens % mesh.size == 0:
    return mesh.size
  return 1


def route(logits_TE, cfg, mesh=None, bias_E=None):
  """Runs the router of `cfg.router` on each routing group, token-parallel on a mesh.

  XLA's partitioner all-gathers the input of TopK (every device would route all T tokens),
  so on a mesh whose size divides T and the number of groups G (`num_routing_groups`) the
  router runs under `shard_map` over the tokens instead, G / mesh.size groups per device:
  no communication. Otherwise it runs on the whole [T, E] array, a vmap over groups.

  Args:
    logits_TE: f32[T, E] router logits.
    cfg: `MoEConfig` (router, top_k, normalize_top_k, ...).
    mesh: None (default) or the layer's mesh.
    bias_E: None (default) or f32[E] selection bias (`bias_balancing`), passed to the router.

  Returns:
    `Routing`, split over every mesh axis when on a mesh that divides T.
  """
  T = logits_TE.shape[0]
  G = num_routing_groups(cfg, T, mesh)
  kwargs = {} if bias_E is None else dict(bias_E=bias_E)
  if mesh is not None and T % mesh.size == 0 and G % mesh.size == 0:
    router = _token_parallel_router(cfg, mesh, G // mesh.size, bias_E is not None)
    return router(
      place(logits_TE, mesh, token_spec(mesh)),
      *([] if bias_E is None else [place(bias_E, mesh, P())]),
    )
  router = functools.partial(route_in_groups, get_router(cfg.router), cfg=cfg, groups=G, **kwargs)
  if G == 1:
    return router(logits_TE)
  # Groups of a token-split array: let XLA choose the shardings of the reshape and the sort.
  # Routing(spec, spec, spec): a pytree of PartitionSpecs, the specs of a Routing's leaves.
  return auto(router, logits_TE, lambda spec: Routing(spec, spec, spec))(logits_TE)  # pyright: ignore[reportArgumentType]


@functools.lru_cache(maxsize=64)
def _token_parallel_router(cfg, mesh, groups_per_device, with_bias):
  """The router of one (config, mesh) under shard_map, built once (no re-trace per call)."""
  tok = token_spec(mesh)
  router = get_router(cfg.router)

  def body(logits_TE, *bias_E):  # per device: T / mesh.size tokens
    kwargs = dict(bias_E=bias_E[0]) if with_bias else {}
    return route_in_groups(router, logits_TE, cfg, groups_per_device, **kwargs)

  in_specs = (tok, P()) if with_bias else (tok,)
  # out_specs: a Routing of PartitionSpecs, one per leaf.
  return jax.jit(
    jax.shard_map(body, mesh=mesh, in_specs=in_specs, out_specs=Routing(tok, tok, tok))  # pyright: ignore[reportArgumentType]
  )
