"""Master weights: float16 / bfloat16 parameters updated through a float32 copy.

A step on 16-bit parameters loses every update below half a unit in the last
place (for float16 near 1.0: 2**-11), so a small learning rate stops learning.
``master_weights(inner)`` keeps a float32 master copy of each 16-bit parameter::

    grads32 = float32(grads)                 # before the scaler unscales them
    updates32, inner_state = inner.update(grads32, inner_state, master)
    master = master + updates32              # accumulates in float32
    updates = float32(param_dtype(master)) - params

so that ``optax.apply_updates(params, updates)`` is the master cast to the
parameters' dtype. On a step ``dynamic_loss_scaling`` skips, its updates are
``-0.0``: ``master + -0.0`` is the master bit for bit, and so are the parameters
and the inner state. Parameters of 32 or more bits pass through with no copy.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from jaxscale import _policy


class MasterWeightsState(NamedTuple):
  """State of :func:`master_weights`.

  Examples:
    >>> import jax.numpy as jnp, optax, jaxscale
    >>> params = {"w": jnp.ones(2, jnp.float16), "b": jnp.zeros(1)}
    >>> state = jaxscale.master_weights(optax.sgd(0.1)).init(params)
    >>> state.master["w"].dtype, state.master["b"]  # float32 params need no copy
    (dtype('float32'), MaskedNode())
  """

  master: Any  # like params: a float32 copy of each 16-bit leaf, `optax.MaskedNode()` elsewhere
  inner_state: optax.OptState

  # Read by `dynamic_loss_scaling`, which refuses to wrap this state: inside it, the scaler would
  # unscale the float16 gradients in float16, flushing the small ones before the master sees them.
  not_inside_dynamic_loss_scaling = (
      "`dynamic_loss_scaling(master_weights(inner))` unscales float16 gradients in float16, where small "
      "ones flush to zero; nest them the other way round: `master_weights(dynamic_loss_scaling(inner))`."
  )


def master_weights(inner: optax.GradientTransformation) -> optax.GradientTransformationExtraArgs:
  """Runs ``inner`` on a float32 master copy of float16 / bfloat16 parameters.

  Put the loss scaler inside: ``master_weights(dynamic_loss_scaling(inner))``.
  The float16 gradients are then cast to float32 *before* they are
  unscaled; unscaled in float16, true gradients below 2**-24 would flush to
  zero again. (The other order is refused by :func:`dynamic_loss_scaling`.)

  The returned updates are float32, and ``optax.apply_updates(params,
  updates)`` equals ``master.astype(params.dtype)`` exactly, as values (a
  parameter the step leaves unchanged keeps its bits), whenever
  ``target - param`` is a normal float32 number: for float16 always, unless
  in one step a parameter shrinks by a factor above 2**12 or leaves an
  infinity (``apply_updates`` adds in at most float32, and no float32 update
  can then land on the target: the last bits may differ); for bfloat16 the
  same with 2**15, and not for values or steps below 2**-126 (float32
  subnormals, which XLA flushes to zero). Float32, float64 and non-floating parameters
  pass through to ``inner`` untouched. Under strict dtype promotion, add the
  updates as ``(p.astype(u.dtype) + u).astype(p.dtype)``.

  Args:
    inner: the optimizer, usually ``dynamic_loss_scaling(...)`` around it.

  Returns:
    An ``optax.GradientTransformationExtraArgs`` whose state is a
    :class:`MasterWeightsState`. Its ``update`` needs ``params``; extra
    arguments go on to ``inner``.

  Raises:
    ValueError: from ``update``, when it is called without ``params``.

  Examples:
    >>> import jax.numpy as jnp, optax, jaxscale
    >>> params = jnp.ones(2, jnp.float16)
    >>> tx = jaxscale.master_weights(optax.sgd(1e-4))
    >>> state = tx.init(params)
    >>> for _ in range(10):  # each step alone is below float16's half-ulp at 1.0
    ...   updates, state = tx.update(jnp.ones(2, jnp.float16), state, params)
    ...   params = optax.apply_updates(params, updates)
    >>> params  # plain sgd(1e-4) would leave them at 1.0
    Array([0.999, 0.999], dtype=float16)
  """
  inner = optax.with_extra_args_support(inner)

  def init_fn(params):
    master = jax.tree.map(lambda p: p.astype(jnp.float32) if _is_narrow(p) else optax.MaskedNode(), params)
    return MasterWeightsState(master, inner.init(_with_master(params, master)))

  def update_fn(updates, state, params=None, **extra_args):
    if params is None:
      raise ValueError(
          "`master_weights` needs the parameters: call `tx.update(grads, opt_state, params)`."
      )
    full = _with_master(params, state.master)
    grads = jax.tree.map(lambda g, p: g.astype(jnp.float32) if _is_narrow(p) else g, updates, params)
    inner_updates, inner_state = inner.update(grads, state.inner_state, full, **extra_args)
    new_full = optax.apply_updates(full, inner_updates)
    master = jax.tree.map(lambda p, m: m if _is_narrow(p) else optax.MaskedNode(), params, new_full)
    updates = jax.tree.map(
        lambda p, m, u: _step_to(p, m) if _is_narrow(p) else u, params, new_full, inner_updates
    )
    return updates, MasterWeightsState(master, inner_state)

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def _step_to(param: jax.Array, master: jax.Array) -> jax.Array:
  """A float32 update with which ``param + update``, cast back, is ``master.astype(param.dtype)``.

  Both ``target`` and ``param`` are 16-bit values, so their float32
  difference is exact unless their exponents are far apart; ``param + delta``
  is then ``target`` itself. The update goes in float32 because in the
  parameters' dtype the difference itself would round (or overflow).
  """
  # The barrier keeps the cast: XLA:GPU folds a float32 -> float16 -> float32 round trip away
  # (`xla_allow_excess_precision`), which would make `target` the unrounded master.
  target = jax.lax.optimization_barrier(master.astype(param.dtype)).astype(jnp.float32)
  delta = target - param.astype(jnp.float32)
  # `x + -0.0` is x bit for bit, even for x = -0.0 (where `x + 0.0` is +0.0).
  return jnp.where(delta == 0, jnp.float32(-0.0), delta)


def _with_master(params, master):
  """``params`` with each 16-bit leaf replaced by its float32 master."""
  return jax.tree.map(lambda p, m: m if _is_narrow(p) else p, params, master)


def _is_narrow(x) -> bool:
  return _policy.is_floating_array(x) and jnp.finfo(x.dtype).bits < 32
