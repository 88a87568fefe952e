"""The update rule, scaling and unscaling, against a plain-Python model of the rule."""

import math
import re

import hypothesis
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxscale
from _bitwise import assert_bitwise_equal
from _jit import compilations
from _reference import ReferenceScaler

# These tests hand the wrapper gradients of their own making, with no gradient site: the warning
# for an update without its `finite` flag is tested in tests/test_contract.py.
pytestmark = pytest.mark.filterwarnings("ignore:jaxscale. `dynamic_loss_scaling`'s update got no `finite` flag")

f32 = np.float32


OPTION_SETS = {
    "torch_defaults_short_interval": dict(init_scale=2.0**16, growth_interval=3),
    "odd_factors": dict(init_scale=1000.0, growth_factor=3.0, backoff_factor=0.3, growth_interval=2),
    "hysteresis_3": dict(init_scale=2.0**10, growth_interval=4, hysteresis=3),
    "bounded": dict(init_scale=4.0, growth_interval=1, min_scale=0.25, max_scale=64.0),
    "static": dict(init_scale=128.0, growth_interval=1, dynamic=False),
    "static_near_its_floor": dict(init_scale=2.0**-121, dynamic=False),  # stalls after 6 overflows in a row
    "static_odd_floor": dict(init_scale=3.0, min_scale=0.5, hysteresis=2, dynamic=False),
    "static_at_its_floor": dict(init_scale=1.0, min_scale=1.0, hysteresis=2, dynamic=False),  # at once, as dynamic
    "growth_overflows_float32": dict(init_scale=2.0**126, growth_interval=1),
    "backoff_to_float32_floor": dict(init_scale=2.0**-120, backoff_factor=0.25, growth_interval=5),
}


DEFAULTS = dict(init_scale=2.0**16, growth_factor=2.0, backoff_factor=0.5, growth_interval=2000, hysteresis=1,
                min_scale=0.0, max_scale=math.inf, dynamic=True)


def reference_for(options):
  return ReferenceScaler(enabled=True, **{**DEFAULTS, **options})


jit_update = jax.jit(jaxscale.update)


@pytest.mark.parametrize("options", OPTION_SETS.values(), ids=OPTION_SETS.keys())
@hypothesis.settings(max_examples=25, deadline=None)
@hypothesis.given(flags=st.lists(st.booleans(), min_size=1, max_size=40))
def test_update_matches_reference_model(options, flags):
  state, ref = jaxscale.init(**options), reference_for(options)
  for finite in flags:
    state = jit_update(state, jnp.asarray(finite))
    ref.update(finite)
    assert float(state.scale) == ref.scale
    assert int(state.growth_tracker) == ref.growth_tracker
    assert int(state.hysteresis_tracker) == ref.hysteresis_tracker
    assert int(state.skipped_steps) == ref.skipped_steps
    assert bool(state.last_skipped) == ref.last_skipped
    assert bool(state.stalled) == ref.stalled


def test_update_compiles_once_whatever_flag_scale_and_options():
  update = jax.jit(lambda state, finite: jaxscale.update(state, finite))
  state = jaxscale.init(growth_interval=2)
  for finite in [True, False, True, True, False]:
    state = update(state, finite)
  state = jaxscale.configure(state, growth_factor=4.0, scale=3.0, hysteresis=2, dynamic=False)
  state = update(state, True)
  assert compilations(update) == 1


def test_scale_of_2_pow_127_does_not_grow_past_float32():
  state = jaxscale.init(init_scale=2.0**127, growth_interval=1)
  state = jaxscale.update(state, True)
  assert float(state.scale) == 2.0**127
  assert int(state.growth_tracker) == 0


def test_growth_is_clamped_to_max_scale():
  state = jaxscale.init(init_scale=48.0, growth_interval=1, max_scale=64.0)
  assert float(jaxscale.update(state, True).scale) == 64.0


def test_backoff_below_one_stops_at_min_scale():
  state = jaxscale.init(init_scale=1.0, min_scale=0.125)
  scales = []
  for _ in range(5):
    state = jaxscale.update(state, False)
    scales.append(float(state.scale))
  assert scales == [0.5, 0.25, 0.125, 0.125, 0.125]


def test_backoff_never_leaves_float32_normal_range():
  # 2**16 backs off to 2**-126 in 142 overflows; torch would go on to 2**-127,
  # which XLA flushes to 0: then every unscale is 0 * inf = NaN, forever.
  state, ref = jaxscale.init(), ReferenceScaler()
  for _ in range(200):
    state = jit_update(state, jnp.asarray(False))
    ref.update(False)
    assert float(state.scale) == ref.scale
  assert float(state.scale) == 2.0**-126
  grads, finite = jaxscale.unscale_and_check(state, {"w": jnp.array([2.0**-100, 0.0])})
  assert bool(finite) and grads["w"].tolist() == [2.0**26, 0.0]


def test_scale_stuck_at_float32_floor_is_a_stall():
  state = jaxscale.init(init_scale=2.0**-125, on_stall="raise")
  state = jaxscale.update(state, False)  # 2**-126: the floor, not a stall yet
  assert float(state.scale) == 2.0**-126 and not bool(state.stalled)
  jaxscale.raise_if_stalled(state)
  state = jaxscale.update(state, False)  # an overflow at the floor
  assert bool(state.stalled)
  with pytest.raises(FloatingPointError, match="2\\*\\*-126"):
    jaxscale.raise_if_stalled(state)


def test_on_stall_skip_keeps_going():
  state = jaxscale.init(init_scale=1.0, min_scale=1.0, growth_interval=1, on_stall="skip")
  for finite in [False, False, True]:
    state = jaxscale.update(state, finite)
  assert not bool(state.stalled)
  assert float(state.scale) == 2.0
  jaxscale.raise_if_stalled(state)


def test_on_stall_raise_freezes_and_raises():
  state = jaxscale.init(init_scale=2.0, min_scale=1.0, growth_interval=1, on_stall="raise")
  state = jaxscale.update(state, False)  # 2 -> 1: backing off still helps
  assert not bool(state.stalled)
  state = jaxscale.update(state, False)  # already at the floor: stalled
  assert bool(state.stalled)
  state = jaxscale.update(state, True)  # later steps are skipped, finite or not
  assert bool(state.last_skipped) and int(state.skipped_steps) == 3
  with pytest.raises(FloatingPointError, match="min_scale"):
    jaxscale.raise_if_stalled(state)


def test_disabled_state_is_inert():
  state = jaxscale.init(enabled=False)
  assert float(state.scale) == 1.0
  after = jaxscale.update(state, False)
  jax.tree.map(lambda a, b: np.testing.assert_array_equal(a, b), after, state)
  grads, finite = jaxscale.unscale_and_check(state, {"w": jnp.array([jnp.nan, 1.0])})
  assert bool(finite)
  np.testing.assert_array_equal(grads["w"], np.array([np.nan, 1.0], np.float32))
  x = jnp.float16(3.0)
  scaled = jaxscale.scale(state, x)
  assert scaled.dtype == jnp.float16 and float(scaled) == 3.0


def test_configure_sets_scale_like_torch_update_new_scale():
  state = jaxscale.update(jaxscale.init(growth_interval=10), True)
  state = jaxscale.configure(state, scale=2.0**8)
  assert float(state.scale) == 256.0
  assert int(state.growth_tracker) == 1  # torch's update(new_scale) leaves the tracker alone


def test_configure_under_jit_changes_options_without_recompiling():
  @jax.jit
  def set_interval(state, n):
    return jaxscale.configure(state, growth_interval=n)

  state = jaxscale.init()
  for n in [1, 5, 9]:
    state = set_interval(state, n)
    assert int(state.growth_interval) == n
  assert compilations(set_interval) == 1


@pytest.mark.parametrize("dtype", [jnp.float16, jnp.bfloat16, jnp.float32], ids=["f16", "bf16", "f32"])
def test_scale_keeps_dtypes_and_leaves_integers_alone(dtype, strict_promotion):
  state = jaxscale.init(init_scale=8.0)
  tree = {"loss": jnp.asarray(0.25, dtype), "aux": (jnp.float32(1.5), jnp.int32(3))}
  out = jaxscale.scale(state, tree)
  assert out["loss"].dtype == dtype and float(out["loss"]) == 2.0
  assert out["aux"][0].dtype == jnp.float32 and float(out["aux"][0]) == 12.0
  assert out["aux"][1].dtype == jnp.int32 and int(out["aux"][1]) == 3


def test_scale_forms_the_product_in_float32():
  # 2**16 does not fit in float16, but 2**-10 * 2**16 = 64 does.
  assert float(jaxscale.scale(jaxscale.init(), jnp.float16(2.0**-10))) == 64.0


@pytest.mark.parametrize("dtype", [jnp.float16, jnp.bfloat16, jnp.float32], ids=["f16", "bf16", "f32"])
def test_unscale_is_exact_for_power_of_two_scales(dtype, strict_promotion):
  rng = np.random.default_rng(0)
  true = jnp.asarray(rng.normal(size=64) * 1e-3, dtype)
  for exponent in [0, 1, 10, 16, 24]:  # scales below 1 would make float16 subnormals
    state = jaxscale.init(init_scale=2.0**exponent)
    scaled = jaxscale.scale(state, true)
    grads, finite = jaxscale.unscale_and_check(state, {"g": scaled})
    # 16-bit gradients come out in float32, cast before they are unscaled; each value is exact.
    assert grads["g"].dtype == jnp.float32 and bool(finite)
    np.testing.assert_array_equal(grads["g"], true.astype(jnp.float32))


def test_unscale_is_exact_at_scale_2_pow_127():
  # 1 / 2**127 is subnormal in float32: a multiply by it would flush to zero.
  state = jaxscale.init(init_scale=2.0**127)
  g = np.array([1.0, -0.75, 2.0**-20], np.float32)
  unscaled, finite = jax.jit(jaxscale.unscale_and_check)(state, g * np.float32(2.0**127))
  assert bool(finite)
  np.testing.assert_array_equal(unscaled, g)


def test_unscale_matches_torch_rounding_for_other_scales():
  # torch multiplies by fl(1 / scale); so do we, without ever forming a subnormal.
  g = np.linspace(-3, 3, 101, dtype=np.float32)
  for s in [3.0, 1000.0, 0.3, 12345.678]:
    ours, _ = jaxscale.unscale_and_check(jaxscale.init(init_scale=s), g)
    np.testing.assert_array_equal(ours, g * (np.float32(1) / np.float32(s)))


@pytest.mark.parametrize("bad", [np.inf, -np.inf, np.nan], ids=["inf", "-inf", "nan"])
@pytest.mark.parametrize("dtype", [jnp.float16, jnp.bfloat16, jnp.float32], ids=["f16", "bf16", "f32"])
def test_check_finds_one_bad_element_anywhere(bad, dtype):
  check = jax.jit(jaxscale.unscale_and_check)
  state = jaxscale.init(init_scale=4.0)
  for index in [0, 517, 1023]:
    grads = {"a": jnp.ones((4, 3), dtype), "b": jnp.ones(1024, dtype).at[index].set(bad)}
    assert not bool(check(state, grads)[1])
  assert bool(check(state, {"a": jnp.ones(3, dtype), "b": jnp.full(3, 60000, dtype)})[1])


def test_unscaling_that_overflows_float32_is_not_finite():
  # A scale below 1 can push float32 gradients past 3.4e38 when unscaling.
  state = jaxscale.init(init_scale=0.5)
  grads, finite = jaxscale.unscale_and_check(state, jnp.array([3e38], jnp.float32))
  assert not bool(finite) and np.isinf(grads).all()


def test_check_ignores_integer_leaves():
  state = jaxscale.init()
  _, finite = jaxscale.unscale_and_check(state, {"g": jnp.ones(2), "n": jnp.int32(7)})
  assert bool(finite)


def test_configure_rejects_bad_values_and_unknown_names():
  state = jaxscale.init()
  with pytest.raises(ValueError, match="`backoff_factor`"):
    jaxscale.configure(state, backoff_factor=2.0)
  with pytest.raises(ValueError, match="cannot change"):
    jaxscale.configure(state, enabled=False)


@pytest.mark.parametrize(
    "loss",
    [jnp.int32(3), 3, {"a": jnp.arange(3)}],
    ids=["int32", "python_int", "int_tree"],
)
def test_scale_rejects_a_loss_with_no_floating_leaf(loss):
  with pytest.raises(ValueError, match="floating"):
    jaxscale.scale(jaxscale.init(), loss)


def test_every_leaf_is_an_array_with_its_own_buffer():
  # Three leaves, packed by dtype: a step passes 3 arrays for the scaler, not 15.
  leaves = jax.tree.leaves(jaxscale.init())
  assert [(leaf.dtype, leaf.shape) for leaf in leaves] == [(jnp.float32, (5,)), (jnp.int32, (5,)), (jnp.bool_, (5,))]
  assert all(isinstance(leaf, jax.Array) for leaf in leaves)
  pointers = [leaf.unsafe_buffer_pointer() for leaf in leaves]
  assert len(set(pointers)) == len(pointers)  # donating the state donates each once


def test_state_survives_tree_map_and_jit_roundtrip():
  state = jaxscale.init(init_scale=1024.0, min_scale=2.0, hysteresis=2)
  again = jax.jit(lambda s: jax.tree.map(lambda x: x, s))(state)
  assert isinstance(again, jaxscale.ScalerState)
  jax.tree.map(np.testing.assert_array_equal, again, state)


def test_value_and_grad_returns_unscaled_value_and_grads():
  def loss(w, x):
    return jnp.sum((w * x) ** 2), {"n": x.shape[0]}

  state = jaxscale.init(init_scale=2.0**12)
  w, x = jnp.array([1.0, -2.0]), jnp.array([0.5, 3.0])
  (value, aux), grads, finite = jaxscale.value_and_grad(loss, has_aux=True)(state, w, x)
  want_value, want_grads = jax.value_and_grad(lambda w: loss(w, x)[0])(w)
  assert bool(finite) and aux == {"n": 2}
  np.testing.assert_array_equal(value, want_value)
  np.testing.assert_array_equal(grads, want_grads)


@pytest.mark.parametrize("dtype", [jnp.float16, jnp.bfloat16, jnp.float32], ids=["f16", "bf16", "f32"])
@hypothesis.settings(max_examples=40, deadline=None)
@hypothesis.example(log2_scale=-13.0, values=[8.0])  # the case that once drew the old reference
@hypothesis.given(
    log2_scale=st.floats(-20, 127),
    values=st.lists(st.floats(allow_nan=True, allow_infinity=True, width=32), min_size=1, max_size=8),
)
def test_flag_is_finiteness_of_the_unscaled_gradients(dtype, log2_scale, values):
  # The flag is computed from the scaled buffers (see unscale_and_check); it
  # must still say exactly whether the *unscaled* gradients are all finite.
  scale = np.float32(2.0**log2_scale)
  state = jaxscale.init(init_scale=float(scale))
  with np.errstate(over="ignore", invalid="ignore"):
    g = np.asarray(values, np.float32).astype(dtype)
    # The reference in NumPy: torch's `g * fl(1 / scale)` in float32, where the gradient site leaves
    # 16-bit gradients (8.0 in float16 unscaled by 2**-13 is 65536: finite in float32, where
    # float16 would overflow).
    true = g.astype(np.float32) * (np.float32(1) / scale)
  _, finite = jax.jit(jaxscale.unscale_and_check)(state, {"g": jnp.asarray(g)})
  assert bool(finite) == bool(np.isfinite(true).all())


def test_all_finite_ignores_integers_and_agrees_over_an_axis():
  tree = {"w": jnp.ones((4, 3)), "n": jnp.arange(4)}
  assert bool(jaxscale.all_finite(tree))
  poisoned = {**tree, "w": tree["w"].at[2, 1].set(jnp.nan)}
  assert not bool(jaxscale.all_finite(poisoned))
  # Mapped over the leading axis, row 2 alone holds the NaN; with `axis_name` every row agrees.
  per_row = jax.vmap(jaxscale.all_finite)(poisoned)
  agreed = jax.vmap(lambda t: jaxscale.all_finite(t, axis_name="rows"), axis_name="rows")(poisoned)
  np.testing.assert_array_equal(per_row, [True, True, False, True])
  np.testing.assert_array_equal(agreed, [False] * 4)


INT32_MAX = 2**31 - 1
JIT = {"eager": lambda f: f, "jit": jax.jit}


def test_configure_keeps_a_disabled_scale_at_one():
  disabled = jaxscale.init(enabled=False)
  assert float(jaxscale.configure(disabled, scale=8.0).scale) == 1.0
  assert float(jax.jit(lambda s: jaxscale.configure(s, scale=jnp.float32(8.0)))(disabled).scale) == 1.0
  assert float(jaxscale.configure(jaxscale.init(), scale=8.0).scale) == 8.0


@pytest.mark.parametrize("wrap", JIT.values(), ids=JIT.keys())
def test_counters_saturate_at_int32_max(wrap):
  update = wrap(jaxscale.update)
  state = jaxscale.init().replace(skipped_steps=jnp.array(INT32_MAX - 1, jnp.int32))
  for _ in range(3):
    state = update(state, jnp.array(False))
    assert int(state.skipped_steps) == INT32_MAX
  # A static scale never grows, so its growth tracker keeps counting up to the end of int32.
  state = jaxscale.configure(jaxscale.init(dynamic=False), growth_tracker=INT32_MAX - 1)
  for _ in range(3):
    state = update(state, jnp.array(True))
    assert int(state.growth_tracker) == INT32_MAX


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
    for name, value in state.fields().items():
      expected = jnp.bool_ if name in flags else jnp.int32 if name in counters else jnp.float32
      assert value.dtype == expected and value.shape == (), (name, value)


def test_the_finiteness_check_cannot_overflow_on_finite_values():
  """A sum of the values themselves would overflow: the check sums `g - g`."""
  assert bool(jaxscale.all_finite(jnp.array([3e38, 3e38])))
  assert bool(jaxscale.all_finite(jnp.array([60000.0, 60000.0], jnp.float16)))
  assert not bool(jaxscale.all_finite(jnp.array([3e38, jnp.inf])))


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32", "complex64"])
@pytest.mark.parametrize("bad", [np.inf, -np.inf, np.nan, None], ids=["inf", "-inf", "nan", "finite"])
def test_the_check_is_numpys_isfinite_eagerly_and_compiled(dtype, bad):
  """`x - x` must stay a subtraction in the compiled check: a compiler that folded it to 0 (as
  fast-math does) would pass every inf. The reference is NumPy's own `isfinite`."""
  values = np.linspace(-60000, 60000, 37).astype(np.float32).astype(dtype)
  if bad is not None:
    values[17] = bad
  tree = {"w": jnp.asarray(values).reshape(37, 1), "b": jnp.ones(3, dtype)}
  want = bool(np.isfinite(values).all())
  assert bool(jaxscale.all_finite(tree)) is want
  assert bool(jax.jit(jaxscale.all_finite)(tree)) is want


def test_unscaling_stays_in_float32_for_float16_gradients_under_x64(x64):
  # 0.046875 / (1.5 * 2**20) is below float16's smallest subnormal: in float32 it survives, and
  # x64 does not widen it to float64.
  unscaled, finite = jaxscale.unscale_and_check(jaxscale.init(init_scale=1.5 * 2**20), jnp.float16(0.046875))
  assert bool(finite) and unscaled.dtype == jnp.float32
  assert float(unscaled) == float(np.float32(0.046875) * (np.float32(1) / np.float32(1.5 * 2**20)))


def test_non_floating_leaves_are_ignored_by_the_check():
  assert bool(jaxscale.all_finite({"key": jax.random.key(0), "step": jnp.int32(3), "x": jnp.ones(2)}))


def test_scales_below_one_flag_only_the_true_overflows():
  """At scale 0.5 a float16 gradient of 40000 unscales to a finite 80000 in float32: the step is good."""
  unscaled, finite = jaxscale.unscale_and_check(jaxscale.init(init_scale=0.5), jnp.array([40000.0], jnp.float16))
  assert bool(finite) and float(unscaled[0]) == 80000.0
  _, finite = jaxscale.unscale_and_check(jaxscale.init(init_scale=0.5), jnp.array([2e38], jnp.float32))
  assert not bool(finite)  # 4e38 is beyond float32


def test_traced_options_are_stored_in_their_documented_dtypes():
  states = jax.vmap(lambda s, n, h: jaxscale.init(init_scale=s, growth_interval=n, hysteresis=h))(
      jnp.array([8, 16]), jnp.array([3.0, 4.0]), jnp.array([1.0, 2.0]))
  assert (states.scale.dtype, states.growth_interval.dtype) == (jnp.float32, jnp.int32)
  assert (states.hysteresis.dtype, states.hysteresis_tracker.dtype) == (jnp.int32, jnp.int32)


@pytest.mark.parametrize("site", ["value_and_grad", "by_hand"])
def test_float16_parameters_keep_gradients_of_1e_minus_9_through_master_weights(site):
  # A true gradient of 1e-9 survives only as a scaled float16 gradient; unscaled in float16 it
  # would be 0. The gradient site casts it to float32 before it unscales it.
  tx = jaxscale.master_weights(jaxscale.dynamic_loss_scaling(optax.sgd(1.0), init_scale=2.0**20))
  params = jnp.zeros(3, jnp.float16)
  state = tx.init(params)
  scaler = jaxscale.find_scaler(state)
  loss = lambda p: jnp.sum(p.astype(jnp.float32) * 1e-9)
  if site == "value_and_grad":
    _, grads, finite = jaxscale.value_and_grad(loss)(scaler, params)
  else:
    grads, finite = jaxscale.unscale_and_check(scaler, jax.grad(lambda p: jaxscale.scale(scaler, loss(p)))(params))
  assert grads.dtype == jnp.float32 and bool(finite)
  _, state = tx.update(grads, state, params, finite=finite)
  # The scaled gradient rounded once to float16 (the cotangent of the cast), then exactly unscaled
  # in float32 (float64 reference).
  expected = -np.float64(np.float16(np.float32(1e-9) * 2**20)) / 2**20
  np.testing.assert_allclose(state.master, expected, rtol=1e-6)
  assert abs(expected + 1e-9) < 1e-12


SCALER_FUNCTIONS = {
    "scale": lambda s: jaxscale.scale(s, jnp.float32(1.0)),
    "unscale_and_check": lambda s: jaxscale.unscale_and_check(s, jnp.ones(2)),
    "update": lambda s: jaxscale.update(s, True),
    "configure": lambda s: jaxscale.configure(s, scale=2.0),
    "raise_if_stalled": jaxscale.raise_if_stalled,
    "state_dict": jaxscale.state_dict,
    "load_state_dict": lambda s: jaxscale.load_state_dict(s, jaxscale.state_dict(jaxscale.init())),
}


@pytest.mark.parametrize("name", SCALER_FUNCTIONS)
def test_an_optimizer_state_for_a_scaler_names_find_scaler(name):
  opt_state = jaxscale.dynamic_loss_scaling(optax.sgd(0.1)).init(jnp.zeros(2))
  with pytest.raises(TypeError) as error:
    SCALER_FUNCTIONS[name](opt_state)
  assert str(error.value) == (
      f"`jaxscale.{name}` takes a `ScalerState` (from `jaxscale.init()`), got an object of type "
      "DynamicLossScalingState. For the scaler inside an optimizer state (of `dynamic_loss_scaling`, "
      "a `TrainState`, an `nnx.Optimizer`), pass `jaxscale.find_scaler(opt_state)`."
  )


def test_value_and_grad_with_the_scaler_second_says_it_comes_first():
  with pytest.raises(TypeError, match=r"scaler state comes first: `value_and_grad\(fun\)\(scaler, \*args\)`"):
    jaxscale.value_and_grad(lambda w: jnp.sum(w**2))(jnp.ones(2), jaxscale.init())


def test_value_and_grad_with_has_aux_needs_a_pair():
  # `out[0]` of a vector would have differentiated its first element alone.
  with pytest.raises(TypeError, match=r"pair `\(loss, aux\)`.*shape \(3,\)"):
    jaxscale.value_and_grad(lambda w: w**2, has_aux=True)(jaxscale.init(), jnp.ones(3))


def test_packed_fields_read_replace_and_show_by_name():
  # Fifteen named scalars in three leaves: each reads, replaces and prints under its own name.
  state = jaxscale.init(init_scale=2.0**10, growth_interval=7, hysteresis=3)
  assert jaxscale.ScalerState.FIELDS == tuple(state.fields())
  assert len(set(jaxscale.ScalerState.FIELDS)) == 15
  changed = state.replace(skipped_steps=5, stalled=True, max_scale=2.0**20)
  for name, value in changed.fields().items():
    want = {"skipped_steps": 5, "stalled": True, "max_scale": 2.0**20}.get(name, getattr(state, name))
    assert value.dtype == getattr(state, name).dtype and value == want, name
  assert jaxscale.ScalerState.of(**changed.fields()).fields().keys() == changed.fields().keys()
  assert_bitwise_equal(jaxscale.ScalerState.of(**changed.fields()), changed)
  assert repr(state).startswith("ScalerState(scale=1024.0, growth_factor=2.0, backoff_factor=0.5, ")
  assert "growth_interval=7, hysteresis=3, " in repr(state)
  with pytest.raises(TypeError, match=r"`ScalerState` has no field \['scael'\]; its fields are \['scale', "):
    state.replace(scael=1.0)
  with pytest.raises(TypeError, match=r"missing \['enabled'\], unknown \[\]"):
    jaxscale.ScalerState.of(**{k: v for k, v in state.fields().items() if k != "enabled"})
  with pytest.raises(AttributeError):
    state.scale = 1.0  # immutable: `replace` makes a new state


def test_fields_given_as_numbers_of_another_kind_are_stored_in_their_own_dtype():
  # 1 for a flag, 3.0 for a count, 8 for the scale: each group keeps float32, int32 and bool.
  ones = jaxscale.ScalerState.of(**{name: 1 for name in jaxscale.ScalerState.FIELDS})
  assert (ones.floats.dtype, ones.ints.dtype, ones.flags.dtype) == (np.float32, np.int32, np.bool_)
  assert ones.fields() == {name: 1 for name in jaxscale.ScalerState.FIELDS}
  changed = jaxscale.init().replace(stalled=1, skipped_steps=3.0, scale=8)
  assert (changed.floats.dtype, changed.ints.dtype, changed.flags.dtype) == (np.float32, np.int32, np.bool_)
  assert changed.stalled.dtype == np.bool_ and changed.stalled
  assert changed.skipped_steps.dtype == np.int32 and changed.skipped_steps == 3
  assert changed.scale.dtype == np.float32 and changed.scale == 8.0


def test_replacing_fields_of_one_group_leaves_the_other_groups_as_they_were():
  state = jaxscale.init()
  changed = state.replace(scale=8.0, min_scale=2.0)
  assert changed.ints is state.ints and changed.flags is state.flags
  assert changed.scale == 8.0 and changed.min_scale == 2.0


def test_a_batch_of_scalers_shows_each_field_as_a_plain_list():
  one, two = jaxscale.init(init_scale=2.0**10, backoff_factor=0.25), jaxscale.init(init_scale=2.0**11)
  batch = jax.tree.map(lambda *leaves: jnp.stack(leaves), one, two)
  assert repr(batch) == (
      "ScalerState(scale=[1024.0, 2048.0], growth_factor=[2.0, 2.0], backoff_factor=[0.25, 0.5], "
      "min_scale=[0.0, 0.0], max_scale=[inf, inf], growth_tracker=[0, 0], hysteresis_tracker=[1, 1], "
      "skipped_steps=[0, 0], growth_interval=[2000, 2000], hysteresis=[1, 1], last_skipped=[False, False], "
      "stalled=[False, False], dynamic=[True, True], raise_on_stall=[True, True], enabled=[True, True])")


def test_a_state_inside_a_trace_shows_its_fields_as_tracers():
  shown = []
  jax.jit(lambda state: shown.append(repr(state)) or state.scale)(jaxscale.init())
  assert re.match(r"ScalerState\(scale=\S*float32\[\]", shown[0]), shown[0]
  assert re.search(r", skipped_steps=\S*int32\[\]", shown[0]), shown[0]
  assert re.search(r", enabled=\S*bool\[\]\S*\)$", shown[0]), shown[0]


# --- a static scale whose every step overflows stalls where the dynamic default would ---------------


@pytest.mark.parametrize("update", [jaxscale.update, jit_update], ids=["eager", "jit"])
@pytest.mark.parametrize("init_scale, hysteresis", [(2.0**16, 1), (1.0, 1), (1000.0, 3), (2.0**-126, 2)])
def test_a_static_scale_whose_every_step_overflows_stalls_where_a_dynamic_one_does(update, init_scale, hysteresis):
  options = dict(init_scale=init_scale, hysteresis=hysteresis)
  static, dynamic = jaxscale.init(**options, dynamic=False), jaxscale.init(**options)
  for step in range(300):
    static, dynamic = update(static, jnp.asarray(False)), update(dynamic, jnp.asarray(False))
    assert bool(static.stalled) == bool(dynamic.stalled), step
  assert bool(static.stalled) and float(static.scale) == f32(init_scale) and int(static.skipped_steps) == 300
  with pytest.raises(FloatingPointError, match=r"static loss scale \(`dynamic=False`\) overflowed on every step"):
    jaxscale.raise_if_stalled(static)
  with pytest.raises(FloatingPointError, match="static loss scale"):
    jaxscale.find_scaler({"scaler": static})


def test_a_static_scale_counts_overflows_in_a_row_only():
  state = jaxscale.init(init_scale=2.0**-120, dynamic=False)  # stalls at the 7th overflow in a row
  for finite in [False] * 6 + [True] + [False] * 6:
    state = jit_update(state, jnp.asarray(finite))
  assert not bool(state.stalled) and int(state.hysteresis_tracker) == 1 - 6
  assert bool(jit_update(state, jnp.asarray(False)).stalled)
  skip = jaxscale.init(init_scale=2.0**-120, dynamic=False, on_stall="skip")
  for _ in range(20):
    skip = jit_update(skip, jnp.asarray(False))
  assert not bool(skip.stalled) and int(skip.skipped_steps) == 20


def test_a_static_scale_in_a_training_step_raises_as_the_dynamic_one_does():
  params = {"w": jnp.ones(3)}
  for dynamic in (True, False):
    tx = jaxscale.dynamic_loss_scaling(optax.sgd(0.1), init_scale=2.0**-124, dynamic=dynamic)
    opt_state = tx.init(params)

    @jax.jit
    def step(params, opt_state):
      loss = lambda p: jnp.sum(p["w"] * jnp.nan)  # a NaN model: every step overflows
      _, grads, finite = jaxscale.value_and_grad(loss)(jaxscale.find_scaler(opt_state), params)
      updates, opt_state = tx.update(grads, opt_state, params, finite=finite)
      return optax.apply_updates(params, updates), opt_state

    for _ in range(2):
      params, opt_state = step(params, opt_state)
    jaxscale.find_scaler(opt_state)  # not yet
    params, opt_state = step(params, opt_state)
    with pytest.raises(FloatingPointError, match="every step since has been skipped"):
      jaxscale.find_scaler(opt_state)
  np.testing.assert_array_equal(params["w"], jnp.ones(3))


@pytest.mark.parametrize("wrap", [jax.jit, lambda f: f], ids=["jit", "eager"])
def test_value_and_grad_of_a_loss_and_aux_without_has_aux_names_has_aux(wrap):
  # JAX's own error would show the loss and the aux, both multiplied by the scale, and no word of
  # `has_aux`.
  loss = lambda w: (jnp.sum(w**2), {"norm": jnp.sum(jnp.abs(w))})
  with pytest.raises(TypeError, match=r"returned a tuple of 2 items.*pass `has_aux=True`"):
    wrap(lambda s, w: jaxscale.value_and_grad(loss)(s, w))(jaxscale.init(), jnp.ones(3))
