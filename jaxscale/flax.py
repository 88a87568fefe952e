"""Flax: loss-scaled training with a Linen ``TrainState`` or an NNX ``Optimizer``.

Neither needs a special class. ``jaxscale.dynamic_loss_scaling(inner)`` is an
ordinary Optax transformation, so it is the ``tx`` of a
``flax.training.train_state.TrainState`` or of an ``nnx.Optimizer``, and
:func:`jaxscale.find_scaler` finds its state inside either (unwrapping NNX's
Variables). Modules compute in float16 and keep float32 parameters with
``dtype=jnp.float16, param_dtype=jnp.float32``.

Linen: :func:`jaxscale.value_and_grad` is the gradient site (it scales the
loss, differentiates and unscales), and :func:`apply_gradients` (Flax's
``TrainState.apply_gradients``, with the finite flag passed on) takes the true
gradients, checks them, and skips the step on an inf or a NaN:

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
...   def loss_fn(params):
...     pred = state.apply_fn(params, x).astype(jnp.float32)
...     return jnp.mean((pred - y) ** 2)
...   scaler = jaxscale.find_scaler(state.opt_state)
...   loss, grads, finite = jaxscale.value_and_grad(loss_fn)(scaler, state.params)
...   return jaxscale.flax.apply_gradients(state, grads=grads, finite=finite), loss
>>> for _ in range(5):
...   state, loss = train_step(state, x, y)
>>> scaler = jaxscale.find_scaler(state.opt_state)  # 2**16 overflowed float16 3 times
>>> float(scaler.scale), int(scaler.skipped_steps), int(state.step)
(8192.0, 3, 5)
>>> train_step._cache_size()
1

NNX, the same with :func:`value_and_grad`, which returns the true
gradients and the finite flag (``update`` passes ``finite`` on to the
wrapper, which ANDs it with its own check of the gradients):

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

Gradients transformed between the gradient site and ``update`` (clipped,
averaged over micro-batches) are true gradients too: the wrapper checks what
it is given.

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

import functools
from typing import Any, Callable, Sequence

import jax
import optax

try:
  from flax import nnx
except ImportError as e:  # an optional extra: say which one
  raise ImportError(
      "`jaxscale.flax` needs Flax, an optional dependency of jaxscale that is not installed; "
      "install it with `pip install 'jaxscale[flax]'`."
  ) from e

from jaxscale import _grad, _scaler


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


def apply_gradients(state: Any, *, grads: Any, finite: jax.typing.ArrayLike, **kwargs: Any) -> Any:
  """``state.apply_gradients(grads=grads)`` for a Linen ``TrainState``, with the finite flag.

  Flax's ``TrainState.apply_gradients`` calls ``tx.update(grads, opt_state,
  params)`` and has no way to pass ``finite=`` on: this runs it with ``tx``'s
  update given the flag of the gradient site (:func:`jaxscale.value_and_grad`),
  and is otherwise Flax's own (the step counts up, ``kwargs`` replace other
  fields).

  Args:
    state: a ``flax.training.train_state.TrainState`` (or a subclass) whose
      ``tx`` holds a :func:`jaxscale.dynamic_loss_scaling`.
    grads: the true gradients, from :func:`jaxscale.value_and_grad`.
    finite: its finite flag.
    **kwargs: other fields to replace, as in ``TrainState.apply_gradients``.

  Returns:
    The next ``TrainState``; on a step that is not finite, its parameters and
    inner optimizer state are those of ``state``.

  Examples:
    >>> import jax, jax.numpy as jnp, optax, jaxscale, jaxscale.flax
    >>> from flax.training import train_state
    >>> state = train_state.TrainState.create(
    ...     apply_fn=None, params={"w": jnp.ones(2)}, tx=jaxscale.dynamic_loss_scaling(optax.sgd(0.5)))
    >>> scaler = jaxscale.find_scaler(state.opt_state)
    >>> loss_fn = lambda params: jnp.sum(params["w"] ** 2)
    >>> loss, grads, finite = jaxscale.value_and_grad(loss_fn)(scaler, state.params)
    >>> jaxscale.flax.apply_gradients(state, grads=grads, finite=finite).params["w"]
    Array([0., 0.], dtype=float32)
  """
  tx = state.tx
  with_flag = optax.GradientTransformation(tx.init, functools.partial(tx.update, finite=finite))
  return state.replace(tx=with_flag).apply_gradients(grads=grads, **kwargs).replace(tx=tx)


def from_dynamic_scale(dynamic_scale: Any, **init_options: Any) -> _scaler.ScalerState:
  """A :class:`jaxscale.ScalerState` that continues a Flax ``DynamicScale``.

  For a run that resumes, after the migration, from a checkpoint saved with
  ``flax.training.dynamic_scale.DynamicScale``: its ``scale`` becomes the
  scale, its ``fin_steps`` the growth tracker, and its options carry over,
  with ``growth_interval + 1`` (Flax grows one step later than torch and
  jaxscale, see docs/migrating/flax.md) and ``minimum_scale`` as
  ``min_scale``. From there the two scale the same way step for step.

  Args:
    dynamic_scale: a Flax ``DynamicScale`` (or one restored from a checkpoint).
    **init_options: other options for :func:`jaxscale.init` (``hysteresis``,
      ``max_scale``, ``on_stall``, ...), or to override the carried ones.

  Returns:
    The :class:`jaxscale.ScalerState`. To put it into an optimizer state,
    replace the one ``jaxscale.find_scaler(opt_state)`` finds (see
    docs/migrating/flax.md).

  Raises:
    TypeError: if ``dynamic_scale`` is not a Flax ``DynamicScale``.

  Examples:
    >>> import jaxscale.flax
    >>> from flax.training.dynamic_scale import DynamicScale
    >>> old = DynamicScale(growth_interval=100, scale=1024.0, fin_steps=7)
    >>> state = jaxscale.flax.from_dynamic_scale(old)
    >>> float(state.scale), int(state.growth_tracker), int(state.growth_interval)
    (1024.0, 7, 101)
  """
  from flax.training.dynamic_scale import DynamicScale

  if not isinstance(dynamic_scale, DynamicScale):
    raise TypeError(
        "`from_dynamic_scale` takes a `flax.training.dynamic_scale.DynamicScale`, got an object of "
        f"type {type(dynamic_scale).__name__}."
    )
  minimum = dynamic_scale.minimum_scale
  options = {
      "init_scale": _python(dynamic_scale.scale),
      "growth_factor": dynamic_scale.growth_factor,
      "backoff_factor": dynamic_scale.backoff_factor,
      "growth_interval": dynamic_scale.growth_interval + 1,
      "min_scale": 0.0 if minimum is None else minimum,
  }
  options.update(init_options)
  return _scaler.configure(_scaler.init(**options), growth_tracker=_python(dynamic_scale.fin_steps))


def _python(value: Any) -> Any:
  return value.item() if hasattr(value, "item") else value
