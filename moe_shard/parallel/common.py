"""The layout of an expert-parallel call: its static facts, input checks and placement."""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import PartitionSpec as P

from moe_shard import _checks, local
from moe_shard.experts import split_dims
from moe_shard.matmuls import GroupedMatmul, MaskedMatmul
from moe_shard.quant import expand, is_quantized
from moe_shard.remat import MOE_DISPATCH_RECV
from moe_shard.sharding import (
  axis_size,
  check_mesh,
  expert_axes,
  place,
  split_axis_size,
  token_spec,
  trim,
)


@dataclasses.dataclass(frozen=True)
class _Layout:
  """Static facts about a call: mesh, axes and sizes."""

  mesh: jax.sharding.Mesh | jax.sharding.AbstractMesh
  expert_axis: str | tuple[str, ...]  # a tuple: experts split over the product, in order
  num_experts: int  # E
  tokens: int  # T before padding
  padded: int  # T after padding to a multiple of the device count
  tensor_axis: str | None = None  # each expert's F split over it (expert tensor parallelism)
  fsdp_axis: str | None = None  # each matrix's last dimension stored split over it (FSDP)

  @property
  def all_axes(self):
    return tuple(self.mesh.axis_names)

  @property
  def other_axes(self):
    """Axes that split no weight, of size > 1: the expert weights are replicated over them,
    so their gradients are summed there (over an axis of size 1 there is nothing to sum)."""
    split = expert_axes(self.expert_axis) + (self.tensor_axis, self.fsdp_axis)
    return tuple(a for a in self.mesh.axis_names if a not in split and self.mesh.shape[a] > 1)

  @property
  def n(self):
    return axis_size(self.mesh, self.expert_axis)

  def ffn_specs(self, ffn):
    """shard_map specs of the expert weights (a pytree like `ffn`): axis 0 split over the
    expert axes, then over the other axes of size 1; every F over the tensor axis and each
    matrix's last dimension over the FSDP axis (`split_specs`). Naming the size-1 axes changes no layout, but
    shard_map (with check_vma off) transposes a replicated input into a psum over the axes
    its spec leaves out: one all-reduce copying every weight gradient even over an axis of
    size 1."""
    split = expert_axes(self.expert_axis)
    first = split + tuple(
      a
      for a in self.mesh.axis_names
      if a not in split + self.other_axes + (self.tensor_axis, self.fsdp_axis)
    )
    return split_specs(ffn, first, self.tensor_axis, self.fsdp_axis)

  @property
  def token_spec(self):
    return token_spec(self.mesh)


def split_specs(ffn, first, tensor_axis, fsdp_axis):
  """`PartitionSpec`s of an FFN's leaves (a pytree like `ffn`): axis 0 over `first`, every F
  (hidden) dimension over `tensor_axis`, and the last dimension of every matrix (rank-3
  leaf: F of gate and up, D of down) over `fsdp_axis`, after the tensor axis where both
  split it (`P("expert", None, ("tensor", "data"))`).

  FSDP splits each matrix's last dimension because that is the one XLA:TPU reduce-scatters
  the gradient over: it turns a reduce-scatter over the second-to-last dimension of a
  [D, F] gradient into an all-reduce (twice the bytes) and a slice (libtpu 0.0.42.1, v5p).
  """
  if tensor_axis is None and fsdp_axis is None:
    return jax.tree.map(lambda a: P(first, *[None] * (len(a.shape) - 1)), ffn)
  letters, _ = split_dims("split_specs", ffn)

  def spec(ls):
    dims = [tensor_axis if c == "F" else None for c in ls[1:]]
    if fsdp_axis is not None and len(ls) == 3:
      dims[-1] = fsdp_axis if dims[-1] is None else (dims[-1], fsdp_axis)
    return P(first, *dims)

  # One spec per matrix; a quantized matrix's values and scales split like it (`expand`).
  return expand(jax.tree.map(spec, _one_per_matrix(letters)), ffn)


def _one_per_matrix(letters):
  """`letters` with a quantized matrix's letters once, in place of its values and scales."""
  return jax.tree.map(lambda a: a.values if is_quantized(a) else a, letters, is_leaf=is_quantized)


def check_split(fn, mesh, ffn, tensor_axis, fsdp_axis):
  """Raises unless each split axis is a mesh axis whose size divides every dimension it
  splits (`split_specs`) of every leaf of `ffn`."""
  if tensor_axis is None and fsdp_axis is None:
    return
  _, output = split_dims(fn, ffn)
  if tensor_axis is not None and output == "F":
    raise ValueError(
      f"{fn}: expert_tensor_axis needs experts with a hidden dimension F between their "
      f"input and output matrices; {type(ffn).__name__} outputs F "
      f"(got expert_tensor_axis={tensor_axis!r})"
    )
  sizes = {
    axis: split_axis_size(fn, mesh, field, axis)
    for field, axis in (("expert_tensor_axis", tensor_axis), ("expert_fsdp_axis", fsdp_axis))
    if axis is not None
  }
  specs = split_specs(ffn, None, tensor_axis, fsdp_axis)
  for (path, leaf), spec in zip(
    jax.tree_util.tree_leaves_with_path(ffn), jax.tree.leaves(specs, is_leaf=_is_spec)
  ):
    for n, axes in zip(leaf.shape[1:], spec[1:]):
      axes = () if axes is None else (axes,) if isinstance(axes, str) else axes
      split = math.prod(sizes[a] for a in axes)
      if n % split:
        what = " x ".join(f"{a!r} ({sizes[a]})" for a in axes)
        raise ValueError(
          f"{fn}: the dimension {n} of w{jax.tree_util.keystr(path)} must be divisible by "
          f"the axes that split it: {what}"
        )


def _is_spec(x):
  return isinstance(x, P)


def gather_weights(ffn, fsdp_axis):
  """FSDP: the last dimension of every matrix (`split_specs`) all-gathered over `fsdp_axis`,
  once per call (its transpose reduce-scatters the gradients); `ffn` itself for None."""
  if fsdp_axis is None:
    return ffn

  def gather(a):
    return jax.lax.all_gather(a, fsdp_axis, axis=2, tiled=True) if a.ndim == 3 else a

  with jax.named_scope("fsdp_gather"):
    return jax.tree.map(gather, ffn)


def output_once(ffn, tensor_axis):
  """Expert tensor parallelism: the vectors without an F dimension (the output bias) kept on
  tensor rank 0 and zero on the others, so that the reduce-scatter of the partial outputs
  adds them once; `ffn` itself for None. Matrices stay whole on every rank: an adapter's a
  of gate or up ([E, D, R], no F) multiplies every rank's own columns of b, and down's b
  ([E, R, D]) each rank's partial sum over its rows of a."""
  if tensor_axis is None:
    return ffn
  letters, _ = split_dims("output_once", ffn)
  first = jax.lax.axis_index(tensor_axis) == 0
  return jax.tree.map(
    lambda a, ls: a if "F" in ls or len(ls) == 3 else jnp.where(first, a, jnp.zeros_like(a)),
    ffn,
    letters,
  )


# Rows of each device's block in the tensor axis's all-gather and reduce-scatter: a multiple
# of this. Compiled for TPU v5p (libtpu 0.0.42.1), a reduce-scatter of bf16 [8 x 2232, 6144]
# partial outputs became an all-reduce of the whole (padded) array, twice the bytes; padded
# to 8 x 2304 rows it stays a reduce-scatter. Not every size is helped: 8 x 640 rows (the
# overflow rounds there) and 8 x 8704 rows of bf16[., 6144] (855 MB) still compile to an
# all-reduce (docs/guides/sharding.md).
TENSOR_ROWS = 128


def one_expert_or_grouped(num_local, gmm_impl, masked, grouped, *args):
  """`masked(*args)` (the FFN through a `MaskedMatmul`) with one local expert and the
  megablox backend (named, or "auto" compiled for TPU), else `grouped(*args)`.

  With one expert a grouped matmul is a dense one: on TPU the dense matmuls on unsorted rows
  need no sort and no row scatters, and XLA fuses the FFN's elementwise ops into them. The
  other backends keep the sorted rows: "tiled" skips the row tiles past the group, which
  the dense matmuls compute (all_to_all's padding slots).
  """
  if num_local != 1 or gmm_impl not in ("auto", "megablox"):
    return grouped(*args)
  if gmm_impl == "megablox":
    return masked(*args)
  return jax.lax.platform_dependent(*args, tpu=masked, default=grouped)


def local_experts(x_MD, ids_M, ffn_L, num_local, gmm_impl, tensor_axis=None):
  """Runs the L local experts on received rows, each with its local expert id (L: padding,
  zeros out): f[M, out] in the dtype of x (products accumulate in float32).

  With a tensor axis (M' devices), each device holds every local expert's F / M' hidden
  columns: the rows of the M' devices are all-gathered, each device computes their partial
  outputs, and a reduce-scatter sums them and hands each device back its own rows. The sum
  happens before the return trip, so each device sends back M rows, not M' * M partial ones
  (docs/guides/sharding.md has the bytes).
  """
  x_MD = checkpoint_name(x_MD, MOE_DISPATCH_RECV)
  M = x_MD.shape[0]
  if tensor_axis is not None:
    # Each device's block a multiple of TENSOR_ROWS rows (padding: id L, zeros out), so
    # that XLA:TPU keeps the reduce-scatter below one (`TENSOR_ROWS`).
    pad = -M % TENSOR_ROWS
    x_MD = jnp.pad(x_MD, ((0, pad), (0, 0)))
    ids_M = jnp.pad(ids_M, (0, pad), constant_values=num_local)
    with jax.named_scope("tensor_gather"):
      x_MD, ids_M = (jax.lax.all_gather(a, tensor_axis, axis=0, tiled=True) for a in (x_MD, ids_M))

  def masked(x_MD, ids_M):  # one expert: dense matmuls, padding rows masked, no sort
    return ffn_L(x_MD, MaskedMatmul(ids_M == 0, x_MD.dtype))

  def grouped(x_MD, ids_M):
    order_M, group_sizes_L, _ = local.sort_by_expert(ids_M, num_local)
    rank_M = local.inverse_permutation(order_M)
    matmul = GroupedMatmul(group_sizes_L, gmm_impl, x_MD.dtype)
    # Sorted even for one local expert: padding rows go last, past the group, and XLA:TPU's
    # ragged-dot backward fails to compile when its one group is all M rows (RET_CHECK in
    # mask_aggregator.cc, libtpu 0.0.42.1).
    x_MD = local.move_rows(x_MD, rank_M, order_M)
    return local.move_rows(ffn_L(x_MD, matmul), order_M, rank_M)

  y_MF = one_expert_or_grouped(num_local, gmm_impl, masked, grouped, x_MD, ids_M)
  if tensor_axis is not None:
    with jax.named_scope("tensor_reduce_scatter"):
      y_MF = jax.lax.psum_scatter(y_MF, tensor_axis, scatter_dimension=0, tiled=True)[:M]
  return y_MF


def _prepare(fn, x_TD, w, experts, weights, mesh, expert_axis, tensor_axis=None, fsdp_axis=None):
  """Checks, pads T to a multiple of the device count and places the inputs on the mesh."""
  x_TD, ffn, E, experts_TK, weights_TK = local.check_moe_inputs(fn, x_TD, w, experts, weights)
  check_mesh(fn, mesh, expert_axis, E)
  _checks.split_axes_fields(fn, expert_axis, tensor_axis, fsdp_axis)
  check_split(fn, mesh, ffn, tensor_axis, fsdp_axis)
  T = x_TD.shape[0]
  pad = -T % mesh.size
  if pad:  # padding tokens route nowhere (id -1) and are trimmed from the output
    # Pad replicated arrays: a T that does not divide cannot be split over the mesh.
    x_TD, experts_TK, weights_TK = (place(a, mesh, P()) for a in (x_TD, experts_TK, weights_TK))
    x_TD = jnp.pad(x_TD, ((0, pad), (0, 0)))
    experts_TK = jnp.pad(experts_TK, ((0, pad), (0, 0)), constant_values=-1)
    weights_TK = jnp.pad(weights_TK, ((0, pad), (0, 0)))
  lay = _Layout(mesh, expert_axis, E, T, T + pad, tensor_axis, fsdp_axis)
  x_TD, experts_TK, weights_TK = (
    place(a, mesh, lay.token_spec) for a in (x_TD, experts_TK, weights_TK)
  )
  ffn = jax.tree.map(lambda leaf, spec: place(leaf, mesh, spec), ffn, lay.ffn_specs(ffn))
  return lay, x_TD, ffn, experts_TK, weights_TK


def shard_map(body, mesh, in_specs, out_specs):
  """`jax.shard_map` of a dispatch body, with JAX's varying-axes check off.

  Why off: the TPU grouped matmul (megablox, `kernels/tpu.py`) builds its group metadata by
  concatenating a constant with the per-device group sizes. Traced inside the body that
  passes, but when JAX later transforms the traced body again (a `lax.scan` over layers
  under `jax.grad`: scan-over-layers training) the check rejects the concatenate ("varying
  manual axes must match"), and with it the TPU's default backend. Without the check JAX
  transposes the body as shard_map did before it had one: a replicated input's cotangent is
  summed over the axes it is replicated on. What the check would catch (an out_spec that
  claims a value is replicated) the bodies rule out by construction: every replicated
  output is a psum or pmax. tests/test_layer_oracle.py checks every gradient on meshes
  with a data axis against finite differences.
  """
  return jax.shard_map(body, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False)


def run_on_mesh(
  body, lay, x_TD, ffn, experts_TK, weights_TK, stats_specs, return_stats, placement=None
):
  """Runs a dispatch body under shard_map on placed inputs: (y_TF, stats) or y_TF.

  Tokens, ids and weights are split like `lay.token_spec`, the FFN over the expert axis, a
  placement (when given, a fifth argument of the body) replicated; the padding tokens are
  trimmed from y, and their K slots (id -1 each) are taken out of `stats["invalid_ids"]`:
  they are not the caller's.
  """
  tok = lay.token_spec
  args, specs = (x_TD, ffn, experts_TK, weights_TK), (tok, lay.ffn_specs(ffn), tok, tok)
  if placement is not None:
    args, specs = args + (placement,), specs + (jax.tree.map(lambda _: P(), placement),)
    stats_specs = dict(stats_specs, slot_load=P())
  y_TF, stats = shard_map(body, lay.mesh, in_specs=specs, out_specs=(tok, stats_specs))(*args)
  y_TF = trim(y_TF, lay.mesh, lay.tokens)
  if not return_stats:
    return y_TF
  padding = (lay.padded - lay.tokens) * experts_TK.shape[1]
  return y_TF, dict(stats, invalid_ids=stats["invalid_ids"] - padding)
