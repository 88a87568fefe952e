"""Behaviour that mutation testing found untested (tests/MUTATION.md): each test here kills mutants
of `_scaler.py` or `_optax.py` that the rest of the suite let live, by asserting what the code must do.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxscale
from jaxscale import _optax

INT32_MAX = 2**31 - 1
PARAMS = {"w": jnp.array([1.0, -2.0, 0.5]), "b": jnp.array([-0.0, 0.25])}
GRADS = {"w": jnp.array([0.5, 0.25, -1.0]), "b": jnp.array([0.0, 2.0])}


def bits(tree):
  return [np.asarray(x).tobytes() for x in jax.tree.leaves(tree)]


def poisoned(tree):
  return {**tree, "w": tree["w"].at[1].set(jnp.nan)}


JIT = {"eager": lambda f: f, "jit": jax.jit}


@pytest.mark.parametrize("wrap", JIT.values(), ids=JIT.keys())
def test_a_flag_passed_in_is_trusted_and_the_gradients_are_not_unscaled_again(wrap):
  tx = jaxscale.dynamic_loss_scaling(optax.sgd(1.0), init_scale=2.0**10)
  state = tx.init(PARAMS)
  update = wrap(lambda g, s, finite: tx.update(g, s, PARAMS, finite=finite))
  # Already unscaled: taken as they are, not divided by 2**10 a second time.
  updates, after = update(GRADS, state, jnp.array(True))
  np.testing.assert_array_equal(updates["w"], -GRADS["w"])
  assert not bool(after.scaler.last_skipped)
  # The flag decides, even where the gradients themselves are finite ...
  updates, after = update(GRADS, state, jnp.array(False))
  assert bool(after.scaler.last_skipped) and float(after.scaler.scale) == 2.0**9
  assert all(not u.any() for u in jax.tree.leaves(updates))
  # ... and a True flag is not overruled by a re-check of huge (but finite) unscaled gradients.
  huge = jax.tree.map(lambda g: g * 2.0**120, GRADS)
  updates, after = update(huge, state, jnp.array(True))
  np.testing.assert_array_equal(updates["w"], -huge["w"])
  assert int(after.scaler.growth_tracker) == 1


@pytest.mark.hand_made_gradients
@pytest.mark.parametrize("wrap", JIT.values(), ids=JIT.keys())
def test_a_stalled_scaler_skips_every_later_step_in_the_wrapper(wrap):
  tx = jaxscale.dynamic_loss_scaling(optax.adam(0.1), init_scale=2.0, min_scale=1.0, on_stall="raise")
  update = wrap(lambda g, s: tx.update(g, s, PARAMS))
  state = tx.init(PARAMS)
  _, state = update(poisoned(GRADS), state)  # 2 -> 1
  _, state = update(poisoned(GRADS), state)  # at the floor: stalled
  assert bool(state.scaler.stalled)
  updates, after = update(GRADS, state)  # finite, but the run has stalled
  assert all(not u.any() and np.signbit(u).all() for u in jax.tree.leaves(updates))
  assert bits(after.inner_state) == bits(state.inner_state)
  assert bool(after.scaler.last_skipped) and int(after.scaler.skipped_steps) == 3
  with pytest.raises(FloatingPointError):
    jaxscale.raise_if_stalled(after.scaler)


@pytest.mark.filterwarnings("ignore:jaxscale. .dynamic_loss_scaling. was given float16 gradients:UserWarning")
@pytest.mark.hand_made_gradients
@pytest.mark.parametrize("wrap", JIT.values(), ids=JIT.keys())
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.float16, jnp.bfloat16], ids=["f32", "f16", "bf16"])
def test_skipped_updates_are_negative_zero_so_negative_zero_parameters_keep_their_sign(wrap, dtype):
  params = jax.tree.map(lambda p: p.astype(dtype), PARAMS)
  tx = jaxscale.dynamic_loss_scaling(optax.sgd(0.1))
  state = tx.init(params)
  grads = jax.tree.map(lambda g: g.astype(dtype), poisoned(GRADS))
  updates, _ = wrap(lambda g, s: tx.update(g, s, params))(grads, state)
  for u in jax.tree.leaves(updates):
    assert u.dtype == dtype and not u.any() and np.signbit(np.asarray(u, np.float32)).all()
  new_params = optax.apply_updates(params, updates)
  assert bits(new_params) == bits(params)  # -0.0 + +0.0 would be +0.0
  assert np.signbit(np.asarray(new_params["b"][0], np.float32))


def test_configure_keeps_a_disabled_scale_at_one():
  disabled = jaxscale.init(enabled=False)
  assert float(jaxscale.configure(disabled, scale=8.0).scale) == 1.0
  assert float(jax.jit(lambda s: jaxscale.configure(s, scale=jnp.float32(8.0)))(disabled).scale) == 1.0
  assert float(jaxscale.configure(jaxscale.init(), scale=8.0).scale) == 8.0


@pytest.mark.parametrize("wrap", JIT.values(), ids=JIT.keys())
def test_counters_saturate_at_int32_max(wrap):
  update = wrap(jaxscale.update)
  state = jaxscale.init()._replace(skipped_steps=jnp.array(INT32_MAX - 1, jnp.int32))
  for _ in range(3):
    state = update(state, jnp.array(False))
    assert int(state.skipped_steps) == INT32_MAX
  # A static scale never grows, so its growth tracker keeps counting up to the end of int32.
  state = jaxscale.configure(jaxscale.init(dynamic=False), growth_tracker=INT32_MAX - 1)
  for _ in range(3):
    state = update(state, jnp.array(True))
    assert int(state.growth_tracker) == INT32_MAX


def twice_and_once():
  """An inner transformation whose new state holds one array twice (and an untouched leaf)."""

  def init(params):
    return (jnp.zeros(3), jnp.ones(3), jnp.full(3, 7.0))

  def update(updates, state, params=None):
    new = state[0] + state[1] + updates["w"]
    return updates, (new, new, state[2])

  return optax.GradientTransformation(init, update)


@pytest.mark.hand_made_gradients
@pytest.mark.parametrize("wrap", JIT.values(), ids=JIT.keys())
def test_a_state_leaf_output_twice_keeps_each_old_value_on_a_skipped_step(wrap):
  tx = jaxscale.dynamic_loss_scaling(twice_and_once(), init_scale=4.0)
  update = wrap(lambda g, s: tx.update(g, s))
  state = tx.init(PARAMS)
  _, skipped = update(poisoned(GRADS), state)
  assert bits(skipped.inner_state) == bits(state.inner_state)  # (0, 1, 7), not (0, 0, 7) or (1, 1, 7)
  _, taken = update(jax.tree.map(lambda g: g * 4.0, GRADS), state)
  want = 1.0 + GRADS["w"]
  for leaf, expected in zip(taken.inner_state, (want, want, jnp.full(3, 7.0))):
    np.testing.assert_array_equal(leaf, expected)


@pytest.mark.hand_made_gradients
def test_the_skip_decision_does_not_depend_on_which_leaf_holds_the_nan():
  tx = jaxscale.dynamic_loss_scaling(optax.sgd(0.1))
  update = jax.jit(lambda g, s: tx.update(g, s, PARAMS))
  state = tx.init(PARAMS)
  for leaf in PARAMS:
    for bad in (jnp.inf, -jnp.inf, jnp.nan):
      grads = {**GRADS, leaf: GRADS[leaf].at[0].set(bad)}
      updates, after = update(grads, state)
      assert bool(after.scaler.last_skipped), (leaf, bad)


# Each error, word for word: a sentence that names the option, the value received and what would
# work. (Matching a fragment, as the other tests do, lets a mangled message through.)
INIT_ERRORS = [
    (dict(growth_factor=1.0), ValueError, "`growth_factor` must be finite and > 1 in float32, got 1.0."),
    (dict(backoff_factor=1.0), ValueError, "`backoff_factor` must be in the open interval (0, 1) in float32, got 1.0."),
    (dict(backoff_factor=1e-50), ValueError,
     "`backoff_factor` must be in the open interval (0, 1) in float32, got 1e-50, which float32 stores as 0.0."),
    (dict(growth_interval=0), ValueError, "`growth_interval` must be an integer >= 1, got 0."),
    (dict(init_scale=1e39), ValueError,
     "`init_scale` must be a normal float32: finite and at least 2**-126 (~1.18e-38), got 1e+39, which float32 stores as inf."),
    (dict(min_scale=16.0, init_scale=4.0), ValueError,
     "`min_scale` (16.0) must not exceed `init_scale` (4.0): a back-off would raise the scale; lower `min_scale` or raise the scale."),
    (dict(init_scale=64.0, max_scale=4.0), ValueError,
     "`init_scale` (64.0) must not exceed `max_scale` (4.0): a growth would lower the scale; raise `max_scale` or lower the scale."),
    (dict(min_scale=8.0, max_scale=4.0, init_scale=4.0), ValueError,
     "`min_scale` (8.0) must not exceed `max_scale` (4.0): no scale could satisfy both."),
    (dict(hysteresis=0), ValueError, "`hysteresis` must be an integer >= 1, got 0."),
    (dict(on_stall="x"), ValueError, "`on_stall` must be 'skip' or 'raise', got 'x'."),
    (dict(dynamic="no"), TypeError, "`dynamic` must be a bool, got 'no' of type str."),
    (dict(growth_interval=True), TypeError, "`growth_interval` must be a real number, got True of type bool."),
    (dict(growth_interval=2**40), ValueError,
     "`growth_interval` must be an integer that fits in int32 (-2147483648 to 2147483647), got 1099511627776."),
    (dict(init_scale="a"), TypeError, "`init_scale` must be a real number, got 'a' of type str."),
    (dict(enabled=1), TypeError, "`enabled` must be a Python bool, got 1."),
    (dict(min_scale=1e-40), ValueError,
     "`min_scale` must be 0 (no bound) or a normal float32: finite and at least 2**-126, got 1e-40, "
     "which float32 stores as 9.99994610111476e-41."),
    (dict(max_scale=0.0), ValueError, "`max_scale` must be at least 2**-126 in float32 (inf for no bound), got 0.0."),
    (dict(growth_factor=np.ones(2)), ValueError, "`growth_factor` must be a scalar, got an array of shape (2,)."),
    (dict(growth_interval=2.5), ValueError,
     "`growth_interval` must be an integer that fits in int32 (-2147483648 to 2147483647), got 2.5."),
    (dict(growth_interval=-2**40), ValueError,
     "`growth_interval` must be an integer that fits in int32 (-2147483648 to 2147483647), got -1099511627776."),
    (dict(min_scale=-1.0), ValueError,
     "`min_scale` must be 0 (no bound) or a normal float32: finite and at least 2**-126, got -1.0."),
    (dict(growth_factor=np.inf), ValueError, "`growth_factor` must be finite and > 1 in float32, got inf."),
    (dict(init_scale=None), TypeError, "`init_scale` must be a real number, got None of type NoneType."),
    (dict(dynamic=1.0), TypeError, "`dynamic` must be a bool, got 1.0 of type float."),
    (dict(backoff_factor=0.99999999), ValueError,
     "`backoff_factor` must be in the open interval (0, 1) in float32, got 0.99999999, which float32 stores as 1.0."),
]


@pytest.mark.parametrize("options, error, message", INIT_ERRORS, ids=[str(o) for o, _, _ in INIT_ERRORS])
def test_init_errors_word_for_word(options, error, message):
  for build in (jaxscale.init, lambda **o: jaxscale.dynamic_loss_scaling(optax.sgd(0.1), **o)):
    with pytest.raises(error) as caught:
      build(**options)
    assert str(caught.value) == message


def test_other_errors_word_for_word():
  state = jaxscale.init()
  takes = ("['backoff_factor', 'dynamic', 'growth_factor', 'growth_interval', 'growth_tracker', "
           "'hysteresis', 'max_scale', 'min_scale', 'scale']")
  stalled = jaxscale.init(init_scale=2.0, min_scale=1.0, on_stall="raise")
  stalled = jaxscale.update(jaxscale.update(stalled, False), False)
  cases = [
      (lambda: jaxscale.configure(state, min_scale=2.0**20), ValueError,
       "`min_scale` (1048576.0) must not exceed `scale` (65536.0): a back-off would raise the scale; "
       "lower `min_scale` or raise the scale."),
      (lambda: jaxscale.configure(state, enabled=False), ValueError,
       f"`configure` cannot change ['enabled']; it takes any of {takes}."),
      (lambda: jaxscale.load_state_dict(state, {}), ValueError,
       "The state dict is empty: it was probably saved from a disabled scaler."),
      (lambda: jaxscale.load_state_dict(state, {"scale": 1.0, "x": 1}), ValueError,
       "Not a torch.amp.GradScaler state dict: missing keys ['_growth_tracker', 'backoff_factor', "
       "'growth_factor', 'growth_interval'], unexpected keys ['x']; expected exactly ['_growth_tracker', "
       "'backoff_factor', 'growth_factor', 'growth_interval', 'scale']."),
      (lambda: jaxscale.raise_if_stalled(stalled), FloatingPointError,
       "jaxscale: a step overflowed while the loss scale was already at `min_scale` (1.0); every step "
       "since has been skipped and the parameters hold their last finite values. Lower `min_scale`, or "
       "look for the source of the inf/NaN in the model."),
      (lambda: jaxscale.scale(state, jnp.int32(1)), ValueError,
       "`jaxscale.scale` needs a floating loss (or a pytree with at least one floating leaf), but got "
       "leaves of dtypes ['int32']."),
      (lambda: jaxscale.find_scaler({}), ValueError,
       "`find_scaler` found no ScalerState in an object of type dict; it needs exactly one. Build the "
       "optimizer with `jaxscale.dynamic_loss_scaling(inner)`, and pass its state (or a part of it "
       "holding one scaler)."),
      (lambda: jaxscale.update(state, "yes"), TypeError,
       "`finite` must be a bool scalar (such as the flag of `unscale_and_check`), got 'yes' of type str; "
       "compare explicitly, e.g. `jnp.isfinite(x).all()`."),
      (lambda: jaxscale.update(state, jnp.float32(1.0)), TypeError,
       "`finite` must be a bool scalar (such as the flag of `unscale_and_check`), got an array of dtype "
       "float32; compare explicitly, e.g. `jnp.isfinite(x).all()`."),
      (lambda: jaxscale.update(state, jnp.array([True, False])), ValueError,
       "`finite` must be a bool scalar of shape (), got shape (2,); reduce it first, e.g. with `.all()`."),
  ]
  for call, error, message in cases:
    with pytest.raises(error) as caught:
      call()
    assert str(caught.value) == message


def test_find_scaler_counts_the_scalers_it_found():
  with pytest.raises(ValueError) as caught:
    jaxscale.find_scaler({"a": jaxscale.init(), "b": [jaxscale.init()]})
  assert str(caught.value).startswith("`find_scaler` found 2 ScalerStates in an object of type dict;")


def test_find_scaler_unwraps_nnx_variables_into_arrays():
  from flax import nnx

  model = nnx.Linear(3, 2, rngs=nnx.Rngs(0))
  options = dict(init_scale=2.0**9, growth_interval=7)
  optimizer = nnx.Optimizer(model, jaxscale.dynamic_loss_scaling(optax.sgd(0.1), **options), wrt=nnx.Param)
  want = jaxscale.init(**options)
  for where in [optimizer.opt_state, nnx.state(optimizer)]:
    found = jaxscale.find_scaler(where)
    assert type(found) is jaxscale.ScalerState
    for name, leaf, expected in zip(want._fields, found, want):
      assert isinstance(leaf, jax.Array) and not isinstance(leaf, nnx.Variable), name
      assert bits(leaf) == bits(expected), name
  plain = jaxscale.init(**options)  # with flax.nnx imported, plain arrays pass through untouched
  assert all(a is b for a, b in zip(jaxscale.find_scaler({"s": plain}), plain))


def test_raise_if_stalled_names_the_stalled_scalers_of_a_2d_batch():
  stall = jax.vmap(jax.vmap(jaxscale.update))
  state = jax.vmap(jax.vmap(lambda _: jaxscale.init(init_scale=2.0, min_scale=1.0, on_stall="raise")))(jnp.zeros((2, 2)))
  flags = jnp.array([[True, False], [True, True]])
  state = stall(stall(state, flags), flags)
  with pytest.raises(FloatingPointError) as caught:
    jaxscale.raise_if_stalled(state)
  assert "(scalers [[0, 1]] of a batch of shape (2, 2))" in str(caught.value)
  assert "`min_scale` (1.0)" in str(caught.value) or "`min_scale` ([1.])" in str(caught.value)


@pytest.mark.hand_made_gradients
@pytest.mark.parametrize("path", ["plain", "fallback"])
def test_a_learning_rate_closed_over_gets_a_zero_derivative_through_a_skipped_step(path, monkeypatch):
  # The plain select (the eager path, and the fallback when the jaxpr cannot be evaluated) runs the
  # inner update on zeroed gradients when skipping: `lr * inf` would make d/dlr NaN, not 0.

  def meta_loss(lr, grads):
    tx = jaxscale.dynamic_loss_scaling(optax.sgd(lr), init_scale=4.0)
    updates, _ = tx.update(grads, tx.init(PARAMS), PARAMS)
    return sum(jnp.sum(p**2) for p in jax.tree.leaves(optax.apply_updates(PARAMS, updates)))

  grad = jax.grad(meta_loss)
  if path == "fallback":
    def cannot(*args, **kwargs):
      raise NotImplementedError("a primitive this evaluator does not know")

    monkeypatch.setattr(_optax, "_eval_jaxpr", cannot)
    grad = jax.jit(grad)
  for bad in (jnp.inf, jnp.nan):
    assert float(grad(jnp.float32(0.1), poisoned(GRADS) | {"b": GRADS["b"].at[0].set(bad)})) == 0.0
  taken = float(grad(jnp.float32(0.1), jax.tree.map(lambda g: g * 4.0, GRADS)))
  want = sum(-2 * float(jnp.sum((p - 0.1 * g) * g)) for p, g in zip(jax.tree.leaves(PARAMS), jax.tree.leaves(GRADS)))
  np.testing.assert_allclose(taken, want, rtol=1e-5)


FAST_PATH_INNERS = {
    "adam": lambda: optax.adam(1e-2),
    "sgd_momentum": lambda: optax.sgd(0.1, momentum=0.9),
    "twice_and_once": twice_and_once,
    "inject_hyperparams": lambda: optax.inject_hyperparams(optax.adam)(learning_rate=1e-2),
    # An array the update closes over is a constant of its jaxpr, which the evaluator must bind.
    "closes_over_an_array": lambda: optax.stateless(lambda u, p: {"w": u["w"] * jnp.array([0.5, 2.0, 1.0]), "b": u["b"]}),
}


@pytest.mark.hand_made_gradients
@pytest.mark.parametrize("make", FAST_PATH_INNERS.values(), ids=FAST_PATH_INNERS.keys())
def test_jitted_steps_select_where_produced_without_falling_back(make, monkeypatch):
  # The fallback gives the same values, only slower: a broken fast path would hide behind it.

  def no_fallback(*args, **kwargs):
    raise AssertionError("the jitted step fell back to selecting on the outputs")

  tx = jaxscale.dynamic_loss_scaling(make(), init_scale=4.0)
  state = tx.init(PARAMS)
  monkeypatch.setattr(_optax, "_select_outputs", no_fallback)
  step = jax.jit(lambda g, s: tx.update(g, s, PARAMS))
  _, taken = step(jax.tree.map(lambda g: g * 4.0, GRADS), state)
  _, skipped = step(poisoned(GRADS), taken)
  assert bits(skipped.inner_state) == bits(taken.inner_state)
  # Derivatives through the fast path: finite, zero for the skipped step's gradients.
  d = jax.grad(lambda g: sum(jnp.sum(u) for u in jax.tree.leaves(step(g, taken)[0])))(poisoned(GRADS))
  assert all(not np.asarray(x).any() for x in jax.tree.leaves(d))


@pytest.mark.filterwarnings("ignore:jaxscale. .dynamic_loss_scaling. was given float16 gradients:UserWarning")
@pytest.mark.hand_made_gradients
@pytest.mark.parametrize("path", ["jit", "eager", "fallback"])
def test_a_skipped_step_keeps_every_dtype(path, monkeypatch):
  """float16 parameters, an int32 step count: a skipped step's updates and state keep their dtypes."""
  params = {"w": jnp.ones(3, jnp.float16), "b": jnp.zeros(2, jnp.float16)}
  tx = jaxscale.dynamic_loss_scaling(optax.adam(1e-2), init_scale=8.0)
  state = tx.init(params)
  grads = {"w": jnp.array([1.0, jnp.inf, 0.0], jnp.float16), "b": jnp.ones(2, jnp.float16)}
  if path == "fallback":
    monkeypatch.setattr(_optax, "_select_where_produced", lambda *a: (_ for _ in ()).throw(RuntimeError("forced")))
  update = tx.update if path == "eager" else jax.jit(tx.update)
  updates, new_state = update(grads, state, params)
  assert jax.tree.map(lambda x: x.dtype, updates) == jax.tree.map(lambda x: x.dtype, params)
  assert jax.tree.map(lambda x: x.dtype, new_state.inner_state) == jax.tree.map(lambda x: x.dtype, state.inner_state)
  assert bool(new_state.scaler.last_skipped)


def test_a_negative_growth_tracker_is_refused_word_for_word():
  with pytest.raises(ValueError) as error:
    jaxscale.configure(jaxscale.init(), growth_tracker=-1)
  assert str(error.value) == "`growth_tracker` must be an integer >= 0, got -1."


def test_init_defaults_are_torchs():
  # torch.amp.GradScaler's documented defaults (init_scale=2.0**16, growth_factor=2.0, backoff_factor=0.5,
  # growth_interval=2000), as its state_dict() writes them.
  assert jaxscale.state_dict(jaxscale.init()) == {
      "scale": 65536.0, "growth_factor": 2.0, "backoff_factor": 0.5, "growth_interval": 2000, "_growth_tracker": 0}


def test_every_state_field_has_its_documented_dtype():
  """ScalerState's field comments: flags are bool, counters int32, the rest float32."""
  flags = {"last_skipped", "stalled", "dynamic", "raise_on_stall", "enabled"}
  counters = {"growth_tracker", "hysteresis_tracker", "skipped_steps", "growth_interval", "hysteresis"}
  for state in (jaxscale.init(), jaxscale.init(enabled=False), jaxscale.update(jaxscale.init(), False)):
    for name, value in state._asdict().items():
      expected = jnp.bool_ if name in flags else jnp.int32 if name in counters else jnp.float32
      assert value.dtype == expected and value.shape == (), (name, value)


# --- from the full run's survivors (tests/MUTATION.md) ---------------------------------------------


def test_the_finiteness_check_cannot_overflow_on_finite_values():
  """A sum of the values themselves would overflow: the check sums `g * 0`."""
  assert bool(jaxscale.all_finite(jnp.array([3e38, 3e38])))
  assert bool(jaxscale.all_finite(jnp.array([60000.0, 60000.0], jnp.float16)))
  assert not bool(jaxscale.all_finite(jnp.array([3e38, jnp.inf])))


def test_the_smallest_normal_float32_is_a_valid_bound():
  tiny = 2.0**-126
  assert float(jaxscale.init(min_scale=tiny).min_scale) == tiny
  assert float(jaxscale.init(init_scale=tiny, max_scale=tiny).max_scale) == tiny


def test_integers_beyond_float32_are_stored_with_their_sign():
  assert float(jaxscale.init(max_scale=10**40).max_scale) == np.inf
  with pytest.raises(ValueError, match=r"got -1000+, which float32 stores as -inf\.$"):
    jaxscale.init(min_scale=-(10**40))


def test_int32_min_is_refused_as_below_one_not_as_out_of_range():
  with pytest.raises(ValueError, match=r"^`growth_interval` must be an integer >= 1, got -2147483648\.$"):
    jaxscale.init(growth_interval=-(2**31))


def test_numpy_error_settings_do_not_leak_into_option_checks():
  with np.errstate(under="raise"), pytest.raises(ValueError, match="which float32 stores as 0.0"):
    jaxscale.init(init_scale=1e-50)


def test_unscaling_stays_in_float32_for_float16_gradients_under_x64(x64):
  # 0.046875 / (1.5 * 2**20) is below float16's smallest subnormal: the float32 product rounds it to 0.
  unscaled, finite = jaxscale.unscale_and_check(jaxscale.init(init_scale=1.5 * 2**20), jnp.float16(0.046875))
  assert bool(finite)
  assert float(unscaled) == 0.0


def test_non_floating_leaves_are_ignored_by_the_check():
  assert bool(jaxscale.all_finite({"key": jax.random.key(0), "step": jnp.int32(3), "x": jnp.ones(2)}))


def test_a_disabled_scaler_takes_bounds_that_do_not_contain_its_fixed_scale_of_one():
  disabled = jaxscale.init(enabled=False)
  assert float(jaxscale.configure(disabled, min_scale=2.0).min_scale) == 2.0
  assert float(jaxscale.configure(disabled, max_scale=0.5).max_scale) == 0.5


def test_scales_below_one_flag_only_the_true_overflows():
  """At scale 0.5 a float16 gradient of 20000 unscales to a finite 40000: the step is good."""
  unscaled, finite = jaxscale.unscale_and_check(jaxscale.init(init_scale=0.5), jnp.array([20000.0], jnp.float16))
  assert bool(finite) and float(unscaled[0]) == 40000.0
  _, finite = jaxscale.unscale_and_check(jaxscale.init(init_scale=0.5), jnp.array([40000.0], jnp.float16))
  assert not bool(finite)  # 80000 is beyond float16


def test_traced_options_are_stored_in_their_documented_dtypes():
  states = jax.vmap(lambda s, n, h: jaxscale.init(init_scale=s, growth_interval=n, hysteresis=h))(
      jnp.array([8, 16]), jnp.array([3.0, 4.0]), jnp.array([1.0, 2.0]))
  assert (states.scale.dtype, states.growth_interval.dtype) == (jnp.float32, jnp.int32)
  assert (states.hysteresis.dtype, states.hysteresis_tracker.dtype) == (jnp.int32, jnp.int32)


def _changes_state_dtype():
  """An inner transformation whose update returns its state in another dtype than `init` made it."""
  init = lambda params: {"m": jnp.zeros(2, jnp.float32), "a": jnp.zeros(2, jnp.float32), "b": jnp.zeros(2, jnp.float32)}

  def update(updates, state, params=None):
    twice = (state["a"] + 2).astype(jnp.bfloat16)  # one value, output as two state leaves
    return updates, {"m": (state["m"] + 1).astype(jnp.bfloat16), "a": twice, "b": twice}

  return optax.GradientTransformation(init, update)


@pytest.mark.hand_made_gradients
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
