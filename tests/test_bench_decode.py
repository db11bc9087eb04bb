"""The benchmark's bound (`bench/reading/bound.py`) and model presets (`bench/cases/models.py`)."""

import json
import re

import jax
import numpy as np
import pytest

import moe_shard as ms
from bench.cases import build, models
from bench.cases import programs as progs
from bench.command import checks, cli, flags
from bench.command import rows as row_facts
from bench.command import run as bench_run
from bench.reading import bound
from bench.reports import report


@pytest.fixture(scope="module")
def mesh8():
  return bench_run.make_mesh("8x1", jax.devices())


@pytest.mark.parametrize(
  "L, E, K, T, want",
  [
    (2, 4, 2, 3, 2 * (1 - (1 / 2) ** 3)),  # 1.75: each expert missed by a token half the time
    (1, 8, 2, 2, 1 - (6 / 8) ** 2),  # 0.4375
    (4, 16, 16, 1, 4.0),  # K = E: every expert touched by one token
    (32, 256, 8, 0, 0.0),  # no tokens, nothing touched
  ],
)
def test_expected_touched_experts_by_hand(L, E, K, T, want):
  assert bound.expected_touched(L, E, K, T) == pytest.approx(want, rel=1e-12)


@pytest.mark.parametrize("E, K, T, N", [(16, 3, 5, 4), (8, 2, 2, 8), (64, 8, 12, 8)])
def test_expected_touched_experts_matches_a_monte_carlo_count(E, K, T, N):
  rng = np.random.default_rng(0)
  trials = 20000
  # Each token's K distinct experts: the first K of a random permutation of E.
  experts = np.argsort(rng.random((trials, T, E)), axis=2)[:, :, :K]
  L = E // N
  hit = np.zeros((trials, E), bool)
  np.put_along_axis(hit, experts.reshape(trials, T * K), True, axis=1)
  touched = hit[:, :L].sum(axis=1)  # device 0's experts
  want = bound.expected_touched(L, E, K, T)
  assert abs(touched.mean() - want) < 5 * touched.std() / np.sqrt(trials) + 1e-9


def test_touched_on_the_busiest_device_counts_distinct_experts():
  experts_TK = np.array([[0, 1], [1, 0], [5, -1], [2, 8]])  # -1 and 8 are out of range
  assert bound.touched_on_busiest(experts_TK, 8, 4) == 2  # device 0 holds experts 0 and 1


def test_bound_of_a_kernel_case_by_hand(mesh8):
  size = build.Size(T=16, D=4, F=6, K=2)
  case = build.make_case("kernel", 8, "uniform", size, mesh8)
  held = row_facts.param_bytes(case.args[1])
  assert held["bytes"] == 4 * 6 * 4  # one f32 [4, 6] expert per device
  touched = 1 - (6 / 8) ** 16
  x, y = 2 * 4 * 4, 2 * 6 * 4  # 2 tokens per device: x read, y written
  peak = {"flops": 1e3, "hbm": 1e2}
  fwd = bound.bound(case, held, "fwd", peak)
  assert fwd["touched_experts"] == pytest.approx(touched)
  assert fwd["bound_bytes"] == pytest.approx(96 * touched + x + y)
  assert fwd["bound_flops"] == 2 * 4 * 6 * 16 * 2 / 8
  assert fwd["bound_s"] == pytest.approx(max(fwd["bound_bytes"] / 1e2, 192 / 1e3))
  bwd = bound.bound(case, held, "fwd_bwd")
  # Weights read twice, gradients written once; x, y forward, dy, x, dx backward.
  assert bwd["bound_bytes"] == pytest.approx(3 * 96 * touched + 3 * x + 2 * y)
  assert bwd["bound_flops"] == 3 * fwd["bound_flops"] and "bound_s" not in bwd


def test_bound_counts_quantized_experts_as_stored_and_frozen(mesh8):
  size = build.Size(T=16, D=64, F=64, K=2, dtype="bfloat16", weights_format="int8")
  case = build.make_case("layer", 8, "uniform", size, mesh8, abstract=True)
  held = row_facts.param_bytes(case.args[0])
  # int8 values and one float32 scale per output column, for gate, up and down.
  assert held["expert_bytes"] == held["frozen_bytes"] == 3 * (64 * 64 + 64 * 4)
  touched = 1 - (6 / 8) ** 16
  other = held["bytes"] - held["expert_bytes"]  # the float32 router
  act = 2 * (2 * 64 * 2)
  fwd = bound.bound(case, held, "fwd")
  assert fwd["bound_bytes"] == pytest.approx(other + held["expert_bytes"] * touched + act)
  bwd = bound.bound(case, held, "fwd_bwd")
  # No gradient of the frozen matrices: the router's only.
  weights = other + held["expert_bytes"] * touched
  assert bwd["bound_bytes"] == pytest.approx(2 * weights + other + act * 5 / 2)


# Hand-written from each model's published config.json.
PRESETS = {
  "mixtral-8x7b": dict(
    d_model=4096,
    d_ff=14336,
    top_k=2,
    experts="8",
    expert_type="swiglu",
    expert_bias=False,
    shared_experts=0,
    router={},
  ),
  "qwen3-30b-a3b": dict(
    d_model=2048,
    d_ff=768,
    top_k=8,
    experts="128",
    expert_type="swiglu",
    expert_bias=False,
    shared_experts=0,
    router={},  # norm_topk_prob true: MoEConfig's default
  ),
  "gpt-oss-120b": dict(
    d_model=2880,
    d_ff=2880,
    top_k=4,
    experts="128",
    expert_type="clamped_swiglu",
    expert_bias=True,
    shared_experts=0,
    router=dict(router_logit_bias=True),
  ),
  "deepseek-v3": dict(
    d_model=7168,
    d_ff=2048,
    top_k=8,
    experts="256",
    expert_type="swiglu",
    expert_bias=False,
    shared_experts=1,
    router=dict(
      score_func="sigmoid", num_groups=8, top_k_groups=4, routed_scaling=2.5, bias_balancing=True
    ),
  ),
}


@pytest.mark.parametrize("name", list(PRESETS))
def test_each_preset_is_its_published_config(name):
  assert models.settings(name) == PRESETS[name]
  s = checks.settings(flags.parser().parse_args(["--preset", name]))
  assert {k: s[k] for k in PRESETS[name]} == dict(
    PRESETS[name], experts=[int(PRESETS[name]["experts"])]
  )
  assert s["levels"] == ["layer"] and s["model"] == name
  cfg = ms.MoEConfig(**models.moe_fields(name))  # the loader's mapping builds a valid layer
  assert cfg.normalize_top_k
  if name == "gpt-oss-120b":
    assert (cfg.swiglu_alpha, cfg.swiglu_limit) == (1.702, 7.0)
  if name == "deepseek-v3":
    assert cfg.shared_d_ff == 2048


def test_flags_given_override_the_preset():
  a = flags.parser().parse_args(
    ["--preset", "deepseek-v3", "-K", "4", "-D", "256", "--shared-experts", "0", "-E", "64"]
  )
  s = checks.settings(a)
  assert (s["top_k"], s["d_model"], s["d_ff"], s["shared_experts"]) == (4, 256, 2048, 0)
  assert s["experts"] == [64] and s["router"]["num_groups"] == 8
  with pytest.raises(checks.UsageError, match="layer settings"):
    checks.settings(flags.parser().parse_args(["--preset", "gpt-oss-120b", "--levels", "kernel"]))


def test_a_preset_runs_on_cpu_with_its_router_and_rows_carry_the_bound(tmp_path, capsys):
  # gpt-oss's router bias and clamped SwiGLU with biases, at small sizes.
  argv = ["--preset", "gpt-oss-120b", "-D", "32", "-F", "32", "-E", "8", "-T", "64"]
  argv += ["--impls", "auto", "--modes", "fwd", "--repeats", "1", "--no-progress"]
  assert cli.main([*argv, "--json", str(tmp_path / "r.json")]) == 0
  (row,) = json.loads((tmp_path / "r.json").read_text())["rows"]
  assert row["model"] == "gpt-oss-120b" and row["K"] == 4 and row["rel_err"] < 1e-5
  assert row["bound_bytes"] > 0 and row["bound_flops"] > 0
  assert "bound_s" not in row  # a CPU host has no cited peaks
  assert "bound ms" not in report.table([row])


def tpu_row(**kw):
  """A row of a TPU compile, its fields made up."""
  return dict(
    level="layer", T=64, D=8, F=8, K=2, E=8, routing="uniform", mode="fwd", impl="auto",
    dtype="bfloat16", mesh="8x1", devices=8, topology="v5e:2x4", xla_optimal_s=1e-3,
    estimate_s=5e-4, roofline_s=4.5e-4, compute_s=1e-4, hbm_s=5e-4, ici_s=1e-5,
    hbm_bytes_xla=4e8, hbm_bytes_accessed=4e8, flops_ratio=1.0, wire_bytes=2**20,
    bytes_over_bound=1.0, bytes_over_routing_bound=1.0, temp_bytes=0, rounds=1, dropped=0,
    compile_s=1.0, bound_s=4e-4, **kw,
  )  # fmt: skip


def test_the_table_prints_the_time_over_the_bound():
  row = tpu_row()
  text = report.table([row])
  assert "bound ms (estimate/bound, + latency)" in text and "| 0.4 (1.25) |" in text
  # The one count plus 3 collectives' 4 us each (0.512 ms).
  both = tpu_row(dependent_collectives=3, latency_s=1.2e-5)
  assert "| 0.4 (1.25, 1.28) |" in report.table([both])
  cpu = {k: v for k, v in row.items() if k not in ("topology", "estimate_s", "roofline_s")}
  cpu.update(time_s=dict(median=8e-4, min=8e-4, max=9e-4), gflops=1.0)
  assert "bound ms (time/bound)" in report.table([cpu]) and "(2.00)" in report.table([cpu])


def test_visited_groups_are_the_busiest_devices_rows_per_local_expert():
  """16 experts on 4 devices: device 0 (experts 0-3) gets the most rows; its groups are the
  rows each of its experts gets, one of them none (the grid skips that group)."""
  import types

  experts_TK = np.array([[0, 1], [2, 5], [9, 0]])
  mesh = types.SimpleNamespace(shape={ms.EXPERT: 4})
  case = types.SimpleNamespace(E=16, mesh=mesh, experts_TK=experts_TK, placement=None)
  assert row_facts.visited_groups(case) == {4: [2, 1, 1, 0]}
  assert row_facts.visited_groups(types.SimpleNamespace(**{**vars(case), "placement": 1})) is None


def test_results_files_merge_with_every_command(tmp_path, capsys):
  paths = []
  for name in ("mixtral-8x7b", "qwen3-30b-a3b"):
    saved = dict(
      machine=dict(cpu="x", cores=2, jax="0", load_average_1min=1.0),
      argv=["python", "-m", "bench", "--preset", name],
      rows=[tpu_row(model=name)],
    )
    paths.append(tmp_path / f"{name}.json")
    paths[-1].write_text(json.dumps(saved))
  stem = tmp_path / "merged"
  assert cli.main(["--from-json", ",".join(map(str, paths)), "--out", str(stem)]) == 0
  merged = json.loads((tmp_path / "merged.json").read_text())
  assert [r["model"] for r in merged["rows"]] == ["mixtral-8x7b", "qwen3-30b-a3b"]
  assert merged["argv"] == [
    ["python", "-m", "bench", "--preset", "mixtral-8x7b"],
    ["python", "-m", "bench", "--preset", "qwen3-30b-a3b"],
  ]
  md = (tmp_path / "merged.md").read_text()
  assert "`python -m bench --preset mixtral-8x7b`\n\n`python -m bench --preset qwen3" in md
  assert "| model | level |" in md and "| qwen3-30b-a3b | layer |" in md


def test_program_layout_spares_the_copy_of_gpt_oss_mxfp4_scales():
  """gpt-oss-120b's MXFP4 gate on one of 8 chips (16 experts, D=2880), narrowed to F=256:
  scales u8[16, 90, F]. The device's default layout of that shape puts the 90 rows
  outermost, and the kernel copies the scales into row-major order on every call; held in
  the layouts the compiled program picks (`--param-layout program`), the program has no
  such copy."""
  from test_gmm_tpu_quant import _abstract_weights, _v5e_chip

  from moe_shard.kernels import tpu as gmm_tpu
  from moe_shard.kernels import tpu_quant

  mesh, sds = _v5e_chip()
  G, D, F, M = 16, 2880, 256, 64
  w = _abstract_weights(sds, (G, D, F), "mxfp4")
  assert w.scales.shape == (G, D // 32, F)
  args = (sds((M, D), "bfloat16"), w, sds((G,), "int32"))
  limit = gmm_tpu.vmem_limit(mesh.devices.flat[0].device_kind)
  gmm = jax.jit(lambda x, w, gs: tpu_quant.quantized_gmm(x, w, gs, vmem_limit_bytes=limit))
  copies = lambda program: re.findall(
    rf"u8\[{G},{D // 32},{F}\]\{{[^}}]*\}} copy\(", program.lower(*args).compile().as_text()
  )
  assert copies(gmm)  # the default layouts: the scales copied before the kernel
  assert not copies(progs.in_program_layout(gmm, args, 1))
