"""MoE layer benchmark: `moe_layer` forward and forward+backward per implementation.

Router + dispatch + SwiGLU experts + combine, as a model author runs it, on a mesh of the
devices found (8 simulated CPU devices on a CPU-only machine), tokens split over every mesh
axis. The default size is the one MaxText's MoE layer was measured at on this machine:
T=8192 tokens (B=8, S=1024), D=512, F=1024, K=2, SwiGLU, E in {8, 64}, float32.

    python -m bench.layer [--experts 8,64] [--mesh 8x1] [--repeats 5] [--quick]
"""

from __future__ import annotations

import os
import sys

if "jax" not in sys.modules and "xla_force_host_platform_device_count" not in os.environ.get(
    "XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                             " --xla_force_host_platform_device_count=8").strip()

import argparse  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import moe_shard as ms  # noqa: E402

from bench import common  # noqa: E402

IMPLS = ("all_to_all", "all_gather", "ragged_dot", "masked_scan")


def run(mesh, E, impls, *, B, S, D, F, K, repeats):
  """Times every impl at one E; returns a list of row dicts."""
  rows = []
  x = jax.device_put(jax.random.normal(jax.random.key(1), (B, S, D)),
                     NamedSharding(mesh, P(tuple(mesh.axis_names))))
  for impl in impls:
    cfg = ms.MoEConfig(d_model=D, d_ff=F, num_experts=E, top_k=K, impl=impl)
    params = ms.init_moe_params(jax.random.key(0), cfg, mesh=mesh)

    def fwd(p, x, cfg=cfg):
      y, aux = ms.moe_layer(p, x, cfg, mesh=mesh)
      return y, aux["aux_loss"]

    def loss(p, x, cfg=cfg):
      y, aux = ms.moe_layer(p, x, cfg, mesh=mesh)
      return jnp.mean(jnp.square(y)) + aux["aux_loss"]

    f, g = jax.jit(fwd), jax.jit(jax.grad(loss, argnums=(0, 1)))
    t_f, t_g = common.time_in_turns([(f, (params, x)), (g, (params, x))], repeats)
    row = dict(impl=impl, E=E, T=B * S, D=D, F=F, K=K, mesh=dict(mesh.shape),
               fwd_s=t_f, fwd_bwd_s=t_g)
    print(f"  {impl:>12} E={E:<3} fwd {t_f['median']*1e3:8.1f} ms (min {t_f['min']*1e3:.0f})"
          f"  fwd+bwd {t_g['median']*1e3:8.1f} ms (min {t_g['min']*1e3:.0f})", flush=True)
    rows.append(row)
  return rows


def to_markdown(rows, info, argv):
  r0 = rows[0]
  out = (f"# MoE layer benchmark\n\n`{' '.join(argv)}`\n\nT={r0['T']}, D={r0['D']}, "
         f"F={r0['F']}, K={r0['K']}, SwiGLU, float32, mesh {r0['mesh']}. Machine: "
         f"{info['cpu']}, {info['cores']} cores, JAX {info['jax']}, load average "
         f"{info['load_average_1min']:.1f} at start. Medians (min-max) over repeats.\n\n"
         "| impl | E | fwd ms | fwd+bwd ms | fwd+bwd / fwd |\n|---|---|---|---|---|\n")
  for r in rows:
    f, g = r["fwd_s"], r["fwd_bwd_s"]
    out += (f"| {r['impl']} | {r['E']} | {f['median']*1e3:.0f} ({f['min']*1e3:.0f}-"
            f"{f['max']*1e3:.0f}) | {g['median']*1e3:.0f} ({g['min']*1e3:.0f}-"
            f"{g['max']*1e3:.0f}) | {g['median']/f['median']:.2f} |\n")
  return out


def main(argv=None):
  argv = sys.argv[1:] if argv is None else argv
  p = argparse.ArgumentParser(prog="python -m bench.layer", description=__doc__.split("\n")[0])
  p.add_argument("--experts", default="8,64")
  p.add_argument("--impls", default=",".join(IMPLS))
  p.add_argument("--mesh", default="8x1", help="expert x data (default 8x1)")
  p.add_argument("--repeats", type=int, default=5)
  p.add_argument("--quick", action="store_true", help="T=2048, D=128, F=256, 3 repeats")
  p.add_argument("--out", default="bench/results/layer_cpu")
  a = p.parse_args(argv)
  B, S, D, F, K = 8, 1024, 512, 1024, 2
  if a.quick:
    B, S, D, F, a.repeats = 2, 1024, 128, 256, 3
  try:
    mesh = common.make_mesh(a.mesh)
  except ValueError as err:
    print(f"bench.layer: error: {err}", file=sys.stderr)
    return 2
  info = common.machine_info()
  rows = []
  for E in (int(v) for v in a.experts.split(",")):
    rows += run(mesh, E, a.impls.split(","), B=B, S=S, D=D, F=F, K=K, repeats=a.repeats)
  full = ["python", "-m", "bench.layer", *argv]
  md = to_markdown(rows, info, full)
  print(md)
  print("wrote", *common.write_results(a.out, rows, md, info, full))
  return 0


if __name__ == "__main__":
  sys.exit(main())
