"""The one TPU estimate (`bench.reading.estimate`) and the HBM model's rules
(`bench.reading.hbm`, `bench.reading.inplace`), each on HLO text whose bytes are known."""

import pytest

from bench.reading import estimate, hbm, inplace, measure, tpu

# A loop of 4 trips (XLA's known_trip_count) whose body writes one [1, 1024] f32 row into a
# [64, 1024] f32 carry: a fusion whose root is a dynamic-update-slice of its parameter 0.
LOOP = """HloModule m, is_scheduled=true

%upd (b: f32[64,1024], r: f32[1,1024], i: s32[]) -> f32[64,1024] {
  %b = f32[64,1024]{1,0} parameter(0)
  %r = f32[1,1024]{1,0} parameter(1)
  %i = s32[] parameter(2)
  %z = s32[] constant(0)
  ROOT %d = f32[64,1024]{1,0} dynamic-update-slice(%b, %r, %i, %z)
}

%body (p: (s32[], f32[64,1024], f32[1,1024])) -> (s32[], f32[64,1024], f32[1,1024]) {
  %p = (s32[], f32[64,1024]{1,0}, f32[1,1024]{1,0}) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %b = f32[64,1024]{1,0} get-tuple-element(%p), index=1
  %r = f32[1,1024]{1,0} get-tuple-element(%p), index=2
  %u = f32[64,1024]{1,0} fusion(%b, %r, %i), kind=kLoop, calls=%upd
  %one = s32[] constant(1)
  %n = s32[] add(%i, %one)
  ROOT %t = (s32[], f32[64,1024]{1,0}, f32[1,1024]{1,0}) tuple(%n, %u, %r)
}

%cond (p: (s32[], f32[64,1024], f32[1,1024])) -> pred[] {
  %p = (s32[], f32[64,1024]{1,0}, f32[1,1024]{1,0}) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %k = s32[] constant(4)
  ROOT %lt = pred[] compare(%i, %k), direction=LT
}

ENTRY %main (b: f32[64,1024], r: f32[1,1024]) -> f32[64,1024] {
  %b = f32[64,1024]{1,0} parameter(0)
  %r = f32[1,1024]{1,0} parameter(1)
  %z = s32[] constant(0)
  %t = (s32[], f32[64,1024]{1,0}, f32[1,1024]{1,0}) tuple(%z, %b, %r)
  %w = (s32[], f32[64,1024]{1,0}, f32[1,1024]{1,0}) while(%t), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"4"}}
  ROOT %o = f32[64,1024]{1,0} get-tuple-element(%w), index=1
}
"""
ROW, BUF = 1024 * 4, 64 * 1024 * 4


def _row(text, opcode, **kw):
  (got,) = [r for r in hbm.op_bytes(text, **kw) if r["opcode"] == opcode]
  return got


def test_an_in_place_update_counts_its_slice_and_its_loop_trips():
  got = _row(LOOP, "fusion")
  assert got["inplace"] and got["runs"] == 4  # XLA's known_trip_count
  # The row read (and the 4-byte offset), the row written: not the 64-row buffer.
  assert (got["read"], got["written"]) == (ROW + 4, ROW)
  # The step: 4 such updates and the loop counter's scalars (under 100 bytes), not 4 buffers.
  assert 4 * (2 * ROW + 4) < hbm.step_bytes(LOOP)["hbm"] < 4 * (2 * ROW + 4) + 100


def test_an_update_whose_buffer_is_read_beside_it_counts_whole():
  # The buffer parameter also feeds a negate: the fusion cannot share it, it writes anew.
  text = LOOP.replace(
    "  ROOT %d = f32[64,1024]{1,0} dynamic-update-slice(%b, %r, %i, %z)",
    "  %g = f32[64,1024]{1,0} negate(%b)\n"
    "  ROOT %d = f32[64,1024]{1,0} dynamic-update-slice(%g, %r, %i, %z)",
  )
  got = _row(text, "fusion")
  assert not got["inplace"] and (got["read"], got["written"]) == (BUF + ROW + 4, BUF)


def test_a_read_modify_write_update_is_in_place_and_reads_its_slice():
  # buf[i] += r: the buffer parameter feeds a dynamic-slice at the update's offsets too.
  text = LOOP.replace(
    "  ROOT %d = f32[64,1024]{1,0} dynamic-update-slice(%b, %r, %i, %z)",
    "  %s = f32[1,1024]{1,0} dynamic-slice(%b, %i, %z), dynamic_slice_sizes={1,1024}\n"
    "  %a = f32[1,1024]{1,0} add(%s, %r)\n"
    "  ROOT %d = f32[64,1024]{1,0} dynamic-update-slice(%b, %a, %i, %z)",
  )
  got = _row(text, "fusion")
  assert got["inplace"] and (got["read"], got["written"]) == (2 * ROW + 4, ROW)


def test_a_copy_counts_whole_and_an_unfused_scatter_counts_its_rows():
  text = """HloModule m

%assign (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  ROOT %b = f32[] parameter(1)
}

ENTRY %main (b: f32[64,1024], i: s32[2,1], u: f32[2,1024]) -> f32[64,1024] {
  %b = f32[64,1024]{1,0} parameter(0)
  %i = s32[2,1]{1,0} parameter(1)
  %u = f32[2,1024]{1,0} parameter(2)
  %c = f32[64,1024]{1,0} copy(%b)
  ROOT %s = f32[64,1024]{1,0} scatter(%c, %i, %u), update_window_dims={1}, inserted_window_dims={0}, scatter_dims_to_operand_dims={0}, index_vector_dim=1, to_apply=%assign
}
"""
  copy, scatter = _row(text, "copy"), _row(text, "scatter")
  assert (copy["read"], copy["written"], copy["inplace"]) == (BUF, BUF, False)
  # An assigning scatter: its indices and 2 rows read, the 2 rows written.
  assert (scatter["read"], scatter["written"]) == (8 + 2 * ROW, 2 * ROW) and scatter["inplace"]
  assert "| scatter s |" in inplace.table(text) and "| yes |" in inplace.table(text)


def test_loop_bodies_count_by_one_model_and_xlas_bytes_are_a_column():
  cost = {"bytes accessed": 123456.0}  # what XLA said, body once by its own rules
  got = estimate.step_estimate(LOOP, "v5e:2x4", cost=cost)
  assert got["hbm_bytes_xla"] == 123456.0
  # The one count: the model's bytes of each op times its runs, whatever XLA said.
  assert got["hbm_bytes"] == hbm.step_bytes(LOOP)["hbm"]
  never = estimate.step_estimate(LOOP.replace('"n":"4"', '"n":"0"'), "v5e:2x4", cost=cost)
  assert never["hbm_bytes"] < got["hbm_bytes"] and never["hbm_bytes_xla"] == 123456.0


GROUPED = """HloModule m

ENTRY %main (n: s32[], o: s32[5], g: s32[8], t: s32[8], x: bf16[2048,128], w: bf16[4,128,256]) -> bf16[2048,256] {
  %n = s32[] parameter(0)
  %o = s32[5]{0} parameter(1)
  %g = s32[8]{0} parameter(2)
  %t = s32[8]{0} parameter(3)
  %x = bf16[2048,128]{1,0} parameter(4)
  %w = bf16[4,128,256]{2,1,0} parameter(5)
  ROOT %y = bf16[2048,256]{1,0} custom-call(%n, %o, %g, %t, %x, %w), custom_call_target="tpu_custom_call", backend_config={"custom_call_config":{"cost_estimate":{"flops":"268435456","transcendentals":"0","bytes_accessed":"9000000"}}}
}
"""


def test_a_grouped_kernel_counts_the_tiles_its_grid_visits():
  meta = 4 + 5 * 4 + 2 * 8 * 4
  declared = _row(GROUPED, "custom-call")
  assert declared["hbm"] == 9_000_000 and declared["flops"] == 268435456
  # 600 rows in groups 0 and 2 (300 each): tiles 0 (group 0), 0 and 1 (group 2) of 512 rows
  # visited, 3 tiles of 512 = 1536 of the 2048 rows; the matrices of 2 of the 4 groups.
  got = _row(GROUPED, "custom-call", groups={4: [300, 0, 300, 0]}, row_tile=512)
  share = 3 * 512 / 2048
  x, w, y = 2048 * 128 * 2, 4 * 128 * 256 * 2, 2048 * 256 * 2
  assert got["hbm"] == pytest.approx(meta + share * (x + y) + w / 2)
  assert got["flops"] == pytest.approx(268435456 * share)
  # Kernels of another group count stay as declared.
  assert _row(GROUPED, "custom-call", groups={8: [1] * 8})["hbm"] == 9_000_000


SPLASH = """HloModule m, is_scheduled=true

ENTRY %main (m: s8[1,4,4], q: bf16[1,8,2048,128], k: bf16[1,8,2048,128]) -> (bf16[1,8,2048,128], bf16[1,8,2048,128], bf16[1,8,2048,128]) {
  %m = s8[1,4,4]{2,1,0} parameter(0)
  %q = bf16[1,8,2048,128]{3,2,1,0} parameter(1)
  %k = bf16[1,8,2048,128]{3,2,1,0} parameter(2)
  %f = bf16[1,8,2048,128]{3,2,1,0} custom-call(%m, %m, %q, %k, %k), custom_call_target="tpu_custom_call", metadata={op_name="jit(step)/splash_mha_fwd_no_residuals/pallas_call"}
  %a = bf16[1,8,2048,128]{3,2,1,0} custom-call(%q, %k, %k), custom_call_target="tpu_custom_call", metadata={op_name="jit(step)/splash_mha_dq/pallas_call"}
  %d = bf16[1,8,2048,128]{3,2,1,0} custom-call(%m, %q, %k, %k), custom_call_target="tpu_custom_call", backend_config={"custom_call_config": {"cost_estimate":{"flops":"1000","transcendentals":"0","bytes_accessed":"4000"}}}, metadata={op_name="jit(step)/splash_mha_dkv/pallas_call"}
  ROOT %t = (bf16[1,8,2048,128]{3,2,1,0}, bf16[1,8,2048,128]{3,2,1,0}, bf16[1,8,2048,128]{3,2,1,0}) tuple(%f, %a, %d)
}
"""


def test_splash_attention_counts_the_blocks_its_mask_leaves():
  # Splash attention declares no FLOPs. The forward's 2 matmuls of 2*B*H*S*S*hd over the 10
  # of 16 blocks a causal 4 x 4 grid leaves; the dq kernel, with no mask operand, all 16
  # blocks of its 3; a kernel that declares its cost keeps what it declares.
  full = 2.0 * 8 * 2048 * 2048 * 128
  ops = {r["name"]: r for r in hbm.op_bytes(SPLASH)}
  assert ops["f"]["flops"] == pytest.approx(2 * full * 10 / 16)
  assert ops["a"]["flops"] == pytest.approx(3 * full)
  assert ops["d"]["flops"] == 1000
  peak = tpu.PEAKS["v5e"]
  got = estimate.step_estimate(SPLASH, "v5e:2x4")
  assert got["flops"] == pytest.approx(2 * full * 10 / 16 + 3 * full + 1000)
  # Each splash kernel is FLOP-bound: its time is its FLOPs at peak, not its bytes.
  fwd_s = 2 * full * 10 / 16 / peak["flops"]
  assert fwd_s > ops["f"]["hbm"] / peak["hbm"]
  assert got["estimate_s"] == pytest.approx(
    fwd_s + 3 * full / peak["flops"] + ops["d"]["hbm"] / peak["hbm"]
  )


def test_splash_attention_reads_rectangular_masks_and_vs_head_dim():
  # v6e Mixtral's q blocks are 4x its kv blocks (a [1, 2, 8] mask: 12 of the 16 blocks are
  # causal), and DeepSeek's MLA has q and k at 192, v at 128: dkv's 4 matmuls are 2 over
  # each head dim.
  text = """HloModule m, is_scheduled=true

ENTRY %main (m: s8[1,2,8], q: bf16[1,4,1024,192], k: bf16[1,4,1024,192], v: bf16[1,4,1024,128]) -> bf16[1,4,1024,192] {
  %m = s8[1,2,8]{2,1,0} parameter(0)
  %q = bf16[1,4,1024,192]{3,2,1,0} parameter(1)
  %k = bf16[1,4,1024,192]{3,2,1,0} parameter(2)
  %v = bf16[1,4,1024,128]{3,2,1,0} parameter(3)
  ROOT %d = bf16[1,4,1024,192]{3,2,1,0} custom-call(%m, %q, %k, %v), custom_call_target="tpu_custom_call", metadata={op_name="jit(step)/splash_mha_dkv/pallas_call"}
}
"""
  (got,) = [r for r in hbm.op_bytes(text) if r["opcode"] == "custom-call"]
  assert got["flops"] == pytest.approx(2.0 * 4 * 1024 * 1024 * (2 * 192 + 2 * 128) * 12 / 16)


def test_time_is_summed_per_op_and_the_whole_step_max_is_the_lower_bound():
  # One FLOP-bound matmul (2048^3 in f32, few bytes per FLOP) and one HBM-bound negate of
  # a large buffer: per op each takes its own larger term; the step max hides one of them.
  text = """HloModule m, is_scheduled=true

%mm (a: f32[2048,2048], b: f32[2048,2048]) -> f32[2048,2048] {
  %a = f32[2048,2048]{1,0} parameter(0)
  %b = f32[2048,2048]{1,0} parameter(1)
  ROOT %d = f32[2048,2048]{1,0} dot(%a, %b), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

ENTRY %main (a: f32[2048,2048], b: f32[2048,2048], c: f32[8192,8192]) -> (f32[2048,2048], f32[8192,8192]) {
  %a = f32[2048,2048]{1,0} parameter(0)
  %b = f32[2048,2048]{1,0} parameter(1)
  %c = f32[8192,8192]{1,0} parameter(2)
  %m = f32[2048,2048]{1,0} fusion(%a, %b), kind=kOutput, calls=%mm
  %n = f32[8192,8192]{1,0} negate(%c)
  ROOT %t = (f32[2048,2048]{1,0}, f32[8192,8192]{1,0}) tuple(%m, %n)
}
"""
  peak = tpu.PEAKS["v5e"]
  got = estimate.step_estimate(text, "v5e:2x4")
  mm_s = 2 * 2048**3 / peak["flops"]  # over its 48 MB / bandwidth
  neg_s = 2 * 8192**2 * 4 / peak["hbm"]
  assert got["estimate_s"] == pytest.approx(mm_s + neg_s)
  assert got["lower_bound_s"] == pytest.approx(max(got["compute_s"], got["hbm_s"]))
  assert got["lower_bound_s"] < got["estimate_s"]
  assert mm_s > 3 * 2048**2 * 4 / peak["hbm"]
  assert got["flops"] == 2 * 2048**3 and got["ici_exposed_s"] == 0.0


def test_a_topology_without_cited_peaks_is_refused():
  with pytest.raises(ValueError, match=r"step_estimate: topology .* got 'v3:2x2'"):
    estimate.step_estimate(LOOP, "v3:2x2")


def test_text_and_compiled_read_alike():
  import jax
  import jax.numpy as jnp

  def f(x, w):
    return jax.lax.scan(lambda c, _: (jnp.tanh(c @ w), None), x, None, length=3)[0]

  spec = jax.ShapeDtypeStruct((128, 128), jnp.float32)
  compiled = measure.compile_fn(f, spec, spec)
  a = estimate.step_estimate(compiled, "v6e:2x4")
  b = estimate.step_estimate(compiled.as_text(), "v6e:2x4", cost=measure._cost(compiled))
  assert a == b and a["flops"] == 3 * 2 * 128**3
