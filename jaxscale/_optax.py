"""The Optax wrapper: dynamic loss scaling around any inner optimizer."""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from jaxscale import _scaler


class DynamicLossScalingState(NamedTuple):
  """State of :func:`dynamic_loss_scaling`."""

  scaler: _scaler.ScalerState
  inner_state: optax.OptState


def dynamic_loss_scaling(
    inner: optax.GradientTransformation,
    *,
    axis_name: Any = None,
    **init_options: Any,
) -> optax.GradientTransformationExtraArgs:
  """Wraps ``inner`` so that it can be fed the gradients of a scaled loss.

  Each update unscales the gradients, checks them, and runs ``inner`` on the
  true gradients. A step whose gradients hold an inf or a NaN is skipped: the
  updates are all zero (``-0.0``, so ``optax.apply_updates`` leaves every
  parameter bit for bit as it was) and ``inner``'s state, step count and
  learning-rate schedule do not advance. The scaler then grows or backs off.

  Gradient clipping and any other transformation that must see true gradients
  go *inside* ``inner`` (``dynamic_loss_scaling(optax.chain(clip, adam))``):
  this is what torch users do by hand with ``scaler.unscale_(optimizer)``.

  If you already unscaled and checked the gradients yourself (with
  :func:`jaxscale.value_and_grad` or :func:`jaxscale.unscale_and_check`),
  pass the flag as ``tx.update(grads, state, params, finite=finite)``: the
  gradients are then taken as unscaled and are not checked a second time.

  Args:
    inner: the optimizer to wrap.
    axis_name: inside ``shard_map``/``pmap``, the axis over which every
      device must take the same skip decision.
    **init_options: options for :func:`jaxscale.init` (``init_scale``,
      ``growth_interval``, ``enabled``, ``hysteresis``, ...).

  Returns:
    An ``optax.GradientTransformationExtraArgs``; its state holds the
    :class:`ScalerState`, which :func:`jaxscale.find_scaler` finds.

  Examples:
    >>> import jax, jax.numpy as jnp, optax, jaxscale
    >>> tx = jaxscale.dynamic_loss_scaling(optax.sgd(0.1), init_scale=1024.0)
    >>> params = jnp.ones(2)
    >>> opt_state = tx.init(params)
    >>> loss = lambda p: jnp.sum(p ** 2)
    >>> scaler = jaxscale.find_scaler(opt_state)
    >>> grads = jax.grad(lambda p: jaxscale.scale(scaler, loss(p)))(params)
    >>> updates, opt_state = tx.update(grads, opt_state, params)
    >>> optax.apply_updates(params, updates)
    Array([0.8, 0.8], dtype=float32)
  """
  inner = optax.with_extra_args_support(inner)
  _scaler.init(**init_options)  # validates the options before any tracing
  enabled = init_options.get("enabled", True)

  def init_fn(params):
    return DynamicLossScalingState(_scaler.init(**init_options), inner.init(params))

  def update_fn(updates, state, params=None, *, finite=None, **extra_args):
    if not enabled:
      updates, inner_state = inner.update(updates, state.inner_state, params, **extra_args)
      return updates, state._replace(inner_state=inner_state)
    scaler = state.scaler
    if finite is None:
      updates, finite = _scaler.unscale_and_check(scaler, updates, axis_name=axis_name)
    finite = jnp.asarray(finite, jnp.bool_) & ~scaler.stalled
    new_updates, new_inner_state = inner.update(updates, state.inner_state, params, **extra_args)
    # Select, don't branch: a `jnp.where` fuses into the fusions that produce
    # the new inner state, so a finite step costs no extra pass and XLA can
    # update the donated state in place; a `lax.cond` carrying the inner state
    # forces copies of it (jax-ml/jax#39449), and on GPU ships the predicate
    # to the host. Measured in benchmarks/NOTES.md.
    updates = jax.tree.map(lambda u: jnp.where(finite, u, -0.0), new_updates)
    inner_state = jax.tree.map(lambda n, o: jnp.where(finite, n, o), new_inner_state, state.inner_state)
    return updates, DynamicLossScalingState(_scaler.update(scaler, finite), inner_state)

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def find_scaler(opt_state: Any) -> _scaler.ScalerState:
  """Returns the :class:`ScalerState` held anywhere inside ``opt_state``.

  Looks through any pytree: ``optax.chain``, ``MultiSteps``,
  ``inject_hyperparams``, a Flax ``TrainState``, an ``nnx.Optimizer``'s
  ``opt_state`` (whose leaves NNX wraps in Variables: they are unwrapped, so
  the result works with :func:`jaxscale.scale` and reads as numbers).

  Raises:
    ValueError: if ``opt_state`` holds no scaler, or more than one.
  """
  found = [
      leaf
      for leaf in jax.tree.leaves(opt_state, is_leaf=lambda x: isinstance(x, _scaler.ScalerState))
      if isinstance(leaf, _scaler.ScalerState)
  ]
  if len(found) != 1:
    what = "no ScalerState" if not found else f"{len(found)} ScalerStates"
    raise ValueError(
        f"`find_scaler` found {what} in an object of type {type(opt_state).__name__}; "
        "it needs exactly one. Build the optimizer with "
        "`jaxscale.dynamic_loss_scaling(inner)`, and pass its state (or a "
        "part of it holding one scaler)."
    )
  # Field by field, not `jax.tree.map`: NNX Variables are pytree nodes
  # themselves, so a tree map would reach the arrays inside them and leave
  # the Variables in place.
  return found[0]._make(_unwrap_variable(field) for field in found[0])


def _unwrap_variable(leaf):
  # NNX stores optimizer state leaves as Variables; `get_value` unwraps them.
  get_value = getattr(leaf, "get_value", None)
  return get_value() if callable(get_value) else leaf
