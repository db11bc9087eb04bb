"""The CLI's presets: named sets of flags (`--quick`, `--tpu`, ...) and `--scaling`'s sweep."""

from __future__ import annotations

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
