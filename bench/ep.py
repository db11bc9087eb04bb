"""Expert-parallel MoE benchmark: shard_map all_to_all / all_gather against jit-only versions.

Runs on the devices it finds; on a CPU-only machine it asks for 8 simulated CPU devices
(XLA_FLAGS is set before JAX is imported). For each number of experts E and routing, every
implementation gets the same sharded inputs (tokens over every mesh axis, expert weights
over "expert") on an Auto mesh, and is measured for the forward and forward+backward:

  * wall time: median (min, max) over repeats after a warm-up; compile time separately;
  * collective bytes per device sent on the wire, read from the compiled HLO, collectives
    in the all_to_all overflow loop multiplied by the rounds actually run (see
    `moe_shard.measure`), over the cost model's lower bound T*K*(N-1)/N*(D + F)*b
    (dispatch D-wide items, return F-wide outputs; T tokens per device);
  * temp memory per device (`memory_analysis()`).

Implementations: "all_to_all" and "all_gather" (shard_map), "jit_ragged_dot" and
"jit_masked_scan" (the local references under `jax.jit` with sharded inputs: XLA inserts
the collectives).

    python -m bench.ep                 # T=8192, D=512, F=1024, K=2, E in {8, 64}, uniform+zipf
    python -m bench.ep --quick         # small sizes, a minute
"""

from __future__ import annotations

import os
import sys

if "jax" not in sys.modules and "xla_force_host_platform_device_count" not in os.environ.get(
    "XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                             " --xla_force_host_platform_device_count=8").strip()

import argparse  # noqa: E402
import functools  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import moe_shard as ms  # noqa: E402
from moe_shard import measure  # noqa: E402
from moe_shard.parallel import OVERFLOW_SCOPE  # noqa: E402

from bench import common  # noqa: E402

IMPLS = ("all_to_all", "all_gather", "jit_ragged_dot", "jit_masked_scan")


def _impl_fn(name, mesh, chunk_size):
  if name == "all_to_all":
    return functools.partial(ms.moe_all_to_all, mesh=mesh, chunk_size=chunk_size)
  if name == "all_gather":
    return functools.partial(ms.moe_all_gather, mesh=mesh)
  if name == "jit_ragged_dot":
    return ms.moe_ragged_dot
  if name == "jit_masked_scan":
    return ms.moe_masked_scan
  raise ValueError(f"bench.ep: unknown impl {name!r}; choose from {IMPLS}")


def _programs(fn):
  """Forward and forward+backward (grads of <y, dy> w.r.t. x, w, weights) programs."""
  fwd = jax.jit(fn)

  def fwd_bwd(x, w, e, g, dy):
    y, vjp = jax.vjp(lambda x, w, g: fn(x, w, e, g), x, w, g)
    return (y, *vjp(dy))
  return fwd, jax.jit(fwd_bwd)


def run_case(mesh, E, routing, impls, *, T, D, F, K, dtype, repeats, chunk_size, seed=0):
  """Measures every impl on one (E, routing); returns a list of row dicts."""
  N = mesh.shape[ms.EXPERT]
  n_dev = mesh.size
  tok = NamedSharding(mesh, P(tuple(mesh.axis_names)))
  exp = NamedSharding(mesh, P(ms.EXPERT))
  key = jax.random.key(seed)
  kx, kw, kd = jax.random.split(key, 3)
  experts, weights = common.synthetic_routing(routing, T, E, K, num_devices=N, seed=seed)
  x = jax.device_put(jax.random.normal(kx, (T, D), dtype), tok)
  w = jax.device_put((jax.random.normal(kw, (E, D, F)) / np.sqrt(D)).astype(dtype), exp)
  e = jax.device_put(jnp.asarray(experts), tok)
  g = jax.device_put(jnp.asarray(weights), tok)
  dy = jax.device_put(jax.random.normal(kd, (T, F), dtype), tok)

  _, stats = jax.jit(functools.partial(ms.moe_all_to_all, mesh=mesh, chunk_size=chunk_size,
                                       return_stats=True))(x, w, e, g)
  rounds = int(stats["rounds"])
  b = jnp.dtype(dtype).itemsize
  bound_fwd = (T // n_dev) * K * (N - 1) / N * (D + F) * b
  ref = None
  rows = []
  for name in impls:
    fwd, fwd_bwd = _programs(_impl_fn(name, mesh, chunk_size))
    row = dict(impl=name, E=E, routing=routing, T=T, D=D, F=F, K=K, N=N,
               devices=n_dev, dtype=jnp.dtype(dtype).name)
    trips = {OVERFLOW_SCOPE: rounds - 1} if name == "all_to_all" else {}
    for tag, prog, args in (("fwd", fwd, (x, w, e, g)), ("fwd_bwd", fwd_bwd, (x, w, e, g, dy))):
      t0 = time.perf_counter()
      compiled = prog.lower(*args).compile()
      row[f"{tag}_compile_s"] = time.perf_counter() - t0
      coll = measure.collective_bytes(compiled, trips, default_trip_count=1)
      row[f"{tag}_wire_bytes"] = sum(c["wire_bytes"] for c in coll.values())
      row[f"{tag}_collectives"] = {k: c["wire_bytes"] for k, c in coll.items()}
      row[f"{tag}_temp_bytes"] = measure.memory_bytes(compiled)["temp"]
    row["rounds"] = rounds if name == "all_to_all" else None
    row["bytes_over_bound"] = row["fwd_wire_bytes"] / bound_fwd if bound_fwd else None
    t_fwd, t_bwd = common.time_in_turns([(fwd, (x, w, e, g)), (fwd_bwd, (x, w, e, g, dy))],
                                        repeats)
    row["fwd_s"], row["fwd_bwd_s"] = t_fwd, t_bwd
    y = np.asarray(fwd(x, w, e, g), np.float32)
    if ref is None:
      ref = np.asarray(ms.moe_ragged_dot(jax.device_get(x), jax.device_get(w), experts,
                                         weights), np.float32)
    row["max_abs_err"] = float(np.max(np.abs(y - ref)))
    rows.append(row)
    print(_line(row), flush=True)
  return rows


def _line(r):
  return (f"  {r['impl']:>16} E={r['E']:<3} {r['routing']:<10} fwd {r['fwd_s']['median']*1e3:8.1f} ms"
          f"  fwd+bwd {r['fwd_bwd_s']['median']*1e3:8.1f} ms  wire {r['fwd_wire_bytes']/2**20:8.2f} MiB"
          f" ({r['bytes_over_bound']:.2f}x bound)  temp {r['fwd_temp_bytes']/2**20:8.1f} MiB"
          f"  rounds {r['rounds']}  err {r['max_abs_err']:.1e}")


def to_markdown(rows, info, argv):
  head = ("| impl | E | routing | fwd ms (min-max) | fwd+bwd ms | bwd/fwd | wire MiB/dev fwd | "
          "x bound | fwd+bwd wire MiB | temp MiB fwd | temp MiB fwd+bwd | rounds | max err |\n"
          "|---|---|---|---|---|---|---|---|---|---|---|---|---|\n")
  body = ""
  for r in rows:
    f, fb = r["fwd_s"], r["fwd_bwd_s"]
    body += (f"| {r['impl']} | {r['E']} | {r['routing']} | {f['median']*1e3:.0f} "
             f"({f['min']*1e3:.0f}-{f['max']*1e3:.0f}) | {fb['median']*1e3:.0f} | "
             f"{fb['median']/f['median']:.2f} | {r['fwd_wire_bytes']/2**20:.2f} | "
             f"{r['bytes_over_bound']:.2f} | {r['fwd_bwd_wire_bytes']/2**20:.2f} | "
             f"{r['fwd_temp_bytes']/2**20:.1f} | {r['fwd_bwd_temp_bytes']/2**20:.1f} | "
             f"{r['rounds'] if r['rounds'] is not None else '-'} | {r['max_abs_err']:.1e} |\n")
  summary = _summary(rows)
  r0 = rows[0]
  return (f"# Expert-parallel benchmark\n\n`{' '.join(argv)}`\n\n"
          f"T={r0['T']} tokens in all, D={r0['D']}, F={r0['F']}, K={r0['K']}, {r0['dtype']}, "
          f"{r0['devices']} devices, expert axis N={r0['N']}. Machine: {info['cpu']}, "
          f"{info['cores']} cores, JAX {info['jax']}. Wall times are medians over repeats "
          f"(8 simulated devices share the cores: noisy; compare ratios within one run). "
          f"Wire bytes are per device, from the compiled HLO, loop bodies times rounds; the "
          f"bound is T_dev*K*(N-1)/N*(D+F)*b.\n\n" + head + body + "\n" + summary)


def _summary(rows):
  """all_to_all against the best jit-only version, per (E, routing)."""
  out = ""
  for key in sorted({(r["E"], r["routing"]) for r in rows}):
    grp = [r for r in rows if (r["E"], r["routing"]) == key]
    a2a = [r for r in grp if r["impl"] == "all_to_all"]
    jit = [r for r in grp if r["impl"].startswith("jit_")]
    if not a2a or not jit:
      continue
    a2a = a2a[0]
    best_t = min(jit, key=lambda r: r["fwd_s"]["median"])
    best_b = min(jit, key=lambda r: r["fwd_wire_bytes"])
    out += (f"- E={key[0]}, {key[1]}: all_to_all fwd {a2a['fwd_s']['median']*1e3:.0f} ms vs best "
            f"jit-only ({best_t['impl']}) {best_t['fwd_s']['median']*1e3:.0f} ms: speedup "
            f"{best_t['fwd_s']['median']/a2a['fwd_s']['median']:.2f}x; wire bytes "
            f"{a2a['fwd_wire_bytes']/2**20:.2f} MiB vs fewest jit-only ({best_b['impl']}) "
            f"{best_b['fwd_wire_bytes']/2**20:.2f} MiB: "
            f"ratio {best_b['fwd_wire_bytes']/max(a2a['fwd_wire_bytes'], 1):.2f}x (> 1: "
            f"all_to_all moves fewer).\n")
  return out


def main(argv=None):
  argv = sys.argv[1:] if argv is None else argv
  p = argparse.ArgumentParser(prog="python -m bench.ep", description=__doc__.split("\n")[0])
  p.add_argument("--tokens", type=int, default=8192, help="T, tokens in all (default 8192)")
  p.add_argument("--d-model", type=int, default=512)
  p.add_argument("--d-ff", type=int, default=1024)
  p.add_argument("--top-k", type=int, default=2)
  p.add_argument("--experts", default="8,64", help="comma-separated E values (default 8,64)")
  p.add_argument("--routing", default="uniform,zipf",
                 help=f"comma-separated, from {common.ROUTINGS} (default uniform,zipf)")
  p.add_argument("--impls", default=",".join(IMPLS))
  p.add_argument("--mesh", default="8x1", help="expert x data (default 8x1)")
  p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
  p.add_argument("--chunk-size", type=int, default=None)
  p.add_argument("--repeats", type=int, default=5)
  p.add_argument("--quick", action="store_true", help="T=2048, D=128, F=256, 3 repeats")
  p.add_argument("--out", default="bench/results/ep_cpu", help="results path stem")
  a = p.parse_args(argv)
  if a.quick:
    a.tokens, a.d_model, a.d_ff, a.repeats = 2048, 128, 256, 3
  try:
    mesh = common.make_mesh(a.mesh)
    n_e = mesh.shape[ms.EXPERT]
    impls = a.impls.split(",")
    for i in impls:
      if i not in IMPLS:
        raise ValueError(f"unknown impl {i!r}; choose from {IMPLS}")
    for E in (int(v) for v in a.experts.split(",")):
      if E % n_e:
        raise ValueError(f"experts ({E}) must be divisible by the expert axis ({n_e})")
  except ValueError as err:
    print(f"bench.ep: error: {err}", file=sys.stderr)
    return 2
  info = common.machine_info()
  print(f"bench.ep on {info['devices']} {info['backend']} devices, mesh {a.mesh}", flush=True)
  rows = []
  for E in (int(v) for v in a.experts.split(",")):
    for routing in a.routing.split(","):
      rows += run_case(mesh, E, routing, impls, T=a.tokens, D=a.d_model, F=a.d_ff, K=a.top_k,
                       dtype=jnp.dtype(a.dtype), repeats=a.repeats, chunk_size=a.chunk_size)
  md = to_markdown(rows, info, ["python", "-m", "bench.ep", *argv])
  print(md)
  paths = common.write_results(a.out, rows, md, info, ["python", "-m", "bench.ep", *argv])
  print("wrote", *paths)
  return 0


if __name__ == "__main__":
  sys.exit(main())
