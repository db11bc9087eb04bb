"""Grouped matmul on one GPU: each backend against one dense matmul of the same routed FLOPs.

    JAX_PLATFORMS=cuda python -m bench.gpu [--repeats N] [--groups 8,32,128] [--out STEM]
    JAX_PLATFORMS=cuda python -m bench.gpu --sweep 32,128 [--out STEM]   # block configs

M=32768 rows, D=2048, F=4096 (`--shape`), bfloat16, G groups with uniform and skewed sizes
(one group holds half the rows, a quarter of the others are empty; `bench.kernel_runs.gmm.group_sizes`).
For each grouped-matmul backend that runs on a GPU ("mosaic_gpu": JAX's Hopper kernels,
`moe_shard.kernels.gpu`; "ragged_dot": `lax.ragged_dot`; "tiled": the while-loop kernel;
"tokamax": tokamax's ragged_dot, where it is installed; "auto": what the library picks
there) and for the PyTorch peer ("torch": `torch._grouped_mm`, `bench/peers/torch_peer.py`, where
PyTorch sees a CUDA device; "not run" with the reason elsewhere), it times the forward (y)
and forward+backward (y, dx, dw), and one dense [M, D] @ [D, F] matmul (cuBLAS through XLA)
with its backward: speed/dense is the dense time over the backend's, both medians of calls
timed in turns (a PyTorch call ends with `torch.cuda.synchronize()`).
`--sweep` times `mosaic_gpu_gmm` forward and forward+backward with each block config of
`SWEEP` (uniform sizes), each config's outputs (y; y, dx and dw) checked against the first
config's that ran. Nothing is estimated: every figure is a wall-clock time on the GPU found.
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from bench.cases import common
from bench.kernel_runs.gmm import group_sizes
from bench.peers import torch_peer
from moe_shard.kernels import gpu as gmm_gpu

gmm_lib = importlib.import_module("moe_shard.kernels.grouped_matmul")

SHAPE = (32768, 2048, 4096)  # M, D, F; `--shape` sets them
_WS = dict(warp_specialized=True)
# Block configs of `mosaic_gpu_gmm`; the first is the default, the others checked against it.
# Shared memory: max_concurrent_steps x (a CTA tile's block_m x block_k + block_k x its
# columns) x 2 bytes of bf16 and the epilogue's tiles, at most 227 KiB on Hopper. A
# warp-specialized CTA tile is block_m x 2 * block_n (dw: 2 * block_m x block_n).
SWEEP = [
  gmm_gpu.BlockConfig(128, 128, 64, 4, 4, epi_block_n=64, **_WS),
  gmm_gpu.BlockConfig(128, 128, 64, 4, 4),  # JAX's single-warpgroup kernels
  gmm_gpu.BlockConfig(128, 128, 64, 4, 8, epi_block_n=64, **_WS),
  gmm_gpu.BlockConfig(128, 128, 64, 3, 4, **_WS),
  gmm_gpu.BlockConfig(128, 128, 128, 2, 4, epi_block_n=64, **_WS),
]


def config_name(b):
  """A sweep row's name: kernels, block_m/block_n/block_k/max_concurrent_steps/grid_block_n,
  and the warp-specialized epilogue's columns."""
  sizes = "/".join(str(v) for v in b.kwargs().values())
  return f"ws {sizes} e{b.epi_block_n or b.block_n}" if b.warp_specialized else f"jax {sizes}"


def _backend(impl):
  return lambda x, w, gs: gmm_lib.grouped_matmul(x, w, gs, impl=impl)


def _programs(impl, mm=None):
  mm = _backend(impl) if mm is None else mm

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
  """max |got - want| over max(1, max |want|); for tuples (y, dx, dw) the largest of these."""
  if isinstance(want, (tuple, list)):
    return max(_max_err(g, w) for g, w in zip(got, want, strict=True))
  got, want = (
    torch_peer.to_numpy(a) if hasattr(a, "detach") else np.asarray(a, np.float32)
    for a in (got, want)
  )
  return float(np.max(np.abs(got - want)) / max(1.0, np.max(np.abs(want))))


def _inputs(G):
  M, D, F = SHAPE
  kx, kw, kdy = jax.random.split(jax.random.key(0), 3)
  x = jax.random.normal(kx, (M, D), jnp.bfloat16)
  dy = jax.random.normal(kdy, (M, F), jnp.bfloat16)
  w = (jax.random.normal(kw, (G, D, F), jnp.float32) / np.sqrt(D)).astype(jnp.bfloat16)
  return x, w, dy


def _measure(row, prog, dense_prog, args, repeats, ref=None, dense_args=None):
  """Compiles and times one program against the dense one; errors become the row's."""
  x, w, _, dy = args if dense_args is None else dense_args
  try:
    t0 = time.perf_counter()
    out = jax.block_until_ready(prog(*args))
    row["compile_s"] = time.perf_counter() - t0
    if ref is not None:
      row["max_err_vs_first"] = _max_err(out, ref)
    t_dense, t_impl = (
      t["median"]
      for t in common.time_in_turns([(dense_prog, (x, w[0], dy)), (prog, args)], repeats)
    )
    row.update(impl_ms=t_impl * 1e3, dense_ms=t_dense * 1e3, speed_vs_dense=t_dense / t_impl)
    return out
  except Exception as e:
    row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
    return None


def run(groups, impls, repeats, on_row=print, skews=("uniform", "skewed")):
  """Each backend at each G and each of `skews` (group sizes), fwd and fwd+bwd."""
  dense = _dense()
  for G in groups:
    x, w, dy = _inputs(G)
    for skew in skews:
      gs = jnp.asarray(group_sizes(G, skew, num_rows=SHAPE[0]))
      ref = None
      for impl in impls:
        args, not_run = (x, w, gs, dy), None
        if impl == "torch":  # the PyTorch peer, on the same values
          try:
            progs, args = torch_peer.grouped_mm_programs(x, w, gs, dy)
          except torch_peer.NotRun as err:
            not_run = f"not run: {err}"
        else:
          progs = _programs(impl)
        for mode in ("fwd", "fwd+bwd"):
          row = dict(G=G, skew=skew, impl=impl, mode=mode)
          if not_run:
            on_row(dict(row, error=not_run))
            continue
          out = _measure(
            row,
            progs[mode],
            dense[mode],
            args,
            repeats,
            ref=ref if mode == "fwd" else None,
            dense_args=(x, w, gs, dy),
          )
          if mode == "fwd" and ref is None and out is not None:
            ref = out
            row["max_err_vs_first"] = 0.0
          on_row(row)


def sweep(groups, repeats, on_row=print, peer=True):
  """`mosaic_gpu_gmm` with each block config of SWEEP, fwd and fwd+bwd, uniform sizes, and
  (`peer`) `torch._grouped_mm` on the same values where PyTorch sees a GPU."""
  dense = _dense()
  for G in groups:
    x, w, dy = _inputs(G)
    gs = jnp.asarray(group_sizes(G, "uniform", num_rows=SHAPE[0]))
    refs = {}  # per pass, the first config's outputs (y; y, dx, dw) that ran
    for blocks in SWEEP:
      progs = _programs(None, lambda x, w, gs, b=blocks: gmm_gpu.mosaic_gpu_gmm(x, w, gs, blocks=b))
      for mode in ("fwd", "fwd+bwd"):
        row = dict(G=G, skew="uniform", impl=config_name(blocks), mode=mode)
        out = _measure(row, progs[mode], dense[mode], (x, w, gs, dy), repeats, refs.get(mode))
        if mode not in refs and out is not None:
          refs[mode] = out
          row["max_err_vs_first"] = 0.0
        on_row(row)
    if peer:
      try:
        progs, args = torch_peer.grouped_mm_programs(x, w, gs, dy)
      except torch_peer.NotRun as err:
        on_row(dict(G=G, skew="uniform", impl="torch", mode="fwd", error=f"not run: {err}"))
        continue
      for mode in ("fwd", "fwd+bwd"):
        row = dict(G=G, skew="uniform", impl="torch", mode=mode)
        _measure(row, progs[mode], dense[mode], args, repeats, dense_args=(x, w, gs, dy))
        on_row(row)


HEADER = (
  "| G | sizes | impl | pass | impl ms | dense ms | speed/dense | max err vs first | "
  "compile s |\n|---|---|---|---|---|---|---|---|---|"
)


def _row_md(r):
  if "error" in r:
    return f"| {r['G']} | {r['skew']} | {r['impl']} | {r['mode']} | {r['error']} | | | | |"
  err = f"{r['max_err_vs_first']:.1e}" if "max_err_vs_first" in r else ""
  return (
    f"| {r['G']} | {r['skew']} | {r['impl']} | {r['mode']} | {r['impl_ms']:.3f} | "
    f"{r['dense_ms']:.3f} | {r['speed_vs_dense']:.2f} | {err} | {r['compile_s']:.1f} |"
  )


def main(argv=None):
  global SHAPE
  argv = sys.argv[1:] if argv is None else argv
  p = argparse.ArgumentParser(prog="python -m bench.gpu", description=__doc__.split("\n")[0])
  p.add_argument("--repeats", type=int, default=20)
  p.add_argument("--groups", default="8,32,128")
  p.add_argument(
    "--impls",
    default="auto,mosaic_gpu,tokamax,torch,ragged_dot,tiled",
    help="grouped-matmul backends (BACKENDS names and auto) and torch (torch._grouped_mm)",
  )
  p.add_argument(
    "--sizes", default="uniform,skewed", help="group sizes: uniform, skewed or both (default)"
  )
  p.add_argument(
    "--shape",
    default=",".join(map(str, SHAPE)),
    metavar="M,D,F",
    help="rows, model width, expert width (default %(default)s)",
  )
  p.add_argument(
    "--sweep",
    default=None,
    metavar="GROUPS",
    help="instead: mosaic_gpu's block configs (SWEEP) at these G, e.g. 32,128",
  )
  p.add_argument("--out", default=None, help="write STEM.json and STEM.md")
  a = p.parse_args(argv)
  try:
    SHAPE = tuple(int(v) for v in a.shape.split(","))
  except ValueError:
    SHAPE = ()
  if len(SHAPE) != 3 or min(SHAPE) < 1:
    p.error(f"--shape must be three positive integers M,D,F (got {a.shape!r})")
  info = common.machine_info()
  info["gpu"] = str(jax.devices()[0].device_kind)
  if torch_peer.unavailable() is None:
    info["torch"] = ", PyTorch " + importlib.import_module("torch").__version__
  print(f"# Grouped matmul on {info['gpu']} (JAX {info['jax']})\n", flush=True)
  print(HEADER, flush=True)
  t0 = time.perf_counter()
  rows = []

  def on_row(row):  # printed and written as it comes: a run cut short keeps its rows
    rows.append(row)
    print(_row_md(row), flush=True)
    info["seconds"] = time.perf_counter() - t0
    if a.out:
      _write(a, argv, info, rows)

  if a.sweep:
    sweep([int(g) for g in a.sweep.split(",")], a.repeats, on_row)
  else:
    skews = a.sizes.split(",")
    if not skews or any(k not in ("uniform", "skewed") for k in skews):
      p.error(f"--sizes must be uniform, skewed or both (got {a.sizes!r})")
    run([int(g) for g in a.groups.split(",")], a.impls.split(","), a.repeats, on_row, skews)


def _write(a, argv, info, rows):
  with open(a.out + ".json", "w") as f:
    json.dump(dict(info=info, argv=argv, rows=rows), f, indent=1)
  what = (
    "mosaic_gpu_gmm with each block config (jax: JAX's kernels, ws: the warp-specialized "
    "ones; block_m/block_n/block_k/max_concurrent_steps/grid_block_n, and the epilogue's "
    "columns), uniform sizes, and torch._grouped_mm. "
    if a.sweep
    else ""
  )
  with open(a.out + ".md", "w") as f:
    f.write(
      f"# Grouped matmul on one GPU: {info['gpu']}\n\n`python -m bench.gpu "
      f"{' '.join(argv)}`\n\nMeasured (wall clock, medians of {a.repeats} calls "
      f"timed in turns with the dense matmul) on {info['gpu']}, JAX {info['jax']}"
      f"{info.get('torch', '')}. M={SHAPE[0]}, D={SHAPE[1]}, F={SHAPE[2]}, bfloat16. "
      f"{what}speed/dense: the time of one dense "
      "[M, D] @ [D, F] matmul (fwd) or its fwd+bwd over the backend's. max err vs "
      "first: the forward's largest difference from the first impl's, over max|y|"
      f"{'; in a sweep, also of dx and dw (fwd+bwd) from the first config' if a.sweep else ''}."
      "\n\n" + HEADER + "\n" + "\n".join(_row_md(r) for r in rows) + "\n"
    )


if __name__ == "__main__":
  main()
