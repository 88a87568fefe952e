"""Log the loss scaler to TensorBoard from a jitted float16 training step.

The step returns ``jaxscale.metrics(opt_state)`` (the scale, skipped steps,
growth tracker, ...) as device arrays, next to the loss: nothing inside the
step converts to a Python number, so nothing waits on the device. The host
reads the numbers every ``--log-every`` steps and writes them with tensorboardX.

    python examples/tensorboard_logging.py --logdir runs/demo
    tensorboard --logdir runs
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import optax

import jaxscale

import _common  # examples/, on the path when this file runs as a script


def summary_writer(logdir: str):
  try:
    from tensorboardX import SummaryWriter
  except ImportError as e:
    raise ImportError(
        "This example logs with tensorboardX: `pip install 'jaxscale[tensorboard]'`."
    ) from e
  return SummaryWriter(logdir)


def write_scalars(writer, metrics: dict, step: int) -> dict[str, float]:
  """Reads ``metrics`` on the host (the one sync) and writes them: the loss as is, the scaler's under ``scaler/``."""
  values = {name: float(value) for name, value in jax.device_get(metrics).items()}
  for name, value in values.items():
    writer.add_scalar(name if name == "loss" else f"scaler/{name}", value, step)
  return values


def init_mlp(key, sizes):
  keys = jax.random.split(key, len(sizes) - 1)
  return [
      {"w": jax.random.normal(k, (m, n)) / jnp.sqrt(m), "b": jnp.zeros(n)}
      for k, m, n in zip(keys, sizes[:-1], sizes[1:])
  ]


def mlp(params, x):  # no dtype anywhere: autocast decides
  for layer in params[:-1]:
    x = jax.nn.gelu(x @ layer["w"] + layer["b"])
  return x @ params[-1]["w"] + params[-1]["b"]


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=_common.HelpFormatter)
  parser.add_argument("--logdir", default="runs/jaxscale", help="where tensorboardX writes its event file")
  parser.add_argument("--steps", type=int, default=500, help="training steps")
  parser.add_argument("--log-every", type=int, default=25, help="read the metrics on the host every N steps")
  parser.add_argument("--precision", default="mixed_float16", help="a jaxscale.get_policy string")
  parser.add_argument("--lr", type=float, default=3e-3, help="Adam learning rate")
  args = parser.parse_args(argv)

  policy = jaxscale.get_policy(args.precision)
  # A small initial scale and interval, so the scale visibly grows and backs off within the run.
  tx = jaxscale.dynamic_loss_scaling(
      optax.adam(args.lr), enabled=jaxscale.needs_loss_scaling(policy), init_scale=2.0**10, growth_interval=50
  )
  x = jax.random.normal(jax.random.key(0), (256, 16))
  y = jnp.sin(3 * x[:, :1]) * jnp.cos(2 * x[:, 1:2])
  params = init_mlp(jax.random.key(1), [16, 64, 64, 1])
  opt_state = tx.init(params)
  apply = jaxscale.autocast(mlp, policy)

  @jax.jit
  def train_step(params, opt_state):
    loss_fn = lambda p: jnp.mean((apply(p, x) - y) ** 2)
    loss, grads, finite = jaxscale.value_and_grad(loss_fn)(jaxscale.find_scaler(opt_state), params)
    updates, opt_state = tx.update(grads, opt_state, params, finite=finite)
    metrics = {"loss": loss, **jaxscale.metrics(opt_state)}
    return optax.apply_updates(params, updates), opt_state, metrics

  writer = summary_writer(args.logdir)
  logged = []
  for step in range(1, args.steps + 1):
    params, opt_state, metrics = train_step(params, opt_state)
    if step % args.log_every == 0 or step == args.steps:
      values = write_scalars(writer, metrics, step)
      logged.append((step, values))
      print(f"step {step:5d}  loss {values['loss']:.4f}  scale {values['scale']:g}  "
            f"skipped {values['skipped_steps']:g}")
  writer.close()
  return logged


if __name__ == "__main__":
  main()
