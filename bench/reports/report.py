"""The benchmark's results as text and files: tables, Markdown, CSV, JSON and a plot.

Pure functions of the rows (dicts) that `bench/command/run.py` measures; nothing here runs JAX.
"""

from __future__ import annotations


def _ms(t):
  if t is None:
    return "n/a"
  return f"{t * 1e3:.0f}" if t >= 0.01 else f"{t * 1e3:.2g}"


def weights_format(row):
  """The row's routed-expert matrices: its `weights_format`, or (rows from before the
  field) its dtype."""
  return row.get("weights_format", row.get("dtype"))


def weights(row):
  """`weights_format(row)`, with " + LoRA r=R" for rows with expert adapters (`--adapters`)
  and ", program's layout" where the parameters were held in the layouts the compiled
  program picked (`--param-layout program`)."""
  fmt = weights_format(row)
  if row.get("adapter_rank"):
    fmt = f"{fmt} + LoRA r={row['adapter_rank']}"
  return f"{fmt}, program's layout" if row.get("param_layout") == "program" else fmt


def quantized_rows(rows):
  """Whether any row holds quantized expert matrices: then tables show a weights column."""
  return any(weights(r) != r.get("dtype") for r in rows)


def float_only_note(rows):
  """The impls that ran for the float weights only (without adapters), in words ("" when
  none)."""
  if not quantized_rows(rows):
    return ""
  by = {}
  for r in rows:
    other = weights_format(r) != r.get("dtype") or bool(r.get("adapter_rank"))
    by.setdefault(r["impl"], set()).add(other)
  only = [i for i, q in by.items() if q == {False}]
  if not only:
    return ""
  plain = (
    "float weights only, without adapters"
    if any(r.get("adapter_rank") for r in rows)
    else "float weights only"
  )
  return (
    f"\n{', '.join(only)}: {plain} (they compute with float matrices of their "
    "own); the other rows' eff. is the float dense limit's time over theirs.\n"
  )


def routing(row):
  """The routing cell: the skew, and the placement with its redundant slots ("zipf, static
  R=8")."""
  if row.get("placement", "none") == "none":
    return row["routing"]
  return f"{row['routing']}, {row['placement']} R={row['replicas']}"


def table(rows):
  """The results as a Markdown table."""
  tpu = any("topology" in r for r in rows)
  quant = quantized_rows(rows)
  if tpu:
    head = (
      "| level | T | E | routing | mode | impl | estimate ms | XLA est. ms | "
      "lower bound ms (compute/HBM/ICI) | HBM GB (one count; XLA's) | eff. | flops x | MiB/dev | x bound "
      "(uniform/routing) | HBM temp MiB | rounds | dropped | compile s |"
    )
  else:
    head = (
      "| level | T | E | routing | mode | impl | median ms (min-max) | GFLOP/s | eff. | "
      "flops x | MiB/dev | x bound (uniform/routing) | temp MiB | rounds | dropped | "
      "rel err (max abs) | compile s |"
    )
  if quant:
    head = head.replace("| impl |", "| impl | weights |", 1)
  models = any("model" in r for r in rows)
  if models:
    head = head.replace("| level |", "| model | level |", 1)
  balanced = any("balancedness" in r for r in rows)
  if balanced:
    head = head.replace(" | rounds |", " | balance (busiest rows) | rounds |", 1)
  bounded = any("bound_s" in r for r in rows)
  if bounded:  # the time over the bound: the roofline's on TPU, the median elsewhere
    over = "estimate/bound, + latency" if tpu else "time/bound"
    head = head.replace(" | eff. |", f" | bound ms ({over}) | eff. |")
  if any("ici_exposed_s" in r for r in rows):  # the schedule's figure (`reading/schedule.py`)
    head = head.replace("(compute/HBM/ICI)", "(compute/HBM/ICI; ICI exposed)", 1)
  out = [head, "|" + "---|" * (head.count("|") - 1)]
  for r in rows:
    common = f"| {r['level']} | {r['T']} | {r['E']} | {routing(r)} | {r['mode']} | {r['impl']} "
    if models:
      common = f"| {r.get('model', '-')} " + common
    if quant:
      common += f"| {weights(r)} "
    if "error" in r:
      why = r["error"] if r["error"].startswith("not run") else f"did not compile: {r['error']}"
      out.append(common + f"| {why} |" + " |" * (head.count("|") - 8 - quant - models))
      continue
    bound = "/".join(
      f"{r[k]:.2f}" if r.get(k) is not None else "-"
      for k in ("bytes_over_bound", "bytes_over_routing_bound")
    )
    star = "*" if r.get("loop_counted_once") else ""
    eff = f"{r['efficiency']:.2f}" if r.get("efficiency") else "-"
    # A row run outside XLA (the PyTorch peer) has no compiled program to read: "-".
    flops = f"{r['flops_ratio']:.2f}{star}" if "flops_ratio" in r else "-"
    wire = f"{r['wire_bytes'] / 2**20:.2f}{star}" if "wire_bytes" in r else "-"
    temp = f"{r['temp_bytes'] / 2**20:.1f}" if "temp_bytes" in r else "-"
    tail = f"| {_over(r, r.get('bound_s'))} " if bounded else ""
    tail += f"| {eff} | {flops} | {wire} | {bound} | {temp} | "
    if balanced:
      tail += f"{r['balancedness']:.2f} ({r['busiest_rows']}) | " if "balancedness" in r else "- | "
    tail += f"{r['rounds'] if r['rounds'] else '-'} | {r['dropped']} "
    if tpu:
      exposed = f"; {_ms(r['ici_exposed_s'])}" if "ici_exposed_s" in r else ""
      roof = (
        f"{_ms(r['roofline_s'])} ({_ms(r['compute_s'])}/{_ms(r['hbm_s'])}/{_ms(r['ici_s'])}"
        f"{exposed})"
        if "roofline_s" in r
        else "-"
      )
      hbm = (
        f"{r['hbm_bytes_accessed'] / 1e9:.1f}; {r['hbm_bytes_xla'] / 1e9:.1f}"
        if "hbm_bytes_xla" in r
        else "-"
      )
      out.append(
        common + f"| {_ms(r.get('estimate_s'))} | {_ms(r['xla_optimal_s'])} | "
        f"{roof} | {hbm} " + tail + f"| {r['compile_s']:.1f} |"
      )
    else:
      t = r["time_s"]
      err = (
        f"{r['rel_err']:.1e} ({r['max_abs_err']:.1e})"
        if "rel_err" in r
        else f"- ({r['max_abs_err']:.1e})"
        if "max_abs_err" in r
        else "-"
      )
      out.append(
        common + f"| {_ms(t['median'])} ({_ms(t['min'])}-{_ms(t['max'])}) | "
        f"{r['gflops']:.1f} " + tail + f"| {err} | {r['compile_s']:.1f} |"
      )
  if any(r.get("loop_counted_once") for r in rows):
    out.append(
      "\n\\* a loop XLA generated without a trip count it shows was counted once: "
      "these FLOPs and bytes are a lower bound."
    )
  return "\n".join(out) + "\n" + float_only_note(rows)


def seconds_of(row):
  """A row's time: the one count (`estimate_s`) of a TPU compile, else the median wall time."""
  return row.get("estimate_s") if "topology" in row else row.get("time_s", {}).get("median")


def _over(row, bound):
  """ "bound ms (time / bound)", or "-" without a bound; a TPU row's time is its one count
  (`estimate_s`), followed by that plus the collectives' latency (`latency_s`)."""
  t = seconds_of(row)
  if bound is None:
    return "-"
  if t is None or bound <= 0:
    return _ms(bound)
  out = f"{_ms(bound)} ({t / bound:.2f}"
  latency = row.get("latency_s")
  if "topology" in row and latency is not None:
    out += f", {(t + latency) / bound:.2f}"
  return out + ")"


def headline(rows):
  """all_to_all against the best jit-only version of each case: time and bytes."""
  tpu = any("topology" in r for r in rows)
  key = (
    ("estimate_s" if all("estimate_s" in r for r in rows if "error" not in r) else "xla_optimal_s")
    if tpu
    else None
  )

  def seconds(r):
    return r[key] if key else r["time_s"]["median"]

  groups = {}
  for r in rows:
    if "error" not in r:
      group = (r["level"], weights(r), r["T"], r["E"], r["routing"], r["mode"])
      groups.setdefault(group, []).append(r)
  quant = quantized_rows(rows)
  lines = []
  for (level, fmt, T, E, routing, mode), rs in groups.items():
    if quant:
      level = f"{level} ({fmt})"
    a2a = [r for r in rs if r["impl"] == "all_to_all"]
    jit = [r for r in rs if r["impl"].startswith("jit_")]
    timed = [r for r in jit if seconds(r) is not None]
    if not a2a or not jit:
      continue
    a2a = a2a[0]
    light = min(jit, key=lambda r: r["wire_bytes"])
    if timed and seconds(a2a) is not None:
      fast = min(timed, key=seconds)
      speed = f"{_named(fast)} {_ms(seconds(fast))} | {seconds(fast) / seconds(a2a):.1f}x"
    else:
      speed = "n/a | n/a"
    eff = f"{a2a['efficiency']:.2f}" if a2a.get("efficiency") else "-"
    lines.append(
      f"| {level} | {T} | {E} | {routing} | {mode} | {_ms(seconds(a2a))} | {eff} | {speed} | "
      f"{a2a['wire_bytes'] / 2**20:.2f} | {_named(light)} {light['wire_bytes'] / 2**20:.2f} "
      f"| {light['wire_bytes'] / max(a2a['wire_bytes'], 1):.2f}x |"
    )
  if not lines:
    return ""
  what = {
    "estimate_s": "the one count's estimate for the TPU compiled for, not a measurement",
    "xla_optimal_s": "XLA's TPU cost estimate, loop bodies once; not a measurement",
    None: "median wall time",
  }[key]
  return (
    "| level | T | E | routing | mode | all_to_all ms | efficiency | fastest jit-only ms "
    "| speed-up | all_to_all MiB/dev | fewest-bytes jit-only MiB/dev | bytes ratio |\n"
    "|---|---|---|---|---|---|---|---|---|---|---|---|\n"
    + "\n".join(lines)
    + f"\n\n(times: {what}; efficiency: the dense limit's time over all_to_all's; bytes "
    "ratio: the jit-only version's bytes over all_to_all's)\n"
  )


def _named(row):
  """The impl's name, with the items it dropped when it dropped some."""
  return row["impl"] + (f" (drops {row['dropped']})" if row.get("dropped") else "")


def argvs(argv):
  """A results file's commands as a list of argv lists (one, unless merged)."""
  return argv if argv and isinstance(argv[0], list) else [argv]


def commands(argv):
  """The command lines of a results file, each in backticks: `argv` is one command's words,
  or (files merged with `--from-json A,B`) a list of them."""
  return "\n\n".join(f"`{' '.join(words)}`" for words in argvs(argv))


def values(rows, key):
  """The distinct values of `key` over the rows, in order, comma-separated."""
  return ", ".join(str(v) for v in dict.fromkeys(r[key] for r in rows))


def markdown(rows, info, argv, s):
  r0 = rows[0]
  where = (
    f"compiled for TPU {r0['topology']} on this machine: every time is an estimate, nothing ran"
    if "topology" in r0
    else f"{info['devices']} {info['backend']} devices"
  )
  return (
    f"# moe_shard benchmark\n\n{commands(argv)}\n\n"
    + "; ".join(f"{k}={values(rows, k)}" for k in "TDFK")
    + f" (T tokens in all); {r0['dtype']}, "
    + (
      f"expert weights {', '.join(dict.fromkeys(weights(r) for r in rows))}, "
      if quantized_rows(rows)
      else ""
    )
    + (f"{r0['shared_experts']} shared expert(s), " if r0.get("shared_experts") else "")
    + f"mesh {mesh_text(rows)}, {where}. Machine: {info['cpu']}, "
    f"{info['cores']} cores, JAX {info['jax']}, malloc: "
    f"{info.get('malloc', 'not recorded')}, load average "
    f"{info['load_average_1min']:.1f} at start. Layer level: router + dispatch + SwiGLU "
    "+ combine; kernel level: one [D, F] matrix per expert. See `python -m bench "
    "--help` for the columns.\n\n## all_to_all against the best jit-only version\n\n"
    + headline(rows)
    + "\n## Every row\n\n"
    + table(rows)
    + ("\n## Memory per device\n\n" + memory_section(rows) if memory_section(rows) else "")
    + hbm_sections(rows)
  )


def mesh_text(rows):
  """The mesh of the rows in words: "8x1 (expert x data)", or the named axes, e.g.
  "expert=8,data=8, expert weights' D stored split over data"."""
  out = []
  for mesh, fsdp in dict.fromkeys((r["mesh"], r.get("expert_fsdp_axis")) for r in rows):
    text = f"{mesh} (expert x data)" if "=" not in mesh else mesh
    if "tensor=" in mesh:
      text += ", each expert's F split over tensor"
    if fsdp:
      text += f", expert weights' D stored split over {fsdp}"
    out.append(text)
  return "; ".join(out)


def memory_section(rows):
  """Per-device memory of the rows that record the layer's parameters: as stored, the
  compiled program's arguments and temp, and (with --model-layers) a model of such layers'
  weights, gradients and Adam state. Empty when no row has them."""
  rows = [r for r in rows if "param_bytes" in r and "error" not in r]
  if not rows:
    return ""
  layers = any("model_state_bytes" in r for r in rows)
  quant = quantized_rows(rows)
  experts = any("expert_bytes" in r for r in rows)
  head = (
    "| T | E | mode | impl |"
    + (" weights |" if quant else "")
    + " params MiB |"
    + (" experts MiB |" if experts else "")
    + " arguments MiB | temp MiB |"
  )
  split = any("experts" in r.get("model_state_bytes", {}) for r in rows)
  if layers:
    head += f" model: weights{' (experts)' if split else ''} / grads / Adam GB | model total GB |"
  out = [head, "|" + "---|" * (head.count("|") - 1)]
  for r in rows:
    line = (
      f"| {r['T']} | {r['E']} | {r['mode']} | {r['impl']} |"
      + (f" {weights(r)} |" if quant else "")
      + f" {r['param_bytes'] / 2**20:.1f} |"
      + (
        f" {r['expert_bytes'] / 2**20:.1f} |" if "expert_bytes" in r else " - |" if experts else ""
      )
      + f" {r['argument_bytes'] / 2**20:.1f} | {r['temp_bytes'] / 2**20:.1f} |"
    )
    if layers:
      m = r.get("model_state_bytes")
      line += (
        f" {m['weights'] / 1e9:.1f} ({m['experts'] / 1e9:.1f}) / {m['grads'] / 1e9:.1f} / "
        f"{m['adam'] / 1e9:.1f} | {m['total'] / 1e9:.1f} |"
        if m and "experts" in m
        else f" {m['weights'] / 1e9:.1f} / {m['grads'] / 1e9:.1f} / {m['adam'] / 1e9:.1f} | "
        f"{m['total'] / 1e9:.1f} |"
        if m
        else " - | - |"
      )
    out.append(line)
  n = max((r["model_state_bytes"]["layers"] for r in rows if "model_state_bytes" in r), default=0)
  held = (
    "; experts: the routed experts' matrices as held (values and scales when quantized)"
    if experts
    else ""
  )
  note = (
    f"\n(per device; params: the layer's parameters as stored{held}; model: {n} such "
    "layers, gradients in the weights' dtype, Adam's two moments in float32, "
    + ("none for quantized matrices (frozen), " if quant else "")
    + "no activations)\n"
    if layers
    else f"\n(per device; params: the layer's parameters as stored{held})\n"
  )
  return "\n".join(out) + "\n" + note


def hbm_sections(rows):
  """The `--hbm-table` reports of the rows that have one, as Markdown sections."""
  return "".join(
    f"\n## HBM: {r['level']} T={r['T']} E={r['E']} {r['routing']} {r['mode']} "
    f"{r['impl']}\n\n{r['hbm_table']}"
    for r in rows
    if "hbm_table" in r
  )
