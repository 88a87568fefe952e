"""Delayed scaling: each float8 tensor's scale chosen from the absolute maxima of earlier steps.

Current scaling (`_float8.quantize`) reads a tensor twice before its GEMM: once for its absolute
maximum, once more for the cast that needs it. With a scale known before the tensor exists, the
kernel that casts it can take the maximum beside the cast, for the next step (Transformer Engine's
"delayed scaling")::

    k[i, j]   from the largest of history.amax[i, j, :]   (matmul i; j: lhs, rhs, incoming gradient)
    q         = float8(clip(x * 2**k))                       one pass, its amax beside it
    history   = float8_update(history, seen)                 the amaxes seen, newest first

The state is a pytree of arrays (`Float8History`): it checkpoints, shards and survives
``jax.tree.map`` as the optimizer's state does. The maxima seen leave a differentiated function the
one way a backward pass's values can: as the gradient of ``history.seen``, a slot of zeros that each
float8 matmul reads (Flax's float8 layers carry theirs the same way).
"""

from __future__ import annotations

import operator
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax.core import Tracer

from jaxscale import _float8

#: The columns of `Float8History.amax`: each float8 matmul's three tensors.
TENSORS = ("lhs", "rhs", "gradient")


class Float8History(NamedTuple):
  """What delayed scaling knows: the absolute maxima of each float8 matmul's tensors in recent steps.

  Attributes:
    amax: float32 ``[matmuls, 3, length]``: for each float8 matmul of the function (in the order it
      runs them), its left operand's, right operand's and incoming gradient's absolute maxima,
      newest first. A tensor's scale comes from the largest of its row.
    seen: float32 ``[matmuls, 3]``, always zeros: the slot whose gradient is this step's maxima
      (`float8_update` reads it).
    saturated: float32 scalar (so that ``jax.grad`` takes the history whole): how many tensors of
      the last step reached past their scale's range (their largest values were clipped to the
      format's largest); 0 in a run whose tensors grow slower than the history forgets.

  Examples:
    >>> import jax.numpy as jnp, jaxscale
    >>> f = jaxscale.autocast(lambda w, x: jnp.sum(x @ w), "mixed_float8,min_intensity=0", delayed=True)
    >>> history = jaxscale.float8_history(f, jnp.ones((32, 16)), jnp.ones((64, 32)))
    >>> history.matmuls, history.amax.shape, history.seen.shape
    (1, (1, 3, 16), (1, 3))
  """

  amax: jax.Array
  seen: jax.Array
  saturated: jax.Array

  @property
  def matmuls(self) -> int:
    return self.amax.shape[0]


#: How the history is restored from a checkpoint that kept its fields by name (a dict).
RESTORE_HINT = "a dict restored from a checkpoint becomes one again with `jaxscale.Float8History(**restored)`"


def exponents(history: Float8History) -> jax.Array:
  """Each tensor's scale exponent (int32 ``[matmuls, 3]``) from its history."""
  return _float8.delayed_exponents(history.amax)


def new(seen: jax.Array, length: int) -> Float8History:
  """A history of ``length`` steps whose newest holds ``seen`` (``[matmuls, 3]``): a calibration."""
  try:
    steps = operator.index(length) if not isinstance(length, bool) else 0
  except TypeError:
    steps = 0
  if steps < 1:
    raise ValueError(f"A float8 history's `length` is a number of steps, an int of at least 1; got {length!r}.")
  length = steps
  seen = jnp.asarray(seen, jnp.float32)
  amax = jnp.zeros((*seen.shape, length), jnp.float32).at[..., 0].set(seen)
  return Float8History(amax, jnp.zeros_like(seen), jnp.zeros((), jnp.float32))


def float8_update(history: Float8History, seen: Any) -> Float8History:
  """The next history: ``seen``'s maxima in front, the oldest forgotten.

  Args:
    history: the `Float8History` the step was called with.
    seen: the gradient of the function with respect to ``history`` (a `Float8History` whose
      ``seen`` holds the maxima of this call), or, summed over microbatches by hand, their sum
      (at least the largest of them: the scales stay safe, by up to log2 of the count too small).

  A maximum that is not finite (a step whose gradients hold inf or NaN) is not recorded: the
  tensor's row keeps its largest. ``saturated`` counts the tensors whose maximum this step passed
  what their scale held; it is NaN where the two arguments cannot be a history and its gradient
  (``history.seen`` not zeros, as after an optimizer moved it, or ``seen.amax`` not zeros, as when
  they are swapped or the history is passed twice): eagerly, that is a `ValueError`.

  Returns:
    The `Float8History` for the next step.

  Raises:
    TypeError: if either is not a `Float8History`.
    ValueError: if their shapes differ (a history built for another function or other shapes), or,
      called eagerly, if they cannot be a history and its gradient (above).

  Examples:
    >>> import jax, jax.numpy as jnp, jaxscale
    >>> def loss(w, x):
    ...   return jnp.sum(jnp.dot(x, w).astype(jnp.float32))
    >>> f = jaxscale.autocast(loss, "mixed_float8,min_intensity=0", delayed=True)
    >>> w, x = jnp.ones((32, 16)), jnp.full((64, 32), 2.0)
    >>> history = jaxscale.float8_history(f, w, x, length=3)
    >>> seen, grads = jax.grad(f, argnums=(0, 1))(history, w, 1.5 * x)  # x has grown, within the margin
    >>> history = jaxscale.float8_update(history, seen)
    >>> history.amax[0, 0].tolist(), float(history.saturated)  # x's maxima, newest first
    ([3.0, 2.0, 0.0], 0.0)
    >>> seen, grads = jax.grad(f, argnums=(0, 1))(history, w, 4 * x)  # past it: x saturates
    >>> history = jaxscale.float8_update(history, seen)
    >>> history.amax[0, 0].tolist(), float(history.saturated)  # recorded at 16 times its scale's range
    ([112.0, 3.0, 2.0], 1.0)
  """
  for name, value in (("history", history), ("seen", seen)):
    if not isinstance(value, Float8History):
      raise TypeError(
          f"`float8_update`'s `{name}` must be a `jaxscale.Float8History` (`seen`: the gradient with respect "
          f"to the history, e.g. `jax.grad(f, argnums=(0, 1))(history, params, batch)[0]`); got "
          f"{type(value).__name__} ({RESTORE_HINT})."
      )
  if seen.seen.shape != history.seen.shape:
    raise ValueError(
        f"`float8_update` got maxima for {seen.seen.shape[0]} float8 matmuls and a history of "
        f"{history.matmuls}: pass the gradient with respect to this history, of the function it was built for."
    )
  # A history's `seen` is zeros (nothing differentiates it but its own slot's gradient) and a
  # gradient's `amax` is zeros (the matmuls read the window, not differentiably).
  misused = jnp.any(history.seen != 0) | jnp.any(seen.amax != 0)
  if not isinstance(misused, Tracer) and bool(misused):
    raise ValueError(
        "`float8_update(history, seen)` got arguments that cannot be a history and its gradient: "
        + ("the history's `seen` is not zeros (was the history among the parameters an optimizer updates? "
           "keep it apart, and update it with `float8_update` alone)" if bool(jnp.any(history.seen != 0)) else
           "`seen.amax` is not zeros (the arguments swapped, or the history passed as its own gradient?)")
        + ". Pass the history the step was called with, then the gradient with respect to it."
    )
  latest = jnp.asarray(seen.seen, jnp.float32)
  largest = jnp.max(history.amax, axis=-1)
  latest = jnp.where(jnp.isfinite(latest), latest, largest)
  used = exponents(history)
  # Saturated: a maximum whose own exponent is below the one used, i.e. beyond the range it scaled to.
  own = jnp.stack([_float8.scale_exponent(latest[:, j], dtype)
                   for j, dtype in enumerate((_float8.FORWARD, _float8.FORWARD, _float8.BACKWARD))], axis=1)
  saturated = jnp.where(misused, jnp.nan, jnp.sum((own < used) & (latest > 0)).astype(jnp.float32))
  amax = jnp.concatenate([latest[..., None], history.amax[..., :-1]], axis=-1)
  return Float8History(amax, jnp.zeros_like(history.seen), saturated)


def refuse_loss_scale(tree: Any, where: str) -> None:
  """The error for a `Float8History` among what a loss scaler differentiates: its gradient would be
  unscaled (its maxima divided by the scale) and its gradient column would see the scaled gradients."""
  if any(isinstance(x, Float8History) for x in jax.tree.leaves(tree, is_leaf=lambda x: isinstance(x, Float8History))):
    raise TypeError(
        f"{where} got a `jaxscale.Float8History` among the arguments it differentiates: a loss scale would "
        "divide the maxima it records and multiply the gradients it scales. Float8 needs no loss scaling "
        "(`jaxscale.needs_loss_scaling('mixed_float8')` is False): differentiate a delayed-scaling function "
        "with `jax.value_and_grad(f, argnums=(0, 1))`."
    )
