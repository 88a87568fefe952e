"""Equinox: loss-scaled training of an ``eqx.Module``.

An Equinox model is a pytree whose leaves are arrays and other things
(activation functions, sizes), so it is differentiated with
``eqx.filter_value_and_grad`` and optimized on ``eqx.filter(model,
eqx.is_array)``. Loss scaling changes two lines of Equinox's recipe: the
optimizer is ``jaxscale.dynamic_loss_scaling(inner)``, an ordinary Optax
transformation, and the gradient line is :func:`filter_value_and_grad`,
which differentiates the scaled loss and returns the unscaled gradients with
the finite flag. ``eqx.apply_updates`` applies the updates as before: on a
skipped step they are all ``-0.0``, so every array of the model stays bit for
bit as it was.

>>> import jax, jax.numpy as jnp, optax, equinox as eqx, jaxscale, jaxscale.equinox
>>> model = eqx.nn.MLP(4, 1, width_size=8, depth=1, key=jax.random.key(0))
>>> tx = jaxscale.dynamic_loss_scaling(optax.adam(1e-2))
>>> opt_state = tx.init(eqx.filter(model, eqx.is_array))
>>> x, y = jnp.ones((16, 4)), jnp.zeros((16, 1))
>>> policy = jaxscale.get_policy("mixed_float16")
>>> def loss_fn(model, x, y):
...   model, x = policy.cast_to_compute((model, x))  # float16 compute
...   pred = policy.cast_to_output(jax.vmap(model)(x))
...   return jnp.mean((pred - y) ** 2)
>>> @eqx.filter_jit
... def train_step(model, opt_state, x, y):
...   scaler = jaxscale.find_scaler(opt_state)
...   loss, grads, finite = jaxscale.equinox.filter_value_and_grad(loss_fn)(scaler, model, x, y)
...   updates, opt_state = tx.update(grads, opt_state, eqx.filter(model, eqx.is_array), finite=finite)
...   return eqx.apply_updates(model, updates), opt_state, loss
>>> for _ in range(3):
...   model, opt_state, loss = train_step(model, opt_state, x, y)
>>> jaxscale.metrics(opt_state)["scale"]
Array(65536., dtype=float32)

The model keeps float32 parameters: ``cast_to_compute`` casts them to float16
inside ``loss_fn``, and their gradients come back through the cast in float32.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax

try:
  import equinox as eqx
except ImportError as e:  # an optional extra: say which one
  raise ImportError(
      "`jaxscale.equinox` needs Equinox, an optional dependency of jaxscale that is not installed; "
      "install it with `pip install 'jaxscale[equinox]'`."
  ) from e

from jaxscale import _grad, _scaler


def filter_value_and_grad(
    fun: Callable[..., Any],
    *,
    has_aux: bool = False,
    axis_name: Any = None,
) -> Callable[..., tuple[Any, Any, jax.Array]]:
  """``eqx.filter_value_and_grad`` of the scaled loss.

  Differentiates ``fun`` with respect to the floating arrays of its first
  argument (the model), as ``eqx.filter_value_and_grad`` does; the other leaves
  of the model get ``None`` gradients.

  Args:
    fun: the loss function, ``fun(model, *args, **kwargs)``; returns a scalar
      loss, or ``(loss, aux)`` with ``has_aux``.
    has_aux: as in ``eqx.filter_value_and_grad``.
    axis_name: inside ``shard_map``/``pmap``, the axis over which every device
      must agree on the finite flag.

  Returns:
    A function taking the scaler state (``jaxscale.find_scaler(opt_state)``),
    then ``fun``'s arguments, and returning ``(value, grads, finite)``:
    ``fun``'s own (unscaled) value, ``(loss, aux)`` with ``has_aux``; the
    unscaled gradients; and the finite flag. Pass the flag on with
    ``tx.update(grads, opt_state, eqx.filter(model, eqx.is_array), finite=finite)``.

  Raises:
    TypeError: if the first argument of the returned function is not a
      ``jaxscale.ScalerState``, or if ``fun`` returns no ``(loss, aux)`` pair
      with ``has_aux``.

  Examples:
    >>> import jax.numpy as jnp, equinox as eqx, jaxscale, jaxscale.equinox
    >>> model = eqx.nn.Linear(2, 1, key=jax.random.key(0))
    >>> loss_fn = lambda model, x: jnp.sum(model(x))
    >>> scaler = jaxscale.init(init_scale=1024.0)
    >>> loss, grads, finite = jaxscale.equinox.filter_value_and_grad(loss_fn)(scaler, model, jnp.ones(2))
    >>> grads.bias, bool(finite)
    (Array([1.], dtype=float32), True)
  """

  if not callable(fun):
    raise TypeError(
        "`jaxscale.equinox.filter_value_and_grad` takes the loss function, "
        f"`filter_value_and_grad(loss_fn)(scaler, model, ...)`; got {fun!r} of type {type(fun).__name__}."
    )

  def grad(scaled_fun, argnums, has_aux):
    del argnums  # eqx.filter_grad differentiates the first argument
    return eqx.filter_grad(scaled_fun, has_aux=has_aux)

  called = _grad.python_of(fun)

  def checked_fun(*args, **kwargs):
    out = called(*args, **kwargs)
    if has_aux and not (isinstance(out, (tuple, list)) and len(out) == 2):
      raise TypeError(
          "With `has_aux=True`, `fun` must return a pair `(loss, aux)`; it returned "
          f"{type(out).__name__} {out!r}. Return the pair, or leave `has_aux` False."
      )
    return out

  value_and_grad = _grad.value_and_grad_with(grad, checked_fun, 0, has_aux, axis_name)

  def wrapped(scaler, *args, **kwargs):
    if not isinstance(scaler, _scaler.ScalerState):
      raise TypeError(
          "The function returned by `jaxscale.equinox.filter_value_and_grad(fun)` takes the scaler "
          "state first, then `fun`'s arguments: call it as `(jaxscale.find_scaler(opt_state), model, "
          f"...)`; its first argument was a {type(scaler).__name__}."
      )
    return value_and_grad(scaler, *args, **kwargs)

  return wrapped
