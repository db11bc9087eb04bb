"""Grouped matmul on one GPU: each backend against one dense matmul of the same routed FLOPs.

    JAX_PLATFORMS=cuda python -m bench.gpu [--repeats N] [--groups 8,32,128] [--out STEM]

M=32768 rows, D=2048, F=4096, bfloat16, G groups with uniform and skewed sizes (one group
holds half the rows, a quarter of the others are empty; `bench.gmm.group_sizes`). For each
grouped-matmul backend that runs on a GPU ("ragged_dot": `lax.ragged_dot`; "tiled": the
while-loop kernel; "auto": what the library picks there) and for JAX's Hopper kernels
("mosaic_gpu": `pallas.ops.gpu.ragged_dot_mgpu` forward and dx, `transposed_ragged_dot_mgpu`
dw, wired here by hand), it times the forward (y) and forward+backward (y, dx, dw), and one
dense [M, D] @ [D, F] matmul (cuBLAS through XLA) with its backward: speed/dense is the dense
time over the backend's, both medians of calls timed in turns. Nothing is estimated: every
figure is a wall-clock time on the GPU found.
"""

from __future__ import annotations

import argparse
import functools
import importlib
import json
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from bench import common
from bench.gmm import group_sizes

gmm_lib = importlib.import_module("moe_shard.grouped_matmul")

M, D, F = 32768, 2048, 4096
MGPU = dict(block_m=128, block_n=128, block_k=64, max_concurrent_steps=4, grid_block_n=1)


def _mosaic_gpu(x_MD, w_GDF, gs_G):
  """JAX's Hopper ragged-dot kernels with a hand-written vjp (sm_90, equal dtypes)."""
  from jax.experimental.pallas.ops.gpu import ragged_dot_mgpu, transposed_ragged_dot_mgpu

  @jax.custom_vjp
  def f(x, w):
    return ragged_dot_mgpu.ragged_dot(x, w, group_sizes=gs_G, **MGPU)

  def fwd(x, w):
    return f(x, w), (x, w)

  def bwd(res, dy):
    x, w = res
    dy = dy.astype(x.dtype)
    dx = ragged_dot_mgpu.ragged_dot(dy, w, group_sizes=gs_G, transpose_rhs=True, **MGPU)
    dw = transposed_ragged_dot_mgpu.transposed_ragged_dot(x, dy, group_sizes=gs_G, **MGPU)
    return dx, dw

  f.defvjp(fwd, bwd)
  return f(x_MD, w_GDF)


def _backend(impl):
  if impl == "mosaic_gpu":
    return _mosaic_gpu
  return lambda x, w, gs: gmm_lib.grouped_matmul(x, w, gs, impl=impl)


def _programs(impl):
  mm = _backend(impl)

  def fwd(x, w, gs, dy):
    del dy
    return mm(x, w, gs)

  def fwd_bwd(x, w, gs, dy):
    y, vjp = jax.vjp(lambda x, w: mm(x, w, gs), x, w)
    return (y, *vjp(dy))

  return {"fwd": jax.jit(fwd), "fwd+bwd": jax.jit(fwd_bwd)}


def _dense():
  def fwd(x, w, dy):
    del dy
    return x @ w

  def fwd_bwd(x, w, dy):
    y, vjp = jax.vjp(lambda x, w: x @ w, x, w)
    return (y, *vjp(dy))

  return {"fwd": jax.jit(fwd), "fwd+bwd": jax.jit(fwd_bwd)}


def _max_err(got, want):
  got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
  return float(np.max(np.abs(got - want)) / max(1.0, np.max(np.abs(want))))


def run(groups, impls, repeats):
  kx, kw, kdy = jax.random.split(jax.random.key(0), 3)
  x = jax.random.normal(kx, (M, D), jnp.bfloat16)
  dy = jax.random.normal(kdy, (M, F), jnp.bfloat16)
  dense = _dense()
  rows = []
  for G in groups:
    w = (jax.random.normal(kw, (G, D, F), jnp.float32) / np.sqrt(D)).astype(jnp.bfloat16)
    for skew in ("uniform", "skewed"):
      gs = jnp.asarray(group_sizes(G, skew, num_rows=M))
      ref = None
      for impl in impls:
        progs = _programs(impl)
        for mode in ("fwd", "fwd+bwd"):
          row = dict(G=G, skew=skew, impl=impl, mode=mode)
          try:
            t0 = time.perf_counter()
            out = jax.block_until_ready(progs[mode](x, w, gs, dy))
            row["compile_s"] = time.perf_counter() - t0
            if mode == "fwd":
              if ref is None:
                ref = out
              row["max_err_vs_first"] = _max_err(out, ref)
            t_dense, t_impl = (t["median"] for t in common.time_in_turns(
                [(dense[mode], (x, w[0], dy)), (progs[mode], (x, w, gs, dy))], repeats))
            row.update(impl_ms=t_impl * 1e3, dense_ms=t_dense * 1e3,
                       speed_vs_dense=t_dense / t_impl)
          except Exception as e:  # noqa: BLE001 - a backend that does not run is a row too
            row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
          rows.append(row)
          print(_row_md(row), flush=True)
  return rows


HEADER = ("| G | sizes | impl | pass | impl ms | dense ms | speed/dense | max err vs first | "
          "compile s |\n|---|---|---|---|---|---|---|---|---|")


def _row_md(r):
  if "error" in r:
    return f"| {r['G']} | {r['skew']} | {r['impl']} | {r['mode']} | {r['error']} | | | | |"
  err = f"{r['max_err_vs_first']:.1e}" if "max_err_vs_first" in r else ""
  return (f"| {r['G']} | {r['skew']} | {r['impl']} | {r['mode']} | {r['impl_ms']:.3f} | "
          f"{r['dense_ms']:.3f} | {r['speed_vs_dense']:.2f} | {err} | {r['compile_s']:.1f} |")


def main(argv=None):
  argv = sys.argv[1:] if argv is None else argv
  p = argparse.ArgumentParser(prog="python -m bench.gpu", description=__doc__.split("\n")[0])
  p.add_argument("--repeats", type=int, default=20)
  p.add_argument("--groups", default="8,32,128")
  p.add_argument("--impls", default="auto,ragged_dot,mosaic_gpu,tiled")
  p.add_argument("--out", default=None, help="write STEM.json and STEM.md")
  a = p.parse_args(argv)
  info = common.machine_info()
  info["gpu"] = str(jax.devices()[0].device_kind)
  print(f"# Grouped matmul on {info['gpu']} (JAX {info['jax']})\n", flush=True)
  print(HEADER, flush=True)
  t0 = time.perf_counter()
  rows = run([int(g) for g in a.groups.split(",")], a.impls.split(","), a.repeats)
  info["seconds"] = time.perf_counter() - t0
  if a.out:
    with open(a.out + ".json", "w") as f:
      json.dump(dict(info=info, argv=argv, rows=rows), f, indent=1)
    with open(a.out + ".md", "w") as f:
      f.write(f"# Grouped matmul on one GPU: {info['gpu']}\n\n`python -m bench.gpu "
              f"{' '.join(argv)}`\n\nMeasured (wall clock, medians of {a.repeats} calls "
              f"timed in turns with the dense matmul) on {info['gpu']}, JAX {info['jax']}. "
              f"M={M}, D={D}, F={F}, bfloat16. speed/dense: the time of one dense "
              "[M, D] @ [D, F] matmul (fwd) or its fwd+bwd over the backend's. max err vs "
              "first: the forward's largest difference from the first impl's, over max|y|."
              "\n\n" + HEADER + "\n" + "\n".join(_row_md(r) for r in rows) + "\n")


if __name__ == "__main__":
  main()
