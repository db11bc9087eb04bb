"""Grouped matmul compiled for one TPU v5e chip (nothing runs): megablox_gmm vs lax.ragged_dot.

    python -m bench.gmm_tpu [--topology v5e:2x4] [--groups 1,8,32] [--out bench/results]

For M=8192 rows, D=2048, F=4096, bfloat16, G groups of equal size, it compiles ("fwd":
y = gmm(x, w); "fwd+bwd": y, dx, dw from `jax.vjp`) for one abstract device of the
topology and reports, from the compiled program:

  * flops/routed: XLA's `cost_analysis()["flops"]` over the routed FLOPs 2*M*D*F (fwd) or
    6*M*D*F (fwd+bwd). A Pallas kernel (a `tpu_custom_call`, not a dot in the HLO) counts
    as the cost it declares, read here from the custom call's backend_config
    (`kernel_flops`, the "kernel" column): megablox declares 2*m*k*n per kernel.
  * kernel rows/M: the rows megablox's kernels actually multiply for these group sizes
    (row tiles from its own tile metadata, times tm) over M. A row tile that two groups
    share is multiplied once per group, which the declared cost does not show.
  * bytes: XLA's "bytes accessed" (Pallas kernels: their declared bytes), temp: XLA's
    temp bytes, xla us: `cost_analysis()["optimal_seconds"]`.
  * kernel bytes: megablox's declared bytes beside the bytes its block specs fetch for
    these group sizes (`fetched_bytes`): its formula counts one w[g] per possible row tile,
    which full-width tiles do not fetch.

Every figure is a compile-time estimate. Writes `<out>/gmm_tpu_<gen>.md`.
"""

from __future__ import annotations

import argparse
import importlib
import os
import re
import sys
import time

# Compile only: no TPU is opened (JAX stays on the CPU backend, libtpu only compiles).
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from bench.reading import tpu
from moe_shard.kernels import tpu as gmm_tpu

_mb = importlib.import_module("jax.experimental.pallas.ops.tpu.megablox.gmm")

M, D, F = 8192, 2048, 4096
GROUPS = (1, 8, 32)
# The declared cost of a Pallas TPU kernel, in its custom call's backend_config JSON.
_COST_RE = re.compile(
  r'"cost_estimate":\{"flops":"(\d+)","transcendentals":"(\d+)",'
  r'"bytes_accessed":"(\d+)"'
)


def kernel_costs(hlo_text):
  """[(flops, bytes_accessed)] declared by each `tpu_custom_call` of an optimised HLO text."""
  out = []
  for line in hlo_text.splitlines():
    if 'custom_call_target="tpu_custom_call"' in line:
      m = _COST_RE.search(line)
      out.append((int(m.group(1)), int(m.group(3))) if m else (0, 0))
  return out


def kernel_rows(group_sizes_G, num_rows, tm):
  """Rows megablox's gmm multiplies: its visited row tiles (one per group per tile) * tm."""
  _, tiles = _mb.make_group_metadata(
    group_sizes=jnp.asarray(group_sizes_G, jnp.int32),
    m=num_rows,
    tm=tm,
    start_group=jnp.int32(0),
    num_nonzero_groups=len(group_sizes_G),
    visit_empty_groups=False,
  )
  return int(tiles) * tm


def _metadata(group_sizes_G, num_rows, tm, visit_empty_groups):
  """megablox's grid metadata, as numpy: (group_ids, m_tile_ids) of its active tiles."""
  (_, group_ids, m_tile_ids), tiles = _mb.make_group_metadata(
    group_sizes=jnp.asarray(group_sizes_G, jnp.int32),
    m=num_rows,
    tm=tm,
    start_group=jnp.int32(0),
    num_nonzero_groups=len(group_sizes_G),
    visit_empty_groups=visit_empty_groups,
  )
  n = int(tiles)
  return np.asarray(group_ids)[:n], np.asarray(m_tile_ids)[:n]


def _transfers(steps):
  """Copies a Pallas TPU pipeline makes for one block spec: one per grid step whose block
  index differs from the previous step's (an unchanged block stays in VMEM)."""
  count, last = 0, None
  for index in steps:
    count += index != last
    last = index
  return count


def fetched_bytes(kernel, group_sizes_G, num_rows, K, N, tiling, itemsize, out_itemsize):
  """HBM bytes megablox's kernel moves by its block specs, for these group sizes.

  Walks the kernel's grid in order and counts a block's bytes each time its index changes
  between consecutive steps (inputs copied in, outputs written back), which is when the
  Pallas TPU pipeline copies (https://docs.jax.dev/en/latest/pallas/tpu/sparse.html).
  "gmm": y[m, n] = x[m, k] @ w[g, k, n], grid (n, active row tiles, k) ("gmm^T", dx =
  dy @ w^T, has the same counts with w's block transposed). "tgmm": dw[g, k, n] =
  x[m, k]^T @ dy[m, n], grid (n, k, active row tiles).

  Args:
    kernel: "gmm" or "tgmm".
    group_sizes_G: the group sizes (ints).
    num_rows: M, a multiple of tm.
    K, N: the contraction and output widths of "gmm" (tgmm: dw's two dims); a width that
      is not a multiple of its tile ends in a partial tile, counted here as a whole one.
    tiling: (tm, tk, tn) as megablox takes it.
    itemsize, out_itemsize: bytes per element of the inputs and of the output.

  Returns:
    (fetched, declared): the bytes the block specs move, and megablox's declared cost
    estimate for the same call (gmm: x * N/tn + one w[g] per active tile + y; tgmm:
    x * N/tn + dy * K/tk + dw).
  """
  tm, tk, tn = tiling
  tiles_k, tiles_n = -(-K // tk), -(-N // tn)
  group_ids, m_tiles = _metadata(group_sizes_G, num_rows, tm, kernel == "tgmm")
  G = len(group_sizes_G)
  if kernel == "gmm":
    grid = [
      (n, (g, t), k)
      for n in range(tiles_n)
      for g, t in zip(group_ids, m_tiles)
      for k in range(tiles_k)
    ]
    x = _transfers((t, k) for _, (_, t), k in grid) * tm * tk * itemsize
    w = _transfers((g, k, n) for n, (g, _), k in grid) * tk * tn * itemsize
    y = _transfers((t, n) for n, (_, t), _ in grid) * tm * tn * out_itemsize
    max_tiles = num_rows // tm + G - 1
    declared = (
      num_rows * K * itemsize * tiles_n + K * N * itemsize * max_tiles + num_rows * N * out_itemsize
    )
    return x + w + y, declared
  grid = [
    (n, k, (g, t))
    for n in range(tiles_n)
    for k in range(tiles_k)
    for g, t in zip(group_ids, m_tiles)
  ]
  x = _transfers((t, k) for _, k, (_, t) in grid) * tm * tk * itemsize
  dy = _transfers((t, n) for n, _, (_, t) in grid) * tm * tn * itemsize
  dw = _transfers((g, k, n) for n, k, (g, _) in grid) * tk * tn * out_itemsize
  declared = (
    num_rows * K * itemsize * tiles_n + num_rows * N * itemsize * tiles_k + G * K * N * out_itemsize
  )
  return x + dy + dw, declared


def _program(impl, mode, tiling, vmem_limit=None):
  def gmm(x, w, gs):
    if impl == "ragged_dot":
      return jax.lax.ragged_dot(x, w, gs, preferred_element_type=jnp.float32).astype(x.dtype)
    return gmm_tpu.megablox_gmm(x, w, gs, tiling=tiling, vmem_limit_bytes=vmem_limit)

  if mode == "fwd":
    return gmm

  def fwd_bwd(x, w, gs, dy):
    y, vjp = jax.vjp(lambda x, w: gmm(x, w, gs), x, w)
    return (y, *vjp(dy))

  return fwd_bwd


def _kernel_bytes(mode, group_sizes_G, tiling):
  """(fetched, declared) bytes of megablox's kernels in one pass (`fetched_bytes`)."""
  tm, tk, tn = tiling
  calls = [("gmm", D, F, (tm, tk, tn))]
  if mode == "fwd+bwd":
    calls += [("gmm", F, D, (tm, tn, tk)), ("tgmm", D, F, tiling)]
  out = [fetched_bytes(k, group_sizes_G, M, kk, n, t, 2, 2) for k, kk, n, t in calls]
  return sum(f for f, _ in out), sum(d for _, d in out)


def run(topology, groups):
  dev = tpu.devices(topology)[0]
  mesh = Mesh(np.array([dev]), ("x",))
  s = NamedSharding(mesh, P())
  sds = lambda shape, dt: jax.ShapeDtypeStruct(shape, dt, sharding=s)
  limit = gmm_tpu.vmem_limit(dev.device_kind)
  cases = [
    (G, impl, mode, None)
    for G in groups
    for impl in ("megablox", "ragged_dot")
    for mode in ("fwd", "fwd+bwd")
  ]
  # The tiles of Mosaic's default VMEM limit (what a generation not known gets), beside.
  cases += [
    (G, "megablox", "fwd+bwd", tiles)
    for G in groups
    for tiles in [gmm_tpu.default_tiling(M, D, F, jnp.bfloat16, num_groups=G)]
    if tiles != gmm_tpu.default_tiling(M, D, F, jnp.bfloat16, num_groups=G, vmem_limit=limit)
  ]
  rows = []
  for G, impl, mode, tiling in cases:
    gs = np.full(G, M // G, np.int32)
    args = [sds((M, D), jnp.bfloat16), sds((G, D, F), jnp.bfloat16), sds((G,), jnp.int32)]
    if mode == "fwd+bwd":
      args.append(sds((M, F), jnp.bfloat16))
    if impl == "megablox" and tiling is None:
      tiling = gmm_tpu.default_tiling(M, D, F, jnp.bfloat16, num_groups=G, vmem_limit=limit)
    t0 = time.perf_counter()
    # The mesh in context: megablox_gmm reads the TPU generation (its VMEM) from it.
    with jax.set_mesh(mesh):
      compiled = jax.jit(_program(impl, mode, tiling)).lower(*args).compile()
    compile_s = time.perf_counter() - t0
    ca = compiled.cost_analysis()
    ca = ca[0] if isinstance(ca, (list, tuple)) else ca
    routed = (2 if mode == "fwd" else 6) * M * D * F
    declared = kernel_costs(compiled.as_text())
    fetched, formula = _kernel_bytes(mode, gs, tiling) if tiling else (None, None)
    row = {
      "G": G,
      "impl": impl,
      "mode": mode,
      "tiling": tiling,
      "flops": float(ca["flops"]),
      "flops_ratio": float(ca["flops"]) / routed,
      "kernel_flops": sum(f for f, _ in declared),
      "kernels": len(declared),
      "kernel_rows_ratio": (kernel_rows(gs, M, tiling[0]) / M if tiling else None),
      "kernel_bytes": sum(b for _, b in declared),
      "kernel_bytes_formula": formula,
      "kernel_bytes_fetched": fetched,
      "bytes": float(ca.get("bytes accessed", 0.0)),
      "temp": int(compiled.memory_analysis().temp_size_in_bytes),
      "xla_s": float(ca.get("optimal_seconds", -1.0)),
      "compile_s": compile_s,
    }
    row["kernel_ratio"] = row["kernel_flops"] / routed
    rows.append(row)
    print(_row_md(row), flush=True)
  return rows


HEADER = (
  "| G | impl | tiling | pass | flops/routed | kernel flops/routed | kernel rows/M | "
  "bytes GB | kernel bytes GB, declared | kernel bytes GB, fetched | temp MiB | xla us | "
  "compile s |\n"
  "|---|---|---|---|---|---|---|---|---|---|---|---|---|"
)


def _row_md(r):
  tiling = "x".join(map(str, r["tiling"])) if r["tiling"] else ""
  kr = f"{r['kernel_rows_ratio']:.2f}" if r["kernel_rows_ratio"] is not None else ""
  kf = f"{r['kernel_ratio']:.3f} ({r['kernels']})" if r["kernels"] else "0 (0)"
  xla = f"{r['xla_s'] * 1e6:.0f}" if r["xla_s"] >= 0 else "n/a"
  fetched = r["kernel_bytes_fetched"]
  kb = f"{r['kernel_bytes'] / 1e9:.2f}" if r["kernels"] and fetched is not None else ""
  kf_bytes = f"{fetched / 1e9:.2f}" if fetched is not None else ""
  return (
    f"| {r['G']} | {r['impl']} | {tiling} | {r['mode']} | {r['flops_ratio']:.3f} | "
    f"{kf} | {kr} | {r['bytes'] / 1e9:.2f} | {kb} | {kf_bytes} | {r['temp'] / 2**20:.1f} | "
    f"{xla} | {r['compile_s']:.1f} |"
  )


def to_markdown(rows, topology, argv, seconds):
  limit = gmm_tpu.vmem_limit(tpu.devices(topology)[0].device_kind)
  return "\n".join(
    [
      f"# Grouped matmul compiled for TPU {topology}, one chip: compile-time estimates",
      "",
      f"`python -m bench.gmm_tpu {' '.join(argv)}`".replace(" `", "`"),
      "",
      f"Nothing ran: every number is read from the program compiled for one abstract "
      f"{topology} device on a CPU host (JAX {jax.__version__}), in {seconds:.0f} s.",
      "",
      f"M={M}, D={D}, F={F}, bfloat16, G equal groups. flops/routed: XLA's cost_analysis "
      "FLOPs over 2MDF (fwd) or 6MDF (fwd+bwd); Pallas kernels count as the cost they "
      "declare. kernel flops/routed: the declared FLOPs of the tpu_custom_calls (their "
      "number in parentheses). kernel rows/M: rows megablox's kernels multiply for these "
      "group sizes (its own tile metadata) over M, the FLOPs they would execute over the "
      "routed ones. bytes: XLA's bytes accessed. kernel bytes, declared: the bytes the "
      "tpu_custom_calls declare (megablox's formula; with one contraction tile, gmm's fetched "
      "bytes, `kernels.tpu.fetched_once_bytes`; part of bytes); fetched: the bytes "
      "their block specs move for these group sizes, a block counted each time its index "
      "changes between grid steps (`fetched_bytes`). temp: XLA temp bytes. xla us: "
      "cost_analysis optimal_seconds (n/a: XLA could not cost an instruction). "
      "megablox's bytes include one pass over y (and dx) that zeroes the rows past the "
      "groups' total: an elementwise `where` that XLA fuses into y's consumer in a model, "
      "but that is the program's last op here. ragged_dot returns f32 then casts to "
      'bf16 (as `grouped_matmul(impl="ragged_dot")` does): its 128 MiB temp.',
      "",
      f"Tiles: `default_tiling` under the VMEM limit `vmem_limit` gives this generation "
      f"({'Mosaic default' if limit is None else f'{limit // 2**20} MiB'}); the last rows "
      "take the tiles of Mosaic's default limit (what a generation not known gets), for "
      "comparison. compile s is the wall time of the ahead-of-time compile on this host "
      "(2 cores shared with other jobs): read it as a ratio between rows of one run.",
      "",
      HEADER,
      *[_row_md(r) for r in rows],
      "",
    ]
  )


def main(argv=None):
  argv = sys.argv[1:] if argv is None else argv
  p = argparse.ArgumentParser(prog="python -m bench.gmm_tpu", description=__doc__.split("\n")[0])
  p.add_argument("--topology", default="v5e:2x4", help="TPU topology (default v5e:2x4)")
  p.add_argument(
    "--groups", default=",".join(map(str, GROUPS)), help="comma-separated G values (default 1,8,32)"
  )
  p.add_argument(
    "--out",
    default=os.path.join(os.path.dirname(os.path.dirname(__file__)), "results"),
    help="directory for gmm_tpu_<generation>.md (default bench/results)",
  )
  args = p.parse_args(argv)
  print(HEADER, flush=True)
  t0 = time.perf_counter()
  rows = run(args.topology, tuple(int(g) for g in args.groups.split(",")))
  os.makedirs(args.out, exist_ok=True)
  path = os.path.join(args.out, f"gmm_tpu_{tpu.generation(args.topology)}.md")
  with open(path, "w") as f:
    f.write(to_markdown(rows, args.topology, argv, time.perf_counter() - t0))
  print(f"wrote {path}")


if __name__ == "__main__":
  main()
