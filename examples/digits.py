"""A small CNN on scikit-learn's handwritten digits, with Flax Linen and a ``TrainState``.

Three runs of the same model, seed and data order: float32; float16 compute
(float32 parameters) without loss scaling; float16 with jaxscale.

    python examples/digits.py                      # the plain loss: float16 alone trains too; seconds per run
    python examples/digits.py --loss-weight 1e-5   # gradients 1e5 times smaller: float16 alone diverges,
                                                   # jaxscale recovers
    python examples/digits.py --precision float32 --precision p=f16,c=f16,o=f32  # autocast, float16 parameters

The Linen recipe is in `make_train_step`; see also `jaxscale.flax`.
"""

from __future__ import annotations

import argparse

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax.training import train_state
from sklearn.datasets import load_digits

import jaxscale
import jaxscale.flax

import _common  # examples/, on the path when this file runs as a script


class CNN(nn.Module):
  """Two 3x3 convolutions and a classifier, computing in ``dtype`` with float32 parameters.

  ``dtype=None``: in the dtype of the parameters and images it is given, as under `jaxscale.autocast`.
  """

  width: int = 32
  dtype: jnp.dtype | None = jnp.float32

  @nn.compact
  def __call__(self, images):
    kw = dict(dtype=self.dtype, param_dtype=jnp.float32)
    x = nn.relu(nn.Conv(self.width, (3, 3), **kw)(images[..., None]))
    x = nn.relu(nn.Conv(2 * self.width, (3, 3), strides=2, **kw)(x))
    x = nn.relu(nn.Dense(4 * self.width, **kw)(x.reshape(x.shape[0], -1)))
    return nn.Dense(10, **kw)(x)


def cross_entropy(state, params, images, labels):
  logits = state.apply_fn(params, images).astype(jnp.float32)
  return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean(), logits


def make_train_step(loss_weight: float, traces: _common.TraceCounter):
  """The Linen recipe: ``jaxscale.value_and_grad`` with the scaler in ``opt_state``, then
  ``jaxscale.flax.apply_gradients``."""

  @jax.jit
  @traces
  def train_step(state, images, labels):
    def weighted_loss(params):
      loss, _ = cross_entropy(state, params, images, labels)
      return loss * loss_weight, loss

    scaler = jaxscale.find_scaler(state.opt_state)
    # Scales the loss, differentiates, unscales and checks: `grads` are the true gradients.
    (_, loss), grads, finite = jaxscale.value_and_grad(weighted_loss, has_aux=True)(scaler, state.params)
    # Flax's `apply_gradients` with the flag passed on: the step is skipped on an inf or a NaN.
    state = jaxscale.flax.apply_gradients(state, grads=grads, finite=finite)
    return state, (loss, jaxscale.metrics(state.opt_state))

  return train_step


@jax.jit
def evaluate(state, images, labels):
  loss, logits = cross_entropy(state, state.params, images, labels)
  return {"loss": loss, "accuracy": jnp.mean(jnp.argmax(logits, -1) == labels)}


def parse_args(argv=None) -> argparse.Namespace:
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=_common.HelpFormatter)
  _common.add_flags(parser, steps=600, batch=64, lr=1e-3, loss_weight=1.0, out="digits.png")
  parser.add_argument("--width", type=int, default=32, help="channels of the first convolution")
  return parser.parse_args(argv)


def main(argv=None):
  args = parse_args(argv)

  digits = load_digits()
  images = (digits.images / 16.0).astype(np.float32)  # pixels are 0..16
  order = np.random.default_rng(12345).permutation(len(images))
  test, train_idx = order[:360], order[360:]
  test_images, test_labels = jnp.asarray(images[test]), jnp.asarray(digits.target[test])

  results = []
  for config in _common.selected_runs(args):
    # --precision: no dtype= in the layers; autocast runs them in the policy's compute dtype.
    model = CNN(width=args.width, dtype=config.dtype if config.policy is None else None)
    params = model.init(jax.random.key(args.seed), test_images[:1])
    apply = model.apply if config.policy is None else jaxscale.autocast(model.apply, config.policy)
    tx = jaxscale.dynamic_loss_scaling(
        optax.adam(args.lr, eps=1e-8 * args.loss_weight), enabled=config.scaling, init_scale=args.init_scale,
        growth_interval=args.growth_interval,
    )
    if config.master_weights:  # 16-bit parameters: Adam updates a float32 copy of them
      params, tx = config.policy.cast_to_param(params), jaxscale.master_weights(tx)
    state = train_state.TrainState.create(apply_fn=apply, params=params, tx=tx)
    # `create` starts `step` as a Python int; an array keeps the step at one compilation.
    state = state.replace(step=jnp.zeros((), jnp.int32))
    traces = _common.TraceCounter()
    train_step = make_train_step(args.loss_weight, traces)
    rng = np.random.default_rng(args.seed)
    batches = (rng.choice(train_idx, args.batch, replace=False) for _ in range(args.steps))

    def step(idx):
      nonlocal state
      state, metrics = train_step(state, images[idx], digits.target[idx])
      return metrics

    def held_out():
      return {k: float(v) for k, v in evaluate(state, test_images, test_labels).items()}

    results.append(_common.train(config, step, batches, held_out, args))
    traces.assert_once()

  if not args.no_plot:
    _common.plot_runs(results, args.out, title=f"CNN on sklearn digits, loss x {args.loss_weight:g}")
  print(f"\nCNN (width {args.width}) on sklearn digits, {len(train_idx)} train / {len(test)} held-out images, "
        f"batch {args.batch}, {args.steps} steps, loss weight {args.loss_weight:g}\n")
  print(_common.results_table(results))
  # 360 held-out images: runs that differ only in rounding end a few percent apart in held-out loss.
  return results


if __name__ == "__main__":
  main()
