"""Expert computations: what one expert does to the tokens routed to it.

`EXPERTS` is the table of expert FFNs, name -> class (`MoEConfig(expert_type=...)` takes a
name or a class):

    "linear"          Linear(w_EDF, b_EF)             y = x @ w + b
    "swiglu"          SwiGLU(gate, up, down, biases)  y = (silu(x@gate + gb) * (x@up + ub)) @ down + db
    "gelu"            GeluMLP(up, down, biases)       y = gelu(x@up + ub) @ down + db
    "geglu"           GeGLU(gate, up, down, biases)   y = (gelu(x@gate + gb) * (x@up + ub)) @ down + db
    "clamped_swiglu"  ClampedSwiGLU(..., alpha, limit)  gpt-oss's clamped SwiGLU

(GELU is the exact erf form.) Each class is a frozen dataclass pytree whose array fields
have the expert axis first: matrices `[E, in, out]`, each optionally followed by a bias
`[E, out]` (None: no bias); constants such as ClampedSwiGLU's `alpha` are static fields
(`dataclasses.field(metadata=dict(static=True))`), part of the tree structure. A field's
name ends in its shape letters (`gate_EDF`, `down_b_ED`), which `ExpertFFN.param_shapes`
and `ExpertFFN.check_shapes` read.

`__call__(x_MD, matmul)` maps tokens to outputs through a matmul supplied by the dispatch
(`matmuls.py`); the FFN never indexes experts itself, so the same code runs

  * on grouped tokens: `matmul` is a `GroupedMatmul` and the leaves are `[E, ...]`;
  * on one expert: the masked-scan reference passes leaves sliced to `[...]` and
    `dense_matmul`.

`matmul(x_MD, w)` multiplies, accumulating in float32: the dispatches' `GroupedMatmul`
stores the products in the compute dtype (x's), `dense_matmul` in float32, and an FFN's
output is in that dtype. `matmul.add_bias(y_MF, b)` adds to each row the bias of the
expert that row belongs to, and nothing to padding rows (rows past `sum(group_sizes)`),
so a bias never reaches a row that no token sent. An FFN without biases needs only
`matmul(x_MD, w)`. A new FFN is one class (subclass `ExpertFFN`, or give it `d_in`,
`d_out`, `param_shapes` and `__call__`) and, to be named by a string, one `EXPERTS`
entry. A bare `f[E, D, F]` array is accepted wherever an FFN is and means `Linear`. A
matrix field may hold a `quant.QuantizedArray` (values and block scales, frozen), which
the matmuls decode.
"""

from __future__ import annotations

import abc
import dataclasses
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, ClassVar, Self

import jax
import jax.core
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name
from jaxtyping import Array, Float

from moe_shard import _checks
from moe_shard.frozen import stop_gradient
from moe_shard.quant import check_quantized, expand, is_quantized
from moe_shard.remat import MOE_EXPERT_GATE, MOE_EXPERT_OUT, MOE_EXPERT_UP

if TYPE_CHECKING:
  from moe_shard.config import MoEConfig

# Shape letters of a field name's suffix -> the `MoEConfig` field giving that size.
SIZE_FIELDS = {"E": "num_experts", "D": "d_model", "F": "d_ff"}
# What an FFN's `__call__` gets: `dense_matmul`, a `GroupedMatmul`, or (for FFNs without
# biases) any `matmul(x_MD, w)`.
Matmul = Callable[..., Array]


def _affine(matmul, x_MD, w, b, name):
  """`x @ w (+ b)` through the dispatch's matmul, named `name` for remat policies."""
  y_MF = matmul(x_MD, w)
  if b is not None:
    y_MF = matmul.add_bias(y_MF, b)
  return checkpoint_name(y_MF, name)


# --------------------------------------------------------------------------- FFN classes


def _static(default):
  """A static dataclass field: a constant of the FFN, not a leaf."""
  return dataclasses.field(default=default, metadata=dict(static=True))


def _array_fields(obj_or_cls):
  return [f for f in dataclasses.fields(obj_or_cls) if not f.metadata.get("static")]


class ExpertFFN:
  """What the built-in FFN classes share: shapes from field names, and their checks.

  A subclass is a frozen dataclass (registered with `jax.tree_util.register_dataclass`)
  whose array fields end in their shape letters over `SIZE_FIELDS` (E experts, D model, F
  hidden): `w_EDF` is a matrix [E, D, F]; a field that defaults to None is a bias, present
  when `MoEConfig(expert_bias=True)`. `CONFIG_FIELDS` maps static fields to the
  `MoEConfig` fields they take their values from.
  """

  CONFIG_FIELDS: ClassVar[dict[str, str]] = {}

  @classmethod
  def param_shapes(cls, cfg: MoEConfig) -> Self:
    """The FFN of `cfg` with `jax.ShapeDtypeStruct` leaves (in `cfg.param_dtype`).

    `init_moe_params` fills every leaf of rank 3 (a matrix [E, in, out]) with
    normal / sqrt(in) and every leaf of rank 2 (a bias [E, out]) with zeros.
    """
    kw = {}
    for f in _array_fields(cls):
      if f.default is None and not cfg.expert_bias:
        continue
      shape = tuple(getattr(cfg, SIZE_FIELDS[c]) for c in f.name.rsplit("_", 1)[1])
      kw[f.name] = jax.ShapeDtypeStruct(shape, cfg.param_dtype)
    kw.update({name: getattr(cfg, field) for name, field in cls.CONFIG_FIELDS.items()})
    return cls(**kw)

  def check_shapes(self, fn: str) -> None:
    """Raises ValueError unless the leaves' shapes agree with their names' letters."""
    sizes, ok, got = {}, True, []
    for f in _array_fields(self):
      leaf = getattr(self, f.name)
      if leaf is None:
        continue
      letters = f.name.rsplit("_", 1)[1]
      got.append(f"{f.name} {tuple(leaf.shape)}")
      if len(leaf.shape) != len(letters):
        ok = False
        continue
      for c, n in zip(letters, leaf.shape):
        ok &= sizes.setdefault(c, n) == n
    if not ok:
      want = ", ".join(
        f"{f.name} [{', '.join(f.name.rsplit('_', 1)[1])}]"
        for f in _array_fields(self)
        if getattr(self, f.name) is not None
      )
      raise ValueError(
        f"{fn}: {type(self).__name__} needs leaves {want}, one size per letter "
        f"(got {', '.join(got)})"
      )


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Linear(ExpertFFN):
  """One matrix per expert: `y = x @ w_EDF[e] + b_EF[e]`.

  Attributes:
    w_EDF: f[E, D, F].
    b_EF: f[E, F] bias, or None (default).
  """

  w_EDF: Float[Array, "E D F"]
  b_EF: Float[Array, "E F"] | None = None

  @property
  def d_in(self) -> int:
    return self.w_EDF.shape[-2]

  @property
  def d_out(self) -> int:
    return self.w_EDF.shape[-1]

  def __call__(self, x_MD: Float[Array, "M D"], matmul: Matmul) -> Float[Array, "M F"]:
    """Applies the expert to tokens; returns [M, F] (named `MOE_EXPERT_OUT`)."""
    return _affine(matmul, x_MD, self.w_EDF, self.b_EF, MOE_EXPERT_OUT)


@dataclasses.dataclass(frozen=True)
class _GatedFFN(ExpertFFN, abc.ABC):
  """`y = h(x @ gate + gb, x @ up + ub) @ down + db`, `h` (`hidden`) from the subclass.

  Attributes:
    gate_EDF, up_EDF: f[E, D, F].
    down_EFD: f[E, F, D].
    gate_b_EF, up_b_EF: f[E, F] biases, or None (default).
    down_b_ED: f[E, D] bias, or None (default).
  """

  gate_EDF: Float[Array, "E D F"]
  up_EDF: Float[Array, "E D F"]
  down_EFD: Float[Array, "E F D"]
  gate_b_EF: Float[Array, "E F"] | None = None
  up_b_EF: Float[Array, "E F"] | None = None
  down_b_ED: Float[Array, "E D"] | None = None

  @property
  def d_in(self) -> int:
    return self.gate_EDF.shape[-2]

  @property
  def d_out(self) -> int:
    return self.down_EFD.shape[-1]

  @abc.abstractmethod
  def hidden(self, g_MF: Float[Array, "M F"], u_MF: Float[Array, "M F"]) -> Float[Array, "M F"]:
    """The hidden activations h(g, u) from the gate and up pre-activations."""

  def __call__(self, x_MD: Float[Array, "M D"], matmul: Matmul) -> Float[Array, "M D"]:
    """Applies the expert to tokens; returns [M, D].

    The two input matmuls (with their biases) are named `MOE_EXPERT_GATE` and
    `MOE_EXPERT_UP`, the output `MOE_EXPERT_OUT` (`remat.py`).
    """
    g_MF = _affine(matmul, x_MD, self.gate_EDF, self.gate_b_EF, MOE_EXPERT_GATE)
    u_MF = _affine(matmul, x_MD, self.up_EDF, self.up_b_EF, MOE_EXPERT_UP)
    h_MF = self.hidden(g_MF, u_MF)
    return _affine(matmul, h_MF.astype(x_MD.dtype), self.down_EFD, self.down_b_ED, MOE_EXPERT_OUT)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SwiGLU(_GatedFFN):
  """Gated FFN `y = (silu(x @ gate + gb) * (x @ up + ub)) @ down + db` (Shazeer 2020).

  Attributes:
    gate_EDF, up_EDF: f[E, D, F].
    down_EFD: f[E, F, D].
    gate_b_EF, up_b_EF: f[E, F] biases, or None (default).
    down_b_ED: f[E, D] bias, or None (default).
  """

  def hidden(self, g_MF: Float[Array, "M F"], u_MF: Float[Array, "M F"]) -> Float[Array, "M F"]:
    return jax.nn.silu(g_MF) * u_MF


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class GeGLU(_GatedFFN):
  """Gated FFN `y = (gelu(x @ gate + gb) * (x @ up + ub)) @ down + db`, exact (erf) GELU.

  Attributes:
    gate_EDF, up_EDF: f[E, D, F].
    down_EFD: f[E, F, D].
    gate_b_EF, up_b_EF: f[E, F] biases, or None (default).
    down_b_ED: f[E, D] bias, or None (default).
  """

  def hidden(self, g_MF: Float[Array, "M F"], u_MF: Float[Array, "M F"]) -> Float[Array, "M F"]:
    return jax.nn.gelu(g_MF, approximate=False) * u_MF


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class ClampedSwiGLU(_GatedFFN):
  """gpt-oss's clamped SwiGLU:

      g = min(x @ gate + gb, limit);  u = clip(x @ up + ub, -limit, limit)
      y = ((u + 1) * g * sigmoid(alpha * g)) @ down + db

  Attributes:
    gate_EDF, up_EDF: f[E, D, F].
    down_EFD: f[E, F, D].
    gate_b_EF, up_b_EF: f[E, F] biases, or None (default).
    down_b_ED: f[E, D] bias, or None (default).
    alpha: the sigmoid's slope (static; default 1.702, `MoEConfig.swiglu_alpha`).
    limit: the clamp (static; default 7.0, `MoEConfig.swiglu_limit`).
  """

  CONFIG_FIELDS: ClassVar[dict[str, str]] = dict(alpha="swiglu_alpha", limit="swiglu_limit")

  alpha: float = _static(1.702)
  limit: float = _static(7.0)

  def hidden(self, g_MF: Float[Array, "M F"], u_MF: Float[Array, "M F"]) -> Float[Array, "M F"]:
    g_MF = jnp.minimum(g_MF, self.limit)
    u_MF = jnp.clip(u_MF, -self.limit, self.limit)
    return (u_MF + 1.0) * g_MF * jax.nn.sigmoid(self.alpha * g_MF)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class GeluMLP(ExpertFFN):
  """Two-matrix FFN `y = gelu(x @ up + ub) @ down + db`, exact (erf) GELU.

  Attributes:
    up_EDF: f[E, D, F].
    down_EFD: f[E, F, D].
    up_b_EF: f[E, F] bias, or None (default).
    down_b_ED: f[E, D] bias, or None (default).
  """

  up_EDF: Float[Array, "E D F"]
  down_EFD: Float[Array, "E F D"]
  up_b_EF: Float[Array, "E F"] | None = None
  down_b_ED: Float[Array, "E D"] | None = None

  @property
  def d_in(self) -> int:
    return self.up_EDF.shape[-2]

  @property
  def d_out(self) -> int:
    return self.down_EFD.shape[-1]

  def __call__(self, x_MD: Float[Array, "M D"], matmul: Matmul) -> Float[Array, "M D"]:
    """Applies the expert to tokens; returns [M, D] (`MOE_EXPERT_UP`, `MOE_EXPERT_OUT`)."""
    u_MF = _affine(matmul, x_MD, self.up_EDF, self.up_b_EF, MOE_EXPERT_UP)
    h_MF = jax.nn.gelu(u_MF, approximate=False)
    return _affine(matmul, h_MF.astype(x_MD.dtype), self.down_EFD, self.down_b_ED, MOE_EXPERT_OUT)


def shared_experts(shared: Any, x_TD: Float[Array, "T D"]) -> Float[Array, "T D"]:
  """Sums the shared experts over every token: f32[T, D].

  The leaves of `shared` (a `SwiGLU`) have the shared-expert axis first (written `e` in the
  einsums): every token goes through every shared expert, and the down projection sums
  over them. A matrix may be a `QuantizedArray` (frozen: its gradient stopped), dequantized
  whole to x's dtype: the shared experts are dense matmuls over every token, which XLA
  fuses the decode into.
  """

  def matmul(x, w):  # [T, D] @ [e, D, F] -> [T, e, F], then [T, e, F] @ [e, F, D] -> [T, D]
    spec = "td,edf->tef" if x.ndim == 2 else "tef,efd->td"
    w = stop_gradient(w).dequantize(x_TD.dtype) if is_quantized(w) else w.astype(x_TD.dtype)
    return jnp.einsum(spec, x, w, preferred_element_type=jnp.float32)

  return shared(x_TD, matmul)


def split_dims(fn: str, ffn: Any) -> tuple[Any, str]:
  """The shape letters of an FFN's array leaves, read from their field names.

  What splitting the FFN over mesh axes needs: the letter E (expert), D (model) or F
  (hidden) of each dimension of each leaf (`expert_tensor_axis` splits every F,
  `expert_fsdp_axis` the last dimension of every matrix).

  Args:
    fn: name of the calling function, for error messages.
    ffn: an FFN (arrays or `ShapeDtypeStruct`s), a dataclass whose array fields end in one
      letter per dimension (`gate_EDF`).

  Returns:
    (letters, output): `letters` has the tree structure of `ffn`, a str per array leaf
    ("EDF"; a `QuantizedArray`'s values and scales both get its matrix's letters); `output` is the letter of the FFN's output dimension, the last letter of its
    last matrix (rank-3) field ("D" for the gated FFNs, "F" for `Linear`).

  Raises:
    ValueError: `ffn` is not such a dataclass.
  """
  is_instance = dataclasses.is_dataclass(ffn) and not isinstance(ffn, type)
  fields = _array_fields(ffn) if is_instance else []
  letters, matrices = {}, []
  for f in fields:
    leaf = getattr(ffn, f.name)
    if leaf is None:
      continue
    suffix = f.name.rsplit("_", 1)[-1]
    if "_" not in f.name or len(suffix) != len(leaf.shape) or set(suffix) - set(SIZE_FIELDS):
      raise ValueError(
        f"{fn}: expert_tensor_axis and expert_fsdp_axis split an FFN's leaves by the "
        f"letters their field names end in (one of E, D, F per dimension, as `gate_EDF`); "
        f"{type(ffn).__name__}.{f.name} of shape {tuple(leaf.shape)} has none"
      )
    letters[f.name] = suffix
    if len(suffix) == 3:
      matrices.append(suffix)
  if not fields or not matrices:
    raise ValueError(
      f"{fn}: expert_tensor_axis and expert_fsdp_axis need an FFN dataclass with matrix "
      f"fields named by their dimensions, such as SwiGLU (got {type(ffn).__name__})"
    )
  tree: Any = ffn  # a dataclass instance (checked above)
  return expand(dataclasses.replace(tree, **letters), ffn), matrices[-1][-1]


EXPERTS = {
  "linear": Linear,
  "swiglu": SwiGLU,
  "gelu": GeluMLP,
  "geglu": GeGLU,
  "clamped_swiglu": ClampedSwiGLU,
}


def expert_class(fn: str, expert_type: str | type) -> type:
  """Returns the FFN class of an `EXPERTS` name or of a class (checked to be one).

  Raises:
    ValueError: an unknown name.
    TypeError: neither a str nor a class with `param_shapes`, `d_in`, `d_out`, `__call__`.
  """
  if isinstance(expert_type, str):
    if expert_type in EXPERTS:
      return EXPERTS[expert_type]
    raise ValueError(
      f"{fn}: expert_type must be one of {tuple(EXPERTS)} or an expert FFN class "
      f"(got {expert_type!r})"
    )
  needs = ("param_shapes", "d_in", "d_out", "__call__")
  if not isinstance(expert_type, type) or not all(hasattr(expert_type, a) for a in needs):
    raise TypeError(
      f"{fn}: expert_type must be a name of EXPERTS or an expert FFN class with "
      f"{', '.join(needs)} (got {expert_type!r})"
    )
  return expert_type


def as_ffn(fn: str, w: Any) -> tuple[Any, int]:
  """Returns `w` as an expert FFN and its number of experts, checking every leaf agrees.

  Args:
    fn: name of the calling function, for error messages.
    w: f[E, D, F] array (taken as `Linear`) or an expert-FFN pytree.

  Returns:
    (ffn, E).

  Raises:
    TypeError: `w` is neither a float array nor an FFN with `d_in`, `d_out`, `__call__`.
    ValueError: a 3-D array was expected, or the leaves disagree on E.
  """
  if isinstance(w, (jax.Array, jax.core.Tracer)) or hasattr(w, "__array__"):
    w = Linear(_checks.float_array(fn, "w", w, ndim=3))
  if not callable(w) or not all(hasattr(type(w), a) for a in ("d_in", "d_out")):
    raise TypeError(
      f"{fn}: w must be an f[E, D, F] array or an expert FFN such as SwiGLU "
      f"(got {type(w).__name__})"
    )
  sizes = {}
  for path, leaf in jax.tree_util.tree_leaves_with_path(w, is_leaf=is_quantized):
    name = "w" + jax.tree_util.keystr(path)
    if is_quantized(leaf):  # integer or FP8 codes and their scales
      check_quantized(fn, name, leaf)
    else:
      leaf = _checks.float_array(fn, name, leaf)
    if leaf.ndim < 1:
      raise ValueError(f"{fn}: {name} must have the expert axis first (got a scalar)")
    sizes[name] = leaf.shape[0]
  if not sizes:
    raise ValueError(f"{fn}: w must have at least one array leaf (got {w!r})")
  if len(set(sizes.values())) != 1:
    listed = ", ".join(f"{k}: {v}" for k, v in sizes.items())
    raise ValueError(
      f"{fn}: every leaf of w must have the same number of experts on axis 0 (got {listed})"
    )
  check_shapes = getattr(w, "check_shapes", None)
  if check_shapes is not None:
    check_shapes(fn)
  return w, next(iter(sizes.values()))
