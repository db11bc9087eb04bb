"""One process of the multi-process checkpoint test: `python tests/hf_mp_worker.py --path ...`.

Every process loads the checkpoint at `--path` with `hf.load_moe_layers` on a mesh over the
devices of every process, the expert axis across the processes, and writes the bytes it read
to `--out`.<process id>.json with the error `hf.save_moe_layers` gives for those leaves,
which no process holds whole; process 0 also writes the loaded leaves, gathered, to
`--out`.npz. `tests/test_multiprocess.py` checks both.
"""

from __future__ import annotations

import os
import sys

if __name__ == "__main__":  # before JAX is imported: 4 CPU devices per process
  os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
  os.environ["JAX_PLATFORMS"] = "cpu"
  sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import argparse
import json

import jax
import numpy as np


def main():
  from jax.experimental import multihost_utils

  from bench.command import distributed
  from moe_shard import hf

  parser = argparse.ArgumentParser()
  distributed.add_arguments(parser)
  parser.add_argument("--path", required=True, help="the checkpoint folder")
  parser.add_argument("--out", required=True, help="prefix of the files written")
  args = parser.parse_args()
  distributed.initialize(args, connect_s=60)
  mesh = jax.make_mesh((4, 2), ("expert", "data"), devices=jax.devices())
  assert len({d.process_index for d in mesh.devices[:, 0]}) == jax.process_count()
  hf.reset_bytes_read()
  cfg, params = hf.load_moe_layers(args.path, mesh=mesh)
  read = hf.bytes_read()
  try:  # each process holds half of the experts: the leaves are not fully addressable
    hf.save_moe_layers(f"{args.out}.saved{jax.process_index()}", cfg, params, like=args.path)
    save_error = None
  except ValueError as e:
    save_error = str(e)
  with open(f"{args.out}.{jax.process_index()}.json", "w") as f:
    json.dump(dict(bytes_read=read, save_error=save_error), f)
  leaves = {
    jax.tree_util.keystr(p, simple=True, separator="."): np.asarray(
      multihost_utils.process_allgather(a, tiled=True)
    )
    for p, a in jax.tree_util.tree_leaves_with_path(params)
  }
  if distributed.is_leader():
    np.savez(f"{args.out}.npz", **leaves)
  print(f"process {jax.process_index()} of {jax.process_count()}: done", flush=True)


if __name__ == "__main__":
  main()
