"""MaxText's own training step of a published workload, compiled for its TPU slice on a host
without one, and written out for the estimator (nothing runs).

    ALLOW_MULTIPLE_LIBTPU_LOAD=1 /work/venvs/mt/bin/python -m bench.peers.maxtext_train \\
      mixtral_8x7b_dropped --out /work/calib/mixtral_8x7b_dropped [--set remat_policy=full] \\
      [--drop-flag xla_tpu_enable_async_collective_fusion] [--block moe_shard]

runs MaxText's `maxtext.trainers.pre_train.train_compile` steps (its config from
`bench/peers/maxtext_workloads.py`: the published fields, `compile_topology`, and `--set`
changes) and writes to --out. `--block moe_shard` compiles it with moe_shard's MoE block in place
of MaxText's (`moe_shard.maxtext.install`, `--impl` its dispatch, default "auto"); the block
is dropless, so give it `--set capacity_factor=-1` and the mesh it splits experts over
(`--set ici_expert_parallelism=N`). The folder is written to:

  * step.hlo.txt: the optimised HLO of the compiled train step (`Compiled.as_text()`);
  * cost.json: XLA's `cost_analysis()`; memory.json: `memory_analysis()`;
  * meta.json: the workload, the config changes, the XLA flags passed and dropped, MaxText's
    own TFLOPs per device of the config, the versions, and the compile's seconds;
  * error.txt instead, with the compiler's message, when the compile fails.

The published XLA flags go to the compile as MaxText's AOT path passes them
(`compile_xla_flags`, compile options); `--probe-flags` compiles a tiny program for the slice
with each flag alone and lists those this libtpu refuses, to drop by name with --drop-flag.
`python -m bench.calibration` reads the folders. Needs MaxText with its TPU extra (Python
3.12): `python3.12 -m venv /work/venvs/mt && /work/venvs/mt/bin/pip install
"maxtext[tpu]==0.2.5"`. Run from the repository root; set `ALLOW_MULTIPLE_LIBTPU_LOAD=1`
where another process holds libtpu.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import sys
import time

from bench.peers import maxtext_workloads as mw


def _value(text):
  """A `--set` value: int, float, true/false, or the string."""
  for cast in (int, float):
    try:
      return cast(text)
    except ValueError:
      pass
  return {"true": True, "false": False}.get(text.lower(), text)


def parse_sets(items):
  """['a=1', 'b=x'] -> {'a': 1, 'b': 'x'}.

  Raises:
    ValueError: an item without '='.
  """
  out = {}
  for item in items:
    key, sep, value = item.partition("=")
    if not sep or not key:
      raise ValueError(f"parse_sets: --set must be key=value, got {item!r}")
    out[key] = _value(value)
  return out


def probe_flags(workload):
  """The workload's published flags that this libtpu refuses as compile options.

  Each flag is passed alone to the compile of a small sharded matmul for the slice.

  Returns:
    list[str]: (flag, first line of the error) pairs of the refused flags.
  """
  import jax
  import jax.numpy as jnp
  from jax.experimental.topologies import get_topology_desc
  from jax.sharding import Mesh, NamedSharding, PartitionSpec
  from maxtext.utils import accelerator_to_spec_map

  hw = accelerator_to_spec_map.get_system_characteristics(workload.compile_topology)
  devices = get_topology_desc(
    platform=hw.platform,
    topology_name=hw.topology_name,
    chip_config_name=hw.chip_config_name,
    chips_per_host_bounds=hw.chips_per_host_bounds,
    num_slices=1,
    wrap=hw.wrap,
  ).devices
  mesh = Mesh(devices, ("x",))
  spec = NamedSharding(mesh, PartitionSpec("x"))
  n = len(devices)
  x = jax.ShapeDtypeStruct((n * 128, 256), jnp.bfloat16, sharding=spec)
  w = jax.ShapeDtypeStruct((256, 256), jnp.bfloat16, sharding=NamedSharding(mesh, PartitionSpec()))
  lowered = jax.jit(lambda a, b: (a @ b).sum()).lower(x, w)
  refused = []
  for flag in mw.flag_list(workload.xla_flags):
    key, _, value = flag.lstrip("-").partition("=")
    try:
      lowered.compile(compiler_options={key: value})
    except Exception as err:  # the compiler's refusal, whatever its type
      lines = str(err).strip().splitlines() or [type(err).__name__]
      refused.append((key, lines[0][:300]))
  return refused


def compile_step(workload, changes, flags):
  """Compiles the workload's train step as MaxText's train_compile does.

  Returns:
    (Compiled, config): the compiled step and MaxText's config.
  """
  import jax
  from flax.core.spmd import logical_axis_rules as axis_rules
  from maxtext.configs import pyconfig
  from maxtext.trainers.pre_train import train, train_compile
  from maxtext.utils import maxtext_utils, sharding

  jax.config.update("jax_default_prng_impl", "unsafe_rbg")
  os.environ["LIBTPU_INIT_ARGS"] = (
    os.environ.get("LIBTPU_INIT_ARGS", "") + " --xla_tpu_spmd_rng_bit_generator_unsafe=true"
  )
  base = pathlib.Path(pyconfig.__file__).parent / "base.yml"
  argv = [
    "train_compile",
    str(base),
    *mw.config_overrides(workload, changes, compile_xla_flags=" ".join(flags), run_name="calib"),
  ]
  config = pyconfig.initialize(argv)
  train_compile.validate_config(config)
  mesh = train_compile.get_topology_mesh(config)
  args, kwargs, state_shardings, _, model = train_compile.get_shaped_inputs(mesh, config)
  params_shardings, state_shardings = sharding.maybe_update_params_sharding_with_opt(
    config, state_shardings
  )
  input_shardings = sharding.build_zero1_input_state_mesh_shardings(
    config, state_shardings, params_shardings
  )
  data_sharding = sharding.get_input_data_sharding(config, mesh)
  func, in_shard, out_shard, static, donate = maxtext_utils.get_functional_train_with_signature(
    train.train_step, data_sharding, input_shardings, model, config, params_shardings
  )
  compiled = train_compile.jit_and_compile(
    func,
    args,
    kwargs,
    mesh,
    in_shard,
    out_shard,
    static,
    donate,
    config,
    axis_rules(config.logical_axis_rules),
  )
  return compiled, config


def _versions():
  import importlib.metadata as md

  return {p: md.version(p) for p in ("maxtext", "jax", "jaxlib", "libtpu", "flax")}


def _memory(compiled):
  m = compiled.memory_analysis()
  names = (
    "temp_size_in_bytes",
    "argument_size_in_bytes",
    "output_size_in_bytes",
    "alias_size_in_bytes",
    "generated_code_size_in_bytes",
    "host_temp_size_in_bytes",
    "host_argument_size_in_bytes",
    "host_output_size_in_bytes",
  )
  return {n: getattr(m, n, None) for n in names}


def run(workload, out, changes, dropped, block="maxtext", impl="auto", chunk_size=None):
  """Compiles one workload and writes its folder (see the module docstring).

  block: "maxtext" (MaxText's own MoE block) or "moe_shard" (moe_shard's, dispatch `impl`,
  all_to_all's `chunk_size`).
  """
  out.mkdir(parents=True, exist_ok=True)
  flags = mw.kept_flags(workload, dropped)
  if block == "moe_shard":
    from moe_shard import maxtext as ms_maxtext

    ms_maxtext.install(impl=impl, chunk_size=chunk_size)
  meta = {
    "workload": workload.name,
    "block": block if block == "maxtext" else f"moe_shard(impl={impl})",
    "chunk_size": chunk_size,
    "compile_topology": workload.compile_topology,
    "topology": workload.topology,
    "changes": changes,
    "xla_flags": flags,
    "dropped_flags": list(dropped),
    "versions": _versions(),
    "argv": sys.argv,
  }
  start = time.time()
  try:
    compiled, config = compile_step(workload, changes, flags)
  except Exception as err:
    meta["compile_s"] = time.time() - start
    (out / "error.txt").write_text(f"{type(err).__name__}: {err}\n")
    (out / "meta.json").write_text(json.dumps(meta, indent=1, default=str))
    raise
  meta["compile_s"] = time.time() - start
  from maxtext.utils import maxtext_utils

  total, _, _ = maxtext_utils.calculate_tflops_training_per_device(config, log=False)
  meta["maxtext_tflops_per_device"] = total
  meta["devices"] = (
    int(config.num_target_devices) if hasattr(config, "num_target_devices") else None
  )
  meta["tokens_per_device"] = config.per_device_batch_size * config.max_target_length
  (out / "step.hlo.txt").write_text(compiled.as_text())
  cost = compiled.cost_analysis()
  cost = cost[0] if isinstance(cost, list) else cost
  (out / "cost.json").write_text(json.dumps({k: float(v) for k, v in cost.items()}, indent=1))
  (out / "memory.json").write_text(json.dumps(_memory(compiled), indent=1))
  (out / "meta.json").write_text(json.dumps(meta, indent=1, default=str))
  (out / "error.txt").unlink(missing_ok=True)
  return meta


def main(argv=None):
  p = argparse.ArgumentParser(
    prog="python -m bench.peers.maxtext_train", description=__doc__.split("\n")[0]
  )
  p.add_argument("workload", choices=sorted(mw.WORKLOADS))
  p.add_argument("--out", help="folder for the compiled step (default: /work/calib/WORKLOAD)")
  p.add_argument("--set", action="append", default=[], help="key=value: a config change")
  p.add_argument("--drop-flag", action="append", default=[], help="a published flag to leave out")
  p.add_argument("--probe-flags", action="store_true", help="list the flags libtpu refuses")
  p.add_argument("--block", choices=("maxtext", "moe_shard"), default="maxtext", help="MoE block")
  p.add_argument("--impl", default="auto", help="moe_shard's dispatch with --block moe_shard")
  p.add_argument(
    "--chunk-size", help="C or C_FIRST,C_OVERFLOW: all_to_all's rows per pair and round"
  )
  a = p.parse_args(argv)
  workload = mw.WORKLOADS[a.workload]
  if a.probe_flags:
    refused = probe_flags(workload)
    for key, why in refused:
      print(f"refused: {key}: {why}")
    print(f"{len(refused)} of {len(mw.flag_list(workload.xla_flags))} flags refused")
    return 0
  out = pathlib.Path(a.out or f"/work/calib/{a.workload}")
  chunk = None
  if a.chunk_size is not None:  # parsed as moe_shard.maxtext's command line parses it
    from moe_shard import maxtext as ms_maxtext

    chunk = ms_maxtext.split_options(["x", f"moe_shard_chunk_size={a.chunk_size}"])[0]["chunk_size"]
  meta = run(workload, out, parse_sets(a.set), a.drop_flag, a.block, a.impl, chunk)
  print(json.dumps(meta, indent=1, default=str))
  return 0


if __name__ == "__main__":
  sys.exit(main())
