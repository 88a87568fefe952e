"""``jax.value_and_grad`` for a scaled loss."""

from __future__ import annotations

import functools
from typing import Any, Callable, Sequence

import jax

from jaxscale import _history, _interpret, _scaler


def value_and_grad(
    fun: Callable[..., Any],
    argnums: int | Sequence[int] = 0,
    has_aux: bool = False,
    holomorphic: bool = False,
    allow_int: bool = False,
    *,
    axis_name: Any = None,
) -> Callable[..., tuple[Any, Any, jax.Array]]:
  """Like ``jax.value_and_grad``, with the loss scaled inside: the gradient site.

  The returned function takes the scaler state first
  (``jaxscale.find_scaler(opt_state)``, inside the jitted step), then
  ``fun``'s arguments. It multiplies ``fun``'s loss by the scale,
  differentiates, casts the gradients of float16 and bfloat16 parameters to
  float32 *before* it unscales them (in float16, the small true gradients
  that only the scale carried would flush to zero again), unscales and checks
  them. It returns ``(value, grads, finite)``: ``fun``'s own (unscaled) value
  (``(loss, aux)`` with ``has_aux``), the **true gradients**, and a scalar bool
  array that is True iff they are all finite.

  This is the one place where a scaled gradient exists: everything after it
  (a clip, an accumulation, a ``pmean``, ``optax.chain``, a Flax
  ``TrainState``, an ``nnx.Optimizer``) sees the gradients it expects. Pass
  ``finite`` on as ``tx.update(grads, opt_state, params, finite=finite)``, or
  let the wrapper check the gradients itself.

  Args:
    fun: the loss function; returns a scalar loss, or ``(loss, aux)`` with
      ``has_aux``.
    argnums: as in ``jax.grad``: which positional argument(s) to
      differentiate with respect to.
    has_aux: as in ``jax.grad``.
    holomorphic: as in ``jax.grad``: ``fun`` is holomorphic and its inputs
      and loss are complex.
    allow_int: as in ``jax.grad``: integer inputs get ``float0`` gradients,
      which pass through the unscaling and the check untouched.
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
  grad = functools.partial(jax.grad, holomorphic=holomorphic, allow_int=allow_int)
  return value_and_grad_with(grad, fun, argnums, has_aux, axis_name)


def value_and_grad_with(grad, fun, argnums, has_aux, axis_name):
  """:func:`value_and_grad` built on ``grad`` (``jax.grad``, ``nnx.grad``, ...)."""

  def wrapped(state, *args, **kwargs):
    _scaler.require_state(
        state, "value_and_grad(fun)", " The scaler state comes first: `value_and_grad(fun)(scaler, *args)`."
    )
    _scaler.warn_if_constant(state, (args, kwargs), "value_and_grad")
    _refuse_scaling_in_trace(fun, args, kwargs)
    _history.refuse_loss_scale(args, "`jaxscale.value_and_grad`")
    called = python_of(fun)

    def scaled_fun(*args, **kwargs):
      uses = {"scale": 0, "unscale": 0}
      token = _scaler.uses_here.set(uses)
      try:
        out = called(*args, **kwargs)
      finally:
        _scaler.uses_here.reset(token)
      _scaler.refuse_scaling_inside(uses)
      if has_aux and not (isinstance(out, (tuple, list)) and len(out) == 2):
        # `out[0]` of an array would differentiate its first element alone.
        shape = getattr(out, "shape", None)
        what = f"an array of shape {shape}" if shape is not None else f"a {type(out).__name__}"
        raise TypeError(
            f"With `has_aux=True`, `fun` must return a pair `(loss, aux)`, as for `jax.grad`; it returned {what}."
        )
      if not has_aux and isinstance(out, (tuple, list)):
        # Scaled whole, the pair would reach `grad` as a non-scalar output, and JAX's error would
        # show the loss and the aux multiplied by the scale.
        raise TypeError(
            f"`fun` returned a {type(out).__name__} of {len(out)} items, not a scalar loss; if it returns "
            "`(loss, aux)`, pass `has_aux=True`: `jaxscale.value_and_grad(fun, has_aux=True)` (in "
            "`jaxscale.flax.value_and_grad` and `jaxscale.equinox.filter_value_and_grad` too)."
        )
      return _scaler.scale_unchecked(state, out[0] if has_aux else out), out

    grads, value = grad(scaled_fun, argnums=argnums, has_aux=True)(*args, **kwargs)
    grads, finite = _scaler.unscale_and_check_unchecked(state, grads, axis_name=axis_name)
    return value, grads, finite

  return wrapped


def python_of(fun):
  """``fun``, or the Python function that a jit wrapper other than ``jax.jit`` wraps (Equinox's
  ``filter_jit``, Flax's ``nnx.jit``), with any ``functools.partial`` around it kept.

  Called again, such a wrapper reuses its cached trace and runs no Python, so a ``jaxscale.scale``
  inside it would go uncounted; and its jaxpr cannot be read as ``jax.jit``'s is (``nnx.jit``'s
  ``trace`` fills its cache, then returns Flax's own type). Its Python function, traced inside the
  gradient site, is the same computation: under the step's ``jit`` the inner ``jit`` would have
  been inlined anyway.
  """
  if isinstance(fun, functools.partial):
    inner = python_of(fun.func)
    return fun if inner is fun.func else functools.partial(inner, *fun.args, **fun.keywords)
  while _is_other_jit(fun):
    fun = fun.__wrapped__
  return fun


def _is_other_jit(fun) -> bool:
  wraps = callable(getattr(fun, "lower", None)) and callable(getattr(fun, "__wrapped__", None))
  return wraps and not isinstance(fun, _JAX_JIT)


_JAX_JIT = type(jax.jit(abs))


def _refuse_scaling_in_trace(fun, args, kwargs) -> None:
  """:func:`_scaler.refuse_scaling_inside` for a ``fun`` jitted on its own (``jax.jit(loss)``, or a
  ``functools.partial`` of one), read from its jaxpr: traced before, it runs no Python when called
  again, and only the marks that ``jaxscale.scale`` and ``unscale_and_check`` leave in the jaxpr
  show what it does. ``trace`` reuses JAX's cached trace, so this costs no second trace."""
  while isinstance(fun, functools.partial):
    fun, args, kwargs = fun.func, (*fun.args, *args), {**fun.keywords, **kwargs}
  if not isinstance(fun, _JAX_JIT):
    return
  try:
    traced: Any = fun.trace(*args, **kwargs)
    closed = traced.jaxpr
  except Exception:  # the call itself, under `grad`, raises whatever is wrong
    return
  marks = _marks(closed.jaxpr)
  _scaler.refuse_scaling_inside({"scale": marks[_scaler.SCALE_MARK], "unscale": marks[_scaler.UNSCALE_MARK]})


def _marks(jaxpr) -> dict[str, int]:
  """How many times each mark is called in ``jaxpr``, nested programs included; a gradient taken
  inside counts a scale twice (forward and backward), hence any unscale excuses every scale."""
  counts = {_scaler.SCALE_MARK: 0, _scaler.UNSCALE_MARK: 0}
  for eqn in jaxpr.eqns:
    name = eqn.params.get("name")
    if name in counts:
      counts[name] += 1
    for sub in _interpret.subjaxprs(eqn.params):
      for key, n in _marks(sub).items():
        counts[key] += n
  if counts[_scaler.UNSCALE_MARK]:
    counts[_scaler.SCALE_MARK] = 0
  return counts
