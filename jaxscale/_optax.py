"""The Optax wrapper: dynamic loss scaling around any inner optimizer."""

from __future__ import annotations

import collections
import sys
from typing import Any, NamedTuple

import jax
import jax.core
import jax.numpy as jnp
import optax
from jax.extend import core as jex_core

from jaxscale import _master, _scaler


class DynamicLossScalingState(NamedTuple):
  """State of :func:`dynamic_loss_scaling`: the scaler's state and the inner optimizer's.

  Examples:
    >>> import jax.numpy as jnp, optax, jaxscale
    >>> opt_state = jaxscale.dynamic_loss_scaling(optax.adam(1e-3)).init(jnp.zeros(3))
    >>> opt_state.scaler.scale
    Array(65536., dtype=float32)
    >>> type(opt_state.inner_state[0]).__name__  # adam's own state, as optax.adam builds it
    'ScaleByAdamState'
  """

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
    inner_state = inner.init(params)
    _master.refuse_inside_scaler(inner_state)
    return DynamicLossScalingState(_scaler.init(**init_options), inner_state)

  def update_fn(updates, state, params=None, *, finite=None, **extra_args):
    if not enabled:
      updates, inner_state = inner.update(updates, state.inner_state, params, **extra_args)
      return updates, state._replace(inner_state=inner_state)
    scaler = state.scaler
    if finite is None:
      updates, finite = _scaler.unscale_and_check(scaler, updates, axis_name=axis_name)
    finite = jnp.asarray(finite, jnp.bool_) & ~scaler.stalled
    updates, inner_state = _update_or_keep(
        finite, lambda u, s, p: inner.update(u, s, p, **extra_args), updates, state.inner_state, params
    )
    return updates, DynamicLossScalingState(_scaler.update(scaler, finite), inner_state)

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def _update_or_keep(finite, update, updates, inner_state, params):
  """``update(updates, inner_state, params)`` if ``finite``, else ``(-0.0, inner_state)``.

  Why not simply ``jnp.where(finite, new, old)`` on the outputs: Adam's new
  parameters are computed from the new moments, and with the select in
  between XLA recomputes them from the old moments, which the select fusion
  overwrites in place in the donated buffers; to keep them readable it copies
  every moment first (4.6x plain Adam). A ``lax.cond`` instead materialises
  the updates at its boundary, where they can no longer fuse into
  ``apply_updates`` (1.3x). So the select goes where each new state leaf is
  *produced*: ``update`` runs from its jaxpr, and each new state value is
  replaced by ``where(finite, new, old)`` the moment it exists, before
  anything reads it. The updates are then computed from the selected state,
  which XLA writes in place exactly as it writes the unwrapped optimizer's
  (benchmarks/NOTES.md). On a finite step every value equals the unwrapped
  one; on a skipped step the state is the old one and the updates are
  masked, whatever they read.
  """

  def keep_if_skipped(new, old):
    return jnp.where(finite, new, old)

  def mask(u):
    return jnp.where(finite, u, -0.0).astype(u.dtype)

  if not any(isinstance(x, jax.core.Tracer) for x in jax.tree.leaves((updates, inner_state, finite))):
    # Op by op (eagerly, or under `disable_jit`) there are no buffers to
    # reuse, and the jaxpr's jitted sub-calls would round differently.
    new_updates, new_state = update(updates, inner_state, params)
    return jax.tree.map(mask, new_updates), jax.tree.map(keep_if_skipped, new_state, inner_state)

  closed, out_shape = jax.make_jaxpr(update, return_shape=True)(updates, inner_state, params)
  n_updates = len(jax.tree.leaves(out_shape[0]))
  state_vars = closed.jaxpr.outvars[n_updates:]
  old_leaves = jax.tree.leaves(inner_state)
  produced = {v for eqn in closed.jaxpr.eqns for v in eqn.outvars}
  repeats = collections.Counter(state_vars)
  # A leaf passed through unchanged, or output twice, is selected at the end.
  old_of = {v: old for v, old in zip(state_vars, old_leaves) if v in produced and repeats[v] == 1}
  outs = _eval_jaxpr(
      closed,
      jax.tree.leaves((updates, inner_state, params)),
      on_output=lambda v, x: keep_if_skipped(x, old_of[v]) if v in old_of else x,
  )
  new_updates = [mask(u) for u in outs[:n_updates]]
  new_state = [
      x if v in old_of else keep_if_skipped(x, old)
      for v, x, old in zip(state_vars, outs[n_updates:], old_leaves)
  ]
  return jax.tree.unflatten(jax.tree.structure(out_shape), new_updates + new_state)


def _eval_jaxpr(closed, args, *, on_output):
  """``jax.core.eval_jaxpr``, passing each equation's outputs through ``on_output``."""
  env = dict(zip(closed.jaxpr.constvars, closed.consts))
  env.update(zip(closed.jaxpr.invars, args))

  def read(v):
    return v.val if isinstance(v, jex_core.Literal) else env[v]

  for eqn in closed.jaxpr.eqns:
    bind_params = eqn.primitive.get_bind_params(eqn.params)
    # Older jax releases return `(subfuns, params)`; newer ones fold subfuns into params.
    subfuns, bind_params = bind_params if isinstance(bind_params, tuple) else ((), bind_params)
    with eqn.ctx.manager:
      outs = eqn.primitive.bind(*subfuns, *map(read, eqn.invars), **bind_params)
    for v, x in zip(eqn.outvars, outs if eqn.primitive.multiple_results else [outs]):
      env[v] = on_output(v, x)
  return [read(v) for v in closed.jaxpr.outvars]


def find_scaler(opt_state: Any) -> _scaler.ScalerState:
  """Returns the :class:`ScalerState` held anywhere inside ``opt_state``.

  Looks through any pytree: ``optax.chain``, ``MultiSteps``,
  ``inject_hyperparams``, a Flax ``TrainState``, an ``nnx.Optimizer``'s
  ``opt_state`` (whose leaves NNX wraps in Variables: they are unwrapped, so
  the result works with :func:`jaxscale.scale` and reads as numbers).

  Args:
    opt_state: any pytree holding exactly one :class:`ScalerState`.

  Returns:
    That :class:`ScalerState`.

  Raises:
    ValueError: if ``opt_state`` holds no scaler, or more than one.

  Examples:
    >>> import jax.numpy as jnp, optax, jaxscale
    >>> tx = optax.chain(optax.add_decayed_weights(1e-4),
    ...                  jaxscale.dynamic_loss_scaling(optax.sgd(0.1), init_scale=512.0))
    >>> jaxscale.find_scaler(tx.init(jnp.zeros(3))).scale
    Array(512., dtype=float32)
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
  # NNX stores optimizer state leaves as Variables. Found through sys.modules:
  # a Variable exists only once flax is imported, and jaxscale must not import it.
  nnx = sys.modules.get("flax.nnx")
  if nnx is None or not isinstance(leaf, nnx.Variable):
    return leaf
  # `get_value` is flax >= 0.12.1, which deprecates `.value`; older ones have only `.value`.
  get_value = getattr(leaf, "get_value", None)
  return get_value() if callable(get_value) else leaf.value
