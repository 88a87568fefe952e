"""Activation-gradient taps: nothing changes but the probes' gradients, which are the cotangents' range."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jaxscale
from _bitwise import assert_bitwise_equal
from _jit import compilations
from _range_reference import reference

SCALE = 2.0**10


def mlp(params, x, taps=None, *, dtype):
  for i, (w, b) in enumerate(params):
    x = jnp.tanh(x.astype(dtype) @ w.astype(dtype) + b.astype(dtype))
    x = jaxscale.tap(x, taps, f"h{i}")
  return x


def loss(params, x, taps=None, *, dtype=jnp.float16):
  return SCALE * 1e-6 * jnp.mean(mlp(params, x, taps, dtype=dtype).astype(jnp.float32) ** 2)


def make_params(rng, widths=(16, 32, 32, 8)):
  return [(jnp.asarray(rng.normal(0, 1 / np.sqrt(a), (a, b)), jnp.float32),
           jnp.asarray(rng.normal(0, 0.1, b), jnp.float32))
          for a, b in zip(widths[:-1], widths[1:])]


def assert_stats(stats, cotangent, dtype=np.float16):
  for field, value in reference(np.asarray(cotangent, np.float32), 1.0, dtype).items():
    # The reference is another program: XLA may round a float32 sum differently (min and max show it).
    rtol = 1e-3 if field.endswith("magnitude") else 1e-6
    np.testing.assert_allclose(np.asarray(getattr(stats, field), np.float64), value, rtol=rtol, err_msg=field)


@pytest.mark.parametrize("dtype", [jnp.float16, jnp.float32], ids=["float16", "float32"])
def test_plain_jax_taps_change_nothing_and_see_the_vjp(dtype):
  rng = np.random.default_rng(0)
  params, x = make_params(rng), jnp.asarray(rng.normal(size=(64, 16)), jnp.float32)
  probes = jaxscale.tap_probes(["h0", "h1"])
  f = lambda *a: loss(*a, dtype=dtype)
  forward = jax.jit(lambda p, x, t: mlp(p, x, t, dtype=dtype))
  assert_bitwise_equal(forward(params, x, None), forward(params, x, probes))
  tapped = jax.jit(jax.grad(f, argnums=(0, 2)))
  grads, stats = tapped(params, x, probes)
  assert_bitwise_equal(jax.jit(jax.grad(f))(params, x), grads)

  # The reference: the cotangent of h0 by hand, from jax.vjp of the rest of the network.
  h0 = jnp.tanh(x.astype(dtype) @ params[0][0].astype(dtype) + params[0][1].astype(dtype))
  rest = lambda h: SCALE * 1e-6 * jnp.mean(mlp(params[1:], h, dtype=dtype).astype(jnp.float32) ** 2)
  _, vjp = jax.vjp(rest, h0)
  (cotangent,) = vjp(jnp.ones((), jnp.float32))
  assert cotangent.dtype == dtype
  assert_stats(stats["h0"], cotangent)
  assert float(stats["h0"].zero_fraction + stats["h0"].subnormal_fraction) > 0  # the case worth seeing
  for _ in range(2):
    tapped(params, x, probes)
  assert compilations(tapped) == 1


def test_taps_off_add_nothing_to_the_computation():
  rng = np.random.default_rng(1)
  params, x = make_params(rng), jnp.asarray(rng.normal(size=(4, 16)), jnp.float32)

  def untapped(params, x):
    for w, b in params:
      x = jnp.tanh(x.astype(jnp.float16) @ w.astype(jnp.float16) + b.astype(jnp.float16))
    return SCALE * 1e-6 * jnp.mean(x.astype(jnp.float32) ** 2)

  assert str(jax.make_jaxpr(jax.grad(loss))(params, x)) == str(jax.make_jaxpr(jax.grad(untapped))(params, x))
  only = jaxscale.tap_probes(["h1"])  # a name not in the probes is not tapped either
  assert "stats_at_scale" in str(jax.make_jaxpr(jax.grad(loss, argnums=(0, 2)))(params, x, only))


def test_tap_dtype_and_errors():
  g = jnp.array([2.0**-7, 2.0**-10, 1.0])
  probes = jaxscale.tap_probes(["x"])
  stats = jax.grad(lambda x, t: jnp.vdot(g, jaxscale.tap(x, t, "x", dtype=jnp.float8_e4m3fn)), argnums=1)(g, probes)
  assert_stats(stats["x"], g, jnp.float8_e4m3fn.dtype if hasattr(jnp.float8_e4m3fn, "dtype") else jnp.float8_e4m3fn)
  with pytest.raises(TypeError, match="`names`"):
    jaxscale.tap_probes("x")


class LinenMLP(nn.Module):
  @nn.compact
  def __call__(self, x, taps=None, delta=0.0):
    x = jaxscale.tap(nn.tanh(nn.Dense(32, dtype=jnp.float16)(x)) + delta, taps, "hidden")
    return nn.Dense(4, dtype=jnp.float16)(x)


class NNXMLP(nnx.Module):
  def __init__(self, rngs):
    self.up = nnx.Linear(16, 32, dtype=jnp.float16, rngs=rngs)
    self.down = nnx.Linear(32, 4, dtype=jnp.float16, rngs=rngs)

  def __call__(self, x, taps=None, delta=0.0):
    return self.down(jaxscale.tap(nnx.tanh(self.up(x)) + delta, taps, "hidden"))


def scaled_mse(y):
  return SCALE * 1e-5 * jnp.mean(y.astype(jnp.float32) ** 2)


def test_linen_taps():
  x = jnp.asarray(np.random.default_rng(2).normal(size=(64, 16)), jnp.float32)
  module = LinenMLP()
  params = module.init(jax.random.key(0), x)
  probes = jaxscale.tap_probes(["hidden"])
  f = lambda params, taps: scaled_mse(module.apply(params, x, taps))
  grads, stats = jax.jit(jax.grad(f, argnums=(0, 1)))(params, probes)
  assert_bitwise_equal(jax.jit(jax.grad(f))(params, None), grads)
  assert_bitwise_equal(module.apply(params, x), module.apply(params, x, probes))
  # The reference: the gradient of a zero added to the tapped activation (the examples' old way).
  delta = jnp.zeros((64, 32), jnp.float16)
  assert_stats(stats["hidden"], jax.grad(lambda d: scaled_mse(module.apply(params, x, delta=d)))(delta))


def test_nnx_taps():
  x = jnp.asarray(np.random.default_rng(3).normal(size=(64, 16)), jnp.float32)
  model = NNXMLP(nnx.Rngs(0))
  probes = jaxscale.tap_probes(["hidden"])
  grads, stats = nnx.jit(nnx.grad(lambda m, t: scaled_mse(m(x, t)), argnums=(0, 1)))(model, probes)
  plain = nnx.jit(nnx.grad(lambda m: scaled_mse(m(x))))(model)
  assert_bitwise_equal(nnx.state(plain), nnx.state(grads))
  assert_bitwise_equal(model(x), model(x, probes))
  delta = jnp.zeros((64, 32), jnp.float16)
  cotangent = nnx.grad(lambda m, d: scaled_mse(m(x, delta=d)), argnums=1)(model, delta)
  assert_stats(stats["hidden"], cotangent)


def test_probes_that_are_not_a_mapping_are_explained():
  with pytest.raises(TypeError, match="tap_probes"):
    jaxscale.tap(jnp.ones(2), ["h"], "h")


def test_forward_mode_needs_the_taps_off():
  """As the docstring says: with probes a tap is a custom_vjp (no jvp); with None it is the identity."""
  x = jnp.ones(3)
  jax.jvp(lambda x: jaxscale.tap(x, None, "h"), (x,), (x,))
  with pytest.raises(TypeError, match="custom_vjp"):
    jax.jvp(lambda x: jaxscale.tap(x, jaxscale.tap_probes(["h"]), "h"), (x,), (x,))
