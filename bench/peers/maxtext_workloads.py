"""MaxText training workloads whose step time was measured on a TPU and published: their
configurations and XLA flags as published, the measured figures with their sources, and the
arithmetic that turns a published TFLOP/s into a step time (`bench/peers/maxtext_train.py`
compiles them, `bench/calibration.py` reads them). Pure Python: no JAX, no MaxText.
"""

from __future__ import annotations

import dataclasses

RECIPES = "https://github.com/AI-Hypercomputer/tpu-recipes/blob"
MAXTEXT = "https://github.com/AI-Hypercomputer/maxtext/blob"

# MaxText's benchmarks/xla_flags_library.py, at the commit each workload names.
_MOE_VMEM_LIMIT = " --xla_tpu_scoped_vmem_limit_kib=81920"
_CF_FOR_ALL_GATHER = (
  " --xla_tpu_enable_async_collective_fusion=true"
  " --xla_tpu_enable_async_collective_fusion_fuse_all_gather=true"
  " --xla_tpu_enable_async_collective_fusion_multiple_steps=true"
  " --xla_tpu_overlap_compute_collective_tc=true"
  " --xla_enable_async_all_gather=true"
)
_DATA_PARALLEL_OVERLAP = (
  " --xla_tpu_enable_data_parallel_all_reduce_opt=true"
  " --xla_tpu_data_parallel_opt_different_sized_ops=true"
)
_SPARSECORE_RS_AG_AR = (
  " --xla_tpu_enable_async_collective_fusion_fuse_all_gather=false"
  " --xla_tpu_enable_async_collective_fusion_fuse_all_reduce=false"
  " --xla_tpu_enable_async_collective_fusion_fuse_reduce_scatter=false"
  " --xla_tpu_enable_sparse_core_collective_offload_all_gather=true"
  " --xla_tpu_enable_sparse_core_collective_offload_reduce_scatter=true"
  " --xla_tpu_enable_sparse_core_collective_offload_all_reduce=true"
  " --xla_tpu_enable_all_gather_offload_tracing=true"
  " --xla_tpu_enable_reduce_scatter_offload_tracing=true"
  " --xla_tpu_enable_all_reduce_offload_tracing=true"
  " --xla_tpu_use_tc_device_shape_on_sc=true"
  " --xla_sc_enable_instruction_fusion=false"
  " --xla_sc_disjoint_spmem=false"
  " --xla_sc_disable_megacore_partitioning=true"
  " --2a886c8_chip_config_name=megachip_tccontrol"
)
_HOST_OFFLOAD = (
  " --xla_tpu_enable_all_experimental_scheduler_features=true"
  " --xla_tpu_enable_scheduler_memory_pressure_tracking=true"
  " --xla_tpu_host_transfer_overlap_limit=24"
  " --xla_tpu_aggressive_opt_barrier_removal=ENABLED"
  " --xla_lhs_prioritize_async_depth_over_stall=ENABLED"
  " --xla_tpu_enable_ag_backward_pipelining=true"
  " --xla_should_allow_loop_variant_parameter_in_chain=ENABLED"
  " --xla_should_add_loop_invariant_op_in_chain=ENABLED"
  " --xla_max_concurrent_host_send_recv=100"
  " --xla_tpu_scheduler_percent_shared_memory_limit=100"
  " --xla_latency_hiding_scheduler_rerun=2"
)
_LAYOUT_FOR_ALL_REDUCE_SCATTER = (
  " --xla_tpu_use_minor_sharding_for_major_trivial_input=true"
  " --xla_tpu_relayout_group_size_threshold_for_reduce_scatter=1"
  " --xla_tpu_assign_all_reduce_scatter_layout=true"
)


@dataclasses.dataclass(frozen=True)
class Dims:
  """The sizes of a decoder that MaxText's FLOP count reads (its model config)."""

  emb: int
  mlp: int  # each expert's hidden size
  layers: int
  heads: int
  kv_heads: int
  head_dim: int
  vocab: int
  experts: int
  top_k: int
  activations: int = 2  # SwiGLU: wi_0 and wi_1


MIXTRAL_8X7B = Dims(
  emb=4096,
  mlp=14336,
  layers=32,
  heads=32,
  kv_heads=8,
  head_dim=128,
  vocab=32000,
  experts=8,
  top_k=2,
)


# Fields both Trillium Mixtral-8x7B configs share (tpu-recipes-v0.1.2's
# maxtext_trillium_model_configs.py), less the profiling and GCS ones.
_TRILLIUM_MIXTRAL = {
  "per_device_batch_size": 12,
  "ici_fsdp_parallelism": -1,
  "max_target_length": 4096,
  "attention": "flash",
  "use_iota_embed": True,
  "dataset_type": "synthetic",
  "reuse_example_batch": 1,
  "enable_checkpointing": False,
  "sa_block_q": 2048,
  "sa_block_q_dkv": 2048,
  "sa_block_q_dq": 2048,
  "tokenizer_path": "assets/tokenizer.mistral-v1",
}


@dataclasses.dataclass(frozen=True)
class Workload:
  """A published MaxText training run: what to compile and what was measured.

  measured holds either step_s (a published step time) or tflops_per_device (a published
  TFLOP/s per device, from which `measured_step_s` derives the step), and source (where).
  """

  name: str
  model_name: str  # MaxText's model_name
  compile_topology: str  # MaxText's name of the slice, e.g. "v5p-128"
  topology: str  # bench.reading's, e.g. "v5p:4x4x4"
  params: dict  # MaxText config fields, as published
  xla_flags: str  # as published
  measured: dict
  config_source: str
  measured_with: str  # the code the published run used
  dims: Dims | None = None  # for a step derived from a published TFLOP/s


WORKLOADS = {
  w.name: w
  for w in (
    Workload(
      name="mixtral_8x7b_v5p_128",
      model_name="mixtral-8x7b",
      compile_topology="v5p-128",
      topology="v5p:4x4x4",
      params={
        "steps": 10,
        "per_device_batch_size": 36,
        "enable_checkpointing": False,
        "max_target_length": 4096,
        "dtype": "bfloat16",
        "weight_dtype": "bfloat16",
        "dataset_type": "synthetic",
        "attention": "flash",
        "tokenizer_path": "assets/tokenizer.mistral-v1",
      },
      xla_flags=(
        "--xla_tpu_enable_async_collective_fusion_fuse_all_gather=true"
        " --xla_tpu_megacore_fusion_allow_ags=false"
        " --xla_enable_async_collective_permute=true"
        " --xla_tpu_enable_ag_backward_pipelining=true"
        " --xla_tpu_enable_data_parallel_all_reduce_opt=true"
        " --xla_tpu_data_parallel_opt_different_sized_ops=true"
        " --xla_tpu_enable_async_collective_fusion=true"
        " --xla_tpu_enable_async_collective_fusion_multiple_steps=true"
        " --xla_tpu_overlap_compute_collective_tc=true"
        " --xla_enable_async_all_gather=true"
        " --xla_tpu_scoped_vmem_limit_kib=81920"
      ),
      measured={
        "tflops_per_device": 251.94,
        "mfu": 0.5489,
        "source": f"{MAXTEXT}/7534e5e21351665bd33d85eb6301e5d9c8f0972e/"
        "end_to_end/tpu/mixtral/Run_Mixtral.md",
      },
      config_source=f"{RECIPES}/0dfb6a6e8467315d306babaac4cf6aef52d448a1/"
      "training/v5p/Mixtral-8X7B-Maxtext/scripts/run_mixtral-8x7b.sh",
      measured_with="MaxText of July 2024 (its default dropless path: megablox)",
      dims=MIXTRAL_8X7B,
    ),
    Workload(
      name="mixtral_8x7b_dropped",
      model_name="mixtral-8x7b",
      compile_topology="v6e-256",
      topology="v6e:16x16",
      params={
        **_TRILLIUM_MIXTRAL,
        "remat_policy": "custom",
        "decoder_layer_input": "offload",
        "out_proj": "offload",
        "query_proj": "offload",
        "key_proj": "offload",
        "value_proj": "offload",
        "megablox": False,
        "sparse_matmul": False,
        "capacity_factor": 1.25,
      },
      xla_flags=(_MOE_VMEM_LIMIT + _CF_FOR_ALL_GATHER + _DATA_PARALLEL_OVERLAP).strip(),
      measured={
        "step_s": 13.484,
        "tflops_per_device": 302.311,
        "tokens_per_s_per_device": 3645.203,
        "source": f"{RECIPES}/40a2af1220af9615f50ca45c03494ebc795dcc3a/"
        "training/trillium/Mixtral-8x7B-MaxText/README.md",
      },
      config_source=f"{MAXTEXT}/tpu-recipes-v0.1.2/benchmarks/maxtext_trillium_model_configs.py",
      measured_with="MaxText tpu-recipes-v0.1.2 on JAX 0.5.2",
      dims=MIXTRAL_8X7B,
    ),
    Workload(
      name="mixtral_8x7b_dropless",
      model_name="mixtral-8x7b",
      compile_topology="v6e-256",
      topology="v6e:16x16",
      params={**_TRILLIUM_MIXTRAL, "remat_policy": "full", "megablox": True, "sparse_matmul": True},
      xla_flags=(_MOE_VMEM_LIMIT + _CF_FOR_ALL_GATHER + _DATA_PARALLEL_OVERLAP).strip(),
      measured={},  # no measured step of it is published
      config_source=f"{MAXTEXT}/tpu-recipes-v0.1.2/benchmarks/maxtext_trillium_model_configs.py",
      measured_with="not measured",
      dims=MIXTRAL_8X7B,
    ),
    Workload(
      name="deepseek3_671b_v5p_1024",
      model_name="deepseek3-671b",
      compile_topology="v5p-1024",
      topology="v5p:8x8x8",
      params={
        "ici_fsdp_parallelism": -1,
        "ici_tensor_parallelism": 1,
        "per_device_batch_size": 6,
        "max_target_length": 8192,
        "dtype": "bfloat16",
        "weight_dtype": "float32",
        "megablox": True,
        "sparse_matmul": True,
        "scan_layers": True,
        "use_custom_sort_vjp": True,
        "sa_block_q": 2048,
        "sa_block_kv": 2048,
        "sa_block_kv_compute": 2048,
        "sa_block_q_dkv": 2048,
        "sa_block_kv_dkv": 2048,
        "sa_block_kv_dkv_compute": 2048,
        "sa_block_q_dq": 2048,
        "sa_block_kv_dq": 2048,
        "remat_policy": "custom",
        "decoder_layer_input": "offload",
        "out_proj": "offload",
        "tile_batch_seq": 512,
        "tile_embed_dim": 1024,
        "tile_mlp_dim": 1024,
        "sa_use_fused_bwd_kernel": False,
        "dataset_type": "synthetic",
        "enable_checkpointing": False,
      },
      xla_flags=(
        _SPARSECORE_RS_AG_AR
        + _HOST_OFFLOAD
        + _LAYOUT_FOR_ALL_REDUCE_SCATTER
        + _DATA_PARALLEL_OVERLAP
        + _MOE_VMEM_LIMIT
        + " --xla_tpu_megacore_fusion_allow_ags=false"
        + " --xla_enable_async_collective_permute=true"
      ).strip(),
      measured={
        "step_s": 90.668,
        "tflops_per_device": 152.415,
        "tokens_per_s_per_device": 542.108,
        "source": f"{RECIPES}/7e88b6d146a00901446f8a11244d49a471d8242b/"
        "training/v5p/DeepSeek3-671B-MaxText/README.md",
      },
      config_source=f"{MAXTEXT}/3eb77db3c94580f56f1b738f8d254b03bd205e35/"
      "benchmarks/maxtext_v5p_model_configs.py",
      measured_with="MaxText 3eb77db on JAX 0.7.0",
    ),
  )
}


def flag_list(flags):
  """'--a=1 --b=2' -> ['--a=1', '--b=2'] (whitespace-separated, order kept)."""
  return flags.split()


def kept_flags(workload, dropped=()):
  """The workload's published XLA flags less those named in `dropped` (by name, no value).

  Raises:
    ValueError: a name in `dropped` is not among the workload's flags.
  """
  flags = flag_list(workload.xla_flags)
  names = {f.split("=", 1)[0].lstrip("-") for f in flags}
  unknown = sorted(set(dropped) - names)
  if unknown:
    raise ValueError(
      f"kept_flags: dropped must name flags of workload {workload.name!r}; "
      f"not among them: {', '.join(unknown)}"
    )
  return [f for f in flags if f.split("=", 1)[0].lstrip("-") not in set(dropped)]


# Published fields that today's MaxText spells otherwise: name -> today's fields, each set
# to the published value. megablox's one tiling (tm, tk, tn) became a tiling per matmul and
# pass (forward, lhs and rhs gradients of wi and wo), with the same defaults.
RENAMED = {
  f"tile_{dim}": tuple(f"{w}_tile_{p}_{dim}" for w in ("wi", "wo") for p in ("fwd", "dlhs", "drhs"))
  for dim in ("batch_seq", "embed_dim", "mlp_dim")
}


def _config_value(v):
  """A config value as MaxText's command line spells it."""
  if isinstance(v, bool):
    return "true" if v else "false"
  return str(v)


def config_overrides(workload, changes=None, **extra):
  """The `key=value` arguments of MaxText's train_compile for a workload.

  Args:
    workload: a `Workload`.
    changes: {field: value} changed from the published config (default None: none).
    **extra: fields set for the compile only (compile_topology and the like are added here).

  Returns:
    list[str]: model_name, compile_topology, compile_topology_num_slices, the published
    fields (with `changes` applied; a field of `RENAMED` under today's names), then `extra`,
    as `key=value`.
  """
  fields = {
    "model_name": workload.model_name,
    "compile_topology": workload.compile_topology,
    "compile_topology_num_slices": 1,
    **workload.params,
    **(changes or {}),
    **extra,
  }
  out = {}
  for k, v in fields.items():
    out.update(dict.fromkeys(RENAMED.get(k, (k,)), v))
  return [f"{k}={_config_value(v)}" for k, v in out.items()]


def maxtext_tflops_per_device(dims, per_device_batch_size, max_target_length):
  """Training TFLOPs per device of one step, as MaxText counted them when the published
  Mixtral figures were measured (`calculate_tflops_training_per_device` of July 2024 to
  tpu-recipes-v0.1.2): matmul FLOPs of every weight times 3 (forward and backward), the
  router's over every expert, K experts' FFN per token, and attention's score and value
  products without the causal halving.

  Returns:
    float: TFLOPs (1e12) per device per step.
  """
  bs = per_device_batch_size * max_target_length  # tokens per device
  ffn = 2 * bs * dims.mlp * dims.emb * (dims.activations + 1)
  gate = 2 * bs * dims.emb * dims.experts
  moe = gate + dims.top_k * ffn
  qkv = 2 * bs * dims.emb * (dims.heads + 2 * dims.kv_heads) * dims.head_dim
  proj = 2 * bs * dims.emb * dims.heads * dims.head_dim
  embed = 2 * bs * dims.emb * dims.vocab
  attn = 4 * bs * max_target_length * dims.heads * dims.head_dim
  weights = ((moe + qkv + proj) * dims.layers + embed) * 3
  return (weights + attn * dims.layers * 3) / 1e12


def measured_step_s(workload):
  """The workload's measured step time in seconds and how it was obtained.

  A published step time is taken as it is; a published TFLOP/s per device gives
  MaxText's FLOPs per device of the published config over it.

  Returns:
    (float, str): the step time and a sentence saying where it comes from; (None, the
    reason) for a workload with no published measurement.
  """
  m = workload.measured
  if not m:
    return None, f"no measured step of {workload.name} is published"
  if "step_s" in m:
    return m["step_s"], f"published step time ({m['source']})"
  p = workload.params
  tflops = maxtext_tflops_per_device(
    workload.dims, p["per_device_batch_size"], p["max_target_length"]
  )
  step = tflops / m["tflops_per_device"]
  return step, (
    f"MaxText's {tflops:.1f} TFLOPs per device of the published config (per_device_batch_size "
    f"{p['per_device_batch_size']}, max_target_length {p['max_target_length']}, attention "
    f"not halved for causality, as MaxText counted then) over the published "
    f"{m['tflops_per_device']} TFLOP/s per device ({m['source']})"
  )
