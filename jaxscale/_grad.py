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

  Examples:
    >>> import jax.numpy as jnp, jaxscale
    >>> scaler = jaxscale.init(init_scale=1024.0)
    >>> loss, grads, finite = jaxscale.value_and_grad(lambda x: x ** 2)(scaler, 3.0)
    >>> float(loss), float(grads), bool(finite)
    (9.0, 6.0, True)
  """

  def scaled_fun(state, *args, **kwargs):
    out = fun(*args, **kwargs)
    loss = out[0] if has_aux else out
    return _scaler.scale(state, loss), out

  def wrapped(state, *args, **kwargs):
    grad_fn = jax.grad(
        lambda *a, **k: scaled_fun(state, *a, **k),
        argnums=argnums,
        has_aux=True,
    )
    grads, value = grad_fn(*args, **kwargs)
    grads, finite = _scaler.unscale_and_check(state, grads, axis_name=axis_name)
    return value, grads, finite

  return wrapped
