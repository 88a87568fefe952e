"""Data-parallel float16 training with jaxscale on every device of every process.

A small MLP learns a random teacher network. Parameters are replicated over a one-axis mesh, each
batch is split across all devices, and `jax.jit` inserts the gradient all-reduce; the loss scale
and the skip decision are therefore the same on every device and every process without any extra
code.

Commands (see docs/distributed.md):

  # 8 simulated CPU devices in one process (no accelerator needed)
  python examples/data_parallel.py --simulate-devices 8

  # two processes on this machine, 4 simulated CPU devices each; run both at once (e.g. in two
  # shells), process 0 hosts the coordinator
  python examples/data_parallel.py --simulate-devices 4 --coordinator-address 127.0.0.1:12355 --num-processes 2 --process-id 0
  python examples/data_parallel.py --simulate-devices 4 --coordinator-address 127.0.0.1:12355 --num-processes 2 --process-id 1

  # a cluster: one process per host, on its accelerators; the address of process 0's host and any
  # free port, by flags or by environment variables
  JAX_COORDINATOR_ADDRESS=10.0.0.1:12355 JAX_NUM_PROCESSES=4 JAX_PROCESS_ID=$RANK python examples/data_parallel.py

  # SLURM, Open MPI, TPU pods: jax.distributed.initialize() finds all of it on its own
  srun --nodes=4 --ntasks-per-node=1 python examples/data_parallel.py --distributed
"""  # noqa: E501  # one command a line, as docs/distributed.md gives them, to copy whole

from __future__ import annotations

import argparse
import os
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import jaxscale

import _common  # examples/, on the path when this file runs as a script

IN, HIDDEN, OUT = 32, 256, 8


def parse_args(argv=None) -> argparse.Namespace:
  description, commands = __doc__.split("\nCommands", 1)
  parser = argparse.ArgumentParser(
      description=description, epilog="commands" + commands, formatter_class=_common.HelpFormatter
  )
  parser.add_argument("--steps", type=int, default=300, help="training steps")
  parser.add_argument("--batch-size", type=int, default=256, help="global batch, over all devices")
  parser.add_argument("--learning-rate", type=float, default=3e-3, help="AdamW's learning rate")
  parser.add_argument(
      "--init-scale", type=float, default=2.0**24,
      help="jaxscale's first loss scale: high, so that the first steps overflow and show the back-off",
  )
  parser.add_argument(
      "--simulate-devices", type=int, default=None, metavar="N",
      help="run on N simulated CPU devices (per process) instead of the accelerators",
  )
  parser.add_argument(
      "--distributed", action="store_true",
      help="call jax.distributed.initialize() with what the environment gives (SLURM, Open MPI, TPU pods)",
  )
  parser.add_argument(
      "--coordinator-address", default=os.environ.get("JAX_COORDINATOR_ADDRESS"), metavar="HOST:PORT",
      help="process 0's host and a free port, the same for every process (env JAX_COORDINATOR_ADDRESS)",
  )
  parser.add_argument(
      "--num-processes", type=int, default=_env_int("JAX_NUM_PROCESSES"),
      help="how many processes join (env JAX_NUM_PROCESSES)",
  )
  parser.add_argument(
      "--process-id", type=int, default=_env_int("JAX_PROCESS_ID"),
      help="this process's index, 0 to --num-processes - 1 (env JAX_PROCESS_ID)",
  )
  return parser.parse_args(argv)


def _env_int(name: str) -> int | None:
  value = os.environ.get(name)
  return None if value is None else int(value)


def start_jax(args: argparse.Namespace) -> None:
  """Configures devices and, for several processes, joins them; before any JAX computation."""
  if args.simulate_devices:
    jax.config.update("jax_platforms", "cpu")
    jax.config.update("jax_num_cpu_devices", args.simulate_devices)
  if args.distributed or args.coordinator_address or args.num_processes:
    # CPU devices of different processes talk through gloo; accelerators use their own collectives.
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    # Arguments left as None are found from the environment (SLURM, Open MPI, TPU, Kubernetes...).
    jax.distributed.initialize(
        coordinator_address=args.coordinator_address,
        num_processes=args.num_processes,
        process_id=args.process_id,
    )


def init_params(key: jax.Array) -> dict[str, jax.Array]:
  """float32 master weights; the forward pass casts them to float16."""
  k1, k2 = jax.random.split(key)
  return {
      "w1": jax.random.normal(k1, (IN, HIDDEN)) / np.sqrt(IN),
      "b1": jnp.zeros(HIDDEN),
      "w2": jax.random.normal(k2, (HIDDEN, OUT)) / np.sqrt(HIDDEN),
      "b2": jnp.zeros(OUT),
  }


def predict(params: dict[str, jax.Array], x: jax.Array) -> jax.Array:
  p = jax.tree.map(lambda w: w.astype(jnp.float16), params)
  h = jax.nn.gelu(x.astype(jnp.float16) @ p["w1"] + p["b1"])
  return h @ p["w2"] + p["b2"]


def loss_fn(params: dict[str, jax.Array], x: jax.Array, y: jax.Array) -> jax.Array:
  return jnp.mean((predict(params, x).astype(jnp.float32) - y) ** 2)


def make_train_step(tx: optax.GradientTransformation):
  def train_step(params, opt_state, x, y):
    # The true gradients (`jit` reduces them over the devices) and one finite flag for all of them.
    loss, grads, finite = jaxscale.value_and_grad(loss_fn)(jaxscale.find_scaler(opt_state), params, x, y)
    updates, opt_state = tx.update(grads, opt_state, params, finite=finite)
    return optax.apply_updates(params, updates), opt_state, loss

  return jax.jit(train_step, donate_argnums=(0, 1))


def local_batch(rng: np.random.Generator, teacher: dict[str, np.ndarray], size: int):
  """This process's share of a batch: inputs and the teacher's float32 outputs."""
  x = rng.standard_normal((size, IN), dtype=np.float32)
  y = np.tanh(x @ teacher["w1"]) @ teacher["w2"]
  return x, y.astype(np.float32)


def read(x: jax.Array) -> float:
  """A replicated value as a Python number; other processes' devices cannot be read from here."""
  return np.asarray(x.addressable_data(0)).item()


def main(argv=None) -> None:
  args = parse_args(argv)
  start_jax(args)
  mesh = jax.make_mesh((jax.device_count(),), ("data",), axis_types=(AxisType.Auto,))
  replicated = NamedSharding(mesh, P())
  data = NamedSharding(mesh, P("data"))
  if args.batch_size % jax.device_count():
    raise SystemExit(f"--batch-size {args.batch_size} must divide over {jax.device_count()} devices.")
  local_size = args.batch_size // jax.process_count()
  leader = jax.process_index() == 0
  if leader:
    print(f"{jax.process_count()} process(es), {jax.device_count()} devices ({jax.devices()[0].platform})")

  tx = jaxscale.dynamic_loss_scaling(
      optax.adamw(args.learning_rate), init_scale=args.init_scale, growth_interval=100
  )
  # The same key everywhere gives the same initial parameters on every process.
  params = jax.jit(init_params, out_shardings=replicated)(jax.random.key(0))
  opt_state = jax.jit(tx.init, out_shardings=replicated)(params)
  train_step = make_train_step(tx)

  teacher_rng = np.random.default_rng(1)
  teacher = {"w1": teacher_rng.standard_normal((IN, 64)) / np.sqrt(IN), "w2": teacher_rng.standard_normal((64, OUT))}
  # Each process draws different examples: together they make the global batch.
  rng = np.random.default_rng(100 + jax.process_index())
  start = time.perf_counter()
  for step in range(args.steps):
    x, y = (jax.make_array_from_process_local_data(data, a) for a in local_batch(rng, teacher, local_size))
    params, opt_state, loss = train_step(params, opt_state, x, y)
    if leader and (step % 50 == 0 or step == args.steps - 1):
      scaler = jaxscale.find_scaler(opt_state)
      print(f"step {step:4d}  loss {read(loss):.4f}  scale {read(scaler.scale):g}  "
            f"skipped {read(scaler.skipped_steps)}")
  scaler = jaxscale.find_scaler(opt_state)
  # Every process prints its own view: the scaler is replicated, so the lines agree.
  print(
      f"process {jax.process_index()}: final loss {read(loss):.4f}, scale {read(scaler.scale):g}, "
      f"skipped {read(scaler.skipped_steps)} of {args.steps} steps, {time.perf_counter() - start:.1f} s"
  )
  if jax.process_count() > 1:
    jax.distributed.shutdown()


if __name__ == "__main__":
  main()
