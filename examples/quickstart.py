"""float16 fails silently where its gradients are small; jaxscale's loss scaling recovers float32.

A small MLP learns a random teacher network, three ways, with the same seed and data: float32;
float16 compute (float32 parameters) without loss scaling; float16 with jaxscale. The loss is
multiplied by 1e-4 (Adam's eps too, so float32 trains the same up to rounding), as a small
auxiliary loss term or a mean over a large batch would make it: the activation gradients then fall
below float16's smallest subnormal, 2**-24, flush to zero, and float16 alone stops learning.

Then the same recipe in Flax: a Linen ``TrainState`` and an NNX ``nnx.Optimizer``.

    python examples/quickstart.py     # seconds on a CPU
"""

import jax
import jax.numpy as jnp
import optax

import jaxscale

LOSS_WEIGHT = 1e-4
STEPS = 300
SIZES = (16, 64, 64, 1)


def init_mlp(key, sizes=SIZES):
  keys = jax.random.split(key, len(sizes) - 1)
  return [{"w": jax.random.normal(k, (m, n)) / jnp.sqrt(m), "b": jnp.zeros(n)} for k, m, n in zip(keys, sizes, sizes[1:])]


def mlp(params, x, dtype):
  """The network in ``dtype``; its float32 parameters are cast where they are used."""
  x = x.astype(dtype)
  for layer in params[:-1]:
    x = jax.nn.tanh(x @ layer["w"].astype(dtype) + layer["b"].astype(dtype))
  return x @ params[-1]["w"].astype(dtype) + params[-1]["b"].astype(dtype)


def loss_fn(params, x, y, dtype):
  """The weighted mean squared error, in float32 whatever the compute dtype."""
  return LOSS_WEIGHT * jnp.mean((mlp(params, x, dtype).astype(jnp.float32) - y) ** 2)


def data(key, n):
  x = jax.random.normal(key, (n, SIZES[0]))
  return x, mlp(init_mlp(jax.random.key(1)), x, jnp.float32)  # the teacher's outputs


# ---------------------------------------------------------------- plain JAX + Optax


def train(dtype, loss_scaling):
  """Trains from the same start; returns the held-out loss (unweighted) and the scaler's state."""
  # enabled=False: the wrapper passes the gradients through and the scale stays 1.
  tx = jaxscale.dynamic_loss_scaling(optax.adam(3e-3, eps=1e-8 * LOSS_WEIGHT), enabled=loss_scaling)

  @jax.jit
  def train_step(params, opt_state, x, y):
    # Scales the loss, differentiates, unscales and checks: `grads` are the true gradients.
    _, grads, finite = jaxscale.value_and_grad(loss_fn)(jaxscale.find_scaler(opt_state), params, x, y, dtype)
    updates, opt_state = tx.update(grads, opt_state, params, finite=finite)  # skips on inf/NaN
    return optax.apply_updates(params, updates), opt_state

  params = init_mlp(jax.random.key(0))
  opt_state = tx.init(params)
  x, y = data(jax.random.key(2), 4096)
  for step in range(STEPS):
    batch = slice(step % 16 * 256, (step % 16 + 1) * 256)
    params, opt_state = train_step(params, opt_state, x[batch], y[batch])
  x_test, y_test = data(jax.random.key(3), 1024)
  return float(loss_fn(params, x_test, y_test, dtype)) / LOSS_WEIGHT, jaxscale.find_scaler(opt_state)


def compare():
  runs = {"float32": (jnp.float32, False), "float16": (jnp.float16, False), "float16 + jaxscale": (jnp.float16, True)}
  results = {name: train(*run) for name, run in runs.items()}
  reference = results["float32"][0]
  print("| run | held-out loss | vs float32 | loss scale | skipped steps |\n|---|---|---|---|---|")
  for name, (loss, scaler) in results.items():
    print(f"| {name} | {loss:.4f} | {100 * (loss / reference - 1):+.1f}% | {float(scaler.scale):g} | "
          f"{int(scaler.skipped_steps)} |")
  return {name: loss for name, (loss, _) in results.items()}


# ---------------------------------------------------------------- Flax Linen: a TrainState


def linen_recipe():
  """``TrainState.apply_gradients(grads=grads)`` with the true gradients of ``jaxscale.value_and_grad``:
  ``tx.update`` checks them again and skips the step on an inf or a NaN."""
  from flax import linen as nn
  from flax.training import train_state

  class MLP(nn.Module):
    @nn.compact
    def __call__(self, x):
      x = nn.tanh(nn.Dense(64, dtype=jnp.float16)(x))
      x = nn.tanh(nn.Dense(64, dtype=jnp.float16)(x))
      return nn.Dense(1, dtype=jnp.float16)(x).astype(jnp.float32)

  x, y = data(jax.random.key(2), 256)
  model = MLP()
  tx = jaxscale.dynamic_loss_scaling(optax.adam(3e-3, eps=1e-8 * LOSS_WEIGHT))
  state = train_state.TrainState.create(apply_fn=model.apply, params=model.init(jax.random.key(0), x), tx=tx)

  @jax.jit
  def train_step(state, x, y):
    loss = lambda p: LOSS_WEIGHT * jnp.mean((state.apply_fn(p, x) - y) ** 2)
    _, grads, _ = jaxscale.value_and_grad(loss)(jaxscale.find_scaler(state.opt_state), state.params)
    return state.apply_gradients(grads=grads)  # true gradients: tx.update checks them and skips on inf/NaN

  for _ in range(STEPS):
    state = train_step(state, x, y)
  return float(jnp.mean((state.apply_fn(state.params, x) - y) ** 2))


# ---------------------------------------------------------------- Flax NNX: an nnx.Optimizer


def nnx_recipe():
  """``jaxscale.flax.value_and_grad``, then ``optimizer.update(model, grads, finite=finite)``: the same recipe."""
  from flax import nnx

  import jaxscale.flax

  class MLP(nnx.Module):
    def __init__(self, rngs):
      kw = dict(dtype=jnp.float16, rngs=rngs)
      self.layers = nnx.List([nnx.Linear(16, 64, **kw), nnx.Linear(64, 64, **kw), nnx.Linear(64, 1, **kw)])

    def __call__(self, x):
      for layer in self.layers[:-1]:
        x = nnx.tanh(layer(x))
      return self.layers[-1](x).astype(jnp.float32)

  x, y = data(jax.random.key(2), 256)
  model = MLP(nnx.Rngs(0))
  optimizer = nnx.Optimizer(model, jaxscale.dynamic_loss_scaling(optax.adam(3e-3, eps=1e-8 * LOSS_WEIGHT)), wrt=nnx.Param)

  @nnx.jit
  def train_step(model, optimizer, x, y):
    loss = lambda m: LOSS_WEIGHT * jnp.mean((m(x) - y) ** 2)
    _, grads, finite = jaxscale.flax.value_and_grad(loss)(jaxscale.find_scaler(optimizer.opt_state), model)
    optimizer.update(model, grads, finite=finite)  # true gradients, skipped on inf/NaN

  for _ in range(STEPS):
    train_step(model, optimizer, x, y)
  return float(jnp.mean((model(x) - y) ** 2))


def main():
  losses = compare()
  print(f"\nFlax Linen TrainState, float16 + jaxscale: training loss {linen_recipe():.3g}")
  print(f"Flax NNX nnx.Optimizer, float16 + jaxscale: training loss {nnx_recipe():.3g}")
  return losses


if __name__ == "__main__":
  main()
