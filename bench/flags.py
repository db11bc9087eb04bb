"""The benchmark's command line: flags, presets and their checks (no JAX needed).

A bad flag or an impossible combination raises `UsageError`: one line on stderr, exit 2.
"""

from __future__ import annotations

import argparse
import math
import os

from bench import LEVELS, MODES, PLACEMENTS, ROUTINGS, models

PRESETS = {
  # jit_ragged_dot is left out of the default (XLA replicates its work on every device, so
  # it is the slowest by far); --impls or --sweep include it. Up to 5 repeats: 8 simulated
  # devices share the host's cores, and a program whose runs spread is timed more
  # (`common.time_in_turns`'s settle).
  "default": dict(
    tokens=8192,
    d_model=512,
    d_ff=1024,
    top_k=2,
    experts="8",
    routing="uniform",
    levels="layer",
    modes="fwd,fwd_bwd",
    repeats=5,
    impls="all_to_all,all_gather,jit_masked_scan,jit_gshard_einsum,dense_limit",
  ),
  "quick": dict(
    tokens=2048,
    d_model=256,
    d_ff=512,
    top_k=2,
    experts="8",
    routing="uniform",
    levels="layer",
    modes="fwd,fwd_bwd",
    repeats=2,
  ),
  "sweep": dict(
    tokens=4096,
    d_model=256,
    d_ff=512,
    top_k=2,
    experts="8,64",
    routing="uniform,zipf,hot_expert,one_device",
    levels="kernel,layer",
    modes="fwd,fwd_bwd",
    repeats=2,
    scaling=True,
  ),
  "tpu": dict(
    tokens=32768,
    d_model=2048,
    d_ff=4096,
    top_k=2,
    experts="8,64",
    routing="uniform",
    levels="layer,kernel",
    modes="fwd,fwd_bwd",
    repeats=0,
  ),
  # DeepSeek-like granularity: many small experts, K=8, group-limited sigmoid routing.
  "deepseek": dict(
    tokens=2048,
    d_model=256,
    d_ff=128,
    top_k=8,
    experts="256",
    routing="uniform",
    levels="layer",
    modes="fwd,fwd_bwd",
    repeats=2,
    router=dict(score_func="sigmoid", num_groups=8, top_k_groups=4, routed_scaling=2.5),
  ),
  "tpu_quick": dict(
    tokens=2048,
    d_model=256,
    d_ff=512,
    top_k=2,
    experts="8",
    routing="uniform",
    levels="layer,kernel",
    modes="fwd,fwd_bwd",
    repeats=0,
  ),
}


# Cost against work: the layer at E=64 for growing T (part of --sweep; --scaling alone).
SCALING = dict(
  tokens=(2048, 8192, 32768),
  d_model=512,
  d_ff=1024,
  experts=(64,),
  routing=("uniform",),
  levels=("layer",),
)


# --weights-format: a float name means the case's --dtype; the others are `ms.FORMATS`.
FLOAT_WEIGHTS = ("float32", "bfloat16")
QUANTIZED_WEIGHTS = ("int8", "fp8", "mxfp4")


class UsageError(Exception):
  """A bad flag or an impossible combination: one line on stderr, exit code 2."""


def parser():
  from bench import cli, distributed

  p = argparse.ArgumentParser(
    prog="python -m bench",
    description=cli.__doc__.split("\n")[0],
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
    help="a published model's MoE block (bench/models.py): E, K, D, F, the router, the "
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
    "most HBM bytes (loops scaled; bench/hbm.py)",
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
    "(bench.common.SETTLE_RUNS, SETTLE_SPREAD)",
  )
  p.add_argument(
    "--capacity-factor",
    type=float,
    default=1.25,
    help="jit_gshard_einsum's capacity factor (default 1.25)",
  )
  p.add_argument("--chunk-size", type=int, help="all_to_all's slots per pair and round")
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
    "see bench/malloc.py)",
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


def _list(value, allowed, what):
  items = [v.strip() for v in value.split(",") if v.strip()]
  bad = [v for v in items if v not in allowed]
  if bad or not items:
    raise UsageError(
      f"unknown {what} {', '.join(bad) or repr(value)}; choose from {', '.join(allowed)}"
    )
  return items


def _ints(value, what):
  try:
    items = [int(v) for v in value.split(",")]
  except ValueError:
    raise UsageError(f"{what} must be comma-separated integers (got {value!r})") from None
  if any(v < 1 for v in items):
    raise UsageError(f"{what} must be >= 1 (got {value!r})")
  return items


def settings(a):
  """Merges the preset with the flags; validates what needs no JAX."""
  preset = (
    ("tpu_quick" if a.quick else "tpu")
    if a.tpu
    else ("quick" if a.quick else "sweep" if a.sweep else "default")
  )
  if a.deepseek:
    preset = "deepseek"
  s = dict(PRESETS[preset], preset=preset)
  if a.deepseek and a.tpu:
    s.update(tokens=32768, d_model=2048, d_ff=1024, repeats=0)
  if a.preset:
    s.update(models.settings(a.preset), model=a.preset, levels="layer")
  s.setdefault("router", {})
  for key in (
    "tokens",
    "d_model",
    "d_ff",
    "top_k",
    "experts",
    "routing",
    "levels",
    "modes",
    "repeats",
  ):
    if getattr(a, key) is not None:
      s[key] = getattr(a, key)
  s["tokens"] = _ints(str(s["tokens"]), "--tokens")
  for key in ("d_model", "d_ff", "top_k"):
    if s[key] < 1:
      raise UsageError(f"--{key.replace('_', '-')} must be >= 1 (got {s[key]})")
  s["scaling"] = bool(a.scaling or s.get("scaling"))
  if s["repeats"] < (0 if a.tpu else 1):
    raise UsageError(f"--repeats must be >= 1 (got {s['repeats']})")
  s["experts"] = _ints(str(s["experts"]), "--experts")
  s["routing"] = _list(s["routing"], ROUTINGS, "routing")
  s["levels"] = _list(s["levels"], LEVELS, "level")
  s["modes"] = _list(s["modes"], MODES, "mode")
  names = _impl_names()
  s["impls"] = _list(a.impls or s.get("impls") or ",".join(names), names, "impl")
  s["dtype"] = a.dtype or ("bfloat16" if a.tpu else "float32")
  if a.hbm_table and not a.tpu:
    raise UsageError("--hbm-table needs --tpu (it reads a compiled TPU program)")
  if a.param_layout != "default" and not a.tpu:
    raise UsageError("--param-layout needs --tpu (host and GPU programs take the default)")
  if a.hbm_table < 0:
    raise UsageError(f"--hbm-table must be >= 0 (got {a.hbm_table})")
  if a.capacity_factor <= 0:
    raise UsageError(f"--capacity-factor must be > 0 (got {a.capacity_factor})")
  if a.chunk_size is not None and a.chunk_size < 1:
    raise UsageError(f"--chunk-size must be >= 1 (got {a.chunk_size})")
  if not (math.isfinite(a.zipf_s) and a.zipf_s > 0):
    raise UsageError(f"--zipf-s must be a finite number > 0 (got {a.zipf_s})")
  if a.replicas < 0:
    raise UsageError(f"--replicas must be >= 0 (got {a.replicas})")
  default = "static" if a.replicas else "none"
  s["placements"] = _list(a.placement or default, PLACEMENTS, "placement")
  s["replicas"] = a.replicas
  placed = [p for p in s["placements"] if p != "none"]
  if placed and "kernel" in s["levels"]:
    raise UsageError("--placement is a layer setting: --levels layer only")

  outputs = [("--json", a.json, a.json), ("--csv", a.csv, a.csv), ("--plot", a.plot, a.plot)]
  if a.out is not None:
    outputs += [("--out", a.out, a.out + ext) for ext in (".json", ".csv", ".md")]
  for flag, value, path in outputs:
    if value is not None:
      _check_writable(flag, value, path)
  if a.num_processes < 1:
    raise UsageError(f"--num-processes must be >= 1 (got {a.num_processes})")
  if a.devices is not None and a.devices < 1:
    raise UsageError(f"--devices must be >= 1 (got {a.devices})")
  axes = dict(mesh_axes(a.mesh)) if a.mesh is not None else {EXPERT_AXIS: None}
  s["expert_tensor_axis"] = TENSOR_AXIS if TENSOR_AXIS in axes else None
  s["expert_fsdp_axis"] = a.fsdp
  if a.fsdp is not None and (a.fsdp not in axes or a.fsdp in (EXPERT_AXIS, TENSOR_AXIS)):
    others = [n for n in axes if n not in (EXPERT_AXIS, TENSOR_AXIS)]
    raise UsageError(
      f"--fsdp must name a --mesh axis other than {EXPERT_AXIS} and {TENSOR_AXIS} "
      f"(got {a.fsdp!r}; such axes here: {', '.join(others) or 'none'})"
    )
  if (s["expert_tensor_axis"] or a.fsdp) and "kernel" in s["levels"]:
    raise UsageError(
      "a tensor axis or --fsdp splits the experts' SwiGLU weights: --levels layer only "
      "(the kernel level runs one [D, F] matrix per expert)"
    )
  if a.shared_experts is not None and a.shared_experts < 0:
    raise UsageError(f"--shared-experts must be >= 0 (got {a.shared_experts})")
  s["shared_experts"] = s.get("shared_experts", 0) if a.shared_experts is None else a.shared_experts
  if s["shared_experts"] and "kernel" in s["levels"]:
    raise UsageError("--shared-experts is a layer setting: --levels layer only")
  if a.model_layers < 0:
    raise UsageError(f"--model-layers must be >= 0 (got {a.model_layers})")
  s["model_layers"] = a.model_layers
  s["weights_formats"] = weights_formats(a.weights_format, s["dtype"])
  quantized = [f for f in s["weights_formats"] if f in QUANTIZED_WEIGHTS]
  takes = _quantized_impl_names()
  if quantized and not any(i in takes for i in s["impls"]):
    raise UsageError(
      f"--weights-format {','.join(quantized)} needs an impl that takes quantized matrices "
      f"(from {', '.join(takes)}; got --impls {','.join(s['impls'])})"
    )
  s["adapter_ranks"] = adapter_ranks(a.adapters)
  if any(s["adapter_ranks"]) and "kernel" in s["levels"]:
    raise UsageError("--adapters puts adapters on the layer's experts: --levels layer only")
  if any(s["adapter_ranks"]) and not any(i in takes for i in s["impls"]):
    raise UsageError(
      f"--adapters needs an impl of the library's layer (from {', '.join(takes)}; got "
      f"--impls {','.join(s['impls'])})"
    )
  s["expert_type"] = a.expert_type or s.get("expert_type", "swiglu")
  s["expert_bias"] = a.expert_bias or s.get("expert_bias", False)
  if (s["expert_type"] != "swiglu" or s["expert_bias"]) and "kernel" in s["levels"]:
    raise UsageError(
      "--expert-type and --expert-bias are layer settings: --levels layer only "
      "(the kernel level runs one [D, F] matrix per expert)"
    )
  return s


def adapter_ranks(value):
  """The ranks of `--adapters`, in order without repeats ([0]: none, when `value` is None)."""
  if value is None:
    return [0]
  ranks = []
  for item in value.split(","):
    try:
      r = int(item)
    except ValueError:
      raise UsageError(f"--adapters takes comma-separated ranks >= 0 (got {value!r})") from None
    if r < 0:
      raise UsageError(f"--adapters takes comma-separated ranks >= 0 (got {value!r})")
    ranks.append(r)
  return list(dict.fromkeys(ranks))


def weights_formats(value, dtype):
  """The formats of `--weights-format`, in order without repeats: the float names as
  `dtype` (float weights in the case's dtype), the quantized ones as given; [dtype] when
  `value` is None."""
  if value is None:
    return [dtype]
  items = _list(value, FLOAT_WEIGHTS + QUANTIZED_WEIGHTS, "--weights-format")
  return list(dict.fromkeys(dtype if f in FLOAT_WEIGHTS else f for f in items))


def _check_writable(flag, value, path):
  """Raises unless the file `path` (written for `flag`'s `value`) can be written once the
  run ends: not a folder, in a folder that exists or can be made, writable."""
  if os.path.isdir(path):
    raise UsageError(f"{flag} would write {path}, which is a folder (got {value!r})")
  existing = os.path.dirname(os.path.abspath(path))
  while not os.path.exists(existing):
    existing = os.path.dirname(existing)
  if not os.path.isdir(existing) or not os.access(existing, os.W_OK | os.X_OK):
    raise UsageError(
      f"{flag} must be in a folder that exists or can be made and written "
      f"(got {value!r}: {existing} is not a writable folder)"
    )


# The mesh axes `--mesh` can name (`ms.EXPERT`, `ms.DATA`, and the expert tensor axis).
EXPERT_AXIS, DATA_AXIS, TENSOR_AXIS = "expert", "data", "tensor"


def mesh_axes(spec):
  """The mesh of `--mesh`, as ((name, size), ...) in layout order.

  "8x1" -> (("expert", 8), ("data", 1)); "expert=8,tensor=8" -> (("expert", 8), ("tensor",
  8)). Named axes come from expert, tensor and data, each at most once, expert first (the
  benchmark's host accounting numbers devices expert-major).

  Raises:
    UsageError: any other spec.
  """
  if "=" not in spec:
    try:
      n_e, n_d = (int(v) for v in spec.split("x"))
    except ValueError:
      n_e = n_d = 0
    if n_e < 1 or n_d < 1:
      raise UsageError(
        f"--mesh must be EXPERTxDATA with positive sizes, e.g. 8x1, or named axes, e.g. "
        f"expert=8,tensor=8 (got {spec!r})"
      )
    return ((EXPERT_AXIS, n_e), (DATA_AXIS, n_d))
  names = (EXPERT_AXIS, TENSOR_AXIS, DATA_AXIS)
  axes = []
  for item in spec.split(","):
    name, _, size = item.partition("=")
    name = name.strip()
    try:
      size = int(size)
    except ValueError:
      size = 0
    if name not in names or size < 1:
      raise UsageError(
        f"--mesh axes must be AXIS=SIZE with AXIS from {', '.join(names)} and SIZE >= 1 "
        f"(got {item!r} in {spec!r})"
      )
    axes.append((name, size))
  seen = [n for n, _ in axes]
  if len(set(seen)) < len(seen) or seen[0] != EXPERT_AXIS:
    raise UsageError(f"--mesh must name each axis at most once, {EXPERT_AXIS} first (got {spec!r})")
  return tuple(axes)


def _impl_names():
  from bench.impls import BENCH_IMPLS  # imports jax, which is fine: no backend starts here

  return tuple(BENCH_IMPLS)


def _quantized_impl_names():
  from bench.impls import BENCH_IMPLS

  return tuple(k for k, v in BENCH_IMPLS.items() if v.quantized)
