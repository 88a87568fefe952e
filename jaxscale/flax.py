"""Flax: loss-scaled training with a Linen ``TrainState`` or an NNX ``Optimizer``.

Neither needs a special class. ``jaxscale.dynamic_loss_scaling(inner)`` is an
ordinary Optax transformation, so it is the ``tx`` of a
``flax.training.train_state.TrainState`` or of an ``nnx.Optimizer``, and
:func:`jaxscale.find_scaler` finds its state inside either (unwrapping NNX's
Variables). Modules compute in float16 and keep float32 parameters with
``dtype=jnp.float16, param_dtype=jnp.float32``.

Linen, with gradients of the scaled loss (``apply_gradients`` unscales,
checks, and skips the step on an inf or a NaN):

>>> import jax, jax.numpy as jnp, optax, jaxscale, jaxscale.flax
>>> import flax.linen as nn
>>> from flax.training import train_state
>>> module = nn.Dense(1, dtype=jnp.float16, param_dtype=jnp.float32)
>>> x, y = jnp.ones((8, 4)), jnp.ones((8, 1))
>>> state = train_state.TrainState.create(
...     apply_fn=module.apply, params=module.init(jax.random.key(0), x),
...     tx=jaxscale.dynamic_loss_scaling(optax.adam(1e-2)))
>>> state = state.replace(step=jnp.zeros((), jnp.int32))  # see "One compilation" below
>>> @jax.jit
... def train_step(state, x, y):
...   scaler = jaxscale.find_scaler(state.opt_state)
...   def scaled_loss(params):
...     pred = state.apply_fn(params, x).astype(jnp.float32)
...     loss = jnp.mean((pred - y) ** 2)
...     return jaxscale.scale(scaler, loss), loss
...   grads, loss = jax.grad(scaled_loss, has_aux=True)(state.params)
...   return state.apply_gradients(grads=grads), loss
>>> for _ in range(5):
...   state, loss = train_step(state, x, y)
>>> scaler = jaxscale.find_scaler(state.opt_state)  # 2**16 overflowed float16 3 times
>>> float(scaler.scale), int(scaler.skipped_steps), int(state.step)
(8192.0, 3, 5)
>>> train_step._cache_size()
1

NNX, the same with :func:`value_and_grad`, which returns the unscaled
gradients and the finite flag (``update`` passes ``finite`` on to the
scaler, which then does not check the gradients a second time):

>>> from flax import nnx
>>> model = nnx.Linear(4, 1, dtype=jnp.float16, param_dtype=jnp.float32, rngs=nnx.Rngs(0))
>>> tx = jaxscale.dynamic_loss_scaling(optax.adam(1e-2), init_scale=1024.0)
>>> optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
>>> @nnx.jit
... def train_step(model, optimizer, x, y):
...   loss_fn = lambda model: jnp.mean((model(x).astype(jnp.float32) - y) ** 2)
...   scaler = jaxscale.find_scaler(optimizer.opt_state)
...   loss, grads, finite = jaxscale.flax.value_and_grad(loss_fn)(scaler, model)
...   optimizer.update(model, grads, finite=finite)
...   return loss
>>> losses = [float(train_step(model, optimizer, x, y)) for _ in range(3)]
>>> losses[-1] < losses[0]
True
>>> jaxscale.find_scaler(optimizer.opt_state).scale
Array(1024., dtype=float32)

Plain ``nnx.grad`` of ``jaxscale.scale(scaler, loss)`` followed by
``optimizer.update(model, grads)`` works as well: the scaler then unscales
and checks, as in the Linen recipe.

One compilation: ``TrainState.create`` starts ``step`` as the Python int 0,
and ``jax.jit`` compiles the step a second time once ``step`` has become an
array; starting it as an array, as above, avoids that. Every leaf of
jaxscale's own state is an array from the start.

Step counters: ``TrainState.step`` and ``nnx.Optimizer.step`` are Flax's own
and count every call, skipped steps included. The inner Optax state (Adam's
``count``, a learning-rate schedule's step) does not advance on a skipped
step, so the applied steps are ``step - find_scaler(opt_state).skipped_steps``.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import jax

try:
  from flax import nnx
except ImportError as e:  # an optional extra: say which one
  raise ImportError(
      "`jaxscale.flax` needs Flax, an optional dependency of jaxscale that is not installed; "
      "install it with `pip install 'jaxscale[flax]'`."
  ) from e

from jaxscale import _grad


def value_and_grad(
    fun: Callable[..., Any],
    argnums: int | nnx.DiffState | Sequence[int | nnx.DiffState] = 0,
    has_aux: bool = False,
    *,
    axis_name: Any = None,
) -> Callable[..., tuple[Any, Any, jax.Array]]:
  """:func:`jaxscale.value_and_grad` for NNX: ``nnx.grad`` of the scaled loss.

  Differentiates with respect to the ``nnx.Param`` s of Module arguments (or
  what an ``nnx.DiffState`` in ``argnums`` selects), and lets ``fun`` update
  the Modules' other state, as ``nnx.value_and_grad`` does.

  Args:
    fun: the loss function; returns a scalar loss, or ``(loss, aux)`` with
      ``has_aux``.
    argnums: as in ``nnx.grad``.
    has_aux: as in ``nnx.grad``.
    axis_name: inside ``shard_map``/``pmap``, the axis over which every device
      must agree on the finite flag.

  Returns:
    A function taking the scaler state, then ``fun``'s arguments, and returning
    ``(value, grads, finite)``: ``fun``'s own (unscaled) value, the unscaled
    gradients as an ``nnx.State``, and the finite flag. Pass the flag on with
    ``optimizer.update(model, grads, finite=finite)``.

  Examples:
    >>> import jax.numpy as jnp, jaxscale, jaxscale.flax
    >>> from flax import nnx
    >>> model = nnx.Linear(2, 1, rngs=nnx.Rngs(0))
    >>> loss_fn = lambda model: jnp.sum(model(jnp.ones((1, 2))))
    >>> scaler = jaxscale.init(init_scale=1024.0)
    >>> loss, grads, finite = jaxscale.flax.value_and_grad(loss_fn)(scaler, model)
    >>> grads["bias"][...], bool(finite)
    (Array([1.], dtype=float32), True)
  """

  return _grad.value_and_grad_with(nnx.grad, fun, argnums, has_aux, axis_name)
