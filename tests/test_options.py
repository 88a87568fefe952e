"""Options that cannot work are refused at construction, checked as they will be stored.

`init`, `dynamic_loss_scaling`, `configure` and `load_state_dict` share one validation: every value
is converted to its storage dtype (float32, int32, bool) first, and checked there, so a value that
is fine in float64 but not in float32 (1e39 -> inf, 1e-50 -> 0, 0.99999999 -> 1) is refused too.
"""

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxscale

# These tests hand the wrapper gradients of their own making, with no gradient site: the warning
# for an update without its `finite` flag is tested in tests/test_contract.py.
pytestmark = pytest.mark.filterwarnings("ignore:jaxscale. `dynamic_loss_scaling`'s update got no `finite` flag")

# Every option that cannot work, refused by `init` and by the wrapper alike. Where the message is
# given in full (a sentence ending in "."), it must be that sentence word for word: it names the
# option, the value received and what would work; otherwise the message must name the option.
OPTION_ERRORS = [
    (dict(growth_factor=1.0), ValueError,
     "`growth_factor` must be finite and > 1 in float32, got 1.0."),
    (dict(backoff_factor=1.0), ValueError,
     "`backoff_factor` must be in the open interval (0, 1) in float32, got 1.0."),
    (dict(backoff_factor=1e-50), ValueError,
     "`backoff_factor` must be in the open interval (0, 1) in float32, got 1e-50, which float32 stores as 0.0."),
    (dict(growth_interval=0), ValueError,
     "`growth_interval` must be an integer >= 1, got 0."),
    (dict(init_scale=1e39), ValueError,
     "`init_scale` must be a normal float32: finite and at least 2**-126 (~1.18e-38), got 1e+39, "
     "which float32 stores as inf."),
    (dict(min_scale=16.0, init_scale=4.0), ValueError,
     "`min_scale` (16.0) must not exceed `init_scale` (4.0): a back-off would raise the scale; "
     "lower `min_scale` or raise the scale."),
    (dict(init_scale=64.0, max_scale=4.0), ValueError,
     "`init_scale` (64.0) must not exceed `max_scale` (4.0): a growth would lower the scale; "
     "raise `max_scale` or lower the scale."),
    (dict(min_scale=8.0, max_scale=4.0, init_scale=4.0), ValueError,
     "`min_scale` (8.0) must not exceed `max_scale` (4.0): no scale could satisfy both."),
    (dict(hysteresis=0), ValueError,
     "`hysteresis` must be an integer >= 1, got 0."),
    (dict(on_stall="x"), ValueError,
     "`on_stall` must be 'skip' or 'raise', got 'x'."),
    (dict(dynamic="no"), TypeError,
     "`dynamic` must be a bool, got 'no' of type str."),
    (dict(growth_interval=True), TypeError,
     "`growth_interval` must be a real number, got True of type bool."),
    (dict(growth_interval=2**40), ValueError,
     "`growth_interval` must be an integer that fits in int32 (-2147483648 to 2147483647), got 1099511627776."),
    (dict(init_scale="a"), TypeError,
     "`init_scale` must be a real number, got 'a' of type str."),
    (dict(enabled=1), TypeError,
     "`enabled` must be a Python bool, got 1."),
    (dict(min_scale=1e-40), ValueError,
     "`min_scale` must be 0 (no bound) or a normal float32: finite and at least 2**-126, got 1e-40, "
     "which float32 stores as 9.99994610111476e-41."),
    (dict(max_scale=0.0), ValueError,
     "`max_scale` must be at least 2**-126 in float32 (inf for no bound), got 0.0."),
    (dict(growth_factor=np.ones(2)), ValueError,
     "`growth_factor` must be a scalar, got an array of shape (2,)."),
    (dict(growth_interval=2.5), ValueError,
     "`growth_interval` must be an integer that fits in int32 (-2147483648 to 2147483647), got 2.5."),
    (dict(growth_interval=-2**40), ValueError,
     "`growth_interval` must be an integer that fits in int32 (-2147483648 to 2147483647), got -1099511627776."),
    (dict(min_scale=-1.0), ValueError,
     "`min_scale` must be 0 (no bound) or a normal float32: finite and at least 2**-126, got -1.0."),
    (dict(growth_factor=np.inf), ValueError,
     "`growth_factor` must be finite and > 1 in float32, got inf."),
    (dict(init_scale=None), TypeError,
     "`init_scale` must be a real number, got None of type NoneType."),
    (dict(dynamic=1.0), TypeError,
     "`dynamic` must be a bool, got 1.0 of type float."),
    (dict(backoff_factor=0.99999999), ValueError,
     "`backoff_factor` must be in the open interval (0, 1) in float32, got 0.99999999, which float32 stores as 1.0."),
    (dict(init_scale=4.0, min_scale=16.0), ValueError, "`min_scale`"),  # min scale above init scale
    (dict(init_scale=2.0**-127), ValueError, "`init_scale`"),  # init scale subnormal
    (dict(init_scale=1e-50), ValueError, "`init_scale`"),  # init scale underflows to 0
    (dict(growth_factor=1 + 1e-8), ValueError, "`growth_factor`"),  # growth factor rounds to 1
    (dict(growth_factor=1e39), ValueError, "`growth_factor`"),  # growth factor overflows float32
    (dict(init_scale=1.0, min_scale=2.0**-130), ValueError, "`min_scale`"),  # min scale subnormal
    (dict(min_scale=1e39), ValueError, "`min_scale`"),  # max scale overflows to inf is fine but min is not
    (dict(growth_interval=2**31), ValueError, "`growth_interval`"),  # growth interval out of int32
    (dict(hysteresis=2**40), ValueError, "`hysteresis`"),  # hysteresis out of int32
    (dict(growth_interval=1e300), ValueError, "`growth_interval`"),  # growth interval huge float
    (dict(dynamic=0), TypeError, "`dynamic`"),  # dynamic int
    (dict(enabled="yes"), TypeError, "`enabled`"),  # enabled string
    (dict(hysteresis=True), TypeError, "`hysteresis`"),  # hysteresis bool
    (dict(growth_factor="2"), TypeError, "`growth_factor`"),  # growth factor string
    (dict(init_scale="1024"), TypeError, "`init_scale`"),  # init scale string
    (dict(backoff_factor=0.5j), TypeError, "`backoff_factor`"),  # backoff factor complex
    (dict(growth_interval="100"), TypeError, "`growth_interval`"),  # growth interval string
    (dict(backoff_factor=0.0), ValueError, "`backoff_factor`"),  # backoff factor 0
    (dict(init_scale=0.0), ValueError, "`init_scale`"),  # init scale 0
    (dict(init_scale=-1.0), ValueError, "`init_scale`"),  # init scale negative
    (dict(init_scale=math.inf), ValueError, "`init_scale`"),  # init scale inf
    (dict(init_scale=math.nan), ValueError, "`init_scale`"),  # init scale nan
    (dict(min_scale=8.0, max_scale=4.0), ValueError, "`min_scale`"),  # min above max
    (dict(on_stall="explode"), ValueError, "`on_stall`"),  # on stall
]


@pytest.mark.parametrize("options, error, message", OPTION_ERRORS, ids=[str(o) for o, _, _ in OPTION_ERRORS])
def test_init_and_wrapper_refuse_options_that_cannot_work(options, error, message):
  for build in (jaxscale.init, lambda **o: jaxscale.dynamic_loss_scaling(optax.sgd(0.1), **o)):
    with pytest.raises(error) as caught:
      build(**options)
    if message.endswith("."):
      assert str(caught.value) == message
    else:
      assert message in str(caught.value)


def test_error_names_the_value_and_what_would_work():
  with pytest.raises(ValueError, match=r"`init_scale`.*float32.*1e\+39.*stores as inf"):
    jaxscale.init(init_scale=1e39)
  with pytest.raises(ValueError, match=r"`backoff_factor`.*0\.99999999.*1\.0"):
    jaxscale.init(backoff_factor=0.99999999)
  with pytest.raises(ValueError, match=r"`min_scale` \(16\.0\).*`init_scale` \(4\.0\)"):
    jaxscale.init(init_scale=4.0, min_scale=16.0)
  with pytest.raises(TypeError, match=r"`dynamic`.*bool.*'no'"):
    jaxscale.init(dynamic="no")


GOOD_EDGES = {
    "smallest_normal_scale": dict(init_scale=float(np.finfo(np.float32).tiny)),
    "largest_scale": dict(init_scale=2.0**127),
    "min_equals_init": dict(init_scale=8.0, min_scale=8.0),
    "max_equals_init": dict(init_scale=8.0, max_scale=8.0),
    "min_scale_underflows_to_0": dict(min_scale=1e-50),  # stored as 0: no bound, which is legal
    "max_scale_overflows_to_inf": dict(max_scale=1e39),  # stored as inf: no bound, which is legal
    "numpy_and_jax_scalars": dict(init_scale=np.float64(8.0), growth_interval=np.int64(3), dynamic=np.bool_(True)),
    "integral_float_interval": dict(growth_interval=3.0),
    "int_scale": dict(init_scale=1024),
}


@pytest.mark.parametrize("options", GOOD_EDGES.values(), ids=GOOD_EDGES.keys())
def test_edge_values_that_work_are_accepted(options):
  state = jaxscale.init(**options)
  # The stored values are what was asked for, in float32 / int32.
  if "init_scale" in options:
    assert float(state.scale) == float(np.float32(options["init_scale"]))
  if "growth_interval" in options:
    assert int(state.growth_interval) == int(options["growth_interval"])


CONFIGURE = {
    "min_scale_above_scale": (dict(min_scale=2.0**20), ValueError, "min_scale"),
    "max_scale_below_scale": (dict(max_scale=2.0), ValueError, "max_scale"),
    "scale_below_min_scale": (dict(scale=1.0, min_scale=4.0), ValueError, "min_scale"),
    "scale_overflows_float32": (dict(scale=1e39), ValueError, "scale"),
    "scale_subnormal": (dict(scale=1e-40), ValueError, "scale"),
    "backoff_factor_rounds_to_1": (dict(backoff_factor=0.99999999), ValueError, "backoff_factor"),
    "growth_factor_rounds_to_1": (dict(growth_factor=1 + 1e-8), ValueError, "growth_factor"),
    "growth_tracker_out_of_int32": (dict(growth_tracker=2**31), ValueError, "growth_tracker"),
    "growth_tracker_negative": (dict(growth_tracker=-1), ValueError, "growth_tracker"),
    "dynamic_string": (dict(dynamic="no"), TypeError, "dynamic"),
    "growth_interval_bool": (dict(growth_interval=True), TypeError, "growth_interval"),
    "scale_string": (dict(scale="8"), TypeError, "scale"),
}


@pytest.mark.parametrize("options, error, name", CONFIGURE.values(), ids=CONFIGURE.keys())
def test_configure_refuses_what_init_refuses(options, error, name):
  state = jaxscale.init(init_scale=2.0**10)
  with pytest.raises(error, match=f"`{name}`"):
    jaxscale.configure(state, **options)


def test_configure_moving_scale_and_bound_together_is_fine():
  state = jaxscale.configure(jaxscale.init(init_scale=2.0**10), scale=2.0**20, min_scale=2.0**15)
  assert float(state.scale) == 2.0**20 and float(state.min_scale) == 2.0**15


def test_configure_under_jit_checks_types_not_values():
  state = jaxscale.init()
  with pytest.raises(TypeError, match="`dynamic`"):
    jax.jit(lambda s, d: jaxscale.configure(s, dynamic=d))(state, jnp.float32(0.0))
  # A traced value is not known at trace time: it is taken as it is.
  out = jax.jit(lambda s, g: jaxscale.configure(s, growth_factor=g))(state, jnp.float32(4.0))
  assert float(out.growth_factor) == 4.0


@pytest.mark.parametrize("hysteresis", [1, 3, 5])
def test_configure_hysteresis_refills_the_tolerance(hysteresis):
  state = jaxscale.init(init_scale=2.0**10, hysteresis=2)
  state = jaxscale.update(state, jnp.array(False))  # one of the two tolerated overflows spent
  assert int(state.hysteresis_tracker) == 1
  state = jaxscale.configure(state, hysteresis=hysteresis)
  assert int(state.hysteresis_tracker) == hysteresis
  # `hysteresis` overflows in a row are now tolerated before the scale backs off.
  scales = []
  for _ in range(hysteresis):
    state = jaxscale.update(state, jnp.array(False))
    scales.append(float(state.scale))
  assert scales == [2.0**10] * (hysteresis - 1) + [2.0**9]


TORCH_DICT = {"scale": 1024.0, "growth_factor": 2.0, "backoff_factor": 0.5, "growth_interval": 10, "_growth_tracker": 0}
LOAD = {
    "scale_below_min_scale": ({"scale": 1.0}, dict(min_scale=4.0), ValueError, "min_scale"),
    "scale_above_max_scale": ({"scale": 2.0**20}, dict(init_scale=2.0**10, max_scale=2.0**12), ValueError, "max_scale"),
    "scale_overflows_float32": ({"scale": 1e39}, {}, ValueError, "scale"),
    "backoff_factor_rounds_to_1": ({"backoff_factor": 0.99999999}, {}, ValueError, "backoff_factor"),
    "growth_interval_string": ({"growth_interval": "10"}, {}, TypeError, "growth_interval"),
    "growth_tracker_out_of_int32": ({"_growth_tracker": 2**33}, {}, ValueError, "growth_tracker"),
}


@pytest.mark.parametrize("changes, init_options, error, name", LOAD.values(), ids=LOAD.keys())
def test_load_state_dict_refuses_what_init_refuses(changes, init_options, error, name):
  state = jaxscale.init(**init_options)
  with pytest.raises(error, match=f"`{name}`"):
    jaxscale.load_state_dict(state, {**TORCH_DICT, **changes})


def test_batched_state_is_validated_elementwise_by_configure():
  states = jax.tree.map(lambda x: jnp.stack([x, x]), jaxscale.init(init_scale=2.0**10))
  # The new value goes to every scaler of the batch.
  np.testing.assert_array_equal(jaxscale.configure(states, growth_factor=4.0).growth_factor, [4.0, 4.0])
  with pytest.raises(ValueError, match="`min_scale`"):
    jaxscale.configure(states, min_scale=2.0**11)


def test_stored_values_never_differ_from_validated_ones():
  # Whatever passes validation is stored as a normal, finite float32 scale.
  for value in [2.0**-126, 1.5, 3.0e38, 2.0**127]:
    state = jaxscale.init(init_scale=value)
    stored = float(state.scale)
    assert math.isfinite(stored) and stored >= 2.0**-126


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
       "since has been skipped and the parameters hold their last finite values. Look for the source "
       "of the inf/NaN in the model, or lower `min_scale`; or, if the loss is scaled by another scaler "
       "than this optimizer's (one found once and reused, or a fresh `jaxscale.init()`), take "
       "`jaxscale.find_scaler(opt_state)` inside each step."),
      (lambda: jaxscale.scale(state, jnp.int32(1)), ValueError,
       "`jaxscale.scale` needs a floating loss (or a pytree with at least one floating leaf), but got "
       "leaves of dtypes ['int32']."),
      (lambda: jaxscale.find_scaler({}), ValueError,
       "`find_scaler` found no ScalerState in an object of type dict; it needs exactly one. Build the "
       "optimizer with `jaxscale.dynamic_loss_scaling(inner)`, and pass its state (or a part of it "
       "holding one scaler)."),
  ]
  for call, error, message in cases:
    with pytest.raises(error) as caught:
      call()
    assert str(caught.value) == message


def test_a_negative_growth_tracker_is_refused_word_for_word():
  with pytest.raises(ValueError) as error:
    jaxscale.configure(jaxscale.init(), growth_tracker=-1)
  assert str(error.value) == "`growth_tracker` must be an integer >= 0, got -1."


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


def test_a_disabled_scaler_takes_bounds_that_do_not_contain_its_fixed_scale_of_one():
  disabled = jaxscale.init(enabled=False)
  assert float(jaxscale.configure(disabled, min_scale=2.0).min_scale) == 2.0
  assert float(jaxscale.configure(disabled, max_scale=0.5).max_scale) == 0.5
