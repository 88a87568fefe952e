"""The Optax wrapper: dynamic loss scaling around any inner optimizer."""

from __future__ import annotations

import inspect
import warnings
from collections.abc import Mapping
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax.core import Tracer

from jaxscale import _provenance, _scaler, _tree


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
  The flag must be a boolean scalar; with ``axis_name`` the devices still
  agree on it (a step is skipped everywhere if any device's flag is False).

  Without ``finite=``, what the update is given is checked while it is traced
  (nothing of it enters the compiled step): gradients that
  :func:`jaxscale.value_and_grad` or :func:`jaxscale.unscale_and_check`
  returned, unchanged, are recognised as unscaled and bring their flag (so
  ``TrainState.apply_gradients`` and ``nnx.Optimizer.update``, which cannot
  pass ``finite=``, never unscale them twice); such gradients changed by hand
  are a ValueError; and gradients when no loss was multiplied by a scale (a
  forgotten :func:`jaxscale.scale`) give a ``UserWarning``. Scaled gradients
  computed in another jitted function cannot be recognised: unscale them
  with :func:`jaxscale.unscale_and_check` where you update, and pass
  ``finite=``.

  A skipped step runs ``inner`` all the same (on zero gradients, its results
  thrown away): side effects inside it, such as ``jax.debug.print`` or host
  callbacks, happen on skipped steps too. Derivatives through a skipped step
  (``jax.grad`` of a training step with respect to a learning rate or the
  parameters) are those of a step that changed nothing: finite, not NaN.

  ``inner`` may be any ``GradientTransformation`` (extra arguments such as
  ``value`` or ``value_fn`` are passed on to it); it must not change the
  structure of its state from one step to the next. tests/test_catalogue.py
  runs every transformation in ``optax`` and ``optax.contrib`` through it.

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
  require_transformation(inner, "dynamic_loss_scaling")
  inner = optax.with_extra_args_support(inner)
  known = inspect.signature(_scaler.init).parameters
  unknown = sorted(set(init_options) - set(known))
  if unknown:
    raise TypeError(
        f"`dynamic_loss_scaling` got unknown options {unknown}; it takes `axis_name` and the "
        f"options of `jaxscale.init`: {', '.join(known)}."
    )
  _scaler.init(**init_options)  # validates the options before any tracing
  enabled = init_options.get("enabled", True)

  def init_fn(params):
    inner_state = inner.init(params)
    _refuse_what_must_not_be_inside(inner_state)
    if any(_is_scaler(x) for x in jax.tree.leaves(inner_state, is_leaf=_is_scaler)):
      raise ValueError(
          "`dynamic_loss_scaling` wraps an optimizer that already holds a loss scaler (a "
          "`dynamic_loss_scaling` inside `inner`): the gradients would be unscaled twice. Wrap "
          "the optimizer once, outermost (inside `master_weights`, if any)."
      )
    return DynamicLossScalingState(_scaler.init(**init_options), inner_state)

  def update_fn(updates, state, params=None, *, finite=None, **extra_args):
    if not (hasattr(state, "scaler") and hasattr(state, "inner_state")):
      raise TypeError(
          "`dynamic_loss_scaling`'s update takes the state its own `init` built (a "
          f"`DynamicLossScalingState`), got an object of type {type(state).__name__}; build it "
          "with `tx.init(params)` of this wrapped optimizer, not of the inner one (a checkpoint "
          "restored without a target is a dict: restore it into the structure of `tx.init(params)`)."
      )
    if not enabled:
      updates, inner_state = inner.update(updates, state.inner_state, params, **extra_args)
      return updates, state._replace(inner_state=inner_state)
    scaler = state.scaler
    if finite is None:
      finite = _flag_of_unscaled(updates, scaler)
    if finite is None:
      _warn_if_float16(updates)
      updates, finite = _scaler.unscale_and_check_unnoted(scaler, updates, axis_name=axis_name)
    else:
      _warn_if_still_scaled(updates, scaler)
      finite = _scaler._as_flag(finite)
      if axis_name is not None:  # each device may have checked only its own gradients
        finite = jax.lax.pmin(finite.astype(jnp.int32), axis_name).astype(jnp.bool_)
    finite = finite & ~scaler.stalled
    updates, inner_state = _update_or_keep(
        finite, lambda u, s, p: inner.update(u, s, p, **extra_args), updates, state.inner_state, params
    )
    return updates, DynamicLossScalingState(_scaler.update(scaler, finite), inner_state)

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def require_transformation(inner: Any, function: str) -> None:
  """Raises a TypeError that says what to pass if ``inner`` is not an Optax transformation."""
  if isinstance(inner, optax.GradientTransformation) or (
      callable(getattr(inner, "init", None)) and callable(getattr(inner, "update", None))
  ):
    return
  if callable(inner):
    name = getattr(inner, "__qualname__", None) or type(inner).__name__
    module = getattr(inner, "__module__", "") or ""
    shown = f"optax.{name}" if module.startswith("optax") else name
    hint = f"it looks like the factory itself: call it, e.g. `{function}({shown}(learning_rate))`"
  else:
    hint = f"pass one, e.g. `{function}(optax.adam(1e-3))`"
  raise TypeError(
      f"`{function}` wraps an `optax.GradientTransformation`, got {inner!r} of type "
      f"{type(inner).__name__}; {hint}."
  )


def _flag_of_unscaled(updates, scaler):
  """The finite flag of ``updates`` if they are known unscaled, else None (they are taken
  as scaled). Raises or warns, at trace time, where they can be neither (see _provenance.py)."""
  leaves = [g for g in jax.tree.leaves(updates) if _tree.is_floating(g)]
  flags = [_provenance.unscaled_flag(g) for g in leaves]
  known = [f for f in flags if f is not None]
  if known and len(known) < len(leaves):
    raise ValueError(
        f"`dynamic_loss_scaling`'s update was given gradients of which {len(known)} of "
        f"{len(leaves)} floating leaves were already unscaled (by `jaxscale.value_and_grad` or "
        "`jaxscale.unscale_and_check`) and the others not; it would divide the unscaled ones by "
        "the loss scale a second time. Unscale them all and pass the flag: "
        "`tx.update(grads, opt_state, params, finite=finite)`."
    )
  if known:  # all unscaled already: their flag comes with them (several calls: all must hold)
    _provenance.forget_scaled_since()
    finite = known[0]
    for flag in known[1:]:
      finite = finite if flag is finite else finite & flag
    return finite
  scaled, last = _provenance.use_of(scaler.scale)
  if last == "unscaled" and isinstance(scaler.scale, Tracer):  # eagerly, one state may serve many calls
    raise ValueError(
        "`dynamic_loss_scaling`'s update was given gradients without `finite=`, but the last "
        "use of its loss scale in this trace was to unscale gradients (`jaxscale.value_and_grad` "
        "or `jaxscale.unscale_and_check`): if these are those gradients, transformed (clipped, "
        "averaged, ...), the update would divide them by the scale a second time. Pass their "
        "flag: `tx.update(grads, opt_state, params, finite=finite)`, or put the transformation "
        "inside the optimizer (`dynamic_loss_scaling(optax.chain(clip, adam))`) and give it the "
        "scaled gradients of `jax.grad` of `jaxscale.scale(scaler, loss)` (as a Flax "
        "`TrainState.apply_gradients` needs, since it cannot pass `finite=`). If they are scaled "
        "gradients and you unscaled a copy only to inspect it, pass that unscaled copy with "
        "`finite=` instead."
    )
  if scaled:
    _provenance.forget_scaled_since()
  elif not _provenance.scaled_since():
    warnings.warn(
        "jaxscale: `dynamic_loss_scaling`'s update was given gradients without `finite=`, so it "
        "takes them as gradients of a scaled loss and divides them by the loss scale; but no "
        "loss was multiplied by this optimizer's scale here, nor any loss by any scale since an "
        "update last saw its own. Gradients of an unscaled loss would then train `scale` times too slowly. "
        "Differentiate `jaxscale.scale(jaxscale.find_scaler(opt_state), loss)`, or use "
        "`jaxscale.value_and_grad(loss_fn)(jaxscale.find_scaler(opt_state), params)`. If the "
        "gradients are scaled but were computed elsewhere (in another jitted function), unscale "
        "them where you update, `grads, finite = jaxscale.unscale_and_check("
        "jaxscale.find_scaler(opt_state), grads)`, and pass `finite=finite`.",
        UserWarning,
        stacklevel=3,
    )
  return None


def _warn_if_float16(updates):
  """Warns, at trace time, when the wrapper is to unscale float16 gradients in float16."""
  if any(_tree.is_floating(g) and jnp.result_type(g) == jnp.float16 for g in jax.tree.leaves(updates)):
    warnings.warn(
        "jaxscale: `dynamic_loss_scaling` was given float16 gradients (of float16 parameters) to "
        "unscale: in float16 every true gradient below 2**-24 flushes to zero again, and those "
        "parameters stop learning. Wrap it as `jaxscale.master_weights(jaxscale.dynamic_loss_scaling("
        "inner))`, which casts the gradients to float32 before they are unscaled, or keep float32 "
        "parameters and compute in float16.",
        UserWarning,
        stacklevel=3,
    )


def _warn_if_still_scaled(updates, scaler):
  """Warns, at trace time, when gradients given with ``finite=`` look like scaled ones: in this
  trace the scale multiplied a loss and was never used to unscale (see _provenance.py)."""
  if not isinstance(scaler.scale, Tracer):  # eagerly, one state may serve many calls
    return
  if _provenance.use_of(scaler.scale)[1] != "scaled":
    return
  leaves = [g for g in jax.tree.leaves(updates) if _tree.is_floating(g)]
  if any(_provenance.unscaled_flag(g) is not None for g in leaves):
    return
  warnings.warn(
      "jaxscale: `dynamic_loss_scaling`'s update was given `finite=`, so it takes the gradients as "
      "unscaled and does not divide them by the loss scale; but in this trace the scale multiplied "
      "a loss and never unscaled anything. If these are the gradients of the scaled loss, the "
      "update is `scale` times too large: unscale them first, `grads, finite = "
      "jaxscale.unscale_and_check(scaler, grads)`, or drop `finite=` and let the update unscale them.",
      UserWarning,
      stacklevel=3,
  )


def _update_or_keep(finite, update, updates, inner_state, params):
  """``update(updates, inner_state, params)`` if ``finite``, else ``(-0.0, inner_state)``.

  ``update`` runs on every step, and a select on its outputs keeps the old
  state and masks the updates when ``finite`` is False: public JAX only, one
  compiled step with no branch and no host sync, and the same algorithm
  eagerly and under ``jit``. On a skipped step ``update`` is fed zero
  gradients, so what it computes from values it closes over (a traced
  learning rate) stays finite.

  Why a select rather than a ``lax.cond``: on the one GPU measured (NVIDIA
  H100, ``bench.py --quick``, docs/benchmarks-h100.md) the select on the
  outputs, the pattern of Flax's ``DynamicScale``, cost 1.04x plain Adam
  (8M parameters, 48 leaves) where Keras's ``cond`` cost 1.06x; on a CPU the
  ``cond`` measured 3.5x (benchmarks/NOTES.md #1). On XLA:CPU, with the
  donated parameters and state, the select measured the same as the jaxpr
  evaluation it replaced, in the Adam step alone (8M parameters, 48 leaves:
  1.47x both, the same 4 copies) and in full LM training steps (the same
  copies and fusions; NOTES.md #19). ``bench.py`` times each mechanism as its
  own row, so that a GPU run can decide again.

  Derivatives through a skipped step (meta-learning, hyperparameter
  gradients) must be zero, not NaN: the updates are masked, but reverse mode
  multiplies their zero cotangent by the derivatives of whatever ``update``
  computed from the inf gradients or the old state (Adam's bias correction
  at count 0 is 0/0): the ``where`` trap. So every input of ``update`` passes
  through :func:`_no_derivative_unless`, the identity (no op in the compiled
  step) whose derivative is zero on a skipped step; the kept state keeps its
  derivative with respect to the old state.
  """
  zeroed = jax.tree.map(lambda u: jnp.where(finite, u, jnp.zeros_like(u)) if _tree.is_floating(u) else u, updates)
  new_updates, new_state = update(*_gate_tree(finite, (zeroed, inner_state, params)))
  _check_state_structure(new_state, inner_state)
  return (
      jax.tree.map(lambda u: _mask(finite, u, jnp.result_type(u)), new_updates),
      jax.tree.map(lambda n, o: _keep_if_skipped(finite, n, o, jnp.result_type(n)), new_state, inner_state),
  )


def _refuse_what_must_not_be_inside(inner_state):
  """Raises the error a state type names in its ``not_inside_dynamic_loss_scaling`` class attribute.

  A wrapper whose state must never be wrapped in this one (``master_weights``:
  the scaler would unscale its float16 gradients in float16) says so on its
  state's type, so that this module need not know it.
  """
  refuses = lambda x: isinstance(getattr(type(x), "not_inside_dynamic_loss_scaling", None), str)
  for leaf in jax.tree.leaves(inner_state, is_leaf=refuses):
    if refuses(leaf):
      raise ValueError(type(leaf).not_inside_dynamic_loss_scaling)


def _check_state_structure(new_state, inner_state):
  if jax.tree.structure(new_state) != jax.tree.structure(inner_state):
    raise ValueError(
        "`dynamic_loss_scaling` keeps the inner optimizer's state on a skipped step, so the "
        "inner update must return a state of the structure it was given; it was given "
        f"{jax.tree.structure(inner_state)} and returned {jax.tree.structure(new_state)}. "
        "Build the state's final structure in the optimizer's `init`."
    )


@jax.custom_jvp
def _no_derivative_unless(finite, x):
  """``x`` (any pytree), whose derivative is zero (not ``0 * nan``) unless ``finite``."""
  del finite
  return x


@_no_derivative_unless.defjvp
def _no_derivative_unless_jvp(primals, tangents):
  finite, x = primals
  # A select, not a product: its transpose zeroes a NaN cotangent too.
  return x, jax.tree.map(lambda t: jnp.where(finite, t, jnp.zeros_like(t)), tangents[1])


def _gate_tree(finite, tree):
  """``tree`` with its floating leaves gated by :func:`_no_derivative_unless`, in one call.

  One call for the whole tree, not one per leaf: each call is an equation
  to trace and lower, and an optimizer of 1000 leaves has thousands of inputs.
  """
  leaves, treedef = jax.tree.flatten(tree)
  floating = [i for i, x in enumerate(leaves) if _tree.is_floating(x)]
  gated = _no_derivative_unless(finite, [leaves[i] for i in floating])
  for i, x in zip(floating, gated):
    leaves[i] = x
  return jax.tree.unflatten(treedef, leaves)


def _mask(finite, u, dtype):
  """The update ``u`` if ``finite``, else -0.0 (``apply_updates`` then changes no bit)."""
  return jnp.where(finite, jnp.asarray(u, dtype), jnp.asarray(-0.0, dtype))


def _keep_if_skipped(finite, new, old, dtype):
  return jnp.where(finite, jnp.asarray(new, dtype), jnp.asarray(old, dtype))


def find_scaler(opt_state: Any) -> _scaler.ScalerState:
  """Returns the :class:`ScalerState` held anywhere inside ``opt_state``.

  Looks through any pytree: ``optax.chain``, ``MultiSteps``,
  ``inject_hyperparams``, a Flax ``TrainState``, an ``nnx.Optimizer``'s
  ``opt_state`` (whose leaves NNX wraps in Variables: they are unwrapped, so
  the result works with :func:`jaxscale.scale` and reads as numbers), and
  the state mappings of ``nnx.state(optimizer)``, ``nnx.split(optimizer)``
  or a serialized state dict, where the scaler is a mapping of its fields.

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
      leaf if isinstance(leaf, _scaler.ScalerState) else _scaler.ScalerState(**{k: leaf[k] for k in _FIELDS})
      for leaf in jax.tree.leaves(opt_state, is_leaf=_is_scaler)
      if _is_scaler(leaf)
  ]
  if isinstance(opt_state, optax.GradientTransformation):
    raise ValueError(
        "`find_scaler` takes an optimizer *state*, got the optimizer itself (a "
        "`GradientTransformation`); pass `opt_state = tx.init(params)` (or `state.opt_state`)."
    )
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
  return found[0]._make(_tree.unwrap_variable(field) for field in found[0])


_FIELDS = frozenset(_scaler.ScalerState._fields)


def _is_scaler(x) -> bool:
  """A ScalerState, or a mapping of its fields: NNX's ``nnx.state`` / ``nnx.split`` views
  and serialized state dicts hold the scaler as such a mapping."""
  if isinstance(x, _scaler.ScalerState):
    return True
  return isinstance(x, Mapping) and set(x.keys()) == _FIELDS
