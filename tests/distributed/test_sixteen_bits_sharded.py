"""16-bit parameters and state over 8 devices: stochastic rounding draws the same numbers however
the parameters are laid out, so a sharded step's parameters are bit for bit the single-device
step's and its state too, but where XLA fuses a float32 update an ulp apart (the stored moments and
Kahan's compensation, within the bounds derived below); the compensation, the keys and the stored
moments keep the parameters' sharding."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import jaxscale

# These tests hand the wrapper gradients of their own making, with no gradient site: the warning
# for an update without its `finite` flag is tested in tests/test_contract.py.
pytestmark = pytest.mark.filterwarnings("ignore:jaxscale. `dynamic_loss_scaling`'s update got no `finite` flag")


def make(method):
  inner = jaxscale.dynamic_loss_scaling(jaxscale.low_precision_state(optax.adam(1e-3)), init_scale=2.0**8)
  return jaxscale.master_weights(inner, method=method)


STEPS = 3


def run(tx, params, steps=STEPS):
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
def single_device_run(method):
  """The unsharded run's parameters as bytes, its state's other leaves and its compensation:
  one reference for the three layouts."""
  params, state = run(make(method), initial_params())
  rest = [np.asarray(x) for x in jax.tree.leaves(state._replace(compensation=None))]
  return bits(params), rest, jax.tree.map(np.asarray, state.compensation)


@pytest.mark.parametrize("spec", [P("x", None), P(None, "x"), P()], ids=["rows", "columns", "replicated"])
@pytest.mark.parametrize("method", ["kahan", "stochastic_rounding"])
def test_sharded_step_is_the_single_device_step(method, spec):
  mesh = jax.make_mesh((8,), ("x",), axis_types=(AxisType.Auto,))
  params = initial_params()
  sharded = {"w": jax.device_put(params["w"], NamedSharding(mesh, spec)),
             "b": jax.device_put(params["b"], NamedSharding(mesh, P()))}
  got_params, got_state = run(make(method), sharded)
  want_params, want_state, want_compensation = single_device_run(method)
  assert bits(got_params) == want_params
  # The stored moments within 2**-8 of their leaf's largest magnitude a step, the rest bit for bit: XLA
  # may fuse a moment's float32 update `b * m + (1 - b) * g` differently in the sharded program, one
  # float32 ulp apart, 2**-23 of its terms (at most max|g| for the first moment, about 4 times the leaf's
  # largest |m| here: 2**-21 of it), and a stochastic rounding of two values that close, with the same
  # random bits, lands on the same or an adjacent bfloat16 value (2**-8 of the leaf's largest at most).
  # Where the terms cancel, that is many ulps of the element itself (seen on jax 0.12: -3.0e-8 against
  # -1.9e-8, once in 2048 elements over three steps).
  for got, want in zip(jax.tree.leaves(got_state._replace(compensation=None)), want_state, strict=True):
    got = np.asarray(got)
    if got.tobytes() != want.tobytes():
      assert jnp.issubdtype(got.dtype, jnp.floating), (got, want)
      got, want = got.astype(np.float64), np.asarray(want).astype(np.float64)
      assert np.all(np.abs(got - want) <= STEPS * 2.0**-8 * np.max(np.abs(want))), np.max(np.abs(got - want))
  # Kahan's compensation (float16, in units of the parameter's ulp) within one of its own ulps per
  # step: XLA fuses Adam's update differently in the sharded program and may round it one float32
  # ulp apart (2**-24 of the update, which is below the parameter's ulp). In the compensation that
  # is at most 2**-24 of a value whose float16 ulp is 2**-11 of it: across one rounding boundary
  # and no further, each step; the compensation carries the last step's difference into the next
  # exactly (it is added back as `c * ulp`, a product by a power of two). The parameters, which
  # the update reaches through a rounding at 2**-11 of their size, stay bit for bit (above).
  for got, want in zip(jax.tree.leaves(got_state.compensation), jax.tree.leaves(want_compensation)):
    got, want = np.asarray(got), np.asarray(want)
    ulps = np.spacing(np.maximum(np.abs(got), np.abs(want))).astype(np.float64)
    assert np.all(np.abs(got.astype(np.float64) - want.astype(np.float64)) <= STEPS * ulps)
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
