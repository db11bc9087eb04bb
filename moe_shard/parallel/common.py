"""The layout of an expert-parallel call: its static facts, input checks and placement."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from moe_shard import local
from moe_shard.sharding import axis_size, check_mesh, expert_axes, place, token_spec, trim


@dataclasses.dataclass(frozen=True)
class _Layout:
  """Static facts about a call: mesh, axes and sizes."""

  mesh: jax.sharding.Mesh | jax.sharding.AbstractMesh
  expert_axis: str | tuple[str, ...]  # a tuple: experts split over the product, in order
  num_experts: int  # E
  tokens: int  # T before padding
  padded: int  # T after padding to a multiple of the device count

  @property
  def all_axes(self):
    return tuple(self.mesh.axis_names)

  @property
  def other_axes(self):
    """Axes other than the expert axes, of size > 1: the expert weights are replicated over
    them, so their gradients are summed there (over an axis of size 1 there is nothing to
    sum)."""
    return tuple(
      a
      for a in self.mesh.axis_names
      if a not in expert_axes(self.expert_axis) and self.mesh.shape[a] > 1
    )

  @property
  def n(self):
    return axis_size(self.mesh, self.expert_axis)

  @property
  def ffn_spec(self):
    """shard_map spec of an expert weight: split over the expert axes, then over the other
    axes of size 1. Naming those changes no layout, but shard_map (with check_vma off)
    transposes a replicated input into a psum over the axes its spec leaves out: one
    all-reduce copying every weight gradient even over an axis of size 1."""
    split = expert_axes(self.expert_axis)
    return P(split + tuple(a for a in self.mesh.axis_names if a not in split + self.other_axes))

  @property
  def token_spec(self):
    return token_spec(self.mesh)


def _prepare(fn, x_TD, w, experts, weights, mesh, expert_axis):
  """Checks, pads T to a multiple of the device count and places the inputs on the mesh."""
  x_TD, ffn, E, experts_TK, weights_TK = local.check_moe_inputs(fn, x_TD, w, experts, weights)
  check_mesh(fn, mesh, expert_axis, E)
  T = x_TD.shape[0]
  pad = -T % mesh.size
  if pad:  # padding tokens route nowhere (id -1) and are trimmed from the output
    # Pad replicated arrays: a T that does not divide cannot be split over the mesh.
    x_TD, experts_TK, weights_TK = (place(a, mesh, P()) for a in (x_TD, experts_TK, weights_TK))
    x_TD = jnp.pad(x_TD, ((0, pad), (0, 0)))
    experts_TK = jnp.pad(experts_TK, ((0, pad), (0, 0)), constant_values=-1)
    weights_TK = jnp.pad(weights_TK, ((0, pad), (0, 0)))
  lay = _Layout(mesh, expert_axis, E, T, T + pad)
  x_TD, experts_TK, weights_TK = (
    place(a, mesh, lay.token_spec) for a in (x_TD, experts_TK, weights_TK)
  )
  ffn = jax.tree.map(lambda leaf: place(leaf, mesh, lay.ffn_spec), ffn)
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


def run_on_mesh(body, lay, x_TD, ffn, experts_TK, weights_TK, stats_specs, return_stats):
  """Runs a dispatch body under shard_map on placed inputs: (y_TF, stats) or y_TF.

  Tokens, ids and weights are split like `lay.token_spec`, the FFN over the expert axis;
  the padding tokens are trimmed from y, and their K slots (id -1 each) are taken out of
  `stats["invalid_ids"]`: they are not the caller's.
  """
  tok = lay.token_spec
  y_TF, stats = shard_map(
    body,
    lay.mesh,
    in_specs=(tok, jax.tree.map(lambda _: lay.ffn_spec, ffn), tok, tok),
    out_specs=(tok, stats_specs),
  )(x_TD, ffn, experts_TK, weights_TK)
  y_TF = trim(y_TF, lay.mesh, lay.tokens)
  if not return_stats:
    return y_TF
  padding = (lay.padded - lay.tokens) * experts_TK.shape[1]
  return y_TF, dict(stats, invalid_ids=stats["invalid_ids"] - padding)
