"""Grouped matmul on one device: executed FLOPs, speed and memory against one dense matmul.

    python -m bench.gmm [--repeats N] [--quick] [--out bench/results]

For M=8192 rows, D=512, F=1024, float32, G in {8, 32, 128} groups with uniform and skewed
sizes (one group holds half the rows, a quarter of the other groups are empty, the rest
random), and each implementation, it reports forward ("fwd": y = gmm(x, w)) and
forward+backward ("fwd+bwd": y, dx, dw from `jax.vjp` with a given dy):

  * flops/routed: executed FLOPs (`measure.executed_flops`: XLA's cost_analysis with loop
    bodies counted once per iteration, iterations from `loop_trip_counts`) over the routed
    FLOPs 2*M*D*F (fwd) or 6*M*D*F (fwd+bwd).
  * speed/dense: median time of one dense [M, D] @ [D, F] matmul (fwd) or its fwd+bwd,
    over the median time of the implementation; both timed in turns in the same run.
    Target >= 0.6.
  * temp/(x+y): XLA's temp bytes (`memory_analysis`) over the bytes of x plus y. Target <= 4.

"ragged_dot" runs only for G=8: on CPU it is a dense product over all groups (G times the
FLOPs and a [G, M, F]-sized temporary), which at G=32 and 128 takes minutes and GBs.

The fwd+bwd rows also give "dw touch ms": the time to write a fresh f32[G, D, F] array (the
size of dw) on this machine. Every implementation pays it (dw is an output) and the dense
matmul does not (its dw is [D, F]); it bounds speed/dense at large G.

Writes the table and raw numbers to `<out>/gmm_cpu.md` and `<out>/gmm_cpu.json`.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from bench.cases import common
from bench.reading import measure


def _medians(fns_args, repeats):
  return [t["median"] for t in common.time_in_turns(fns_args, repeats)]


# The module, not the function `moe_shard.grouped_matmul` that the package re-exports.
gmm_lib = importlib.import_module("moe_shard.kernels.grouped_matmul")

M, D, F = 8192, 512, 1024
GROUPS = (8, 32, 128)
SKEWS = ("uniform", "skewed")
RAGGED_DOT_MAX_G = 8


def group_sizes(num_groups, skew, num_rows=M, seed=0):
  """Rows per group: equal, or one group with half the rows, a quarter empty, rest random."""
  G = num_groups
  if skew == "uniform":
    sizes = np.full(G, num_rows // G)
    sizes[: num_rows - sizes.sum()] += 1
    return sizes.astype(np.int32)
  rng = np.random.default_rng(seed)
  big = num_rows // 2
  rest = num_rows - big
  if G == 1:
    return np.array([num_rows], np.int32)
  p = rng.dirichlet(np.full(G - 1, 0.5))
  p[rng.choice(G - 1, (G - 1) // 4, replace=False)] = 0
  p /= p.sum()
  sizes = np.floor(p * rest).astype(np.int64)
  sizes[np.argmax(sizes)] += rest - sizes.sum()
  return np.concatenate([[big], sizes]).astype(np.int32)


def _fwd(impl):
  def f(x_MD, w_GDF, gs_G):
    return gmm_lib.grouped_matmul(x_MD, w_GDF, gs_G, impl=impl)

  return f


def _fwd_bwd(impl):
  def f(x_MD, w_GDF, gs_G, dy_MF):
    y_MF, vjp = jax.vjp(lambda x, w: gmm_lib.grouped_matmul(x, w, gs_G, impl=impl), x_MD, w_GDF)
    return (y_MF, *vjp(dy_MF))

  return f


def _dense_fwd(x_MD, w_DF):
  return x_MD @ w_DF


def _dense_fwd_bwd(x_MD, w_DF, dy_MF):
  y_MF, vjp = jax.vjp(lambda x, w: x @ w, x_MD, w_DF)
  return (y_MF, *vjp(dy_MF))


def run(repeats, groups):
  key = jax.random.PRNGKey(0)
  kx, kw, kdy = jax.random.split(key, 3)
  x_MD = jax.random.normal(kx, (M, D), jnp.float32)
  dy_MF = jax.random.normal(kdy, (M, F), jnp.float32)
  xy_bytes = (M * D + M * F) * 4
  rows = []
  dense = {"fwd": jax.jit(_dense_fwd), "fwd+bwd": jax.jit(_dense_fwd_bwd)}
  for G in groups:
    w_GDF = jax.random.normal(kw, (G, D, F), jnp.float32) / np.sqrt(D)
    touch = jax.jit(lambda s, G=G: jnp.zeros((G, D, F), jnp.float32) + s)
    (touch_s,) = _medians([(touch, (jnp.float32(1),))], repeats)
    for skew in SKEWS:
      gs_np = group_sizes(G, skew)
      gs_G = jnp.asarray(gs_np)
      tiles = gmm_lib.tile_sizes(M, *gmm_lib.default_tiles(M, G))
      trips = gmm_lib.loop_trip_counts(gs_np, M, tiles)
      impls = ["tiled"] + (["ragged_dot"] if G <= RAGGED_DOT_MAX_G else [])
      for impl in impls:
        for mode in ("fwd", "fwd+bwd"):
          if mode == "fwd":
            fn, args, routed = _fwd(impl), (x_MD, w_GDF, gs_G), 2 * M * D * F
            dargs = (x_MD, w_GDF[0])
          else:
            fn, args, routed = _fwd_bwd(impl), (x_MD, w_GDF, gs_G, dy_MF), 6 * M * D * F
            dargs = (x_MD, w_GDF[0], dy_MF)
          t0 = time.perf_counter()
          compiled = measure.compile_fn(fn, *args)
          compile_s = time.perf_counter() - t0
          flops = measure.executed_flops(compiled, trips if impl == "tiled" else None)
          mem = measure.memory_bytes(compiled)
          t_dense, t_impl = _medians(
            [(dense[mode], dargs), (compiled, args)],
            repeats if impl == "tiled" else max(2, repeats // 2),
          )
          row = {
            "G": G,
            "skew": skew,
            "impl": impl,
            "mode": mode,
            "flops_ratio": flops["executed"] / routed,
            "speed_ratio": t_dense / t_impl,
            "temp_ratio": mem["temp"] / xy_bytes,
            "impl_ms": t_impl * 1e3,
            "dense_ms": t_dense * 1e3,
            "executed_flops": flops["executed"],
            "routed_flops": routed,
            "temp_bytes": mem["temp"],
            "compile_s": compile_s,
            "dw_touch_ms": touch_s * 1e3 if mode == "fwd+bwd" else None,
            "tiles": list(tiles) if impl == "tiled" else None,
            "visits": trips if impl == "tiled" else None,
            "group_sizes": gs_np.tolist(),
          }
          rows.append(row)
          print(_row_md(row), flush=True)
    if G > RAGGED_DOT_MAX_G:
      print(
        f"  (ragged_dot skipped at G={G}: a dense product over all {G} groups, "
        f"{G}x the FLOPs, [G, M, F] = {G * M * F * 4 / 2**30:.1f} GiB temporaries)",
        flush=True,
      )
  return rows


HEADER = (
  "| G | sizes | impl | pass | flops/routed | speed/dense | temp/(x+y) | impl ms | "
  "dense ms | dw touch ms |\n|---|---|---|---|---|---|---|---|---|---|"
)


def _row_md(r):
  touch = f"{r['dw_touch_ms']:.0f}" if r["dw_touch_ms"] is not None else ""
  return (
    f"| {r['G']} | {r['skew']} | {r['impl']} | {r['mode']} | {r['flops_ratio']:.3f} | "
    f"{r['speed_ratio']:.2f} | {r['temp_ratio']:.2f} | {r['impl_ms']:.0f} | "
    f"{r['dense_ms']:.0f} | {touch} |"
  )


def to_markdown(rows, info, argv):
  lines = [
    "# Grouped matmul on CPU",
    "",
    f"`python -m bench.gmm {' '.join(argv)}`".replace(" `", "`"),
    "",
    f"Machine: {info['cpu']}, {info['cores']} cores; JAX {info['jax']} (jaxlib "
    f"{info['jaxlib']}), backend {info['backend']}; GLIBC_TUNABLES="
    f"{info['GLIBC_TUNABLES'] or '(unset)'}; load average (1 min) "
    f"{info['loadavg_1min_start']:.1f} at start, {info['loadavg_1min_end']:.1f} at end "
    f"(other processes share the cores: timings are noisy); {info['repeats']} repeats; "
    f"{info['seconds']:.0f} s.",
    "",
    f"M={M}, D={D}, F={F}, float32. flops/routed: executed / 2MDF (fwd) or 6MDF "
    "(fwd+bwd), target <= 1.25. speed/dense: dense matmul time / impl time (medians, "
    "timed in turns), target >= 0.6. temp/(x+y): XLA temp bytes / bytes(x + y), "
    "target <= 4. dw touch: time to write a fresh f32[G, D, F] (dw's size).",
    "",
    HEADER,
  ]
  lines += [_row_md(r) for r in rows]
  skipped = sorted({G for G in {r["G"] for r in rows} if G > RAGGED_DOT_MAX_G})
  if skipped:
    lines += [
      "",
      f"ragged_dot not run for G in {skipped}: on CPU it is a dense product over "
      "all groups (G x the FLOPs, [G, M, F] temporaries).",
    ]
  return "\n".join(lines) + "\n"


def main(argv=None):
  argv = sys.argv[1:] if argv is None else argv
  p = argparse.ArgumentParser(prog="python -m bench.gmm", description=__doc__.split("\n")[0])
  p.add_argument("--repeats", type=int, default=7, help="timed calls per function (default 7)")
  p.add_argument("--quick", action="store_true", help="G in {8, 128} only, 3 repeats")
  p.add_argument(
    "--groups", default=None, help="comma-separated G values (default 8,32,128; --quick: 8,128)"
  )
  p.add_argument(
    "--out",
    default=os.path.join(os.path.dirname(os.path.dirname(__file__)), "results"),
    help="directory for gmm_cpu.md and gmm_cpu.json (default bench/results)",
  )
  args = p.parse_args(argv)
  repeats = 3 if args.quick and "--repeats" not in " ".join(argv) else args.repeats
  info = common.machine_info()
  print(f"# {info['cpu']}, {info['cores']} cores, JAX {info['jax']}", flush=True)
  print(HEADER, flush=True)
  t0 = time.perf_counter()
  groups = (
    ((8, 128) if args.quick else GROUPS)
    if args.groups is None
    else tuple(int(g) for g in args.groups.split(","))
  )
  rows = run(repeats, groups)
  info["seconds"] = time.perf_counter() - t0
  info["loadavg_1min_end"] = os.getloadavg()[0]
  info["repeats"] = repeats
  os.makedirs(args.out, exist_ok=True)
  with open(os.path.join(args.out, "gmm_cpu.md"), "w") as f:
    f.write(to_markdown(rows, info, argv))
  with open(os.path.join(args.out, "gmm_cpu.json"), "w") as f:
    json.dump(
      {"machine": info, "shape": {"M": M, "D": D, "F": F, "dtype": "float32"}, "rows": rows},
      f,
      indent=1,
    )
  print(f"wrote {args.out}/gmm_cpu.md and .json in {info['seconds']:.0f} s")


if __name__ == "__main__":
  main()
