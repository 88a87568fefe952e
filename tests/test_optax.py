"""The Optax wrapper against the unwrapped optimizer."""

import functools
import re
import types

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxscale
from _bitwise import assert_bitwise_equal, bits
from _jit import compilations

# These tests hand the wrapper gradients of their own making, with no gradient site: the warning
# for an update without its `finite` flag is tested in tests/test_contract.py.
pytestmark = pytest.mark.filterwarnings("ignore:jaxscale. `dynamic_loss_scaling`'s update got no `finite` flag")

PARAMS = {"w": jnp.linspace(-1.0, 1.0, 12, dtype=jnp.float32).reshape(3, 4), "b": jnp.arange(4, dtype=jnp.float32)}
GRADS = jax.tree.map(lambda p: jnp.cos(p) * 2.0**-6, PARAMS)  # true gradients


def poisoned(tree, value=jnp.inf):
  return {**tree, "b": tree["b"].at[2].set(value)}


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
    updates, state = tx.update(GRADS, state, params)
    params = optax.apply_updates(params, updates)
  return params, state


@pytest.mark.parametrize("make_inner", INNERS.values(), ids=INNERS.keys())
@pytest.mark.parametrize("bad", [jnp.inf, jnp.nan], ids=["inf", "nan"])
def test_skipped_step_changes_nothing_but_the_scaler(make_inner, bad):
  tx = jaxscale.dynamic_loss_scaling(make_inner(), init_scale=2.0**10)
  params, state = warm(tx)
  updates, new_state = jax.jit(tx.update)(poisoned(GRADS, bad), state, params)
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
      updates, state = tx.update(GRADS, state, params)
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
    updates, state = jax.jit(tx.update)(GRADS, state, params)
    want, inner_state = jax.jit(inner.update)(GRADS, inner_state, params)
    jax.tree.map(functools.partial(np.testing.assert_allclose, rtol=1e-6, atol=0), updates, want)
    params = optax.apply_updates(params, updates)


def test_disabled_is_exactly_inner_and_never_skips():
  tx = jaxscale.dynamic_loss_scaling(optax.adam(1e-3), enabled=False)
  inner = optax.adam(1e-3)
  state, inner_state = tx.init(PARAMS), inner.init(PARAMS)
  assert float(jaxscale.find_scaler(state).scale) == 1.0
  for grads in [GRADS, poisoned(GRADS), GRADS]:
    updates, state = tx.update(grads, state, PARAMS)
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
    _, state = tx.update(grads, state, PARAMS)
  assert int(state.inner_state.count) == 2
  assert float(state.inner_state.hyperparams["learning_rate"]) == schedule(1)


def test_clipping_inside_sees_unscaled_gradients():
  clip = 1e-3
  tx = jaxscale.dynamic_loss_scaling(optax.chain(optax.clip_by_global_norm(clip), optax.sgd(1.0)), init_scale=2.0**12)
  state = tx.init(PARAMS)
  updates, _ = tx.update(GRADS, state, PARAMS)
  want = optax.chain(optax.clip_by_global_norm(clip), optax.sgd(1.0))
  want_updates, _ = want.update(GRADS, want.init(PARAMS), PARAMS)
  np.testing.assert_allclose(optax.tree.norm(updates), clip, rtol=1e-6)
  assert_bitwise_equal(updates, want_updates)


# Each composition built around an inner optimizer, given the wrapper (`with_scaler`) or nothing.
# MultiSteps outside the wrapper is left to tests/test_accumulation.py: after an overflow it does not
# train as the unwrapped composition does (optax's `(1 - emit) * acc` turns the inf into a NaN).
COMPOSITIONS = {
    "inside_chain": lambda with_scaler: optax.chain(optax.identity(), with_scaler(optax.adam(1e-3))),
    "around_chain": lambda with_scaler: with_scaler(optax.chain(optax.add_decayed_weights(1e-4), optax.adam(1e-3))),
    "inject_hyperparams_inside": lambda with_scaler: with_scaler(
        optax.inject_hyperparams(optax.adam)(learning_rate=1e-3)
    ),
    "multi_steps_inside": lambda with_scaler: with_scaler(optax.MultiSteps(optax.adam(1e-3), 2)),
    "multi_transform_inside": lambda with_scaler: with_scaler(
        optax.multi_transform({"a": optax.adam(1e-3), "s": optax.sgd(0.1)}, {"w": "a", "b": "s"})
    ),
}


@pytest.mark.parametrize("make_tx", COMPOSITIONS.values(), ids=COMPOSITIONS.keys())
def test_compositions_skip_the_overflows_and_otherwise_train_as_the_unwrapped_composition(make_tx):
  tx, unwrapped = make_tx(jaxscale.dynamic_loss_scaling), make_tx(lambda inner: inner)
  state, params = tx.init(PARAMS), PARAMS
  step = jax.jit(functools.partial(train_step, tx))
  finite = [jax.tree.map(lambda g, i=i: g * (1 + i), GRADS) for i in range(4)]  # four different batches
  for grads in [finite[0], finite[1], poisoned(GRADS), poisoned(GRADS), finite[2], finite[3]]:
    params, state = step(params, state, grads)
  scaler = jaxscale.find_scaler(state)
  assert int(scaler.skipped_steps) == 2 and float(scaler.scale) == 2.0**14
  assert compilations(step) == 1
  # The reference: the composition without the wrapper, on the four finite batches only.
  want, want_state = PARAMS, unwrapped.init(PARAMS)
  for grads in finite:
    updates, want_state = unwrapped.update(grads, want_state, want)
    want = optax.apply_updates(want, updates)
  assert not all(bool((a == b).all()) for a, b in zip(jax.tree.leaves(want), jax.tree.leaves(PARAMS)))
  jax.tree.map(lambda got, w: np.testing.assert_allclose(got, w, rtol=1e-6, atol=1e-9), params, want)


def train_step(tx, params, state, true_grads):
  updates, state = tx.update(true_grads, state, params)
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
  assert compilations(step) == 1
  assert int(jaxscale.find_scaler(state).skipped_steps) == 6


def test_the_flag_of_the_gradient_site_decides_as_the_wrappers_own_check_does():
  tx = jaxscale.dynamic_loss_scaling(optax.adam(1e-3), init_scale=2.0**10)
  state = tx.init(PARAMS)
  loss = lambda p: sum(jnp.sum(jnp.sin(x)) for x in jax.tree.leaves(p))
  value, grads, finite = jaxscale.value_and_grad(loss)(jaxscale.find_scaler(state), PARAMS)
  via_flag, flag_state = tx.update(grads, state, PARAMS, finite=finite)
  via_check, check_state = tx.update(grads, state, PARAMS)
  assert_bitwise_equal(via_flag, via_check)
  assert_bitwise_equal(flag_state, check_state)
  skipped, skip_state = tx.update(grads, state, PARAMS, finite=jnp.array(False))
  assert float(jaxscale.find_scaler(skip_state).scale) == 2.0**9
  assert_bitwise_equal(skip_state.inner_state, state.inner_state)


# float16 parameters without a master on purpose: the dtypes the wrapper keeps are what is checked.
@pytest.mark.filterwarnings("ignore:jaxscale. `dynamic_loss_scaling` updates float16 parameters")
@pytest.mark.parametrize("dtype", [jnp.float16, jnp.bfloat16, jnp.float32], ids=["f16", "bf16", "f32"])
def test_low_precision_gradients_keep_their_dtype(dtype):
  params = jax.tree.map(lambda p: p.astype(dtype), PARAMS)
  tx = jaxscale.dynamic_loss_scaling(optax.sgd(0.5), init_scale=2.0**8)
  state = tx.init(params)
  grads = jax.tree.map(lambda g: g.astype(dtype), GRADS)
  updates, state = tx.update(grads, state, params)
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


# --- the skip, on a small problem: the flag, the sign of a skipped update, state leaves, dtypes ------

SMALL_PARAMS = {"w": jnp.array([1.0, -2.0, 0.5]), "b": jnp.array([-0.0, 0.25])}
SMALL_GRADS = {"w": jnp.array([0.5, 0.25, -1.0]), "b": jnp.array([0.0, 2.0])}
JIT = {"eager": lambda f: f, "jit": jax.jit}


def nan_in_w(tree):
  return {**tree, "w": tree["w"].at[1].set(jnp.nan)}


@pytest.mark.parametrize("wrap", JIT.values(), ids=JIT.keys())
def test_a_flag_passed_in_is_anded_with_the_wrappers_own_check(wrap):
  tx = jaxscale.dynamic_loss_scaling(optax.sgd(1.0), init_scale=2.0**10)
  state = tx.init(SMALL_PARAMS)
  update = wrap(lambda g, s, finite: tx.update(g, s, SMALL_PARAMS, finite=finite))
  # True gradients: taken as they are, never divided by the scale.
  updates, after = update(SMALL_GRADS, state, jnp.array(True))
  np.testing.assert_array_equal(updates["w"], -SMALL_GRADS["w"])
  assert not bool(after.scaler.last_skipped)
  # The flag decides, even where the gradients themselves are finite ...
  updates, after = update(SMALL_GRADS, state, jnp.array(False))
  assert bool(after.scaler.last_skipped) and float(after.scaler.scale) == 2.0**9
  assert all(not u.any() for u in jax.tree.leaves(updates))
  # ... huge but finite gradients are finite ...
  huge = jax.tree.map(lambda g: g * 2.0**120, SMALL_GRADS)
  updates, after = update(huge, state, jnp.array(True))
  np.testing.assert_array_equal(updates["w"], -huge["w"])
  assert int(after.scaler.growth_tracker) == 1
  # ... and a True flag does not overrule the wrapper's own check of what it was given.
  updates, after = update(nan_in_w(SMALL_GRADS), state, jnp.array(True))
  assert bool(after.scaler.last_skipped)
  assert all(not u.any() and np.signbit(u).all() for u in jax.tree.leaves(updates))


@pytest.mark.parametrize("wrap", JIT.values(), ids=JIT.keys())
def test_a_stalled_scaler_skips_every_later_step_in_the_wrapper(wrap):
  tx = jaxscale.dynamic_loss_scaling(optax.adam(0.1), init_scale=2.0, min_scale=1.0, on_stall="raise")
  update = wrap(lambda g, s: tx.update(g, s, SMALL_PARAMS))
  state = tx.init(SMALL_PARAMS)
  _, state = update(nan_in_w(SMALL_GRADS), state)  # 2 -> 1
  _, state = update(nan_in_w(SMALL_GRADS), state)  # at the floor: stalled
  assert bool(state.scaler.stalled)
  updates, after = update(SMALL_GRADS, state)  # finite, but the run has stalled
  assert all(not u.any() and np.signbit(u).all() for u in jax.tree.leaves(updates))
  assert bits(after.inner_state) == bits(state.inner_state)
  assert bool(after.scaler.last_skipped) and int(after.scaler.skipped_steps) == 3
  with pytest.raises(FloatingPointError):
    jaxscale.raise_if_stalled(after.scaler)


# float16 parameters without a master on purpose: the dtypes the wrapper keeps are what is checked.
@pytest.mark.filterwarnings("ignore:jaxscale. `dynamic_loss_scaling` updates float16 parameters")
@pytest.mark.parametrize("wrap", JIT.values(), ids=JIT.keys())
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.float16, jnp.bfloat16], ids=["f32", "f16", "bf16"])
def test_skipped_updates_are_negative_zero_so_negative_zero_parameters_keep_their_sign(wrap, dtype):
  params = jax.tree.map(lambda p: p.astype(dtype), SMALL_PARAMS)
  tx = jaxscale.dynamic_loss_scaling(optax.sgd(0.1))
  state = tx.init(params)
  grads = jax.tree.map(lambda g: g.astype(dtype), nan_in_w(SMALL_GRADS))
  updates, _ = wrap(lambda g, s: tx.update(g, s, params))(grads, state)
  for u in jax.tree.leaves(updates):
    assert u.dtype == dtype and not u.any() and np.signbit(np.asarray(u, np.float32)).all()
  new_params = optax.apply_updates(params, updates)
  assert bits(new_params) == bits(params)  # -0.0 + +0.0 would be +0.0
  assert np.signbit(np.asarray(new_params["b"][0], np.float32))


def twice_and_once():
  """An inner transformation whose new state holds one array twice (and an untouched leaf)."""

  def init(params):
    return (jnp.zeros(3), jnp.ones(3), jnp.full(3, 7.0))

  def update(updates, state, params=None):
    new = state[0] + state[1] + updates["w"]
    return updates, (new, new, state[2])

  return optax.GradientTransformation(init, update)


@pytest.mark.parametrize("wrap", JIT.values(), ids=JIT.keys())
def test_a_state_leaf_output_twice_keeps_each_old_value_on_a_skipped_step(wrap):
  tx = jaxscale.dynamic_loss_scaling(twice_and_once(), init_scale=4.0)
  update = wrap(lambda g, s: tx.update(g, s))
  state = tx.init(SMALL_PARAMS)
  _, skipped = update(nan_in_w(SMALL_GRADS), state)
  assert bits(skipped.inner_state) == bits(state.inner_state)  # (0, 1, 7), not (0, 0, 7) or (1, 1, 7)
  _, taken = update(SMALL_GRADS, state)
  want = 1.0 + SMALL_GRADS["w"]
  for leaf, expected in zip(taken.inner_state, (want, want, jnp.full(3, 7.0))):
    np.testing.assert_array_equal(leaf, expected)


def test_the_skip_decision_does_not_depend_on_which_leaf_holds_the_nan():
  tx = jaxscale.dynamic_loss_scaling(optax.sgd(0.1))
  update = jax.jit(lambda g, s: tx.update(g, s, SMALL_PARAMS))
  state = tx.init(SMALL_PARAMS)
  for leaf in SMALL_PARAMS:
    for bad in (jnp.inf, -jnp.inf, jnp.nan):
      grads = {**SMALL_GRADS, leaf: SMALL_GRADS[leaf].at[0].set(bad)}
      updates, after = update(grads, state)
      assert bool(after.scaler.last_skipped), (leaf, bad)


def test_find_scaler_counts_the_scalers_it_found():
  with pytest.raises(ValueError) as caught:
    jaxscale.find_scaler({"a": jaxscale.init(), "b": [jaxscale.init()]})
  assert str(caught.value).startswith("`find_scaler` found 2 ScalerStates in an object of type dict;")


@pytest.mark.parametrize("path", ["eager", "jit"])
def test_a_learning_rate_closed_over_gets_a_zero_derivative_through_a_skipped_step(path):
  # A skipped step runs the inner update on zeroed gradients: `lr * inf` would make d/dlr NaN, not 0.

  def meta_loss(lr, grads):
    tx = jaxscale.dynamic_loss_scaling(optax.sgd(lr), init_scale=4.0)
    updates, _ = tx.update(grads, tx.init(SMALL_PARAMS), SMALL_PARAMS)
    return sum(jnp.sum(p**2) for p in jax.tree.leaves(optax.apply_updates(SMALL_PARAMS, updates)))

  grad = jax.grad(meta_loss)
  if path == "jit":
    grad = jax.jit(grad)
  for bad in (jnp.inf, jnp.nan):
    assert float(grad(jnp.float32(0.1), nan_in_w(SMALL_GRADS) | {"b": SMALL_GRADS["b"].at[0].set(bad)})) == 0.0
  taken = float(grad(jnp.float32(0.1), SMALL_GRADS))
  want = sum(-2 * float(jnp.sum((p - 0.1 * g) * g))
             for p, g in zip(jax.tree.leaves(SMALL_PARAMS), jax.tree.leaves(SMALL_GRADS)))
  np.testing.assert_allclose(taken, want, rtol=1e-5)


SKIP_INNERS = {
    "adam": lambda: optax.adam(1e-2),
    "sgd_momentum": lambda: optax.sgd(0.1, momentum=0.9),
    "twice_and_once": twice_and_once,
    "inject_hyperparams": lambda: optax.inject_hyperparams(optax.adam)(learning_rate=1e-2),
    # An array the update closes over is a constant of the traced step.
    "closes_over_an_array": lambda: optax.stateless(
        lambda u, p: {"w": u["w"] * jnp.array([0.5, 2.0, 1.0]), "b": u["b"]}
    ),
}


@pytest.mark.parametrize("make", SKIP_INNERS.values(), ids=SKIP_INNERS.keys())
def test_a_jitted_skipped_step_keeps_the_state_and_has_zero_derivatives(make):
  tx = jaxscale.dynamic_loss_scaling(make(), init_scale=4.0)
  state = tx.init(SMALL_PARAMS)
  step = jax.jit(lambda g, s: tx.update(g, s, SMALL_PARAMS))
  _, taken = step(SMALL_GRADS, state)
  _, skipped = step(nan_in_w(SMALL_GRADS), taken)
  assert bits(skipped.inner_state) == bits(taken.inner_state)
  # Derivatives through the skip: finite, zero for the skipped step's gradients.
  d = jax.grad(lambda g: sum(jnp.sum(u) for u in jax.tree.leaves(step(g, taken)[0])))(nan_in_w(SMALL_GRADS))
  assert all(not np.asarray(x).any() for x in jax.tree.leaves(d))


# float16 parameters without a master on purpose: the dtypes the wrapper keeps are what is checked.
@pytest.mark.filterwarnings("ignore:jaxscale. `dynamic_loss_scaling` updates float16 parameters")
@pytest.mark.parametrize("path", ["jit", "eager"])
def test_a_skipped_step_keeps_every_dtype(path):
  """float16 parameters, an int32 step count: a skipped step's updates and state keep their dtypes."""
  params = {"w": jnp.ones(3, jnp.float16), "b": jnp.zeros(2, jnp.float16)}
  tx = jaxscale.dynamic_loss_scaling(optax.adam(1e-2), init_scale=8.0)
  state = tx.init(params)
  grads = {"w": jnp.array([1.0, jnp.inf, 0.0], jnp.float16), "b": jnp.ones(2, jnp.float16)}
  update = tx.update if path == "eager" else jax.jit(tx.update)
  updates, new_state = update(grads, state, params)
  assert jax.tree.map(lambda x: x.dtype, updates) == jax.tree.map(lambda x: x.dtype, params)
  assert jax.tree.map(lambda x: x.dtype, new_state.inner_state) == jax.tree.map(lambda x: x.dtype, state.inner_state)
  assert bool(new_state.scaler.last_skipped)


def _changes_state_dtype():
  """An inner transformation whose update returns its state in another dtype than `init` made it."""
  init = lambda params: {"m": jnp.zeros(2, jnp.float32), "a": jnp.zeros(2, jnp.float32), "b": jnp.zeros(2, jnp.float32)}

  def update(updates, state, params=None):
    twice = (state["a"] + 2).astype(jnp.bfloat16)  # one value, output as two state leaves
    return updates, {"m": (state["m"] + 1).astype(jnp.bfloat16), "a": twice, "b": twice}

  return optax.GradientTransformation(init, update)


@pytest.mark.parametrize("wrap", [lambda f: f, jax.jit], ids=["eager", "jit"])
def test_a_skipped_step_keeps_the_dtypes_the_inner_update_returns(wrap):
  grads = {"a": jnp.array([1.0, 2.0]), "i": jnp.array([3, 4], jnp.int32)}
  for inner, state_dtype in [(optax.identity(), None), (_changes_state_dtype(), jnp.bfloat16)]:
    tx = jaxscale.dynamic_loss_scaling(inner, init_scale=1.0)
    step = wrap(lambda g, s: tx.update(g, s))
    updates, taken = step(grads, tx.init(grads))
    skipped_updates, skipped = step(grads | {"a": jnp.array([jnp.inf, 2.0])}, taken)
    assert jaxscale.find_scaler(skipped).last_skipped
    assert {k: v.dtype for k, v in skipped_updates.items()} == {"a": jnp.float32, "i": jnp.int32}
    if state_dtype is not None:
      for k in ("m", "a", "b"):
        assert taken.inner_state[k].dtype == skipped.inner_state[k].dtype == state_dtype
      assert bits(skipped.inner_state) == bits(taken.inner_state)


def test_an_optimizer_factory_not_called_says_call_it():
  with pytest.raises(TypeError) as error:
    jaxscale.dynamic_loss_scaling(optax.adam)
  assert str(error.value) == (
      f"`dynamic_loss_scaling` wraps an `optax.GradientTransformation`, got {optax.adam!r} of type "
      "function; it looks like the factory itself: call it, e.g. "
      "`dynamic_loss_scaling(optax.adam(learning_rate))`."
  )
  with pytest.raises(TypeError) as error:
    jaxscale.dynamic_loss_scaling(0.1)
  assert str(error.value) == (
      "`dynamic_loss_scaling` wraps an `optax.GradientTransformation`, got 0.1 of type float; pass "
      "one, e.g. `dynamic_loss_scaling(optax.adam(1e-3))`."
  )
  # Half an optimizer (an `init` and no `update`) is not one.
  with pytest.raises(TypeError, match="wraps an `optax.GradientTransformation`, got namespace"):
    jaxscale.dynamic_loss_scaling(types.SimpleNamespace(init=lambda params: ()))
  # A callable object (no `__qualname__` of its own) is named by its type.
  class Factory:
    def __call__(self, learning_rate):
      return optax.sgd(learning_rate)
  with pytest.raises(TypeError, match=r"e.g. `dynamic_loss_scaling\(Factory\(learning_rate\)\)`\.$"):
    jaxscale.dynamic_loss_scaling(Factory())
  # A callable that is not Optax's is named as it is.
  def my_optimizer(learning_rate):
    return optax.sgd(learning_rate)
  with pytest.raises(TypeError, match=r"e.g. `dynamic_loss_scaling\(test_an_optimizer_factory_not_called_says_call_it"
                                      r".<locals>.my_optimizer\(learning_rate\)\)`\.$"):
    jaxscale.dynamic_loss_scaling(my_optimizer)


def test_a_misspelt_option_names_the_options():
  with pytest.raises(TypeError) as error:
    jaxscale.dynamic_loss_scaling(optax.adam(1e-3), init_scal=1024.0)
  assert str(error.value) == (
      "`dynamic_loss_scaling` got unknown options ['init_scal']; it takes `axis_name` and the options "
      "of `jaxscale.init`: init_scale, growth_factor, backoff_factor, growth_interval, enabled, hysteresis, "
      "min_scale, max_scale, dynamic, on_stall."
  )


def test_find_scaler_of_the_optimizer_itself_asks_for_its_state():
  with pytest.raises(ValueError) as error:
    jaxscale.find_scaler(jaxscale.dynamic_loss_scaling(optax.adam(1e-3)))
  assert str(error.value) == (
      "`find_scaler` takes an optimizer *state*, got the optimizer itself (a "
      "`GradientTransformation`); pass `opt_state = tx.init(params)` (or `state.opt_state`)."
  )


@pytest.mark.parametrize("stored", ["leaves", "fields"])
def test_find_scaler_reads_a_scaler_stored_as_a_mapping_of_its_fields(stored):
  # As in a serialized state dict or `nnx.state(optimizer)`: a ScalerState comes back, from its
  # three packed leaves or, as a state saved before they were packed holds it, its fifteen fields.
  scaler = jaxscale.configure(jaxscale.update(jaxscale.init(init_scale=2.0**10, growth_interval=7), False),
                              hysteresis=3)
  mapping = scaler._asdict() if stored == "leaves" else {k: np.asarray(v) for k, v in scaler.fields().items()}
  assert len(mapping) == (3 if stored == "leaves" else 15)
  found = jaxscale.find_scaler({"opt_state": {"0": mapping, "1": {"count": jnp.int32(3)}}})
  assert type(found) is jaxscale.ScalerState
  assert_bitwise_equal(found, scaler)


def test_the_inner_optimizers_state_is_refused_by_the_wrapper():
  params = jnp.ones(2)
  tx = jaxscale.dynamic_loss_scaling(optax.adam(1e-3))
  with pytest.raises(TypeError) as error:
    tx.update(params, optax.adam(1e-3).init(params), params)
  assert str(error.value) == (
      "`dynamic_loss_scaling`'s update takes the state its own `init` built (a "
      "`DynamicLossScalingState`), got an object of type tuple; build it with `tx.init(params)` of "
      "this wrapped optimizer, not of the inner one (a checkpoint restored without a target is a "
      "dict: restore it into the structure of `tx.init(params)`)."
  )
  # A state with an `inner_state` of its own (optax.masked's) is not the wrapper's either.
  masked_state = optax.masked(optax.adam(1e-3), True).init(params)
  assert hasattr(masked_state, "inner_state")
  with pytest.raises(TypeError, match="got an object of type MaskedState; build it with"):
    tx.update(params, masked_state, params)


def test_a_scaler_inside_a_scaler_is_refused():
  with pytest.raises(ValueError) as error:
    jaxscale.dynamic_loss_scaling(jaxscale.dynamic_loss_scaling(optax.sgd(0.1))).init(jnp.ones(2))
  assert str(error.value) == (
      "`dynamic_loss_scaling` wraps an optimizer that already holds a loss scaler (a "
      "`dynamic_loss_scaling` inside `inner`): two scales would back off and grow apart, and "
      "`find_scaler` could not tell which one scales the loss. Wrap the optimizer once."
  )


@pytest.mark.parametrize("wrap", [jax.jit, lambda f: f], ids=["jit", "eager"])
def test_an_attribute_of_the_inner_state_is_named_with_the_way_to_it(wrap):
  # `optax.inject_hyperparams` users read `opt_state.hyperparams`; inside the wrapper it is one
  # level down, and the error says where.
  inner = optax.inject_hyperparams(optax.adam)(learning_rate=1e-3)
  for tx, path in ((jaxscale.dynamic_loss_scaling(inner), ""),
                   (jaxscale.dynamic_loss_scaling(optax.chain(optax.clip(1.0), inner)), "[1]")):
    def read(params):
      return tx.init(params).hyperparams

    with pytest.raises(AttributeError, match=rf"the inner optimizer's state has it: `opt_state\.inner_state"
                                             rf"{re.escape(path)}\.hyperparams`"):
      wrap(read)(PARAMS)
  state = jaxscale.dynamic_loss_scaling(inner).init(PARAMS)
  assert float(state.inner_state.hyperparams["learning_rate"]) == np.float32(1e-3)  # the way named
  assert not hasattr(state, "hyperparams")  # still an AttributeError for `hasattr` and `getattr`


def _weight_decay_of_my_own(wd):
  """A weight decay written by hand, as a user writes one: its state is `()`."""
  def update(updates, state, params=None):
    return jax.tree.map(lambda g, w: g + wd * w, updates, params), ()

  return optax.GradientTransformation(lambda params: (), update)


@pytest.mark.parametrize("wrap", [jax.jit, lambda f: f], ids=["jit", "eager"])
def test_the_wrapper_around_one_partition_or_before_a_state_of_its_own_is_refused(wrap):
  # On a skipped step the other partition's momentum (or the weight decay after the wrapper) would
  # still move the parameters; `find_scaler`, which every step calls, says how to nest it.
  params = {"a": jnp.ones(2), "b": jnp.ones(2)}
  labels = {"a": "trained", "b": "other"}
  one_partition = optax.multi_transform(
      {"trained": jaxscale.dynamic_loss_scaling(optax.adam(1e-3)), "other": optax.sgd(0.1, momentum=0.9)}, labels)
  with pytest.raises(ValueError, match=r"around one partition of an `optax.multi_transform`.*Wrap the whole"):
    wrap(lambda p: jaxscale.find_scaler(one_partition.init(p)).scale)(params)
  decay_after = optax.chain(jaxscale.dynamic_loss_scaling(optax.adam(1e-3)), _weight_decay_of_my_own(1e-2))
  with pytest.raises(ValueError, match=r"a transformation after `dynamic_loss_scaling`.*its state: \(\)"):
    wrap(lambda p: jaxscale.find_scaler(decay_after.init(p)).scale)(params)
  # Nested as the messages say, both are found.
  for tx in (jaxscale.dynamic_loss_scaling(optax.multi_transform(
                 {"trained": optax.adam(1e-3), "other": optax.sgd(0.1, momentum=0.9)}, labels)),
             jaxscale.dynamic_loss_scaling(optax.chain(optax.adam(1e-3), _weight_decay_of_my_own(1e-2)))):
    assert float(wrap(lambda p: jaxscale.find_scaler(tx.init(p)).scale)(params)) == 2.0**16
