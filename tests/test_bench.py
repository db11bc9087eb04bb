"""The benchmark CLI: its host-side accounting against the library, its outputs, its errors."""

import dataclasses
import json
import math
import os
import pathlib
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import moe_shard as ms
from bench import ROUTINGS
from bench.cases import baselines, build, common, impls, reference
from bench.cases import programs as progs
from bench.command import checks, cli, flags
from bench.command import rows as row_facts
from bench.command import run as bench_run
from bench.reading import accounting, measure, replica_accounting
from bench.reports import report

SMALL = build.Size(T=256, D=16, F=32, K=2)
SMALL_ARGS = ["-T", "256", "-D", "16", "-F", "32", "-E", "8", "--repeats", "1", "--no-progress"]


@pytest.fixture(scope="module")
def mesh8():
  return bench_run.make_mesh("8x1", jax.devices())


@pytest.fixture(scope="module")
def mesh42():
  return bench_run.make_mesh("4x2", jax.devices())


@pytest.mark.parametrize("routing", ROUTINGS)
def test_synthetic_routing_follows_its_skew(routing):
  e, w = common.synthetic_routing(routing, 512, 16, 2, num_devices=8)
  assert e.shape == w.shape == (512, 2)
  assert np.all(e[:, 0] != e[:, 1])  # K distinct experts
  np.testing.assert_allclose(w.sum(axis=1), 1.0, rtol=1e-6)
  load = np.bincount(e.ravel(), minlength=16)
  if routing == "hot_expert":
    assert load[0] == 512
  elif routing == "one_device":
    assert load[2:].sum() == 0  # E / N = 2 experts on device 0, K = 2
  elif routing == "zipf":
    assert load.max() > 3 * 512 * 2 / 16
  else:
    assert load.max() < 2 * 512 * 2 / 16


@pytest.mark.parametrize(
  "mesh_name, routing",
  [("mesh8", "zipf"), ("mesh8", "one_device"), ("mesh42", "uniform"), ("mesh42", "hot_expert")],
)
def test_host_rounds_and_trip_counts_match_the_library(routing, mesh_name, request):
  """The host's rounds equal the library's stats; its trip counts cover every loop and
  give executed dot FLOPs of at least the routed ones."""
  mesh = request.getfixturevalue(mesh_name)
  case = build.make_case("kernel", 8, routing, SMALL, mesh)
  x, w, e, g, _ = case.args
  _, stats = ms.moe_all_to_all(x, w, e, g, mesh=mesh, return_stats=True)
  acc = impls.BENCH_IMPLS["all_to_all"].accounting(case)
  assert (acc.rounds, acc.dropped) == (int(stats["rounds"]), 0)
  compiled = progs.programs(case, "all_to_all")["fwd"].lower(*case.args).compile()
  trips = acc.trips
  assert len(trips) == mesh.size
  for t in trips:
    # The only dots are the tiles the host's counts visit, each once (the combine is an
    # elementwise sum over K, `local.rows_to_tokens`); and every routed row is in some
    # tile, so at least the routed FLOPs run (tiles pad up).
    rows = sum(
      int(key.rsplit("_", 1)[1]) * n
      for key, n in t.items()
      if key.split("/")[-1].startswith("gmm_tile_")
    )
    assert measure.executed_flops(compiled, t)["dot_executed"] == 2 * SMALL.D * SMALL.F * rows
  executed = sum(measure.executed_flops(compiled, t)["dot_executed"] for t in trips)
  assert case.routed_flops <= executed <= 1.5 * case.routed_flops


def independent_rounds(experts_TK, E, mesh_shape, K, chunk_size=None):
  """all_to_all rounds by the documented rule, written out from the routing alone.

  Tokens are split in order over the devices (block d on the d-th device, mesh order);
  device d sends each item to expert-axis position expert // (E / N). With T_dev tokens
  per device and mean = ceil(T_dev * K / N): C_first = max(8, 8 * ceil((mean +
  ceil(4 * sqrt(mean))) / 8)) and C_overflow = C_first (an int chunk_size sets both), and
  rounds = 1 + ceil(max(0, busiest (source, destination) queue - C_first) / C_overflow).
  """
  N, devices = mesh_shape[0], mesh_shape[0] * mesh_shape[1]
  ids = np.asarray(experts_TK).reshape(devices, -1)  # [device, T_dev * K] in token order
  t_dev = ids.shape[1] // K
  busiest = max(
    int(np.sum((ids[d] >= 0) & (ids[d] < E) & (ids[d] // (E // N) == n)))
    for d in range(devices)
    for n in range(N)
  )
  if chunk_size is None:
    mean = math.ceil(t_dev * K / N)
    c_first = max(8, 8 * math.ceil((mean + math.ceil(4 * math.sqrt(mean))) / 8))
    c_overflow = c_first
  else:
    c_first = c_overflow = chunk_size
  return 1 + math.ceil(max(0, busiest - c_first) / c_overflow)


@pytest.mark.parametrize(
  "level, routing, mesh_name, chunk_size",
  [
    ("kernel", "uniform", "mesh8", None),
    ("kernel", "zipf", "mesh8", None),
    ("kernel", "hot_expert", "mesh42", None),
    ("kernel", "one_device", "mesh8", 8),
    ("layer", "hot_expert", "mesh42", None),
  ],
)
def test_reported_rounds_match_an_independent_host_model(
  level, routing, mesh_name, chunk_size, request
):
  mesh = request.getfixturevalue(mesh_name)
  case = build.make_case(level, 8, routing, dataclasses.replace(SMALL, chunk_size=chunk_size), mesh)
  want = independent_rounds(
    case.experts_TK, 8, (mesh.shape["expert"], mesh.shape["data"]), SMALL.K, chunk_size
  )
  assert routing == "uniform" or want > 1  # skew: overflow rounds, so the count is tested
  acc = impls.BENCH_IMPLS["all_to_all"].accounting(case)
  assert (acc.rounds, acc.dropped) == (want, 0)


@pytest.mark.parametrize("mesh_name, routing", [("mesh8", "zipf"), ("mesh42", "hot_expert")])
def test_ragged_host_accounting_matches_the_library(routing, mesh_name, request):
  """ragged_all_to_all: the host's rounds equal the library's, its tile counts visit every
  received row (CPU: the emulation, no ragged-all-to-all in the program), and its exact
  forward bytes are the routing's own bound."""
  mesh = request.getfixturevalue(mesh_name)
  case = build.make_case("kernel", 8, routing, SMALL, mesh)
  x, w, e, g, _ = case.args
  _, stats = ms.moe_ragged_all_to_all(x, w, e, g, mesh=mesh, return_stats=True)
  acc = impls.BENCH_IMPLS["ragged_all_to_all"].accounting(case)
  assert (acc.rounds, acc.dropped) == (int(stats["rounds"]), 0)
  compiled = progs.programs(case, "ragged_all_to_all")["fwd"].lower(*case.args).compile()
  assert "ragged-all-to-all" not in measure.collective_bytes(compiled, acc.trips[0])
  received = np.asarray(stats["received_items"])
  for d, t in enumerate(acc.trips):
    rows = sum(
      int(key.rsplit("_", 1)[1]) * n
      for key, n in t.items()
      if key.split("/")[-1].startswith("gmm_tile_")
    )
    assert received[d] <= rows <= received[d] + acc.rounds * 8 * 32  # tiles pad a little
    # The tiles are the only dots (the combine is an elementwise sum over K).
    assert measure.executed_flops(compiled, t)["dot_executed"] == 2 * SMALL.D * SMALL.F * rows
  # Each item crosses once each way, whatever the rounds: the routing's own bound, exactly.
  assert acc.sent_bytes["fwd"] == pytest.approx(accounting.routing_bound_bytes(case))


@pytest.mark.parametrize(
  "tokens, k, n, num_local",
  [(256, 8, 8, 16), (256, 8, 8, 32), (256, 4, 8, 16), (8, 2, 8, 1), (4096, 2, 8, 8), (40, 2, 4, 2)],
)
def test_ragged_capacity_written_out_equals_the_library(tokens, k, n, num_local):
  """The host's receive-buffer rule, written out from the docs, gives the library's sizes,
  the rounding to the grouped matmul's row tiles (several local experts) included."""
  from moe_shard.plan import default_capacity

  want = default_capacity(tokens, k, num_devices=n, num_local=num_local)
  got = accounting.ragged_capacity(tokens, k, n, num_local=num_local)
  assert got == (want.first, want.big, want.last)
  if (tokens, k, num_local) == (256, 8, 16):
    assert got[0] == 2304  # 2232 rows rounded to whole 256-row tiles


def test_layer_level_reports_the_rounds_the_host_counts(mesh42):
  """At layer level the routing comes from the biased router; the host recomputes it."""
  case = build.make_case("layer", 8, "hot_expert", SMALL, mesh42)
  load = np.bincount(case.experts_TK.ravel(), minlength=8)
  assert load[0] == SMALL.T  # the router's bias row makes expert 0 every token's choice
  y, _, rounds, dropped = progs.programs(case, "all_to_all")["fwd"](*case.args)
  acc = impls.BENCH_IMPLS["all_to_all"].accounting(case)
  assert (int(rounds), int(dropped)) == (acc.rounds, acc.dropped)
  params, x, _ = (jax.device_get(a) for a in case.args)
  ref = reference.layer(params, np.asarray(x), case.cfg, case.experts_TK)
  np.testing.assert_allclose(np.asarray(y), ref, rtol=1e-4, atol=1e-4)


def test_gshard_baseline_matches_the_reference_without_drops(mesh8):
  case = build.make_case("kernel", 8, "uniform", SMALL, mesh8)
  x, w, e, g, _ = case.args
  y, dropped = jax.jit(lambda *a: baselines.gshard_moe(*a, mesh=mesh8, capacity_factor=8.0))(
    x, ms.Linear(w_EDF=w), e, g
  )
  ref = ms.moe_ragged_dot(*(jax.device_get(a) for a in (x, w, e, g)))
  assert int(dropped) == 0
  np.testing.assert_allclose(np.asarray(y), np.asarray(ref), rtol=1e-5, atol=1e-5)


def _slot_major_drops(experts_TK, groups, capacity):
  """Host model of the baseline: in each group, items in slot-major order past C drop."""
  T, K = experts_TK.shape
  e = experts_TK.reshape(groups, T // groups, K).transpose(0, 2, 1).reshape(groups, -1)
  kept = np.ones_like(e, bool)
  for g in range(groups):
    counts = {}
    for i, ex in enumerate(e[g]):
      kept[g, i] = counts.get(ex, 0) < capacity
      counts[ex] = counts.get(ex, 0) + 1
  kept = kept.reshape(groups, K, T // groups).transpose(0, 2, 1).reshape(T, K)
  return np.where(kept, experts_TK, -1)


@pytest.mark.parametrize("mesh_name, routing", [("mesh8", "uniform"), ("mesh42", "hot_expert")])
def test_gshard_drops_slot_major_past_capacity(mesh_name, routing, request):
  mesh = request.getfixturevalue(mesh_name)
  size = dataclasses.replace(SMALL, capacity_factor=1.0)
  case = build.make_case("kernel", 8, routing, size, mesh)
  x, w, e, g, _ = case.args
  y, dropped = jax.jit(lambda *a: baselines.gshard_moe(*a, mesh=mesh, capacity_factor=1.0))(
    x, ms.Linear(w_EDF=w), e, g
  )
  acc = impls.BENCH_IMPLS["jit_gshard_einsum"].accounting(case)
  assert (acc.rounds, acc.dropped) == (1, int(dropped))
  assert routing == "uniform" or int(dropped) > 0
  C = -(-(SMALL.T // mesh.size) * SMALL.K // 8)  # ceil(1.0 * S * K / E)
  kept = _slot_major_drops(case.experts_TK, mesh.size, C)
  assert int(np.sum(kept < 0)) == int(dropped)
  np.testing.assert_array_equal(acc.kept, kept >= 0)
  x, w, g = (jax.device_get(a) for a in (x, w, g))
  np.testing.assert_allclose(
    np.asarray(y), np.asarray(ms.moe_ragged_dot(x, w, kept, g)), rtol=1e-5, atol=1e-5
  )


def test_routing_bound_follows_the_skew(mesh8):
  uniform = build.make_case("kernel", 8, "uniform", SMALL, mesh8)
  assert 1.0 <= accounting.routing_bound_bytes(uniform) / uniform.bound_bytes < 1.3
  skewed = build.make_case("kernel", 8, "one_device", SMALL, mesh8)
  # Every token goes to experts 0 and 1 (K = 2), on devices 0 and 1. Device 0 returns F-wide
  # outputs for the 7 other devices' tokens and sends its own tokens' second items to
  # device 1, D wide.
  t_dev = SMALL.T // 8
  assert accounting.routing_bound_bytes(skewed) == (7 * t_dev * SMALL.F + t_dev * SMALL.D) * 4


def test_a_program_that_does_not_compile_is_a_row_not_a_crash(monkeypatch, capsys):
  real = progs.programs_and_args

  class Unfit:
    def lower(self, *args):
      raise RuntimeError("RESOURCE_EXHAUSTED: Ran out of memory in memory space hbm.")

  def programs_and_args(case, impl):
    if impl == "all_gather":
      return {m: Unfit() for m in ("fwd", "fwd_bwd")}, case.args
    return real(case, impl)

  monkeypatch.setattr(progs, "programs_and_args", programs_and_args)
  assert (
    cli.main(
      [*SMALL_ARGS, "--levels", "kernel", "--impls", "all_gather,jit_masked_scan", "--modes", "fwd"]
    )
    == 0
  )
  out = capsys.readouterr().out
  assert "| all_gather | did not compile: RuntimeError: RESOURCE_EXHAUSTED" in out
  assert "| jit_masked_scan | " in out


def test_cli_run_writes_json_csv_markdown_and_plot(tmp_path, capsys):
  stem = str(tmp_path / "r")
  png = str(tmp_path / "r.png")
  code = cli.main(
    [
      *SMALL_ARGS,
      "--levels",
      "kernel",
      "--routing",
      "zipf",
      "--impls",
      "all_to_all,jit_gshard_einsum",
      "--capacity-factor",
      "4",
      "--out",
      stem,
      "--plot",
      png,
    ]
  )
  assert code == 0
  out = capsys.readouterr().out
  assert "all_to_all" in out and "fastest jit-only" in out
  data = json.loads(pathlib.Path(stem + ".json").read_text())
  rows = data["rows"]
  assert data["machine"]["jax"] == jax.__version__
  assert data["machine"]["malloc"].startswith(("glibc mallopt", "system default"))
  assert len(rows) == 2 * 2  # impls x modes
  for r in rows:
    assert r["time_s"]["min"] <= r["time_s"]["median"] <= r["time_s"]["max"]
    assert r["flops_ratio"] >= 0.99 and r["temp_bytes"] >= 0 and r["compile_s"] > 0
    if r["mode"] == "fwd":  # against the NumPy reference without the dropped items
      assert r["max_abs_err"] < 1e-3
  a2a = [r for r in rows if r["impl"] == "all_to_all"]
  assert all(r["rounds"] >= 1 and r["dropped"] == 0 and r["wire_bytes"] > 0 for r in a2a)
  # The reported rounds are those of the routing the CLI draws (seed 0, 8x1 mesh).
  experts_TK, _ = common.synthetic_routing("zipf", 256, 8, 2, num_devices=8, seed=0)
  assert {r["rounds"] for r in a2a} == {independent_rounds(experts_TK, 8, (8, 1), 2)}
  header = pathlib.Path(stem + ".csv").read_text().splitlines()[0].strip().split(",")
  assert header[:5] == ["level", "impl", "E", "routing", "mode"]
  assert "all_to_all against the best jit-only" in pathlib.Path(stem + ".md").read_text()
  assert pathlib.Path(png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize(
  "argv, message",
  [
    (["-E", "6"], "experts (6) must be divisible by the expert axis of the mesh (8)"),
    (["--impls", "all_to_all,fast"], "unknown impl fast"),
    (["--mesh", "16x1"], "mesh 16x1 needs 16 devices, found 8"),
    (["--mesh", "8by1"], "--mesh must be EXPERTxDATA"),
    (["-T", "100"], "tokens (100) must be divisible by the mesh size (8)"),
    (["--routing", "zipf,spiky"], "unknown routing spiky"),
    (["-K", "9"], "top-k (9) must be <= experts (8)"),
    (["--repeats", "0"], "--repeats must be >= 1"),
    (["--chunk-size", "0"], "--chunk-size must be >= 1 (got 0)"),
    (["--chunk-size", "1152,0"], "--chunk-size must be >= 1 (got (1152, 0))"),
    (["--devices", "16"], "--devices 16: JAX is already initialised with 8 CPU devices"),
    (["--placement", "hot"], "unknown placement hot"),
    (["--replicas", "4"], "experts + replicas (8 + 4) must be divisible by the expert axis"),
    (["--placement", "step"], "placement 'step' needs replicas, a multiple of the expert axis"),
  ],
)
def test_bad_input_is_one_line_and_exit_code_2(argv, message, capsys):
  assert cli.main([*SMALL_ARGS, *argv]) == 2
  err = capsys.readouterr().err.strip()
  assert err.startswith("python -m bench: error: ") and message in err
  assert "\n" not in err


def test_chunk_size_takes_an_int_or_a_pair(capsys):
  parse = lambda text: flags.parser().parse_args([*SMALL_ARGS, "--chunk-size", text]).chunk_size
  assert parse("288") == 288 and parse("1152,288") == (1152, 288)
  with pytest.raises(SystemExit):
    parse("12x")
  assert "expected C or C_FIRST,C_OVERFLOW, integers (got '12x')" in capsys.readouterr().err


def _usage_error_before_any_run(monkeypatch, capsys, argv):
  """The one line `cli.main(argv)` prints on stderr, failing if the run would start (the
  devices asked for, then JAX): these checks come before any JAX work."""

  def started(*args, **kwargs):
    raise AssertionError("the run started: the check must come before it")

  monkeypatch.setattr(cli, "ask_for_devices", started)
  monkeypatch.setattr(cli, "run", started)
  assert cli.main([*SMALL_ARGS, *argv]) == 2
  err = capsys.readouterr().err.strip()
  assert err.startswith("python -m bench: error: ") and "\n" not in err
  return err.removeprefix("python -m bench: error: ")


@pytest.mark.parametrize("zipf_s", ["-1", "0", "nan", "inf"])
def test_zipf_exponent_must_be_positive(zipf_s, monkeypatch, capsys):
  err = _usage_error_before_any_run(
    monkeypatch, capsys, ["--routing", "uniform,zipf", "--zipf-s", zipf_s]
  )
  assert err == f"--zipf-s must be a finite number > 0 (got {float(zipf_s)})"


@pytest.mark.parametrize("flag", ["--out", "--json", "--csv", "--plot"])
def test_output_under_a_file_fails_before_the_run(flag, tmp_path, monkeypatch, capsys):
  blocker = tmp_path / "a_file"
  blocker.write_text("")
  target = str(blocker / "sub" / "results")
  err = _usage_error_before_any_run(monkeypatch, capsys, [flag, target])
  assert err == (
    f"{flag} must be in a folder that exists or can be made and written "
    f"(got {target!r}: {blocker} is not a writable folder)"
  )


def test_output_that_is_a_folder_fails_before_the_run(tmp_path, monkeypatch, capsys):
  err = _usage_error_before_any_run(monkeypatch, capsys, ["--json", str(tmp_path)])
  assert err == f"--json would write {tmp_path}, which is a folder (got {str(tmp_path)!r})"


@pytest.mark.parametrize(
  "spec, axes",
  [
    ("8x1", (("expert", 8), ("data", 1))),
    ("4x2", (("expert", 4), ("data", 2))),
    ("expert=4,tensor=2", (("expert", 4), ("tensor", 2))),
    ("expert=2,data=2,tensor=2", (("expert", 2), ("data", 2), ("tensor", 2))),
  ],
)
def test_mesh_flag_takes_sizes_or_named_axes(spec, axes):
  assert checks.mesh_axes(spec) == axes
  mesh = bench_run.make_mesh(spec, jax.devices())
  assert tuple(mesh.shape.items()) == axes
  assert bench_run.mesh_label(mesh) == spec


@pytest.mark.parametrize(
  "argv, message",
  [
    (["--mesh", "tensor=2,expert=4"], "--mesh must name each axis at most once, expert first"),
    (["--mesh", "expert=4,expert=2"], "--mesh must name each axis at most once, expert first"),
    (["--mesh", "expert=4,model=2"], "--mesh axes must be AXIS=SIZE with AXIS from expert, "),
    (["--mesh", "expert=4,data=0"], "(got 'data=0' in 'expert=4,data=0')"),
    (["--mesh", "expert=4,data=2", "--fsdp", "tensor"], "--fsdp must name a --mesh axis"),
    (["--fsdp", "data"], "(got 'data'; such axes here: none)"),
    (["--mesh", "expert=4,tensor=2", "--levels", "kernel"], "--levels layer only"),
    (["--model-layers", "-1"], "--model-layers must be >= 0 (got -1)"),
    (["--shared-experts", "1", "--levels", "kernel"], "--levels layer only"),
  ],
)
def test_bad_mesh_axes_fail_before_the_run(argv, message, monkeypatch, capsys):
  assert message in _usage_error_before_any_run(monkeypatch, capsys, argv)


def test_split_axes_reach_the_layer_config_and_the_stored_bytes():
  """A tensor axis splits each expert's F, --fsdp its matrices' last dimension: the case's
  config names them and each device stores 1/2 of the expert weights; the router stays
  whole."""
  a = flags.parser().parse_args(
    [*SMALL_ARGS, "--mesh", "expert=4,tensor=2", "--levels", "layer", "--model-layers", "3"]
  )
  s = checks.settings(a)
  assert (s["expert_tensor_axis"], s["expert_fsdp_axis"], s["model_layers"]) == ("tensor", None, 3)
  s = checks.settings(flags.parser().parse_args([*SMALL_ARGS, "--mesh", "4x2", "--fsdp", "data"]))
  assert (s["expert_tensor_axis"], s["expert_fsdp_axis"]) == (None, "data")
  D, F, E = SMALL.D, SMALL.F, 8
  router = D * E * 4
  experts = 3 * E * D * F * 4  # gate, up, down in float32
  for spec, split in [
    ("4x2", {}),
    ("expert=4,tensor=2", dict(expert_tensor_axis="tensor")),
    ("4x2", dict(expert_fsdp_axis="data")),
  ]:
    mesh = bench_run.make_mesh(spec, jax.devices())
    size = dataclasses.replace(SMALL, **split)
    case = build.make_case("layer", E, "uniform", size, mesh, abstract=True)
    assert (case.cfg.expert_tensor_axis, case.cfg.expert_fsdp_axis) == (
      split.get("expert_tensor_axis"),
      split.get("expert_fsdp_axis"),
    )
    stored = row_facts.param_bytes(case.args[0])
    assert stored["bytes"] == router + experts // 4 // (2 if split else 1)
    model = row_facts.model_state_bytes(stored, 3)
    assert model["weights"] == model["grads"] == 3 * stored["bytes"]
    assert model["adam"] == 3 * 8 * stored["elems"]
  s = checks.settings(flags.parser().parse_args([*SMALL_ARGS, "--shared-experts", "1"]))
  assert s["shared_experts"] == 1
  mesh = bench_run.make_mesh("8x1", jax.devices())
  plain, shared = (
    build.make_case("layer", E, "uniform", dataclasses.replace(SMALL, num_shared_experts=n), mesh)
    for n in (0, 1)
  )
  assert shared.cfg.num_shared_experts == 1 and shared.args[0].shared is not None
  assert shared.routed_flops - plain.routed_flops == 3 * 2 * D * F * SMALL.T
  with pytest.raises(ValueError, match="d_ff \\(20\\) must be divisible by the tensor axis"):
    build.check_combination(
      dataclasses.replace(SMALL, F=20, expert_tensor_axis="tensor"),
      8,
      bench_run.make_mesh("expert=1,tensor=8", jax.devices()),
      "layer",
    )


def test_memory_table_and_mesh_words():
  row = dict(
    T=64,
    E=8,
    mode="fwd",
    impl="all_to_all",
    mesh="expert=8,data=8",
    expert_fsdp_axis="data",
    param_bytes=3 * 2**20,
    argument_bytes=5 * 2**20,
    temp_bytes=7 * 2**20,
    model_state_bytes=row_facts.model_state_bytes({"bytes": 2e9, "elems": 1e9}, 2),
  )
  lines = report.memory_section([row]).splitlines()
  assert lines[2] == "| 64 | 8 | fwd | all_to_all | 3.0 | 5.0 | 7.0 | 4.0 / 4.0 / 16.0 | 24.0 |"
  assert "model: 2 such layers" in lines[-1]
  assert report.memory_section([dict(row, error="did not compile")]) == ""
  assert report.mesh_text([row]) == "expert=8,data=8, expert weights' D stored split over data"
  assert report.mesh_text([dict(mesh="8x1")]) == "8x1 (expert x data)"


def test_uniform_layer_routing_loads_every_expert_alike(mesh8):
  """The layer's router scores every expert alike (orthonormal columns): at E=64, K=2 over
  65536 items the busiest expert stays within 4 standard deviations of the mean, as under
  a uniform draw; the norms of a plain Gaussian draw's columns would skew the loads."""
  size = dataclasses.replace(SMALL, T=32768, D=128)
  case = build.make_case("layer", 64, "uniform", size, mesh8, abstract=True)
  load = np.bincount(case.experts_TK.ravel(), minlength=64)
  mean = 32768 * 2 / 64
  assert load.max() < mean + 4 * np.sqrt(mean) and load.min() > mean - 4 * np.sqrt(mean)
  w = build.equal_logit_columns(np.random.default_rng(0).standard_normal((128, 64)))
  np.testing.assert_allclose(w.T @ w, np.eye(64), atol=1e-5)
  w = build.equal_logit_columns(np.random.default_rng(0).standard_normal((16, 64)))
  np.testing.assert_allclose(np.linalg.norm(w, axis=0), 1.0, rtol=1e-5)


def test_tpu_compile_for_v5e(capsys):
  """Compiles for a TPU v5e 2x4 slice here (libtpu) and reports estimates."""
  pytest.importorskip("libtpu")
  code = cli.main(
    [
      "--tpu",
      "v5e:2x4",
      "-T",
      "512",
      "-D",
      "128",
      "-F",
      "256",
      "-E",
      "8",
      "--levels",
      "kernel",
      "--impls",
      "all_to_all,jit_ragged_dot",
      "--modes",
      "fwd",
      "--no-progress",
    ]
  )
  assert code == 0
  out = capsys.readouterr().out
  assert "estimate ms" in out and "lower bound ms" in out and "all_to_all" in out


def test_tpu_compile_in_the_programs_layouts(tmp_path, capsys):
  """`--param-layout program`: w in the layouts the compiled program picks; the rows say so,
  and off a TPU the flag is refused."""
  pytest.importorskip("libtpu")
  argv = ["--tpu", "v5e:2x4", "-T", "512", "-D", "128", "-F", "256", "-E", "8"]
  argv += ["--levels", "kernel", "--impls", "all_to_all", "--modes", "fwd", "--no-progress"]
  out = tmp_path / "r.json"
  assert cli.main([*argv, "--param-layout", "program", "--json", str(out)]) == 0
  (row,) = json.loads(out.read_text())["rows"]
  assert row["param_layout"] == "program" and "error" not in row
  assert "| bfloat16, program's layout |" in capsys.readouterr().out
  assert cli.main(["--param-layout", "program", "--no-progress"]) == 2
  assert "--param-layout needs --tpu" in capsys.readouterr().err


def test_tpu_estimates_use_cited_peaks():
  pytest.importorskip("libtpu")
  from bench.reading import tpu

  devs = tpu.devices("v5e:2x4")
  assert len(devs) == 8 and "TPU" in devs[0].device_kind
  mesh = bench_run.make_mesh(None, devs)
  # E=16 on 8 chips: 2 experts per chip (one takes lax.ragged_dot, exact for one group).
  case = build.make_case(
    "kernel", 16, "uniform", dataclasses.replace(SMALL, dtype="bfloat16"), mesh, abstract=True
  )
  compiled = progs.programs(case, "all_to_all")["fwd"].lower(*case.args).compile()
  trips = impls.BENCH_IMPLS["all_to_all"].accounting(case, on_tpu=True).trips
  assert set(trips[0]) == {"a2a_overflow_rounds"}
  # grouped_matmul's "auto" picked megablox's TPU kernels, not the tiled kernel's loops.
  scopes = {lp.scope() for lp in measure.parse_hlo(compiled.as_text()).loops}
  assert scopes == {"a2a_overflow_rounds"}
  assert 'custom_call_target="tpu_custom_call"' in compiled.as_text()
  est = tpu.estimates(compiled, "v5e:2x4", trips[0], 1e6)
  assert est["xla_optimal_s"] > 0
  assert est["ici_s"] == pytest.approx(1e6 / 200e9)
  assert est["roofline_s"] == max(est["compute_s"], est["hbm_s"], est["ici_s"])
  assert est["roofline_s"] <= est["estimate_s"]
  assert est["hbm_bytes_xla"] == measure.bytes_accessed(compiled)  # a reference column
  assert est["hbm_s"] == pytest.approx(est["hbm_bytes_accessed"] / 819e9)
  # Uniform routing: one round, so the overflow loop's body never runs and counts nothing;
  # run twice, it counts twice.
  from bench.reading import hbm

  assert trips[0]["a2a_overflow_rounds"] == 0
  once = hbm.step_bytes(compiled, {"a2a_overflow_rounds": 1})["hbm"]
  twice = hbm.step_bytes(compiled, {"a2a_overflow_rounds": 2})["hbm"]
  assert 0 < est["hbm_bytes_accessed"] < once < twice
  assert twice - once == pytest.approx(once - est["hbm_bytes_accessed"])


def test_unknown_tpu_topology_is_a_usage_error(capsys):
  pytest.importorskip("libtpu")
  assert cli.main(["--tpu", "v99:1x1", "--no-progress"]) == 2
  assert "v99:1x1" in capsys.readouterr().err


def test_a_loop_without_trip_count_is_counted_once_and_flagged():
  def measured(compiled, trips, default_trip_count=None):
    if default_trip_count is None:
      raise ValueError("measure: while loop while.1 has no known trip count")
    return {"executed": 10.0 * default_trip_count}

  assert row_facts.counted(measured, None, {}) == {"executed": 10.0, "loop_counted_once": True}
  assert row_facts.counted(lambda c, t: {"executed": 3.0}, None, {}) == {"executed": 3.0}
  row = dict(
    level="kernel",
    impl="jit_gshard_einsum",
    T=256,
    E=8,
    routing="uniform",
    mode="fwd",
    flops_ratio=1.5,
    wire_bytes=2**20,
    bytes_over_bound=1.0,
    bytes_over_routing_bound=1.0,
    temp_bytes=0,
    rounds=None,
    dropped=0,
    time_s={"median": 0.1, "min": 0.1, "max": 0.1},
    gflops=1.0,
    compile_s=1.0,
    loop_counted_once=True,
  )
  text = report.table([row])
  assert "| 1.50* | 1.00* |" in text and "counted once" in text


# --------------------------------------------------------------------------- a dispatch from outside


def dense_one_hot(x_TD, ffn, experts_TK, weights_TK, *, mesh, cfg):
  """A dispatch written outside the package: every expert on every token, one-hot combine
  (the table's signature; E/K times the routed FLOPs, no sort, no collectives of its own)."""
  E = jax.tree.leaves(ffn)[0].shape[0]
  coef_TE = jnp.einsum("tk,tke->te", weights_TK, jax.nn.one_hot(experts_TK, E, dtype=jnp.float32))
  # x: [T, D] into every expert, then each expert's own hidden [T, E, F] out of it.
  out_TEF = ffn(
    x_TD,
    lambda x, w: jnp.einsum(
      "ti,eio->teo" if x.ndim == 2 else "tei,eio->teo",
      x,
      w.astype(x.dtype),
      preferred_element_type=jnp.float32,
    ),
  )
  return jnp.einsum("te,tef->tf", coef_TE, out_TEF).astype(x_TD.dtype), {}


def test_a_dispatch_defined_outside_the_package_runs_in_the_layer_and_the_benchmark(
  tmp_path, capsys, monkeypatch
):
  """Adding a dispatch touches nothing in moe_shard/: the layer takes the function as
  `impl`, the benchmark as a registered entry; both check it against the NumPy reference."""
  mesh = bench_run.make_mesh("4x2", jax.devices())
  case = build.make_case("layer", 8, "zipf", SMALL, mesh)
  params, x, _ = case.args
  cfg = dataclasses.replace(case.cfg, impl=dense_one_hot)
  y, aux = jax.jit(lambda p, x: ms.moe_layer(p, x, cfg, mesh=mesh))(params, x)
  want = reference.layer(jax.device_get(params), np.asarray(x), case.cfg, case.experts_TK)
  np.testing.assert_allclose(np.asarray(y), want, rtol=1e-4, atol=1e-4)
  assert int(aux["rounds"]) == 1 and int(aux["dropped_items"]) == 0

  monkeypatch.setitem(impls.BENCH_IMPLS, "dense_one_hot", impls.Impl(dense_one_hot))
  stem = str(tmp_path / "r")
  assert (
    cli.main(
      [
        *SMALL_ARGS,
        "--impls",
        "dense_one_hot,all_to_all",
        "--routing",
        "zipf",
        "--modes",
        "fwd",
        "--out",
        stem,
      ]
    )
    == 0
  )
  rows = {r["impl"]: r for r in json.loads(pathlib.Path(stem + ".json").read_text())["rows"]}
  assert set(rows) == {"dense_one_hot", "all_to_all"}
  assert rows["dense_one_hot"]["max_abs_err"] < 1e-3
  # Every expert on every token: E/K = 4 times the expert FLOPs (the router's are extra).
  assert 3.5 < rows["dense_one_hot"]["flops_ratio"] < 4.5


def test_deepseek_like_layer_matches_the_reference_and_the_host_routing(mesh8):
  """Sigmoid scores, 4 expert groups of which each token keeps 2, scaling 2.5: the host's
  NumPy routing (for the accounting) and reference (for the error) follow the layer."""
  size = dataclasses.replace(
    SMALL, K=4, score_func="sigmoid", num_groups=4, top_k_groups=2, routed_scaling=2.5
  )
  case = build.make_case("layer", 16, "zipf", size, mesh8)
  groups_TK = case.experts_TK // 4  # expert e is in group e // (E / G)
  assert all(len(set(g)) <= 2 for g in groups_TK)  # at most 2 groups per token
  y, _, rounds, dropped = progs.programs(case, "all_to_all")["fwd"](*case.args)
  acc = impls.BENCH_IMPLS["all_to_all"].accounting(case)
  assert (int(rounds), int(dropped)) == (acc.rounds, acc.dropped)
  params, x, _ = (jax.device_get(a) for a in case.args)
  want = reference.layer(params, np.asarray(x), case.cfg, case.experts_TK)
  np.testing.assert_allclose(np.asarray(y), want, rtol=1e-4, atol=1e-4)


def test_a_compile_only_case_holds_no_input_on_the_host(mesh8):
  """A --tpu case of 256 GiB of x: every argument is a ShapeDtypeStruct with its sharding,
  and the routing is sampled shard by shard (drawing x would raise ArrayMemoryError)."""
  size = build.Size(T=2**16, D=2**20, F=32, K=2)
  case = build.make_case("layer", 8, "zipf", size, mesh8, abstract=True)
  leaves = jax.tree.leaves(case.args)
  assert leaves and all(isinstance(a, jax.ShapeDtypeStruct) for a in leaves)
  assert all(a.sharding.mesh == mesh8 for a in leaves)
  assert case.args[1].shape == (8, 2**13, 2**20)
  assert case.experts_TK.shape == (2**16, 2)
  assert case.experts_TK.min() >= 0 and case.experts_TK.max() < 8
  assert np.all(case.experts_TK[:, 0] != case.experts_TK[:, 1])


@pytest.mark.parametrize("groups", [1, 4])
def test_sampled_routing_follows_the_routing_of_drawn_inputs(groups, mesh8, monkeypatch):
  """Below HOST_DRAW_BYTES a compile routes the x a run draws; past it the sampled routing
  loads the experts as that one does."""
  size = build.Size(
    T=8192, D=64, F=32, K=4, score_func="sigmoid", num_groups=groups, top_k_groups=min(groups, 2)
  )
  drawn = build.make_case("layer", 16, "zipf", size, mesh8, abstract=True)
  run = build.make_case("layer", 16, "zipf", size, mesh8)
  np.testing.assert_array_equal(drawn.experts_TK, run.experts_TK)
  monkeypatch.setattr(build, "HOST_DRAW_BYTES", 0)
  sampled = build.make_case("layer", 16, "zipf", size, mesh8, abstract=True)
  assert not np.array_equal(drawn.experts_TK, sampled.experts_TK)
  if groups > 1:
    assert all(len(set(g)) <= 2 for g in sampled.experts_TK // 4)
  loads = [np.bincount(c.experts_TK.ravel(), minlength=16) / (8192 * 4) for c in (drawn, sampled)]
  assert loads[0].max() > 0.15  # skewed: E=16, a uniform load is 1/16
  np.testing.assert_allclose(loads[1], loads[0], atol=0.04)


def test_a_program_too_big_for_the_host_is_a_row_not_a_kill():
  # Simulated CPU devices share the host's memory: a program whose buffers, times the
  # devices, would not fit is reported, not run (the kernel would kill the process).
  compiled = jax.jit(lambda a: a * 2).lower(jnp.ones((256, 256))).compile()
  assert row_facts.host_memory_short(compiled) is None
  why = row_facts.host_memory_short(compiled, fraction=0.0)
  assert why.startswith("not run: needs") and "simulated devices" in why
  row = dict(
    level="layer", impl="all_gather", T=32768, E=64, routing="uniform", mode="fwd_bwd", error=why
  )
  text = report.table([row])
  assert "| not run: needs" in text and "did not compile" not in text


MALLOC_PROBE = """
import ctypes, sys
from bench.command import malloc
class Info(ctypes.Structure):
  _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd",
              "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]
libc = ctypes.CDLL("libc.so.6")
libc.mallinfo2.restype = Info
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, (ctypes.c_size_t,)
libc.free.argtypes = (ctypes.c_void_p,)
setting = malloc.reuse_freed_memory() if sys.argv[1] == "reuse" else malloc.SYSTEM
before = libc.mallinfo2().hblkhd
p = libc.malloc(64 << 20)
mapped = libc.mallinfo2().hblkhd - before
libc.free(p)
kept = libc.mallinfo2().fordblks
malloc.release_freed_memory()
print(setting, mapped, kept, libc.mallinfo2().arena)
"""


def _glibc_version():
  """(major, minor) of the C library's glibc, or (0, 0) when it is not glibc."""
  try:
    name, version = (os.confstr("CS_GNU_LIBC_VERSION") or "none 0.0").split()
    return tuple(int(v) for v in version.split(".")[:2]) if name == "glibc" else (0, 0)
  except (AttributeError, ValueError, OSError):
    return (0, 0)


@pytest.mark.skipif(_glibc_version() < (2, 33), reason="glibc 2.33 or later only (mallinfo2)")
def test_reuse_freed_memory_keeps_a_large_block_in_the_heap_until_released():
  out = {}
  for mode in ("system", "reuse"):
    res = subprocess.run(
      [sys.executable, "-c", MALLOC_PROBE, mode], capture_output=True, text=True, check=True
    )
    setting, mapped, kept, heap = res.stdout.rsplit(" ", 3)
    out[mode] = setting, int(mapped), int(kept), int(heap)
  # glibc's default: a fresh mmap for 64 MiB, returned to the kernel by free.
  assert out["system"][1] >= 64 << 20 and out["system"][2] < 64 << 20
  # Reusing: from the heap and kept after free, until release_freed_memory trims the heap.
  assert out["reuse"][:2] == (
    "glibc mallopt: arena_max=1, mmap_threshold=512 MiB, trim_threshold=2 GiB",
    0,
  )
  assert out["reuse"][2] >= 64 << 20 and out["reuse"][3] < 64 << 20


def test_quantized_rows_carry_their_format_and_match_the_dequantized_reference(tmp_path, capsys):
  """--weights-format: every row names its format; the float-only rows (dense_limit) run for
  the float weights only; the quantized kernel and layer rows compute with the dequantized
  values (`ms.dequantize_experts`), which the NumPy reference is given."""
  stem = str(tmp_path / "q")
  argv = ["-T", "256", "-D", "64", "-F", "64", "-E", "8", "--repeats", "1", "--no-progress"]
  argv += ["--levels", "kernel,layer", "--modes", "fwd", "--impls", "auto,dense_limit"]
  assert cli.main([*argv, "--weights-format", "bfloat16,int8,mxfp4", "--out", stem]) == 0
  out = capsys.readouterr().out
  rows = json.loads(pathlib.Path(stem + ".json").read_text())["rows"]
  # bfloat16 is the float entry: float weights in the case's dtype (float32 here).
  assert {(r["level"], r["impl"], r["weights_format"]) for r in rows} == {
    (level, impl, fmt)
    for level in ("kernel", "layer")
    for impl, fmt in [("auto", "float32"), ("auto", "int8"), ("auto", "mxfp4")]
    + [("dense_limit", "float32")]
  }
  for r in rows:
    assert "error" not in r, r
    if r["impl"] == "auto":
      assert r["rel_err"] < 1e-5  # float32 rounding, against the dequantized weights
  assert "| impl | weights |" in out and "dense_limit: float weights only" in out
  header = pathlib.Path(stem + ".csv").read_text().splitlines()[0].split(",")
  assert "weights_format" in header and "expert_bytes" in header


def test_adapter_rows_match_the_folded_reference(tmp_path, capsys):
  """--adapters 0,4: the (int8) experts with and without adapters of rank 4 on every matrix,
  a row each (the float-only dense_limit runs for float weights only: no row here); the
  forward matches the NumPy reference of the matrices with the adapters folded in
  (`ms.merge_adapters`), and the table says so."""
  stem = str(tmp_path / "lora")
  argv = ["-T", "256", "-D", "64", "-F", "64", "-E", "8", "--repeats", "1", "--no-progress"]
  argv += ["--levels", "layer", "--modes", "fwd", "--impls", "auto,dense_limit"]
  argv += ["--weights-format", "int8", "--adapters", "0,4", "--out", stem]
  assert cli.main(argv) == 0
  out = capsys.readouterr().out
  rows = json.loads(pathlib.Path(stem + ".json").read_text())["rows"]
  assert {(r["impl"], r["weights_format"], r.get("adapter_rank", 0)) for r in rows} == {
    ("auto", "int8", 0),
    ("auto", "int8", 4),
  }
  for r in rows:
    assert "error" not in r, r
    if r["impl"] == "auto":
      assert r["rel_err"] < 1e-5
  assert "| int8 + LoRA r=4 |" in out


def test_quantized_expert_bytes_and_model_state_by_hand(mesh8):
  """The bytes each device holds of a layer with mxfp4 experts, counted by hand: per expert
  matrix D*F/2 bytes of packed e2m1 codes and D/32*F one-byte exponents (0.53 bytes a
  weight, bf16's 2), no gradient or Adam state for them (frozen)."""
  D, F, E, L = 64, 128, 8, 3
  size = build.Size(T=64, D=D, F=F, K=2, dtype="bfloat16")
  router = D * E * 4  # float32, replicated
  bf16_experts = 3 * D * F * 2  # gate, up, down: one expert per device
  mxfp4_experts = 2 * (D * F // 2 + D // 32 * F) + (F * D // 2 + F // 32 * D)
  held = {}
  for fmt in (None, "mxfp4", "int8"):
    case = build.make_case(
      "layer", E, "uniform", dataclasses.replace(size, weights_format=fmt), mesh8, abstract=True
    )
    held[fmt] = row_facts.param_bytes(case.args[0])
  assert held[None]["expert_bytes"] == bf16_experts and held[None]["frozen_bytes"] == 0
  assert held["mxfp4"]["expert_bytes"] == mxfp4_experts == held["mxfp4"]["frozen_bytes"]
  assert held["mxfp4"]["bytes"] == router + mxfp4_experts
  assert held["mxfp4"]["expert_bytes"] / bf16_experts == pytest.approx(0.53125 / 2)
  # int8: one byte a weight and one float32 scale per output column of each matrix.
  assert held["int8"]["expert_bytes"] == 3 * D * F + 4 * (2 * F + D)
  model = row_facts.model_state_bytes(held["mxfp4"], L)
  assert model["weights"] == L * (router + mxfp4_experts)
  assert model["experts"] == L * mxfp4_experts
  assert model["grads"] == L * router and model["adam"] == L * 8 * D * E
  float_model = row_facts.model_state_bytes(held[None], L)
  assert float_model["grads"] == float_model["weights"] == L * (router + bf16_experts)


@pytest.mark.parametrize(
  "argv, message",
  [
    (["--weights-format", "int4"], "unknown --weights-format int4"),
    (
      ["--weights-format", "int8", "--impls", "dense_limit,jit_gshard_einsum"],
      "--weights-format int8 needs an impl that takes quantized matrices",
    ),
    (["--expert-bias", "--levels", "kernel"], "--expert-type and --expert-bias are layer"),
    (["--adapters", "0,16", "--levels", "kernel"], "--adapters puts adapters on the layer"),
    (["--adapters", "16,x"], "--adapters takes comma-separated ranks >= 0 (got '16,x')"),
  ],
)
def test_bad_weights_format_fails_before_the_run(argv, message, monkeypatch, capsys):
  assert message in _usage_error_before_any_run(monkeypatch, capsys, argv)


def test_a_block_that_does_not_divide_a_matrix_is_a_usage_error(capsys):
  argv = [*SMALL_ARGS, "--weights-format", "fp8", "--levels", "kernel"]
  assert cli.main(argv) == 2
  assert (
    "weights format 'fp8' needs the input dimension of every [16, 32] expert matrix "
    "divisible by its block (128); got 16" in capsys.readouterr().err
  )


def test_weights_formats_name_the_float_entry_by_the_case_dtype():
  assert checks.weights_formats(None, "float32") == ["float32"]
  assert checks.weights_formats("bfloat16,int8,float32,mxfp4", "float32") == [
    "float32",
    "int8",
    "mxfp4",
  ]
  assert not impls.BENCH_IMPLS["dense_limit"].quantized and impls.BENCH_IMPLS["auto"].quantized


def test_time_in_turns_stops_a_program_whose_runs_settle(monkeypatch):
  """A program leaves the turns once 3 of its runs, the slowest aside, are within 10% of
  their median; one whose runs spread wider runs all `repeats`; `outputs` gets each
  program's last output."""
  clock = [0.0]
  monkeypatch.setattr(common.time, "perf_counter", lambda: clock[0])

  def program(durations):
    calls = iter(durations)

    def fn(i):
      clock[0] += next(calls)
      return jnp.full((), i)

    return fn

  steady = program([9.0, 1.0, 1.9, 1.05, 1.0, 1.0])  # the warm-up first; one slow run
  noisy = program([9.0, 1.0, 2.0, 1.5, 2.0, 1.0])
  outputs = []
  times = common.time_in_turns([(steady, (1,)), (noisy, (2,))], 5, settle=True, outputs=outputs)
  assert times[0]["runs"] == 3
  assert times[0]["median"] == pytest.approx(1.05) and times[0]["max"] == pytest.approx(1.9)
  assert times[1]["runs"] == 5 and times[1]["median"] == pytest.approx(1.5)
  assert [int(o) for o in outputs] == [1, 2]
  assert common.time_in_turns([(program([1.0, 1.0, 2.0]), (0,))], 2)[0]["runs"] == 2


@pytest.mark.parametrize(
  "placement, impl",
  [("static", "ragged_all_to_all"), ("served", "all_to_all"), ("step", "all_to_all")],
)
def test_placed_accounting_matches_the_layer(placement, impl, mesh42):
  """With a placement the host's model of the replica rule (and of the step's plan) gives
  the layer's rounds and each expert-axis position's rows; "static" skews a 4 x 2 mesh
  onto one expert and spreads it over 4 redundant slots."""
  size = dataclasses.replace(SMALL, T=512, placement=placement, replicas=4)
  case = build.make_case("layer", 8, "zipf", size, mesh42)
  if placement == "step":  # a plan that pays at these sizes
    case.placement = ms.StepPlacement(spare_slots=1, rows_per_moved_expert=0)
  acc, rows = replica_accounting.placed(impls.BENCH_IMPLS[impl].accounting, case, False, impl)
  cfg = dataclasses.replace(case.cfg, impl=impl)
  params, x, _ = case.args
  with jax.set_mesh(mesh42):
    _, aux = jax.jit(lambda p, x: ms.moe_layer(p, x, cfg, mesh42, placement=case.placement))(
      params, x
    )
  assert acc.rounds == int(aux["rounds"])
  np.testing.assert_array_equal(rows.reshape(4, 2).sum(1), aux["device_load"])
  if placement == "step":
    assert int(aux["step_placement"]) == 1
  unplaced = replica_accounting.chip_rows(case.experts_TK, 8, case)
  assert rows.max() < unplaced.max()  # the replicas take load off the busiest device


def test_the_parser_describes_itself_as_the_cli_does():
  # flags.py holds the CLI's first docstring line as a constant (cli.py imports flags.py).
  assert flags.parser().description == cli.__doc__.split("\n")[0]
