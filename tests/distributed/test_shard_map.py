"""`shard_map` and `pmap` over 8 devices: with `axis_name`, every device takes the same decision.

Inside a mapped function each device sees only its own gradients, so a check without `axis_name`
is local: that is what the control test shows, and why the flag must be reduced over the axis.
Every function here is run by both mappers on per-device arguments stacked along a leading axis
of size 8, and returns per-device results stacked the same way, so the tests read what each
device decided.
"""

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

AXIS = "devices"
N = 8
SCALE = 2.0**12
POISONED_DEVICE = 5


def run_mapped(mapper, fn, *stacked):
  """Runs `fn` on each device's slice of `stacked`; returns its outputs stacked per device."""
  if mapper == "pmap":
    return jax.pmap(fn, axis_name=AXIS)(*stacked)
  mesh = jax.make_mesh((N,), (AXIS,), axis_types=(AxisType.Auto,))

  def per_device(*blocks):
    out = fn(*jax.tree.map(lambda x: x[0], blocks))
    return jax.tree.map(lambda x: x[None], out)

  stacked = jax.device_put(stacked, NamedSharding(mesh, P(AXIS)))
  return jax.jit(jax.shard_map(per_device, mesh=mesh, in_specs=P(AXIS), out_specs=P(AXIS)))(*stacked)


def replicate(tree):
  """`tree` copied to every device: stacked N times along a new leading axis."""
  return jax.tree.map(lambda x: jnp.stack([x] * N), tree)


def per_device_grads(poison=False):
  """Different (scaled) gradients on every device; with `poison`, an inf on one device only."""
  grads = {"w": jax.random.normal(jax.random.key(1), (N, 4, 3)), "b": jnp.arange(N * 3.0).reshape(N, 3)}
  if poison:
    grads["w"] = grads["w"].at[POISONED_DEVICE, 2, 1].set(jnp.inf)
  return jax.tree.map(lambda g: g * SCALE, grads)


def assert_same_on_every_device(stacked_tree):
  for leaf in jax.tree.leaves(stacked_tree):
    leaf = np.asarray(leaf)
    for row in leaf[1:]:
      np.testing.assert_array_equal(row, leaf[0])


def pmean_gradients():
  """Averages the gradients over the devices: data parallelism as an Optax transformation."""
  return optax.GradientTransformation(
      lambda params: optax.EmptyState(),
      lambda updates, state, params=None: (jax.lax.pmean(updates, AXIS), state),
  )


MAPPERS = ["shard_map", "pmap"]


@pytest.mark.parametrize("mapper", MAPPERS)
def test_check_before_the_mean_agrees_only_with_axis_name(mapper):
  scaler = replicate(jaxscale.init(init_scale=SCALE))

  def check(scaler, grads):
    _, shared = jaxscale.unscale_and_check(scaler, grads, axis_name=AXIS)
    _, local = jaxscale.unscale_and_check(scaler, grads)
    return shared, local

  shared, local = run_mapped(mapper, check, scaler, per_device_grads(poison=True))
  assert not np.asarray(shared).any()
  assert np.flatnonzero(~np.asarray(local)).tolist() == [POISONED_DEVICE]


@pytest.mark.parametrize("mapper", MAPPERS)
def test_value_and_grad_agrees(mapper):
  def loss(w, x):
    return jnp.sum((x.astype(jnp.float16) * w.astype(jnp.float16)).astype(jnp.float32) ** 2)

  def step(scaler, w, x):
    _, grads, finite = jaxscale.value_and_grad(loss, axis_name=AXIS)(scaler, w, x)
    return finite

  # One device's batch overflows float16; the others are fine.
  x = jnp.ones((N, 3)).at[POISONED_DEVICE, 0].set(1e5)
  finite = run_mapped(mapper, step, replicate(jaxscale.init(init_scale=SCALE)), replicate(jnp.ones(3)), x)
  assert not np.asarray(finite).any()


LAYOUTS = {
    # Every device holds all parameters; the wrapper checks local gradients before the mean.
    "data_parallel": (True, lambda: optax.chain(pmean_gradients(), optax.adam(1e-2))),
    # Every device holds one shard of each parameter, and its shard of the gradients.
    "fsdp": (False, lambda: optax.adam(1e-2)),
}


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("mapper", MAPPERS)
def test_wrapper_skips_on_every_device(mapper, layout):
  replicated_params, make_inner = LAYOUTS[layout]
  tx = jaxscale.dynamic_loss_scaling(make_inner(), axis_name=AXIS, init_scale=SCALE)
  plain = make_inner()
  params = {"w": jnp.ones((4, 3)), "b": jnp.zeros(3)}
  params = replicate(params) if replicated_params else jax.tree.map(lambda g: g / SCALE, per_device_grads())

  def step(tx, params, opt_state, grads):
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state

  def init(params):
    return jax.vmap(tx.init)(params), jax.vmap(plain.init)(params)

  opt_state, plain_state = init(params)
  true_grads = jax.tree.map(lambda g: g / SCALE, per_device_grads())
  poisoned = jax.tree.map(lambda g: g / SCALE, per_device_grads(poison=True))
  skipped_params, skipped_state = run_mapped(mapper, lambda *a: step(tx, *a), params, opt_state, poisoned)
  jax.tree.map(np.testing.assert_array_equal,
               (skipped_params, skipped_state.inner_state), (params, opt_state.inner_state))
  assert_same_on_every_device(skipped_state.scaler)
  assert float(skipped_state.scaler.scale[0]) == SCALE / 2

  # A finite step: the same parameters as the plain optimizer on the true gradients, bit for bit.
  new_params, new_state = run_mapped(mapper, lambda *a: step(tx, *a), skipped_params, skipped_state, true_grads)
  expected, _ = run_mapped(mapper, lambda *a: step(plain, *a), params, plain_state, true_grads)
  jax.tree.map(np.testing.assert_array_equal, new_params, expected)
  assert_same_on_every_device(new_state.scaler)
  if replicated_params:
    assert_same_on_every_device(new_params)


@pytest.mark.parametrize("mapper", MAPPERS)
def test_wrapper_agrees_on_a_flag_passed_in(mapper):
  # Each device checks its own gradients and passes its local flag with `finite=`; the wrapper,
  # built with `axis_name`, must still take one decision for all (else the replicas diverge).
  tx = jaxscale.dynamic_loss_scaling(optax.chain(pmean_gradients(), optax.sgd(0.5)), axis_name=AXIS, init_scale=SCALE)
  params = replicate({"w": jnp.ones((4, 3)), "b": jnp.zeros(3)})
  opt_state = jax.vmap(tx.init)(params)

  def step(params, opt_state, grads):
    grads, local = jaxscale.unscale_and_check(jaxscale.find_scaler(opt_state), grads)
    updates, opt_state = tx.update(grads, opt_state, params, finite=local)
    return optax.apply_updates(params, updates), opt_state

  new_params, new_state = run_mapped(mapper, step, params, opt_state, per_device_grads(poison=True))
  jax.tree.map(np.testing.assert_array_equal, new_params, params)  # skipped everywhere, no -inf
  assert np.asarray(new_state.scaler.last_skipped).all()
  assert_same_on_every_device(new_state.scaler)


@pytest.mark.filterwarnings("error:jaxscale. `dynamic_loss_scaling`'s update got gradients that differ")
def test_fsdp_without_axis_name_warns_where_the_devices_would_part():
  # FSDP under shard_map: each device holds its shard of the parameters and of the gradients. With
  # no `axis_name` and a local flag, the device whose shard overflows skips and the others step:
  # their scales part (as the last line shows). JAX's varying-axes types show it at trace time.
  tx = jaxscale.dynamic_loss_scaling(optax.sgd(0.5), init_scale=SCALE)

  def step(site_axis, params, opt_state, x):
    loss = lambda p: jnp.sum(p["w"] * x) + jnp.sum(p["b"])
    _, grads, finite = jaxscale.value_and_grad(loss, axis_name=site_axis)(jaxscale.find_scaler(opt_state), params)
    updates, opt_state = tx.update(grads, opt_state, params, finite=finite)
    return optax.apply_updates(params, updates), opt_state

  mesh = jax.make_mesh((N,), (AXIS,), axis_types=(AxisType.Auto,))

  def run(site_axis):
    # The parameters sharded, the optimizer state replicated (one scaler), each device's decision read.
    def per_device(params, opt_state, x):
      params, opt_state = step(site_axis, jax.tree.map(lambda a: a[0], params), opt_state, x[0])
      return jax.tree.map(lambda a: a[None], params), jax.tree.map(lambda a: a[None], opt_state)

    mapped = jax.shard_map(per_device, mesh=mesh, in_specs=(P(AXIS), P(), P(AXIS)), out_specs=P(AXIS))
    return jax.jit(mapped)(params, opt_state, x)[1]

  params = jax.tree.map(lambda g: g / SCALE, per_device_grads())
  opt_state = tx.init(jax.tree.map(lambda a: a[0], params))
  x = jnp.ones((N, 4, 3)).at[POISONED_DEVICE].set(jnp.inf)
  with pytest.warns(UserWarning, match=rf"differ between the devices of the mapped axes '{AXIS}' and no `axis_name`"):
    parted = run(None)
  assert np.asarray(parted.scaler.last_skipped).tolist() == [i == POISONED_DEVICE for i in range(N)]
  # A flag reduced over the devices makes the decision common: nothing to say, and every device skips.
  assert np.asarray(run(AXIS).scaler.last_skipped).all()
