"""Where the time of the all_to_all layer goes, forward and backward, against the dense limit.

    python -m bench.kernel_runs.profile_backward [--T 2048,8192] [-E 8,64] [--repeats 5] [--hlo]

On the 8x1 mesh ("expert" x "data", 8 simulated CPU devices), D=512, F=1024, K=2, SwiGLU,
float32, for each (T, E) it times in turns (medians; every program of a case in the same
turns, so ratios are comparable under a noisy load):

  * layer: `moe_layer` with impl="all_to_all", forward (y) and forward+backward (jitted
    `jax.value_and_grad` of sum(y * dy) with respect to the params and x).
  * gmm: the expert SwiGLU alone, through `grouped_matmul`, under shard_map at the shapes one
    device sees in round 0 (M = N * C_first received rows, L = E / N groups holding the
    T_dev * K routed items evenly), forward and forward+backward (dx and the three dW).
  * dense: the dense limit: the same routed FLOPs as plain dense SwiGLU matmuls per device
    under shard_map ([T_dev * K, D] rows, one [D, F], [D, F], [F, D] set of weights per
    device), no routing, no dispatch; forward and forward+backward.

and prints: ms of each (wall, and CPU time of the process: the steadier one when other
processes share the cores), fwd+bwd / fwd, and efficiency = dense ms / layer ms. With `--hlo` it also
lists, for the layer's compiled fwd+bwd, the big ops (>= 1 MiB results) inside loop bodies:
copies, broadcasts (zero fills), dynamic-update-slices, adds, by computation.
"""

from __future__ import annotations

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import argparse
import collections
import functools
import re
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import moe_shard as ms
from bench.cases import common
from bench.command import malloc
from moe_shard import plan as plan_lib
from moe_shard.kernels.grouped_matmul import grouped_matmul

D, F, K = 512, 1024, 2


def make_mesh():
  devices = np.array(jax.devices()[:8], dtype=object).reshape(8, 1)
  return jax.sharding.Mesh(
    devices, (ms.EXPERT, "data"), axis_types=(jax.sharding.AxisType.Auto,) * 2
  )


def layer_programs(T, E, mesh, seed=0):
  """(fwd, fwd_bwd, args) of the all_to_all layer at T tokens, E experts."""
  cfg = ms.MoEConfig(d_model=D, d_ff=F, num_experts=E, top_k=K, impl="all_to_all")
  params = ms.init_moe_params(jax.random.key(seed), cfg, mesh=mesh)
  tok = NamedSharding(mesh, P((ms.EXPERT, "data")))
  kx, kd = jax.random.split(jax.random.key(seed + 1))
  x = jax.device_put(jax.random.normal(kx, (8, T // 8, D)), tok)
  dy = jax.device_put(jax.random.normal(kd, (8, T // 8, D)), tok)

  def fwd(p, x, dy):
    y, aux = ms.moe_layer(p, x, cfg, mesh=mesh)
    return y, aux["rounds"]

  def loss(p, x, dy):
    return jnp.sum(ms.moe_layer(p, x, cfg, mesh=mesh)[0] * dy)

  return jax.jit(fwd), jax.jit(jax.value_and_grad(loss, argnums=(0, 1))), (params, x, dy)


def _swiglu_params(key, G, shape_in, shape_out):
  k1, k2, k3 = jax.random.split(key, 3)
  return ms.SwiGLU(
    gate_EDF=jax.random.normal(k1, (G, D, F)) / D**0.5,
    up_EDF=jax.random.normal(k2, (G, D, F)) / D**0.5,
    down_EFD=jax.random.normal(k3, (G, F, D)) / F**0.5,
  )


def gmm_programs(T, E, mesh, seed=0):
  """(fwd, fwd_bwd, args): the expert SwiGLU via grouped_matmul at round 0's shapes."""
  N = mesh.shape[ms.EXPERT]
  L = E // N
  T_dev = T // mesh.size
  C = plan_lib.default_chunks(T_dev, K, N).first
  M = N * C
  items = T_dev * K
  sizes = np.full(L, items // L)
  sizes[: items - sizes.sum()] += 1
  ffn = _swiglu_params(jax.random.key(seed), E, None, None)
  kx, kd = jax.random.split(jax.random.key(seed + 1))
  x = jax.random.normal(kx, (mesh.size * M, D))
  dy = jax.random.normal(kd, (mesh.size * M, D))
  gs = jnp.tile(jnp.asarray(sizes, jnp.int32), mesh.size)
  dev = P((ms.EXPERT, "data"))
  exp = P(ms.EXPERT)

  def local(ffn_L, x_MD, gs_L):
    mm = functools.partial(grouped_matmul, group_sizes_G=gs_L, preferred_element_type=jnp.float32)
    return ffn_L(x_MD, mm)

  def fwd(ffn, x, gs, dy):
    return jax.shard_map(local, mesh=mesh, in_specs=(exp, dev, dev), out_specs=dev)(ffn, x, gs)

  def loss(ffn, x, gs, dy):
    return jnp.sum(fwd(ffn, x, gs, dy) * dy)

  args = _place(mesh, (ffn, x, gs, dy), (exp, dev, dev, dev))
  return jax.jit(fwd), jax.jit(jax.value_and_grad(loss, argnums=(0, 1))), args


def dense_programs(T, E, mesh, seed=0):
  """(fwd, fwd_bwd, args): the dense limit, dense SwiGLU of the routed rows per device."""
  T_dev = T // mesh.size
  rows = T_dev * K
  ffn = _swiglu_params(jax.random.key(seed), mesh.size, None, None)
  kx, kd = jax.random.split(jax.random.key(seed + 1))
  x = jax.random.normal(kx, (mesh.size * rows, D))
  dy = jax.random.normal(kd, (mesh.size * rows, D))
  dev = P((ms.EXPERT, "data"))

  def local(ffn_1, x_MD):
    w = jax.tree.map(lambda a: a[0], ffn_1)
    mm = ms.matmuls.dense_matmul
    return w(x_MD, mm)

  def fwd(ffn, x, dy):
    return jax.shard_map(local, mesh=mesh, in_specs=(dev, dev), out_specs=dev)(ffn, x)

  def loss(ffn, x, dy):
    return jnp.sum(fwd(ffn, x, dy) * dy)

  args = _place(mesh, (ffn, x, dy), (dev, dev, dev))
  return jax.jit(fwd), jax.jit(jax.value_and_grad(loss, argnums=(0, 1))), args


def _place(mesh, args, specs):
  """Puts each argument (a pytree) on the mesh with its spec, so no call moves inputs."""
  return tuple(
    jax.tree.map(lambda a, s=s: jax.device_put(a, NamedSharding(mesh, s)), a)
    for a, s in zip(args, specs)
  )


BIG_OP = re.compile(r"^\s*(?:ROOT )?%?(\S+) = (\w+)\[([\d,]*)\][^ ]* (\w[\w-]*)\(")


def big_ops(hlo_text, min_bytes=1 << 20):
  """Counts ops with f32/s32 results of at least `min_bytes`, by (computation, opcode, shape).

  Fusions are reported by their kind and the ops they wrap are not (their results live in
  registers or the fusion's output buffer).
  """
  comp = None
  counts = collections.Counter()
  for line in hlo_text.splitlines():
    if line and not line.startswith(" ") and "{" in line:
      comp = line.split("(")[0].split()[-1]
      continue
    m = BIG_OP.match(line)
    if not m or comp is None or "fused_computation" in comp or comp[:6] == "fusion":
      continue
    _, dtype, dims, op = m.groups()
    n = int(np.prod([int(d) for d in dims.split(",") if d])) if dims else 1
    if n * 4 < min_bytes:
      continue
    kind = op
    if op == "fusion":
      k = re.search(r"kind=(\w+)", line)
      calls = re.search(r"calls=%?([\w.-]+)", line)
      kind = f"fusion:{k.group(1) if k else '?'}:{calls.group(1) if calls else '?'}"
    counts[(comp, kind, f"{dtype}[{dims}]")] += 1
  return counts


def time_case(T, E, mesh, repeats, hlo):
  progs = {
    "layer": layer_programs(T, E, mesh),
    "gmm": gmm_programs(T, E, mesh),
    "dense": dense_programs(T, E, mesh),
  }
  fns_args, names = [], []
  for name, (fwd, fwd_bwd, args) in progs.items():
    for mode, fn in (("fwd", fwd), ("fwd+bwd", fwd_bwd)):
      t0 = time.perf_counter()
      compiled = fn.lower(*args).compile()
      print(f"  compiled {name} {mode} in {time.perf_counter() - t0:.1f} s", flush=True)
      if hlo and name == "layer" and mode == "fwd+bwd":
        print_big_ops(compiled.as_text())
      fns_args.append((compiled, args))
      names.append((name, mode))
  rounds = int(progs["layer"][0](*progs["layer"][2])[1])
  load0 = os.getloadavg()[0]
  wall, cpu = time_in_turns(fns_args, repeats)
  load1 = os.getloadavg()[0]
  return (
    {k: w * 1e3 for k, w in zip(names, wall)},
    {k: c * 1e3 for k, c in zip(names, cpu)},
    rounds,
    (load0, load1),
  )


def time_in_turns(fns_args, repeats):
  """Median wall and process CPU seconds of each (fn, args), called in turns.

  One call at a time (block_until_ready): overlapping multi-device steps can hit XLA:CPU's
  collective rendezvous timeout. CPU time (all threads of this process) is the steadier
  measure when other processes share the cores: it does not count the time this process
  waits for a core.
  """
  for fn, args in fns_args:
    jax.block_until_ready(fn(*args))
  wall = [[] for _ in fns_args]
  cpu = [[] for _ in fns_args]
  for _ in range(repeats):
    for i, (fn, args) in enumerate(fns_args):
      w0, c0 = time.perf_counter(), time.process_time()
      jax.block_until_ready(fn(*args))
      wall[i].append(time.perf_counter() - w0)
      cpu[i].append(time.process_time() - c0)
  return [float(np.median(t)) for t in wall], [float(np.median(t)) for t in cpu]


def print_big_ops(text):
  counts = big_ops(text)
  print("  big ops (>= 1 MiB) of the layer's fwd+bwd, by computation:")
  for (comp, kind, shape), n in sorted(counts.items()):
    if any(
      s in kind
      for s in (
        "copy",
        "broadcast",
        "dynamic-update-slice",
        "fusion",
        "add",
        "dynamic-slice",
        "while",
        "select",
      )
    ):
      print(f"    {comp:50s} {kind:60s} {shape:20s} x{n}")


def main(argv=None):
  p = argparse.ArgumentParser(
    prog="python -m bench.kernel_runs.profile_backward", description=__doc__.split("\n")[0]
  )
  p.add_argument("--T", default="2048,8192", help="token counts (default 2048,8192)")
  p.add_argument("-E", default="8,64", help="expert counts (default 8,64)")
  p.add_argument("--repeats", type=int, default=5, help="timed turns (default 5)")
  p.add_argument("--hlo", action="store_true", help="list big ops of the layer's fwd+bwd")
  p.add_argument(
    "--system-malloc",
    action="store_true",
    help="keep glibc's malloc defaults (default: reuse freed memory, as "
    "`python -m bench` does; bench/command/malloc.py)",
  )
  args = p.parse_args(argv)
  allocator = malloc.SYSTEM if args.system_malloc else malloc.reuse_freed_memory()
  mesh = make_mesh()
  info = common.machine_info()
  print(
    f"# {info['cpu']}, {info['cores']} cores, JAX {info['jax']}, malloc: {allocator}, "
    f"{len(jax.devices())} devices, mesh 8x1, D={D} F={F} K={K} SwiGLU f32, "
    f"{args.repeats} repeats (medians)",
    flush=True,
  )
  rows = []
  for T in (int(t) for t in args.T.split(",")):
    for E in (int(e) for e in args.E.split(",")):
      print(f"T={T} E={E}", flush=True)
      wall, cpu, rounds, load = time_case(T, E, mesh, args.repeats, args.hlo)
      rows.append((T, E, rounds, wall, cpu, load))
      print(_table([rows[-1]], 3), flush=True)
      print(_table([rows[-1]], 4), flush=True)
  print("\nwall ms (medians):")
  print(_table(rows, 3))
  print("\nprocess CPU ms (medians; steadier under a shared load):")
  print(_table(rows, 4))


def _table(rows, which):
  out = [
    "| T | E | rounds | layer fwd | layer fwd+bwd | bwd/fwd | gmm fwd | gmm fwd+bwd | "
    "dense fwd | dense fwd+bwd | eff fwd | eff fwd+bwd | load (1 min) |",
    "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
  ]
  for row in rows:
    T, E, rounds, t, (l0, l1) = row[:3] + (row[which], row[5])
    lf, lb = t[("layer", "fwd")], t[("layer", "fwd+bwd")]
    df, db = t[("dense", "fwd")], t[("dense", "fwd+bwd")]
    out.append(
      f"| {T} | {E} | {rounds} | {lf:.0f} | {lb:.0f} | {lb / lf:.2f} | "
      f"{t[('gmm', 'fwd')]:.0f} | {t[('gmm', 'fwd+bwd')]:.0f} | {df:.0f} | "
      f"{db:.0f} | {df / lf:.2f} | {db / lb:.2f} | {l0:.1f}-{l1:.1f} |"
    )
  return "\n".join(out)


if __name__ == "__main__":
  main()
