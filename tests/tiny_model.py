"""A tiny residual MoE model shared by the framework tests (`test_nnx.py`, `test_equinox.py`).

    x_{l+1} = x_l + MoE_l(rms_norm(x_l) * scale_l),   l < LAYERS
    loss    = mean((x_L - target)^2) + sum_l aux_loss_l

The framework modules hold the parameters; `functional_loss` is the same model written with
`moe_layer`, `lax.scan` and `jax.checkpoint` on plain arrays, the reference for their losses.
"""

import contextlib

import jax
import jax.numpy as jnp
from cases import FAST_COMPILE
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import moe_shard as ms

B, S, D, F, E, K, LAYERS, STEPS = 8, 4, 8, 16, 8, 2, 2, 4
CFG = ms.MoEConfig(
  d_model=D,
  d_ff=F,
  num_experts=E,
  top_k=K,
  num_shared_experts=1,
  shared_d_ff=D,
  gmm_impl="ragged_dot",
)  # ragged_dot compiles fast on CPU
LEARNING_RATE = 1e-2


def make_mesh(kind):
  types = {"auto": AxisType.Auto, "explicit": AxisType.Explicit}[kind]
  return jax.make_mesh((2, 4), (ms.DATA, ms.EXPERT), axis_types=(types, types))


def batches(mesh):
  """STEPS (x_BSD, target_BSD) pairs, split over both mesh axes."""
  keys = jax.random.split(jax.random.key(42), 2 * STEPS)
  sharding = NamedSharding(mesh, P((ms.DATA, ms.EXPERT)))
  return [
    tuple(
      jax.device_put(jax.random.normal(k, (B, S, D)), sharding) for k in keys[2 * i : 2 * i + 2]
    )
    for i in range(STEPS)
  ]


def rms_norm(x_BSD):
  return x_BSD * jax.lax.rsqrt(jnp.mean(x_BSD**2, axis=-1, keepdims=True) + 1e-6)


def functional_loss(moe_L, scale_LD, x_BSD, target_BSD, mesh):
  """The model on plain arrays: `moe_L` a `MoEParams` stacked on axis 0, `scale_LD`."""

  def block(x_BSD, layer):
    moe, scale_D = layer
    y_BSD, aux = ms.moe_layer(moe, rms_norm(x_BSD) * scale_D, CFG, mesh=mesh)
    return x_BSD + y_BSD, aux["aux_loss"]

  x_BSD, aux_L = jax.lax.scan(jax.checkpoint(block), x_BSD, (moe_L, scale_LD))
  return jnp.mean((x_BSD - target_BSD) ** 2) + jnp.sum(aux_L)


functional_loss_jit = jax.jit(functional_loss, static_argnums=4, compiler_options=FAST_COMPILE)

COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"


@contextlib.contextmanager
def count_compiles():
  """Counts XLA compilations in the block: `with count_compiles() as n: ...; n[0]`."""
  count = [0]

  def listener(event, duration, **kwargs):
    del duration, kwargs
    if event == COMPILE_EVENT:
      count[0] += 1

  jax.monitoring.register_event_duration_secs_listener(listener)
  try:
    yield count
  finally:
    jax.monitoring.unregister_event_duration_listener(listener)
