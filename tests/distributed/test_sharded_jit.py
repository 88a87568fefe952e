"""`jax.jit` over 8 devices with `NamedSharding`: one skip decision, a replicated scaler, no gathers

Under `jit` the gradients are global arrays, so the reduction in `all_finite` already spans every
shard: XLA inserts the all-reduce. These tests check that this holds for data-parallel, FSDP-style
and mixed layouts, that nothing about the scaler changes the shardings the step produces, and
that wrapping an optimizer adds no all-gather to the compiled step.
"""

import re
from collections import Counter

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

# (data, fsdp) mesh shapes. The batch is split over both axes, the parameters over "fsdp".
LAYOUTS = {"data_parallel": (8, 1), "fsdp": (1, 8), "data_and_fsdp": (2, 4)}
SCALE = 2.0**10
BATCH = 32


def loss_fn(params, batch):
  x, y = batch
  h = jnp.tanh(x.astype(jnp.float16) @ params["w1"].astype(jnp.float16))
  pred = (h @ params["w2"].astype(jnp.float16)).astype(jnp.float32)
  return jnp.mean((pred - y) ** 2)


def train_step(tx, params, opt_state, batch, poison):
  """One step; `poison` is added to the gradients (zeros, or an inf on one shard)."""
  wrapped = isinstance(opt_state, jaxscale.DynamicLossScalingState)

  if wrapped:
    _, grads, _ = jaxscale.value_and_grad(loss_fn)(jaxscale.find_scaler(opt_state), params, batch)
  else:
    grads = jax.grad(loss_fn)(params, batch)
  grads = jax.tree.map(jnp.add, grads, poison)
  updates, opt_state = tx.update(grads, opt_state, params)
  return optax.apply_updates(params, updates), opt_state


class Setup:
  """Parameters, optimizer state and batch of one layout, placed on its mesh."""

  def __init__(self, layout, tx):
    mesh = jax.make_mesh(LAYOUTS[layout], ("data", "fsdp"), axis_types=(AxisType.Auto,) * 2)
    self.replicated = NamedSharding(mesh, P())
    self.param_sharding = NamedSharding(mesh, P("fsdp", None))
    self.batch_sharding = NamedSharding(mesh, P(("data", "fsdp"), None))
    k1, k2, k3, k4 = jax.random.split(jax.random.key(0), 4)
    params = {"w1": jax.random.normal(k1, (16, 32)) * 0.3, "w2": jax.random.normal(k2, (32, 4)) * 0.3}
    self.params = jax.device_put(params, self.param_sharding)
    # Every parameter-shaped leaf of the optimizer state is sharded like its parameter.
    abstract_state = jax.eval_shape(tx.init, self.params)
    self.opt_sharding = optax.tree_map_params(
        tx, lambda _, s: s, abstract_state, jax.tree.map(lambda _: self.param_sharding, params),
        transform_non_params=lambda _: self.replicated,
    )
    self.opt_state = jax.jit(tx.init, out_shardings=self.opt_sharding)(self.params)
    batch = (jax.random.normal(k3, (BATCH, 16)), jax.random.normal(k4, (BATCH, 4)))
    self.batch = jax.device_put(batch, self.batch_sharding)
    self.no_poison = jax.device_put(jax.tree.map(jnp.zeros_like, params), self.param_sharding)

  def poisoned(self, where):
    """The batch and the gradient poison of a step with an inf on a single device's shard."""
    if where == "batch_shard":
      # The last example lives on the last device only; in float16 it overflows.
      x, y = self.batch
      return jax.device_put((x.at[-1, 0].set(1e5), y), self.batch_sharding), self.no_poison
    w1 = self.no_poison["w1"].at[-1, -1].set(jnp.inf)
    poison = jax.device_put({**self.no_poison, "w1": w1}, self.param_sharding)
    return self.batch, poison


def jitted_step(tx):
  # No `out_shardings`: the shardings the step produces are the ones under test.
  return jax.jit(lambda *args: train_step(tx, *args), donate_argnums=(0, 1))


def copy_to_host(tree):
  return jax.tree.map(np.asarray, tree)


def assert_trees_equal(a, b):
  jax.tree.map(np.testing.assert_array_equal, copy_to_host(a), copy_to_host(b))


def assert_same_shardings(tree, shardings):
  for leaf, sharding in zip(jax.tree.leaves(tree), jax.tree.leaves(shardings), strict=True):
    assert leaf.sharding.is_equivalent_to(sharding, leaf.ndim), (leaf.sharding, sharding)


def devices_with_nonfinite(tree):
  return {
      shard.device for leaf in jax.tree.leaves(tree) for shard in leaf.addressable_shards
      if not np.isfinite(np.asarray(shard.data)).all()
  }


COLLECTIVE = re.compile(
    r"= (\([^)]*\)|\S+) (all-gather|all-reduce|reduce-scatter|all-to-all|collective-permute)(?:-start)?\("
)


def collectives(compiled):
  """The collectives of a compiled step, as (op, operand shape) with their counts.

  XLA combines collectives into tuples in no fixed order: count each operand on its own.
  """
  return Counter(
      (op, operand)
      for shapes, op in COLLECTIVE.findall(compiled.as_text())
      for operand in re.findall(r"\w+\[[^\]]*\]", shapes)
  )


def assert_only_scalar_all_reduces_added(wrapped, plain):
  """Wrapping may add the reduction of the finite flag, and nothing else: no parameter gathers."""
  added = collectives(wrapped) - collectives(plain)
  assert all(op == "all-reduce" and operand.endswith("[]") for op, operand in added), added


@pytest.mark.parametrize("layout", LAYOUTS)
def test_inf_on_one_shard_skips_every_device(layout):
  plain = optax.adam(1e-2)
  tx = jaxscale.dynamic_loss_scaling(plain, init_scale=SCALE)
  setup = Setup(layout, tx)
  args = (setup.params, setup.opt_state, setup.batch, setup.no_poison)
  # Compiled once, up front: a changed sharding or dtype in the state would fail to run, not retrace.
  step = jitted_step(tx).lower(*args).compile()
  plain_setup = Setup(layout, plain)
  plain_step = jitted_step(plain).lower(
      plain_setup.params, plain_setup.opt_state, plain_setup.batch, plain_setup.no_poison
  ).compile()
  assert_only_scalar_all_reduces_added(step, plain_step)

  params, opt_state = setup.params, setup.opt_state
  before = copy_to_host((params, opt_state.inner_state))
  for skipped, where in enumerate(["batch_shard", "gradient_shard"], start=1):
    batch, poison = setup.poisoned(where)
    if where == "gradient_shard":  # one shard of w1, and its replicas over "data"
      assert len(devices_with_nonfinite(poison)) == LAYOUTS[layout][0]
    params, opt_state = step(params, opt_state, batch, poison)
    assert_trees_equal((params, opt_state.inner_state), before)
    scaler = jaxscale.find_scaler(opt_state)
    assert float(scaler.scale) == SCALE / 2**skipped and int(scaler.skipped_steps) == skipped
    for leaf in scaler:
      assert leaf.sharding.is_fully_replicated
      assert len({np.asarray(s.data).tobytes() for s in leaf.addressable_shards}) == 1
    assert_same_shardings(params, jax.tree.map(lambda _: setup.param_sharding, params))
    assert_same_shardings(opt_state, setup.opt_sharding)

  # The next, finite step moves every parameter on every device, as on one device.
  on_one_device = jax.device_put(
      (copy_to_host(params), copy_to_host(opt_state), setup.batch, setup.no_poison), jax.devices()[0]
  )
  expected, _ = jax.jit(lambda *args: train_step(tx, *args))(*on_one_device)
  params, opt_state = step(params, opt_state, setup.batch, setup.no_poison)
  assert not np.isclose(copy_to_host(params)["w1"], before[0]["w1"]).any()
  jax.tree.map(
      lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-3, atol=1e-6),
      copy_to_host(params), copy_to_host(expected),
  )
