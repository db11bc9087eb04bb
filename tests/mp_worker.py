"""One process of the multi-process test: `python tests/mp_worker.py --process-id I ...`.

Every process builds the same seeded NumPy case, supplies only the shards on its own devices
(`jax.make_array_from_callback`), runs `moe_layer` forward and backward under `jax.jit` in
each of `CONFIGS` (all_to_all and all_gather, Auto and Explicit meshes, capacity mode) on
meshes over the devices of every process, and gathers the results to host;
process 0 writes them to an .npz. `tests/test_multiprocess.py` runs the same `run` in one
process and compares.

`--die after_init` or `--die during` makes process `--dying` exit abruptly after connecting,
or right after dispatching the first step, for the test that the others stop.
"""

from __future__ import annotations

import os
import sys

if __name__ == "__main__":  # before JAX is imported: 4 CPU devices per process
  os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
  os.environ["JAX_PLATFORMS"] = "cpu"
  sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import argparse
import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from cases import FAST_COMPILE
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import moe_shard as ms
from moe_shard import sharding

# gmm_impl="ragged_dot": the tiled kernel's loops stay within a device and would dominate the
# compile time; what crosses processes is the dispatch, its return and the gradient sums.
CFG = ms.MoEConfig(
  d_model=16,
  d_ff=32,
  num_experts=8,
  top_k=2,
  impl="all_to_all",
  gmm_impl="ragged_dot",
  num_shared_experts=1,
)
B, S = 8, 8  # T = 64 tokens
# The configurations every worker runs, in one process each: name -> (config, mesh shape
# (expert, data), axis type). The expert axis crosses the processes in each. In capacity
# mode the drops follow the global token order, so process 1's tokens (the later ones)
# lose their items to process 0's: C = ceil(0.5 * 64 * 2 / 8) = 8 items per expert.
CONFIGS = {
  "all_to_all-auto-4x2": (CFG, (4, 2), AxisType.Auto),
  "all_gather-explicit-4x2": (
    dataclasses.replace(CFG, impl="all_gather"),
    (4, 2),
    AxisType.Explicit,
  ),
  "all_to_all-capacity-explicit-2x4": (
    dataclasses.replace(CFG, capacity_factor=0.5),
    (2, 4),
    AxisType.Explicit,
  ),
}


def make_mesh(shape, axis_type=AxisType.Auto):
  """An ("expert", "data") mesh over every device of every process."""
  return jax.make_mesh(
    shape, ("expert", "data"), axis_types=(axis_type,) * 2, devices=jax.devices()
  )


def case(seed=0):
  """The global inputs as NumPy arrays: (params: MoEParams, x_BSD, ct_BSD)."""
  rng = np.random.default_rng(seed)
  params = jax.tree.map(
    lambda s: (rng.normal(size=s.shape) / np.sqrt(s.shape[-2])).astype(s.dtype),
    ms.moe_param_shapes(CFG),
  )
  x_BSD = rng.normal(size=(B, S, CFG.d_model)).astype(np.float32)
  ct_BSD = rng.normal(size=(B, S, CFG.d_model)).astype(np.float32)
  return params, x_BSD, ct_BSD


def shard(a, mesh, spec):
  """The global jax.Array of NumPy `a`, of which this process builds only its own shards."""
  return jax.make_array_from_callback(a.shape, NamedSharding(mesh, spec), lambda idx: a[idx])


@functools.partial(jax.jit, static_argnames=("cfg", "mesh"), compiler_options=FAST_COMPILE)
def step(params, x_BSD, ct_BSD, *, cfg, mesh):
  """Forward and backward of `sum(y * ct) + aux_loss`: dict(y, aux, dparams, dx)."""

  def loss(params, x_BSD):
    y_BSD, aux = ms.moe_layer(params, x_BSD, cfg, mesh=mesh)
    return jnp.sum(y_BSD * ct_BSD) + aux["aux_loss"], (y_BSD, aux)

  (dparams, dx_BSD), (y_BSD, aux) = jax.grad(loss, argnums=(0, 1), has_aux=True)(params, x_BSD)
  return dict(y=y_BSD, aux=aux, dparams=dparams, dx=dx_BSD)


def run(name, seed=0):
  """Places the case on config `name`'s mesh and dispatches `step` (asynchronously).

  Returns {f"{name}/{leaf path}": jax.Array}, with `place`: `sharding.place` of the NumPy
  tokens, which must come back unchanged.
  """
  cfg, shape, axis_type = CONFIGS[name]
  mesh = make_mesh(shape, axis_type)
  params, x_BSD, ct_BSD = case(seed)
  tok = P(tuple(mesh.axis_names))
  params = jax.tree.map(lambda a, s: shard(a, mesh, s), params, ms.moe_param_specs(cfg))
  out = step(params, shard(x_BSD, mesh, tok), shard(ct_BSD, mesh, tok), cfg=cfg, mesh=mesh)
  out["place"] = sharding.place(x_BSD, mesh, tok)
  return {
    f"{name}/{jax.tree_util.keystr(p, simple=True, separator='/')}": a
    for p, a in jax.tree_util.tree_leaves_with_path(out)
  }


def main():
  from jax.experimental import multihost_utils

  from bench.command import distributed

  parser = argparse.ArgumentParser()
  distributed.add_arguments(parser)
  parser.add_argument("--out", required=True, help=".npz that process 0 writes")
  parser.add_argument(
    "--heartbeat",
    type=int,
    default=distributed.HEARTBEAT_S,
    help="seconds without heartbeats before a process counts as dead",
  )
  parser.add_argument("--die", choices=("never", "after_init", "during"), default="never")
  parser.add_argument("--dying", type=int, default=1, help="the process that dies")
  args = parser.parse_args()
  distributed.initialize(args, heartbeat_s=args.heartbeat, connect_s=60)
  dies = args.die != "never" and args.process_id == args.dying
  if dies and args.die == "after_init":
    os._exit(1)
  results = {}
  for name, (_, shape, axis_type) in CONFIGS.items():
    mesh = make_mesh(shape, axis_type)
    assert len({d.process_index for d in mesh.devices[:, 0]}) == jax.process_count(), (
      f"the expert axis should cross processes: {mesh.devices}"
    )
    out = run(name)
    if dies:  # "during": the step is dispatched, its collectives under way
      os._exit(1)
    # Every process takes part in gathering the global arrays; each gets them whole.
    results.update(
      {k: np.asarray(multihost_utils.process_allgather(a, tiled=True)) for k, a in out.items()}
    )
  if distributed.is_leader():
    np.savez(args.out, **results)
  print(f"process {jax.process_index()} of {jax.process_count()}: done", flush=True)


if __name__ == "__main__":
  main()
