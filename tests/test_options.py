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

BAD_INIT = {
    # bounds against the scale they bound
    "min_scale_above_init_scale": (dict(init_scale=4.0, min_scale=16.0), ValueError, "min_scale"),
    "max_scale_below_init_scale": (dict(init_scale=64.0, max_scale=4.0), ValueError, "max_scale"),
    # as stored in float32
    "init_scale_overflows_float32": (dict(init_scale=1e39), ValueError, "init_scale"),
    "init_scale_subnormal": (dict(init_scale=2.0**-127), ValueError, "init_scale"),
    "init_scale_underflows_to_0": (dict(init_scale=1e-50), ValueError, "init_scale"),
    "backoff_factor_underflows_to_0": (dict(backoff_factor=1e-50), ValueError, "backoff_factor"),
    "backoff_factor_rounds_to_1": (dict(backoff_factor=0.99999999), ValueError, "backoff_factor"),
    "growth_factor_rounds_to_1": (dict(growth_factor=1 + 1e-8), ValueError, "growth_factor"),
    "growth_factor_overflows_float32": (dict(growth_factor=1e39), ValueError, "growth_factor"),
    "min_scale_subnormal": (dict(init_scale=1.0, min_scale=2.0**-130), ValueError, "min_scale"),
    "max_scale_overflows_to_inf_is_fine_but_min_is_not": (dict(min_scale=1e39), ValueError, "min_scale"),
    # as stored in int32
    "growth_interval_out_of_int32": (dict(growth_interval=2**31), ValueError, "growth_interval"),
    "hysteresis_out_of_int32": (dict(hysteresis=2**40), ValueError, "hysteresis"),
    "growth_interval_huge_float": (dict(growth_interval=1e300), ValueError, "growth_interval"),
    # wrong types
    "dynamic_string": (dict(dynamic="no"), TypeError, "dynamic"),
    "dynamic_int": (dict(dynamic=0), TypeError, "dynamic"),
    "enabled_string": (dict(enabled="yes"), TypeError, "enabled"),
    "growth_interval_bool": (dict(growth_interval=True), TypeError, "growth_interval"),
    "hysteresis_bool": (dict(hysteresis=True), TypeError, "hysteresis"),
    "growth_factor_string": (dict(growth_factor="2"), TypeError, "growth_factor"),
    "init_scale_string": (dict(init_scale="1024"), TypeError, "init_scale"),
    "init_scale_none": (dict(init_scale=None), TypeError, "init_scale"),
    "backoff_factor_complex": (dict(backoff_factor=0.5j), TypeError, "backoff_factor"),
    "growth_interval_string": (dict(growth_interval="100"), TypeError, "growth_interval"),
}


@pytest.mark.parametrize("options, error, name", BAD_INIT.values(), ids=BAD_INIT.keys())
def test_init_and_wrapper_refuse_options_that_cannot_work(options, error, name):
  with pytest.raises(error, match=f"`{name}`"):
    jaxscale.init(**options)
  with pytest.raises(error, match=f"`{name}`"):
    jaxscale.dynamic_loss_scaling(optax.sgd(0.1), **options)


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
  assert float(jaxscale.configure(states, growth_factor=4.0).growth_factor) == 4.0
  with pytest.raises(ValueError, match="`min_scale`"):
    jaxscale.configure(states, min_scale=2.0**11)


def test_stored_values_never_differ_from_validated_ones():
  # Whatever passes validation is stored as a normal, finite float32 scale.
  for value in [2.0**-126, 1.5, 3.0e38, 2.0**127]:
    state = jaxscale.init(init_scale=value)
    stored = float(state.scale)
    assert math.isfinite(stored) and stored >= 2.0**-126
