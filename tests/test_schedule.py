"""The exposed link time of a compiled schedule (`bench.reading.schedule`), on HLO text with
an asynchronous all-gather whose window holds a matmul and a synchronous all-to-all."""

import pytest

from bench.reading import schedule, tpu

_DEVICES = "replica_groups={{0,1,2,3,4,5,6,7}}"
HLO = f"""HloModule m, is_scheduled=true

%fused_dot (p0: f32[512,512], p1: f32[512,512]) -> f32[512,512] {{
  %p0 = f32[512,512]{{1,0}} parameter(0)
  %p1 = f32[512,512]{{1,0}} parameter(1)
  ROOT %d = f32[512,512]{{1,0}} dot(%p0, %p1), lhs_contracting_dims={{1}}, rhs_contracting_dims={{0}}
}}

ENTRY %main (x: f32[512,512], w: f32[512,512], a: f32[64,512], s: f32[1024,512]) -> (f32[512,512], f32[512,512], f32[1024,512]) {{
  %x = f32[512,512]{{1,0}} parameter(0)
  %w = f32[512,512]{{1,0}} parameter(1)
  %a = f32[64,512]{{1,0}} parameter(2)
  %s = f32[1024,512]{{1,0}} parameter(3)
  %ags = (f32[64,512]{{1,0}}, f32[512,512]{{1,0}}) all-gather-start(%a), channel_id=1, {_DEVICES}, dimensions={{0}}
  %f = f32[512,512]{{1,0}} fusion(%x, %w), kind=kOutput, calls=%fused_dot
  %agd = f32[512,512]{{1,0}} all-gather-done(%ags)
  %a2a = f32[1024,512]{{1,0}} all-to-all(%s), channel_id=2, {_DEVICES}, dimensions={{0}}
  ROOT %t = (f32[512,512]{{1,0}}, f32[512,512]{{1,0}}, f32[1024,512]{{1,0}}) tuple(%f, %agd, %a2a)
}}
"""

GATHER_S = 512 * 512 * 4 * 7 / 8 / 1e9  # the all-gather's wire bytes over 1 GB/s
A2A_S = 1024 * 512 * 4 * 7 / 8 / 1e9  # the all-to-all's (synchronous: exposed whole)
DOT_FLOPS = 2 * 512**3


@pytest.mark.parametrize("flops_per_s", [1e12, 1e11])
def test_an_async_collective_is_covered_by_its_window_and_a_sync_one_by_nothing(flops_per_s):
  peak = {"flops": flops_per_s, "hbm": 1e12, "ici": 1e9}
  got = schedule.exposed_link(HLO, peak)
  dot_s = DOT_FLOPS / flops_per_s  # the fusion's time: its FLOPs (its bytes take 3 us)
  assert got["link_s"] == pytest.approx(GATHER_S + A2A_S)
  assert got["exposed_s"] == pytest.approx(max(GATHER_S - dot_s, 0.0) + A2A_S)


def test_a_row_takes_the_share_exposed_of_its_own_link_time():
  from bench.reading import estimate

  got = estimate.step_estimate(HLO, "v5e:2x4", ici_bytes=200e9 * 2e-3)  # 2 ms of link
  assert got["ici_s"] == pytest.approx(2e-3) and 0.0 < got["ici_exposed_s"] <= 2e-3
  own = schedule.exposed_link(HLO, tpu.PEAKS["v5e"])
  assert got["ici_exposed_s"] == pytest.approx(2e-3 * own["exposed_s"] / own["link_s"])
