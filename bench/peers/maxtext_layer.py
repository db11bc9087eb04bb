"""MaxText's RoutedMoE as programs to compile: its config for a case, its paths (sparse matmul,
dense einsum), the items each drops, and the jitted forward and backward
(`bench/peers/maxtext_peer.py` runs them; its docstring says how MaxText is installed)."""

from __future__ import annotations

import math
import os

import numpy as np

# name -> MaxText config fields of that path (besides the case's, `maxtext_config`).
PATHS = {
  "maxtext_capacity": {"sparse_matmul": False, "megablox": False, "capacity_factor": 1.25},
  "maxtext_capacity_a2a": {
    "sparse_matmul": False,
    "megablox": False,
    "capacity_factor": 1.25,
    "moe_dispatch_no_expert_sharding": True,
  },
  "maxtext_megablox": {"sparse_matmul": True, "megablox": True, "capacity_factor": -1.0},
  "maxtext_megablox_rbf1.25": {
    "sparse_matmul": True,
    "megablox": True,
    "capacity_factor": -1.0,
    "ragged_buffer_factor": 1.25,
  },
}


# name -> what the path is, in a line (the results file's list of paths).
SUMMARIES = {
  "maxtext_capacity": "one-hot dispatch and combine einsums, a capacity per sequence and expert",
  "maxtext_capacity_a2a": "the same, tokens moved by all-to-all instead of the weights gathered",
  "maxtext_megablox": "dropless: ragged all-to-all and megablox, a worst-case receive buffer",
  "maxtext_megablox_rbf1.25": "the same, a receive buffer of 1.25x the balanced load",
}


DENSE_LIMIT = "dense_limit"


def capacity_drops(experts_BSK, num_experts, capacity_factor):
  """(token, slot) items MaxText's capacity path drops for a routing.

  MaxText's `RoutedMoE.generate_masks`: in each sequence, the items of expert e in order of
  (token, slot) beyond its capacity int(max(ceil(S * K / E) * capacity_factor,
  capacity_factor)) are dropped.

  Args:
    experts_BSK: int[B, S, K] the expert of each item.
    num_experts: E.
    capacity_factor: > 0.

  Returns:
    int: the items dropped.
  """
  B, S, K = experts_BSK.shape
  capacity = int(max(math.ceil(S * K / num_experts) * capacity_factor, capacity_factor))
  onehot_BIE = np.eye(num_experts, dtype=np.int64)[experts_BSK.reshape(B, S * K)]
  position_BIE = np.cumsum(onehot_BIE, axis=1) * onehot_BIE  # 1-based place in its expert
  return int(np.sum(position_BIE > capacity))


def buffer_drops(experts_TK, num_experts, num_shards, ragged_buffer_factor):
  """(token, slot) items that overflow MaxText's ragged receive buffers for a routing.

  With `ragged_buffer_factor` f > 0 each of the `num_shards` expert shards receives into a
  buffer of int(T / N * K * f) rows (`RoutedMoE.get_ragged_buffer_size`); the items past it
  are dropped. With f <= 0 the buffer holds the worst case: nothing drops.

  Args:
    experts_TK: int[T, K] the expert of each item (T tokens of all shards).
    num_experts: E, a multiple of num_shards (experts split evenly, in order).
    num_shards: N, the expert-parallel devices.
    ragged_buffer_factor: f.

  Returns:
    int: the items dropped.
  """
  if ragged_buffer_factor <= 0:
    return 0
  T, K = experts_TK.shape
  received_N = np.bincount(
    (experts_TK // (num_experts // num_shards)).ravel(), minlength=num_shards
  )
  buffer = int(T // num_shards * K * ragged_buffer_factor)
  return int(np.maximum(received_N - buffer, 0).sum())


def dropped(path, experts_TK, num_experts, num_shards):
  """Items `path` (a key of PATHS) drops under the routing experts_TK, sequences of T / N."""
  fields = PATHS[path]
  if not fields["sparse_matmul"]:
    experts_BSK = experts_TK.reshape(num_shards, -1, experts_TK.shape[1])
    return capacity_drops(experts_BSK, num_experts, fields["capacity_factor"])
  return buffer_drops(experts_TK, num_experts, num_shards, fields.get("ragged_buffer_factor", -1.0))


def maxtext_config(path, E, T, D, F, K, num_devices):
  """The MaxText config fields of `path` on the case (every field this module sets)."""
  if T % num_devices:
    raise ValueError(f"maxtext_peer: tokens ({T}) must be divisible by the devices ({num_devices})")
  return dict(
    num_experts=E,
    num_experts_per_tok=K,
    base_emb_dim=D,
    base_mlp_dim=F,
    base_moe_mlp_dim=F,
    dtype="bfloat16",
    weight_dtype="bfloat16",
    float32_gate_logits=True,
    per_device_batch_size=1,
    max_target_length=T // num_devices,
    ici_expert_parallelism=num_devices,
    ici_fsdp_parallelism=1,
    **PATHS[path],
  )


def _jax_compat():
  """Gives jax 0.10.2 the one name MaxText 0.2.5 imports from a later jax (see the module
  docstring): a `must_fuse_call` that raises, used only by an attention kernel."""
  from jax.experimental import xla_metadata

  if not hasattr(xla_metadata, "must_fuse_call"):

    def must_fuse_call(*args, **kwargs):
      raise NotImplementedError("must_fuse_call needs jax >= 0.11 (not used by RoutedMoE)")

    xla_metadata.must_fuse_call = must_fuse_call


def maxtext_programs(fields, devices):
  """MaxText's RoutedMoE on `devices`: its programs, abstract arguments and mesh.

  Args:
    fields: MaxText config fields (`maxtext_config`).
    devices: the topology's devices (`bench.reading.tpu.devices`).

  Returns:
    (programs, args, params, enter): {"fwd", "fwd_bwd"} -> function of (params, state, x,
    dy); args: (params, state, x, dy) as ShapeDtypeStructs with shardings; params: the
    parameters alone; enter: a function returning the context (mesh and MaxText's logical
    axis rules) to lower the programs in.
  """
  import contextlib

  import jax
  import maxtext
  from flax import linen as nn
  from flax import nnx
  from jax.sharding import Mesh
  from jax.sharding import PartitionSpec as P
  from maxtext.configs import pyconfig
  from maxtext.layers import moe
  from maxtext.layers.initializers import nd_dense_init
  from maxtext.utils import maxtext_utils, sharding

  base = os.path.join(os.path.dirname(maxtext.__file__), "configs", "base.yml")
  cfg = pyconfig.initialize(
    [None, base], run_name="maxtext_peer", enable_checkpointing=False, **fields
  )
  grid = maxtext_utils.create_device_mesh(cfg, devices)
  mesh = Mesh(grid, cfg.mesh_axes, axis_types=(jax.sharding.AxisType.Auto,) * len(cfg.mesh_axes))

  def enter():
    stack = contextlib.ExitStack()
    stack.enter_context(jax.set_mesh(mesh))
    stack.enter_context(nn.logical_axis_rules(cfg.logical_axis_rules))
    return stack

  def make():
    return moe.RoutedMoE(
      config=cfg,
      num_experts=cfg.num_experts,
      num_experts_per_tok=cfg.num_experts_per_tok,
      mesh=mesh,
      kernel_init=nd_dense_init(1.0, "fan_in", "truncated_normal"),
      kernel_axes=("embed", "mlp"),
      intermediate_dim=cfg.moe_mlp_dim,
      weight_dtype=cfg.weight_dtype,
      dtype=cfg.dtype,
      rngs=nnx.Rngs(params=0),
    )

  with nn.logical_axis_rules(cfg.logical_axis_rules):
    graphdef, params, state = nnx.split(nnx.eval_shape(make), nnx.Param, ...)

    def abstract(tree):
      shardings = sharding.nnx_construct_named_sharding(tree, mesh)
      return jax.tree.map(
        lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), tree, shardings
      )

    params, state = abstract(params), abstract(state)
    x_sharding = nn.logical_to_mesh_sharding(
      P("activation_batch", "activation_length", "activation_embed"),
      mesh,
      cfg.logical_axis_rules,
    )
  B = mesh.devices.size
  x = jax.ShapeDtypeStruct((B, cfg.max_target_length, cfg.emb_dim), cfg.dtype, sharding=x_sharding)

  def layer(p, s, x):
    y, _, _ = nnx.merge(graphdef, p, s)(x)
    return y

  def fwd(p, s, x, dy):
    return layer(p, s, x)

  def fwd_bwd(p, s, x, dy):
    y, vjp = jax.vjp(lambda p, x: layer(p, s, x), p, x)
    return (y, *vjp(dy))

  return {"fwd": fwd, "fwd_bwd": fwd_bwd}, (params, state, x, x), params, enter
