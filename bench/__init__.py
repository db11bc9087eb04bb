"""Benchmarks of moe_shard (run as modules from the repo root, e.g. `python -m bench.gmm`)."""
