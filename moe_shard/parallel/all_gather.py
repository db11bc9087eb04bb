"""`moe_all_gather`: all_gather the tokens, compute the local experts, reduce-scatter."""

from __future__ import annotations

import functools
from typing import Any, Literal, overload

import jax
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import AbstractMesh, Mesh
from jax.sharding import PartitionSpec as P
from jaxtyping import Array, Float, Int

from moe_shard import _checks, local
from moe_shard.balance import expert_load
from moe_shard.experts import ExpertFFN
from moe_shard.parallel.common import _prepare, gather_weights, output_once, shard_map
from moe_shard.parallel.replicas import check_dispatch_placement, slot_inputs
from moe_shard.placement import Placement
from moe_shard.remat import MOE_DISPATCH_RECV
from moe_shard.sharding import EXPERT, expert_axes, resolve_mesh, trim, vary_over

# --------------------------------------------------------------------------- all_gather


@overload
def moe_all_gather(
  x_TD: Float[Array, "T D"],
  w: Float[Array, "E D F"] | ExpertFFN,
  experts: Int[Array, "T K"] | Int[Array, " T"],
  weights: Float[Array, "T K"] | Float[Array, " T"] | None = None,
  *,
  mesh: Mesh | AbstractMesh | None = None,
  expert_axis: str | tuple[str, ...] = EXPERT,
  gmm_impl: str = "auto",
  expert_tensor_axis: str | None = None,
  expert_fsdp_axis: str | None = None,
  placement: Placement | None = None,
  slot_weights: bool = False,
  return_stats: Literal[False] = False,
) -> Float[Array, "T F"]: ...
@overload
def moe_all_gather(
  x_TD: Float[Array, "T D"],
  w: Float[Array, "E D F"] | ExpertFFN,
  experts: Int[Array, "T K"] | Int[Array, " T"],
  weights: Float[Array, "T K"] | Float[Array, " T"] | None = None,
  *,
  mesh: Mesh | AbstractMesh | None = None,
  expert_axis: str | tuple[str, ...] = EXPERT,
  gmm_impl: str = "auto",
  expert_tensor_axis: str | None = None,
  expert_fsdp_axis: str | None = None,
  placement: Placement | None = None,
  slot_weights: bool = False,
  return_stats: Literal[True],
) -> tuple[Float[Array, "T F"], dict[str, Any]]: ...
def moe_all_gather(
  x_TD: Float[Array, "T D"],
  w: Float[Array, "E D F"] | ExpertFFN,
  experts: Int[Array, "T K"] | Int[Array, " T"],
  weights: Float[Array, "T K"] | Float[Array, " T"] | None = None,
  *,
  mesh: Mesh | AbstractMesh | None = None,
  expert_axis: str | tuple[str, ...] = EXPERT,
  gmm_impl: str = "auto",
  expert_tensor_axis: str | None = None,
  expert_fsdp_axis: str | None = None,
  placement: Placement | None = None,
  slot_weights: bool = False,
  return_stats: bool = False,
) -> Float[Array, "T F"] | tuple[Float[Array, "T F"], dict[str, Any]]:
  """Expert-parallel MoE: all_gather tokens, compute local experts, reduce-scatter.

  Each device gathers the tokens, expert ids and weights of the N devices on its expert
  axis, runs its L = E / N experts on the items routed to them (sort + grouped matmul), and
  a reduce-scatter sums the N partial outputs of each token on the device that owns it.
  Moves about (N - 1) * T * (D + F) elements per device: best when K >= N.

  Args:
    x_TD: f[T, D] tokens (global shape; split over every mesh axis inside).
    w: f[E, D, F], or an expert-FFN pytree with the expert axis first (split over
      `expert_axis`, replicated over the other axes).
    experts: int[T] or int[T, K] expert ids; ids outside [0, E) contribute zero.
    weights: f[T, K] combine weights (the shape of `experts`), or None for ones (default).
    mesh: a `jax.sharding.Mesh` with `expert_axis`; Auto or Explicit axis types. Inputs are
      placed (resharded) on it as needed. An `AbstractMesh` works under `jax.jit` with
      inputs already on the mesh, and under `jax.eval_shape`. None (default): the mesh in
      scope (`jax.set_mesh(mesh)`); without one, ValueError.
    expert_axis: name of the mesh axis experts are split over (default "expert"), or a
      tuple of names: experts split over the product of their sizes, in the order given.
    gmm_impl: `grouped_matmul` implementation (default "auto").
    expert_tensor_axis: None (default) or a mesh axis splitting every F (hidden) dimension
      of `w` (`MoEConfig.expert_tensor_axis`): the tokens are gathered over the expert axis
      and this one, and the partial outputs reduce-scattered over both in one collective.
    expert_fsdp_axis: None (default) or a mesh axis splitting the last dimension of every
      matrix of `w` (`MoEConfig.expert_fsdp_axis`): all-gathered once per call.
    placement: None (default) or a one-layer `Placement` of the E experts over S slots:
      each item goes to a replica of its expert (`replica_rule.choose_replicas`: one on its
      own device first, else spread evenly), computed by the device holding that slot. `w`
      holds the E logical experts, whose slots' weights are fetched from their owners
      inside the call (their gradients summed back), or, with `slot_weights`, the S slots.
    slot_weights: whether `w` holds the placement's slots (default False).
    return_stats: also return a dict of statistics (default False).

  Returns:
    y_TF: f[T, F] in the dtype of `x_TD`, split over the mesh like the tokens; with
    `return_stats`, `(y_TF, stats)` where stats holds `expert_load` (i32[E]: valid items
    per expert) and, with a placement, `slot_load` (i32[S]: items each slot computed, as
    the devices split the tokens).

  Raises:
    TypeError, ValueError: bad arguments, no mesh (none given and none in scope), or E not
      divisible by the expert-axis size.
  """
  expert_axis = _checks.expert_axis_field("moe_all_gather", expert_axis)
  mesh = resolve_mesh("moe_all_gather", mesh, expert_axis, required=True)
  placement, grad_rows = check_dispatch_placement(
    "moe_all_gather", placement, w, mesh, expert_axis, slot_weights
  )
  y_TF, stats = _all_gather_jit(
    x_TD,
    w,
    experts,
    weights,
    mesh=mesh,
    expert_axis=expert_axis,
    gmm_impl=gmm_impl,
    tensor_axis=expert_tensor_axis,
    fsdp_axis=expert_fsdp_axis,
    placement=placement,
    slot_weights=bool(slot_weights),
    grad_rows=grad_rows,
  )
  return (y_TF, stats) if return_stats else y_TF


@functools.partial(
  jax.jit,
  static_argnames=(
    "mesh",
    "expert_axis",
    "gmm_impl",
    "tensor_axis",
    "fsdp_axis",
    "slot_weights",
    "grad_rows",
  ),
)
def _all_gather_jit(
  x_TD,
  w,
  experts,
  weights,
  *,
  mesh,
  expert_axis,
  gmm_impl,
  tensor_axis,
  fsdp_axis,
  placement,
  slot_weights,
  grad_rows,
):
  # Jitted so that a call outside jit does not run the shard_map body op by op.
  lay, x_TD, ffn, experts_TK, weights_TK = _prepare(
    "moe_all_gather", x_TD, w, experts, weights, mesh, expert_axis, tensor_axis, fsdp_axis
  )
  body = functools.partial(
    _all_gather_body, lay=lay, gmm_impl=gmm_impl, slot_weights=slot_weights, grad_rows=grad_rows
  )
  tok = lay.token_spec
  args, specs = (x_TD, ffn, experts_TK, weights_TK), (tok, lay.ffn_specs(ffn), tok, tok)
  stats_specs = dict(expert_load=P())
  if placement is not None:
    args, specs = args + (placement,), specs + (jax.tree.map(lambda _: P(), placement),)
    stats_specs = dict(stats_specs, slot_load=P())
  y_TF, stats = shard_map(body, mesh, in_specs=specs, out_specs=(tok, stats_specs))(*args)
  return trim(y_TF, mesh, lay.tokens), stats


def _all_gather_body(
  x_TD, ffn_L, experts_TK, weights_TK, *placement, lay, gmm_impl, slot_weights, grad_rows
):
  # Per-device sizes: T tokens of this device, L = E / N local experts (with a placement:
  # E = S slots, L = S / N of them here, and the ids are slot ids).
  if placement:
    lay, ffn_L, experts_TK, stats = slot_inputs(
      lay, placement[0], ffn_L, experts_TK, slot_weights=slot_weights, grad_rows=grad_rows
    )
  else:
    stats = dict(expert_load=jax.lax.psum(expert_load(experts_TK, lay.num_experts), lay.all_axes))
  axis = lay.expert_axis
  L = lay.num_experts // lay.n
  ffn_L = vary_over(
    output_once(gather_weights(ffn_L, lay.fsdp_axis), lay.tensor_axis), lay.other_axes
  )
  # Every device receives the tokens, ids and weights of all N devices on its expert axis
  # (and on its tensor axis: each holds a slice of F of its experts, for every token).
  axes = expert_axes(axis) + ((lay.tensor_axis,) if lay.tensor_axis else ())
  with jax.named_scope("all_gather"):
    x_MD, experts_MK, weights_MK = (
      jax.lax.all_gather(a, axes, axis=0, tiled=True) for a in (x_TD, experts_TK, weights_TK)
    )
    x_MD = checkpoint_name(x_MD, MOE_DISPATCH_RECV)
  with jax.named_scope("local_experts"):
    local_MK = experts_MK - jax.lax.axis_index(axis) * L  # outside [0, L): not ours, zero
    y_MF = local.ragged_combine(x_MD, ffn_L, L, local_MK, weights_MK, gmm_impl)
  # Each device receives, summed over the N (x tensor) devices, the partial outputs of its
  # own tokens.
  with jax.named_scope("reduce_scatter"):
    y_TF = jax.lax.psum_scatter(y_MF.astype(x_TD.dtype), axes, scatter_dimension=0, tiled=True)
  return y_TF, stats
