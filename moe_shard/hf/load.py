"""Load the MoE blocks of a Hugging Face checkpoint into `MoEParams`, and save them back.

`load_moe_layer` and `load_moe_layers` read config.json, check it against the family table
(`hf.families`), check every tensor's shape against the config, then build each leaf. With a
mesh each leaf is created already placed (`jax.make_array_from_callback` with
`moe_param_specs`), and the callback of a device reads from the files only the rows of the
experts that device holds: a process reads its own experts and the replicated tensors, never
a whole expert tensor.

With `keep_quantized=True` the routed experts' matrices stored as MXFP4 or block-FP8 are
`QuantizedArray`s holding the checkpoint's bytes (`hf.layouts`), values and scales each
created placed with the matrix's spec; `save_moe_layers` writes them back byte for byte.
"""

from __future__ import annotations

import dataclasses
import operator
import os
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from moe_shard.config import MoEConfig
from moe_shard.hf import fp8
from moe_shard.hf.families import FAMILIES, Family, text_config
from moe_shard.hf.io import Checkpoint, write_folder
from moe_shard.hf.layouts import BF16, fp8_block, kept_shapes, stored, stored_kept
from moe_shard.hf.mxfp4 import quantize as quantize_mxfp4
from moe_shard.params import MoEParams, check_split_axes, moe_param_shapes, moe_param_specs
from moe_shard.quant import QuantizedArray, is_quantized
from moe_shard.sharding import EXPERT, resolve_mesh

DTYPES = {
  "F64": np.dtype(np.float64),
  "F32": np.dtype(np.float32),
  "F16": np.dtype(np.float16),
  "BF16": BF16,
}


@dataclasses.dataclass
class _Block:
  """One checkpoint opened for the MoE blocks: its family, text config and MoEConfig."""

  ckpt: Checkpoint
  family: Family
  text: dict
  layouts: tuple = ()

  def num_layers(self):
    return int(self.text[self.family.num_layers])

  def moe_layers(self):
    return [i for i in range(self.num_layers()) if self.family.dense(self.text, i) is None]

  def prefix(self, i):
    """Where layer i's block lives: the first prefix holding the block's first tensor."""
    first = self.layouts[0]
    name = getattr(first, dataclasses.fields(first)[0].name)
    for p in self.family.prefixes:
      p = p.format(i=i)
      if p + name in self.ckpt or p + name + "_blocks" in self.ckpt:
        return p
    return self.family.prefixes[0].format(i=i)

  def at(self, i):
    """The layouts of layer i with full tensor names."""
    p = self.prefix(i)
    return tuple(
      dataclasses.replace(lay, **{f: p + getattr(lay, f)})
      for lay in self.layouts
      for f in [dataclasses.fields(lay)[0].name]
    )


def _open(fn, path):
  ckpt = Checkpoint(fn, path)
  model_type = ckpt.config.get("model_type")
  if model_type not in FAMILIES:
    raise ValueError(
      f"{fn}: config.json model_type {model_type!r} is not a supported MoE architecture "
      f"(supported: {', '.join(sorted(FAMILIES))})"
    )
  family = FAMILIES[model_type]
  text = text_config(ckpt.config)
  quant = (ckpt.config.get("quantization_config") or text.get("quantization_config") or {}).get(
    "quant_method"
  )
  if quant not in (None, "mxfp4", "fp8") or (quant == "mxfp4" and model_type != "gpt_oss"):
    raise ValueError(
      f"{fn}: config.json quantization_config.quant_method {quant!r} is not supported for "
      f"{model_type} (only gpt_oss's 'mxfp4' and block 'fp8' are dequantized on load): "
      f"dequantize the checkpoint first"
    )
  return _Block(ckpt, family, text, tuple(family.layouts(text)))


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
    for name in lay.tensors(_leaf_shapes(cfg)) if lay.expert_axis else ():
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


def _name(path):
  """A leaf's name: its `MoEParams` path, e.g. "experts.gate_EDF"."""
  return jax.tree_util.keystr(path, simple=True, separator=".")


def _leaves(tree, is_leaf=None):
  return {_name(p): a for p, a in jax.tree_util.tree_leaves_with_path(tree, is_leaf=is_leaf)}


def _float_cfg(cfg):
  """`cfg` describing float expert matrices: the layouts map the matrices' logical shapes."""
  if getattr(cfg, "weights_format", None) is None:
    return cfg
  return dataclasses.replace(cfg, weights_format=None)


def _leaf_shapes(cfg):
  return {k: s.shape for k, s in _leaves(moe_param_shapes(_float_cfg(cfg))).items()}


def _kept(fn, block, layers, cfg, keep_quantized):
  """{leaf: "mxfp4" | "fp8"}: the routed experts' matrices kept as stored, alike in every
  layer of `layers` (empty unless `keep_quantized`)."""
  if not keep_quantized:
    return {}
  shapes, first = _leaf_shapes(cfg), None
  for i in layers:
    kept = {}
    for lay in block.at(i):
      if not lay.expert_axis:
        continue
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
  fmts = set(kept.values())
  matrices = {k for k, s in _leaf_shapes(cfg).items() if k.startswith("experts.") and len(s) == 3}
  if len(fmts) != 1 or set(kept) != matrices or not hasattr(cfg, "weights_format"):
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


def _check_layer(fn, block, layer):
  """Returns `layer` as an int, raising unless it is an integer index of an MoE layer."""
  n = block.num_layers()
  try:
    i = None if isinstance(layer, bool) else operator.index(layer)
  except TypeError:
    i = None
  if i is None or not 0 <= i < n:
    raise ValueError(
      f"{fn}: layer must be an int in [0, {n}) ({block.family.num_layers}={n} in "
      f"config.json) (got {layer!r})"
    )
  layer = i
  reason = block.family.dense(block.text, layer)
  if reason is not None:
    raise ValueError(
      f"{fn}: layer {layer} is dense, not MoE, in this {block.ckpt.config['model_type']} "
      f"checkpoint: {reason} in config.json (MoE layers: {block.moe_layers()})"
    )
  return layer


def _check_tensors(fn, block, layer, cfg):
  """Raises unless every tensor of layer `layer`'s block exists with the config's shape."""
  shapes = _leaf_shapes(cfg)
  for lay in block.at(layer):
    for name, want in lay.tensors(shapes).items():
      got, how = stored(block.ckpt, name)
      if how == "fp8":
        scale, _ = block.ckpt.meta(name + "_scale_inv")
        why = fp8.check(name, got, scale, fp8_block(block.ckpt))
        if why:
          raise ValueError(f"{fn}: {why}")
      if tuple(got) != tuple(want):
        what = " (dequantized MXFP4)" if how == "mxfp4" else ""
        raise ValueError(
          f"{fn}: tensor {name!r}{what} has shape {tuple(got)}, but config.json implies "
          f"{tuple(want)}"
        )


def _reader(block, cfg, layers, mx_dtype):
  """(read(leaf, layer_pos, lo, hi) -> np array in the leaf's dtype, read_kept(...) -> (values,
  scales) of a kept leaf, layout of each leaf, the cache)."""
  shapes = _leaf_shapes(cfg)
  dtypes = {k: s.dtype for k, s in _leaves(moe_param_shapes(_float_cfg(cfg))).items()}
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
  shapes = moe_param_shapes(_float_cfg(cfg))
  specs = moe_param_specs(_float_cfg(cfg))
  flat = {
    _name(p): (s, spec)
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
  return QuantizedArray(*arrays, fmt, jnp.dtype(cfg.param_dtype))


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
    keep_quantized: keep the routed experts' matrices stored as MXFP4 or block-FP8 as stored
      (default False: dequantized to `dtype`): each is a `QuantizedArray` ("mxfp4" or "fp8")
      holding the checkpoint's bytes, whose `dequantize()` is the matrix `keep_quantized=False`
      loads, `dtype` its logical dtype. Its values and scales are each placed with the
      matrix's spec. Other tensors, and float checkpoints, load as without it.

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
  block = _open(fn, path)
  layer = _check_layer(fn, block, layer)
  cfg = _config(fn, block, layer, dtype, expert_axis, expert_tensor_axis, expert_fsdp_axis)
  mesh = _mesh(fn, mesh, cfg)
  _check_tensors(fn, block, layer, cfg)
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
  block = _open(fn, path)
  layers = block.moe_layers()
  if not layers:
    raise ValueError(f"{fn}: {str(path)!r} has no MoE layer")
  cfg = _config(fn, block, layers[0], dtype, expert_axis, expert_tensor_axis, expert_fsdp_axis)
  mesh = _mesh(fn, mesh, cfg)
  for i in layers:
    _check_tensors(fn, block, i, cfg)
  kept = _kept(fn, block, layers, cfg, keep_quantized)
  params = _build(fn, block, cfg, layers, mesh, True, kept)
  return _with_format(cfg, kept), params


def moe_layers(path: str | os.PathLike) -> list[int]:
  """Returns the decoder layer indices whose block is MoE, by config.json."""
  return _open("moe_layers", path).moe_layers()


def _write_formats(fn, block, lay, cfg, quantized, like):
  """{tensor name: format} of a layout whose leaves are `QuantizedArray`s, raising unless
  each leaf is one in the format the checkpoint stores its tensor in."""
  shapes = _leaf_shapes(cfg)
  names = list(lay.tensors(shapes))
  try:
    want = lay.kept(block.ckpt, shapes)
  except ValueError as e:
    raise ValueError(
      f"{fn}: params holds QuantizedArrays where {str(like)!r} stores {e}; dequantize them "
      f"first (ms.dequantize_experts(params))"
    ) from None
  for k in lay.leaves:
    got = quantized[k].fmt if k in quantized else None
    if got != want.get(k):
      held = f"a QuantizedArray in {got!r}" if got else "a float array"
      how = f"as {want[k]!r}" if k in want else f"as {block.ckpt.meta(names[0])[1]} floats"
      raise ValueError(
        f"{fn}: params.{k} is {held}, but {str(like)!r} stores tensor {names[0]!r} {how}: a "
        f"QuantizedArray is written only in the format its tensor is stored in; pass float "
        f"leaves (ms.dequantize_experts(params)) to have them quantized as stored"
      )
  return dict.fromkeys(names, want[lay.leaves[0]])


def save_moe_layers(
  path: str | os.PathLike,
  cfg: MoEConfig,
  params: MoEParams,
  *,
  like: str | os.PathLike,
  layers: list[int] | None = None,
) -> None:
  """Writes MoE blocks back in a checkpoint's own tensor names, dtypes and layouts.

  The folder `path` gets `like`'s config.json and every tensor of `like` that is not in the
  MoE blocks written (copied as stored), plus the MoE tensors from `params`, each in the
  dtype `like` stores it in and transformed back to its layout (transposed, fused, DBRX's
  rows). MXFP4 tensors of `like` are written as MXFP4 `_blocks`/`_scales` again
  (`mxfp4.quantize`), keeping `like`'s scale of each block of 32 whose values it still
  represents exactly (so unchanged weights come back bit for bit) and choosing a fresh
  scale, values rounded to nearest even, for a block that changed. Block-FP8 tensors are
  written as F8_E4M3 with `like`'s `weight_scale_inv` (unchanged weights bit for bit; a
  value beyond 448 times its block's scale raises). config.json keeps its
  `quantization_config`. A `QuantizedArray` leaf (`keep_quantized=True`) is written as its
  bytes, values and scales, in the format `like` stores its tensor in, which it must be.

  Args:
    path: the output folder (created; must not be `like`).
    cfg: the `MoEConfig` of `params` (as loaded).
    params: `MoEParams` with every leaf stacked on a leading axis of len(layers), e.g. from
      `load_moe_layers`; each array must be fully addressable by this process.
    like: the checkpoint folder the blocks came from.
    layers: the decoder layers of the stack (default None: every MoE layer of `like`).

  Raises:
    ValueError: `path` is `like`, the stack length differs from len(layers), a block-FP8
      value does not fit its stored scale, a `QuantizedArray` in a format other than the one
      `like` stores its tensor in ("int8", MXFP4 where `like` stores FP8 or floats, ...), or
      as `load_moe_layer` for `like`.
  """
  fn = "save_moe_layers"
  block = _open(fn, like)
  if Path(path).resolve() == Path(like).resolve():
    raise ValueError(f"{fn}: path must differ from like (got {str(path)!r} for both)")
  layers = block.moe_layers() if layers is None else list(layers)
  layers = [_check_layer(fn, block, i) for i in layers]
  if not isinstance(params, MoEParams):
    raise TypeError(f"{fn}: params must be a MoEParams (got {type(params).__name__})")
  leaves = _leaves(params, is_leaf=is_quantized)
  for k, a in leaves.items():
    if a.ndim == 0 or a.shape[0] != len(layers):
      raise ValueError(
        f"{fn}: params.{k} must be stacked on a leading axis of {len(layers)} layers "
        f"{layers} (got shape {tuple(a.shape)})"
      )
    if any(
      isinstance(x, jax.Array) and not x.is_fully_addressable
      for x in (a.arrays() if is_quantized(a) else [a])
    ):
      raise ValueError(
        f"{fn}: params.{k} must be fully addressable by this process to be written (gather "
        f"it first, e.g. jax.experimental.multihost_utils.process_allgather)"
      )
  floats = {k: a for k, a in leaves.items() if not is_quantized(a)}
  quantized = {k: a for k, a in leaves.items() if is_quantized(a)}
  moe, shards = set(), []
  for pos, i in enumerate(layers):
    _check_tensors(fn, block, i, cfg)
    arrays = {k: np.asarray(jax.device_get(a[pos])) for k, a in floats.items()}
    kept = {
      k: tuple(np.asarray(jax.device_get(x[pos])) for x in q.arrays()) for k, q in quantized.items()
    }
    shard = {}
    for lay in block.at(i):
      if any(k in quantized for k in lay.leaves):
        fmts = _write_formats(fn, block, lay, cfg, quantized, like)
        for name, (values, scales) in lay.write_kept(kept).items():
          tensors = stored_kept(name, fmts[name], values, scales)
          moe.update(tensors)
          shard.update(tensors)
        continue
      for name, a in lay.write(arrays).items():
        _, how = stored(block.ckpt, name)
        if how == "mxfp4":
          # The checkpoint's [out, in] order; `like`'s scales kept where the block fits them.
          like_scales = block.ckpt.read(name + "_scales")
          blocks, scales = quantize_mxfp4(np.swapaxes(a, -1, -2), like_scales)
          moe.update({name + "_blocks", name + "_scales"})
          shard[name + "_blocks"], shard[name + "_scales"] = blocks, scales
        elif how == "fp8":
          scale = block.ckpt.read(name + "_scale_inv")
          moe.update({name, name + "_scale_inv"})
          shard[name] = fp8.quantize(name, a, scale, fp8_block(block.ckpt))
          shard[name + "_scale_inv"] = scale
        else:
          moe.add(name)
          shard[name] = np.asarray(a, DTYPES[block.ckpt.meta(name)[1]])
    shards.append(shard)
  rest = {}
  for name, file in block.ckpt.files.items():
    if name not in moe:
      rest.setdefault(file, {})[name] = block.ckpt.read(name)
  write_folder(path, block.ckpt.config, [*rest.values(), *shards])
