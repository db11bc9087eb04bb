"""The checkpoint names (`moe_shard.remat`) are in the layer's jaxpr and a
`save_only_these_names` policy saves exactly what it names (MaxText issue 4005: a renamed
intermediate silently stopped being saved). Only traced, nothing compiled."""

import contextlib
import dataclasses
import io

import jax
import jax.numpy as jnp
import pytest
from jax.ad_checkpoint import print_saved_residuals
from jax.sharding import AxisType

import moe_shard as ms

CFG = ms.MoEConfig(d_model=8, d_ff=16, num_experts=8, top_k=2, gmm_impl="ragged_dot")
X = jnp.ones((8, 2, 8))
LOCAL = (
  ms.MOE_ROUTER_LOGITS,
  ms.MOE_EXPERT_GATE,
  ms.MOE_EXPERT_UP,
  ms.MOE_EXPERT_OUT,
  ms.MOE_DISPATCH_OUT,
)


def loss_fn(cfg, mesh):
  def loss(params, x_BSD):
    y_BSD, aux = ms.moe_layer(params, x_BSD, cfg, mesh=mesh)
    return jnp.sum(y_BSD**2) + aux["aux_loss"]

  return loss


def saved(f, *args):
  """The lines of `print_saved_residuals`: one per value saved for the backward pass."""
  out = io.StringIO()
  with contextlib.redirect_stdout(out):
    print_saved_residuals(f, *args)
  return out.getvalue().splitlines()


def named(lines):
  return {name for name in ms.CHECKPOINT_NAMES for line in lines if f"named '{name}'" in line}


@pytest.fixture(scope="module")
def mesh():
  return jax.make_mesh((2, 4), (ms.DATA, ms.EXPERT), axis_types=(AxisType.Auto,) * 2)


def test_names_are_stable():
  assert ms.CHECKPOINT_NAMES == (
    "moe_router_logits",
    "moe_dispatch_recv",
    "moe_expert_gate",
    "moe_expert_up",
    "moe_expert_out",
    "moe_dispatch_out",
  )


@pytest.mark.parametrize("impl", ["ragged_dot", "masked_scan", "all_gather", "all_to_all"])
def test_names_are_in_the_jaxpr(impl, mesh):
  cfg = dataclasses.replace(CFG, impl=impl)
  on_mesh = impl.startswith("all_")
  m = mesh if on_mesh else None
  params = ms.init_moe_params(jax.random.key(0), cfg, mesh=m)
  jaxpr = str(jax.make_jaxpr(loss_fn(cfg, m))(params, X))
  want = set(LOCAL) | ({ms.MOE_DISPATCH_RECV} if on_mesh else set())
  assert {n for n in ms.CHECKPOINT_NAMES if f"name={n}" in jaxpr} == want


@pytest.mark.parametrize("name", LOCAL)
def test_policy_saves_exactly_the_named_value(name):
  params = ms.init_moe_params(jax.random.key(0), CFG)
  f = loss_fn(CFG, None)
  nothing = saved(jax.checkpoint(f), params, X)
  assert named(nothing) == set()  # default policy: only the inputs
  one = saved(
    jax.checkpoint(f, policy=jax.checkpoint_policies.save_only_these_names(name)), params, X
  )
  assert named(one) == {name} and len(one) == len(nothing) + 1
  # Saving every name except this one: the rest, and not this one.
  others = [n for n in ms.CHECKPOINT_NAMES if n != name]
  rest = saved(
    jax.checkpoint(f, policy=jax.checkpoint_policies.save_only_these_names(*others)), params, X
  )
  assert named(rest) == set(LOCAL) - {name}


def test_policy_on_the_all_to_all_layer(mesh):
  # The overflow rounds run in a while_loop under a custom_vjp whose backward replays them,
  # and round 0 is differentiated inside the dispatch's shard_map: the names inside a round
  # are not saved by a policy, the layer-level ones (logits, dispatch output) are. (Round 0
  # keeps its own residuals inside the shard_map, which the policy does not govern.)
  cfg = dataclasses.replace(CFG, impl="all_to_all")
  params = ms.init_moe_params(jax.random.key(0), cfg, mesh=mesh)
  f = loss_fn(cfg, mesh)
  everything = jax.checkpoint_policies.save_only_these_names(*ms.CHECKPOINT_NAMES)
  lines = saved(jax.checkpoint(f, policy=everything), params, X)
  assert named(lines) == {ms.MOE_ROUTER_LOGITS, ms.MOE_DISPATCH_OUT}
  assert len(lines) >= len(saved(jax.checkpoint(f), params, X)) + 2
