"""suggest_scale and probe_scale: the largest power of two that fits, over the headroom."""

import math
import warnings

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from flax import nnx

import jaxscale
from _jit import compilations
from _range_reference import reference

DTYPES = {"float16": np.float16, "bfloat16": ml_dtypes.bfloat16, "float8_e4m3fn": ml_dtypes.float8_e4m3fn,
          "float8_e5m2": ml_dtypes.float8_e5m2}


def overflows(x, scale, dtype):
  with warnings.catch_warnings(), np.errstate(over="ignore"):
    warnings.simplefilter("ignore")
    return not np.all(np.isfinite((np.asarray(x, np.float32) * np.float32(scale)).astype(dtype).astype(np.float32)))


@pytest.mark.parametrize("name", list(DTYPES))
@pytest.mark.parametrize("largest", [3.0, 2.0**-20, 65504.0, 1e30])
def test_known_largest_gradient_gives_the_expected_power_of_two(name, largest, strict_promotion):
  dtype, headroom = DTYPES[name], 8.0
  top = float(ml_dtypes.finfo(dtype).max)
  expected = min(max(2.0 ** math.floor(math.log2(top / largest)) / headroom, 2.0**-126), 2.0**127)
  # A linear model whose gradient is c: the largest |c| is known.
  c = np.asarray(np.random.default_rng(0).uniform(-1, 1, 50) * largest / 2, np.float32)
  c[7] = -largest
  grads = jax.grad(lambda w: jnp.vdot(w, jnp.asarray(c)))(jnp.zeros(50))
  f = jax.jit(lambda g: jaxscale.suggest_scale({"w": g, "n": jnp.arange(2)}, dtype=getattr(jnp, name)))
  scale = f(grads)
  assert scale.dtype == jnp.float32 and float(scale) == expected
  clipped = expected == 2.0**127  # bfloat16 at 2**-20: no float32 power of two is too large
  assert not overflows(c, float(scale) * (1 if clipped else headroom), dtype)
  assert clipped or overflows(c, 2 * float(scale) * headroom, dtype)
  f(grads * 2)
  assert compilations(f) == 1


def test_headroom_and_what_says_nothing():
  g = jnp.array([3.0, -1e-3])
  assert float(jaxscale.suggest_scale(g, headroom=1)) == 2.0**14
  assert float(jaxscale.suggest_scale(g, headroom=2**5)) == 2.0**9
  with_bad = jnp.array([3.0, -1e-3, jnp.inf, jnp.nan])
  assert float(jaxscale.suggest_scale(with_bad)) == float(jaxscale.suggest_scale(g))
  assert float(jaxscale.suggest_scale({"z": jnp.zeros(3), "n": jnp.array([jnp.nan])})) == 2.0**16
  assert float(jaxscale.suggest_scale({})) == 2.0**16
  for bad in (3.0, 0.5, 0):
    with pytest.raises(ValueError, match="`headroom`"):
      jaxscale.suggest_scale(g, headroom=bad)


def test_probe_scale_on_a_model_with_known_gradients():
  """loss = weight * sum(c * tap(x * w)): the tap's cotangent is weight * c, w's is weight * c * x."""
  rng = np.random.default_rng(1)
  c = rng.uniform(-1, 1, 64).astype(np.float32)
  x = rng.uniform(0.0, 0.25, 64).astype(np.float32)
  weight = np.float32(1e-6)

  def loss_fn(w, x, taps=None):
    return weight * jnp.sum(jnp.asarray(c) * jaxscale.tap(x * w, taps, "h"))

  probe = jax.jit(lambda w, x: jaxscale.probe_scale(loss_fn, w, x, taps=["h"]))(jnp.ones(64), jnp.asarray(x))
  largest = float(np.max(np.abs(weight * c)))  # the tap's, four times the parameters'
  assert float(probe.max_magnitude) == pytest.approx(largest, rel=1e-6)
  assert float(probe.scale) == 2.0 ** math.floor(math.log2(65504 / largest)) / 8
  expected = reference(weight * c * x, float(probe.scale), np.float16)
  np.testing.assert_allclose(float(probe.stats.zero_fraction), expected["zero_fraction"])
  np.testing.assert_allclose(float(probe.stats.subnormal_fraction), expected["subnormal_fraction"])
  tap = reference(weight * c * np.float32(probe.scale), 1.0, np.float16)
  np.testing.assert_allclose(float(probe.taps["h"].max_magnitude), tap["max_magnitude"], rtol=1e-6)
  assert float(probe.taps["h"].overflow_fraction) == 0.0
  unscaled = jaxscale.range_stats(weight * c * x)
  assert float(probe.stats.zero_fraction) < float(unscaled.zero_fraction)
  grads, taps = jax.grad(loss_fn, argnums=(0, 2))(jnp.ones(64), jnp.asarray(x), jaxscale.tap_probes(["h"]))
  assert float(jaxscale.suggest_scale((grads, taps))) == float(probe.scale) < float(jaxscale.suggest_scale(grads))
  state = jaxscale.init(init_scale=float(probe.scale))
  assert float(state.scale) == float(probe.scale)


class TappedNNX(nnx.Module):
  def __init__(self, rngs):
    self.up, self.down = nnx.Linear(8, 16, rngs=rngs), nnx.Linear(16, 4, rngs=rngs)

  def __call__(self, x, taps=None):
    return self.down(jaxscale.tap(nnx.relu(self.up(x)), taps, "hidden"))


def test_probe_scale_with_nnx_under_nnx_jit():
  model, x = TappedNNX(nnx.Rngs(0)), jnp.ones((4, 8))
  loss_fn = lambda model, x, taps=None: 1e-7 * jnp.mean(model(x, taps) ** 2)
  probe = nnx.jit(lambda m, x: jaxscale.probe_scale(loss_fn, m, x, taps=["hidden"], grad=nnx.grad))(model, x)
  grads, taps = nnx.grad(loss_fn, argnums=(0, 2))(model, x, jaxscale.tap_probes(["hidden"]))
  assert float(probe.scale) == float(jaxscale.suggest_scale((grads, taps)))
  assert sorted(probe.taps) == ["hidden"]


def test_float64_gradients_beyond_float32_range_still_set_the_scale(x64):
  assert float(jaxscale.suggest_scale(jnp.array([1e300, 1.0], jnp.float64))) == 2.0**-126


def test_headroom_as_a_numpy_or_jax_scalar():
  g = jnp.array([3.0])
  for headroom in (np.float32(8.0), jnp.float32(8.0), np.int64(8)):
    assert float(jaxscale.suggest_scale(g, headroom=headroom)) == 2.0**11
  for bad in (float("inf"), float("nan"), "8", None):
    with pytest.raises(ValueError, match="`headroom`"):
      jaxscale.suggest_scale(g, headroom=bad)


def test_probe_scale_with_a_float16_loss_keeps_the_scaled_loss_finite():
  """A float16 loss is scaled in float16 (`jaxscale.scale` keeps dtypes), and its seed cotangent is the
  scale itself: both must fit, whatever room the gradients leave."""
  w, x = jnp.full((4, 3), 0.1, jnp.float16), jnp.ones((8, 4), jnp.float16)
  loss_fn = lambda w, x: jnp.mean(jnp.tanh(x @ w) ** 2) * jnp.float16(1e-3)
  probe = jaxscale.probe_scale(loss_fn, w, x)
  assert float(probe.scale) == 2.0**15 / 8  # max(|loss|, 1) * s * headroom <= 65504
  scaler = jaxscale.init(init_scale=float(probe.scale))
  _, finite = jaxscale.unscale_and_check(scaler, jax.grad(lambda w: jaxscale.scale(scaler, loss_fn(w, x)))(w))
  assert bool(finite) and float(probe.stats.nonfinite) == 0.0


def test_at_twice_the_scale_the_largest_exceeds_the_maximum_though_it_may_round_down_onto_it():
  """The documented bound is `max |x| * s * headroom <= finfo.max`; just above 65504 the cast rounds down."""
  scale = float(jaxscale.suggest_scale(jnp.array([65505.0]), headroom=1))
  assert scale == 0.5 and not overflows([65505.0], 2 * scale, np.float16)


def tapped_loss(w, x, taps=None):
  h = jaxscale.tap(jnp.tanh(x @ w), taps, "hidden")
  return jnp.mean(h**2) * 1e-9


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_probe_scale_refuses_taps_that_loss_fn_does_not_tap(jit):
  w, x = jnp.full((4, 3), 0.1), jnp.ones((8, 4))
  probe = lambda w, x: jaxscale.probe_scale(tapped_loss, w, x, taps=["hidden", "hiden"])
  with pytest.raises(ValueError, match=r"taps \['hiden'\].*\['hidden'\]"):
    (jax.jit(probe) if jit else probe)(w, x)


def test_probe_scale_refuses_a_single_tap_name_as_a_string():
  with pytest.raises(TypeError, match=r"single string 'hidden'; pass \['hidden'\]"):
    jaxscale.probe_scale(tapped_loss, jnp.full((4, 3), 0.1), jnp.ones((8, 4)), taps="hidden")
