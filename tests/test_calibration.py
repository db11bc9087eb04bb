"""The calibration's pure parts: the published workloads' configs and flags, the step time
derived from a published TFLOP/s, the host transfers read from HLO text, and the results
row (`bench/calibration.py`, `bench/peers/maxtext_workloads.py`, `bench/peers/maxtext_train.py`).
MaxText itself is needed only by the last test, which skips without it."""

import dataclasses

import pytest

from bench import calibration
from bench.peers import maxtext_train
from bench.peers import maxtext_workloads as mw

TINY = mw.Dims(emb=2, mlp=3, layers=1, heads=1, kv_heads=1, head_dim=2, vocab=5, experts=2, top_k=1)


def test_tflops_by_hand():
  # B*S = 2 tokens: ffn 2*2*3*2*3 = 72, gate 2*2*2*2 = 16, qkv 2*2*2*(1+2)*2 = 48,
  # proj 2*2*2*1*2 = 16, embed 2*2*2*5 = 40, attention 4*2*2*1*2 = 32 (not halved);
  # ((16 + 1*72 + 48 + 16) * 1 + 40) * 3 + 32 * 1 * 3 = 672.
  assert mw.maxtext_tflops_per_device(TINY, 1, 2) == pytest.approx(672e-12)


def test_tflops_reproduce_published_v6e_pair():
  # The recipe's log line: 13.484 s at 302.311 TFLOP/s per device; the count is MaxText's.
  w = mw.WORKLOADS["mixtral_8x7b_dropped"]
  tflops = mw.maxtext_tflops_per_device(w.dims, 12, 4096)
  assert tflops / w.measured["tflops_per_device"] == pytest.approx(13.484, rel=1e-4)


def test_measured_step_published_and_derived():
  step, how = mw.measured_step_s(mw.WORKLOADS["mixtral_8x7b_dropped"])
  assert step == 13.484 and "published step time" in how
  w = mw.WORKLOADS["mixtral_8x7b_v5p_128"]
  step, how = mw.measured_step_s(w)
  want = mw.maxtext_tflops_per_device(w.dims, 36, 4096) / 251.94
  assert step == pytest.approx(want) and "251.94" in how and "Run_Mixtral.md" in how


def test_config_overrides_spell_maxtext_values():
  w = mw.WORKLOADS["mixtral_8x7b_dropped"]
  args = mw.config_overrides(w, {"per_device_batch_size": 11}, run_name="calib")
  assert args[:3] == [
    "model_name=mixtral-8x7b",
    "compile_topology=v6e-256",
    "compile_topology_num_slices=1",
  ]
  assert "megablox=false" in args and "capacity_factor=1.25" in args
  assert "per_device_batch_size=11" in args and "per_device_batch_size=12" not in args
  assert args[-1] == "run_name=calib"


def test_config_overrides_rename_tiles():
  args = mw.config_overrides(mw.WORKLOADS["deepseek3_671b_v5p_1024"])
  assert not any(a.startswith("tile_") for a in args)
  assert "wi_tile_fwd_batch_seq=512" in args and "wo_tile_drhs_mlp_dim=1024" in args
  assert sum(a.endswith("_embed_dim=1024") for a in args) == 6


def test_kept_flags_drop_by_name():
  w = mw.WORKLOADS["mixtral_8x7b_v5p_128"]
  kept = mw.kept_flags(w, ["xla_tpu_enable_async_collective_fusion_fuse_all_gather"])
  assert len(kept) == len(mw.flag_list(w.xla_flags)) - 1
  assert not any("fuse_all_gather" in f for f in kept)
  with pytest.raises(ValueError, match=r"kept_flags: dropped must name flags.*xla_nope"):
    mw.kept_flags(w, ["xla_nope"])


def test_parse_sets():
  got = maxtext_train.parse_sets(["a=1", "b=0.5", "c=true", "d=full"])
  assert got == {"a": 1, "b": 0.5, "c": True, "d": "full"}
  with pytest.raises(ValueError, match="parse_sets: --set must be key=value, got 'remat'"):
    maxtext_train.parse_sets(["remat"])


HOST_HLO = """\
HloModule m

%cond (c: (s32[], bf16[8,128])) -> pred[] {
  %c = (s32[], bf16[8,128]{1,0}) parameter(0)
  %i = s32[] get-tuple-element(%c), index=0
  %n = s32[] constant(4)
  ROOT %lt = pred[] compare(%i, %n), direction=LT
}

%body (b: (s32[], bf16[8,128])) -> (s32[], bf16[8,128]) {
  %b = (s32[], bf16[8,128]{1,0}) parameter(0)
  %i = s32[] get-tuple-element(%b), index=0
  %x = bf16[8,128]{1,0} get-tuple-element(%b), index=1
  %cs = (bf16[8,128]{1,0:S(5)}, bf16[8,128]{1,0}, u32[]) copy-start(%x)
  %cd = bf16[8,128]{1,0:S(5)} copy-done(%cs)
  %back = bf16[8,128]{1,0} copy(%cd)
  %vm = bf16[8,128]{1,0:S(1)} copy(%back)
  %ds = ((bf16[8,128]{1,0:S(5)}, s32[]), bf16[8,128]{1,0}, u32[]) dynamic-slice-start(%cd, %i)
  ROOT %t = (s32[], bf16[8,128]{1,0}) tuple(%i, %back)
}

ENTRY %main (x0: bf16[8,128]) -> bf16[8,128] {
  %x0 = bf16[8,128]{1,0} parameter(0)
  %z = s32[] constant(0)
  %init = (s32[], bf16[8,128]{1,0}) tuple(%z, %x0)
  %w = (s32[], bf16[8,128]{1,0}) while(%init), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"4"}}
  ROOT %r = bf16[8,128]{1,0} get-tuple-element(%w), index=1
}
"""


def test_host_transfers_scale_with_trips():
  # Each of the 4 iterations sends 8*128 bf16 (2048 bytes) to the host and reads it back;
  # the copy into VMEM (S(1)) is no host transfer, nor the start of a slice of a host value.
  got = calibration.host_transfers(HOST_HLO)
  assert got == {"to_host_bytes": 4 * 2048, "from_host_bytes": 4 * 2048, "ops": 2}


def test_a_kernel_config_split_over_lines_stays_in_its_computation():
  # A backend config with a raw newline (splash attention's), inside a loop body: the
  # parser joins its lines, so the body keeps its later instructions and host transfers.
  split = HOST_HLO.replace(
    "  %vm = bf16[8,128]{1,0:S(1)} copy(%back)\n",
    '  %k = bf16[8,128]{1,0} custom-call(%back), custom_call_target="tpu_custom_call", '
    'backend_config={"custom_call_config": {"x": "a\n}}, metadata={op_name="k"}\n',
  )
  from bench.reading import hlo

  body = hlo.parse_hlo(split).comps["body"]
  assert {"k", "t"} <= {i.name for i in body}
  assert calibration.host_transfers(split)["to_host_bytes"] == 4 * 2048


SPLASH_HLO = """\
HloModule m

ENTRY %main (m: s8[1,4,4], q: bf16[2,3,16,8], k: bf16[2,1,16,8]) -> bf16[2,3,16,8] {
  %m = s8[1,4,4]{2,1,0} parameter(0)
  %q = bf16[2,3,16,8]{3,2,1,0} parameter(1)
  %k = bf16[2,1,16,8]{3,2,1,0} parameter(2)
  ROOT %o = bf16[2,3,16,8]{3,2,1,0} custom-call(%m, %m, %q, %k, %k), custom_call_target="tpu_custom_call", metadata={op_name="jit(f)/splash_mha_dq_segmented_no_residuals/pallas_call"}
}
"""


def test_splash_flops_from_shapes():
  # dq: 3 matmuls of 2*B*H*Sq*Skv*hd = 2*2*3*16*16*8 FLOPs, over 10 of the 16 blocks of a
  # causal 4 x 4 grid.
  got = calibration.splash_flops(SPLASH_HLO)
  assert got == {"splash_flops": 3 * 2 * 2 * 3 * 16 * 16 * 8 * 10 / 16, "splash_calls": 1}


def test_scale_back():
  w = mw.WORKLOADS["mixtral_8x7b_dropped"]
  assert calibration.scale_back(w, {}) == (1.0, "the published config")
  factor, how = calibration.scale_back(w, {"per_device_batch_size": 11})
  assert factor == pytest.approx(12 / 11) and "per_device_batch_size=11" in how
  # MaxText's count is proportional to per_device_batch_size (checked on Mixtral's dims).
  assert mw.maxtext_tflops_per_device(w.dims, 12, 4096) == pytest.approx(
    12 / 11 * mw.maxtext_tflops_per_device(w.dims, 11, 4096)
  )
  factor, _ = calibration.scale_back(
    mw.WORKLOADS["deepseek3_671b_v5p_1024"], {"per_device_batch_size": 5}
  )
  assert factor == pytest.approx(6 / 5)
  factor, how = calibration.scale_back(w, {"remat_policy": "full"})
  assert factor == 1.0 and "not scaled" in how


def test_row_format():
  w = mw.WORKLOADS["mixtral_8x7b_dropped"]
  estimate = dict(
    estimate_s=11.0,
    lower_bound_s=9.0,
    compute_s=9.0,
    hbm_s=4.0,
    ici_s=2.0,
    ici_exposed_s=0.5,
    flops=1e15,
    hbm_bytes=1e12,
    hbm_bytes_xla=2e12,
  )
  meta = {"changes": {"per_device_batch_size": 11}, "dropped_flags": ["x"], "compile_s": 1.0}
  row = calibration.make_row(w, meta, estimate, {"host_s": None})
  assert row["workload"] == "mixtral_8x7b_dropped" and row["topology"] == "v6e-256"
  assert row["mesh"] == "v6e:16x16" and row["measured_step_s"] == 13.484
  assert row["estimate_step_s"] == pytest.approx(11.0 * 12 / 11)
  assert row["ratio"] == pytest.approx(12.0 / 13.484)
  assert row["lower_bound_s"] == pytest.approx(9.0 * 12 / 11)
  assert row["dropped_flags"] == ["x"] and row["hbm_bytes_xla"] == 2e12


def test_markdown_rows():
  w = mw.WORKLOADS["mixtral_8x7b_dropped"]
  keys = ("estimate_s", "lower_bound_s", "compute_s", "hbm_s", "ici_s", "ici_exposed_s")
  estimate = dict(zip(keys, (12.0, 9.0, 9.0, 4.0, 2.0, 0.5)), flops=1e15)
  unseen = dict(
    to_host_bytes=3e9,
    from_host_bytes=1e9,
    host_s=None,
    dependent_collectives=7.0,
    latency_s=None,
    kernel_flops_share=0.25,
    splash_s=0.5,
  )
  row = calibration.make_row(w, {"dropped_flags": []}, estimate, unseen)
  text = calibration.markdown([row], "python -m bench.calibration --out x")
  assert "`python -m bench.calibration --out x`" in text
  assert "| mixtral_8x7b_dropped | v6e-256 | 13.48 | 12.00 | 0.89 | 9.00 | 9.00 | 4.00 |" in text
  # The splash kernels are in the estimate; with unseen adds only the collectives' latency.
  assert "| 0.50 | 12.00 | 0.89 |" in text
  assert "| mixtral_8x7b_dropped | 3.0 | 1.0 | - | 7 | - | 0.25 | 0.50 |" in text
  assert "the published config (scale 1.0000)" in text


def test_workload_table_is_consistent():
  for name, w in mw.WORKLOADS.items():
    assert w.name == name
    assert w.config_source.startswith("https://github.com/AI-Hypercomputer/"), name
    if not w.measured:  # compiled for the blocks' comparison only
      continue
    assert ("step_s" in w.measured) or w.dims is not None, name
    assert w.measured["source"].startswith("https://github.com/AI-Hypercomputer/")
    assert dataclasses.asdict(w)["params"] == w.params


def test_maxtext_accepts_the_configs():
  pytest.importorskip(
    "maxtext", reason="MaxText is not installed (see bench/peers/maxtext_train.py)"
  )
  import pathlib

  from maxtext.configs import pyconfig

  base = pathlib.Path(pyconfig.__file__).parent / "base.yml"
  for w in mw.WORKLOADS.values():
    config = pyconfig.initialize(["x", str(base), *mw.config_overrides(w, run_name="t")])
    assert config.per_device_batch_size == w.params["per_device_batch_size"]
    assert config.max_target_length == w.params["max_target_length"]
