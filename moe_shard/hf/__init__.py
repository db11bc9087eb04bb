"""Hugging Face checkpoints: load a model's MoE blocks into `MoEParams`, and save them back.

    from moe_shard import hf
    cfg, params = hf.load_moe_layer(path, layer, mesh=mesh)   # one MoE layer
    cfg, params = hf.load_moe_layers(path, mesh=mesh)         # all, stacked on axis 0
    cfg, params = hf.load_moe_layers(path, keep_quantized=True)  # MXFP4 / FP8 experts as stored
    hf.save_moe_layers(out, cfg, params, like=path)
    y_BSD, aux = ms.moe_layer(params, x_BSD, cfg, mesh=mesh)   # the model's MoE block

`path` is a model folder: config.json and safetensors (one file, or an index and shards).
Tensors are read lazily, a slice at a time, with no torch; pickle files are never opened.
gpt-oss's MXFP4 and the block-FP8 of DeepSeek-V3 and Qwen3 FP8 releases are dequantized on
load and quantized back on save; with `keep_quantized=True` the routed experts' matrices are
`QuantizedArray`s holding the stored bytes, which save writes back as they are. A float
checkpoint loads as floats: quantize it with `ms.quantize_experts(params, fmt)`.
The families (config.json `model_type`) are the keys of `FAMILIES` (`hf/families.py`).
"""

from moe_shard.hf.families import FAMILIES
from moe_shard.hf.io import bytes_read, reset_bytes_read
from moe_shard.hf.load import load_moe_layer, load_moe_layers, moe_layers
from moe_shard.hf.mxfp4 import dequantize as dequantize_mxfp4
from moe_shard.hf.mxfp4 import quantize as quantize_mxfp4
from moe_shard.hf.save import save_moe_layers

__all__ = [
  "FAMILIES",
  "bytes_read",
  "dequantize_mxfp4",
  "load_moe_layer",
  "load_moe_layers",
  "moe_layers",
  "quantize_mxfp4",
  "reset_bytes_read",
  "save_moe_layers",
]
