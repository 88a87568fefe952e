"""float16 gradients that overflow in their cast, under XLA:GPU's excess precision.

XLA:GPU (`xla_allow_excess_precision`, on by default) folds a float32 -> float16 -> float32 round
trip away: inside one jitted step, a float16 gradient made by a cast can be read as the float32
value it was cast from. On the CPU these tests check the plain semantics; on a GPU they check that
the folding never makes the skip decision and the update disagree (a step taken on inf gradients,
or a skipped step that changes anything).
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxscale

# These tests hand the wrapper gradients of their own making, with no gradient site: the warning
# for an update without its `finite` flag is tested in tests/test_contract.py.
pytestmark = pytest.mark.filterwarnings("ignore:jaxscale. `dynamic_loss_scaling`'s update got no `finite` flag")

BIG = 7e4  # finite in float32, inf in float16


def loss(params, weights):
  # The cotangent of `astype(float32)` is cast back to float16: BIG becomes inf in the gradient.
  return jnp.sum(params["w"].astype(jnp.float32) * weights)


@pytest.fixture
def problem():
  """float16 parameters without a master on purpose: their float16 gradient is what overflows."""
  params = {"w": jnp.ones(4, jnp.float16)}
  tx = jaxscale.dynamic_loss_scaling(optax.adam(1e-3), init_scale=1.0)
  return params, tx, tx.init(params)


@pytest.mark.filterwarnings("ignore:jaxscale. `dynamic_loss_scaling` updates float16 parameters")
def test_a_returned_gradient_that_overflowed_in_its_cast_skips_the_step(problem):
  params, tx, state = problem

  @jax.jit
  def step(params, state, weights):
    grads = jax.grad(loss)(params, weights)
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state, grads

  new_params, new_state, grads = step(params, state, jnp.array([1.0, BIG, 1.0, 1.0]))
  assert np.isinf(np.asarray(grads["w"], np.float32)).tolist() == [False, True, False, False]
  assert bool(jaxscale.find_scaler(new_state).last_skipped)
  np.testing.assert_array_equal(new_params["w"], params["w"])
  jax.tree.map(np.testing.assert_array_equal, new_state.inner_state, state.inner_state)


@pytest.mark.filterwarnings("ignore:jaxscale. `dynamic_loss_scaling` updates float16 parameters")
def test_a_gradient_kept_inside_the_step_never_corrupts_the_parameters(problem):
  """Not returned, the cast may be folded: skipped or taken, the step must be consistent."""
  params, tx, state = problem

  @jax.jit
  def step(params, state, weights):
    updates, state = tx.update(jax.grad(loss)(params, weights), state, params)
    return optax.apply_updates(params, updates), state

  new_params, new_state = step(params, state, jnp.array([1.0, BIG, 1.0, 1.0]))
  assert jaxscale.all_finite((new_params, new_state.inner_state))
  if bool(jaxscale.find_scaler(new_state).last_skipped):
    np.testing.assert_array_equal(new_params["w"], params["w"])
  else:  # taken on the float32 values XLA kept: Adam's first step moves every weight by -lr
    assert jax.default_backend() != "cpu", "XLA:CPU keeps float16 semantics: the step must be skipped"
    np.testing.assert_allclose(np.asarray(new_params["w"], np.float32), 1 - 1e-3, rtol=1e-3)
