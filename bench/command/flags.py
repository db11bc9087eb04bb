"""The benchmark's command line: its flags (`parser`; no JAX needed). Presets are in
`presets.py`, the checks that turn the parsed flags into a run's settings in `checks.py`.
"""

from __future__ import annotations

import argparse

from bench.cases import models
from bench.command import distributed
from bench.command.presets import PRESETS

# --weights-format: a float name means the case's --dtype; the others are `ms.FORMATS`.
FLOAT_WEIGHTS = ("float32", "bfloat16")
QUANTIZED_WEIGHTS = ("int8", "fp8", "mxfp4")


# The first line of the CLI's docstring (bench/command/cli.py), which imports this module.
DESCRIPTION = "moe_shard benchmark: shard_map MoE against jit-only versions, on the devices found."


def parser():
  p = argparse.ArgumentParser(
    prog="python -m bench",
    description=DESCRIPTION,
    formatter_class=argparse.RawDescriptionHelpFormatter,
    epilog="Presets (flags given override them): "
    + "; ".join(
      f"{k}: T={v['tokens']} D={v['d_model']} F={v['d_ff']} E={v['experts']} "
      f"routing={v['routing']} levels={v['levels']}"
      for k, v in PRESETS.items()
    ),
  )
  g = p.add_mutually_exclusive_group()
  g.add_argument("--quick", action="store_true", help="small sizes, about a minute")
  g.add_argument("--sweep", action="store_true", help="the full matrix (tens of minutes)")
  g.add_argument(
    "--deepseek",
    action="store_true",
    help="DeepSeek-like layer: E=256, K=8, d_ff=128, sigmoid scores, 8 expert "
    "groups of which each token keeps 4, scaling 2.5 (T=2048, D=256 on CPU; "
    "with --tpu: T=32768, D=2048, d_ff=1024)",
  )
  g.add_argument(
    "--preset",
    choices=tuple(models.CONFIGS),
    help="a published model's MoE block (bench/cases/models.py): E, K, D, F, the router, the "
    "experts' FFN and biases, shared experts; layer level. Flags given override it",
  )
  p.add_argument(
    "--tpu",
    metavar="TOPOLOGY",
    help="compile for a TPU topology (e.g. v5e:2x4) without running; needs "
    "the tpu extra. Default sizes T=32768 D=2048 F=4096 bf16",
  )
  p.add_argument(
    "--hbm-table",
    type=int,
    metavar="N",
    default=0,
    help="with --tpu: for each program, the N ops and scopes that access the "
    "most HBM bytes (loops scaled; bench/reading/hbm.py)",
  )
  p.add_argument("-T", "--tokens", help="tokens in all (B*S); a comma list runs each")
  p.add_argument(
    "--scaling",
    action="store_true",
    help="also the scaling case: the layer at E=64, uniform, D=512, F=1024, "
    "T in 2048, 8192, 32768 (part of --sweep)",
  )
  p.add_argument("-D", "--d-model", type=int)
  p.add_argument("-F", "--d-ff", type=int, help="expert width (kernel: the matrix's F)")
  p.add_argument("-K", "--top-k", type=int)
  p.add_argument("-E", "--experts", help="comma-separated, e.g. 8,64")
  p.add_argument(
    "--mesh",
    help="EXPERTxDATA, e.g. 8x1, or named axes AXIS=SIZE,... from expert, tensor, data, "
    "expert first, laid out in the order given (e.g. expert=8,tensor=8: each expert's F "
    "split over tensor, MoEConfig.expert_tensor_axis; expert=8,data=8 --fsdp data). "
    "Tokens are split over every axis. Default: all devices on expert",
  )
  p.add_argument(
    "--fsdp",
    metavar="AXIS",
    help="store the last dimension of every expert weight matrix split over this --mesh axis "
    "(MoEConfig.expert_fsdp_axis; not expert or tensor), e.g. data. Layer level only",
  )
  p.add_argument(
    "--shared-experts",
    type=int,
    metavar="N",
    help="layer level: N shared SwiGLU experts of width F on every token "
    "(MoEConfig.num_shared_experts; default 0)",
  )
  p.add_argument(
    "--model-layers",
    type=int,
    default=0,
    metavar="L",
    help="also report, per device, the weights, gradients (the weights' dtype) and Adam "
    "state (2 x float32) of L such layers, from the parameters' shardings",
  )
  p.add_argument("--dtype", choices=FLOAT_WEIGHTS, help="default float32 (bfloat16 with --tpu)")
  p.add_argument(
    "--weights-format",
    help="comma-separated from " + ", ".join(FLOAT_WEIGHTS + QUANTIZED_WEIGHTS) + ": the routed "
    "experts' matrices as held; a float name means the case's --dtype (the default), int8, "
    "fp8 and mxfp4 quantized (MoEConfig.weights_format; fp8 needs D and F divisible by 128, "
    "mxfp4 by 32). Each format is a row of its own; rows that take float matrices only "
    "(jit_gshard_einsum, dense_limit, matmul_limit, torch_moe) run for the float one",
  )
  p.add_argument(
    "--adapters",
    metavar="RANKS",
    help="layer level: comma-separated LoRA ranks R put on every routed-expert matrix "
    "(ms.add_adapters; 0: none), each a row of its own, timed in turns with the others: "
    "e.g. 0,16 measures the adapters' extra time. Rows that take float matrices only "
    "(jit_gshard_einsum, dense_limit, matmul_limit, torch_moe) run without",
  )
  p.add_argument(
    "--param-layout",
    choices=("default", "program"),
    default="default",
    help="with --tpu: the layer's parameters (the kernel level's w) in the device's default "
    "layouts (the default), or in the layouts the compiled program picks (Layout.AUTO), as "
    "held after jax.device_put(params, compiled.input_formats[0][0]); rows say so in their "
    "weights column",
  )
  p.add_argument(
    "--expert-type",
    choices=("swiglu", "clamped_swiglu"),
    help="layer level: the experts' FFN (MoEConfig.expert_type; default swiglu; "
    "clamped_swiglu is gpt-oss's)",
  )
  p.add_argument(
    "--expert-bias",
    action="store_true",
    help="layer level: biases on the experts' matrices (MoEConfig.expert_bias)",
  )
  p.add_argument("--routing", help="comma-separated from uniform, zipf, hot_expert, one_device")
  p.add_argument("--zipf-s", type=float, default=1.2, help="Zipf exponent s > 0 (default 1.2)")
  p.add_argument(
    "--replicas",
    type=int,
    default=0,
    metavar="R",
    help="layer level: R redundant expert slots (S = E + R, divisible by the expert axis) "
    "for --placement (default 0)",
  )
  p.add_argument(
    "--placement",
    help="layer level, comma-separated from none, static, served, home, step (default none; "
    "static when --replicas is given): static = EPLB's packing of the case's own load on the "
    "logical parameters (the layer fetches the replicas' weights and sums their gradients "
    "back: training); served = that placement on slot-major parameters "
    "(ms.replicate_experts: a server's); home = plan_placement(keep_home=True); step = "
    "placement='step' with R / N redundant slots a device. Rows carry balancedness "
    "(mean/max rows a chip) and the busiest chip's rows",
  )
  p.add_argument("--impls", help="comma-separated from " + ", ".join(_impl_names()))
  p.add_argument("--levels", help="comma-separated from layer, kernel")
  p.add_argument("--modes", help="comma-separated from fwd, fwd_bwd")
  p.add_argument(
    "--repeats",
    type=int,
    help="timed runs per program after a warm-up, at most: a program whose runs are 3 or "
    "more and, the slowest aside, within 10%% of their median is done "
    "(bench.cases.common.SETTLE_RUNS, SETTLE_SPREAD)",
  )
  p.add_argument(
    "--capacity-factor",
    type=float,
    default=1.25,
    help="jit_gshard_einsum's capacity factor (default 1.25)",
  )
  p.add_argument(
    "--chunk-size",
    type=_chunk_size,
    help="all_to_all's slots per pair and round: C, or C_FIRST,C_OVERFLOW (round 0, then the"
    " overflow rounds; default: the library's)",
  )
  p.add_argument(
    "--devices",
    type=int,
    help="simulated CPU devices in all, when JAX finds only a CPU (default 8)",
  )
  p.add_argument("--seed", type=int, default=0)
  p.add_argument(
    "--out",
    metavar="STEM",
    help="write STEM.json, STEM.csv and STEM.md (machine and argv recorded)",
  )
  p.add_argument("--json", metavar="PATH")
  p.add_argument("--csv", metavar="PATH")
  p.add_argument("--plot", metavar="PNG", help="bar charts of time and bytes (matplotlib)")
  p.add_argument(
    "--system-malloc",
    action="store_true",
    help="keep glibc's malloc defaults (default on CPU: freed memory is reused, "
    "see bench/command/malloc.py)",
  )
  p.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
  p.add_argument(
    "--from-json",
    metavar="PATH[,PATH...]",
    help="measure nothing: print (and with --out/--csv/--plot, write) the tables "
    "and plot of a results file written before (several: their rows and commands in one)",
  )
  distributed.add_arguments(p)
  return p


def _chunk_size(text):
  """--chunk-size: "C" gives the int C, "C_FIRST,C_OVERFLOW" the pair (MoEConfig.chunk_size),
  parsed as moe_shard.maxtext's command line parses `moe_shard_chunk_size`."""
  from moe_shard import maxtext

  try:
    return maxtext.split_options(["x", f"moe_shard_chunk_size={text}"])[0]["chunk_size"]
  except ValueError:
    msg = f"expected C or C_FIRST,C_OVERFLOW, integers (got {text!r})"
    raise argparse.ArgumentTypeError(msg) from None


def _impl_names():
  from bench.cases.impls import BENCH_IMPLS  # imports jax, which is fine: no backend starts here

  return tuple(BENCH_IMPLS)
