"""Which operation overflowed: a skipped float16 step, explained by `jaxscale.find_overflow`.

A Flax MLP with float16 compute (float32 parameters) learns a random teacher network with
jaxscale's dynamic loss scaling. Two kinds of step are skipped, and for each the training loop
hands the step's loss function, batch and scaler to ``find_overflow``, which names the
operation, the layer, the line and the pass that made the first inf:

- the first steps, at the default start scale 2^16: the backward pass overflows where the
  scaled cotangent of the loss is cast to float16 (the scale is too high for this model; the
  scaler halves it and the steps go through, or start lower with ``jaxscale.probe_scale``);
- one batch with a corrupted sample (a feature 1e5 times too large): the forward pass
  overflows where the first layer casts that input to float16, before its matmul, at any
  scale (no scale fixes that: the data, or normalising the inputs, does).

    python examples/find_overflow.py     # under a minute on a CPU
"""

from __future__ import annotations

import argparse

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

import jaxscale

FEATURES, WIDTH, BATCH = 16, 64, 32


class MLP(nn.Module):
  @nn.compact
  def __call__(self, x):
    x = jnp.tanh(nn.Dense(WIDTH, dtype=jnp.float16, name="hidden")(x))
    return nn.Dense(1, dtype=jnp.float16, name="head")(x)


MODEL = MLP()


def loss_fn(params, x, y):
  """The mean squared error, in float32."""
  return jnp.mean((MODEL.apply(params, x).astype(jnp.float32) - y) ** 2)


def batches(steps, corrupt_step, seed=0):
  """``(x, y)`` per step from a teacher network; at ``corrupt_step`` one feature is 1e5 times too large."""
  key_x, key_teacher = jax.random.split(jax.random.key(seed))
  teacher = MODEL.init(key_teacher, jnp.zeros((1, FEATURES)))
  teacher = jax.tree.map(lambda p: 10 * p, teacher)  # outputs of tens: large squared errors at the start
  for step, key in enumerate(jax.random.split(key_x, steps)):
    x = jax.random.normal(key, (BATCH, FEATURES))
    y = MODEL.apply(teacher, x).astype(jnp.float32)
    if step == corrupt_step:
      x = x.at[0, 3].multiply(1e5)
    yield x, y


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--steps", type=int, default=40, help="training steps (default: %(default)s)")
  parser.add_argument("--corrupt-step", type=int, default=30,
                      help="the step whose batch holds a corrupted sample (default: %(default)s)")
  args = parser.parse_args(argv)

  tx = jaxscale.dynamic_loss_scaling(optax.adam(1e-2))  # starts at 2^16, torch's default

  @jax.jit
  def train_step(params, opt_state, x, y):
    loss, grads, finite = jaxscale.value_and_grad(loss_fn)(jaxscale.find_scaler(opt_state), params, x, y)
    updates, opt_state = tx.update(grads, opt_state, params, finite=finite)
    return optax.apply_updates(params, updates), opt_state, loss, finite

  params = MODEL.init(jax.random.key(1), jnp.zeros((1, FEATURES)))
  opt_state = tx.init(params)
  skipped, losses = {}, []
  for step, (x, y) in enumerate(batches(args.steps, args.corrupt_step)):
    scaler = jaxscale.find_scaler(opt_state)  # the scale this step runs at
    new_params, opt_state, loss, finite = train_step(params, opt_state, x, y)
    if not finite:  # the step was skipped: which operation made the inf?
      skipped[step] = jaxscale.find_overflow(loss_fn, scaler, params, x, y)
      print(f"step {step} skipped: {skipped[step]}")
    params = new_params
    losses.append(float(loss))
  print(f"{len(skipped)} of {args.steps} steps skipped; loss {losses[0]:.4g} at the first step, "
        f"{losses[-1]:.4g} at the last; scale {float(jaxscale.find_scaler(opt_state).scale):g}")
  return skipped


if __name__ == "__main__":
  main()
