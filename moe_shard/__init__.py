"""moe_shard: Mixture-of-Experts layers with expert parallelism in JAX.

    Out[i] = sum_j G[i, j] * expert(W[B[i, j]], A[i])

Shape letters (array names carry them as a suffix, e.g. `x_TD`, `experts_TK`):

    T  tokens                     D  model width
    F  expert hidden (output)     E  experts
    L  local experts (E / N)      K  experts per token (top-k)
    C  chunk or capacity          N  devices on the expert axis
    B  batch                      S  sequence
    M  rows of a grouped matmul   G  groups of a grouped matmul
    I  (token, slot) items, T*K   Q  rows of a padded buffer (gmm_tiled)
    R  rank of an expert adapter

Inside a `shard_map` body the letters are per-device sizes.

Names for rematerialisation policies: `CHECKPOINT_NAMES` (remat.py). Framework modules, each
behind its optional extra and not imported here: `moe_shard.nnx.MoE` (Flax NNX) and
`moe_shard.equinox.MoE` (Equinox).

Quantized expert matrices (int8, FP8, MXFP4): `quantize_experts`, `dequantize_experts`,
`QuantizedArray` (quant.py). Fine-tuning (adapters.py): `trainable_mask`, `split_trainable`,
`merge_trainable`, and low-rank expert adapters `add_adapters`, `merge_adapters`, `Adapter`.

Four tables, one per concern: `ROUTERS` (routing.py), `DISPATCHES` (dispatch.py), the
expert FFNs `EXPERTS` (experts.py) and the grouped-matmul `BACKENDS` (grouped_matmul.py).
"""

from moe_shard.adapters import Adapter, add_adapters, merge_adapters
from moe_shard.balance import (
  expert_load,
  load_balancing_loss,
  router_z_loss,
  sequence_balance_loss,
  update_router_bias,
)
from moe_shard.config import MoEConfig
from moe_shard.dispatch import DISPATCHES, Dispatch
from moe_shard.exchange_rule import choose_impl
from moe_shard.experts import (
  EXPERTS,
  ClampedSwiGLU,
  ExpertFFN,
  GeGLU,
  GeluMLP,
  Linear,
  SwiGLU,
)
from moe_shard.kernels.grouped_matmul import BACKENDS, PLATFORM_BACKENDS, grouped_matmul
from moe_shard.layer import moe_layer
from moe_shard.local import moe_masked_scan, moe_ragged_dot
from moe_shard.matmuls import GroupedMatmul, MaskedMatmul
from moe_shard.parallel import moe_all_gather, moe_all_to_all, moe_ragged_all_to_all
from moe_shard.params import MoEParams, init_moe_params, moe_param_shapes, moe_param_specs
from moe_shard.placement import Placement
from moe_shard.planning import plan_placement
from moe_shard.quant import FORMATS, QuantizedArray, dequantize_experts, quantize_experts
from moe_shard.remat import (
  CHECKPOINT_NAMES,
  MOE_DISPATCH_OUT,
  MOE_DISPATCH_RECV,
  MOE_EXPERT_GATE,
  MOE_EXPERT_OUT,
  MOE_EXPERT_UP,
  MOE_ROUTER_LOGITS,
)
from moe_shard.replica_rule import StepPlacement
from moe_shard.replicas import (
  LoadWindow,
  ServedParams,
  SlotParams,
  layer_slots,
  logical_global_norm,
  logical_params,
  move_replicas,
  replicate_experts,
  stack_slots,
)
from moe_shard.route_groups import num_routing_groups
from moe_shard.routing import (
  ROUTERS,
  Router,
  Routing,
  capacity,
  drop_over_capacity,
  expert_choice_routing,
  top_k_routing,
)
from moe_shard.sharding import DATA, EXPERT, mesh_in_scope
from moe_shard.trainable import merge_trainable, split_trainable, trainable_mask

__all__ = [
  "BACKENDS",
  "CHECKPOINT_NAMES",
  "DATA",
  "DISPATCHES",
  "EXPERT",
  "EXPERTS",
  "FORMATS",
  "MOE_DISPATCH_OUT",
  "MOE_DISPATCH_RECV",
  "MOE_EXPERT_GATE",
  "MOE_EXPERT_OUT",
  "MOE_EXPERT_UP",
  "MOE_ROUTER_LOGITS",
  "PLATFORM_BACKENDS",
  "ROUTERS",
  "Adapter",
  "ClampedSwiGLU",
  "Dispatch",
  "ExpertFFN",
  "GeGLU",
  "GeluMLP",
  "GroupedMatmul",
  "Linear",
  "LoadWindow",
  "MaskedMatmul",
  "MoEConfig",
  "MoEParams",
  "Placement",
  "QuantizedArray",
  "Router",
  "Routing",
  "ServedParams",
  "SlotParams",
  "StepPlacement",
  "SwiGLU",
  "add_adapters",
  "capacity",
  "choose_impl",
  "dequantize_experts",
  "drop_over_capacity",
  "expert_choice_routing",
  "expert_load",
  "grouped_matmul",
  "init_moe_params",
  "layer_slots",
  "load_balancing_loss",
  "logical_global_norm",
  "logical_params",
  "merge_adapters",
  "merge_trainable",
  "mesh_in_scope",
  "moe_all_gather",
  "moe_all_to_all",
  "moe_layer",
  "moe_masked_scan",
  "moe_param_shapes",
  "moe_param_specs",
  "moe_ragged_all_to_all",
  "moe_ragged_dot",
  "move_replicas",
  "num_routing_groups",
  "plan_placement",
  "quantize_experts",
  "replicate_experts",
  "router_z_loss",
  "sequence_balance_loss",
  "split_trainable",
  "stack_slots",
  "top_k_routing",
  "trainable_mask",
  "update_router_bias",
]
