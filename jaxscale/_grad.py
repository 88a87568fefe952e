"""``jax.value_and_grad`` for a scaled loss."""

from __future__ import annotations

from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp

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

  Gradients must not be float16: unscaled in float16, the small true
  gradients that only the scale carried would flush to zero again. float16
  parameters are refused with a ValueError that says what to do instead
  (:func:`jaxscale.master_weights`); bfloat16 and float32 ones are fine.

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
    _scaler.require_state(
        state, "value_and_grad(fun)", " The scaler state comes first: `value_and_grad(fun)(scaler, *args)`."
    )
    def scaled_fun(*args, **kwargs):
      out = fun(*args, **kwargs)
      if has_aux and not (isinstance(out, (tuple, list)) and len(out) == 2):
        # `out[0]` of an array would differentiate its first element alone.
        shape = getattr(out, "shape", None)
        what = f"an array of shape {shape}" if shape is not None else f"a {type(out).__name__}"
        raise TypeError(
            f"With `has_aux=True`, `fun` must return a pair `(loss, aux)`, as for `jax.grad`; it returned {what}."
        )
      return _scaler.scale(state, out[0] if has_aux else out), out

    grads, value = grad(scaled_fun, argnums=argnums, has_aux=True)(*args, **kwargs)
    _refuse_float16(grads)
    grads, finite = _scaler.unscale_and_check(state, grads, axis_name=axis_name)
    return value, grads, finite

  return wrapped


def _refuse_float16(grads: Any) -> None:
  """Raises for float16 gradients, which cannot be unscaled in their own dtype without loss."""
  paths = [jax.tree_util.keystr(path) for path, g in jax.tree_util.tree_leaves_with_path(grads)
           if jnp.result_type(g) == jnp.float16]
  if paths:
    raise ValueError(
        f"`jaxscale.value_and_grad` got float16 gradients (at {', '.join(paths[:3])}"
        f"{', ...' if len(paths) > 3 else ''}), of float16 parameters: unscaled in float16, every "
        "true gradient below 2**-24 would flush to zero again (torch refuses to unscale them too). "
        "Keep float32 parameters and compute in float16 (Flax: `dtype=jnp.float16, "
        "param_dtype=jnp.float32`); or, to store float16 parameters, take `jax.grad` of "
        "`jaxscale.scale(scaler, loss)` and update with "
        "`jaxscale.master_weights(jaxscale.dynamic_loss_scaling(inner))`, which casts the scaled "
        "gradients to float32 before it unscales them."
    )
