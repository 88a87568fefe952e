"""The 16-bit steps at the leaf counts of real models: the H100 and TPU v5e programs, with compile times.

Each row of `gpu_program.sixteen_table` (Adam over 32M parameters split into N leaves of one size,
float32 gradients, parameters and state donated) is compiled without a device for the target, and
read against float32 Adam's program at the same N, compiled in the same run:

    kernels   launches in the ENTRY computation (fusions, library and custom calls, copies)
    HBM       H100: each kernel's operands and outputs, summed (`gpu_program.read_program`);
              TPU: XLA's own cost analysis, "bytes accessed"
    peak      XLA's memory analysis: arguments + outputs not aliased to them + temporaries
    copies    `copy` instructions in ENTRY (a copy of a donated buffer is a pass and a buffer more)
    compile   trace + lower + compile of the step: wall seconds, and the CPU seconds of this
              process (all of XLA's threads), which a shared machine's load changes less; the
              ratios use the CPU seconds

    python benchmarks/sixteen_programs.py                         # H100, 8 / 48 / 150 leaves
    python benchmarks/sixteen_programs.py --target tpu-v5e        # TPU v5e (libtpu, no TPU needed)
    python benchmarks/sixteen_programs.py --leaves 1000           # 1000 leaves (32k parameters each)

The H100 needs the `gpu-program` extra (the CUDA plugin at jax's version); the TPU, libtpu at jax's
version (`pip install "jax[tpu]"`), which compiles for a TPU on a machine without one.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
# Other processes may hold libtpu at the same time: each compiles on its own, nothing runs.
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
import gpu_program  # noqa: E402  (sets the deviceless CUDA environment before jax starts)
import jax  # noqa: E402
import numpy as np  # noqa: E402

TARGETS = ("h100", "tpu-v5e")


@dataclasses.dataclass(frozen=True)
class Measured:
  """One compiled step: what its program does, and what compiling it cost."""

  kernels: int
  hbm_bytes: float
  peak_bytes: int
  copies: int
  compile_wall_s: float
  compile_cpu_s: float

  def ratios(self, base: Measured) -> dict:
    return {"hbm": self.hbm_bytes / base.hbm_bytes, "peak": self.peak_bytes / base.peak_bytes,
            "compile": self.compile_cpu_s / base.compile_cpu_s}


def tpu_v5e():
  """A sharding on one deviceless TPU v5e chip, or an error that says what to install."""
  try:
    from jax.experimental import topologies

    topology = topologies.get_topology_desc(topology_name="v5e:1x1", platform="tpu")
  except Exception as e:  # libtpu's absence shows as several error types across jax releases
    raise RuntimeError(f"compiling for a TPU needs libtpu at jax's version ({jax.__version__}): "
                       "`pip install \"jax[tpu]\"`") from e
  mesh = topologies.make_mesh(topology, (len(topology.devices),), ("x",))
  return jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())


def _sharding(target):
  return gpu_program.h100() if target == "h100" else tpu_v5e()


def compile_timed(target, step, args, donate=(0, 1)):
  """The compiled executable of `jax.jit(step)` for `target` on the shapes of `args`, with its wall and CPU seconds."""
  sharding = _sharding(target)
  shapes = jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), x.dtype, sharding=sharding), args)
  wall, cpu = time.perf_counter(), time.process_time()
  compiled = jax.jit(step, donate_argnums=donate).trace(*shapes).lower().compile()
  return compiled, time.perf_counter() - wall, time.process_time() - cpu


def read_tpu(compiled) -> tuple[int, float, int, int]:
  """Kernels, bytes accessed, peak and copies of a compiled TPU executable."""
  entry = re.sub(r"/\*index=\d+\*/", "", compiled.as_text().split("\nENTRY", 1)[1])
  ops = re.findall(r"= \S+ ([\w\-]+)\(", entry)
  kernels = sum(op in ("fusion", "custom-call", "copy", "copy-start", "convolution", "dot") for op in ops)
  copies = sum(op in ("copy", "copy-start") for op in ops)
  cost = compiled.cost_analysis() or {}
  if isinstance(cost, list):  # jax releases before 0.4.36 give one dict per computation
    cost = cost[0] if cost else {}
  memory = compiled.memory_analysis()
  peak = (memory.argument_size_in_bytes + memory.output_size_in_bytes - memory.alias_size_in_bytes
          + memory.temp_size_in_bytes)
  return kernels, float(cost.get("bytes accessed", 0.0)), int(peak), copies


def measure(target, build) -> Measured:
  step, args, donate = build()
  compiled, wall, cpu = compile_timed(target, step, args, donate)
  if target == "h100":
    p = gpu_program.read_program(compiled)
    kernels, moved, peak, copies = p.kernels, float(p.hbm_bytes), p.peak_bytes, p.copies
  else:
    kernels, moved, peak, copies = read_tpu(compiled)
  return Measured(kernels, moved, peak, copies, wall, cpu)


def measure_rows(target, n_leaves, rows=None, n_params=32_000_000) -> dict[str, Measured]:
  """The chosen rows of the sixteen table at `n_leaves` (all by default), float32 Adam's first."""
  builders = gpu_program.sixteen_table(n_params, n_leaves)
  names = ["float32 Adam", *[r for r in (rows or builders) if r != "float32 Adam"]]
  return {name: measure(target, builders[name]) for name in names}


def gpt_rows(config=None) -> dict:
  """Full training steps of the GPT-2-small-shaped Transformer (benchmarks/models.py): the
  `"mixed_bfloat16"` step with AdamW, the same with AdamW's first moment in bfloat16, and bfloat16
  parameters with Kahan, bfloat16 state and the scaler, as docs/sixteen_bits.md builds it."""
  import jax.numpy as jnp
  import models
  import optax

  import jaxscale

  config = config or models.GPTConfig()
  model = models.GPT(config)
  tokens = jax.ShapeDtypeStruct((config.batch, config.seq), jnp.int32)
  params32 = jax.eval_shape(lambda t: model.init(jax.random.key(0), t)["params"], tokens)

  def loss(params, tokens):
    logits = model.apply({"params": params}, tokens)
    targets = jnp.roll(tokens, -1, axis=-1)
    return optax.softmax_cross_entropy_with_integer_labels(logits[:, :-1], targets[:, :-1]).mean()

  def plain(tx):
    cast_loss = jaxscale.autocast(loss, "mixed_bfloat16")

    def step(params, opt_state, tokens):
      value, grads = jax.value_and_grad(cast_loss)(params, tokens)
      updates, opt_state = tx.update(grads, opt_state, params)
      return optax.apply_updates(params, updates), opt_state, value

    return lambda: (step, (params32, jax.eval_shape(tx.init, params32), tokens), (0, 1))

  def sixteen():
    tx = jaxscale.master_weights(jaxscale.dynamic_loss_scaling(jaxscale.low_precision_state(models.adamw())),
                                 method="kahan")
    grad = jaxscale.value_and_grad(jaxscale.autocast(loss, "params=bfloat16,compute=bfloat16,output=float32"))
    params16 = jax.tree.map(lambda p: jax.ShapeDtypeStruct(p.shape, jnp.bfloat16), params32)

    def step(params, opt_state, tokens):
      value, grads, finite = grad(jaxscale.find_scaler(opt_state), params, tokens)
      updates, opt_state = tx.update(grads, opt_state, params, finite=finite)
      return optax.apply_updates(params, updates), opt_state, value

    return step, (params16, jax.eval_shape(tx.init, params16), tokens), (0, 1)

  return {
      "float32 Adam": plain(models.adamw()),  # the baseline's name: "mixed_bfloat16", AdamW
      "mixed_bfloat16, adamw(mu_dtype=bfloat16)": plain(optax.adamw(3e-4, weight_decay=0.1, mu_dtype=jnp.bfloat16)),
      "bf16 params, kahan + bf16 state + scaler": sixteen,
  }


def markdown(target, n_leaves, results: dict[str, Measured]) -> list[str]:
  base = results["float32 Adam"]
  title = n_leaves if isinstance(n_leaves, str) else f"Adam step, 32M params / {n_leaves} leaves"
  lines = [f"**{target}, {title}**", "",
           "| program | kernels | HBM MB | x | peak MB | x | copies | compile s (CPU) | x |",
           "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
  for name, m in results.items():
    r = m.ratios(base)
    lines.append(f"| {name} | {m.kernels} | {m.hbm_bytes / 1e6:.1f} | {r['hbm']:.3f} | {m.peak_bytes / 1e6:.1f} | "
                 f"{r['peak']:.3f} | {m.copies} | {m.compile_cpu_s:.2f} | {r['compile']:.2f} |")
  return lines + [""]


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--target", choices=TARGETS, default="h100")
  parser.add_argument("--leaves", type=int, nargs="*", default=list(gpu_program.SIXTEEN_LEAVES))
  parser.add_argument("--rows", nargs="*", help="row names of the sixteen table (default: all)")
  parser.add_argument("--gpt", action="store_true", help="the GPT-2-small-shaped training steps instead")
  args = parser.parse_args(argv)
  try:
    _sharding(args.target)  # before any work: say what is missing at once
  except RuntimeError as e:
    parser.exit(1, f"{parser.prog}: {e}\n")
  print(f"{args.target} programs compiled without a device by jax {jax.__version__} "
        f"(`python benchmarks/sixteen_programs.py --target {args.target}`); x: ratio to float32 Adam's.\n")
  if args.gpt:
    results = {name: measure(args.target, build) for name, build in gpt_rows().items()}
    print("\n".join(markdown(args.target, "GPT-2 small training step (first row: mixed_bfloat16)", results)))
    return
  for n in args.leaves:
    print("\n".join(markdown(args.target, n, measure_rows(args.target, n, args.rows))), flush=True)


if __name__ == "__main__":
  main()
