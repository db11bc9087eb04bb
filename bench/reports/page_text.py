"""The benchmarks page's words: its sections (which results files, under which titles), the
notes under each results file, and its introduction (`docs_page` builds the page)."""

from __future__ import annotations

# What each results file is, in page order; a file not listed comes last under its name.
SECTIONS = {
  "cpu_default": "The layer on 8 simulated CPU devices: the default case",
  "cpu_layer_e64": "The layer on CPU at E=64, T from 2048 to 32768",
  "cpu_deepseek": "A DeepSeek-like layer on CPU (E=256, K=8, sigmoid group-limited routing)",
  "cpu_sweep": "The CPU sweep: E, routing skew, layer and kernel",
  "gmm_cpu": "Grouped matmul on CPU",
  "gmm_tpu_v5e": "Grouped matmul compiled for one TPU v5e chip",
  "gpu_h100_gmm": "Grouped matmul on one H100",
  "gpu_h100_sweep": "Mosaic GPU block sweep on one H100",
  "gpu_h100_layer": "The layer on one H100",
  "gpu_h200_gmm": "Grouped matmul against torch._grouped_mm on one H200",
  "gpu_h200_layer": "The layer against a PyTorch MoE layer on one H200, E=8",
  "gpu_h200_layer_e64": "The layer against a PyTorch MoE layer on one H200, E=64",
  "gpu_h200_sweep": "Mosaic GPU block sweep on one H200: warp-specialized and JAX's kernels",
  "gpu_h200_sweep_transpose_w": "The warp-specialized forward with w transposed first, one H200",
  "gpu_h200_gmm_default": "Grouped matmul with its default blocks against torch._grouped_mm, H200",
  "gpu_h200_gmm_levers": "tokamax's ragged_dot against auto and torch._grouped_mm on one H200",
  "gpu_h200_layer_levers": "ragged_all_to_all on a 1x1 mesh against the local path, one H200",
  "tpu_calibration": "MaxText training steps measured on TPUs: the one estimate against them",
  "tpu_maxtext_models": "MaxText's Mixtral and DeepSeek steps with each MoE block, compiled for pods",
  "tpu_v5e_2x4_step": "The layer's training step compiled for TPU v5e 2x4",
  "tpu_v6e_2x4_step": "The layer's training step compiled for TPU v6e 2x4",
  "tpu_v5e_2x4_maxtext": "MaxText's RoutedMoE, the peer, compiled for TPU v5e 2x4",
  "tpu_v5e_2x4_gshard": "A GShard-style einsum layer's training step compiled for TPU v5e 2x4",
  "tpu_v6e_2x4_maxtext": "MaxText's RoutedMoE, the peer, compiled for TPU v6e 2x4",
  "tpu_v5e_ragged_step": "ragged_all_to_all against all_to_all, compiled for TPU v5e 2x4",
  "tpu_v5e_2x4_skew": "Replicated experts under Zipf routing, compiled for TPU v5e 2x4",
  "tpu_v6e_2x4_skew": "Replicated experts under Zipf routing, compiled for TPU v6e 2x4",
  "tpu_v5e_2x4_skew_decode": "Replicated experts at decode (Qwen3-30B-A3B), TPU v5e 2x4",
  "tpu_tpu7x_2x2x1_step": "The layer's training step compiled for TPU7x (Ironwood) 2x2x1",
  "tpu_v5p_2x2x2_step": "The layer's training step compiled for TPU v5p 2x2x2",
  "tpu_v6e_2x4_skew_exchanges": "Both exchanges under Zipf routing without a placement, TPU v6e 2x4",
  "tpu_v6e_2x4_skew_exchanges_quarter_rounds": (
    "Both exchanges under Zipf routing, all_to_all's overflow rounds a quarter of round 0, v6e"
  ),
  "tpu_tpu7x_2x2x1_skew": "Replicated experts under Zipf routing, compiled for TPU7x 2x2x1",
  "tpu_tpu7x_2x2x1_decode": "Decode: Qwen3-30B-A3B's layer, both exchanges, TPU7x 2x2x1",
  "tpu_v5e_2x4": "Every implementation compiled for TPU v5e 2x4",
  "tpu_v6e_2x4": "The layer at E=64 compiled for TPU v6e 2x4",
  "tpu_v6e_2x4_layer": "The layer compiled for TPU v6e 2x4",
  "tpu_v5e_2x4_deepseek": "A DeepSeek-like layer compiled for TPU v5e 2x4",
  "tpu_v5p_8x8x4_deepseek_T1M": (
    "DeepSeek-V3's layer size (T=1M, D=7168, F=2048, E=256, K=8) compiled for TPU v5p 8x8x4"
  ),
  "tpu_v5p_4x4x4_e64": "The layer at E=64 compiled for TPU v5p 4x4x4 (EP=64)",
  "tpu_v5p_4x4x4_mixtral_etp8": (
    "A Mixtral-8x22B-like layer on TPU v5p 4x4x4: EP8 x expert tensor parallelism 8"
  ),
  "tpu_v5p_4x4x4_mixtral_fsdp8": "A Mixtral-8x22B-like layer on TPU v5p 4x4x4: EP8 x FSDP8",
  "tpu_v5p_4x4x4_mixtral_fsdp8_step": (
    "A Mixtral-8x22B-like training step on TPU v5p 4x4x4, EP8 x FSDP8: both exchanges"
  ),
  "tpu_v5p_4x4x4_mixtral_replicated": (
    "A Mixtral-8x22B-like layer on TPU v5p 4x4x4: EP8, experts replicated over data"
  ),
  "tpu_v5p_8x8x4_deepseek_ep256": "A DeepSeek-V3-like layer on TPU v5p 8x8x4: EP=256",
  "tpu_v5p_8x8x4_deepseek_ep64": "A DeepSeek-V3-like layer on TPU v5p 8x8x4: EP=64 x data 4",
  "tpu_v5p_8x8x4_deepseek_ep64_fsdp4": (
    "A DeepSeek-V3-like layer on TPU v5p 8x8x4: EP=64 x FSDP 4 over data"
  ),
  "tpu_v5e_op_costs": "XLA's TPU cost model on the layer's building blocks",
  "tpu_v5e_2x4_quant": "Quantized experts (int8, fp8, mxfp4) against bf16, compiled for TPU v5e 2x4",
  "tpu_v5e_2x4_gpt_oss_quant": (
    "A gpt-oss-120b-like layer with MXFP4 and int8 experts, compiled for TPU v5e 2x4"
  ),
  "tpu_v5p_deepseek_quant": "A DeepSeek-V3-like layer with block-FP8 experts, compiled for TPU v5p",
  "tpu_v5e_2x4_adapters": (
    "Expert adapters (LoRA r=16) on the training step, bf16 and int8 experts, TPU v5e 2x4"
  ),
  "cpu_adapters": "Expert adapters (LoRA r=16) on the layer, 8 simulated CPU devices",
  "tpu_v5e_2x4_decode": (
    "Decode: four published models' layers at 8, 64 and 256 tokens per chip, TPU v5e 2x4"
  ),
  "tpu_v6e_2x4_decode": (
    "Decode: four published models' layers at 8, 64 and 256 tokens per chip, TPU v6e 2x4"
  ),
  "tpu_v5e_2x4_decode_dispatches": (
    "Decode: ragged_all_to_all against all_to_all for the four models, TPU v5e 2x4"
  ),
  "tpu_v6e_2x4_decode_dispatches": (
    "Decode: ragged_all_to_all against all_to_all for the four models, TPU v6e 2x4"
  ),
}


# A TPU file whose rows predate the one count (`bench/reading/estimate.py`).
OLD_TPU_COUNT = (
  "Counted before the one count: these rows carry no estimate (`estimate_s`); their lower "
  "bound, efficiency and bound columns are the old roofline, max(compute, HBM, ICI) with "
  "XLA's \"bytes accessed\" and loop bodies scaled by a correction on XLA's own figure, "
  "which over-counts in-place updates and VMEM prefetches and megablox's declared bytes."
)


# What a reader needs to know about a file beyond its rows.
NOTES = {
  "tpu_v5e_2x4_adapters": (
    "The adapters' cost on the training step, by the one count: bf16 experts 1.16x (E=8: "
    "9.70 against 8.35 ms) and 1.19x (E=64: 10.68 against 8.99) the step without them, int8 "
    "experts (frozen: no weight gradient) 1.25x (7.31 against 5.87) and 1.26x (8.24 against "
    "6.53), against a target of 1.1x; their FLOPs are 1% of the experts'. Each adapter "
    "matmul is a pass of its own over the rows it multiplies (x read again for x @ a, the "
    "low-rank products added to the base's outputs, the backward's dy read twice more): "
    "0.6-1.4 GB more HBM traffic per device. A grouped matmul that computes x @ a and adds "
    "(x @ a) @ b inside the base matmul's tiles would not make them."
  ),
  "cpu_adapters": (
    "Measured while other sessions loaded the 2 cores (load average 3.8 at the start, 7.4 at "
    "the end): float32 experts 1.09x (forward) and 1.16x (forward+backward) the layer without "
    "adapters; int8 experts 1.05x and 1.75x (its adapter row's runs spread from 1.8 to 3.5 s: "
    "1.43x on the fastest runs), where the frozen int8 layer computes no weight gradient."
  ),
  "tpu_v5e_2x4": (
    'jit_ragged_dot does not compile for TPU: its grouped matmul (`gmm_impl="auto"`, '
    "megablox's Pallas kernel) cannot be partitioned by XLA under `jax.jit` with sharded "
    "tokens ([dispatch guide](guides/dispatch.md)). jit_masked_scan's training step at E=64 "
    "needs 29 GB of temporaries, more than v5e's 16 GB. all_gather's at E=64 is a second "
    "command's row: it ran out of VMEM in the compile until megablox's tiles kept tgmm's "
    "transposed block within the limit (`tpu_tiling.tgmm_fits`)."
  ),
  "tpu_v6e_2x4": (
    "all_gather's training step is a second command's row: it ran out of VMEM in the "
    "compile until megablox's tiles kept tgmm's transposed block within the limit "
    "(`tpu_tiling.tgmm_fits`)."
  ),
  "tpu_calibration": (
    "The command runs from the repository root with `PYTHONPATH=.tpu-libs` (libtpu gives the "
    "chips' coordinates, for the collectives' latency) on the folders that "
    "`bench/peers/maxtext_train.py` wrote in a Python 3.12 environment with MaxText 0.2.5 "
    "(jax 0.12.0.1, libtpu 0.0.52); each row names its compile command. The programs are "
    "today's MaxText's, not the code each run was measured with (each row names that code), "
    "compiled with the published XLA flags less those this libtpu refuses. "
    "mixtral_8x7b_dropped's published per_device_batch_size 12 does not fit v6e's HBM on "
    "today's stack (32.00 GB of temporaries against 31.24 GB, as reported when it was "
    "first tried); 11 compiles (29.5 GB, `memory_analysis`). deepseek3_671b_v5p_1024's "
    "published per_device_batch_size 6 does not fit v5p's HBM here either (97.19 GB of "
    "temporaries against 95.73 GB); 4 compiles (80.5 GB), its estimate scaled by 6 / 4, "
    "which also scales the step's fixed parts (the FSDP gathers of the weights), so the "
    "scaled estimate is if anything high. Splash attention declares no FLOPs: the estimate "
    "counts the blocks its causal mask leaves (15.3 s of DeepSeek-V3's step at peak, "
    "scaled). What it does not see there is the host offload of the decoder layers' inputs "
    "(90 GB each way per step, scaled; no v5p host link figure is cited, so no time)."
  ),
  "tpu_v5e_2x4_maxtext": (
    "The command runs in the Python 3.12 environment with MaxText 0.2.5 that "
    "`bench/peers/maxtext_peer.py` describes, with `PYTHONPATH=.tpu-libs`, from the repository "
    "root. MaxText's forward+backward has no load-balance loss; the layer's rows "
    "(`tpu_v5e_2x4_step`, `tpu_v6e_2x4_step`) include one."
  ),
  "tpu_v6e_2x4_maxtext": (
    "The command runs in the Python 3.12 environment with MaxText 0.2.5 that "
    "`bench/peers/maxtext_peer.py` describes, with `PYTHONPATH=.tpu-libs`, from the repository "
    "root. MaxText's forward+backward has no load-balance loss; the layer's rows "
    "(`tpu_v5e_2x4_step`, `tpu_v6e_2x4_step`) include one."
  ),
  "gpu_h100_layer": (
    "The Mosaic GPU kernels are custom calls, whose FLOPs XLA's cost analysis does not count "
    "(flops x 0.00). The max err column compares with the benchmark's float32 host reference: "
    "XLA:GPU's default TF32 router matmul can pick other experts for near-tied tokens; "
    "`tests/test_gpu.py`, at `highest` precision, matches the float64 oracle."
  ),
  **dict.fromkeys(
    ("gpu_h200_layer", "gpu_h200_layer_e64"),
    "Run by `bash bench/gpu_h100.sh` on an H200 (which names its files after the card), the "
    "grouped matmul's kernels warp-specialized (`kernels/gpu_ws.py`). The Mosaic GPU "
    "kernels are custom calls, whose FLOPs XLA's cost analysis does not count (flops x 0.00). "
    "The rel err of the JAX rows (1.5e-2 and 1.9e-2, against 4.6e-3 for torch_moe) includes "
    "the tokens that XLA:GPU's default TF32 router logits send to another expert than the "
    "host's float32 routing; PyTorch computes float32 matmuls without TF32 by default.",
  ),
  "gpu_h200_gmm": (
    "Run by `bash bench/gpu_h100.sh` on an H200, the default kernels warp-specialized "
    "(`kernels/gpu_ws.py`), in the same run as `gpu_h200_sweep`, `gpu_h200_layer` and "
    "`gpu_h200_layer_e64`."
  ),
  "gpu_h100_sweep": "Block configs: block_m/block_n/block_k/max_concurrent_steps/grid_block_n.",
  "gpu_h200_sweep": (
    "Run by `bash bench/gpu_h100.sh` on an H200. ws: the warp-specialized kernels (each "
    "consumer warpgroup's block_m/block_n, block_k, stages, snake width, epilogue columns); "
    "jax: JAX's kernels (block_m/block_n/block_k/max_concurrent_steps/grid_block_n). The "
    "step's 130 s limit stopped it within G=128, after the first config's forward."
  ),
  "gpu_h200_sweep_transpose_w": (
    "A second run on the same H200, at commit f0b92c2: `wT` rows ran the forward on a copy "
    "of w transposed to [G, F, D] (an option since removed: no faster at G=8, slower at "
    "G=32 and 128). The step's limit stopped it within G=128."
  ),
  "gpu_h200_gmm_default": (
    "JAX's kernels with grid_block_n = 4 (128/128/64/4/4), their default before the "
    "warp-specialized kernels, from an earlier run."
  ),
  "gpu_h200_gmm_levers": (
    "Run by an earlier `bash bench/gpu_h100.sh --levers` (JAX's kernels, grid_block_n = 1). "
    "tokamax 0.0.17 ran with "
    "its heuristic config (no autotuning). The step's 60 s limit ended it while compiling "
    "G=128's `auto`: that G has no rows."
  ),
  "gpu_h200_layer_levers": (
    "Run by an earlier `bash bench/gpu_h100.sh --levers` (JAX's kernels, grid_block_n = 1): "
    "`ragged_all_to_all` on "
    "the 1x1 mesh takes the local path (no exchange)."
  ),
  "tpu_v6e_2x4_skew_exchanges_quarter_rounds": (
    "all_to_all's overflow rounds carry C_first / 4 slots per pair (`--chunk-size 1152,288`), "
    "against the default's C_first (1152, `tpu_v6e_2x4_skew_exchanges`): its rows run 9 and "
    "5 rounds (3 and 2 by default); the ragged dispatch's rows are as in that file."
  ),
  "tpu_v5p_8x8x4_deepseek_T1M": (
    "x (28 GiB in float32) is never drawn on the host: the routing the accounting counts is "
    "sampled one token shard at a time from the distribution of the router's logits "
    "(`bench.cases.build.sampled_top_k`). XLA gave no cost estimate of these programs (n/a)."
  ),
  **dict.fromkeys(
    (
      "tpu_v5p_4x4x4_mixtral_etp8",
      "tpu_v5p_4x4x4_mixtral_fsdp8",
      "tpu_v5p_4x4x4_mixtral_fsdp8_step",
      "tpu_v5p_4x4x4_mixtral_replicated",
      "tpu_v5p_8x8x4_deepseek_ep256",
      "tpu_v5p_8x8x4_deepseek_ep64",
      "tpu_v5p_8x8x4_deepseek_ep64_fsdp4",
    ),
    "x is never drawn on the host: the routing the accounting counts is sampled one token "
    "shard at a time (`bench.cases.build.sampled_top_k`). MiB/dev includes every collective: "
    "the tensor axis's row all-gather and partial-sum reduction, the FSDP weight gathers and "
    "gradient reductions, and the gradient all-reduces of replicated weights; x bound "
    "divides it by what moving the tokens alone must send. XLA gave no cost estimate of "
    "these programs (n/a).",
  ),
}


INTRO = """\
# Benchmarks

This page is generated by `python -m bench.docs_page` from the results files in
`bench/results/` (do not edit it by hand). Each section gives the command that made the
file, the machine it recorded and its rows. How to run the benchmark and what each column
means: `python -m bench --help`, and the [TPU and GPU guide](guides/tpu_gpu.md).

- How noisy each figure is:
  - Times on simulated CPU devices are wall-clock medians of 8 devices sharing the host's
    cores; "(min-max)" is their spread over the repeats of one run. Across runs they move
    with the machine and its load, and so do *efficiency* and *speed-up* (ratios of two
    times in one run) though less: the default case's section tabulates every run of its
    command with the ranges. Quote a ratio to a baseline run beside it, over a range of runs.
  - Counts (FLOPs, *flops x*, bytes, *x bound*, temp memory, rounds, drops) come from the
    compiled program and the routing: the same in every run of one tree and JAX version.
  - TPU estimates are computed, not timed: the same on every run of one tree, JAX and
    libtpu version.
  - GPU times are medians of one run on one H100 or H200, each program timed in turns with
    its dense baseline; no spread over runs is recorded.
- Every TPU figure is a compile-time estimate for the slice named: the program is compiled
  ahead of time on a CPU host and nothing runs. On 3 published MaxText training steps the
  estimate reads 0.85-1.04 of the measured time
  ([calibration](#maxtext-training-steps-measured-on-tpus-the-one-estimate-against-them)).
- *efficiency* is the dense limit's time over the row's (the routed FLOPs as plain dense
  matmuls on each device, no routing or communication); *x bound* the bytes sent per
  device over the least a dispatch must send (uniform routing / this routing).
- A results file records the tree it was measured on only through the git history.
"""
