"""One of the two JAX processes that tests/test_multihost.py starts; not a test itself.

  python tests/distributed/multihost_worker.py PORT PROCESS_ID RESULT.json

Both processes join over 127.0.0.1:PORT, each with 4 CPU devices (gloo collectives), and train an
FSDP-sharded model with the Optax wrapper over the 8 devices. One step adds an inf to a gradient
shard that lives on process 1 only. Each process writes what it saw to RESULT.json: the scaler
after each step, and whether its own parameter shards moved.
"""

import inspect
import json
import sys

STEPS = 6
POISONED_STEP = 3
SCALE = 2.0**10
GROWTH_INTERVAL = 2


def main(port: str, process_id: str, result_path: str) -> None:
  import jax
  import jax.numpy as jnp
  import numpy as np
  import optax
  from jax.sharding import AxisType, NamedSharding
  from jax.sharding import PartitionSpec as P

  import jaxscale

  jax.config.update("jax_cpu_collectives_implementation", "gloo")
  # jax < 0.8.1 has no `shutdown_timeout_seconds`: it then keeps its own default.
  timeouts = {"initialization_timeout": 60, "shutdown_timeout_seconds": 30}
  accepted = inspect.signature(jax.distributed.initialize).parameters
  jax.distributed.initialize(
      coordinator_address=f"127.0.0.1:{port}",
      coordinator_bind_address=f"127.0.0.1:{port}",
      num_processes=2,
      process_id=int(process_id),
      **{name: value for name, value in timeouts.items() if name in accepted},
  )
  assert jax.device_count() == 8 and jax.local_device_count() == 4
  mesh = jax.make_mesh((8,), ("fsdp",), axis_types=(AxisType.Auto,))
  sharded = NamedSharding(mesh, P("fsdp", None))
  replicated = NamedSharding(mesh, P())

  def loss_fn(params, x, y):
    h = jnp.tanh(x.astype(jnp.float16) @ params["w1"].astype(jnp.float16))
    return jnp.mean(((h @ params["w2"].astype(jnp.float16)).astype(jnp.float32) - y) ** 2)

  tx = jaxscale.dynamic_loss_scaling(optax.adam(1e-2), init_scale=SCALE, growth_interval=GROWTH_INTERVAL)

  @jax.jit
  def step(params, opt_state, x, y, poison):
    _, grads, finite = jaxscale.value_and_grad(loss_fn)(jaxscale.find_scaler(opt_state), params, x, y)
    grads = jax.tree.map(jnp.add, grads, poison)
    updates, opt_state = tx.update(grads, opt_state, params, finite=finite)
    return optax.apply_updates(params, updates), opt_state

  def init(key):
    k1, k2 = jax.random.split(key)
    return {"w1": jax.random.normal(k1, (16, 32)) * 0.3, "w2": jax.random.normal(k2, (32, 4)) * 0.3}

  param_shardings = {"w1": sharded, "w2": sharded}
  params = jax.jit(init, out_shardings=param_shardings)(jax.random.key(0))
  opt_shardings = optax.tree_map_params(
      tx, lambda _, s: s, jax.eval_shape(tx.init, params), param_shardings,
      transform_non_params=lambda _: replicated,
  )
  opt_state = jax.jit(tx.init, out_shardings=opt_shardings)(params)

  def poison(with_inf):
    """Zeros like the parameters; with `with_inf`, an inf in this process's first w1 shard only."""

    def block(shape, sharding, first_local_index):
      def fill(index):
        out = np.zeros(shape, np.float32)[index]
        if with_inf and index == first_local_index:
          out[0, 0] = np.inf
        return out

      return jax.make_array_from_callback(shape, sharding, fill)

    first = next(iter(sharded.addressable_devices_indices_map((16, 32)).values()))
    return {"w1": block((16, 32), sharded, first), "w2": block((32, 4), sharded, None)}

  rng = np.random.default_rng(jax.process_index())
  batch_sharding = NamedSharding(mesh, P("fsdp"))
  steps = []
  for i in range(STEPS):
    # Each process supplies its half of the global batch.
    x, y = (
        jax.make_array_from_process_local_data(batch_sharding, rng.standard_normal(shape, dtype=np.float32))
        for shape in [(16, 16), (16, 4)]
    )
    poisoned = i == POISONED_STEP and jax.process_index() == 1
    g = poison(poisoned)
    local_inf = any(not np.isfinite(np.asarray(s.data)).all() for s in g["w1"].addressable_shards)
    before = [np.asarray(s.data).copy() for leaf in jax.tree.leaves(params) for s in leaf.addressable_shards]
    params, opt_state = step(params, opt_state, x, y, g)
    after = [np.asarray(s.data) for leaf in jax.tree.leaves(params) for s in leaf.addressable_shards]
    scaler = jaxscale.find_scaler(opt_state)
    steps.append({
        "inf_on_this_process": local_inf,
        "local_params_moved": [bool((a != b).any()) for a, b in zip(after, before)],
        "scaler_replicated": all(leaf.sharding.is_fully_replicated for leaf in scaler),
        # Every local copy of every scaler leaf, as numbers: they must all be the same.
        "scaler": {
            name: sorted({np.asarray(s.data).item() for s in getattr(scaler, name).addressable_shards})
            for name in scaler.FIELDS
        },
        "count": np.asarray(opt_state.inner_state[0].count.addressable_data(0)).item(),
    })
  with open(result_path, "w") as f:
    json.dump(steps, f)
  jax.distributed.shutdown()


if __name__ == "__main__":
  main(*sys.argv[1:])
