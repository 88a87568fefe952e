"""float16 fails silently where its gradients are small; jaxscale's loss scaling recovers float32.

A small MLP learns a random teacher network with the same seed, start and data five ways: float32;
float16 compute (float32 parameters) without loss scaling; float16 with jaxscale in plain JAX and
Optax; and the same recipe with a Flax Linen ``TrainState`` and an NNX ``nnx.Optimizer``. The loss
is multiplied by 1e-4 (Adam's eps too, so float32 trains the same up to rounding), as a small
auxiliary loss term or a mean over a large batch would make it: many activation gradients then fall
below float16's smallest subnormal, 2**-24, flush to zero, and float16 alone learns far less.

The table rounds to what any machine reproduces. Which gradients float16 alone keeps hangs on their
last bits, so its loss moves with the CPU and the JAX release (+74% against float32 with jax 0.12,
+86% with jax 0.10 on the same machine); it is shown as a bound. Every other figure is stable.

    python examples/quickstart.py     # about 10 seconds on a CPU
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
  return [{"w": jax.random.normal(k, (m, n)) / jnp.sqrt(m), "b": jnp.zeros(n)}
          for k, m, n in zip(keys, sizes, sizes[1:])]


def mlp(params, x, dtype):
  """The network in ``dtype``; its float32 parameters are cast where they are used."""
  x = x.astype(dtype)
  for layer in params[:-1]:
    x = jax.nn.tanh(x @ layer["w"].astype(dtype) + layer["b"].astype(dtype))
  return x @ params[-1]["w"].astype(dtype) + params[-1]["b"].astype(dtype)


def data(key, n):
  x = jax.random.normal(key, (n, SIZES[0]))
  return x, mlp(init_mlp(jax.random.key(1)), x, jnp.float32)  # the teacher's outputs


START = init_mlp(jax.random.key(0))  # every run starts here
X, Y = data(jax.random.key(2), 4096)
X_TEST, Y_TEST = data(jax.random.key(3), 1024)


def batches():
  for step in range(STEPS):
    batch = slice(step % 16 * 256, (step % 16 + 1) * 256)
    yield X[batch], Y[batch]


def adam():
  return optax.adam(3e-3, eps=1e-8 * LOSS_WEIGHT)


def weighted_mse(pred, y):
  """The weighted mean squared error, in float32 whatever the compute dtype."""
  return LOSS_WEIGHT * jnp.mean((pred.astype(jnp.float32) - y) ** 2)


# ---------------------------------------------------------------- plain JAX + Optax


def plain(dtype, loss_scaling):
  """Returns the trained network (as a function of x) and the scaler's state."""
  # enabled=False: the wrapper passes the gradients through and the scale stays 1.
  tx = jaxscale.dynamic_loss_scaling(adam(), enabled=loss_scaling)

  @jax.jit
  def train_step(params, opt_state, x, y):
    # Scales the loss, differentiates, unscales and checks: `grads` are the true gradients.
    loss_fn = lambda p: weighted_mse(mlp(p, x, dtype), y)
    _, grads, finite = jaxscale.value_and_grad(loss_fn)(jaxscale.find_scaler(opt_state), params)
    updates, opt_state = tx.update(grads, opt_state, params, finite=finite)  # skips on inf/NaN
    return optax.apply_updates(params, updates), opt_state

  params, opt_state = START, tx.init(START)
  for x, y in batches():
    params, opt_state = train_step(params, opt_state, x, y)
  return lambda x: mlp(params, x, dtype), jaxscale.find_scaler(opt_state)


# ---------------------------------------------------------------- Flax Linen: a TrainState


def linen():
  """``jaxscale.flax.apply_gradients`` (Flax's ``apply_gradients``, the finite flag passed on) with the
  true gradients of ``jaxscale.value_and_grad``: the step is skipped on an inf or a NaN."""
  import jaxscale.flax
  from flax import linen as nn
  from flax.training import train_state

  class MLP(nn.Module):
    @nn.compact
    def __call__(self, x):
      for i, layer in enumerate(START):  # float16 compute, float32 parameters, from the same start
        dense = nn.Dense(layer["b"].size, dtype=jnp.float16, kernel_init=lambda *_, w=layer["w"]: w)
        x = dense(x) if i == len(START) - 1 else nn.tanh(dense(x))
      return x

  model = MLP()
  state = train_state.TrainState.create(apply_fn=model.apply, params=model.init(jax.random.key(0), X[:1]),
                                        tx=jaxscale.dynamic_loss_scaling(adam()))

  @jax.jit
  def train_step(state, x, y):
    loss_fn = lambda p: weighted_mse(state.apply_fn(p, x), y)
    _, grads, finite = jaxscale.value_and_grad(loss_fn)(jaxscale.find_scaler(state.opt_state), state.params)
    return jaxscale.flax.apply_gradients(state, grads=grads, finite=finite)  # skips the step on inf/NaN

  for x, y in batches():
    state = train_step(state, x, y)
  return lambda x: model.apply(state.params, x), jaxscale.find_scaler(state.opt_state)


# ---------------------------------------------------------------- Flax NNX: an nnx.Optimizer


def nnx_optimizer():
  """``jaxscale.flax.value_and_grad``, then ``optimizer.update(model, grads, finite=finite)``: the same recipe."""
  from flax import nnx

  import jaxscale.flax

  class MLP(nnx.Module):
    def __init__(self):  # float16 compute, float32 parameters, from the same start
      self.layers = nnx.List([
          nnx.Linear(*layer["w"].shape, dtype=jnp.float16, kernel_init=lambda *_, w=layer["w"]: w, rngs=nnx.Rngs(0))
          for layer in START])

    def __call__(self, x):
      for layer in self.layers[:-1]:
        x = nnx.tanh(layer(x))
      return self.layers[-1](x)

  model = MLP()
  optimizer = nnx.Optimizer(model, jaxscale.dynamic_loss_scaling(adam()), wrt=nnx.Param)

  @nnx.jit
  def train_step(model, optimizer, x, y):
    loss_fn = lambda m: weighted_mse(m(x), y)
    _, grads, finite = jaxscale.flax.value_and_grad(loss_fn)(jaxscale.find_scaler(optimizer.opt_state), model)
    optimizer.update(model, grads, finite=finite)  # true gradients, skipped on inf/NaN

  for x, y in batches():
    train_step(model, optimizer, x, y)
  return model, jaxscale.find_scaler(optimizer.opt_state)


# ---------------------------------------------------------------- the table

RUNS = {
    "float32": lambda: plain(jnp.float32, loss_scaling=False),
    "float16": lambda: plain(jnp.float16, loss_scaling=False),
    "float16 + jaxscale": lambda: plain(jnp.float16, loss_scaling=True),
    "float16 + jaxscale, Flax Linen TrainState": linen,
    "float16 + jaxscale, Flax NNX nnx.Optimizer": nnx_optimizer,
}


def versus(loss, reference):
  """The gap to float32, rounded to what any machine reproduces (see the module docstring)."""
  gap = loss / reference - 1
  if abs(gap) <= 0.01:
    return "within 1%"
  return "worse by 50% or more" if gap >= 0.5 else f"{gap:+.0%}"


def main():
  """Trains the five runs, printing each as it starts, then the table; returns the held-out losses."""
  print(f"Training a small MLP {len(RUNS)} ways, {STEPS} steps each:", flush=True)
  results = {}
  for name, run in RUNS.items():
    print(f"  {name}", flush=True)
    predict, scaler = run()
    results[name] = float(jnp.mean((predict(X_TEST).astype(jnp.float32) - Y_TEST) ** 2)), scaler
  reference = results["float32"][0]
  print("\n| run | held-out loss | vs float32 | loss scale | skipped steps |\n|---|---|---|---|---|")
  for name, (loss, scaler) in results.items():
    print(f"| {name} | {loss:.1g} | {'(reference)' if name == 'float32' else versus(loss, reference)} | "
          f"{float(scaler.scale):g} | {int(scaler.skipped_steps)} |")
  return {name: loss for name, (loss, _) in results.items()}


if __name__ == "__main__":
  main()
