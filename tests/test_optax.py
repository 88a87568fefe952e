"""The Optax wrapper against the unwrapped optimizer."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxscale

PARAMS = {"w": jnp.linspace(-1.0, 1.0, 12, dtype=jnp.float32).reshape(3, 4), "b": jnp.arange(4, dtype=jnp.float32)}
GRADS = jax.tree.map(lambda p: jnp.cos(p) * 2.0**-6, PARAMS)  # true gradients


def poisoned(tree, value=jnp.inf):
  return {**tree, "b": tree["b"].at[2].set(value)}


def assert_bitwise_equal(a, b):
  def same_bits(x, y):
    x, y = np.atleast_1d(np.asarray(x)), np.atleast_1d(np.asarray(y))
    assert x.dtype == y.dtype
    np.testing.assert_array_equal(x.view(np.uint8), y.view(np.uint8))

  jax.tree.map(same_bits, a, b)


INNERS = {
    "sgd": lambda: optax.sgd(0.1),
    "sgd_momentum": lambda: optax.sgd(0.1, momentum=0.9),
    "adam": lambda: optax.adam(1e-3),
    "adamw": lambda: optax.adamw(1e-3, weight_decay=0.1),
    "chain_clip_adam": lambda: optax.chain(optax.clip_by_global_norm(1e-3), optax.adam(1e-3)),
    "scheduled_adam": lambda: optax.adam(optax.linear_schedule(1e-3, 0.0, 10)),
    "inject_hyperparams": lambda: optax.inject_hyperparams(optax.adam)(learning_rate=1e-3),
}


def warm(tx, steps=3):
  """A wrapper state a few finite steps in, so inner state is not all zeros."""
  state = tx.init(PARAMS)
  params = PARAMS
  for _ in range(steps):
    scaler = jaxscale.find_scaler(state)
    updates, state = tx.update(jaxscale.scale(scaler, GRADS), state, params)
    params = optax.apply_updates(params, updates)
  return params, state


@pytest.mark.parametrize("make_inner", INNERS.values(), ids=INNERS.keys())
@pytest.mark.parametrize("bad", [jnp.inf, jnp.nan], ids=["inf", "nan"])
def test_skipped_step_changes_nothing_but_the_scaler(make_inner, bad):
  tx = jaxscale.dynamic_loss_scaling(make_inner(), init_scale=2.0**10)
  params, state = warm(tx)
  scaler = jaxscale.find_scaler(state)
  updates, new_state = jax.jit(tx.update)(poisoned(jaxscale.scale(scaler, GRADS), bad), state, params)
  assert_bitwise_equal(optax.apply_updates(params, updates), params)
  assert_bitwise_equal(new_state.inner_state, state.inner_state)
  new_scaler = jaxscale.find_scaler(new_state)
  assert float(new_scaler.scale) == 2.0**9
  assert int(new_scaler.skipped_steps) == 1 and bool(new_scaler.last_skipped)


@pytest.mark.parametrize("make_inner", INNERS.values(), ids=INNERS.keys())
def test_finite_step_equals_inner_on_true_gradients(make_inner):
  # Op by op, unscaling by a power of two is exact, so every bit agrees.
  # Under jit, XLA fuses the two graphs differently (it may recompute a
  # moment inside another fusion with a fused multiply-add), so the last
  # bit may differ there: see test_jitted_finite_step_is_within_rounding.
  tx = jaxscale.dynamic_loss_scaling(make_inner(), init_scale=2.0**14)
  inner = make_inner()
  state, inner_state, params = tx.init(PARAMS), inner.init(PARAMS), PARAMS
  with jax.disable_jit():
    for _ in range(4):
      scaled = jaxscale.scale(jaxscale.find_scaler(state), GRADS)
      updates, state = tx.update(scaled, state, params)
      want, inner_state = inner.update(GRADS, inner_state, params)
      assert_bitwise_equal(updates, want)
      assert_bitwise_equal(state.inner_state, inner_state)
      params = optax.apply_updates(params, updates)


@pytest.mark.parametrize("make_inner", INNERS.values(), ids=INNERS.keys())
def test_jitted_finite_step_is_within_rounding(make_inner):
  tx = jaxscale.dynamic_loss_scaling(make_inner(), init_scale=2.0**14)
  inner = make_inner()
  state, inner_state, params = tx.init(PARAMS), inner.init(PARAMS), PARAMS
  for _ in range(4):
    scaled = jaxscale.scale(jaxscale.find_scaler(state), GRADS)
    updates, state = jax.jit(tx.update)(scaled, state, params)
    want, inner_state = jax.jit(inner.update)(GRADS, inner_state, params)
    jax.tree.map(functools.partial(np.testing.assert_allclose, rtol=1e-6, atol=0), updates, want)
    params = optax.apply_updates(params, updates)


def test_disabled_is_exactly_inner_and_never_skips():
  tx = jaxscale.dynamic_loss_scaling(optax.adam(1e-3), enabled=False)
  inner = optax.adam(1e-3)
  state, inner_state = tx.init(PARAMS), inner.init(PARAMS)
  assert float(jaxscale.find_scaler(state).scale) == 1.0
  for grads in [GRADS, poisoned(GRADS), GRADS]:
    updates, state = tx.update(jaxscale.scale(jaxscale.find_scaler(state), grads), state, PARAMS)
    want, inner_state = inner.update(grads, inner_state, PARAMS)
    assert_bitwise_equal(updates, want)
    assert_bitwise_equal(state.inner_state, inner_state)
  assert int(jaxscale.find_scaler(state).skipped_steps) == 0


def test_disabled_passes_params_and_extra_arguments_to_the_inner_optimizer():
  """adamw reads the parameters (weight decay), reduce_on_plateau the loss (`value`)."""
  inners = {
      "adamw": (lambda: optax.adamw(1e-2, weight_decay=0.1), {}),
      "reduce_on_plateau": (lambda: optax.chain(optax.sgd(1.0), optax.contrib.reduce_on_plateau()), {"value": 1.0}),
  }
  for make, extra in inners.values():
    tx, inner = jaxscale.dynamic_loss_scaling(make(), enabled=False), make()
    updates, state = tx.update(GRADS, tx.init(PARAMS), PARAMS, **extra)
    want, inner_state = inner.update(GRADS, inner.init(PARAMS), PARAMS, **extra)
    assert_bitwise_equal(updates, want)
    assert_bitwise_equal(state.inner_state, inner_state)


def test_skipped_step_does_not_advance_step_count_or_schedule():
  schedule = optax.linear_schedule(1.0, 0.0, 4)
  tx = jaxscale.dynamic_loss_scaling(optax.inject_hyperparams(optax.sgd)(learning_rate=schedule))
  state = tx.init(PARAMS)
  for grads in [GRADS, poisoned(GRADS), poisoned(GRADS), GRADS]:
    _, state = tx.update(jaxscale.scale(jaxscale.find_scaler(state), grads), state, PARAMS)
  assert int(state.inner_state.count) == 2
  assert float(state.inner_state.hyperparams["learning_rate"]) == schedule(1)


def test_clipping_inside_sees_unscaled_gradients():
  clip = 1e-3
  tx = jaxscale.dynamic_loss_scaling(optax.chain(optax.clip_by_global_norm(clip), optax.sgd(1.0)), init_scale=2.0**12)
  state = tx.init(PARAMS)
  updates, _ = tx.update(jaxscale.scale(jaxscale.find_scaler(state), GRADS), state, PARAMS)
  want = optax.chain(optax.clip_by_global_norm(clip), optax.sgd(1.0))
  want_updates, _ = want.update(GRADS, want.init(PARAMS), PARAMS)
  np.testing.assert_allclose(optax.tree.norm(updates), clip, rtol=1e-6)
  assert_bitwise_equal(updates, want_updates)


COMPOSITIONS = {
    "inside_chain": lambda: optax.chain(optax.identity(), jaxscale.dynamic_loss_scaling(optax.adam(1e-3))),
    "around_chain": lambda: jaxscale.dynamic_loss_scaling(optax.chain(optax.add_decayed_weights(1e-4), optax.adam(1e-3))),
    "inject_hyperparams_inside": lambda: jaxscale.dynamic_loss_scaling(optax.inject_hyperparams(optax.adam)(learning_rate=1e-3)),
    "multi_steps_outside": lambda: optax.MultiSteps(jaxscale.dynamic_loss_scaling(optax.adam(1e-3)), 2),
    "multi_steps_inside": lambda: jaxscale.dynamic_loss_scaling(optax.MultiSteps(optax.adam(1e-3), 2)),
    "multi_transform_inside": lambda: jaxscale.dynamic_loss_scaling(
        optax.multi_transform({"a": optax.adam(1e-3), "s": optax.sgd(0.1)}, {"w": "a", "b": "s"})
    ),
}


@pytest.mark.parametrize("make_tx", COMPOSITIONS.values(), ids=COMPOSITIONS.keys())
def test_compositions_find_the_scaler_skip_and_train(make_tx):
  tx = make_tx()
  state, params = tx.init(PARAMS), PARAMS
  step = jax.jit(functools.partial(train_step, tx))
  for grads in [GRADS, GRADS, poisoned(GRADS), poisoned(GRADS), GRADS, GRADS]:
    params, state = step(params, state, grads)
  scaler = jaxscale.find_scaler(state)
  assert int(scaler.skipped_steps) >= 1
  assert float(scaler.scale) < 2.0**16
  assert all(bool(jnp.isfinite(x).all()) for x in jax.tree.leaves(params))
  assert not all(bool((a == b).all()) for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(PARAMS)))
  assert step._cache_size() == 1


def train_step(tx, params, state, true_grads):
  scaler = jaxscale.find_scaler(state)
  scaled = jaxscale.scale(scaler, true_grads)
  updates, state = tx.update(scaled, state, params)
  return optax.apply_updates(params, updates), state


def test_training_jits_once_and_never_touches_the_host():
  tx = jaxscale.dynamic_loss_scaling(optax.adam(1e-3), growth_interval=2)

  @functools.partial(jax.jit, donate_argnums=(0, 1))
  def step(params, state, true_grads):
    return train_step(tx, params, state, true_grads)

  params, state = jax.tree.map(jnp.copy, PARAMS), tx.init(PARAMS)
  batches = [jax.device_put(g) for g in [GRADS, poisoned(GRADS), GRADS, GRADS, poisoned(GRADS, jnp.nan)] * 3]
  four = jax.device_put(np.float32(4.0))
  with jax.transfer_guard("disallow"):
    for i, grads in enumerate(batches):
      params, state = step(params, state, grads)
      if i == 7:  # change hyperparameters mid-run, on the device
        state = state._replace(scaler=jax.jit(jaxscale.configure)(state.scaler, growth_factor=four))
  assert step._cache_size() == 1
  assert int(jaxscale.find_scaler(state).skipped_steps) == 6


def test_finite_extra_arg_skips_the_second_check():
  tx = jaxscale.dynamic_loss_scaling(optax.adam(1e-3), init_scale=2.0**10)
  state = tx.init(PARAMS)
  loss = lambda p: sum(jnp.sum(jnp.sin(x)) for x in jax.tree.leaves(p))
  value, grads, finite = jaxscale.value_and_grad(loss)(jaxscale.find_scaler(state), PARAMS)
  via_flag, flag_state = tx.update(grads, state, PARAMS, finite=finite)
  scaled = jax.grad(lambda p: jaxscale.scale(jaxscale.find_scaler(state), loss(p)))(PARAMS)
  via_check, check_state = tx.update(scaled, state, PARAMS)
  assert_bitwise_equal(via_flag, via_check)
  assert_bitwise_equal(flag_state, check_state)
  skipped, skip_state = tx.update(grads, state, PARAMS, finite=jnp.array(False))
  assert float(jaxscale.find_scaler(skip_state).scale) == 2.0**9
  assert_bitwise_equal(skip_state.inner_state, state.inner_state)


@pytest.mark.filterwarnings("ignore:jaxscale. .dynamic_loss_scaling. was given float16 gradients:UserWarning")
@pytest.mark.parametrize("dtype", [jnp.float16, jnp.bfloat16, jnp.float32], ids=["f16", "bf16", "f32"])
def test_low_precision_gradients_keep_their_dtype(dtype):
  params = jax.tree.map(lambda p: p.astype(dtype), PARAMS)
  tx = jaxscale.dynamic_loss_scaling(optax.sgd(0.5), init_scale=2.0**8)
  state = tx.init(params)
  grads = jax.tree.map(lambda g: g.astype(dtype), GRADS)
  updates, state = tx.update(jaxscale.scale(jaxscale.find_scaler(state), grads), state, params)
  assert all(u.dtype == dtype for u in jax.tree.leaves(updates))
  want, _ = optax.sgd(0.5).update(grads, optax.sgd(0.5).init(params))
  assert_bitwise_equal(updates, want)


def test_find_scaler_errors_without_a_scaler():
  with pytest.raises(ValueError, match="no ScalerState"):
    jaxscale.find_scaler(optax.adam(1e-3).init(PARAMS))
  two = (jaxscale.init(), jaxscale.init())
  with pytest.raises(ValueError, match="2 ScalerStates"):
    jaxscale.find_scaler(two)


def test_each_init_has_its_own_buffers():
  tx = jaxscale.dynamic_loss_scaling(optax.sgd(0.1))
  a, b = jax.tree.leaves(tx.init(PARAMS).scaler), jax.tree.leaves(tx.init(PARAMS).scaler)
  assert not {x.unsafe_buffer_pointer() for x in a} & {x.unsafe_buffer_pointer() for x in b}


# --- gradients of an unscaled loss, or unscaled twice ---------------------------------------------


def quadratic(params):
  return jnp.sum(params["w"] ** 2)


QUADRATIC_PARAMS = {"w": jnp.array([1.0, -2.0, 3.0])}


def test_value_and_grad_gradients_without_finite_are_unscaled_once():
  tx = jaxscale.dynamic_loss_scaling(optax.sgd(0.1), init_scale=2.0**12)
  state = tx.init(QUADRATIC_PARAMS)

  @jax.jit
  def step(params, state):
    _, grads, _ = jaxscale.value_and_grad(quadratic)(jaxscale.find_scaler(state), params)
    updates, state = tx.update(grads, state, params)
    return updates, state

  updates, state = step(QUADRATIC_PARAMS, state)
  np.testing.assert_array_equal(updates["w"], -0.1 * 2 * QUADRATIC_PARAMS["w"])
  # The flag comes with them: an inf skips the step.
  _, grads, _ = jaxscale.value_and_grad(lambda p: quadratic(p) * jnp.inf)(jaxscale.find_scaler(state), QUADRATIC_PARAMS)
  updates, state = tx.update(grads, state, QUADRATIC_PARAMS)
  assert bool(jaxscale.find_scaler(state).last_skipped)


def test_mixing_unscaled_and_other_gradients_is_an_error():
  tx = jaxscale.dynamic_loss_scaling(optax.sgd(0.1))
  state = tx.init({"a": QUADRATIC_PARAMS, "b": QUADRATIC_PARAMS})
  scaler = jaxscale.find_scaler(state)
  _, grads, _ = jaxscale.value_and_grad(quadratic)(scaler, QUADRATIC_PARAMS)
  scaled = jax.grad(lambda p: jaxscale.scale(scaler, quadratic(p)))(QUADRATIC_PARAMS)
  with pytest.raises(ValueError, match="1 of 2 floating leaves were already unscaled"):
    tx.update({"a": grads, "b": scaled}, state)


def test_forgetting_to_scale_the_loss_warns_at_trace_time():
  tx = jaxscale.dynamic_loss_scaling(optax.sgd(0.1))
  state = tx.init(QUADRATIC_PARAMS)

  @jax.jit
  def step(params, state):
    return tx.update(jax.grad(quadratic)(params), state, params)  # no jaxscale.scale

  # A first, right update: a loss scaled anywhere since the last update silences the check
  # (control flow and a second jit hand the update a scale it cannot recognise).
  tx.update(jaxscale.scale(jaxscale.find_scaler(state), jax.grad(quadratic)(QUADRATIC_PARAMS)), state)
  with pytest.warns(UserWarning, match="jaxscale.scale\\(jaxscale.find_scaler\\(opt_state\\), loss\\)"):
    step(QUADRATIC_PARAMS, state)


def test_scaled_gradients_from_another_jit_are_taken_with_their_flag():
  # The documented way to say "these are scaled, from elsewhere": unscale where you update.
  tx = jaxscale.dynamic_loss_scaling(optax.sgd(0.1), init_scale=2.0**12)
  state = tx.init(QUADRATIC_PARAMS)
  grad_fn = jax.jit(lambda p, scaler: jax.grad(lambda p: jaxscale.scale(scaler, quadratic(p)))(p))
  scaled = grad_fn(QUADRATIC_PARAMS, jaxscale.find_scaler(state))

  @jax.jit
  def update(grads, state, params):
    grads, finite = jaxscale.unscale_and_check(jaxscale.find_scaler(state), grads)
    return tx.update(grads, state, params, finite=finite)

  updates, _ = update(scaled, state, QUADRATIC_PARAMS)
  np.testing.assert_array_equal(updates["w"], -0.1 * 2 * QUADRATIC_PARAMS["w"])


def test_an_optimizer_factory_not_called_says_call_it():
  with pytest.raises(TypeError, match=r"call it.*optax.adam\(learning_rate\)"):
    jaxscale.dynamic_loss_scaling(optax.adam)
  with pytest.raises(TypeError, match="optax.GradientTransformation.*got 0.1"):
    jaxscale.dynamic_loss_scaling(0.1)


def test_a_misspelt_option_names_the_options():
  with pytest.raises(TypeError, match=r"unknown options \['init_scal'\].*init_scale, growth_factor"):
    jaxscale.dynamic_loss_scaling(optax.adam(1e-3), init_scal=1024.0)


def test_find_scaler_of_the_optimizer_itself_asks_for_its_state():
  with pytest.raises(ValueError, match=r"optimizer itself.*tx.init\(params\)"):
    jaxscale.find_scaler(jaxscale.dynamic_loss_scaling(optax.adam(1e-3)))


def test_the_inner_optimizers_state_is_refused_by_the_wrapper():
  params = jnp.ones(2)
  tx = jaxscale.dynamic_loss_scaling(optax.adam(1e-3))
  with pytest.raises(TypeError, match=r"tx.init\(params\)` of this wrapped optimizer"):
    tx.update(params, optax.adam(1e-3).init(params), params)


def test_a_scaler_inside_a_scaler_is_refused():
  with pytest.raises(ValueError, match="already holds a loss scaler"):
    jaxscale.dynamic_loss_scaling(jaxscale.dynamic_loss_scaling(optax.sgd(0.1))).init(jnp.ones(2))


def test_scaled_gradients_given_with_finite_warn_at_trace_time():
  tx = jaxscale.dynamic_loss_scaling(optax.sgd(0.1))
  state = tx.init(QUADRATIC_PARAMS)

  @jax.jit
  def step(params, state):
    scaler = jaxscale.find_scaler(state)
    grads = jax.grad(lambda p: jaxscale.scale(scaler, quadratic(p)))(params)
    return tx.update(grads, state, params, finite=jaxscale.all_finite(grads))  # never unscaled

  with pytest.warns(UserWarning, match="given `finite=`.*never unscaled anything"):
    step(QUADRATIC_PARAMS, state)


def test_float16_gradients_unscaled_by_the_wrapper_warn_at_trace_time():
  # A true gradient of 2**-30 survives only scaled (2**-14 at 2**16); unscaled in float16 it is 0.
  params = jnp.zeros(2, jnp.float16)
  tx = jaxscale.dynamic_loss_scaling(optax.sgd(1.0))
  state = tx.init(params)
  true = jnp.full(2, 2.0**-30, jnp.float32)
  grads = jaxscale.scale(jaxscale.find_scaler(state), true).astype(jnp.float16)  # float16 holds 2**-14
  with pytest.warns(UserWarning, match=r"float16 gradients.*master_weights\(jaxscale.dynamic_loss_scaling"):
    updates, _ = tx.update(grads, state, params)
  assert not np.asarray(updates).any()  # what the warning is about: the gradient flushed to zero
  right = jaxscale.master_weights(jaxscale.dynamic_loss_scaling(optax.sgd(1.0)))
  right_state = right.init(params)
  grads = jaxscale.scale(jaxscale.find_scaler(right_state), true).astype(jnp.float16)
  _, right_state = right.update(grads, right_state, params)  # no warning: unscaled in float32
  np.testing.assert_array_equal(right_state.master, -(2.0**-30))
