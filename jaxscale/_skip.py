"""Skipping a step: run an update, and keep the old state where its gradients were not finite.

A skipped step must be invisible: the parameters, the inner optimizer's state,
its step count, a master copy, a compensation buffer and a PRNG key all stay
bit for bit as they were. Every transformation of jaxscale that skips
(``dynamic_loss_scaling``, and ``master_weights`` reading the decision of a
scaler inside it) does it with the pieces below::

    updates, state = update_or_keep(finite, inner_update, grads, state, params)
        # inner_update runs on every step, fed zero gradients when not finite;
        # updates = finite ? new_updates : -0.0    (apply_updates changes no bit)
        # state   = finite ? new_state   : state   (a select per leaf)
    x = keep(skipped, old, new)                   # one leaf: old when skipped

A select on the outputs, not a ``lax.cond`` around the update: public JAX
only, one compiled step with no branch and no host sync, the same algorithm
eagerly and under ``jit``; on an H100 it is as fast as selecting each state
leaf where it is produced (benchmarks/NOTES.md has the measurements).
"""

from __future__ import annotations

import functools
import operator
from typing import Any, Callable

import jax
import jax.numpy as jnp

from jaxscale import _scaler, _tree


def update_or_keep(finite: jax.Array, update: Callable, updates: Any, inner_state: Any, params: Any):
  """``update(updates, inner_state, params)`` if ``finite``, else ``(-0.0, inner_state)``.

  On a skipped step ``update`` is fed zero gradients, so what it computes from
  values it closes over (a traced learning rate) stays finite.

  Derivatives through a skipped step (meta-learning, hyperparameter
  gradients) must be zero, not NaN: the updates are masked, but reverse mode
  multiplies their zero cotangent by the derivatives of whatever ``update``
  computed from the inf gradients or the old state (Adam's bias correction
  at count 0 is 0/0): the ``where`` trap. So every input of ``update`` passes
  through :func:`_no_derivative_unless`, the identity (no op in the compiled
  step) whose derivative is zero on a skipped step; the kept state keeps its
  derivative with respect to the old state.
  """
  zeroed = jax.tree.map(lambda u: keep(finite, jnp.zeros_like(u), u) if _tree.is_floating(u) else u, updates)
  new_updates, new_state = update(*_gate_tree(finite, (zeroed, inner_state, params)))
  _check_state_structure(new_state, inner_state)
  return (
      jax.tree.map(lambda u: mask(finite, u), new_updates),
      jax.tree.map(lambda n, o: keep(finite, o, jnp.asarray(n, jnp.result_type(n))), new_state, inner_state),
  )


def keep(finite: jax.Array, old: Any, new: Any) -> jax.Array:
  """``new`` if ``finite``, else ``old``, in ``new``'s dtype."""
  new = jnp.asarray(new)
  return jnp.where(finite, new, jnp.asarray(old, new.dtype))


def mask(finite: jax.Array, update: Any) -> jax.Array:
  """The update if ``finite``, else -0.0: ``x + -0.0`` is ``x`` bit for bit, even for ``x = -0.0``."""
  return keep(finite, -0.0, update)


def skipped_inside(inner_state: Any) -> jax.Array:
  """Whether a ``dynamic_loss_scaling`` inside ``inner_state`` skipped this step (False if none)."""
  is_scaler = lambda x: isinstance(x, _scaler.ScalerState)
  flags = [s.last_skipped for s in jax.tree.leaves(inner_state, is_leaf=is_scaler) if is_scaler(s)]
  # A scalar of its own, behind a barrier: read from the scaler's packed flags by every leaf's
  # kernel, the packed array is an operand they share, and XLA then merges the kernels of many
  # leaves into one, whose compile time grows faster than its size (benchmarks/NOTES.md).
  if not flags:
    return jnp.asarray(False)  # a constant XLA folds away, with every select on it
  return jax.lax.optimization_barrier(functools.reduce(operator.or_, flags))


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
