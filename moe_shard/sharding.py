"""Placing arrays on a mesh, mesh checks, the mesh in scope, and the Explicit/Auto helpers;
the carry and the loop of a data-dependent loop inside shard_map (`zeros_varying`,
`fori_while`).

Mesh axes: experts are split over `EXPERT` (or over a tuple of axes, e.g. `(DATA, EXPERT)`:
their product, in the order given); tokens over every mesh axis (`EXPERT` and, when present,
`DATA` or any other). `jax.make_mesh` defaults to `AxisType.Explicit`, under which JAX
refuses to guess shardings for sort and scatter; `auto` runs such a stage with the Explicit
axes switched to Auto, and `like` puts a result back on the sharding of a reference.

The mesh argument of every public function may be a `jax.sharding.Mesh`, an `AbstractMesh`
(enough wherever nothing is placed on devices: under `jax.jit` with sharded inputs, under
`jax.eval_shape`) or None, meaning the mesh in scope (`jax.set_mesh(mesh)`):
`resolve_mesh`. Nothing here issues a collective.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, Literal, overload

import jax
import jax._src.core
import jax._src.mesh
import jax.core
import jax.numpy as jnp
import numpy as np
from jax.sharding import AbstractMesh, AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from moe_shard import _checks

EXPERT = "expert"
DATA = "data"


def expert_axes(expert_axis):
  """The mesh axes experts are split over, as a tuple: `"expert"` -> `("expert",)`."""
  return (expert_axis,) if isinstance(expert_axis, str) else tuple(expert_axis)


def axis_size(mesh, expert_axis):
  """N, the devices experts are split over: the product of the sizes of `expert_axis`
  (a name or a tuple of names); an axis the mesh lacks counts 1."""
  return math.prod(mesh.shape.get(a, 1) for a in expert_axes(expert_axis))


def mesh_in_scope() -> Mesh | AbstractMesh | None:
  """The mesh of `jax.set_mesh` (or `jax.sharding.use_abstract_mesh`), or None.

  The concrete `Mesh` when there is one (`jax.set_mesh`, inside or outside jit), else the
  `AbstractMesh` in scope, else None.
  """
  concrete = jax._src.mesh.get_concrete_mesh()  # JAX 0.10: no public getter usable in jit
  if concrete is not None and not concrete.empty:
    return concrete
  abstract = jax.sharding.get_abstract_mesh()
  return None if abstract.empty else abstract


def check_mesh(fn, mesh, expert_axis, num_experts=None, *, optional=False, what="mesh"):
  """Raises unless `mesh` is a (possibly abstract) mesh with `expert_axis`, whose size
  divides `num_experts`.

  Args:
    fn: name of the calling function, for error messages.
    mesh: the mesh argument.
    expert_axis: the axis (or tuple of axes) experts are split over.
    num_experts: E, or None not to check divisibility.
    optional: whether None is allowed (it is then returned as is).
    what: how the messages name the mesh (default "mesh").
  """
  if mesh is None and optional:
    return
  if not isinstance(mesh, (Mesh, AbstractMesh)):
    kinds = (
      "a jax.sharding.Mesh, an AbstractMesh or None"
      if optional
      else ("a jax.sharding.Mesh or an AbstractMesh")
    )
    raise TypeError(f"{fn}: {what} must be {kinds} (got {type(mesh).__name__})")
  missing = [a for a in expert_axes(expert_axis) if a not in mesh.axis_names]
  if missing:
    raise ValueError(
      f"{fn}: {what} must have the expert axis {expert_axis!r} (got axes {tuple(mesh.axis_names)})"
    )
  if num_experts is not None:
    _checks.divisible(
      fn, "num_experts", num_experts, f"the {expert_axis!r} axis size", axis_size(mesh, expert_axis)
    )


def split_axis_size(fn, mesh, field, axis):
  """The size of `axis`, the value of the `MoEConfig` field `field` (`expert_tensor_axis`,
  `expert_fsdp_axis`); raises ValueError unless it is an axis of `mesh`."""
  if axis not in mesh.axis_names:
    raise ValueError(
      f"{fn}: {field} must be an axis of the mesh (got {axis!r}; mesh axes "
      f"{tuple(mesh.axis_names)})"
    )
  return mesh.shape[axis]


@overload
def resolve_mesh(
  fn: str,
  mesh: Mesh | AbstractMesh | None,
  expert_axis: str | tuple[str, ...],
  num_experts: int | None = None,
  *,
  required: Literal[True],
) -> Mesh | AbstractMesh: ...
@overload
def resolve_mesh(
  fn: str,
  mesh: Mesh | AbstractMesh | None,
  expert_axis: str | tuple[str, ...],
  num_experts: int | None = None,
  *,
  required: bool,
) -> Mesh | AbstractMesh | None: ...
def resolve_mesh(fn, mesh, expert_axis, num_experts=None, *, required):
  """The mesh a call runs on: `mesh`, or for None the mesh in scope; checked.

  Args:
    fn: name of the calling function, for error messages.
    mesh: a `Mesh`, an `AbstractMesh` (replaced by the concrete mesh in scope when that is
      its concrete form) or None.
    expert_axis: the axis (or tuple of axes) experts are split over.
    num_experts: E, or None not to check divisibility.
    required: whether the call needs a mesh. When True, no mesh at all, or a mesh in scope
      without the expert axis, raises. When False, a mesh in scope without the expert axis
      is not used (None is returned): the call runs without expert parallelism.

  Returns:
    A `Mesh`, an `AbstractMesh`, or None (only when not `required`).

  Raises:
    TypeError, ValueError: as `check_mesh`, or no mesh where one is required.
  """
  if mesh is not None:
    scope = mesh_in_scope()
    if isinstance(mesh, AbstractMesh) and isinstance(scope, Mesh) and scope.abstract_mesh == mesh:
      mesh = scope
    check_mesh(fn, mesh, expert_axis, num_experts, optional=True)
    return mesh
  scope = mesh_in_scope()
  if scope is None:
    if required:
      raise ValueError(
        f"{fn}: mesh must be given, or a mesh be in scope "
        f"(`with jax.set_mesh(mesh):`) (got mesh=None and no mesh in scope)"
      )
    return None
  if not required and any(a not in scope.axis_names for a in expert_axes(expert_axis)):
    return None
  check_mesh(fn, scope, expert_axis, num_experts, what="the mesh in scope (jax.set_mesh)")
  return scope


def tracing():
  """Whether JAX is tracing (under jit, eval_shape, grad...): JAX 0.10 has no public test."""
  return not jax._src.core.trace_state_clean()


def is_concrete(mesh):
  """Whether `mesh` has devices (a `Mesh`), as opposed to an `AbstractMesh`."""
  return isinstance(mesh, Mesh)


def token_spec(mesh):
  """Tokens split over every mesh axis: `P((all axes))`."""
  return P(tuple(mesh.axis_names))


def place(a, mesh, spec):
  """Puts `a` on the mesh with `spec`, inside or outside jit, for Auto or Explicit axes.

  On a mesh spanning processes, data this process holds whole (NumPy, or a jax.Array on its
  own devices) is taken to be the same global array in every process. An `AbstractMesh`
  places traced arrays (under jit) only.
  """
  sharding = NamedSharding(mesh, spec)
  if not isinstance(a, jax.core.Tracer) and is_concrete(mesh):
    if not sharding.is_fully_addressable and getattr(a, "is_fully_addressable", True):
      # Each process copies only its own shards; device_put would first all-gather the
      # whole array from every process to check that they agree.
      host = np.asarray(a)
      dtype = jax.dtypes.canonicalize_dtype(host.dtype)
      return jax.make_array_from_callback(
        host.shape, sharding, lambda idx: host[idx].astype(dtype), dtype=dtype
      )
    return jax.device_put(a, sharding)
  # Traced, or an AbstractMesh (no devices to put on: the array's own are used).
  a = jnp.asarray(a)
  if all(t == AxisType.Explicit for t in mesh.axis_types):
    return jax.sharding.reshard(a, sharding)
  return jax.lax.with_sharding_constraint(a, sharding)


def trim(y_TF, mesh, tokens):
  """Keeps the first `tokens` rows (drops padding tokens; the result is replicated when
  they do not divide the mesh)."""
  if y_TF.shape[0] == tokens:
    return y_TF
  if all(t == AxisType.Explicit for t in mesh.axis_types):
    y_TF = place(y_TF, mesh, P())
  return y_TF[:tokens]


def vary_over(tree, axes):
  """Casts arrays replicated over `axes` to varying there (`lax.pcast(to="varying")`).

  What the cast does depends on the enclosing shard_map's `check_vma`. With the check on,
  it changes the arrays' type to varying over `axes` and its transpose sums their
  cotangents over `axes` (a psum). With the check off, as in the dispatch bodies
  (`parallel.common.shard_map`), `pcast` returns its input as it is: the cast changes
  nothing, and the sum of the gradients over `axes` comes from shard_map's transpose of an
  input whose spec leaves `axes` out (a replicated input's cotangent is summed over the axes
  it is replicated on).
  """
  return jax.tree.map(lambda a: jax.lax.pcast(a, axes, to="varying"), tree) if axes else tree


def explicit_mesh(ref):
  """The abstract mesh of `ref` and its Explicit axes, or (None, ()) when there are none."""
  mesh = getattr(getattr(jax.typeof(ref), "sharding", None), "mesh", None)
  if mesh is None or not mesh.axis_names:
    return None, ()
  return mesh, tuple(n for n, t in zip(mesh.axis_names, mesh.axis_types) if t == AxisType.Explicit)


def auto(fn: Callable[..., Any], ref: Any, out_specs: Callable[[P], Any]) -> Callable[..., Any]:
  """`fn` with the Explicit axes of `ref`'s mesh switched to Auto (XLA picks shardings).

  `out_specs(ref_spec)` gives the `PartitionSpec` pytree of fn's outputs. Without Explicit
  axes, `fn` itself.
  """
  mesh, axes = explicit_mesh(ref)
  if mesh is None or not axes:
    return fn

  def wrapped(*args):
    with jax.sharding.use_abstract_mesh(mesh):
      out = out_specs(jax.typeof(ref).sharding.spec)
      return jax.sharding.auto_axes(fn, axes=axes, out_sharding=out)(*args)

  return wrapped


def like(y, ref):
  """Reshards `y` to the sharding of `ref` when both live on an Explicit mesh."""
  mesh, axes = explicit_mesh(ref)
  if mesh is None or not axes:
    return y
  want = jax.typeof(ref).sharding
  if jax.typeof(y).sharding.spec == want.spec:
    return y
  with jax.sharding.use_abstract_mesh(mesh):
    return jax.sharding.reshard(y, want.spec)


def match_vma(*arrays):
  """Makes the arrays vary over the same mesh axes (the union of theirs) inside shard_map.

  An operand that is the same on every device (e.g. replicated weights) next to one that
  varies (the rows) is cast to varying here, before the custom_vjp: its cotangent is then
  varying like the bwd rule's, and JAX transposes the cast into the psum. Outside shard_map
  this does nothing.
  """
  vmas = [varying_axes(a) for a in arrays]
  union = frozenset().union(*vmas)
  return tuple(
    a if v == union else jax.lax.pcast(a, tuple(sorted(union - v)), to="varying")
    for a, v in zip(arrays, vmas)
  )


def varying_axes(a):
  """The mesh axes `a` varies over (JAX 0.10: `manual_axis_type.varying`; older: `vma`)."""
  aval = jax.typeof(a)
  mat = getattr(aval, "manual_axis_type", None)
  if mat is not None:
    return frozenset(mat.varying)
  return frozenset(getattr(aval, "vma", frozenset()))


def zeros_varying(shape, dtype, *refs):
  """Zeros with the mesh-axis variance of `refs` (a loop carry inside shard_map)."""
  z = jnp.zeros_like(refs[0], shape=shape, dtype=dtype)
  for r in refs[1:]:
    z = z + jnp.zeros_like(r, shape=(), dtype=dtype)
  return z


def fori_while(lower, upper, body, init):
  """`lax.fori_loop(lower, upper, body, init)` for a traced `upper`, as a plain `while_loop`.

  Args:
    lower: the first index, a Python int.
    upper: i32[] one past the last index (data-dependent: a count of rounds or tiles).
    body: body(i, carry) -> carry, i an i32[] index.
    init: the carry before the first step.

  Returns:
    The carry after body(i, carry) for i = lower .. upper - 1 (`init` when upper <= lower).
  """

  def cond(c):
    return c[0] < upper

  def step(c):
    return c[0] + 1, body(c[0], c[1])

  return jax.lax.while_loop(cond, step, (jnp.full((), lower, jnp.int32), init))[1]


def _token_sharding(mesh, tokens):
  """Where a layer's [T, ...] tokens go on `mesh`: split over every axis when they divide
  it, else replicated."""
  return NamedSharding(mesh, token_spec(mesh) if tokens % mesh.size == 0 else P())


def flatten_tokens(x_BSD, mesh):
  """`x_BSD` as `x_TD` (T = B * S); on an Explicit mesh, split over the mesh's axes.

  An Explicit-axis reshape must be told its output sharding whenever the merged sharding
  cannot be written on [T] (e.g. B = 4 split over a mesh of 8): it goes to
  `_token_sharding`, so any B and S work on both axis types.
  """
  B, S, D = x_BSD.shape
  if mesh is None or AxisType.Explicit not in mesh.axis_types:
    return x_BSD.reshape(B * S, D)
  if not explicit_mesh(x_BSD)[1]:  # not on the mesh yet: merge, then place
    return place(x_BSD.reshape(B * S, D), mesh, _token_sharding(mesh, B * S).spec)
  return jax.lax.reshape(x_BSD, (B * S, D), out_sharding=_token_sharding(mesh, B * S))


def unflatten_tokens(y_TD, x_BSD, mesh):
  """`y_TD` back to the shape of `x_BSD`, with its sharding on an Explicit mesh."""
  B, S, _ = x_BSD.shape
  shape = (B, S, y_TD.shape[-1])
  if mesh is None or AxisType.Explicit not in mesh.axis_types:
    return y_TD.reshape(shape)
  if explicit_mesh(x_BSD)[1]:
    return jax.lax.reshape(
      y_TD, shape, out_sharding=NamedSharding(mesh, jax.typeof(x_BSD).sharding.spec)
    )
  # x was not on the mesh: its batch split over the mesh when it divides, else whole.
  y_TD = place(y_TD, mesh, token_spec(mesh) if B % mesh.size == 0 else P())
  return y_TD.reshape(shape)


def expert_positions(mesh, expert_axis):
  """np.int32[mesh.size]: the position on the expert axis of the g-th device of the mesh in
  the order tokens are split over it (`token_spec`: every axis, row-major); for a tuple of
  expert axes, the linear position over them in the order given."""
  shape = tuple(mesh.shape[a] for a in mesh.axis_names)
  coords = np.unravel_index(np.arange(math.prod(shape)), shape)
  position = np.zeros(math.prod(shape), np.int64)
  for a in expert_axes(expert_axis):
    position = position * mesh.shape[a] + coords[list(mesh.axis_names).index(a)]
  return position.astype(np.int32)


def data_rows(mesh, expert_axis):
  """np.int32[mesh.size]: the row of the g-th device (`expert_positions`' order): the linear
  index over the mesh's other axes. The devices of one row, one per expert-axis position,
  are those a dispatch exchanges among."""
  shape = tuple(mesh.shape[a] for a in mesh.axis_names)
  coords = np.unravel_index(np.arange(math.prod(shape)), shape)
  row = np.zeros(math.prod(shape), np.int64)
  for i, a in enumerate(mesh.axis_names):
    if a not in expert_axes(expert_axis):
      row = row * mesh.shape[a] + coords[i]
  return row.astype(np.int32)
