"""Trace-time argument checks with one message template: `fn: argument rule (got ...)`."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np


def _shape_dtype(value):
  if isinstance(value, (jax.Array, np.ndarray, jax.ShapeDtypeStruct)) or hasattr(value, "aval"):
    return tuple(value.shape), jnp.dtype(value.dtype)
  arr = np.asarray(value)
  return arr.shape, arr.dtype


def as_array(fn, name, value):
  """Returns `value` as a jax array (or tracer), raising TypeError if it is not array-like."""
  if isinstance(value, (jax.Array, jax.core.Tracer)):
    return value
  try:
    return jnp.asarray(value)
  except TypeError as e:
    raise TypeError(f"{fn}: {name} must be an array (got {type(value).__name__})") from e


def float_array(fn, name, value, *, ndim=None):
  """Checks that `value` is a floating-point array of rank `ndim` and returns it."""
  value = as_array(fn, name, value)
  if not jnp.issubdtype(value.dtype, jnp.floating):
    raise TypeError(f"{fn}: {name} must have a floating-point dtype (got {value.dtype})")
  if ndim is not None and value.ndim != ndim:
    raise ValueError(f"{fn}: {name} must be {ndim}-D (got shape {tuple(value.shape)})")
  return value


def int_array(fn, name, value):
  """Checks that `value` is an integer array and returns it."""
  value = as_array(fn, name, value)
  if not jnp.issubdtype(value.dtype, jnp.integer):
    raise TypeError(f"{fn}: {name} must have an integer dtype (got {value.dtype})")
  return value


def int_in_range(fn, name, value, lo, hi):
  """Checks that `value` is a Python int (not bool) with lo <= value <= hi."""
  if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
    raise TypeError(f"{fn}: {name} must be an int (got {type(value).__name__})")
  if not lo <= value <= hi:
    raise ValueError(f"{fn}: {name} must be in [{lo}, {hi}] (got {value})")
  return int(value)


def divisible(fn, what, value, by_what, by):
  if value % by:
    raise ValueError(f"{fn}: {what} ({value}) must be divisible by {by_what} ({by})")
