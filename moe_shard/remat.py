"""Names of the MoE layer's intermediates, for rematerialisation (`jax.checkpoint`) policies.

Each name is attached with `jax.ad_checkpoint.checkpoint_name`; a policy such as
`jax.checkpoint_policies.save_only_these_names(*names)` saves the values it names and
recomputes everything else in the backward pass. The names are API (a renamed intermediate
would silently stop being saved): `tests/test_remat.py` checks each one appears in the layer's
jaxpr and changes what a policy saves.

    MOE_ROUTER_LOGITS   f32[T, E]  router logits (moe_layer)
    MOE_DISPATCH_RECV   f[M, D]    tokens as the expert devices receive them: the all_gather
                                   dispatch's gathered tokens, the all_to_all's received rows
    MOE_EXPERT_GATE     f[M, F]    x @ gate + its bias, of the gated experts (grouped)
    MOE_EXPERT_UP       f[M, F]    x @ up + its bias, of the gated experts and GeluMLP
    MOE_EXPERT_OUT      f[M, F]    each expert's output (h @ down + b; Linear's x @ w + b)
    MOE_DISPATCH_OUT    f32[T, F]  the dispatch's combined output, before the shared experts

f is the compute dtype (`MoEConfig.compute_dtype`): the sorting dispatches' grouped matmuls
accumulate in float32 and store their products in it. The masked-scan reference
(`dense_matmul`) keeps its expert products in float32.

Inside the all_to_all dispatch, the names within a round (received rows, expert outputs)
are visible in the jaxpr but no policy can save them: the rounds run in a `while_loop`
under a `custom_vjp` whose backward replays them. `MOE_DISPATCH_OUT` is the value a policy
keeps to skip that replay's forward when the layer is rematerialised.
"""

MOE_ROUTER_LOGITS = "moe_router_logits"
MOE_DISPATCH_RECV = "moe_dispatch_recv"
MOE_EXPERT_GATE = "moe_expert_gate"
MOE_EXPERT_UP = "moe_expert_up"
MOE_EXPERT_OUT = "moe_expert_out"
MOE_DISPATCH_OUT = "moe_dispatch_out"

CHECKPOINT_NAMES = (
  MOE_ROUTER_LOGITS,
  MOE_DISPATCH_RECV,
  MOE_EXPERT_GATE,
  MOE_EXPERT_UP,
  MOE_EXPERT_OUT,
  MOE_DISPATCH_OUT,
)
