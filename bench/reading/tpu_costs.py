"""What XLA's TPU cost model charges the layer's building blocks, in HBM bytes.

    python -m bench.tpu_costs [--topology v5e:2x4] [--out bench/results/tpu_v5e_op_costs.md]

Each op is compiled (not run) for one chip of the topology on this host, and its "bytes
accessed" (`cost_analysis()`) is set beside the bytes it must move: each operand read once
and the result written once. The roofline of `python -m bench --tpu` divides XLA's bytes by
the chip's HBM bandwidth, so these ratios decide which way of writing a step is cheaper
there. Shapes: one device's share of the benchmark's layer (8192 items, D=2048, F=4096,
bf16). Every figure is a compile-time estimate: nothing runs on a TPU.
"""

from __future__ import annotations

import argparse
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from bench.reading import tpu

M, D, F = 8192, 2048, 4096
BF, I32 = jnp.bfloat16, jnp.int32


def _ops():
  """name -> (fn, [(shape, dtype)], bytes it must move)."""
  mb = lambda *elems: sum(elems) * 2

  def fwd_bwd(f):
    def run(*args):
      *primals, dy = args
      y, vjp = jax.vjp(f, *primals)
      return y, *vjp(dy)

    return run

  swiglu = lambda x, g, u, d: (jax.nn.silu(x @ g) * (x @ u)) @ d
  return {
    "dot x[M,D] @ w[D,F], bf16 out": (
      lambda x, w: x @ w,
      [((M, D), BF), ((D, F), BF)],
      mb(M * D, D * F, M * F),
    ),
    "lax.ragged_dot, one group, bf16 out": (
      lambda x, w, g: jax.lax.ragged_dot(x, w, g, preferred_element_type=BF),
      [((M, D), BF), ((1, D, F), BF), ((1,), I32)],
      mb(M * D, D * F, M * F),
    ),
    "lax.ragged_dot, one group, f32 out + cast": (
      lambda x, w, g: jax.lax.ragged_dot(x, w, g, preferred_element_type=jnp.float32).astype(BF),
      [((M, D), BF), ((1, D, F), BF), ((1,), I32)],
      mb(M * D, D * F, M * F),
    ),
    "dot fwd+bwd (y, dx, dw)": (
      fwd_bwd(lambda x, w: x @ w),
      [((M, D), BF), ((D, F), BF), ((M, F), BF)],
      3 * mb(M * D, D * F, M * F),
    ),
    "dense SwiGLU fwd+bwd": (
      fwd_bwd(swiglu),
      [((M, D), BF), ((D, F), BF), ((D, F), BF), ((F, D), BF), ((M, D), BF)],
      9 * mb(M * D, D * F, M * F),
    ),
    "row gather x[idx]": (lambda x, i: x[i], [((M, D), BF), ((M,), I32)], mb(2 * M * D)),
    "row scatter out.at[idx].set(x)": (
      lambda x, i: jnp.zeros_like(x).at[i].set(x, mode="drop"),
      [((M, D), BF), ((M,), I32)],
      mb(2 * M * D),
    ),
    "row scatter-add into f32 [M/2, D]": (
      lambda x, i: jnp.zeros((M // 2, D), jnp.float32).at[i].add(x.astype(jnp.float32)),
      [((M, D), BF), ((M,), I32)],
      mb(M * D) + 2 * M // 2 * D * 4,
    ),
    "silu(g) * u": (lambda g, u: jax.nn.silu(g) * u, [((M, F), BF), ((M, F), BF)], mb(3 * M * F)),
  }


def measure(topology):
  dev = tpu.devices(topology)[:1]
  sharding = NamedSharding(jax.sharding.Mesh(np.array(dev), ("x",)), P())
  rows = []
  for name, (fn, shapes, ideal) in _ops().items():
    args = [jax.ShapeDtypeStruct(s, d, sharding=sharding) for s, d in shapes]
    ca = jax.jit(fn).lower(*args).compile().cost_analysis()
    ca = ca[0] if isinstance(ca, list) else ca
    xla = float(ca.get("bytes accessed", 0.0))
    rows.append(dict(op=name, xla_mb=xla / 1e6, ideal_mb=ideal / 1e6, ratio=xla / ideal))
    print(f"| {name} | {xla / 1e6:.0f} | {ideal / 1e6:.0f} | {xla / ideal:.2f} |", flush=True)
  return rows


def main(argv=None):
  argv = sys.argv[1:] if argv is None else argv
  p = argparse.ArgumentParser(prog="python -m bench.tpu_costs", description=__doc__.split("\n")[0])
  p.add_argument("--topology", default="v5e:2x4")
  p.add_argument("--out", default=None, help="write the table to this .md file")
  a = p.parse_args(argv)
  head = "| op | XLA bytes accessed, MB | bytes it must move, MB | ratio |\n|---|---|---|---|"
  print(head, flush=True)
  rows = measure(a.topology)
  if a.out:
    with open(a.out, "w") as f:
      f.write(
        f"# XLA's TPU cost model on the layer's building blocks ({a.topology}, one "
        f"chip): compile-time estimates\n\n`python -m bench.tpu_costs "
        f"{' '.join(argv)}`\n\n{__doc__.split(chr(10) + chr(10))[1]}\n\nJAX "
        f"{jax.__version__}.\n\n{head}\n"
        + "\n".join(
          f"| {r['op']} | {r['xla_mb']:.0f} | {r['ideal_mb']:.0f} | {r['ratio']:.2f} |"
          for r in rows
        )
        + "\n"
      )


if __name__ == "__main__":
  os.environ.setdefault("JAX_PLATFORMS", "cpu")
  main()
