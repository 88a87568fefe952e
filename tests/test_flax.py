"""Flax integration: Linen TrainState and NNX Optimizer, float16 compute, jitted once."""

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from flax.training import train_state

import jaxscale
from _bitwise import assert_bitwise_equal
from _jit import compilations
import jaxscale.flax

IN, HIDDEN, OUT = 8, 16, 1
INIT_SCALE = 2.0**10


@pytest.fixture(autouse=True)
def fresh_trace_counter():
  # chex counts traces per function body; each parameterisation defines its own step.
  chex.clear_trace_counter()


def batches():
  """A poisoned batch (it overflows float16 in the forward pass), then finite ones."""
  rng = np.random.default_rng(0)
  x = jnp.asarray(rng.normal(size=(32, IN)), jnp.float32)
  y = jnp.sum(x[:, :2], axis=1, keepdims=True)
  yield x * 1e5, y  # 1e5 > float16's largest finite, 65504
  for _ in range(20):
    yield x, y


def mse(pred, y):
  return jnp.mean((pred.astype(jnp.float32) - y) ** 2)


def check_run(losses, params_history, scalers):
  """The poisoned step was skipped bit for bit, the scale halved, and the finite steps trained."""
  chex.assert_trees_all_equal(params_history[0], params_history[1])  # bitwise
  assert float(scalers[0].scale) == INIT_SCALE / 2
  assert bool(scalers[0].last_skipped) and int(scalers[0].skipped_steps) == 1
  assert not any(bool(s.last_skipped) for s in scalers[1:])
  assert float(scalers[-1].scale) == INIT_SCALE / 2
  assert losses[-1] < 0.5 * losses[1], losses


class LinenMLP(nn.Module):
  @nn.compact
  def __call__(self, x):
    kw = dict(dtype=jnp.float16, param_dtype=jnp.float32)
    return nn.Dense(OUT, **kw)(nn.relu(nn.Dense(HIDDEN, **kw)(x)))


@pytest.mark.parametrize("recipe", ["apply_gradients", "finite_flag", "by_hand"])
def test_linen_train_state(recipe):
  model = LinenMLP()
  x0, _ = next(batches())
  state = train_state.TrainState.create(
      apply_fn=model.apply,
      params=model.init(jax.random.key(0), x0),
      tx=jaxscale.dynamic_loss_scaling(optax.adam(1e-2), init_scale=INIT_SCALE),
  )
  # TrainState.create starts `step` as a Python int, which would compile twice.
  state = state.replace(step=jnp.zeros((), jnp.int32))

  @jax.jit
  @chex.assert_max_traces(n=1)
  def train_step(state, x, y):
    scaler = jaxscale.find_scaler(state.opt_state)
    loss_fn = lambda params: mse(state.apply_fn(params, x), y)
    if recipe == "apply_gradients":  # Flax's apply_gradients, the flag passed on
      loss, grads, finite = jaxscale.value_and_grad(loss_fn)(scaler, state.params)
      return jaxscale.flax.apply_gradients(state, grads=grads, finite=finite), loss
    if recipe == "by_hand":  # the gradient site written out
      grads = jax.grad(lambda p: jaxscale.scale(scaler, loss_fn(p)))(state.params)
      grads, finite = jaxscale.unscale_and_check(scaler, grads)
      loss = loss_fn(state.params)
    else:
      loss, grads, finite = jaxscale.value_and_grad(loss_fn)(scaler, state.params)
    updates, opt_state = state.tx.update(grads, state.opt_state, state.params, finite=finite)
    params = optax.apply_updates(state.params, updates)
    return state.replace(step=state.step + 1, params=params, opt_state=opt_state), loss

  losses, params_history, scalers = [], [state.params], []
  for x, y in batches():
    state, loss = train_step(state, x, y)
    losses.append(float(loss))
    params_history.append(state.params)
    scalers.append(jaxscale.find_scaler(state.opt_state))
  check_run(losses, params_history, scalers)
  assert compilations(train_step) == 1
  # Flax's counter counts the skipped step; the inner Adam's does not.
  assert int(state.step) == 21
  assert int(state.opt_state.inner_state[0].count) == 20


class NNXMLP(nnx.Module):
  def __init__(self, rngs):
    kw = dict(dtype=jnp.float16, param_dtype=jnp.float32, rngs=rngs)
    self.hidden = nnx.Linear(IN, HIDDEN, **kw)
    self.out = nnx.Linear(HIDDEN, OUT, **kw)

  def __call__(self, x):
    return self.out(nnx.relu(self.hidden(x)))


@pytest.mark.parametrize("recipe", ["finite_flag", "no_flag"])
@pytest.mark.filterwarnings("ignore:jaxscale. `dynamic_loss_scaling`'s update got no `finite` flag")
def test_nnx_optimizer(recipe):
  model = NNXMLP(nnx.Rngs(0))
  tx = jaxscale.dynamic_loss_scaling(optax.adam(1e-2), init_scale=INIT_SCALE)
  optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)

  @nnx.jit
  @chex.assert_max_traces(n=1)
  def train_step(model, optimizer, x, y):
    scaler = jaxscale.find_scaler(optimizer.opt_state)
    loss_fn = lambda model: mse(model(x), y)
    loss, grads, finite = jaxscale.flax.value_and_grad(loss_fn)(scaler, model)
    if recipe == "no_flag":  # true gradients: tx.update checks them itself
      optimizer.update(model, grads)
    else:
      optimizer.update(model, grads, finite=finite)
    return loss

  params = lambda: jax.tree.map(jnp.copy, nnx.to_pure_dict(nnx.state(model, nnx.Param)))
  losses, params_history, scalers = [], [params()], []
  for x, y in batches():
    losses.append(float(train_step(model, optimizer, x, y)))
    params_history.append(params())
    scalers.append(jaxscale.find_scaler(optimizer.opt_state))
  check_run(losses, params_history, scalers)
  assert int(optimizer.step[...]) == 21  # NNX's own counter counts the skipped step
  assert int(jaxscale.find_scaler(optimizer.opt_state).growth_tracker) == 20


def test_find_scaler_in_every_nnx_view_gives_plain_arrays():
  """An nnx.Optimizer's opt_state, nnx.state, nnx.split and the OptState filter: the scaler as plain arrays,
  bit for bit the one `init` builds, usable by `jaxscale.scale` eagerly and inside nnx.jit."""
  model = NNXMLP(nnx.Rngs(0))
  options = dict(init_scale=2.0**9, growth_interval=7)
  optimizer = nnx.Optimizer(model, jaxscale.dynamic_loss_scaling(optax.sgd(0.1), **options), wrt=nnx.Param)
  want = jaxscale.init(**options)
  _, split_state = nnx.split(optimizer)
  for where in [optimizer.opt_state, nnx.state(optimizer), split_state, nnx.state(optimizer, nnx.OptState)]:
    found = jaxscale.find_scaler(where)
    assert type(found) is jaxscale.ScalerState
    assert all(isinstance(leaf, jax.Array) and not isinstance(leaf, nnx.Variable) for leaf in found)
    assert_bitwise_equal(found, want)
    assert jaxscale.scale(found, jnp.float16(0.5)).dtype == jnp.float16
  plain = jaxscale.init(**options)  # with flax.nnx imported, plain arrays pass through untouched
  assert all(a is b for a, b in zip(jaxscale.find_scaler({"s": plain}), plain))

  @nnx.jit
  def scaled(optimizer, loss):
    return jaxscale.scale(jaxscale.find_scaler(optimizer.opt_state), loss)

  assert float(scaled(optimizer, jnp.float32(0.5))) == 2.0**8


# --- the true gradients of jaxscale.value_and_grad, in Flax's own update calls -----------------------


def quadratic(params):
  return jnp.sum(params["w"] ** 2)


def test_train_state_with_value_and_grad_is_plain_sgd_on_the_true_gradients():
  params = {"w": jnp.array([1.0, -2.0, 3.0])}
  tx = jaxscale.dynamic_loss_scaling(optax.sgd(0.1), init_scale=INIT_SCALE)
  state = train_state.TrainState.create(apply_fn=None, params=params, tx=tx)

  @jax.jit
  def step(state):
    scaler = jaxscale.find_scaler(state.opt_state)
    _, grads, finite = jaxscale.value_and_grad(quadratic)(scaler, state.params)
    return jaxscale.flax.apply_gradients(state, grads=grads, finite=finite)

  state = step(state)
  np.testing.assert_array_equal(state.params["w"], params["w"] - 0.1 * 2 * params["w"])  # plain SGD
  assert int(state.step) == 1  # Flax's own apply_gradients counted the step
  assert int(jaxscale.find_scaler(state.opt_state).growth_tracker) == 1


def test_nnx_optimizer_with_value_and_grad_is_plain_sgd_on_the_true_gradients():
  model = nnx.Linear(2, 1, rngs=nnx.Rngs(0))
  optimizer = nnx.Optimizer(model, jaxscale.dynamic_loss_scaling(optax.sgd(0.5), init_scale=INIT_SCALE), wrt=nnx.Param)
  bias = model.bias[...]

  @nnx.jit
  def step(model, optimizer):
    scaler = jaxscale.find_scaler(optimizer.opt_state)
    _, grads, finite = jaxscale.flax.value_and_grad(lambda m: jnp.sum(m(jnp.ones((1, 2)))))(scaler, model)
    optimizer.update(model, grads, finite=finite)

  step(model, optimizer)
  np.testing.assert_array_equal(model.bias[...], bias - 0.5)  # d(sum)/d(bias) = 1


def test_train_state_with_gradients_clipped_by_hand_trains_on_the_clipped_true_gradients():
  # Under the old contract these were scaled gradients clipped by hand: no learning.
  params = {"w": jnp.array([1.0, -2.0, 3.0])}
  tx = jaxscale.dynamic_loss_scaling(optax.sgd(0.1), init_scale=INIT_SCALE)
  state = train_state.TrainState.create(apply_fn=None, params=params, tx=tx)

  @jax.jit
  def step(state):
    scaler = jaxscale.find_scaler(state.opt_state)
    _, grads, finite = jaxscale.value_and_grad(quadratic)(scaler, state.params)
    grads = jax.tree.map(lambda g: jnp.clip(g, -1.0, 1.0), grads)  # clipped by hand
    return jaxscale.flax.apply_gradients(state, grads=grads, finite=finite)

  state = step(state)
  # Plain SGD on the clipped gradient of sum(w**2), 2w: [2, -4, 6] clipped to [1, -1, 1]; exact
  # (the scale is a power of two, and 0.1 * 1 rounds as it does in the reference).
  np.testing.assert_array_equal(state.params["w"], params["w"] - 0.1 * jnp.array([1.0, -1.0, 1.0]))


def test_train_state_with_a_scaler_found_outside_the_step_warns_at_trace_time():
  params = {"w": jnp.array([1.0, -2.0, 3.0])}
  state = train_state.TrainState.create(apply_fn=None, params=params, tx=jaxscale.dynamic_loss_scaling(optax.sgd(0.1)))
  scaler = jaxscale.find_scaler(state.opt_state)  # outside the step: a constant of it

  @jax.jit
  def step(state):
    _, grads, finite = jaxscale.value_and_grad(quadratic)(scaler, state.params)
    return jaxscale.flax.apply_gradients(state, grads=grads, finite=finite)

  with pytest.warns(UserWarning, match=r"constant of the traced computation.*jaxscale.find_scaler\(opt_state\)"):
    step(state)


def test_from_dynamic_scale_resumes_a_flax_run_step_for_step():
  from flax.training.dynamic_scale import DynamicScale

  flags = [True] * 5 + [False] + [True] * 9 + [False, False] + [True] * 8
  step = jax.jit(lambda ds, g: ds.value_and_grad(lambda w: jnp.sum(w * g))(jnp.ones(2))[:2])
  dyn = DynamicScale(growth_interval=3, scale=jnp.float32(2.0**10), fin_steps=jnp.int32(0))
  for finite in flags[:7]:  # before the migration: a checkpoint holds `dyn`
    dyn, _ = step(dyn, jnp.array([1.0, 1.0 if finite else jnp.inf]))
  state = jaxscale.flax.from_dynamic_scale(dyn)
  for finite in flags[7:]:  # after: both go on, the same way
    dyn, is_fin = step(dyn, jnp.array([1.0, 1.0 if finite else jnp.inf]))
    state = jaxscale.update(state, is_fin)
    assert float(state.scale) == float(dyn.scale)
    assert int(state.growth_tracker) == int(dyn.fin_steps)
  assert float(dyn.scale) != 2.0**10  # it grew and backed off on the way


def test_from_dynamic_scale_refuses_other_objects():
  with pytest.raises(TypeError, match="DynamicScale"):
    jaxscale.flax.from_dynamic_scale(jaxscale.init())


@pytest.mark.parametrize("wrap", [nnx.jit, lambda f: f], ids=["nnx_jit", "eager"])
@pytest.mark.parametrize("before", ["cold", "traced_once"])
def test_an_nnx_jitted_loss_that_scales_itself_is_refused_whatever_ran_before(wrap, before):
  # `nnx.jit` reuses its trace and runs no Python when called again; even cold, a trace of it
  # taken to read its jaxpr would fill that cache. The gradient site traces the function it wraps.
  model = nnx.Linear(IN, OUT, rngs=nnx.Rngs(0))
  x, y = next(batches())[0] / 1e5, jnp.zeros((32, OUT))
  scaler = jaxscale.init(init_scale=INIT_SCALE)

  @nnx.jit
  def loss_scaled_inside(model, scaler):
    return jaxscale.scale(scaler, mse(model(x), y))

  if before == "traced_once":
    loss_scaled_inside(model, scaler)
  for _ in range(2):
    with pytest.raises(ValueError, match="called `jaxscale.scale` and did not unscale"):
      wrap(lambda m, s: jaxscale.flax.value_and_grad(loss_scaled_inside)(s, m, s))(model, scaler)


FORGOTTEN = r"got no `finite` flag.*`jaxscale.value_and_grad"


@pytest.mark.parametrize("wrap", [jax.jit, lambda f: f], ids=["jit", "eager"])
def test_a_linen_step_that_kept_jax_grad_warns_and_the_documented_one_does_not(wrap):
  # The first mistake of a user coming from DynamicScale or apply_if_finite: only the optimizer line
  # changed. Nothing scales the loss, the scale reads 65536 and no step is skipped; the wrapper, given
  # no flag, says so at trace time, whatever ran before.
  params = {"w": jnp.array([1.0, -2.0, 3.0])}
  state = train_state.TrainState.create(apply_fn=None, params=params, tx=jaxscale.dynamic_loss_scaling(optax.sgd(0.1)))

  for _ in range(2):  # a trace-time warning: each step function is new, and traced anew
    def kept_jax_grad(state):
      return state.apply_gradients(grads=jax.grad(quadratic)(state.params))

    def documented(state):
      _, grads, finite = jaxscale.value_and_grad(quadratic)(jaxscale.find_scaler(state.opt_state), state.params)
      return jaxscale.flax.apply_gradients(state, grads=grads, finite=finite)

    with pytest.warns(UserWarning, match=FORGOTTEN):
      wrap(kept_jax_grad)(state)
    wrap(documented)(state)  # warnings are errors here


@pytest.mark.parametrize("wrap", [nnx.jit, lambda f: f], ids=["nnx_jit", "eager"])
def test_an_nnx_step_that_kept_nnx_value_and_grad_warns_and_the_documented_one_does_not(wrap):
  model = nnx.Linear(2, 1, rngs=nnx.Rngs(0))
  optimizer = nnx.Optimizer(model, jaxscale.dynamic_loss_scaling(optax.sgd(0.5)), wrt=nnx.Param)
  loss_fn = lambda m: jnp.sum(m(jnp.ones((1, 2))))

  for _ in range(2):
    def kept_nnx_grad(model, optimizer):
      _, grads = nnx.value_and_grad(loss_fn)(model)
      optimizer.update(model, grads)

    def documented(model, optimizer):
      scaler = jaxscale.find_scaler(optimizer.opt_state)
      _, grads, finite = jaxscale.flax.value_and_grad(loss_fn)(scaler, model)
      optimizer.update(model, grads, finite=finite)

    with pytest.warns(UserWarning, match=FORGOTTEN):
      wrap(kept_nnx_grad)(model, optimizer)
    wrap(documented)(model, optimizer)
