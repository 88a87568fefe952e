"""The Optax wrapper: dynamic loss scaling around any inner optimizer."""

from __future__ import annotations

import difflib
import inspect
import warnings
from collections import OrderedDict
from collections.abc import Mapping
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax.core import Tracer

from jaxscale import _scaler, _skip, _tree


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

  def __getattr__(self, name: str) -> Any:
    # Only for names the state lacks: an attribute of the inner optimizer's state (the
    # `hyperparams` of `optax.inject_hyperparams`) is named with the way to it.
    if name.startswith("__"):
      raise AttributeError(name)
    found = _path_to_attribute(self.inner_state, name)
    where = (
        f"; the inner optimizer's state has it: `opt_state.inner_state{found}.{name}`" if found is not None
        else "; the inner optimizer's state is `opt_state.inner_state`"
    )
    raise AttributeError(
        f"`DynamicLossScalingState` has no attribute {name!r} (its fields are `scaler` and "
        f"`inner_state`){where}."
    )


def _path_to_attribute(tree: Any, name: str, path: str = "") -> str | None:
  """The ``keystr`` path to the first node of ``tree`` (depth first) that has attribute ``name``."""
  if hasattr(tree, name):
    return path
  children = jax.tree_util.tree_flatten_with_path(tree, is_leaf=lambda x: x is not tree)[0]
  for key, child in children:
    if child is not tree:
      found = _path_to_attribute(child, name, path + jax.tree_util.keystr(key))
      if found is not None:
        return found
  return None


def dynamic_loss_scaling(
    inner: optax.GradientTransformation,
    *,
    axis_name: Any = None,
    **init_options: Any,
) -> optax.GradientTransformationExtraArgs:
  """Wraps ``inner`` so that a step whose gradients hold an inf or a NaN is skipped.

  Its update takes the **true** (unscaled) gradients, as every Optax
  transformation does: the gradient site, :func:`jaxscale.value_and_grad`
  (or ``jaxscale.scale`` -> ``jax.grad`` -> :func:`jaxscale.unscale_and_check`
  by hand), is the one place where a scaled gradient exists. So a stateless
  transformation in front of the wrapper sees true gradients: a clip
  (``optax.chain(optax.clip_by_global_norm(1.0), dynamic_loss_scaling(adam))``)
  clips them, as torch users do after ``scaler.unscale_``. A skipped step is
  invisible only to what the wrapper wraps: a momentum, a weight decay or a
  schedule *after* or *around* it would still act on it, so wrap every
  stateful or parameter-dependent transformation
  (``dynamic_loss_scaling(optax.chain(optax.add_decayed_weights(1e-4), adam))``):
  :func:`find_scaler` refuses a state with any transformation after the
  wrapper in an ``optax.chain``. float16 parameters that no
  :func:`jaxscale.master_weights` keeps in float32 are warned about when the
  update is traced. So is an update given no ``finite`` flag (unless the
  wrapper is built with ``enabled=False``): gradients that no gradient site
  computed (plain ``jax.grad``, ``nnx.value_and_grad``) come from a loss that
  nothing scaled, and float16 would train as if unscaled.

  Each update checks the gradients (inf and NaN survive exact unscaling, so
  this is the check of the scaled ones), ANDs the ``finite`` flag of the
  gradient site (``tx.update(grads, state, params, finite=finite)``;
  ``optimizer.update(model, grads, finite=finite)`` for an ``nnx.Optimizer``,
  :func:`jaxscale.flax.apply_gradients` for a Linen ``TrainState``), and runs
  ``inner``. A step that is not finite is skipped: the updates are all zero
  (``-0.0``, so ``optax.apply_updates`` leaves every parameter bit for bit as
  it was) and ``inner``'s state, step count and learning-rate schedule do not
  advance. The scaler then grows or backs off, and the next
  ``jaxscale.find_scaler(opt_state)`` scales the loss by the new scale.

  With gradient accumulation, accumulate inside:
  ``dynamic_loss_scaling(optax.MultiSteps(inner, k))`` checks every
  micro-batch and skips only the bad ones. ``optax.MultiSteps`` or
  ``optax.apply_if_finite`` *around* the wrapper would hide its decisions
  (a window's inf stays in the accumulator; a back-off is thrown away):
  :func:`find_scaler` refuses such a state and says what to write instead.

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
    >>> value, grads, finite = jaxscale.value_and_grad(loss)(jaxscale.find_scaler(opt_state), params)
    >>> grads  # true gradients: the scale exists only inside value_and_grad
    Array([2., 2.], dtype=float32)
    >>> updates, opt_state = tx.update(grads, opt_state, params, finite=finite)
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
  _scaler.build(**init_options)  # validates the options before any tracing
  enabled = init_options.get("enabled", True)

  def init_fn(params):
    inner_state = inner.init(params)
    if any(_is_scaler(x) for x in jax.tree.leaves(inner_state, is_leaf=_is_scaler)):
      raise ValueError(
          "`dynamic_loss_scaling` wraps an optimizer that already holds a loss scaler (a "
          "`dynamic_loss_scaling` inside `inner`): two scales would back off and grow apart, and "
          "`find_scaler` could not tell which one scales the loss. Wrap the optimizer once."
      )
    return DynamicLossScalingState(_scaler.build(**init_options), inner_state)

  def update_fn(updates, state, params=None, *positional, finite=None, **extra_args):
    if positional:
      raise TypeError(
          f"`dynamic_loss_scaling`'s update takes (grads, state, params) and the flag by name, got "
          f"{3 + len(positional)} positional arguments: write `tx.update(grads, state, params, "
          "finite=finite)`."
      )
    require_own_state(state, DynamicLossScalingState, "dynamic_loss_scaling")
    _refuse_misspelt_finite(extra_args)
    _warn_without_master(params, state.inner_state, lambda u, p: inner.update(u, state.inner_state, p, **extra_args)[0],
                         updates)
    if not enabled:
      updates, inner_state = inner.update(updates, state.inner_state, params, **extra_args)
      return updates, state._replace(inner_state=inner_state)
    if finite is None:
      _warn_without_gradient_site()
    # inf and NaN survive exact unscaling, so checking the true gradients is checking the
    # scaled ones; a flag from the gradient site (`jaxscale.value_and_grad`) is ANDed in.
    checked = _scaler.all_finite(updates, axis_name=axis_name)
    if finite is not None:
      finite = _scaler.as_flag(finite)
      if axis_name is not None:  # each device may have checked only its own gradients
        finite = jax.lax.pmin(finite.astype(jnp.int32), axis_name).astype(jnp.bool_)
      checked = checked & finite
    if axis_name is None:
      _warn_if_decisions_part(updates, finite, state.scaler)
    checked = checked & ~state.scaler.stalled
    updates, inner_state = _skip.update_or_keep(
        checked, lambda u, s, p: inner.update(u, s, p, **extra_args), updates, state.inner_state, params
    )
    return updates, DynamicLossScalingState(_scaler.update(state.scaler, checked), inner_state)

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def _warn_if_decisions_part(updates, finite, scaler) -> None:
  """Warns, at trace time, inside ``shard_map`` when the gradients differ between devices (FSDP
  shards, or data-parallel gradients before their mean) over which the scaler is common, and
  neither ``axis_name`` nor a flag reduced over them makes the skip decision common: each device
  would then skip or step on its own, and their scales part. Seen through JAX's varying-axes types
  (``shard_map`` with its default ``check_vma=True``); ``pmap`` has none, and is not seen."""
  own = _varying_axes(scaler)  # axes over which the scalers are the devices' own already
  varying = _varying_axes(updates) - own
  if varying and finite is not None:
    varying &= _varying_axes(finite)
  if not varying:
    return
  axes = ", ".join(repr(a) for a in sorted(varying, key=str))
  warnings.warn(
      f"jaxscale: `dynamic_loss_scaling`'s update got gradients that differ between the devices of "
      f"the mapped axes {axes} and no `axis_name`: each device would skip or step on its own "
      f"gradients alone, and their scales part. Build it with `dynamic_loss_scaling(inner, "
      f"axis_name={axes if len(varying) == 1 else '(' + axes + ')'})` (or pass a flag reduced over "
      "them, `jaxscale.value_and_grad(loss_fn, axis_name=...)`'s).",
      UserWarning,
      stacklevel=3,
  )


def _varying_axes(tree) -> frozenset:
  """The ``shard_map`` axes along which some leaf of ``tree`` differs between devices, as its
  abstract value says (``.vma`` up to jax 0.8, ``.mat.varying`` since); none where it says nothing."""
  typeof = getattr(jax, "typeof", None)
  if typeof is None:
    return frozenset()
  axes: set = set()
  for leaf in jax.tree.leaves(tree):
    aval = typeof(leaf)
    mat = getattr(aval, "mat", None)
    axes.update((getattr(mat, "varying", None) if mat is not None else getattr(aval, "vma", None)) or ())
  return frozenset(axes)


def _warn_without_gradient_site() -> None:
  """Warns, at trace time, for an update given no ``finite`` flag: the gradient sites all return
  one, and the likeliest reason for its absence is the first mistake of a newcomer who changed only
  the optimizer line (``jax.grad`` kept: nothing scales the loss, and float16 trains as if unscaled,
  with a scale that reads 65536 and never skips)."""
  warnings.warn(
      "jaxscale: `dynamic_loss_scaling`'s update got no `finite` flag, the sign of gradients that "
      "no gradient site computed: from `jax.grad` or `nnx.value_and_grad` nothing scales the loss, "
      "and float16 trains as if unscaled (small gradients flush to zero). Take them from "
      "`jaxscale.value_and_grad(loss_fn)(jaxscale.find_scaler(opt_state), params, ...)` (or "
      "`jaxscale.flax.value_and_grad`, `jaxscale.equinox.filter_value_and_grad`) and pass its flag "
      "on: `tx.update(grads, opt_state, params, finite=finite)`, `optimizer.update(model, grads, "
      "finite=finite)` in NNX, `jaxscale.flax.apply_gradients(state, grads=grads, finite=finite)` "
      "for a Linen TrainState. Without loss scaling, build the wrapper with `enabled=False` "
      "(`enabled=jaxscale.needs_loss_scaling(policy)`).",
      UserWarning,
      stacklevel=3,
  )


def _warn_without_master(params, inner_state, inner_update, grads) -> None:
  """Warns, at trace time, for float16 parameters that no ``master_weights`` keeps in float32 and
  that ``inner_update`` (``inner``'s update, as a function of the gradients and the parameters)
  changes: ``inner``'s moments then live in float16 (Adam's second moment overflows at gradients
  of 256), updates below half an ulp vanish, and the run soon goes NaN and skips every step."""
  if params is None or any(
      type(x).__name__ == "MasterWeightsState"
      for x in jax.tree.leaves(inner_state, is_leaf=lambda x: type(x).__name__ == "MasterWeightsState")
  ):
    return
  flat = jax.tree_util.tree_flatten_with_path(params)[0]
  narrow = [i for i, (_, p) in enumerate(flat) if getattr(p, "dtype", None) == jnp.float16]
  if not narrow:
    return
  moving = _moving(inner_update, grads, params)
  narrow = [jax.tree_util.keystr(flat[i][0]) for i in narrow if moving is None or moving[i]]
  if narrow:
    shown = ", ".join(narrow[:3]) + (", ..." if len(narrow) > 3 else "")
    warnings.warn(
        f"jaxscale: `dynamic_loss_scaling` updates float16 parameters ({shown or 'the root'}) with no "
        "float32 master copy: the inner optimizer's state and steps are then float16, its moments "
        "overflow or flush, updates below half an ulp vanish, and the run goes NaN and skips every "
        "step. Keep a master: `jaxscale.master_weights(jaxscale.dynamic_loss_scaling(inner))` (or "
        "`method=\"kahan\"` for 2 bytes a parameter), or store the parameters in float32 and compute "
        "in float16 (`jaxscale.autocast(fun, \"mixed_float16\")`).",
        UserWarning,
        stacklevel=3,
    )


def _moving(inner_update, grads, params) -> list[bool] | None:
  """For each leaf of ``params``: whether its update depends on the gradients or the parameters at
  all (one frozen with ``optax.set_to_zero()`` in an ``optax.multi_transform`` gets a constant 0).
  Read from the update's jaxpr, traced once more, abstractly; None where that trace fails (an
  ``inner`` that needs arguments it was not given) or its updates do not mirror ``params``."""
  try:
    jaxpr = jax.make_jaxpr(inner_update)(grads, params).jaxpr
  except Exception:  # advisory: every parameter then counts as moving
    return None
  live = {id(v) for v in jaxpr.invars}
  for eqn in jaxpr.eqns:  # a nested program counts as one operation on all of its inputs
    if any(id(v) in live for v in eqn.invars):
      live.update(id(v) for v in eqn.outvars)
  if len(jaxpr.outvars) != len(jax.tree.leaves(params)):
    return None
  return [id(v) in live for v in jaxpr.outvars]


def require_own_state(state: Any, state_type: type, function: str) -> None:
  """Raises a TypeError that says what to pass if ``state`` lacks ``state_type``'s fields (a
  checkpoint restored without a target is a dict, whose fields an update would fail to read)."""
  if all(hasattr(state, field) for field in state_type._fields):
    return
  raise TypeError(
      f"`{function}`'s update takes the state its own `init` built (a `{state_type.__name__}`), got "
      f"an object of type {type(state).__name__}; build it with `tx.init(params)` of this wrapped "
      "optimizer, not of the inner one (a checkpoint restored without a target is a dict: restore "
      "it into the structure of `tx.init(params)`)."
  )


def _refuse_misspelt_finite(extra_args):
  """Extra arguments go on to ``inner``, which ignores those it does not take: a misspelt
  ``finite=`` would vanish there. Names close to it are refused."""
  close = [name for name in extra_args if difflib.get_close_matches(name, ["finite"], cutoff=0.7)]
  if close:
    raise TypeError(
        f"`dynamic_loss_scaling`'s update got the argument {close[0]!r}; did you mean `finite=`? "
        "(Other extra arguments go on to the inner optimizer.)"
    )


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
    ValueError: if ``opt_state`` holds no scaler, or more than one, or holds
      the wrapper inside ``optax.MultiSteps`` or ``optax.apply_if_finite``,
      which would hide its decisions, or a transformation after it in an
      ``optax.chain``, which would act on its skipped steps (the message
      says what to write).
    FloatingPointError: outside ``jit``, if the scaler has stalled (see
      ``on_stall`` in :func:`jaxscale.init`): every step since was skipped.

  Examples:
    >>> import jax.numpy as jnp, optax, jaxscale
    >>> tx = optax.chain(optax.add_decayed_weights(1e-4),
    ...                  jaxscale.dynamic_loss_scaling(optax.sgd(0.1), init_scale=512.0))
    >>> jaxscale.find_scaler(tx.init(jnp.zeros(3))).scale
    Array(512., dtype=float32)
  """
  scaler = scaler_of(opt_state)
  if not isinstance(scaler.stalled, Tracer):  # outside `jit`: reading one bool costs nothing new
    _scaler.raise_if_stalled(scaler)
  return scaler


def scaler_of(opt_state: Any) -> _scaler.ScalerState:
  """:func:`find_scaler` without the stall check."""
  found = [
      _as_scaler(leaf)
      for leaf in jax.tree.leaves(opt_state, is_leaf=_is_scaler)
      if _is_scaler(leaf)
  ]
  if isinstance(opt_state, optax.GradientTransformation):
    raise ValueError(
        "`find_scaler` takes an optimizer *state*, got the optimizer itself (a "
        "`GradientTransformation`); pass `opt_state = tx.init(params)` (or `state.opt_state`)."
    )
  _refuse_hidden_decisions(opt_state)
  if len(found) == 1:
    _refuse_transformations_after(opt_state)
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


# What must not hold the wrapper, and what to write instead. Each would hide the wrapper's decisions:
# `MultiSteps` keeps a window's inf in its accumulator (and resets it with `(1 - emit) * acc`, a NaN
# that stays), so every later window is skipped; `apply_if_finite` throws the back-off away with the
# rest of the state of a non-finite step, so the same scale overflows again.
_HIDING = {
    optax.MultiStepsState: (
        "`optax.MultiSteps(dynamic_loss_scaling(inner), k)`: an overflow in one micro-batch would "
        "stay in MultiSteps' accumulator and skip every later window. Accumulate inside the "
        "wrapper, `dynamic_loss_scaling(optax.MultiSteps(inner, k))`: each micro-batch is then "
        "checked, and only the bad ones are skipped."
    ),
    optax.ApplyIfFiniteState: (
        "`optax.apply_if_finite(dynamic_loss_scaling(inner), n)`: on a non-finite step "
        "apply_if_finite throws away the scaler's back-off with the rest of the state, so the "
        "same scale overflows again and again. Drop `apply_if_finite`: `dynamic_loss_scaling` "
        "already skips non-finite steps (or put it inside: `dynamic_loss_scaling(apply_if_finite(inner, n))`)."
    ),
}


def _refuse_hidden_decisions(opt_state):
  hides = lambda x: isinstance(x, tuple(_HIDING))
  for node in jax.tree.leaves(opt_state, is_leaf=lambda x: hides(x) or _is_scaler(x)):
    if hides(node) and any(_is_scaler(x) for x in jax.tree.leaves(node, is_leaf=_is_scaler)):
      raise ValueError(f"The optimizer state holds {_HIDING[type(node)]}")


def _refuse_transformations_after(node) -> None:
  """Raises if, in an ``optax.chain``'s state (a plain tuple; ``optax.named_chain``'s, an
  ``OrderedDict``), a transformation follows the one holding the scaler.

  A skipped step is invisible only inside the wrapper: its ``-0.0`` updates go on through what
  follows, and a momentum (``trace``) adds its velocity, a weight decay its ``wd * params``, a
  schedule counts the step. A transformation's state is a ``NamedTuple`` (``EmptyState()`` for a
  stateless one, which may be harmless, a clip, or not, a weight decay: they cannot be told
  apart), or the ``()`` or ``None`` a transformation of the user's own may keep; the wrapper
  outermost is right for all, so every one after it is refused, as is the wrapper around one
  partition of an ``optax.multi_transform`` (the others step on its skipped steps). A user's own
  tuple (``(opt_state, params)``) holds no ``NamedTuple`` after the scaler, and passes. Older
  optax releases (0.2.5) keep ``named_chain``'s state in a plain dict, whose order ``jit`` sorts:
  it is not checked.
  """
  while not _is_scaler(node):
    children = jax.tree.leaves(node, is_leaf=lambda x: x is not node)
    holding = [i for i, child in enumerate(children) if _holds_scaler(child)]
    if len(holding) != 1:
      return
    i = holding[0]
    if isinstance(node, optax.MultiTransformState) and len(node.inner_states) > 1:
      raise ValueError(
          "The optimizer state holds `dynamic_loss_scaling` around one partition of an "
          "`optax.multi_transform` only: a skipped step is skipped only inside the wrapper, so the "
          "other partitions still step on it (their momentum moves, their gradients, an inf among "
          "them, reach the parameters). Wrap the whole `multi_transform`: "
          "`dynamic_loss_scaling(optax.multi_transform({\"a\": optax.adam(1e-3), \"frozen\": "
          "optax.set_to_zero()}, labels))`."
      )
    chained = list(node) if type(node) is tuple else list(node.values()) if type(node) is OrderedDict else None
    if chained is not None:
      after = [x for child in chained[i + 1:] for x in jax.tree.leaves(child, is_leaf=_is_state) if _is_state(x)]
      # A transformation of the user's own may keep `()` (or `None`) as its state: no leaves.
      after += [x for x in chained[i + 1:] if x is None or (type(x) is tuple and not x)]
      if after:
        names = ", ".join(dict.fromkeys("()" if type(x) is tuple else type(x).__name__ for x in after))
        raise ValueError(
            f"The optimizer state holds a transformation after `dynamic_loss_scaling` in an "
            f"`optax.chain` (its state: {names}). A skipped step is skipped only inside the wrapper: "
            "what follows it still acts on it (a momentum applies its velocity, a weight decay "
            "moves the parameters, a schedule counts the step). Wrap the whole chain instead, "
            "`dynamic_loss_scaling(optax.chain(..., optax.add_decayed_weights(wd), ...))`; a "
            "stateless transformation that must see the true gradients (a clip) may come before "
            "the wrapper: `optax.chain(optax.clip_by_global_norm(1.0), dynamic_loss_scaling(inner))`. "
            "(If this tuple is not a chain's state but two optimizers' states side by side, pass "
            "`find_scaler` the one holding the scaler.)"
        )
    node = children[i]


def _holds_scaler(tree) -> bool:
  return any(_is_scaler(x) for x in jax.tree.leaves(tree, is_leaf=_is_scaler))


def _is_state(x) -> bool:
  """An optimizer state: optax's are ``NamedTuple``s (``EmptyState()`` included)."""
  return isinstance(x, tuple) and hasattr(x, "_fields")


_PACKED = frozenset(_scaler.ScalerState._fields)  # its three leaves: floats, ints, flags
_NAMED = frozenset(_scaler.ScalerState.FIELDS)  # its fifteen fields, as states saved before they were packed hold them


def _is_scaler(x) -> bool:
  """A ScalerState, or a mapping of its leaves: NNX's ``nnx.state`` / ``nnx.split`` views
  and serialized state dicts hold the scaler as such a mapping (of its fifteen fields, in
  states saved before they were packed)."""
  if isinstance(x, _scaler.ScalerState):
    return True
  return isinstance(x, Mapping) and set(x.keys()) in (_PACKED, _NAMED)


def _as_scaler(x) -> _scaler.ScalerState:
  if isinstance(x, _scaler.ScalerState):
    return x
  if set(x.keys()) == _PACKED:
    return _scaler.ScalerState(**{k: x[k] for k in _PACKED})
  return _scaler.ScalerState.of(**{k: _tree.unwrap_variable(x[k]) for k in _NAMED})
