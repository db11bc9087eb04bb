"""Quantized matrices are frozen: their gradients stopped, and a clear error when asked for.

`stop_gradient` stops a `QuantizedArray`'s arrays; `freeze(fn, tree)` marks every quantized
matrix of a tree so that differentiating the layer in one raises at trace time, naming it
(its float scales would otherwise get a meaningless gradient, its integer values JAX's
float0); `split_frozen` / `merge` split an FFN into the leaves a custom_vjp differentiates
and the frozen ones, and `zero_cotangent` is what the frozen ones get back.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from moe_shard.quant import is_quantized


def stop_gradient(w: Any) -> Any:
  """A `QuantizedArray` with its arrays' gradients stopped (frozen); other `w` unchanged."""
  if not is_quantized(w):
    return w
  return dataclasses.replace(
    w, values=jax.lax.stop_gradient(w.values), scales=jax.lax.stop_gradient(w.scales)
  )


def freeze(fn: str, tree: Any, prefix: str = "params") -> Any:
  """`tree` with its quantized matrices marked frozen: differentiating one raises TypeError.

  A quantized matrix has no gradient an optimizer could apply: its FP8 values would get
  float8 zeros (Adam's 0 / (0 + eps) is NaN in e4m3) and its integer values float0 (no
  arithmetic at all). So a transformation that differentiates the float arrays of a
  `QuantizedArray` (its scales, FP8 values) fails at trace time, naming the matrices and
  the way to leave them out; one that differentiates other leaves only (the quantized ones
  closed over, or split off with `trainable.split_trainable`) is unaffected: the mark is an
  identity that costs nothing. Integer arrays (int8 and MXFP4 values, MXFP4 scales) are
  differentiated only under `allow_int=True`, where JAX gives them float0 without tracing
  them: they cannot be seen here.

  Args:
    fn: the calling function, for the message.
    tree: any pytree holding `QuantizedArray`s.
    prefix: how the message names the root of `tree` (default "params").

  Returns:
    `tree`, its quantized matrices' arrays passed through the mark.
  """
  leaves, treedef = jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_quantized)
  names = tuple(prefix + jax.tree_util.keystr(p) for p, a in leaves if is_quantized(a))
  if not names:
    return tree
  arrays = [a.arrays() for _, a in leaves if is_quantized(a)]
  marked = iter(_frozen((fn, names), arrays))
  return jax.tree.unflatten(
    treedef,
    [dataclasses.replace(a, **dict(zip(("values", "scales"), next(marked)))) if is_quantized(a)
     else a for _, a in leaves],
  )  # fmt: skip


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _frozen(where, arrays):
  return arrays


def _frozen_fwd(where, arrays):
  # Called only when some of `arrays` are differentiated (symbolic zeros: the others are not).
  fn, names = where
  hit = [n for n, pair in zip(names, arrays) if any(a.perturbed for a in pair)]
  raise TypeError(
    f"{fn}: {', '.join(hit)} {'is a quantized matrix' if len(hit) == 1 else 'are quantized matrices'} "
    f"(QuantizedArray), frozen: they cannot be differentiated, and an optimizer step on them "
    f"would corrupt them (float8 zeros make Adam's update NaN). Differentiate the trainable "
    f"leaves only: `trainable, frozen = ms.split_trainable(params)` and "
    f"`jax.grad(lambda t: loss(ms.merge_trainable(t, frozen)))(trainable)`; in Equinox "
    f"`eqx.partition(model, ms.trainable_mask(model))`; in Flax NNX `nnx.grad` (they are not "
    f"nnx.Param) (docs/guides/quantization.md)"
  )


def _frozen_bwd(where, residuals, cotangents):  # unreachable: the forward rule raises
  raise AssertionError("frozen.freeze: a frozen matrix was differentiated")


_frozen.defvjp(_frozen_fwd, _frozen_bwd, symbolic_zeros=True)


def zero_cotangent(tree: Any) -> Any:
  """Zero cotangents for the arrays of `tree`: float0 for integer ones, zeros otherwise."""

  def zero(a):
    if jnp.issubdtype(a.dtype, jnp.integer) or a.dtype == jnp.bool_:
      return np.zeros(a.shape, jax.dtypes.float0)
    return jnp.zeros(a.shape, a.dtype)

  return jax.tree.map(zero, tree)


def split_frozen(tree: Any) -> tuple[list, list, Any]:
  """Splits `tree` into its trainable leaves and its quantized (frozen) matrices.

  Returns:
    (trainable, frozen, treedef): two lists over the leaves of `tree` (`QuantizedArray`s
    taken whole), each holding None where the other holds the leaf; `merge(treedef,
    trainable, frozen)` rebuilds the tree. A function differentiated in `trainable` with
    `frozen` closed over sees no integer leaf.
  """
  leaves, treedef = jax.tree.flatten(tree, is_leaf=is_quantized)
  trainable = [None if is_quantized(a) else a for a in leaves]
  frozen = [a if is_quantized(a) else None for a in leaves]
  return trainable, frozen, treedef


def merge(treedef: Any, trainable: list, frozen: list) -> Any:
  """The tree `split_frozen` split (`frozen` may hold cotangents of the quantized leaves)."""
  return jax.tree.unflatten(
    treedef, [t if f is None else f for t, f in zip(trainable, frozen, strict=True)]
  )
