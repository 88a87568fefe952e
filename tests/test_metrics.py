"""metrics: the scaler's numbers from an opt_state or a ScalerState, under jit, with no host transfer."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxscale
from _jit import compilations

# These tests hand the wrapper gradients of their own making, with no gradient site: the warning
# for an update without its `finite` flag is tested in tests/test_contract.py.
pytestmark = pytest.mark.filterwarnings("ignore:jaxscale. `dynamic_loss_scaling`'s update got no `finite` flag")

KEYS = {"scale", "growth_tracker", "hysteresis_tracker", "skipped_steps", "last_skipped", "stalled"}


def test_metrics_under_jit_without_host_transfer():
  tx = optax.chain(jaxscale.dynamic_loss_scaling(optax.sgd(0.1), init_scale=8.0, growth_interval=2))
  params = jnp.ones(3)

  @jax.jit
  def step(params, opt_state, grads):
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, jaxscale.metrics(opt_state)

  opt_state = tx.init(params)
  grads = [jnp.ones(3), jnp.array([1.0, jnp.inf, 0.0]), jnp.ones(3), jnp.ones(3), jnp.ones(3)]
  grads = [jax.device_put(g) for g in grads]
  logged = []
  with jax.transfer_guard("disallow"):
    for g in grads:
      params, opt_state, m = step(params, opt_state, g)
      logged.append(m)
  assert compilations(step) == 1
  assert all(set(m) == KEYS for m in logged)
  # The reference: the scaler's rule played by hand (growth_interval=2, backoff 0.5, growth 2).
  assert [float(m["scale"]) for m in logged] == [8.0, 4.0, 4.0, 8.0, 8.0]
  assert [int(m["growth_tracker"]) for m in logged] == [1, 0, 1, 0, 1]
  assert [bool(m["last_skipped"]) for m in logged] == [False, True, False, False, False]
  assert [int(m["skipped_steps"]) for m in logged] == [0, 1, 1, 1, 1]
  assert not any(bool(m["stalled"]) for m in logged)
  assert logged[0]["scale"].dtype == jnp.float32 and logged[0]["skipped_steps"].dtype == jnp.int32


def test_metrics_of_a_scaler_state_and_an_nnx_optimizer():
  from flax import nnx

  state = jaxscale.init(init_scale=16.0)
  np.testing.assert_equal({k: np.asarray(v) for k, v in jaxscale.metrics(state).items()},
                          {k: np.asarray(getattr(state, k)) for k in KEYS})
  model = nnx.Linear(2, 1, rngs=nnx.Rngs(0))
  optimizer = nnx.Optimizer(model, jaxscale.dynamic_loss_scaling(optax.sgd(0.1), init_scale=32.0), wrt=nnx.Param)
  m = jax.jit(jaxscale.metrics)(optimizer.opt_state)
  assert float(m["scale"]) == 32.0 and all(isinstance(v, jax.Array) for v in m.values())


def test_no_scaler():
  with pytest.raises(ValueError, match="no ScalerState"):
    jaxscale.metrics(optax.sgd(0.1).init(jnp.ones(2)))


# --- a stalled run: `metrics` outside `jit` raises, as `find_scaler` does; inside, `stalled` says it --


def stalled_run(tx, params, steps):
  """A jitted step whose every gradient holds a NaN (a NaN model), returning `metrics` as it logs."""

  @jax.jit
  def step(params, opt_state):
    updates, opt_state = tx.update(jnp.full_like(params, jnp.nan), opt_state, params)
    return optax.apply_updates(params, updates), opt_state, jaxscale.metrics(opt_state)

  opt_state = tx.init(params)
  for _ in range(steps):
    params, opt_state, logged = step(params, opt_state)
  return params, opt_state, logged


def test_metrics_of_a_stalled_run_raise_outside_jit_and_report_the_flag_inside():
  tx = jaxscale.dynamic_loss_scaling(optax.sgd(0.1), init_scale=2.0**-124)
  params, opt_state, logged = stalled_run(tx, jnp.ones(3), 2)  # 2**-124 -> 2**-125: not yet
  assert not bool(logged["stalled"]) and set(jaxscale.metrics(opt_state)) == KEYS
  params, opt_state, logged = stalled_run(tx, jnp.ones(3), 3)  # the floor, then an overflow there
  assert bool(logged["stalled"]) and int(logged["skipped_steps"]) == 3  # in the step: the flag
  with pytest.raises(FloatingPointError, match="every step since has been skipped"):
    jaxscale.metrics(opt_state)  # where the host logs: told
  with pytest.raises(FloatingPointError, match="every step since has been skipped"):
    jaxscale.metrics(opt_state.scaler)  # a ScalerState too
  np.testing.assert_array_equal(params, jnp.ones(3))  # every step was skipped


def test_metrics_of_a_stalled_static_scale_raise_too():
  tx = jaxscale.dynamic_loss_scaling(optax.sgd(0.1), init_scale=2.0**-124, dynamic=False)
  _, opt_state, logged = stalled_run(tx, jnp.ones(3), 2)  # two halvings would reach 2**-126
  assert not bool(logged["stalled"])
  _, opt_state, logged = stalled_run(tx, jnp.ones(3), 3)  # where the dynamic scale stalls
  assert bool(logged["stalled"]) and float(logged["scale"]) == 2.0**-124
  with pytest.raises(FloatingPointError, match="static loss scale"):
    jaxscale.metrics(opt_state)


def test_metrics_of_a_stalled_nnx_optimizer_raise_outside_jit():
  from flax import nnx

  model = nnx.Linear(2, 1, rngs=nnx.Rngs(0))
  optimizer = nnx.Optimizer(model, jaxscale.dynamic_loss_scaling(optax.sgd(0.1), init_scale=2.0**-126), wrt=nnx.Param)

  @nnx.jit
  def step(model, optimizer):
    grads = jax.tree.map(lambda p: jnp.full_like(p, jnp.nan), nnx.state(model, nnx.Param))
    optimizer.update(model, grads)
    return jaxscale.metrics(optimizer.opt_state)

  assert bool(step(model, optimizer)["stalled"])  # the scale was at its floor already
  with pytest.raises(FloatingPointError, match="every step since has been skipped"):
    jaxscale.metrics(optimizer.opt_state)
