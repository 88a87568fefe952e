"""Autocast's cost: the LM example's training step under per-operation autocast against float16 by hand.

The model is examples/lm.py's Transformer (NNX, pre-LayerNorm blocks, a float32 softmax in the
attention), copied here so that the benchmark stands alone. Variants, in one process, interleaved:

    float16 by hand   every layer built with dtype=jnp.float16 (float32 parameters)
    autocast          the layers with no dtype= (lm.py's --precision model), float32 parameters,
                      through jaxscale.autocast(loss, "mixed_float16")
    boundary cast     the same model, its parameters cast to float16 at the boundary (jmp's way,
                      and jaxscale.autocast before it chose per operation)
    float32           every layer built with dtype=jnp.float32

For each: the time to trace, lower and compile the jitted step (median of --compiles fresh jits),
the median step time over --steps steps, both as ratios to float16 by hand, and the precision
report of the step's gradient. Run: python benchmarks/autocast.py [--quick]
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import jaxscale

VOCAB = 256


class CausalSelfAttention(nnx.Module):
  def __init__(self, width, heads, *, dtype, rngs):
    kw = {"dtype": dtype, "param_dtype": jnp.float32, "kernel_init": nnx.initializers.normal(0.02), "rngs": rngs}
    self.heads = heads
    self.qkv = nnx.Linear(width, 3 * width, **kw)
    self.out = nnx.Linear(width, width, **kw)

  def __call__(self, x):
    batch, length, width = x.shape
    q, k, v = jnp.split(self.qkv(x).reshape(batch, length, 3 * self.heads, -1), 3, axis=2)
    scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(width // self.heads).astype(x.dtype)
    causal = jnp.tril(jnp.ones((length, length), jnp.bool_))
    weights = jax.nn.softmax(jnp.where(causal, scores.astype(jnp.float32), -jnp.inf), axis=-1)
    y = jnp.einsum("bhqk,bkhd->bqhd", weights.astype(x.dtype), v)
    return self.out(y.reshape(batch, length, width))


class Block(nnx.Module):
  def __init__(self, width, heads, *, dtype, rngs):
    kw = {"dtype": dtype, "param_dtype": jnp.float32, "rngs": rngs}
    init = nnx.initializers.normal(0.02)
    self.ln1, self.ln2 = nnx.LayerNorm(width, **kw), nnx.LayerNorm(width, **kw)
    self.attn = CausalSelfAttention(width, heads, dtype=dtype, rngs=rngs)
    self.up = nnx.Linear(width, 4 * width, kernel_init=init, **kw)
    self.down = nnx.Linear(4 * width, width, kernel_init=init, **kw)

  def __call__(self, x):
    x = x + self.attn(self.ln1(x))
    return x + self.down(nnx.gelu(self.up(self.ln2(x))))


class TransformerLM(nnx.Module):
  """As examples/lm.py's: ``layer_dtypes=False`` builds the layers without ``dtype=``."""

  def __init__(self, *, width, depth, heads, seq_len, dtype, rngs, layer_dtypes=True):
    layer_dtype = dtype if layer_dtypes else None
    kw = {"dtype": layer_dtype, "param_dtype": jnp.float32, "rngs": rngs}
    init = nnx.initializers.normal(0.02)
    self.dtype = dtype
    self.embed = nnx.Embed(VOCAB, width, embedding_init=init, **kw)
    self.pos = nnx.Param(init(rngs.params(), (seq_len, width), jnp.float32))
    self.blocks = nnx.List([Block(width, heads, dtype=layer_dtype, rngs=rngs) for _ in range(depth)])
    self.ln = nnx.LayerNorm(width, **kw)
    self.head = nnx.Linear(width, VOCAB, kernel_init=init, **kw)

  def __call__(self, tokens):
    x = self.embed(tokens) + self.pos[: tokens.shape[-1]].astype(self.dtype)
    for block in self.blocks:
      x = block(x)
    return self.head(self.ln(x))


def lm_loss(model, windows):
  logits = model(windows[:, :-1])
  return optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), windows[:, 1:]).mean()


def variants(args):
  """name -> (graphdef, params, loss of (params, windows))."""
  policy = jaxscale.get_policy("mixed_float16")
  shape = {"width": args.width, "depth": args.depth, "heads": args.heads, "seq_len": args.seq_len}

  def build(dtype, layer_dtypes=True):
    return nnx.split(TransformerLM(**shape, dtype=dtype, layer_dtypes=layer_dtypes, rngs=nnx.Rngs(0)))

  def plain(graphdef):
    return lambda params, windows: lm_loss(nnx.merge(graphdef, params), windows)

  # As examples/lm.py builds them: `--precision mixed_float16` has no dtype= in the layers.
  hand, none, full = build(jnp.float16), build(jnp.float16, layer_dtypes=False), build(jnp.float32)
  boundary = lambda params, windows: plain(none[0])(policy.cast_to_compute(params), windows)  # noqa: E731
  return {
      "float16 by hand": (hand[1], plain(hand[0])),
      "autocast": (none[1], jaxscale.autocast(plain(none[0]), policy)),
      "boundary cast": (none[1], boundary),
      "float32": (full[1], plain(full[0])),
  }


def make_step(loss, tx):
  def step(params, opt_state, windows):
    scaler = jaxscale.find_scaler(opt_state)
    grads = jax.grad(lambda p: jaxscale.scale(scaler, loss(p, windows)))(params)
    updates, opt_state = tx.update(grads, opt_state, params)
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
  print("| variant | ms/step | step ratio | compile s | compile ratio | float16 share of matmul FLOPs |")
  print("| --- | --- | --- | --- | --- | --- |")
  for name, (params, loss) in runs.items():
    ms, c = statistics.median(step_s[name]) * 1e3, statistics.median(compile_s[name])
    report = jaxscale.precision_report(jax.grad(loss), params, windows)
    print(f"| {name} | {ms:.2f} | {ms / base_step / 1e3:.3f} | {c:.2f} | {c / base_compile:.3f} | "
          f"{report.share('float16'):.1%} |")
  for name in ("boundary cast", "autocast"):
    params, loss = runs[name]
    print(f"\nprecision report, jax.grad of the loss, {name}:")
    print(jaxscale.precision_report(jax.grad(loss), params, windows))


if __name__ == "__main__":
  main()
