"""An Equinox MLP on scikit-learn's handwritten digits: float32 against float16 with jaxscale, over seeds.

Each seed (the initialisation and the data order) trains the same model three ways: float32;
float16 compute (float32 parameters, the "mixed_float16" policy) without loss scaling; and
float16 with jaxscale. The table gives each run's held-out loss and accuracy, and the summary
says whether float16 with jaxscale lands within float32's spread over the seeds.

    python examples/equinox_mlp.py                      # 3 seeds, 400 steps: about 30 s on 2 CPU cores
    python examples/equinox_mlp.py --loss-weight 1e-5   # gradients 1e5 times smaller: float16 alone stalls

The Equinox recipe is in `make_train_step`; see also docs/equinox.md and `jaxscale.equinox`.
"""

from __future__ import annotations

import argparse
import time

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
from sklearn.datasets import load_digits

import jaxscale
import jaxscale.equinox

RUNS = {  # name: (policy, loss scaling)
    "float32": ("float32", False),
    "float16": ("mixed_float16", False),
    "float16 + jaxscale": ("mixed_float16", True),
}


def load_data():
  """The 1797 8x8 digits, as 64 floats in [0, 1]; the last 360 held out."""
  digits = load_digits()
  x, y = (digits.data / 16.0).astype(np.float32), digits.target.astype(np.int32)
  return (x[:-360], y[:-360]), (x[-360:], y[-360:])


def loss_and_accuracy(model, x, y, policy, loss_weight=1.0):
  model, x = policy.cast_to_compute((model, x))
  logits = policy.cast_to_output(jax.vmap(model)(x)).astype(jnp.float32)
  loss = optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()
  return loss * loss_weight, (logits.argmax(-1) == y).mean()


def make_train_step(tx, policy, loss_weight):
  """Equinox's training step, with `jaxscale.equinox.filter_value_and_grad` and the flag passed on."""

  @eqx.filter_jit
  def train_step(model, opt_state, x, y):
    scaler = jaxscale.find_scaler(opt_state)
    (loss, _), grads, finite = jaxscale.equinox.filter_value_and_grad(loss_and_accuracy, has_aux=True)(
        scaler, model, x, y, policy, loss_weight)
    updates, opt_state = tx.update(grads, opt_state, eqx.filter(model, eqx.is_array), finite=finite)
    return eqx.apply_updates(model, updates), opt_state, loss

  return train_step


def train(name, seeds, args, data):
  """One run per seed (one compilation for all); returns each one's held-out loss and accuracy, and scaler numbers."""
  policy_name, scaling = RUNS[name]
  policy = jaxscale.get_policy(policy_name)
  (x_train, y_train), (x_test, y_test) = data
  tx = jaxscale.dynamic_loss_scaling(optax.adam(args.lr), enabled=scaling)
  train_step = make_train_step(tx, policy, args.loss_weight)
  evaluate = eqx.filter_jit(loss_and_accuracy)
  results = []
  for seed in seeds:
    model_key, data_key = jax.random.split(jax.random.key(seed))
    model = eqx.nn.MLP(64, 10, width_size=args.width, depth=2, key=model_key)
    opt_state = tx.init(eqx.filter(model, eqx.is_array))
    order = np.asarray(jax.random.randint(data_key, (args.steps, args.batch), 0, len(x_train)))
    for batch in order:
      model, opt_state, _ = train_step(model, opt_state, x_train[batch], y_train[batch])
    loss, accuracy = evaluate(model, x_test, y_test, policy)
    m = jaxscale.metrics(opt_state)
    results.append({"loss": float(loss), "accuracy": float(accuracy), "scale": float(m["scale"]),
                    "skipped": int(m["skipped_steps"])})
  return results


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--seeds", type=int, default=3, help="seeds per run (default: %(default)s)")
  parser.add_argument("--steps", type=int, default=400, help="training steps (default: %(default)s)")
  parser.add_argument("--batch", type=int, default=64, help="batch size (default: %(default)s)")
  parser.add_argument("--width", type=int, default=128, help="hidden width (default: %(default)s)")
  parser.add_argument("--lr", type=float, default=3e-3, help="Adam's learning rate (default: %(default)s)")
  parser.add_argument("--loss-weight", type=float, default=1.0,
                      help="multiplies the training loss, to shrink the gradients (default: %(default)s)")
  args = parser.parse_args(argv)
  data = load_data()
  t0 = time.perf_counter()
  results = {name: train(name, range(args.seeds), args, data) for name in RUNS}
  print(f"{args.seeds} seeds x {args.steps} steps, loss weight {args.loss_weight:g} "
        f"({time.perf_counter() - t0:.0f} s)\n")
  print("| run | held-out loss per seed | mean | accuracy (mean) | final scale | skipped steps |")
  print("| --- | --- | --- | --- | --- | --- |")
  for name, runs in results.items():
    losses = [r["loss"] for r in runs]
    print(f"| {name} | {', '.join(f'{v:.4f}' for v in losses)} | {np.mean(losses):.4f} | "
          f"{np.mean([r['accuracy'] for r in runs]):.3f} | {runs[-1]['scale']:g} | "
          f"{', '.join(str(r['skipped']) for r in runs)} |")
  reference = [r["loss"] for r in results["float32"]]
  low, high = min(reference), max(reference)
  print(f"\nfloat32's held-out loss over the seeds spans [{low:.4f}, {high:.4f}].")
  for name in ("float16", "float16 + jaxscale"):
    mean = np.mean([r["loss"] for r in results[name]])
    print(f"{name}: mean {mean:.4f}, {'within' if low <= mean <= high else 'outside'} float32's spread.")
  return results


if __name__ == "__main__":
  main()
