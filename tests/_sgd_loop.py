"""jaxscale's side of the step-for-step comparisons with torch and the peers.

One jitted step of ``dynamic_loss_scaling(inner)`` on ``sum(w * g)``, whose gradient is exactly
``g``: the parameters start at ones, and every step's scale, growth tracker and parameters are
recorded.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax

import jaxscale
from _jit import compilations


def run(grads, inner, **options):
  """Returns ``(trajectory, opt_state)``: ``(scale, growth_tracker, w)`` after each row of ``grads``."""
  tx = jaxscale.dynamic_loss_scaling(inner, **options)
  w = jnp.ones(grads.shape[1], jnp.float32)
  opt_state = tx.init(w)

  @jax.jit
  def step(w, opt_state, g):
    _, grads, finite = jaxscale.value_and_grad(lambda w: jnp.sum(w * g))(jaxscale.find_scaler(opt_state), w)
    updates, opt_state = tx.update(grads, opt_state, w, finite=finite)
    return optax.apply_updates(w, updates), opt_state

  trajectory = []
  for g in grads:
    w, opt_state = step(w, opt_state, g)
    scaler = jaxscale.find_scaler(opt_state)
    trajectory.append((float(scaler.scale), int(scaler.growth_tracker), np.asarray(w)))
  assert compilations(step) == 1
  return trajectory, opt_state
