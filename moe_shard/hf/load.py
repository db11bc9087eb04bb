"""Load the MoE blocks of a Hugging Face checkpoint into `MoEParams`.

`load_moe_layer` and `load_moe_layers` open the checkpoint (`hf.block`: config.json against
the family table, every tensor's shape against the config), then build each leaf. With a
mesh each leaf is created already placed (`jax.make_array_from_callback` with
`moe_param_specs`), and the callback of a device reads from the files only the rows of the
experts that device holds: a process reads its own experts and the replicated tensors, never
a whole expert tensor.

With `keep_quantized=True` the routed experts' matrices stored as MXFP4 or block-FP8 (and the
shared experts' stored as block-FP8) are `QuantizedArray`s holding the checkpoint's bytes (`hf.layouts`), values and scales each
created placed with the matrix's spec; `save_moe_layers` (`hf.save`) writes them back byte
for byte.
"""

from __future__ import annotations

import dataclasses
import os

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from moe_shard.config import MoEConfig
from moe_shard.hf.block import (
  DTYPES,
  check_layer,
  check_tensors,
  float_cfg,
  leaf_name,
  leaf_shapes,
  named_leaves,
  open_block,
)
from moe_shard.hf.layouts import kept_shapes, stored
from moe_shard.params import MoEParams, check_split_axes, moe_param_shapes, moe_param_specs
from moe_shard.quant import QuantizedArray
from moe_shard.sharding import EXPERT, resolve_mesh


def _config(fn, block, layer, dtype, expert_axis, tensor_axis=None, fsdp_axis=None):
  """The MoEConfig of layer `layer`; param_dtype is `dtype` or the experts' stored dtype."""
  try:
    fields = block.family.config(block.text)
  except KeyError as e:
    raise ValueError(f"{fn}: config.json lacks the field {e.args[0]!r}") from None
  except ValueError as e:
    raise ValueError(f"{fn}: {e}") from None
  if dtype is None:
    dtype = _stored_dtype(fn, block, layer, MoEConfig(**fields))
  return MoEConfig(
    **fields,
    param_dtype=jnp.dtype(dtype),
    expert_axis=expert_axis,
    expert_tensor_axis=tensor_axis,
    expert_fsdp_axis=fsdp_axis,
  )


def _stored_dtype(fn, block, layer, cfg):
  """The widest float dtype of the layer's expert tensors (MXFP4 and FP8 count as bfloat16)."""
  kinds = set()
  for lay in block.at(layer):
    for name in lay.tensors(leaf_shapes(cfg)) if lay.expert_axis else ():
      _, how = stored(block.ckpt, name)
      kind = "BF16" if how else block.ckpt.meta(name)[1]
      if kind.startswith("F8"):
        raise ValueError(
          f"{fn}: tensor {name!r} has dtype {kind} without block scales "
          f"{name + '_scale_inv'!r}: FP8 is read only as block-FP8 (quantization_config "
          f"quant_method 'fp8', F8_E4M3 weights, each with its weight_scale_inv); "
          f"dequantize the checkpoint first"
        )
      if kind not in DTYPES:
        raise ValueError(f"{fn}: tensor {name!r} has dtype {kind}, not a float dtype")
      kinds.add(kind)
  if len(kinds) == 1:
    return DTYPES[kinds.pop()]
  return DTYPES["F64"] if "F64" in kinds else DTYPES["F32"]


def _kept(fn, block, layers, cfg, keep_quantized):
  """{leaf: "mxfp4" | "fp8"}: the routed experts' matrices (and the shared experts' stored
  as block-FP8) kept as stored, alike in every layer of `layers` (empty unless
  `keep_quantized`)."""
  if not keep_quantized:
    return {}
  shapes, first = leaf_shapes(cfg), None
  for i in layers:
    kept = {}
    for lay in block.at(i):
      try:
        kept.update(lay.kept(block.ckpt, shapes))
      except ValueError as e:
        raise ValueError(
          f"{fn}: keep_quantized=True cannot keep {e}; pass keep_quantized=False to load it "
          f"dequantized"
        ) from None
    if first is not None and kept != first:
      raise ValueError(
        f"{fn}: keep_quantized=True needs the MoE layers stored alike, but layer {i} keeps "
        f"{kept} and layer {layers[0]} {first}; pass keep_quantized=False"
      )
    first = kept
  return first


def _with_format(cfg, kept):
  """`cfg` with `weights_format` the kept format when every routed-expert matrix is kept in
  it (and `MoEConfig` has that field), else `cfg`."""
  routed = {k: f for k, f in kept.items() if k.startswith("experts.")}
  fmts = set(routed.values())
  matrices = {k for k, s in leaf_shapes(cfg).items() if k.startswith("experts.") and len(s) == 3}
  if len(fmts) != 1 or set(routed) != matrices or not hasattr(cfg, "weights_format"):
    return cfg
  return dataclasses.replace(cfg, weights_format=fmts.pop())


def _check_divides(fn, mesh, spec, shape, what):
  """Raises unless every mesh axis of `spec` divides the dimension of `shape` it splits."""
  for dim, (axes, n) in enumerate(zip(spec, shape)):
    axes = () if axes is None else (axes,) if isinstance(axes, str) else tuple(axes)
    size = int(np.prod([mesh.shape[a] for a in axes]))
    if n % size:
      raise ValueError(
        f"{fn}: keep_quantized=True cannot split {what} of shape {tuple(shape)} over the mesh "
        f"axes {axes} (size {size}): its dimension {dim} ({n}) must be divisible by it; pass "
        f"keep_quantized=False, or split over fewer devices"
      )


def _mesh(fn, mesh, cfg):
  """The mesh to place the leaves on (`mesh`, or the one in scope), a concrete `Mesh`."""
  resolved = resolve_mesh(fn, mesh, cfg.expert_axis, cfg.num_experts, required=False)
  check_split_axes(fn, cfg, resolved)
  if resolved is not None and not isinstance(resolved, Mesh):
    raise ValueError(
      f"{fn}: mesh must be a concrete jax.sharding.Mesh to create arrays on (got "
      f"{type(resolved).__name__})"
    )
  return resolved


def _reader(block, cfg, layers, mx_dtype):
  """(read(leaf, layer_pos, lo, hi) -> np array in the leaf's dtype, read_kept(...) -> (values,
  scales) of a kept leaf, layout of each leaf, the cache)."""
  shapes = leaf_shapes(cfg)
  dtypes = {k: s.dtype for k, s in named_leaves(moe_param_shapes(float_cfg(cfg))).items()}
  at = [dict((leaf, lay) for lay in block.at(i) for leaf in lay.leaves) for i in layers]
  cache = {}

  def read(leaf, pos, lo, hi):
    lay = at[pos][leaf]
    if not lay.expert_axis:
      lo, hi = 0, shapes[leaf][0]
    a = lay.read(block.ckpt, leaf, shapes, lo, hi, cache, mx_dtype)
    return np.asarray(a, dtypes[leaf])

  def read_kept(leaf, pos, lo, hi):
    return at[pos][leaf].read_kept(block.ckpt, leaf, shapes, lo, hi, cache)

  return read, read_kept, at[0], cache


def _build(fn, block, cfg, layers, mesh, stacked, kept):
  """Every leaf of the layers `layers` (stacked on axis 0 when `stacked`), placed on `mesh`;
  the leaves of `kept` as `QuantizedArray`s of their stored format."""
  mx_dtype = np.dtype(cfg.param_dtype)
  read, read_kept, by_leaf, cache = _reader(block, cfg, layers, mx_dtype)
  shapes = moe_param_shapes(float_cfg(cfg))
  specs = moe_param_specs(float_cfg(cfg))
  flat = {
    leaf_name(p): (s, spec)
    for (p, s), spec in zip(
      jax.tree_util.tree_leaves_with_path(shapes),
      jax.tree.leaves(specs, is_leaf=lambda x: isinstance(x, P)),
    )
  }
  out = {}
  # Leaves in layout order, so that the leaves of one fused tensor share its cached rows.
  for leaf in dict.fromkeys(leaf for lay in block.layouts for leaf in lay.leaves):
    s, spec = flat[leaf]
    E = s.shape[0]
    if leaf in kept:
      out[leaf] = _build_kept(fn, read_kept, leaf, kept[leaf], s, spec, cfg, layers, mesh, stacked)
    elif mesh is None:
      parts = [read(leaf, k, 0, E) for k in range(len(layers))]
      out[leaf] = jnp.asarray(np.stack(parts) if stacked else parts[0])
    else:
      shape = (len(layers), *s.shape) if stacked else s.shape
      sharding = NamedSharding(mesh, P(None, *spec) if stacked else spec)

      def cb(index, leaf=leaf, E=E):
        ks = range(len(layers))[index[0]] if stacked else [0]
        rest = index[1:] if stacked else index
        lo, hi, _ = rest[0].indices(E)
        parts = [read(leaf, k, lo, hi)[(slice(None), *rest[1:])] for k in ks]
        return np.stack(parts) if stacked else parts[0]

      out[leaf] = jax.make_array_from_callback(shape, sharding, cb)
    if leaf == by_leaf[leaf].leaves[-1]:
      cache.clear()
  return jax.tree.unflatten(jax.tree.structure(shapes), [out[k] for k in flat])


def _build_kept(fn, read_kept, leaf, fmt, s, spec, cfg, layers, mesh, stacked):
  """The `QuantizedArray` of one kept leaf: values and scales each read (and, with a mesh,
  created placed with the matrix's spec) from the stored bytes, never decoded."""
  E, n = s.shape[0], len(layers)
  arrays = []
  for part, (shape, _) in enumerate(kept_shapes(fmt, s.shape)):
    if mesh is None:
      pieces = [read_kept(leaf, k, 0, E)[part] for k in range(n)]
      arrays.append(jnp.asarray(np.stack(pieces) if stacked else pieces[0]))
      continue
    shape = (n, *shape) if stacked else shape
    full = P(None, *spec) if stacked else spec
    _check_divides(fn, mesh, full, shape, f"params.{leaf}.{('values', 'scales')[part]}")

    def cb(index, part=part):
      ks = range(n)[index[0]] if stacked else [0]
      rest = index[1:] if stacked else index
      lo, hi, _ = rest[0].indices(E)
      pieces = [read_kept(leaf, k, lo, hi)[part][(slice(None), *rest[1:])] for k in ks]
      return np.stack(pieces) if stacked else pieces[0]

    arrays.append(jax.make_array_from_callback(shape, NamedSharding(mesh, full), cb))
  values, scales = arrays
  return QuantizedArray(values, scales, fmt, jnp.dtype(cfg.param_dtype))


def load_moe_layer(
  path: str | os.PathLike,
  layer: int,
  *,
  mesh: Mesh | None = None,
  dtype: jnp.dtype | type | None = None,
  expert_axis: str | tuple[str, ...] = EXPERT,
  expert_tensor_axis: str | None = None,
  expert_fsdp_axis: str | None = None,
  keep_quantized: bool = False,
) -> tuple[MoEConfig, MoEParams]:
  """Loads the MoE block of one decoder layer of a Hugging Face checkpoint.

  Args:
    path: a model folder: config.json and `model.safetensors` or
      `model.safetensors.index.json` with its shards.
    layer: the decoder layer index i (`model.layers.{i}`), 0 <= i < num_hidden_layers; its
      block must be MoE.
    mesh: None (default): arrays on the default device. A `Mesh` with `expert_axis`: every
      leaf created placed as `moe_param_specs(cfg)` says, each process reading only the
      experts its devices hold.
    dtype: the dtype of the expert and shared-expert weights (default None: the stored one;
      bfloat16 for MXFP4 and block-FP8, whose products are formed in float32). The router,
      its biases and the shared gate are float32.
    expert_axis: `MoEConfig.expert_axis` (default "expert").
    expert_tensor_axis: `MoEConfig.expert_tensor_axis` (default None): with a mesh, each
      device reads only its slice of every expert's hidden dimension.
    expert_fsdp_axis: `MoEConfig.expert_fsdp_axis` (default None): with a mesh, each
      device reads only its slice of the last dimension of every expert matrix.
    keep_quantized: keep the routed experts' matrices stored as MXFP4 or block-FP8, and the
      shared experts' stored as block-FP8 (DeepSeek-V3), as stored (default False:
      dequantized to `dtype`): each is a `QuantizedArray` ("mxfp4" or "fp8") holding the
      checkpoint's bytes, whose `dequantize()` is the matrix `keep_quantized=False` loads,
      `dtype` its logical dtype. Its values and scales are each placed with the matrix's
      spec. Other tensors, and float checkpoints, load as without it.

  Returns:
    (cfg: MoEConfig, params: MoEParams) such that `moe_layer(params, x, cfg)` computes the
    model's MoE block (routed and shared experts, gates and scaling).

  Raises:
    FileNotFoundError: no folder, config.json or safetensors file.
    ValueError: an unsupported model_type or config field, only pickle files, a layer out of
      range or dense, a tensor missing or of a shape other than config.json implies, an
      expert tensor not of a float dtype (FP8 without block scales), block-FP8 scales of
      another shape than the block implies; with `keep_quantized`, a quantized matrix whose
      layout a `QuantizedArray` cannot keep (FP8 blocks other than 128 x 128 or not dividing
      the matrix, a fused or transposed layout the blocks cannot follow, values or scales a
      mesh axis does not divide).
  """
  fn = "load_moe_layer"
  block = open_block(fn, path)
  layer = check_layer(fn, block, layer)
  cfg = _config(fn, block, layer, dtype, expert_axis, expert_tensor_axis, expert_fsdp_axis)
  mesh = _mesh(fn, mesh, cfg)
  check_tensors(fn, block, layer, cfg)
  kept = _kept(fn, block, [layer], cfg, keep_quantized)
  params = _build(fn, block, cfg, [layer], mesh, False, kept)
  return _with_format(cfg, kept), params


def load_moe_layers(
  path: str | os.PathLike,
  *,
  mesh: Mesh | None = None,
  dtype: jnp.dtype | type | None = None,
  expert_axis: str | tuple[str, ...] = EXPERT,
  expert_tensor_axis: str | None = None,
  expert_fsdp_axis: str | None = None,
  keep_quantized: bool = False,
) -> tuple[MoEConfig, MoEParams]:
  """Loads every MoE block of a checkpoint, leaves stacked on a leading layer axis.

  The MoE layers are those `moe_layers(path)` lists (dense layers are skipped), in order;
  leaf l of the stack is that list's l-th layer. Feed the stack to `jax.lax.scan` or
  `nnx.scan`. With a mesh each leaf's spec is `P(None, *moe_param_specs(cfg).leaf)`.

  Args:
    path, mesh, dtype, expert_axis, expert_tensor_axis, expert_fsdp_axis, keep_quantized: as
      `load_moe_layer`.

  Returns:
    (cfg: MoEConfig, params: MoEParams with every leaf [L, ...]; a kept `QuantizedArray`'s
    values and scales both [L, ...]).

  Raises:
    FileNotFoundError, ValueError: as `load_moe_layer`; ValueError also when the checkpoint
      has no MoE layer.
  """
  fn = "load_moe_layers"
  block = open_block(fn, path)
  layers = block.moe_layers()
  if not layers:
    raise ValueError(f"{fn}: {str(path)!r} has no MoE layer")
  cfg = _config(fn, block, layers[0], dtype, expert_axis, expert_tensor_axis, expert_fsdp_axis)
  mesh = _mesh(fn, mesh, cfg)
  for i in layers:
    check_tensors(fn, block, i, cfg)
  kept = _kept(fn, block, layers, cfg, keep_quantized)
  params = _build(fn, block, cfg, layers, mesh, True, kept)
  return _with_format(cfg, kept), params


def moe_layers(path: str | os.PathLike) -> list[int]:
  """Returns the decoder layer indices whose block is MoE, by config.json."""
  return open_block("moe_layers", path).moe_layers()
