"""Fine-tuning: which leaves an optimizer may move.

    mask = trainable_mask(params)                  # False: frozen leaves (optax.masked, eqx.partition)
    trainable, frozen = split_trainable(params)    # differentiate `trainable` only
    params = merge_trainable(trainable, frozen)

Frozen leaves are the quantized matrices (`QuantizedArray`: the layer refuses to be
differentiated in them, `frozen.freeze`), the base matrix under an adapter (`adapters.py`),
and the router's selection bias `router_bias` (moved by `update_router_bias`, not by
gradients).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax

from moe_shard.adapters import is_adapter
from moe_shard.params import MoEParams
from moe_shard.quant import is_quantized


def trainable_mask(tree: Any) -> Any:
  """Returns True for each leaf an optimizer may move, False for the frozen ones.

  Frozen: the arrays of every `QuantizedArray` (values and scales), the base matrix `w` of
  every `Adapter`, and the `router_bias` of every `MoEParams` (aux-loss-free balancing's
  selection bias, moved by `update_router_bias`). Everything else is True. Use it as the
  labels of `optax.multi_transform` (`{True: tx, False: optax.set_to_zero()}`), the filter
  of `eqx.partition`, or a mask of `optax.masked` (which passes the masked-out leaves'
  updates through: it restricts a transformation, it does not freeze); `split_trainable`
  splits a tree by it. For `SlotParams` that move between placements give optax the
  function, `optax.multi_transform({True: tx, False: optax.set_to_zero()},
  trainable_mask)` or `optax.masked(tx, trainable_mask)`: a tree of labels carries the
  placement it was made on and no longer matches the parameters after a move.

  Args:
    tree: any pytree: a `MoEParams` or `SlotParams` (or a stack of them), an Equinox
      module holding one, a dict of them.

  Returns:
    a pytree of bools with the structure of `tree` (a `QuantizedArray` of two bools where
    `tree` holds one).
  """

  def one(x):
    if is_quantized(x):
      return dataclasses.replace(x, values=False, scales=False)
    if is_adapter(x):
      return dataclasses.replace(x, w=jax.tree.map(lambda _: False, x.w), a=one(x.a), b=one(x.b))
    if isinstance(x, MoEParams):
      fields = {  # the arrays' fields (a SlotParams keeps its type and placement)
        f.name: jax.tree.map(one, getattr(x, f.name), is_leaf=_is_node)
        for f in dataclasses.fields(MoEParams)
      }
      bias = None if x.router_bias is None else False
      return dataclasses.replace(x, **{**fields, "router_bias": bias})
    return True

  return jax.tree.map(one, tree, is_leaf=_is_node)


def _is_node(x):
  return is_quantized(x) or is_adapter(x) or isinstance(x, MoEParams)


def split_trainable(tree: Any) -> tuple[Any, Any]:
  """Splits `tree` by `trainable_mask` into (trainable, frozen), each None where the other
  holds the leaf (as `eqx.partition`): differentiate and optimize `trainable`, pass `frozen`
  along, and `merge_trainable(trainable, frozen)` is `tree` again.

  Args:
    tree: as `trainable_mask`.

  Returns:
    (trainable, frozen): two pytrees of the structure of `tree` with None leaves.
  """
  mask = trainable_mask(tree)
  trainable = jax.tree.map(lambda a, m: a if m else None, tree, mask)
  frozen = jax.tree.map(lambda a, m: None if m else a, tree, mask)
  return trainable, frozen


def merge_trainable(trainable: Any, frozen: Any) -> Any:
  """The tree `split_trainable` split: each leaf from `trainable`, or from `frozen` where
  `trainable` holds None."""
  return jax.tree.map(
    lambda t, f: f if t is None else t, trainable, frozen, is_leaf=lambda x: x is None
  )
