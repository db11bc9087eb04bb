"""`moe_layer` inside a real model: a tiny decoder-only transformer trained with Adam.

The task: sequences over V = 16 tokens that count up by a step d in {1, 2, 3} drawn per
sequence, mod V (x[t+1] = x[t] + d), from a random first token. Predicting x[t+1] needs the
previous two tokens (attention) to read d; only x[1] is a guess between 3 values, so the
loss floor is log(3) / 15 = 0.07 per position, from log(16) = 2.77 at initialisation (the
unembedding starts at zero: uniform predictions).

The same model, data and initial values train on one device (impl="ragged_dot") and on a
data x expert = 2 x 4 mesh (impl="all_to_all", batch split over both axes). The train step
is jitted once per run; the two blocks (causal attention + MoE, pre-norm residual) are a
`lax.scan` over stacked layer parameters, so each run compiles one block.
"""

import dataclasses
import fcntl
import functools
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from cases import FAST_COMPILE
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import moe_shard as ms

V, S, D, H, B, LAYERS, STEPS = 16, 16, 32, 2, 8, 2, 100
MOE = ms.MoEConfig(
  d_model=D,
  d_ff=2 * D,
  num_experts=8,
  top_k=2,
  num_shared_experts=1,
  shared_d_ff=D,
  load_balance_coef=0.05,
  z_loss_coef=1e-3,
  gmm_impl="ragged_dot",
)  # lax.ragged_dot compiles faster than "tiled"
LEARNING_RATE = 1e-2


# --------------------------------------------------------------------------- model


def init_model(seed, mesh=None):
  """Dense weights from NumPy (identical on every mesh), MoE layers from `init_moe_params`."""
  rng = np.random.default_rng(seed)

  def normal(*shape, fan_in):
    return jnp.asarray(rng.normal(size=shape) / np.sqrt(fan_in), jnp.float32)

  dense = dict(
    embed_VD=normal(V, D, fan_in=1),
    pos_SD=normal(S, D, fan_in=1),
    unembed_DV=jnp.zeros((D, V)),
    norm_D=jnp.ones((D,)),
    # One entry per layer, stacked on axis 0 (L) for the scan; K = D / H per head.
    wq_LDHK=normal(LAYERS, D, H, D // H, fan_in=D),
    wk_LDHK=normal(LAYERS, D, H, D // H, fan_in=D),
    wv_LDHK=normal(LAYERS, D, H, D // H, fan_in=D),
    wo_LHKD=normal(LAYERS, H, D // H, D, fan_in=D),
    norm1_LD=jnp.ones((LAYERS, D)),
    norm2_LD=jnp.ones((LAYERS, D)),
  )
  keys = jax.random.split(jax.random.key(seed), LAYERS)
  moe = jax.tree.map(lambda *a: jnp.stack(a), *[ms.init_moe_params(k, MOE, mesh) for k in keys])
  if mesh is not None:
    dense = jax.device_put(dense, NamedSharding(mesh, P()))
  return dict(dense=dense, moe=moe)


def rms_norm(x_BSD, scale_D):
  return x_BSD * jax.lax.rsqrt(jnp.mean(x_BSD**2, axis=-1, keepdims=True) + 1e-6) * scale_D


def attention(x_BSD, wq_DHK, wk_DHK, wv_DHK, wo_HKD):
  q_BSHK, k_BSHK, v_BSHK = (jnp.einsum("bsd,dhk->bshk", x_BSD, w) for w in (wq_DHK, wk_DHK, wv_DHK))
  logits_BHST = jnp.einsum("bshk,bthk->bhst", q_BSHK, k_BSHK) / np.sqrt(q_BSHK.shape[-1])
  causal_ST = np.tril(np.ones((S, S), bool))
  probs_BHST = jax.nn.softmax(jnp.where(causal_ST, logits_BHST, -1e9), axis=-1)
  return jnp.einsum("bhst,bthk,hkd->bsd", probs_BHST, v_BSHK, wo_HKD)


def forward(params, tokens_BS, cfg, mesh):
  """Returns (logits_BSV, aux of the MoE layers stacked on axis 0)."""
  d = params["dense"]
  x_BSD = jax.nn.one_hot(tokens_BS, V) @ d["embed_VD"] + d["pos_SD"]

  def block(x_BSD, layer):
    ld, moe = layer
    x_BSD = x_BSD + attention(
      rms_norm(x_BSD, ld["norm1_LD"]), ld["wq_LDHK"], ld["wk_LDHK"], ld["wv_LDHK"], ld["wo_LHKD"]
    )
    y_BSD, aux = ms.moe_layer(moe, rms_norm(x_BSD, ld["norm2_LD"]), cfg, mesh)
    return x_BSD + y_BSD, aux

  per_layer = {k: v for k, v in d.items() if k.endswith(("_LD", "_LDHK", "_LHKD"))}
  x_BSD, aux = jax.lax.scan(block, x_BSD, (per_layer, params["moe"]))
  return rms_norm(x_BSD, d["norm_D"]) @ d["unembed_DV"], aux


def batches(seed):
  """i32[STEPS, B, S]: x[t+1] = (x[t] + d) mod V, d in {1, 2, 3} drawn per sequence."""
  rng = np.random.default_rng(seed)
  seq = np.zeros((STEPS, B, S), np.int32)
  d = rng.integers(1, 4, size=(STEPS, B))
  seq[..., 0] = rng.integers(0, V, size=(STEPS, B))
  for t in range(1, S):
    seq[..., t] = (seq[..., t - 1] + d) % V
  return seq


def loss_of(cfg, mesh):
  """The training loss of the model with `cfg` on `mesh`: (loss, (cross-entropy, load))."""

  def loss_fn(params, tokens_BS):
    logits_BSV, aux = forward(params, tokens_BS, cfg, mesh)
    # Cross-entropy against one-hot labels: jax 0.12 cannot infer the sharding of the
    # scatter in the backward of optax's integer-label form on a batch-sharded Explicit mesh.
    ce = optax.softmax_cross_entropy(logits_BSV[:, :-1], jax.nn.one_hot(tokens_BS[:, 1:], V))
    return jnp.mean(ce) + jnp.sum(aux["aux_loss"]), (jnp.mean(ce), aux["expert_load"])

  return loss_fn


def train(cfg, mesh=None, seed=0, reference_cfg=None):
  """Trains for STEPS steps; returns (losses f32[STEPS], expert_load of the last step [L, E],
  and with `reference_cfg` the cross-entropy of that config on one device at this run's
  parameters before each step, f32[STEPS])."""
  params = init_model(seed, mesh)
  opt = optax.adam(LEARNING_RATE)
  state = opt.init(params)
  loss_fn = loss_of(cfg, mesh)
  reference = (
    None
    if reference_cfg is None
    else jax.jit(
      lambda p, t: loss_of(reference_cfg, None)(p, t)[1][0], compiler_options=FAST_COMPILE
    )
  )

  @functools.partial(jax.jit, donate_argnums=(0, 1), compiler_options=FAST_COMPILE)
  def step(params, state, tokens_BS):
    (_, (ce, load)), grads = jax.value_and_grad(loss_fn, has_aux=True)(params, tokens_BS)
    updates, state = opt.update(grads, state, params)
    return optax.apply_updates(params, updates), state, ce, load

  # Each batch placed from NumPy up front (no per-step slicing program); on the mesh the
  # sequences are split over every axis.
  sharding = None if mesh is None else NamedSharding(mesh, P(tuple(mesh.axis_names)))
  host = batches(seed)
  data = [jax.device_put(tokens_BS, sharding) for tokens_BS in host]
  losses, reference_losses = [], []
  for tokens_np, tokens_BS in zip(host, data):
    if reference is not None:  # before the step donates the parameters
      reference_losses.append(float(reference(jax.device_get(params), tokens_np)))
    params, state, ce, load = step(params, state, tokens_BS)
    # One step in flight at a time. With async dispatch, the 8 simulated devices (threads
    # of one pool on a 2-core machine) can start step i+1 while others finish step i; the
    # first to arrive then block pool threads in a collective of step i+1 that the others
    # need to finish step i: XLA:CPU aborted on a rendezvous timeout that way (2 of 2
    # runs under load) until this wait was added.
    losses.append(float(ce))
  if reference is not None:
    return np.asarray(losses), np.asarray(load), np.asarray(reference_losses)
  return np.asarray(losses), np.asarray(load)


# --------------------------------------------------------------------------- tests


def all_runs():
  """The one-device run, the mesh run and its one-device reference losses, as NumPy."""
  one = train(dataclasses.replace(MOE, impl="ragged_dot"))
  mesh = jax.make_mesh((2, 4), (ms.DATA, ms.EXPERT))
  *sharded, reference = train(
    dataclasses.replace(MOE, impl="all_to_all"),
    mesh,
    reference_cfg=dataclasses.replace(MOE, impl="ragged_dot"),
  )
  return dict(one_device=one, mesh=tuple(sharded), reference=reference)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
  """`all_runs()` in a fresh Python process (this file run as a script), retried once if
  that process dies by a signal; once per pytest run: under xdist the first worker to get
  here runs it, holding a lock in the run's shared temporary folder, and the other reads its
  file (each worker would otherwise train the same models again).

  Why a process of its own: in 2 of 5 runs of the whole suite the test worker died in this
  fixture; the one whose output showed why died of a segmentation fault inside XLA:CPU's
  compiler (`backend_compile_and_load`) compiling the one-device train step, after other
  tests had run in the same worker. The same compile passed in the other runs and in
  isolation. A crash there now costs a
  retry, reported on stderr, instead of the worker; a failure of any other kind (an
  exception, wrong losses) fails the test as before.
  """
  shared = tmp_path_factory.getbasetemp()
  if os.environ.get("PYTEST_XDIST_WORKER"):  # basetemp is the worker's; its parent the run's
    shared = shared.parent
  out = shared / "test_training_runs.npz"
  with open(shared / "test_training_runs.lock", "w") as lock:
    fcntl.flock(lock, fcntl.LOCK_EX)
    if not out.is_file():
      _train_in_a_process(out)
  with np.load(out) as f:
    return dict(
      one_device=(f["one_losses"], f["one_load"]),
      mesh=(f["mesh_losses"], f["mesh_load"]),
      reference=f["reference"],
    )


def _train_in_a_process(out):
  """Runs this file as a script writing `out`, once more if the process dies by a signal."""
  for attempt in (1, 2):
    proc = subprocess.run(
      [sys.executable, __file__, str(out)], capture_output=True, text=True, timeout=1200
    )
    if proc.returncode >= 0:
      break
    print(
      f"test_training: the training process died by signal {-proc.returncode} "
      f"(attempt {attempt}); its stderr ends:\n{proc.stderr[-2000:]}",
      file=sys.stderr,
    )
  assert proc.returncode == 0, f"training process failed:\n{proc.stdout}\n{proc.stderr}"


@pytest.mark.parametrize("run", ["one_device", "mesh"])
def test_loss_falls(run, runs):
  losses, _ = runs[run]
  print(f"{run}: loss {losses[0]:.4f} -> {losses[-1]:.4f}")
  # The unembedding starts at zero: exactly uniform predictions.
  np.testing.assert_allclose(losses[0], np.log(V), rtol=1e-5)
  # At least 8x lower over the last 5 steps (measured: about 20x, 2.77 -> 0.12-0.18).
  assert np.mean(losses[-5:]) < np.log(V) / 8


def test_one_device_and_mesh_agree(runs):
  # At every step of the mesh run, the one-device model (ragged_dot, no mesh) evaluated at
  # the mesh run's own parameters gives the same loss: the same function along the whole
  # trajectory. Both do the same float32 math in a different order (sums split over 8
  # devices, one grouped matmul over all items against per-device chunks after an
  # all_to_all): measured at most 3.3e-6 (1.2e-6 relative, at step 0). The tolerance, 1e-5
  # (+ 1e-5 relative), leaves ~10x margin and is 100x below what a real disagreement costs
  # (one dropped or misrouted item moves the loss by 1e-3 or more). One step may differ by
  # such a flip: when the second layer's router sees a near tie, the two float orders can
  # pick different experts for one token at that step only (seen: step 18, 7.7e-4, once the
  # combine summed K rows of a [K, T, D] buffer). A wrong dispatch moves every step.
  # Two separately trained runs are not compared step for step: Adam does not damp
  # ulp-level differences, and once a near-tie top-k choice flips in one run (seen at step
  # 18 with optax 0.2.x), the trajectories part for good.
  sharded, _ = runs["mesh"]
  diff = np.abs(sharded - runs["reference"])
  print(f"max per-step |loss difference| {diff.max():.2e} (step {diff.argmax()})")
  off = diff > 1e-5 + 1e-5 * np.abs(runs["reference"])
  assert off.sum() <= 1 and diff.max() < 2e-3, (
    f"steps {np.flatnonzero(off).tolist()} differ: {diff[off]}"
  )


@pytest.mark.parametrize("run", ["one_device", "mesh"])
def test_expert_load_stays_near_uniform(run, runs):
  # load_balance_coef = 0.05: after 100 steps every expert of both layers gets within a
  # factor of 2 of the uniform load (measured: 0.72x to 1.34x).
  _, load_LE = runs[run]
  uniform = B * S * MOE.top_k / MOE.num_experts  # 32 items per expert per layer
  print(f"{run}: expert load / uniform\n{load_LE / uniform}")
  assert np.all(load_LE.sum(axis=1) == B * S * MOE.top_k)  # dropless: every item computed
  assert np.all(load_LE <= 2 * uniform) and np.all(load_LE >= uniform / 2)


if __name__ == "__main__":  # the `runs` fixture's process: python test_training.py OUT.npz
  if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    raise SystemExit("run by the `runs` fixture, which sets XLA_FLAGS for 8 CPU devices")
  r = all_runs()
  np.savez(
    sys.argv[1],
    one_losses=r["one_device"][0],
    one_load=r["one_device"][1],
    mesh_losses=r["mesh"][0],
    mesh_load=r["mesh"][1],
    reference=r["reference"],
  )
