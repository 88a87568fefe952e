"""Autocast: a function transform that runs a function in the policy's compute dtype.

``autocast(fun, policy)`` is ``fun`` with its floating inputs cast to
``policy.compute_dtype`` and its floating outputs cast to ``policy.output_dtype``::

    autocast(fun, policy)(*args) == policy.cast_to_output(fun(*policy.cast_to_compute(args)))

A cast is differentiable and its transpose casts back, so gradients with respect to
float32 inputs arrive in float32. Unlike ``torch.autocast`` there is no global or
thread-local flag: the region is the function, and a nested ``autocast`` governs its own
region, since it casts its own inputs (``enabled=False`` is the identity, so its region
runs in whatever dtype its inputs already have, as torch's does). What ``fun``
receives as arguments is cast, and ``fun`` itself when it is a pytree (an NNX
module, or the NNX module whose bound method it is); parameters reached through a
plain closure are not: pass them as arguments.
An NNX module is cast like any pytree, into new Variables; what ``fun`` assigns to them
(RNG counts, batch statistics) is written back to the module's own, in their dtype.
"""

from __future__ import annotations

import functools
import inspect
import sys
from typing import Callable, TypeVar, Union

import jax

from jaxscale import _policy

F = TypeVar("F", bound=Callable)


def autocast(fun: F, policy: Union[_policy.Policy, str], *, enabled: bool = True) -> F:
  """``fun`` run in ``policy.compute_dtype``, returning ``policy.output_dtype``.

  Floating array inputs (in any pytree, Flax variables and NNX modules
  included) are cast to the compute dtype and floating outputs to the output
  dtype; integers, bools, PRNG keys and Python scalars pass through. So a
  model written without any ``dtype=`` argument runs in float16, and
  ``jax.grad`` of the wrapped function returns gradients in the dtype of the
  parameters passed in.

  Args:
    fun: any function of pytrees.
    policy: a :class:`Policy`, or a string for :func:`get_policy`.
    enabled: False returns ``fun`` itself.

  Returns:
    The wrapped function.

  Raises:
    ValueError: if ``enabled`` is not a Python bool, or the policy string is
      not understood.
    TypeError: if ``policy`` is neither a :class:`Policy` nor a string.

  Examples:
    >>> import jax, jax.numpy as jnp, jaxscale
    >>> def loss(w, x):
    ...   print("computing in", (x @ w).dtype)
    ...   return jnp.sum(x @ w)
    >>> grads = jax.grad(jaxscale.autocast(loss, "mixed_float16"))(jnp.ones(3), jnp.ones((2, 3)))
    computing in float16
    >>> grads.dtype
    dtype('float32')
  """
  if not isinstance(enabled, bool):
    raise ValueError(f"`autocast`'s `enabled` must be a Python bool, got {enabled!r}.")
  policy = _policy.get_policy(policy)
  if not enabled:
    return fun

  # An NNX module called as `fun`, or whose method `fun` is, holds the parameters itself: as a
  # pytree (`Partial` for a method) it is cast like the arguments.
  callee = jax.tree_util.Partial(fun.__func__, fun.__self__) if inspect.ismethod(fun) else fun

  @functools.wraps(fun)
  def wrapped(*args, **kwargs):
    cast_callee, cast_args, cast_kwargs = policy.cast_to_compute((callee, args, kwargs))
    variables = _nnx_variables((callee, args, kwargs), (cast_callee, cast_args, cast_kwargs))
    out = cast_callee(*cast_args, **cast_kwargs)
    for original, copy, before in variables:
      after = _get(copy)
      if after is not before:  # `fun` assigned it: an RNG count, batch statistics
        _set(original, policy.cast_to_param(after) if _policy.is_floating_array(_get(original)) else after)
    return policy.cast_to_output(out)

  return wrapped  # type: ignore[return-value]


def _nnx_variables(originals, copies) -> list:
  """``(original, cast copy, copy's value)`` for each NNX Variable among the arguments.

  The cast gives an NNX module new Variables; what ``fun`` writes into them
  (RNG stream counts, batch statistics) is copied back to the originals, in
  their own dtype, so that state updates inside the region are not lost.
  Found through sys.modules: jaxscale must not import flax.
  """
  nnx = sys.modules.get("flax.nnx")
  if nnx is None:
    return []
  is_variable = lambda x: isinstance(x, nnx.Variable)  # noqa: E731
  pairs = zip(jax.tree.leaves(originals, is_leaf=is_variable), jax.tree.leaves(copies, is_leaf=is_variable))
  return [(o, c, _get(c)) for o, c in pairs if is_variable(o) and is_variable(c)]


def _get(variable):
  # `get_value`/`set_value` are flax >= 0.12.1, which deprecates `.value`.
  get_value = getattr(variable, "get_value", None)
  return get_value() if callable(get_value) else variable.value


def _set(variable, value):
  set_value = getattr(variable, "set_value", None)
  if callable(set_value):
    set_value(value)
  else:
    variable.value = value
