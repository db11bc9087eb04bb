"""The "tokamax" grouped-matmul backend: tokamax's `ragged_dot` (openxla's Pallas kernel library).

tokamax (`pip install tokamax`; not a dependency of moe_shard) picks its own kernel per
platform: Mosaic GPU or Triton on a GPU, Mosaic on TPU, `lax.ragged_dot` ("xla") elsewhere,
and differentiates it with its own kernels. It is imported when this backend is first
traced, so the package imports and runs without it.
"""

from __future__ import annotations

import importlib

import jax.numpy as jnp


def tokamax_gmm(x_MD, w_GDF, group_sizes_G, *, out_dtype, **_):
  """The "tokamax" backend: `tokamax.ragged_dot`, products accumulated in float32 and the
  result written in `out_dtype`, differentiable in x and w (tokamax's own backward).

  Rows past `sum(group_sizes_G)` are zeroed on the way in and out, so that y and dx keep
  the table's contract (zeros there) whatever the kernel tokamax picks leaves in them.

  Args:
    x_MD: [M, D] rows sorted by group.
    w_GDF: [G, D, F] one matrix per group, cast to x's dtype.
    group_sizes_G: i32[G] rows per group.
    out_dtype: dtype of y.

  Returns:
    y_MF: [M, F] in `out_dtype`.

  Raises:
    ImportError: tokamax is not installed (`pip install tokamax`).
  """
  try:
    tokamax = importlib.import_module("tokamax")
  except ImportError as err:
    raise ImportError(
      f"grouped_matmul: impl 'tokamax' needs the tokamax package (pip install tokamax); "
      f"importing it failed: {err}"
    ) from err
  # tokamax reads its settings from absl flags, parsing sys.argv when first asked: that
  # fails under any program with flags of its own (pytest, python -m bench). Marked parsed,
  # its flags keep their defaults.
  flags = importlib.import_module("absl.flags")
  if not flags.FLAGS.is_parsed():
    flags.FLAGS.mark_as_parsed()
  rows_M1 = jnp.arange(x_MD.shape[0])[:, None] < jnp.sum(group_sizes_G)
  x_MD = jnp.where(rows_M1, x_MD, jnp.zeros((), x_MD.dtype))
  y_MF = tokamax.ragged_dot(
    x_MD,
    w_GDF.astype(x_MD.dtype),
    group_sizes_G.astype(jnp.int32),
    preferred_element_type=out_dtype,
  )
  return jnp.where(rows_M1, y_MF, jnp.zeros((), y_MF.dtype))


def available() -> bool:
  """Whether tokamax imports here (tests skip the backend where it does not)."""
  try:
    importlib.import_module("tokamax")
  except ImportError:
    return False
  return True
