"""`shared_mlp`: the shared experts as a dense tensor-parallel MLP, their weights FSDP."""

from __future__ import annotations

import functools

import jax

from moe_shard.experts import SwiGLU, shared_experts
from moe_shard.parallel.common import gather_weights, shard_map, split_specs
from moe_shard.sharding import place, token_spec


def shared_mlp(shared: SwiGLU, x_TD: jax.Array, *, mesh, tensor_axis, fsdp_axis) -> jax.Array:
  """Every token through every shared expert, summed, on a mesh: f32[T, D].

  Tokens are split over every mesh axis (T must divide by the mesh size). The weights are
  split as `moe_param_specs` places them: F over `tensor_axis`, each matrix's last dimension
  over `fsdp_axis`. Each device all-gathers its slices of the weights over the FSDP axis
  (the gradients come back reduce-scattered) and the tokens of the devices on its tensor
  axis, computes their partial outputs from its F / M columns, and a reduce-scatter over the
  tensor axis sums them and hands each device its own tokens: (M - 1) / M of its tokens' D
  in, of their outputs back.

  Args:
    shared: the shared experts, leaves [e, D, F] and [e, F, D], placed or not.
    x_TD: f[T, D] tokens.
    mesh: the layer's mesh.
    tensor_axis: None or the axis splitting F.
    fsdp_axis: None or the axis splitting each matrix's last dimension.

  Returns:
    f32[T, D], split over every mesh axis.
  """
  return _shared_jit(shared, x_TD, mesh=mesh, tensor_axis=tensor_axis, fsdp_axis=fsdp_axis)


@functools.partial(jax.jit, static_argnames=("mesh", "tensor_axis", "fsdp_axis"))
def _shared_jit(shared, x_TD, *, mesh, tensor_axis, fsdp_axis):
  tok = token_spec(mesh)
  specs = split_specs(shared, None, tensor_axis, fsdp_axis)
  shared = jax.tree.map(lambda a, spec: place(a, mesh, spec), shared, specs)

  def body(x_TD, w):
    w = gather_weights(w, fsdp_axis)
    if tensor_axis is not None:
      with jax.named_scope("tensor_gather"):
        x_TD = jax.lax.all_gather(x_TD, tensor_axis, axis=0, tiled=True)
    y_TD = shared_experts(w, x_TD)
    if tensor_axis is not None:
      with jax.named_scope("tensor_reduce_scatter"):
        y_TD = jax.lax.psum_scatter(y_TD, tensor_axis, scatter_dimension=0, tiled=True)
    return y_TD

  return shard_map(body, mesh, in_specs=(tok, specs), out_specs=tok)(place(x_TD, mesh, tok), shared)
