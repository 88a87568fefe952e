"""Checkpoints: Orbax save, restore in a fresh process, continue bit for bit; Flax serialization;
turning loss scaling on when restoring a checkpoint saved without it.

The fresh process is this very file run as a script (see the bottom), so both sides share one
definition of the training run.
"""

import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax

import jaxscale
from _jit import compilations

STEPS, SAVE_AT = 8, 4
# Overflows (steps 2 and 6) and growth (every 2 finite steps) on both sides of the checkpoint, so a
# restored run that lost the growth tracker or the scale would drift.
OVERFLOW_STEPS = (2, 6)


def make_tx():
  return jaxscale.dynamic_loss_scaling(
      optax.MultiSteps(optax.adamw(1e-2), 1), init_scale=2.0**8, growth_interval=2
  )


def batch(step):
  x = jax.random.normal(jax.random.key(step), (16, 4))
  if step in OVERFLOW_STEPS:
    x = x.at[0, 0].set(1e5)  # overflows float16
  return x, jnp.sum(x, axis=1, keepdims=True)


def init_state():
  params = {"w": jnp.zeros((4, 1)), "b": jnp.zeros(1)}
  return {"params": params, "opt_state": make_tx().init(params), "step": jnp.zeros((), jnp.int32)}


@jax.jit
def train_step(state, x, y):
  tx = make_tx()
  scaler = jaxscale.find_scaler(state["opt_state"])

  def loss_fn(p):
    pred = x.astype(jnp.float16) @ p["w"].astype(jnp.float16) + p["b"].astype(jnp.float16)
    return jnp.mean((pred.astype(jnp.float32) - y) ** 2)

  _, grads, finite = jaxscale.value_and_grad(loss_fn)(scaler, state["params"])
  updates, opt_state = tx.update(grads, state["opt_state"], state["params"], finite=finite)
  params = optax.apply_updates(state["params"], updates)
  return {"params": params, "opt_state": opt_state, "step": state["step"] + 1}


def train(state, stop):
  while int(state["step"]) < stop:
    state = train_step(state, *batch(int(state["step"])))
  return state


def checkpointer():
  import orbax.checkpoint as ocp

  return ocp.StandardCheckpointer()


def restore(path, like):
  ckpt = checkpointer()
  # The sharding named: a checkpoint saved on a GPU restores in a process that runs on the CPU.
  device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
  restored = ckpt.restore(path, jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=device), like))
  ckpt.close()
  return restored


def save(path, state):
  ckpt = checkpointer()
  ckpt.save(path, state)
  ckpt.wait_until_finished()
  ckpt.close()


def assert_states_equal(a, b):
  assert jax.tree.structure(a) == jax.tree.structure(b)
  jax.tree.map(np.testing.assert_array_equal, a, b)


def resume_in_this_process(checkpoint, result):
  """The fresh process: restore, finish the run, save the final state."""
  save(result, train(restore(checkpoint, init_state()), STEPS))


def test_orbax_restore_in_a_fresh_process_continues_bit_for_bit(tmp_path):
  from _spawn import child_env, run_python

  uninterrupted = train(init_state(), STEPS)
  save(tmp_path / "mid", train(init_state(), SAVE_AT))
  run_python(
      [["tests/test_checkpoint.py", str(tmp_path / "mid"), str(tmp_path / "final")]],
      env=child_env(), timeout=120, logs=tmp_path / "logs",
  )
  resumed = restore(tmp_path / "final", init_state())
  assert_states_equal(resumed, uninterrupted)
  scaler = jaxscale.find_scaler(resumed["opt_state"])
  assert int(scaler.skipped_steps) == len(OVERFLOW_STEPS)


def test_flax_msgpack_round_trip_continues_bit_for_bit():
  from flax import serialization

  mid = train(init_state(), SAVE_AT)
  data = serialization.msgpack_serialize(serialization.to_state_dict(mid))
  restored = serialization.from_state_dict(init_state(), serialization.msgpack_restore(data))
  assert_states_equal(restored, mid)
  # Restored leaves are NumPy arrays: put them on the device once, or the first step compiles again.
  restored = jax.device_put(restored)
  before = compilations(train_step)
  assert_states_equal(train(restored, STEPS), train(mid, STEPS))
  assert compilations(train_step) == before


def test_turning_loss_scaling_on_when_restoring_a_checkpoint_saved_without_it(tmp_path):
  # A run without loss scaling saved params and a plain Adam state.
  inner = optax.adam(1e-2)
  params = {"w": jnp.array([1.0, -2.0])}
  grads = {"w": jnp.array([0.5, 0.25])}
  plain_state = inner.init(params)
  plain_state = inner.update(grads, plain_state, params)[1]
  save(tmp_path / "plain", {"params": params, "opt_state": plain_state})

  # The recipe: restore into the old structure, then put the old state inside a new wrapper state.
  restored = restore(tmp_path / "plain", {"params": params, "opt_state": inner.init(params)})
  tx = jaxscale.dynamic_loss_scaling(inner, init_scale=2.0**10)
  opt_state = tx.init(restored["params"])._replace(inner_state=restored["opt_state"])

  updates, opt_state = tx.update(grads, opt_state, restored["params"], finite=True)  # as a gradient site would say
  expected, expected_state = inner.update(grads, plain_state, params)
  assert_states_equal(updates, expected)
  assert_states_equal(opt_state.inner_state, expected_state)  # Adam's count went on from 1 to 2


if __name__ == "__main__":
  resume_in_this_process(*sys.argv[1:])
