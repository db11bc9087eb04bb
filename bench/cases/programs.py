"""What the benchmark compiles: every implementation of one case, on the same sharded inputs.

A case is (level, E, routing) at one size on one mesh:

  * level "kernel": `Out = sum_j G[i,j] * (W[B[i,j]] @ A[i])`, one [D, F] matrix per expert,
    routing drawn by `common.synthetic_routing`.
  * level "layer": `moe_layer` (router + dispatch + SwiGLU experts + combine), the router
    biased so that its top-k follows the same skew (a constant input feature whose router
    row is the log-popularity of each expert; the other rows score every expert alike,
    `build.equal_logit_columns`).

Implementations come from the table in `bench/cases/impls.py`: each is a dispatch (a library
name or a function of the dispatch signature), run through `moe_layer` at layer level and
directly, with one matrix per expert, at kernel level.

Everything here works on real arrays (CPU/GPU/TPU runs) and on `jax.ShapeDtypeStruct`s
with shardings (ahead-of-time compiles for a TPU topology): the routing is known on the
host in both cases (computed here in NumPy, not by the library), so are the trip counts of
the data-dependent loops (`bench/reading/accounting.py`). A compile holds no input on the
host: past `build.HOST_DRAW_BYTES` of x, its routing is sampled shard by shard
(`build.sampled_top_k`). The case itself is built in `build.py`.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

import moe_shard as ms
from bench.cases.impls import BENCH_IMPLS


def programs(case, impl):
  """Returns {"fwd": jitted fn, "fwd_bwd": jitted fn} of the `impl` entry on `case`.

  Kernel level: (x, w, experts, weights, dy) -> y, or (y, dx, dw, dweights) (y, dx, dweights
  for a quantized w: frozen). Layer level: (params, x, dy) -> (y, aux_loss, rounds,
  dropped_items), or (y, dparams, dx) (with quantized matrices, dparams is the list of the
  trainable leaves of `ms.frozen.split_frozen`).
  """
  return programs_and_args(case, impl)[0]


def programs_and_args(case, impl):
  """(`programs(case, impl)`, the arguments they take): `case.args`, or an entry's own
  inputs (the dense limit)."""
  if impl not in BENCH_IMPLS:
    raise ValueError(f"unknown impl {impl!r}; choose from {', '.join(BENCH_IMPLS)}")
  if BENCH_IMPLS[impl].programs is not None:
    return BENCH_IMPLS[impl].programs(case)
  return _dispatch_programs(case, impl), case.args


def in_program_layout(program, args, index):
  """`program` (a `jax.jit` function) with the arrays of argument `index` in the layouts its
  compiled program picks (`Layout.AUTO`), as a server holds its weights after
  `jax.device_put(params, compiled.input_formats[0][index])`; the other arguments keep
  their shardings and the default layouts. `args`: ShapeDtypeStructs with shardings."""
  from jax.experimental.layout import Format, Layout

  shardings = [jax.tree.map(lambda a: a.sharding, arg) for arg in args]
  shardings[index] = jax.tree.map(lambda a: Format(Layout.AUTO, a.sharding), args[index])
  return jax.jit(program.__wrapped__, in_shardings=tuple(shardings))


def _dispatch_programs(case, impl):
  mesh = case.mesh
  dispatch = BENCH_IMPLS[impl].resolve(case.size)
  cfg = dataclasses.replace(case.cfg, impl=dispatch)
  if case.level == "kernel":
    # "auto" as the layer resolves it on this mesh (`ms.choose_impl`); other names as given.
    tokens = -(-case.size.T // mesh.size)  # per device, as the layer passes them
    resolved = ms.choose_impl(cfg, mesh, tokens=tokens) if isinstance(dispatch, str) else None
    fn = dispatch if resolved is None else ms.DISPATCHES[resolved].fn

    def kernel(x, w, e, g):
      return fn(x, ms.Linear(w_EDF=w), e, g, mesh=mesh, cfg=cfg)[0]

    def fwd(x, w, e, g, dy):
      return kernel(x, w, e, g)

    def fwd_bwd(x, w, e, g, dy):
      if ms.quant.is_quantized(w):  # frozen: no gradient of the quantized matrices
        y, vjp = jax.vjp(lambda x, g: kernel(x, w, e, g), x, g)
        return (y, *vjp(dy))
      y, vjp = jax.vjp(lambda x, w, g: kernel(x, w, e, g), x, w, g)
      return (y, *vjp(dy))

    return {"fwd": jax.jit(fwd), "fwd_bwd": jax.jit(fwd_bwd)}

  placement = case.placement

  def fwd(p, x, dy):
    y, aux = ms.moe_layer(p, x, cfg, mesh=mesh, placement=placement)
    return y, aux["aux_loss"], aux["rounds"], aux["dropped_items"]

  def fwd_bwd(p, x, dy):
    def outputs(p, x):
      y, aux = ms.moe_layer(p, x, cfg, mesh=mesh, placement=placement)
      return y, aux["aux_loss"]

    if not any(map(ms.quant.is_quantized, jax.tree.leaves(p, is_leaf=ms.quant.is_quantized))):
      (y, _), vjp = jax.vjp(outputs, p, x)
      return (y, *vjp((dy, jnp.ones((), jnp.float32))))
    # Quantized matrices are frozen: the gradient is of the other parameters and x.
    trainable, frozen, treedef = ms.frozen.split_frozen(p)
    (y, _), vjp = jax.vjp(
      lambda t, x: outputs(ms.frozen.merge(treedef, t, frozen), x), trainable, x
    )
    return (y, *vjp((dy, jnp.ones((), jnp.float32))))

  return {"fwd": jax.jit(fwd), "fwd_bwd": jax.jit(fwd_bwd)}
