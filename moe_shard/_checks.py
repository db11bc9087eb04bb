"""Trace-time argument checks with one message template: `fn: argument rule (got ...)`."""

from __future__ import annotations

import math
import numbers

import jax
import jax.core
import jax.numpy as jnp
import numpy as np


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


# --------------------------------------------------------------------------- config fields
# Every static argument (a MoEConfig field, a keyword of a public function) is checked here,
# with the same template: `fn: name must be rule (got value)`.


def _error(kind, fn, name, rule, value):
  return kind(f"{fn}: {name} must be {rule} (got {value!r})")


def is_int(value):
  """True for a Python or NumPy integer that is not a bool."""
  return isinstance(value, numbers.Integral) and not isinstance(value, (bool, np.bool_))


def int_field(fn, name, value, lo):
  """Returns `value` as an int, raising TypeError (not an int) or ValueError (below lo)."""
  if not is_int(value):
    raise _error(TypeError, fn, name, "an int", value)
  if value < lo:
    raise _error(ValueError, fn, name, f">= {lo}", value)
  return int(value)


def real_field(fn, name, value, *, positive):
  """Returns `value` as a finite float, > 0 when `positive`, else >= 0."""
  if isinstance(value, bool) or not isinstance(value, numbers.Real):
    raise _error(TypeError, fn, name, "a real number", value)
  if not math.isfinite(value) or (value <= 0 if positive else value < 0):
    raise _error(ValueError, fn, name, "finite and > 0" if positive else "finite and >= 0", value)
  return float(value)


def dtype_field(fn, name, value):
  """Returns `value` as a floating-point `jnp.dtype`."""
  try:
    dtype = jnp.dtype(value)
  except TypeError as e:
    raise _error(TypeError, fn, name, "a dtype", value) from e
  if not jnp.issubdtype(dtype, jnp.floating):
    raise _error(ValueError, fn, name, "a floating-point dtype", value)
  return dtype


def choice_field(fn, name, value, allowed):
  """Checks that `value` is one of `allowed` (a tuple of names)."""
  if isinstance(value, str) and value in allowed:
    return value
  raise _error(ValueError, fn, name, f"one of {tuple(allowed)}", value)


def bool_field(fn, name, value):
  if not isinstance(value, bool):
    raise _error(TypeError, fn, name, "a bool", value)
  return value


AXIS_RULE = "a mesh axis name (a non-empty str) or a non-empty tuple of distinct names"


def expert_axis_field(fn, value):
  """Returns the expert axis as a str, or a tuple of 2+ distinct str (a list is taken as a
  tuple; a 1-tuple is its one name), so that equal choices hash equally."""
  names = (value,) if isinstance(value, str) else value
  if (
    not isinstance(names, (tuple, list))
    or not names
    or not all(isinstance(n, str) and n for n in names)
  ):
    raise _error(TypeError, fn, "expert_axis", AXIS_RULE, value)
  if len(set(names)) != len(names):
    raise _error(ValueError, fn, "expert_axis", AXIS_RULE, value)
  return names[0] if len(names) == 1 else tuple(names)


SPLIT_AXIS_RULE = "None or a mesh axis name (a non-empty str)"


def split_axes_fields(fn, expert_axis, tensor_axis, fsdp_axis):
  """Checks `expert_tensor_axis` and `expert_fsdp_axis`: None or a name, each axis used by at
  most one of them and the expert axis (a name or a tuple of names)."""
  for name, value in (("expert_tensor_axis", tensor_axis), ("expert_fsdp_axis", fsdp_axis)):
    if value is not None and not (isinstance(value, str) and value):
      raise _error(TypeError, fn, name, SPLIT_AXIS_RULE, value)
  experts = (expert_axis,) if isinstance(expert_axis, str) else tuple(expert_axis)
  given = {"expert_axis": expert_axis}
  used = {a: "expert_axis" for a in experts}
  for name, value in (("expert_tensor_axis", tensor_axis), ("expert_fsdp_axis", fsdp_axis)):
    if value is None:
      continue
    if value in used:
      other = used[value]
      raise ValueError(
        f"{fn}: {name} must be an axis that {other} does not use: one mesh axis splits "
        f"one dimension (got {name}={value!r}, {other}={given[other]!r})"
      )
    used[value], given[name] = name, value


CHUNK_RULE = "None, an int >= 1 or a pair of ints >= 1"


def chunk_size_field(fn, value):
  """Returns the all_to_all chunk size as None or a hashable pair (C_first, C_overflow).

  An int C means (C, C). The one rule for `chunk_size` wherever it is passed.
  """
  if value is None:
    return None
  pair = (value, value) if is_int(value) else value
  if not isinstance(pair, (tuple, list)) or len(pair) != 2 or not all(map(is_int, pair)):
    raise _error(TypeError, fn, "chunk_size", CHUNK_RULE, value)
  if min(pair) < 1:
    raise _error(ValueError, fn, "chunk_size", CHUNK_RULE, value)
  return int(pair[0]), int(pair[1])
