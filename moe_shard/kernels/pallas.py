"""What the Pallas-kernel grouped-matmul backends share (`kernels.tpu`: megablox on TPU,
`kernels.gpu`: Mosaic GPU on Hopper): group sizes clipped to the rows, the zeroing of rows the
kernels leave unwritten, and tracing a `pallas_call` inside `jax.shard_map` with check_vma.

  * JAX's grouped-matmul kernels write only the rows of the groups: the rows at and past
    sum(group_sizes) hold whatever the output buffer held (NaN in interpret mode), so y and
    dx are zeroed there with a `where` (fused into the consumer by XLA).
  * Their pallas_calls declare outputs without mesh-axis types, which Pallas rejects inside
    a `shard_map` with check_vma: they are traced with JAX's internal check_vma flag off
    (`no_vma_check`) and their outputs cast to vary like the inputs (`vary_like`). Inputs
    that do not vary (e.g. replicated w) are cast to varying first (`sharding.match_vma`),
    so a replicated w's gradient comes back summed over the devices.
"""

from __future__ import annotations

import contextlib

import jax
import jax._src.config
import jax.numpy as jnp

from moe_shard import _checks
from moe_shard.sharding import varying_axes


def check_inputs(fn, x_MD, w_GDF, group_sizes_G, dtypes, kernels, preferred_element_type):
  """The argument checks both kernel backends share; returns (x_MD, w_GDF, group_sizes_G,
  out_dtype), out_dtype `preferred_element_type` or, for None, the dtype of `x_MD`.

  Raises:
    TypeError: `x_MD` not one of `dtypes` (what `kernels` take), non-float `w_GDF` or
      `preferred_element_type`, non-integer group sizes.
    ValueError: bad ranks, mismatched D or G.
  """
  x_MD = _checks.float_array(fn, "x_MD", x_MD, ndim=2)
  w_GDF = _checks.float_array(fn, "w_GDF", w_GDF, ndim=3)
  group_sizes_G = _checks.int_array(fn, "group_sizes_G", group_sizes_G)
  if x_MD.dtype not in dtypes:
    names = " or ".join(jnp.dtype(d).name for d in dtypes)
    raise TypeError(f"{fn}: x_MD must be {names}, the dtypes {kernels} take (got {x_MD.dtype})")
  D, G = x_MD.shape[1], w_GDF.shape[0]
  if w_GDF.shape[1] != D:
    raise ValueError(f"{fn}: w_GDF's D ({w_GDF.shape[1]}) must equal x_MD's D ({D})")
  if group_sizes_G.shape != (G,):
    raise ValueError(
      f"{fn}: group_sizes_G must have shape ({G},), one per group of w_GDF "
      f"(got {tuple(group_sizes_G.shape)})"
    )
  out_dtype = jnp.dtype(x_MD.dtype if preferred_element_type is None else preferred_element_type)
  if not jnp.issubdtype(out_dtype, jnp.floating):
    raise TypeError(f"{fn}: preferred_element_type must be a float dtype (got {out_dtype})")
  return x_MD, w_GDF, group_sizes_G, out_dtype


def round_up(n, multiple):
  """The least multiple of `multiple` that is >= n."""
  return -(-n // multiple) * multiple


def clip_group_sizes(group_sizes_G, M):
  """int32 sizes whose groups end by row M: rows past M (and any padding) are in no group."""
  ends_G = jnp.clip(jnp.cumsum(group_sizes_G.astype(jnp.int32)), 0, M)
  return jnp.diff(ends_G, prepend=jnp.zeros((1,), jnp.int32))


def zero_past_groups(a_PN, group_sizes_G):
  """Zeros the rows at and past sum(group_sizes), which the kernels leave unwritten."""
  rows_P = jax.lax.broadcasted_iota(jnp.int32, (a_PN.shape[0], 1), 0)
  return jnp.where(rows_P < jnp.sum(group_sizes_G), a_PN, jnp.zeros((), a_PN.dtype))


def vary_like(axes, *arrays):
  """Casts each array to vary over `axes` (a superset of its own; no-op outside shard_map)."""
  return tuple(
    a
    if varying_axes(a) == axes
    else jax.lax.pcast(a, tuple(sorted(axes - varying_axes(a))), to="varying")
    for a in arrays
  )


def no_vma_check():
  """Traces a kernel's pallas_calls inside a shard_map with check_vma (see the module doc)."""
  flag = getattr(jax._src.config, "_check_vma", None)  # internal: no public switch exists
  return contextlib.nullcontext() if flag is None else flag(False)
