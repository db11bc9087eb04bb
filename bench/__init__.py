"""Benchmarks of moe_shard: `python -m bench` (bench/cli.py) and `python -m bench.gmm`.

The names below are shared by the CLI (which reads them before JAX starts) and the
modules that build the programs. The implementations are a table of their own,
`bench/impls.py`.
"""

ROUTINGS = ("uniform", "zipf", "hot_expert", "one_device")
LEVELS = ("layer", "kernel")
MODES = ("fwd", "fwd_bwd")
