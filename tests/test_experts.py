"""The expert FFN table (`ms.EXPERTS`): every class, with and without biases, on the dispatches.

  * the table, `MoEConfig(expert_type=..., expert_bias=...)`, and what params.py builds
    from a class (shapes, init, specs, the checks), a user's own class included;
  * `GroupedMatmul.add_bias` on its own: each row gets its group's bias, padding rows none,
    and every biased class maps padding rows to zeros; the remat names of every class;
  * each class with its biases through masked_scan, ragged_dot and one of the
    expert-parallel dispatches (`PARALLEL`: all_gather; all_to_all with chunks of 3 and 2,
    so padding slots and overflow rounds; ragged_all_to_all with receive buffers of 4
    rows, so several rounds and a partly filled last buffer), on adversarial routings:
    outputs and the gradients of x, every leaf and the weights against the float64 oracle
    (`tests/oracle.py`); the new classes without biases on ragged_dot;
  * `moe_layer` with each expert_type and expert_bias on one device, two of them on the
    2x4 mesh, and a user's class, against the float64 layer model (`tests/layer_oracle.py`),
    gradients by its finite differences;
  * every error message.

Compile time dominates: the dispatches of one class run in one jitted program (`run_all`),
which all routings share (a routing changes values, not shapes).
"""

import dataclasses
import functools
import math
import re

import jax
import jax.numpy as jnp
import layer_oracle
import numpy as np
import oracle
import pytest
from cases import FAST_COMPILE, assert_close, assert_tree_close, cotangent, make_case
from jax.sharding import PartitionSpec as P

import moe_shard as ms
from moe_shard.params import _check_params


@pytest.fixture(scope="module", autouse=True)
def _eight_devices(devices):
  del devices  # conftest's fixture asserts the 8 simulated devices


NAMES = list(ms.EXPERTS)
T, D, F, E, K = 40, 4, 6, 8, 2  # 5 tokens per device on 8 devices
# A small clamp, so that gpt-oss's clamps are active on some rows of these O(1) values.
CLAMP = dict(alpha=1.5, limit=0.6)


def draw_ffn(name, *, bias, E=E, D=D, F=F, seed=0):
  """An FFN of class `EXPERTS[name]` with normal values (variance 1 / fan-in; biases 0.5)."""
  cls, sizes = ms.EXPERTS[name], dict(E=E, D=D, F=F)
  rng = np.random.default_rng([seed, NAMES.index(name)])
  leaves = {}
  for f in dataclasses.fields(cls):
    if f.metadata.get("static") or (f.default is None and not bias):
      continue
    shape = [sizes[c] for c in f.name.rsplit("_", 1)[1]]
    scale = 1 / math.sqrt(shape[-2]) if len(shape) == 3 else 0.5
    leaves[f.name] = jnp.asarray(rng.normal(size=shape) * scale, jnp.float32)
  return cls(**leaves, **(CLAMP if name == "clamped_swiglu" else {}))


# --------------------------------------------------------------------------- the table


def config(**overrides):
  return ms.MoEConfig(**{**dict(d_model=D, d_ff=F, num_experts=E, top_k=K), **overrides})


def test_table_names_the_classes():
  want = dict(
    linear=ms.Linear,
    swiglu=ms.SwiGLU,
    gelu=ms.GeluMLP,
    geglu=ms.GeGLU,
    clamped_swiglu=ms.ClampedSwiGLU,
  )
  assert want == ms.EXPERTS
  for name in ("EXPERTS", "GeluMLP", "GeGLU", "ClampedSwiGLU"):
    assert name in ms.__all__
  # alpha and limit are static: part of the tree structure, not leaves.
  w = draw_ffn("clamped_swiglu", bias=False)
  assert len(jax.tree.leaves(w)) == 3
  assert jax.tree.structure(w) != jax.tree.structure(dataclasses.replace(w, limit=7.0))


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("bias", [False, True])
def test_param_shapes_and_specs_from_the_class(name, bias):
  """The leaves of each class, their biases with expert_bias, every leaf split on axis 0."""
  cfg = config(expert_type=name, d_ff=D if name == "linear" else F, expert_bias=bias)
  cfg = dataclasses.replace(cfg, expert_axis="ep")
  shapes = ms.moe_param_shapes(cfg).experts
  assert type(shapes) is ms.EXPERTS[name] and cfg.expert_class is ms.EXPERTS[name]
  gated = {
    "gate_EDF": (E, D, F),
    "up_EDF": (E, D, F),
    "down_EFD": (E, F, D),
    "gate_b_EF": (E, F),
    "up_b_EF": (E, F),
    "down_b_ED": (E, D),
  }
  want = {
    "linear": {"w_EDF": (E, D, D), "b_EF": (E, D)},
    "gelu": {"up_EDF": (E, D, F), "down_EFD": (E, F, D), "up_b_EF": (E, F), "down_b_ED": (E, D)},
  }.get(name, gated)
  if not bias:
    want = {k: v for k, v in want.items() if len(v) == 3}
  assert {k: s.shape for k, s in leaves_by_name(shapes).items()} == want
  specs = ms.moe_param_specs(cfg).experts
  assert {k: s for k, s in leaves_by_name(specs).items()} == {
    k: ms_spec("ep", len(v)) for k, v in want.items()
  }


def ms_spec(axis, ndim):
  return jax.sharding.PartitionSpec(axis, *[None] * (ndim - 1))


def leaves_by_name(ffn):
  return {jax.tree_util.keystr(p)[1:]: a for p, a in jax.tree_util.tree_leaves_with_path(ffn)}


def test_clamped_swiglu_takes_alpha_and_limit_from_the_config():
  cfg = config(expert_type="clamped_swiglu", swiglu_alpha=1.5, swiglu_limit=0.6)
  shapes = ms.moe_param_shapes(cfg).experts
  assert (shapes.alpha, shapes.limit) == (1.5, 0.6)
  assert cfg.expert_class is ms.ClampedSwiGLU
  default = ms.moe_param_shapes(config(expert_type=ms.ClampedSwiGLU)).experts
  assert (default.alpha, default.limit) == (1.702, 7.0)


@pytest.mark.parametrize("name", NAMES)
def test_every_class_names_its_matmul_outputs_for_remat(name):
  """`MOE_EXPERT_GATE`/`UP`/`OUT` are on each class's (biased) matmul outputs: a
  `save_only_these_names` policy saves them instead of recomputing (traced only)."""
  w = draw_ffn(name, bias=True, E=2)
  mm = ms.GroupedMatmul(jnp.array([3, 2], jnp.int32), "ragged_dot")
  jaxpr = str(jax.make_jaxpr(lambda x, w: w(x, mm))(jnp.ones((6, D)), w))
  names = {"linear": [ms.MOE_EXPERT_OUT], "gelu": [ms.MOE_EXPERT_UP, ms.MOE_EXPERT_OUT]}.get(
    name, [ms.MOE_EXPERT_GATE, ms.MOE_EXPERT_UP, ms.MOE_EXPERT_OUT]
  )
  for n in ms.CHECKPOINT_NAMES:
    assert (f"name={n}" in jaxpr) == (n in names), (name, n)


# --------------------------------------------------------------------------- a user's class


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class ReluMLP:
  """A user's FFN, written without `ms.ExpertFFN`: `relu(x @ up + ub) @ down`."""

  up_EDF: jax.Array
  down_EFD: jax.Array
  up_b_EF: jax.Array | None = None

  d_in = property(lambda self: self.up_EDF.shape[-2])
  d_out = property(lambda self: self.down_EFD.shape[-1])

  @classmethod
  def param_shapes(cls, cfg):
    s = lambda *shape: jax.ShapeDtypeStruct(shape, cfg.param_dtype)
    E, D, F = cfg.num_experts, cfg.d_model, cfg.d_ff
    return cls(s(E, D, F), s(E, F, D), s(E, F) if cfg.expert_bias else None)

  def __call__(self, x_MD, matmul):
    h_MF = matmul(x_MD, self.up_EDF)
    if self.up_b_EF is not None:
      h_MF = matmul.add_bias(h_MF, self.up_b_EF)
    return matmul(jax.nn.relu(h_MF).astype(x_MD.dtype), self.down_EFD)


def relu_mlp_model(ex, x_TKD, experts_TK):
  """ReluMLP in float64 for the layer model (`layer_oracle.EXPERT_MODELS`)."""
  h = np.einsum("tkd,tkdf->tkf", x_TKD, ex.up_EDF[experts_TK])
  if ex.up_b_EF is not None:
    h = h + ex.up_b_EF[experts_TK]
  return np.einsum("tkf,tkfd->tkd", np.maximum(h, 0.0), ex.down_EFD[experts_TK])


def test_a_users_class_is_built_checked_and_split_like_the_table_s(monkeypatch):
  """A class passed as expert_type: params.py builds its leaves, its biases start at zero,
  every leaf is split on axis 0, and the layer matches the float64 model (given the class's
  model)."""
  cfg = config(expert_type=ReluMLP, expert_bias=True, expert_axis="ep")
  assert cfg.expert_class is ReluMLP and hash(cfg) == hash(dataclasses.replace(cfg))
  params = ms.init_moe_params(jax.random.key(0), cfg)
  _check_params("test", params, cfg)
  assert type(params.experts) is ReluMLP
  # Matrices normal with variance 1 / fan-in, biases zeros (the rule of every class: leaves
  # of rank 3 and 2), and the biases draw no key: turning them on changes no other value.
  np.testing.assert_array_equal(params.experts.up_b_EF, 0.0)
  for a in (params.experts.up_EDF, params.experts.down_EFD):
    assert 0.5 < float(jnp.std(a)) * math.sqrt(a.shape[-2]) < 1.5
  plain = ms.init_moe_params(jax.random.key(0), dataclasses.replace(cfg, expert_bias=False))
  assert plain.experts.up_b_EF is None
  np.testing.assert_array_equal(plain.experts.up_EDF, params.experts.up_EDF)
  np.testing.assert_array_equal(plain.experts.down_EFD, params.experts.down_EFD)
  np.testing.assert_array_equal(plain.router_DE, params.router_DE)
  specs = ms.moe_param_specs(cfg).experts
  assert specs == ReluMLP(ms_spec("ep", 3), ms_spec("ep", 3), ms_spec("ep", 2))
  monkeypatch.setitem(layer_oracle.EXPERT_MODELS, "ReluMLP", relu_mlp_model)
  cfg = layer_config(expert_type=ReluMLP, expert_bias=True, impl="ragged_dot")
  check_layer(cfg, None, draw=relu_mlp_draw)


def relu_mlp_draw(seed):
  rng = np.random.default_rng([seed, 99])
  n = lambda *s: rng.normal(size=s) / math.sqrt(s[-2]) if len(s) == 3 else 0.5 * rng.normal(size=s)
  return ReluMLP(n(LE, LD, LF), n(LE, LF, LD), n(LE, LF))


# --------------------------------------------------------------------------- GroupedMatmul


def test_grouped_matmul_bias_reaches_only_the_rows_of_each_group():
  # Groups of 2, 0 (empty), 3 and 1 rows; rows 6 and 7 are padding.
  sizes_G = jnp.array([2, 0, 3, 1], jnp.int32)
  b_GF = jnp.arange(1.0, 9.0).reshape(4, 2)
  mm = ms.GroupedMatmul(sizes_G, "ragged_dot")
  got = mm.add_bias(jnp.zeros((8, 2)), b_GF)
  want = np.array([b_GF[0]] * 2 + [b_GF[2]] * 3 + [b_GF[3]] + [[0.0, 0.0]] * 2)
  np.testing.assert_array_equal(got, want)
  # Its gradient: each group's bias collects its rows' cotangents, padding rows none.
  ct = jnp.arange(16.0).reshape(8, 2)
  db = jax.grad(lambda b: jnp.sum(mm.add_bias(jnp.zeros((8, 2)), b) * ct))(b_GF)
  np.testing.assert_array_equal(db, [ct[0] + ct[1], [0, 0], ct[2] + ct[3] + ct[4], ct[5]])


def test_masked_matmul_multiplies_the_valid_rows_only():
  """`MaskedMatmul`: valid rows get x @ w[0] (+ b[0]), padding rows zeros, in any order;
  the gradients of x, w and b against numpy, padding rows contributing nothing."""
  rng = np.random.default_rng(3)
  x = rng.normal(size=(6, 3)).astype(np.float32)
  w = rng.normal(size=(1, 3, 2)).astype(np.float32)
  b = rng.normal(size=(1, 2)).astype(np.float32)
  ct = rng.normal(size=(6, 2)).astype(np.float32)
  valid = np.array([True, False, True, True, False, True])
  mm = ms.MaskedMatmul(jnp.asarray(valid))
  f = lambda x, w, b: mm.add_bias(mm(x, w), b)
  y = f(x, w, b)
  keep = valid[:, None].astype(np.float64)
  want = keep * (x.astype(np.float64) @ w[0] + b[0])
  np.testing.assert_allclose(y, want, rtol=1e-6, atol=1e-6)
  np.testing.assert_array_equal(np.asarray(y)[~valid], 0.0)
  dx, dw, db = jax.grad(lambda *a: jnp.sum(f(*a) * ct), argnums=(0, 1, 2))(x, w, b)
  np.testing.assert_allclose(dx, keep * (ct @ w[0].T), rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(dw[0], x.T @ (keep * ct), rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(db[0], (keep * ct).sum(0), rtol=1e-5, atol=1e-6)
  with pytest.raises(
    ValueError, match=re.escape("MaskedMatmul: w_GDF must be [1, D, F] (got (2, 3, 2))")
  ):
    mm(x, jnp.zeros((2, 3, 2)))


@pytest.mark.parametrize("name", NAMES)
def test_padding_rows_stay_zero_through_every_biased_ffn(name):
  """Rows past sum(group_sizes) are zeros in and get no bias, so they come out as zeros
  (every FFN of the table maps 0 to 0 without its biases)."""
  w = draw_ffn(name, bias=True, E=3)
  x_MD = jnp.asarray(np.random.default_rng(0).normal(size=(9, D)), jnp.float32)
  sizes_G = jnp.array([2, 0, 4], jnp.int32)  # rows 6..8 are padding
  x_MD = x_MD.at[6:].set(0.0)
  y = w(x_MD, ms.GroupedMatmul(sizes_G, "ragged_dot"))
  np.testing.assert_array_equal(y[6:], 0.0)
  want = oracle.moe(x_MD[:6], w, np.array([0, 0, 2, 2, 2, 2]))
  assert_close(y[:6], want, jnp.float32)


# --------------------------------------------------------------------------- dispatches


@functools.cache
def mesh_4x2():
  return jax.make_mesh((4, 2), (ms.EXPERT, ms.DATA), devices=jax.devices()[:8])


def _no_stats(y):
  return y, {}


# Every dispatch, with what makes padding rows: all_to_all chunks of 3 then 2 (5 tokens, 10
# items per device over 4 destinations: padded slots, and overflow rounds when skewed),
# ragged_all_to_all receive buffers of 4 rows (10 items per device: 3+ rounds, the last
# buffer partly filled). lax.ragged_dot compiles fastest; the bias does not depend on it.
DISPATCH_FNS = {
  "masked_scan": lambda x, w, e, g: _no_stats(ms.moe_masked_scan(x, w, e, g)),
  "ragged_dot": lambda x, w, e, g: _no_stats(ms.moe_ragged_dot(x, w, e, g, gmm_impl="ragged_dot")),
  "all_gather": lambda x, w, e, g: _no_stats(
    ms.moe_all_gather(x, w, e, g, mesh=mesh_4x2(), gmm_impl="ragged_dot")
  ),
  "all_to_all": lambda x, w, e, g: ms.moe_all_to_all(
    x, w, e, g, mesh=mesh_4x2(), chunk_size=(3, 2), return_stats=True, gmm_impl="ragged_dot"
  ),
  "ragged_all_to_all": lambda x, w, e, g: ms.moe_ragged_all_to_all(
    x, w, e, g, mesh=mesh_4x2(), recv_capacity=4, return_stats=True, gmm_impl="ragged_dot"
  ),
}
ROUTINGS = ["uniform", "one_expert", "empty_experts", "invalid_ids"]


@functools.partial(jax.jit, static_argnames="names", compiler_options=FAST_COMPILE)
def run_all(x_TD, w, experts_TK, weights_TK, ct, names):
  """{dispatch: (y, (dx, dw, dweights), stats)} of `sum(y * ct)`, every dispatch in one
  program."""
  out = {}
  for name in names:
    fn = DISPATCH_FNS[name]

    def loss(x, w, g, fn=fn):
      y, stats = fn(x, w, experts_TK, g)
      return jnp.sum(y.astype(jnp.float32) * ct), (y, stats)

    grads, (y, stats) = jax.grad(loss, argnums=(0, 1, 2), has_aux=True)(x_TD, w, weights_TK)
    out[name] = (y, grads, stats)
  return out


def check_dispatches(w, names):
  for routing in ROUTINGS:
    x, _, experts, weights = make_case(routing, T=T, D=D, F=F, E=E, K=K, seed=1, num_devices=4)
    ct = cotangent((T, w.d_out), jnp.float32, seed=1)
    want_y = oracle.moe(x, w, experts, weights)
    want = oracle.moe_grads(x, w, experts, weights, ct)
    for name, (y, grads, stats) in run_all(x, w, experts, weights, ct, names=names).items():
      what = f"{type(w).__name__} {routing} {name}"
      assert_close(y, want_y, jnp.float32, what)
      for part, got, expected in zip(("dx", "dw", "dweights"), grads, want):
        assert_tree_close(got, expected, jnp.float32, f"{what} {part}")
      if name == "ragged_all_to_all" or (name == "all_to_all" and routing == "one_expert"):
        assert int(stats["rounds"]) >= 3, what


# The FFN sees only the matmul a dispatch hands it: `dense_matmul` (masked_scan) or a
# `GroupedMatmul` (every other dispatch), whose group sizes and padding rows are the
# dispatch's. So every class runs on both local dispatches, and the expert-parallel ones
# are spread over the classes (each class on one or two, each dispatch with a gated class
# and all three biases), which keeps the compiles few.
PARALLEL = {
  "linear": ("all_gather",),
  "swiglu": ("ragged_all_to_all",),
  "gelu": ("all_to_all",),
  "geglu": ("all_gather",),
  "clamped_swiglu": ("all_to_all",),
}
assert set(PARALLEL) == set(NAMES)
assert {d for ds in PARALLEL.values() for d in ds} == set(DISPATCH_FNS) - {
  "masked_scan",
  "ragged_dot",
}


@pytest.mark.parametrize("name", NAMES)
def test_biased_ffns_match_the_oracle_on_every_dispatch(name):
  check_dispatches(draw_ffn(name, bias=True), ("masked_scan", "ragged_dot", *PARALLEL[name]))


@pytest.mark.parametrize("name", ["gelu", "geglu", "clamped_swiglu"])
def test_unbiased_ffns_match_the_oracle(name):
  """Without biases (Linear and SwiGLU without them: tests/test_parallel.py, test_ragged.py)."""
  check_dispatches(draw_ffn(name, bias=False), ("ragged_dot",))


# --------------------------------------------------------------------------- the layer

LB, LS, LD, LF, LE, LK = 4, 4, 4, 6, 8, 2  # T = 16 tokens: 2 per device on 8 devices


def layer_config(**overrides):
  base = dict(d_model=LD, d_ff=LF, num_experts=LE, top_k=LK, load_balance_coef=0.1)
  if overrides.get("expert_type") == "linear":
    base["d_ff"] = LD
  return ms.MoEConfig(**{**base, **overrides})


@functools.partial(jax.jit, static_argnames=("cfg", "mesh"), compiler_options=FAST_COMPILE)
def layer_and_grads(params, x_BSD, ct_BSD, cfg, mesh=None):
  """(y, (dparams, dx)) of `sum(y * ct) + aux_loss`, jitted once per (cfg, mesh)."""

  def loss(params, x_BSD):
    y, aux = ms.moe_layer(params, x_BSD, cfg, mesh)
    return jnp.sum(y * ct_BSD) + aux["aux_loss"], y

  (_, y), grads = jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)(params, x_BSD)
  return y, grads


def check_layer(cfg, mesh, draw):
  """`moe_layer` against the float64 layer model: y, dx and the gradient of every leaf.

  The first seed whose routing has a margin of 0.05 between each token's K-th and (K+1)-th
  logit is used, so float32 and float64 pick the same experts and no finite-difference
  step changes the choice (`layer_oracle.fd_grads`).
  """
  for seed in range(100):
    rng = np.random.default_rng([seed, 5])
    router = 2 * rng.normal(size=(LD, LE)) / math.sqrt(LD)
    x = rng.normal(size=(LB, LS, LD))
    if layer_oracle.routing_margin(x.reshape(-1, LD), router, LK) >= 0.05:
      break
  ct = rng.normal(size=(LB, LS, LD))
  params = ms.MoEParams(router_DE=router, experts=draw(seed), shared=None)
  params, x, ct = jax.tree.map(lambda a: np.asarray(a, np.float32), (params, x, ct))
  want_y, _ = layer_oracle.layer(params, x, cfg)
  want_dparams, want_dx = layer_oracle.fd_grads(params, x, ct, cfg)
  args = jax.tree.map(jnp.asarray, (params, x))
  if mesh is not None:
    put = lambda a, spec: jax.device_put(a, jax.sharding.NamedSharding(mesh, spec))
    experts = jax.tree.map(lambda a: put(a, P(cfg.expert_axis)), args[0].experts)
    args = (dataclasses.replace(args[0], experts=experts), put(args[1], P(ms.DATA)))
  y, (dparams, dx) = layer_and_grads(*args, jnp.asarray(ct), cfg, mesh)
  what = f"{cfg.expert_type} bias={cfg.expert_bias} {cfg.impl}"
  assert_close(y, want_y, jnp.float32, f"{what} y")
  assert_close(dx, want_dx, jnp.float32, f"{what} dx")
  assert_tree_close(dparams, want_dparams, jnp.float32, f"{what} d")


def layer_draw(name, bias):
  return lambda seed: draw_ffn(
    name, bias=bias, E=LE, D=LD, F=LD if name == "linear" else LF, seed=seed
  )


@pytest.mark.parametrize("name", NAMES)
def test_layer_with_each_expert_type_matches_the_model(name):
  cfg = layer_config(expert_type=name, expert_bias=True, impl="ragged_dot", gmm_impl="ragged_dot")
  if name == "clamped_swiglu":
    cfg = dataclasses.replace(cfg, swiglu_alpha=CLAMP["alpha"], swiglu_limit=CLAMP["limit"])
  check_layer(cfg, None, layer_draw(name, bias=True))


# On the 2x4 mesh (data x expert, 2 local experts per device), with small chunks or
# receive buffers: padding rows and several rounds inside the layer.
MESH_LAYER_CASES = {
  "clamped_swiglu": dict(impl="all_to_all", chunk_size=1),
  "gelu": dict(impl="ragged_all_to_all", recv_capacity=3),
}


@pytest.mark.parametrize("name", list(MESH_LAYER_CASES))
def test_layer_on_a_mesh_matches_the_model(name):
  mesh = jax.make_mesh((2, 4), (ms.DATA, ms.EXPERT), devices=jax.devices()[:8])
  cfg = layer_config(expert_type=name, expert_bias=True, gmm_impl="ragged_dot")
  cfg = dataclasses.replace(cfg, **MESH_LAYER_CASES[name])
  if name == "clamped_swiglu":
    cfg = dataclasses.replace(cfg, swiglu_alpha=CLAMP["alpha"], swiglu_limit=CLAMP["limit"])
  check_layer(cfg, mesh, layer_draw(name, bias=True))


# One expert per device (8 experts on 8 devices) with the megablox backend (what "auto"
# takes on TPU): all_to_all and ragged_all_to_all run each product as a `MaskedMatmul`
# (unsorted rows, padding masked), here on CPU.
ONE_EXPERT_CASES = {
  "clamped_swiglu": dict(impl="all_to_all", chunk_size=1, gmm_impl="megablox"),
  "swiglu": dict(impl="ragged_all_to_all", recv_capacity=3, gmm_impl="megablox"),
}


@pytest.mark.parametrize("name", list(ONE_EXPERT_CASES))
def test_layer_with_one_expert_per_device_matches_the_model(name, monkeypatch):
  mesh = jax.make_mesh((1, 8), (ms.DATA, ms.EXPERT), devices=jax.devices()[:8])
  cfg = layer_config(expert_type=name, expert_bias=True, **ONE_EXPERT_CASES[name])
  if name == "clamped_swiglu":
    cfg = dataclasses.replace(cfg, swiglu_alpha=CLAMP["alpha"], swiglu_limit=CLAMP["limit"])
  products = []
  call = ms.MaskedMatmul.__call__
  monkeypatch.setattr(
    ms.MaskedMatmul, "__call__", lambda self, x, w: products.append(w.shape) or call(self, x, w)
  )
  check_layer(cfg, mesh, layer_draw(name, bias=True))
  assert products and all(s[0] == 1 for s in products), products


# --------------------------------------------------------------------------- errors


def _layer_call(params, cfg):
  x_BSD = jax.ShapeDtypeStruct((2, 2, D), jnp.float32)
  return lambda: jax.eval_shape(lambda p, x: ms.moe_layer(p, x, cfg), params, x_BSD)


def _error_cases():
  swiglu = config()
  clamped = config(expert_type="clamped_swiglu", swiglu_limit=0.6)
  biased = config(expert_bias=True)
  f32 = lambda *s: np.zeros(s, np.float32)
  gelu = ms.GeluMLP(f32(E, D, F), f32(E, F, D), up_b_EF=f32(E, F + 1))
  x, experts = f32(T, D), np.zeros((T, K), np.int32)
  return {
    "unknown_name": (
      lambda: config(expert_type="relu"),
      ValueError,
      "MoEConfig: expert_type must be one of ('linear', 'swiglu', 'gelu', 'geglu', "
      "'clamped_swiglu') or an expert FFN class (got 'relu')",
    ),
    "not_a_class": (
      lambda: config(expert_type=3),
      TypeError,
      "MoEConfig: expert_type must be a name of EXPERTS or an expert FFN class with "
      "param_shapes, d_in, d_out, __call__ (got 3)",
    ),
    "class_without_param_shapes": (
      lambda: config(expert_type=dict),
      TypeError,
      "MoEConfig: expert_type must be a name of EXPERTS or an expert FFN class with "
      "param_shapes, d_in, d_out, __call__ (got <class 'dict'>)",
    ),
    "expert_bias_not_bool": (
      lambda: config(expert_bias=1),
      TypeError,
      "MoEConfig: expert_bias must be a bool (got 1)",
    ),
    "alpha_unread": (
      lambda: config(swiglu_alpha=1.0),
      ValueError,
      "MoEConfig: swiglu_alpha must be 1.702 with expert_type 'swiglu', which does not read "
      "it (got 1.0)",
    ),
    "limit_unread_by_a_users_class": (
      lambda: config(expert_type=ReluMLP, swiglu_limit=5.0),
      ValueError,
      "MoEConfig: swiglu_limit must be 7.0 with expert_type 'ReluMLP', which does not read "
      "it (got 5.0)",
    ),
    "limit_not_positive": (
      lambda: config(expert_type="clamped_swiglu", swiglu_limit=0.0),
      ValueError,
      "MoEConfig: swiglu_limit must be finite and > 0 (got 0.0)",
    ),
    "alpha_not_real": (
      lambda: config(expert_type="clamped_swiglu", swiglu_alpha="1"),
      TypeError,
      "MoEConfig: swiglu_alpha must be a real number (got '1')",
    ),
    "experts_not_d_to_d": (
      lambda: config(expert_type="linear", d_ff=F),
      ValueError,
      f"MoEConfig: the experts of expert_type 'linear' must map d_model ({D}) to d_model "
      f"(got d_in {D}, d_out {F}; 'linear' maps d_model to d_ff)",
    ),
    "params_of_another_class": (
      _layer_call(
        dataclasses.replace(
          ms.moe_param_shapes(swiglu),
          experts=ms.moe_param_shapes(config(expert_type="geglu")).experts,
        ),
        swiglu,
      ),
      ValueError,
      "moe_layer: params.experts must be a SwiGLU for this MoEConfig (expert_type='swiglu') "
      "(got GeGLU)",
    ),
    "params_of_another_limit": (
      _layer_call(ms.moe_param_shapes(dataclasses.replace(clamped, swiglu_limit=7.0)), clamped),
      ValueError,
      "moe_layer: params.experts.limit must be 0.6 for this MoEConfig (got 7.0)",
    ),
    "params_without_biases": (
      _layer_call(ms.moe_param_shapes(swiglu), biased),
      ValueError,
      "moe_layer: params must have the leaves of this MoEConfig (expert_type='swiglu', "
      "num_shared_experts=0, expert_bias=True): missing ['params.experts.gate_b_EF', "
      "'params.experts.up_b_EF', 'params.experts.down_b_ED'], unexpected []",
    ),
    "bias_shape": (
      lambda: ms.moe_ragged_dot(x, gelu, experts),
      ValueError,
      f"moe_ragged_dot: GeluMLP needs leaves up_EDF [E, D, F], down_EFD [E, F, D], up_b_EF "
      f"[E, F], one size per letter (got up_EDF {(E, D, F)}, down_EFD {(E, F, D)}, up_b_EF "
      f"{(E, F + 1)})",
    ),
    "bias_rank": (
      lambda: ms.moe_masked_scan(x, ms.Linear(f32(E, D, F), f32(E, 1, F)), experts),
      ValueError,
      f"moe_masked_scan: Linear needs leaves w_EDF [E, D, F], b_EF [E, F], one size per "
      f"letter (got w_EDF {(E, D, F)}, b_EF {(E, 1, F)})",
    ),
    "layer_model_of_an_unknown_class": (
      lambda: layer_oracle.expert_outputs(ReluMLP(f32(1, 1, 1), f32(1, 1, 1)), None, None),
      ValueError,
      "layer_oracle: no model of the FFN ReluMLP (known: ",
    ),
  }


ERRORS = _error_cases()


@pytest.mark.parametrize("case", list(ERRORS))
def test_errors(case):
  call, error, message = ERRORS[case]
  with pytest.raises(error, match="^" + re.escape(message)):
    call()


def test_error_ffn_without_leaves():
  x_TD, experts_T = np.zeros((3, 4), np.float32), np.zeros((3,), np.int32)
  with pytest.raises(ValueError, match=r"^moe_ragged_dot: w must have at least one array leaf"):
    ms.moe_ragged_dot(x_TD, ms.Linear(None), experts_T)
