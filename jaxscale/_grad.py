"""``jax.value_and_grad`` for a scaled loss."""

from __future__ import annotations

from typing import Any, Callable, Sequence

import jax

from jaxscale import _scaler


def value_and_grad(
    fun: Callable[..., Any],
    argnums: int | Sequence[int] = 0,
    has_aux: bool = False,
    *,
    axis_name: Any = None,
) -> Callable[..., tuple[Any, Any, jax.Array]]:
  """Like ``jax.value_and_grad``, differentiating the scaled loss.

  The returned function takes the scaler state first, then ``fun``'s
  arguments, and returns ``(value, grads, finite)``: ``fun``'s own (unscaled)
  value (``(loss, aux)`` with ``has_aux``), the unscaled gradients, and the
  finite flag of :func:`unscale_and_check`. Pass ``finite`` on to
  :func:`update`, or to the Optax wrapper as
  ``tx.update(grads, opt_state, params, finite=finite)``.

  Args:
    fun: the loss function; returns a scalar loss, or ``(loss, aux)`` with
      ``has_aux``.
    argnums: as in ``jax.grad``: which positional argument(s) to
      differentiate with respect to.
    has_aux: as in ``jax.grad``.
    axis_name: inside ``shard_map``/``pmap``, the axis over which every device
      must agree on the finite flag.

  Returns:
    A function taking the scaler state, then ``fun``'s arguments, and
    returning ``(value, grads, finite)``.

  Examples:
    >>> import jax.numpy as jnp, jaxscale
    >>> scaler = jaxscale.init(init_scale=1024.0)
    >>> loss, grads, finite = jaxscale.value_and_grad(lambda x: x ** 2)(scaler, 3.0)
    >>> float(loss), float(grads), bool(finite)
    (9.0, 6.0, True)
  """
  return value_and_grad_with(jax.grad, fun, argnums, has_aux, axis_name)


def value_and_grad_with(grad, fun, argnums, has_aux, axis_name):
  """:func:`value_and_grad` built on ``grad`` (``jax.grad``, ``nnx.grad``, ...)."""

  def wrapped(state, *args, **kwargs):
    def scaled_fun(*args, **kwargs):
      out = fun(*args, **kwargs)
      return _scaler.scale(state, out[0] if has_aux else out), out

    grads, value = grad(scaled_fun, argnums=argnums, has_aux=True)(*args, **kwargs)
    grads, finite = _scaler.unscale_and_check(state, grads, axis_name=axis_name)
    return value, grads, finite

  return wrapped
