"""Save MoE blocks back into a Hugging Face checkpoint's own tensor names, dtypes and layouts.

`save_moe_layers` writes a folder like the checkpoint the blocks came from: its config.json,
its other tensors as stored, and the MoE tensors from `MoEParams`, each transformed back to
its layout (`hf.layouts`) and quantized back where the checkpoint stores MXFP4 or block-FP8.
`QuantizedArray` leaves (`keep_quantized=True`) are written as their bytes.
"""

from __future__ import annotations

import os
from pathlib import Path

import jax
import numpy as np

from moe_shard.config import MoEConfig
from moe_shard.hf import fp8
from moe_shard.hf.block import (
  DTYPES,
  check_layer,
  check_tensors,
  leaf_shapes,
  named_leaves,
  open_block,
)
from moe_shard.hf.io import write_folder
from moe_shard.hf.layouts import fp8_block, stored, stored_kept
from moe_shard.hf.mxfp4 import quantize as quantize_mxfp4
from moe_shard.params import MoEParams
from moe_shard.quant import is_quantized
from moe_shard.replicas import SlotParams


def _write_formats(fn, block, lay, cfg, quantized, like):
  """{tensor name: format} of a layout whose leaves are `QuantizedArray`s, raising unless
  each leaf is one in the format the checkpoint stores its tensor in."""
  shapes = leaf_shapes(cfg)
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
      `load_moe_layers`; each array must be fully addressable by this process. The
      logical experts: slot-major `SlotParams` are refused (`logical_params` first).
    like: the checkpoint folder the blocks came from.
    layers: the decoder layers of the stack (default None: every MoE layer of `like`).

  Raises:
    TypeError: `params` not `MoEParams`, or slot-major `SlotParams`.
    ValueError: `path` is `like`, the stack length differs from len(layers), a block-FP8
      value does not fit its stored scale, a `QuantizedArray` in a format other than the one
      `like` stores its tensor in ("int8", MXFP4 where `like` stores FP8 or floats, ...), or
      as `load_moe_layer` for `like`.
  """
  fn = "save_moe_layers"
  if not isinstance(params, MoEParams):
    raise TypeError(f"{fn}: params must be a MoEParams (got {type(params).__name__})")
  if isinstance(params, SlotParams):
    raise TypeError(
      f"{fn}: params must hold the logical experts [E, ...]; got slot-major SlotParams "
      f"([S, ...] replicas): write ms.logical_params(params, placement) instead"
    )
  block = open_block(fn, like)
  if Path(path).resolve() == Path(like).resolve():
    raise ValueError(f"{fn}: path must differ from like (got {str(path)!r} for both)")
  layers = block.moe_layers() if layers is None else list(layers)
  layers = [check_layer(fn, block, i) for i in layers]
  leaves = named_leaves(params, is_leaf=is_quantized)
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
    check_tensors(fn, block, i, cfg)
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
