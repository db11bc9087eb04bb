"""Benchmarks of moe_shard: `python -m bench` (bench/command/cli.py) and `python -m bench.gmm`.

The names below are shared by the CLI (which reads them before JAX starts) and the
modules that build the programs. The implementations are a table of their own,
`bench/cases/impls.py`.
"""

ROUTINGS = ("uniform", "zipf", "hot_expert", "one_device")
LEVELS = ("layer", "kernel")
MODES = ("fwd", "fwd_bwd")
# --placement: "none"; "static" (EPLB's packing of the case's own load, logical parameters:
# the layer fetches the replicas' weights and sums their gradients back, as in training);
# "served" (the same placement, slot-major parameters from `ms.replicate_experts`: what a
# server holds); "home" (`plan_placement(keep_home=True)`: only the redundant slots move);
# "step" (`placement="step"`, R / N redundant slots a device, planned in each step).
PLACEMENTS = ("none", "static", "served", "home", "step")
