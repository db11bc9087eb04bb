"""Every bad input of the local references raises at trace time, naming function and argument.

Each case runs under `jax.eval_shape` (see `cases.trace`): arrays are abstract, so an error
here comes from a trace-time check, before anything is compiled.
"""

import re

import jax.numpy as jnp
import numpy as np
import pytest
from cases import trace

import moe_shard as ms

T, D, F, E, K = 5, 4, 3, 6, 2
FNS = [ms.moe_masked_scan, ms.moe_ragged_dot]


def _f32(*shape):
  return np.zeros(shape, np.float32)


def _swiglu(e_gate=E, e_up=E, e_down=E):
  return ms.SwiGLU(_f32(e_gate, D, F), _f32(e_up, D, F), _f32(e_down, F, D))


def _good():
  return dict(
    x_TD=_f32(T, D), w=_f32(E, D, F), experts=np.zeros((T, K), np.int32), weights=_f32(T, K)
  )


# (id, overrides of the good arguments, error type, message after "<fn>: ")
CASES = [
  ("x_1d", dict(x_TD=_f32(D)), ValueError, "x must be 2-D (got shape (4,))"),
  ("x_3d", dict(x_TD=_f32(1, T, D)), ValueError, "x must be 2-D (got shape (1, 5, 4))"),
  (
    "x_int",
    dict(x_TD=np.zeros((T, D), np.int32)),
    TypeError,
    "x must have a floating-point dtype (got int32)",
  ),
  ("w_2d", dict(w=_f32(D, F)), ValueError, "w must be 3-D (got shape (4, 3))"),
  ("w_4d", dict(w=_f32(E, 1, D, F)), ValueError, "w must be 3-D (got shape (6, 1, 4, 3))"),
  (
    "w_int",
    dict(w=np.zeros((E, D, F), np.int32)),
    TypeError,
    "w must have a floating-point dtype (got int32)",
  ),
  (
    "w_str",
    dict(w="w"),
    TypeError,
    "w must be an f[E, D, F] array or an expert FFN such as SwiGLU (got str)",
  ),
  (
    "w_dict",
    dict(w={"w_EDF": _f32(E, D, F)}),
    TypeError,
    "w must be an f[E, D, F] array or an expert FFN such as SwiGLU (got dict)",
  ),
  (
    "w_none",
    dict(w=None),
    TypeError,
    "w must be an f[E, D, F] array or an expert FFN such as SwiGLU (got NoneType)",
  ),
  (
    "w_D_mismatch",
    dict(w=_f32(E, D + 1, F)),
    ValueError,
    "w's input dimension (5) must equal x's last dimension D (4)",
  ),
  (
    "swiglu_D_mismatch",
    dict(w=ms.SwiGLU(_f32(E, 7, F), _f32(E, 7, F), _f32(E, F, 7))),
    ValueError,
    "w's input dimension (7) must equal x's last dimension D (4)",
  ),
  (
    "swiglu_E_disagree",
    dict(w=_swiglu(e_down=3)),
    ValueError,
    "every leaf of w must have the same number of experts on axis 0 "
    "(got w.gate_EDF: 6, w.up_EDF: 6, w.down_EFD: 3)",
  ),
  (
    "swiglu_E_disagree_up",
    dict(w=_swiglu(e_gate=4, e_up=6, e_down=4)),
    ValueError,
    "every leaf of w must have the same number of experts on axis 0 "
    "(got w.gate_EDF: 4, w.up_EDF: 6, w.down_EFD: 4)",
  ),
  (
    "swiglu_int_leaf",
    dict(w=ms.SwiGLU(_f32(E, D, F), np.zeros((E, D, F), np.int32), _f32(E, F, D))),
    TypeError,
    "w.up_EDF must have a floating-point dtype (got int32)",
  ),
  (
    "swiglu_scalar_leaf",
    dict(w=ms.SwiGLU(_f32(E, D, F), _f32(E, D, F), _f32())),
    ValueError,
    "w.down_EFD must have the expert axis first (got a scalar)",
  ),
  (
    "swiglu_down_shape",
    dict(w=ms.SwiGLU(_f32(E, D, F), _f32(E, D, F), _f32(E, F + 1, D))),
    ValueError,
    f"SwiGLU needs leaves gate_EDF [E, D, F], up_EDF [E, D, F], down_EFD [E, F, D], one "
    f"size per letter (got gate_EDF {(E, D, F)}, up_EDF {(E, D, F)}, "
    f"down_EFD {(E, F + 1, D)})",
  ),
  (
    "swiglu_up_shape",
    dict(w=ms.SwiGLU(_f32(E, D, F), _f32(E, D, F + 1), _f32(E, F, D))),
    ValueError,
    "SwiGLU needs leaves gate_EDF [E, D, F], up_EDF [E, D, F], down_EFD [E, F, D], one size",
  ),
  (
    "experts_float",
    dict(experts=_f32(T, K)),
    TypeError,
    "experts must have an integer dtype (got float32)",
  ),
  (
    "experts_bool",
    dict(experts=np.zeros((T, K), bool)),
    TypeError,
    "experts must have an integer dtype (got bool)",
  ),
  (
    "experts_wrong_T",
    dict(experts=np.zeros((T + 1, K), np.int32), weights=_f32(T + 1, K)),
    ValueError,
    "experts must be int[T] or int[T, K] with T = 5 tokens (got shape (6, 2))",
  ),
  (
    "experts_wrong_T_1d",
    dict(experts=np.zeros((T - 1,), np.int32), weights=None),
    ValueError,
    "experts must be int[T] or int[T, K] with T = 5 tokens (got shape (4,))",
  ),
  (
    "experts_3d",
    dict(experts=np.zeros((T, K, 1), np.int32), weights=_f32(T, K, 1)),
    ValueError,
    "experts must be int[T] or int[T, K] with T = 5 tokens (got shape (5, 2, 1))",
  ),
  (
    "experts_0d",
    dict(experts=np.int32(0), weights=None),
    ValueError,
    "experts must be int[T] or int[T, K] with T = 5 tokens (got shape ())",
  ),
  (
    "experts_k0",
    dict(experts=np.zeros((T, 0), np.int32), weights=_f32(T, 0)),
    ValueError,
    "experts must route each token to at least one expert (got shape (5, 0))",
  ),
  (
    "weights_wrong_K",
    dict(weights=_f32(T, K + 1)),
    ValueError,
    "weights must have the shape of experts (5, 2) (got (5, 3))",
  ),
  (
    "weights_transposed",
    dict(weights=_f32(K, T)),
    ValueError,
    "weights must have the shape of experts (5, 2) (got (2, 5))",
  ),
  (
    "weights_2d_for_top1",
    dict(experts=np.zeros((T,), np.int32), weights=_f32(T, 1)),
    ValueError,
    "weights must have the shape of experts (5,) (got (5, 1))",
  ),
  (
    "weights_int",
    dict(weights=np.ones((T, K), np.int32)),
    TypeError,
    "weights must have a floating-point dtype (got int32)",
  ),
]


def _id(case):
  return (case.values if hasattr(case, "values") else case)[0]


@pytest.mark.parametrize("name, overrides, error, match", CASES, ids=[_id(c) for c in CASES])
@pytest.mark.parametrize("fn", FNS, ids=lambda f: f.__name__)
def test_bad_input_raises_at_trace_time(fn, name, overrides, error, match):
  args = dict(_good(), **overrides)
  with pytest.raises(error, match=re.escape(f"{fn.__name__}: {match}")):
    trace(fn, args["x_TD"], args["w"], args["experts"], args["weights"])


@pytest.mark.parametrize("fn", FNS, ids=lambda f: f.__name__)
@pytest.mark.parametrize("w", [_f32(E, D, F), _swiglu()], ids=["linear", "swiglu"])
def test_good_input_traces(fn, w):
  # The baseline every case above perturbs is itself valid (so each error is the one named).
  args = dict(_good(), w=w)
  out = trace(fn, args["x_TD"], args["w"], args["experts"], args["weights"])
  assert out.shape == (T, F if isinstance(w, np.ndarray) else D)
  assert out.dtype == jnp.float32


def test_ragged_dot_unknown_gmm_impl():
  args = _good()
  with pytest.raises(
    ValueError,
    match=re.escape(
      "grouped_matmul: impl must be one of ('auto', 'megablox', 'mosaic_gpu', 'ragged_dot', 'tiled', 'tokamax') (got 'dense')"
    ),
  ):
    trace(
      ms.moe_ragged_dot, args["x_TD"], args["w"], args["experts"], args["weights"], gmm_impl="dense"
    )
