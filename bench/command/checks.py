"""The parsed flags turned into a run's settings, each checked (`settings`): a bad flag or an
impossible combination raises `UsageError`, one line on stderr, exit code 2."""

from __future__ import annotations

import math
import os

from bench import LEVELS, MODES, PLACEMENTS, ROUTINGS
from bench.cases import models
from bench.command.flags import FLOAT_WEIGHTS, QUANTIZED_WEIGHTS, _impl_names
from bench.command.presets import PRESETS


class UsageError(Exception):
  """A bad flag or an impossible combination: one line on stderr, exit code 2."""


def _list(value, allowed, what):
  items = [v.strip() for v in value.split(",") if v.strip()]
  bad = [v for v in items if v not in allowed]
  if bad or not items:
    raise UsageError(
      f"unknown {what} {', '.join(bad) or repr(value)}; choose from {', '.join(allowed)}"
    )
  return items


def _ints(value, what):
  try:
    items = [int(v) for v in value.split(",")]
  except ValueError:
    raise UsageError(f"{what} must be comma-separated integers (got {value!r})") from None
  if any(v < 1 for v in items):
    raise UsageError(f"{what} must be >= 1 (got {value!r})")
  return items


def settings(a):
  """Merges the preset with the flags; validates what needs no JAX."""
  preset = (
    ("tpu_quick" if a.quick else "tpu")
    if a.tpu
    else ("quick" if a.quick else "sweep" if a.sweep else "default")
  )
  if a.deepseek:
    preset = "deepseek"
  s = dict(PRESETS[preset], preset=preset)
  if a.deepseek and a.tpu:
    s.update(tokens=32768, d_model=2048, d_ff=1024, repeats=0)
  if a.preset:
    s.update(models.settings(a.preset), model=a.preset, levels="layer")
  s.setdefault("router", {})
  for key in (
    "tokens",
    "d_model",
    "d_ff",
    "top_k",
    "experts",
    "routing",
    "levels",
    "modes",
    "repeats",
  ):
    if getattr(a, key) is not None:
      s[key] = getattr(a, key)
  s["tokens"] = _ints(str(s["tokens"]), "--tokens")
  for key in ("d_model", "d_ff", "top_k"):
    if s[key] < 1:
      raise UsageError(f"--{key.replace('_', '-')} must be >= 1 (got {s[key]})")
  s["scaling"] = bool(a.scaling or s.get("scaling"))
  if s["repeats"] < (0 if a.tpu else 1):
    raise UsageError(f"--repeats must be >= 1 (got {s['repeats']})")
  s["experts"] = _ints(str(s["experts"]), "--experts")
  s["routing"] = _list(s["routing"], ROUTINGS, "routing")
  s["levels"] = _list(s["levels"], LEVELS, "level")
  s["modes"] = _list(s["modes"], MODES, "mode")
  names = _impl_names()
  s["impls"] = _list(a.impls or s.get("impls") or ",".join(names), names, "impl")
  s["dtype"] = a.dtype or ("bfloat16" if a.tpu else "float32")
  if a.hbm_table and not a.tpu:
    raise UsageError("--hbm-table needs --tpu (it reads a compiled TPU program)")
  if a.param_layout != "default" and not a.tpu:
    raise UsageError("--param-layout needs --tpu (host and GPU programs take the default)")
  if a.hbm_table < 0:
    raise UsageError(f"--hbm-table must be >= 0 (got {a.hbm_table})")
  if a.capacity_factor <= 0:
    raise UsageError(f"--capacity-factor must be > 0 (got {a.capacity_factor})")
  chunks = a.chunk_size if isinstance(a.chunk_size, tuple) else (a.chunk_size,)
  if a.chunk_size is not None and min(chunks) < 1:
    raise UsageError(f"--chunk-size must be >= 1 (got {a.chunk_size})")
  if not (math.isfinite(a.zipf_s) and a.zipf_s > 0):
    raise UsageError(f"--zipf-s must be a finite number > 0 (got {a.zipf_s})")
  if a.replicas < 0:
    raise UsageError(f"--replicas must be >= 0 (got {a.replicas})")
  default = "static" if a.replicas else "none"
  s["placements"] = _list(a.placement or default, PLACEMENTS, "placement")
  s["replicas"] = a.replicas
  placed = [p for p in s["placements"] if p != "none"]
  if placed and "kernel" in s["levels"]:
    raise UsageError("--placement is a layer setting: --levels layer only")

  outputs = [("--json", a.json, a.json), ("--csv", a.csv, a.csv), ("--plot", a.plot, a.plot)]
  if a.out is not None:
    outputs += [("--out", a.out, a.out + ext) for ext in (".json", ".csv", ".md")]
  for flag, value, path in outputs:
    if value is not None:
      _check_writable(flag, value, path)
  if a.num_processes < 1:
    raise UsageError(f"--num-processes must be >= 1 (got {a.num_processes})")
  if a.devices is not None and a.devices < 1:
    raise UsageError(f"--devices must be >= 1 (got {a.devices})")
  axes = dict(mesh_axes(a.mesh)) if a.mesh is not None else {EXPERT_AXIS: None}
  s["expert_tensor_axis"] = TENSOR_AXIS if TENSOR_AXIS in axes else None
  s["expert_fsdp_axis"] = a.fsdp
  if a.fsdp is not None and (a.fsdp not in axes or a.fsdp in (EXPERT_AXIS, TENSOR_AXIS)):
    others = [n for n in axes if n not in (EXPERT_AXIS, TENSOR_AXIS)]
    raise UsageError(
      f"--fsdp must name a --mesh axis other than {EXPERT_AXIS} and {TENSOR_AXIS} "
      f"(got {a.fsdp!r}; such axes here: {', '.join(others) or 'none'})"
    )
  if (s["expert_tensor_axis"] or a.fsdp) and "kernel" in s["levels"]:
    raise UsageError(
      "a tensor axis or --fsdp splits the experts' SwiGLU weights: --levels layer only "
      "(the kernel level runs one [D, F] matrix per expert)"
    )
  if a.shared_experts is not None and a.shared_experts < 0:
    raise UsageError(f"--shared-experts must be >= 0 (got {a.shared_experts})")
  s["shared_experts"] = s.get("shared_experts", 0) if a.shared_experts is None else a.shared_experts
  if s["shared_experts"] and "kernel" in s["levels"]:
    raise UsageError("--shared-experts is a layer setting: --levels layer only")
  if a.model_layers < 0:
    raise UsageError(f"--model-layers must be >= 0 (got {a.model_layers})")
  s["model_layers"] = a.model_layers
  s["weights_formats"] = weights_formats(a.weights_format, s["dtype"])
  quantized = [f for f in s["weights_formats"] if f in QUANTIZED_WEIGHTS]
  takes = _quantized_impl_names()
  if quantized and not any(i in takes for i in s["impls"]):
    raise UsageError(
      f"--weights-format {','.join(quantized)} needs an impl that takes quantized matrices "
      f"(from {', '.join(takes)}; got --impls {','.join(s['impls'])})"
    )
  s["adapter_ranks"] = adapter_ranks(a.adapters)
  if any(s["adapter_ranks"]) and "kernel" in s["levels"]:
    raise UsageError("--adapters puts adapters on the layer's experts: --levels layer only")
  if any(s["adapter_ranks"]) and not any(i in takes for i in s["impls"]):
    raise UsageError(
      f"--adapters needs an impl of the library's layer (from {', '.join(takes)}; got "
      f"--impls {','.join(s['impls'])})"
    )
  s["expert_type"] = a.expert_type or s.get("expert_type", "swiglu")
  s["expert_bias"] = a.expert_bias or s.get("expert_bias", False)
  if (s["expert_type"] != "swiglu" or s["expert_bias"]) and "kernel" in s["levels"]:
    raise UsageError(
      "--expert-type and --expert-bias are layer settings: --levels layer only "
      "(the kernel level runs one [D, F] matrix per expert)"
    )
  return s


def adapter_ranks(value):
  """The ranks of `--adapters`, in order without repeats ([0]: none, when `value` is None)."""
  if value is None:
    return [0]
  ranks = []
  for item in value.split(","):
    try:
      r = int(item)
    except ValueError:
      raise UsageError(f"--adapters takes comma-separated ranks >= 0 (got {value!r})") from None
    if r < 0:
      raise UsageError(f"--adapters takes comma-separated ranks >= 0 (got {value!r})")
    ranks.append(r)
  return list(dict.fromkeys(ranks))


def weights_formats(value, dtype):
  """The formats of `--weights-format`, in order without repeats: the float names as
  `dtype` (float weights in the case's dtype), the quantized ones as given; [dtype] when
  `value` is None."""
  if value is None:
    return [dtype]
  items = _list(value, FLOAT_WEIGHTS + QUANTIZED_WEIGHTS, "--weights-format")
  return list(dict.fromkeys(dtype if f in FLOAT_WEIGHTS else f for f in items))


def _check_writable(flag, value, path):
  """Raises unless the file `path` (written for `flag`'s `value`) can be written once the
  run ends: not a folder, in a folder that exists or can be made, writable."""
  if os.path.isdir(path):
    raise UsageError(f"{flag} would write {path}, which is a folder (got {value!r})")
  existing = os.path.dirname(os.path.abspath(path))
  while not os.path.exists(existing):
    existing = os.path.dirname(existing)
  if not os.path.isdir(existing) or not os.access(existing, os.W_OK | os.X_OK):
    raise UsageError(
      f"{flag} must be in a folder that exists or can be made and written "
      f"(got {value!r}: {existing} is not a writable folder)"
    )


# The mesh axes `--mesh` can name (`ms.EXPERT`, `ms.DATA`, and the expert tensor axis).
EXPERT_AXIS, DATA_AXIS, TENSOR_AXIS = "expert", "data", "tensor"


def mesh_axes(spec):
  """The mesh of `--mesh`, as ((name, size), ...) in layout order.

  "8x1" -> (("expert", 8), ("data", 1)); "expert=8,tensor=8" -> (("expert", 8), ("tensor",
  8)). Named axes come from expert, tensor and data, each at most once, expert first (the
  benchmark's host accounting numbers devices expert-major).

  Raises:
    UsageError: any other spec.
  """
  if "=" not in spec:
    try:
      n_e, n_d = (int(v) for v in spec.split("x"))
    except ValueError:
      n_e = n_d = 0
    if n_e < 1 or n_d < 1:
      raise UsageError(
        f"--mesh must be EXPERTxDATA with positive sizes, e.g. 8x1, or named axes, e.g. "
        f"expert=8,tensor=8 (got {spec!r})"
      )
    return ((EXPERT_AXIS, n_e), (DATA_AXIS, n_d))
  names = (EXPERT_AXIS, TENSOR_AXIS, DATA_AXIS)
  axes = []
  for item in spec.split(","):
    name, _, size = item.partition("=")
    name = name.strip()
    try:
      size = int(size)
    except ValueError:
      size = 0
    if name not in names or size < 1:
      raise UsageError(
        f"--mesh axes must be AXIS=SIZE with AXIS from {', '.join(names)} and SIZE >= 1 "
        f"(got {item!r} in {spec!r})"
      )
    axes.append((name, size))
  seen = [n for n, _ in axes]
  if len(set(seen)) < len(seen) or seen[0] != EXPERT_AXIS:
    raise UsageError(f"--mesh must name each axis at most once, {EXPERT_AXIS} first (got {spec!r})")
  return tuple(axes)


def _quantized_impl_names():
  from bench.cases.impls import BENCH_IMPLS

  return tuple(k for k, v in BENCH_IMPLS.items() if v.quantized)
