"""16-bit parameters and state over 8 devices: stochastic rounding draws the same numbers however
the parameters are laid out, so a sharded step is bit for bit the single-device one, and the
compensation, the keys and the stored moments keep the parameters' sharding."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import jaxscale


def make(method):
  inner = jaxscale.dynamic_loss_scaling(jaxscale.low_precision_state(optax.adam(1e-3)), init_scale=2.0**8)
  return jaxscale.master_weights(inner, method=method)


def run(tx, params, steps=3):
  def step(p, s, g):
    u, s = tx.update(g, s, p)
    return optax.apply_updates(p, u), s

  state = jax.jit(tx.init)(params)
  for i in range(steps):
    grads = jax.tree.map(lambda p, i=i: (jax.random.normal(jax.random.key(i), p.shape) * 8).astype(p.dtype), params)
    grads = jax.device_put(grads, jax.tree.map(lambda p: p.sharding, params))
    params, state = jax.jit(step)(params, state, grads)
  return params, state


def initial_params():
  return {"w": jax.random.normal(jax.random.key(0), (64, 32)).astype(jnp.float16), "b": jnp.zeros(32, jnp.float16)}


def bits(tree):
  return [np.asarray(x).tobytes() for x in jax.tree.leaves(tree)]


@functools.cache
def single_device_bits(method):
  """The unsharded run's parameters and state, as bytes: one reference for the three layouts."""
  params, state = run(make(method), initial_params())
  return bits(params), bits(state)


@pytest.mark.parametrize("spec", [P("x", None), P(None, "x"), P()], ids=["rows", "columns", "replicated"])
@pytest.mark.parametrize("method", ["kahan", "stochastic_rounding"])
def test_sharded_step_is_the_single_device_step(method, spec):
  mesh = jax.make_mesh((8,), ("x",), axis_types=(AxisType.Auto,))
  params = initial_params()
  sharded = {"w": jax.device_put(params["w"], NamedSharding(mesh, spec)),
             "b": jax.device_put(params["b"], NamedSharding(mesh, P()))}
  got_params, got_state = run(make(method), sharded)
  want_params, want_state = single_device_bits(method)
  assert bits(got_params) == want_params
  assert bits(got_state) == want_state
  assert got_params["w"].sharding.is_equivalent_to(NamedSharding(mesh, spec), 2)


def test_an_eager_init_keeps_each_stored_leaf_where_its_parameter_is():
  """Each leaf is rounded by itself: one program for all of them would put them on one set of
  devices (or refuse parameters committed to different ones)."""
  mesh = jax.make_mesh((8,), ("x",), axis_types=(AxisType.Auto,))
  params = {"w": jax.device_put(jnp.ones((64, 32)), NamedSharding(mesh, P("x", None))),
            "b": jax.device_put(jnp.zeros(32), jax.devices()[3])}
  mu = jaxscale.low_precision_state(optax.adam(1e-3)).init(params).inner_state[0].mu
  assert mu["w"].values.sharding.is_equivalent_to(params["w"].sharding, 2)
  assert mu["b"].values.devices() == {jax.devices()[3]}
