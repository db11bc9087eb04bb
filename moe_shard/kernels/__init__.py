"""The grouped matmul and its backends (internal; the public names are re-exported by
`moe_shard`: `grouped_matmul`, `BACKENDS`, `PLATFORM_BACKENDS`).

    grouped_matmul.py    `grouped_matmul(x_MD, w_GDF, group_sizes_G, impl=...)`, the backend
                         table `BACKENDS` and the choice per platform `PLATFORM_BACKENDS`
    tiled.py             "tiled": power-of-two row tiles in `while_loop`s (CPU, any platform)
    tpu.py               "megablox": JAX's megablox Pallas kernels (TPU)
    tpu_tiling.py        megablox's tiles and each TPU generation's VMEM (no Pallas import)
    gpu.py               "mosaic_gpu": JAX's Mosaic GPU Pallas kernels (Hopper GPUs)
    pallas.py            what the two Pallas backends share
    tokamax.py           "tokamax": tokamax's `ragged_dot` (optional package)
    tpu_quant.py         `quantized_gmm`: a Pallas TPU kernel on int8, fp8 or mxfp4 weights,
                         dequantized block by block in VMEM
    tpu_quant_tiling.py  its tiles, VMEM estimate and argument checks

Every backend does only the routed FLOPs, forward and backward. The Pallas modules (tpu,
tpu_quant, gpu, gpu_ws) are imported when their backend is first traced. Nothing here knows about
experts, routing or meshes: the dispatches call `grouped_matmul` on rows sorted by group.
"""
