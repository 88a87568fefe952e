"""Autocast's cost: the LM example's training step under per-operation autocast against float16 by hand.

The model is examples/lm.py's Transformer (NNX, pre-LayerNorm blocks, a float32 softmax in the
attention), copied here so that the benchmark stands alone. Variants, in one process, interleaved:

    float16 by hand   every layer built with dtype=jnp.float16 (float32 parameters)
    autocast          the layers with no dtype= (lm.py's --precision model), float32 parameters,
                      through jaxscale.autocast(loss, "mixed_float16")
    boundary cast     the same model, its parameters cast to float16 at the boundary (jmp's way,
                      and jaxscale.autocast before it chose per operation)
    float32           every layer built with dtype=jnp.float32
    autocast POLICY   with --policies: the autocast model under each policy named (e.g.
                      mixed_bfloat16 mixed_float8, to time float8 against bfloat16 on a GPU)

For each: the time to trace, lower and compile the jitted step (median of --compiles fresh jits),
the median step time over --steps steps, both as ratios to float16 by hand, and the precision
report of the step's gradient. Run: python benchmarks/autocast.py [--quick] [--policies P ...]
"""

from __future__ import annotations

import argparse
import pathlib
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import jaxscale

# The model and loss are examples/lm.py's own, so this measures the example's step.
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "examples"))
from lm import VOCAB, TransformerLM, lm_loss


def variants(args):
  """name -> (graphdef, params, loss of (params, windows))."""
  policy = jaxscale.get_policy("mixed_float16")
  shape = {"width": args.width, "depth": args.depth, "heads": args.heads, "seq_len": args.seq_len}

  def build(dtype, layer_dtypes=True):
    return nnx.split(TransformerLM(**shape, dtype=dtype, init_std=0.02, layer_dtypes=layer_dtypes, rngs=nnx.Rngs(0)))

  def plain(graphdef):
    return lambda params, windows: lm_loss(nnx.merge(graphdef, params), windows)

  # As examples/lm.py builds them: `--precision mixed_float16` has no dtype= in the layers.
  hand, none, full = build(jnp.float16), build(jnp.float16, layer_dtypes=False), build(jnp.float32)
  boundary = lambda params, windows: plain(none[0])(policy.cast_to_compute(params), windows)
  return {
      "float16 by hand": (hand[1], plain(hand[0])),
      "autocast": (none[1], jaxscale.autocast(plain(none[0]), policy)),
      "boundary cast": (none[1], boundary),
      "float32": (full[1], plain(full[0])),
      **{f"autocast {p}": (none[1], jaxscale.autocast(plain(none[0]), p)) for p in args.policies},
  }


def make_step(loss, tx):
  def step(params, opt_state, windows):
    scaler = jaxscale.find_scaler(opt_state)
    _, grads, finite = jaxscale.value_and_grad(loss)(scaler, params, windows)  # true gradients
    updates, opt_state = tx.update(grads, opt_state, params, finite=finite)
    return optax.apply_updates(params, updates), opt_state

  return step


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--width", type=int, default=128)
  parser.add_argument("--depth", type=int, default=2)
  parser.add_argument("--heads", type=int, default=4)
  parser.add_argument("--seq-len", type=int, default=64)
  parser.add_argument("--batch", type=int, default=32)
  parser.add_argument("--steps", type=int, default=30, help="timed steps per variant and round")
  parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds")
  parser.add_argument("--compiles", type=int, default=3, help="fresh compilations per variant")
  parser.add_argument("--quick", action="store_true", help="a tiny model and few steps (a smoke test)")
  parser.add_argument("--policies", nargs="*", default=[], help="more autocast variants, by policy (mixed_float8)")
  args = parser.parse_args(argv)
  if args.quick:
    args.width, args.depth, args.seq_len, args.batch, args.steps, args.rounds, args.compiles = 32, 1, 16, 4, 3, 1, 1
  tx = jaxscale.dynamic_loss_scaling(optax.adam(1e-3))
  windows = jnp.asarray(np.random.default_rng(0).integers(0, VOCAB, (args.batch, args.seq_len + 1)), jnp.int32)
  runs = variants(args)
  compile_s = {name: [] for name in runs}
  steps = {}
  for _ in range(args.compiles):
    for name, (params, loss) in runs.items():
      start = time.perf_counter()
      compiled = jax.jit(make_step(loss, tx)).lower(params, tx.init(params), windows).compile()
      compile_s[name].append(time.perf_counter() - start)
      steps[name] = compiled
  state = {name: (params, tx.init(params)) for name, (params, _) in runs.items()}
  step_s = {name: [] for name in runs}
  for _ in range(args.rounds):
    for name, compiled in steps.items():
      params, opt_state = state[name]
      params, opt_state = jax.block_until_ready(compiled(params, opt_state, windows))  # warm
      for _ in range(args.steps):
        start = time.perf_counter()
        params, opt_state = jax.block_until_ready(compiled(params, opt_state, windows))
        step_s[name].append(time.perf_counter() - start)
      state[name] = (params, opt_state)
  base_step = statistics.median(step_s["float16 by hand"])
  base_compile = statistics.median(compile_s["float16 by hand"])
  print(f"device: {jax.devices()[0].device_kind}; jax {jax.__version__}; model width {args.width}, depth "
        f"{args.depth}, seq {args.seq_len}, batch {args.batch}")
  print("| variant | ms/step | step ratio | compile s | compile ratio | float16 share of matmul FLOPs | float8 share |")
  print("| --- | --- | --- | --- | --- | --- | --- |")
  for name, (params, loss) in runs.items():
    ms, c = statistics.median(step_s[name]) * 1e3, statistics.median(compile_s[name])
    report = jaxscale.precision_report(jax.grad(loss), params, windows)
    float8 = report.share("float8_e4m3fn") + report.share("float8_e5m2")
    print(f"| {name} | {ms:.2f} | {ms / base_step / 1e3:.3f} | {c:.2f} | {c / base_compile:.3f} | "
          f"{report.share('float16'):.1%} | {float8:.1%} |")
  for name in ("boundary cast", "autocast", *(f"autocast {p}" for p in args.policies)):
    params, loss = runs[name]
    print(f"\nprecision report, jax.grad of the loss, {name}:")
    print(jaxscale.precision_report(jax.grad(loss), params, windows))


if __name__ == "__main__":
  main()
