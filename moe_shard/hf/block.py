"""One Hugging Face checkpoint opened for its MoE blocks: what loading and saving share.

`open_block` reads config.json and checks its `model_type` and `quantization_config`
against the family table (`hf.families`); the `Block` it returns names each MoE layer's
tensors (`Block.at`). `check_layer` and `check_tensors` raise unless a layer is an MoE layer
and every tensor of its block exists with the shape config.json implies. The leaf helpers
name the `MoEParams` leaves ("experts.gate_EDF") and give their float shapes, which the
layouts (`hf.layouts`) map to tensors.
"""

from __future__ import annotations

import dataclasses
import operator

import jax
import numpy as np

from moe_shard.hf import fp8
from moe_shard.hf.families import FAMILIES, Family, text_config
from moe_shard.hf.io import Checkpoint
from moe_shard.hf.layouts import BF16, fp8_block, stored
from moe_shard.params import moe_param_shapes

# The float dtypes of safetensors, by their header name.
DTYPES = {
  "F64": np.dtype(np.float64),
  "F32": np.dtype(np.float32),
  "F16": np.dtype(np.float16),
  "BF16": BF16,
}


@dataclasses.dataclass
class Block:
  """One checkpoint opened for the MoE blocks: its family, text config and block layouts."""

  ckpt: Checkpoint
  family: Family
  text: dict
  layouts: tuple = ()

  def num_layers(self):
    """The decoder layers, MoE or dense, by config.json."""
    return int(self.text[self.family.num_layers])

  def moe_layers(self):
    """The indices of the decoder layers whose block is MoE."""
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


def open_block(fn, path):
  """Opens the checkpoint folder `path`, raising unless its model_type and quantization are
  supported; `fn` names the caller in the errors."""
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
  return Block(ckpt, family, text, tuple(family.layouts(text)))


def leaf_name(path):
  """A leaf's name: its `MoEParams` path, e.g. "experts.gate_EDF"."""
  return jax.tree_util.keystr(path, simple=True, separator=".")


def named_leaves(tree, is_leaf=None):
  """{leaf name: leaf} of a `MoEParams` tree (`is_leaf` as `jax.tree_util`'s)."""
  return {leaf_name(p): a for p, a in jax.tree_util.tree_leaves_with_path(tree, is_leaf=is_leaf)}


def float_cfg(cfg):
  """`cfg` describing float expert matrices: the layouts map the matrices' logical shapes."""
  if getattr(cfg, "weights_format", None) is None:
    return cfg
  return dataclasses.replace(cfg, weights_format=None)


def leaf_shapes(cfg):
  """{leaf name: shape} of `cfg`'s params with float expert matrices."""
  return {k: s.shape for k, s in named_leaves(moe_param_shapes(float_cfg(cfg))).items()}


def check_layer(fn, block, layer):
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


def check_tensors(fn, block, layer, cfg):
  """Raises unless every tensor of layer `layer`'s block exists with the config's shape."""
  shapes = leaf_shapes(cfg)
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
