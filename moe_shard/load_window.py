"""`LoadWindow`: the expert loads of the last steps per layer (`aux["expert_load"]`), the
load to plan a placement from (`plan_placement(window.load(), ...)`)."""

from __future__ import annotations

import collections
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from moe_shard import _checks
from moe_shard.placement import concrete


class LoadWindow:
  """The expert loads of the last `window` steps, per layer: the load to plan from.

  `record(aux["expert_load"])` after each step (an i32[E] of one layer or [L, E] of a
  stack, device arrays kept as they are: nothing is copied to the host until `load()`);
  `load()` sums the window, oldest steps dropped. vLLM counts the same way (a window of
  1000 steps, re-planned every 3000). Loads are counts or weights: integer loads sum as
  int64, float ones (e.g. a router's mean probabilities) as float64; none may be negative
  or non-finite.

  Args:
    num_experts: E.
    num_layers: L, or None (default) for one layer.
    window: steps kept (default 1000).
  """

  def __init__(self, num_experts: int, num_layers: int | None = None, window: int = 1000):
    fn = "LoadWindow"
    self.num_experts = _checks.int_field(fn, "num_experts", num_experts, 1)
    self.num_layers = (
      None if num_layers is None else _checks.int_field(fn, "num_layers", num_layers, 1)
    )
    self.window = _checks.int_field(fn, "window", window, 1)
    self._steps: collections.deque = collections.deque(maxlen=self.window)

  @property
  def shape(self) -> tuple[int, ...]:
    return (self.num_experts,) if self.num_layers is None else (self.num_layers, self.num_experts)

  def record(self, expert_load: Any) -> None:
    """Adds one step's load (i32[E], or [L, E] with layers; or floats).

    Raises:
      TypeError: a load that is not a real-number array, or one traced inside a
        transformation (`jax.jit`, `lax.scan`): the window runs on the host, after the
        step; return the load from the step and record it there.
      ValueError: the wrong shape, or (checked here for host arrays, at `load()` for
        device arrays) a negative or non-finite value.
    """
    fn = "LoadWindow.record"
    if not concrete(expert_load):
      raise TypeError(
        f"{fn}: expert_load must be a value, not traced: the window runs on the host, "
        f"outside jax.jit (return aux['expert_load'] from the step and record it after; "
        f"got a tracer of {jax.typeof(expert_load).str_short()})"
      )
    shape = tuple(np.shape(expert_load))
    if shape != self.shape:
      raise ValueError(f"{fn}: expert_load must have shape {self.shape} (got {shape})")
    dtype = getattr(expert_load, "dtype", None)
    dtype = np.asarray(expert_load).dtype if dtype is None else np.dtype(dtype)
    if not (jnp.issubdtype(dtype, jnp.integer) or jnp.issubdtype(dtype, jnp.floating)):
      raise TypeError(f"{fn}: expert_load must hold integers or floats (got {dtype})")
    if not isinstance(expert_load, jax.Array):  # host data: checked now, for free
      # Its index once appended (the oldest step leaves a full window first).
      _check_load(fn, np.asarray(expert_load), min(len(self._steps), self.window - 1))
    self._steps.append(expert_load)

  def __len__(self) -> int:
    return len(self._steps)

  def load(self) -> np.ndarray:
    """int64[E] (or [L, E]): the loads of the steps in the window, summed (zeros if none);
    float64 when any step's load is floats.

    Raises:
      ValueError: a step's load holds a negative or non-finite value (named by its step).
    """
    steps = [np.asarray(step) for step in self._steps]
    floats = any(jnp.issubdtype(step.dtype, jnp.floating) for step in steps)  # bf16 too
    total = np.zeros(self.shape, np.float64 if floats else np.int64)
    for i, step in enumerate(steps):
      _check_load("LoadWindow.load", step, i)
      total += step.astype(total.dtype)
    return total


def _check_load(fn, load, step):
  if jnp.issubdtype(load.dtype, jnp.floating):
    load = load.astype(np.float64)
  bad = ~np.isfinite(load) | (load < 0) if load.dtype == np.float64 else load < 0
  if np.any(bad):
    value = load[np.unravel_index(int(np.argmax(bad)), load.shape)]
    raise ValueError(
      f"{fn}: a load must be finite and >= 0 (step {step} of the window holds {value})"
    )
