"""What `find_overflow` costs on a CPU: its first and later calls, beside the jitted step's compile and run.

Two small float16 Flax models (linen, float32 parameters), one skipped step each (at scale 2^24
their backward pass overflows) and then one finite step (scale 1), in that order, in one process
(the finite step's first call finds the per-operation checks compiled already):

    python benchmarks/find_overflow_cost.py            # both models, about 5 minutes on 2 cores

Each line: the model, its parameter count, and seconds (wall time, `time.perf_counter`) for the
jitted gradient site's compile and one run, then `find_overflow`'s first and second call.
"""

from __future__ import annotations

import argparse
import time

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

import jaxscale


class CNN(nn.Module):
  @nn.compact
  def __call__(self, x):
    for features in (32, 64, 64):
      x = nn.relu(nn.Conv(features, (3, 3), dtype=jnp.float16)(x))
      x = nn.max_pool(x, (2, 2), (2, 2))
    x = nn.relu(nn.Dense(128, dtype=jnp.float16)(x.reshape(x.shape[0], -1)))
    return nn.Dense(10, dtype=jnp.float16)(x)


class Block(nn.Module):
  width: int

  @nn.compact
  def __call__(self, x):
    h = nn.LayerNorm(dtype=jnp.float16)(x)
    x = x + nn.MultiHeadDotProductAttention(4, dtype=jnp.float16)(h, h, mask=nn.make_causal_mask(x[..., 0]))
    h = nn.LayerNorm(dtype=jnp.float16)(x)
    return x + nn.Dense(self.width, dtype=jnp.float16)(nn.gelu(nn.Dense(4 * self.width, dtype=jnp.float16)(h)))


class Transformer(nn.Module):
  width: int = 128
  depth: int = 2
  vocab: int = 512

  @nn.compact
  def __call__(self, tokens):
    x = nn.Embed(self.vocab, self.width, dtype=jnp.float16)(tokens)
    for _ in range(self.depth):
      x = Block(self.width)(x)
    return nn.Dense(self.vocab, dtype=jnp.float16)(nn.LayerNorm(dtype=jnp.float16)(x))


def cross_entropy(logits, labels):
  logits = logits.astype(jnp.float32)
  return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), labels[..., None], axis=-1))


def problems():
  rng = np.random.default_rng(0)
  images = jnp.asarray(rng.normal(size=(32, 28, 28, 1)), jnp.float32)
  cnn = CNN()
  yield "CNN 28x28x1, batch 32", cnn, images, jnp.asarray(rng.integers(0, 10, 32))
  tokens = jnp.asarray(rng.integers(0, 512, (8, 64)))
  yield "transformer 2 x 128 wide, 64 tokens, batch 8", Transformer(), tokens, jnp.roll(tokens, -1, axis=1)


def seconds(fun, *args):
  start = time.perf_counter()
  out = jax.block_until_ready(fun(*args))
  return time.perf_counter() - start, out


def main():
  argparse.ArgumentParser(description=__doc__).parse_args()
  for name, model, inputs, labels in problems():
    params = model.init(jax.random.key(0), inputs)
    count = sum(np.size(p) for p in jax.tree.leaves(params))

    def loss(params, inputs, labels, model=model):
      return cross_entropy(model.apply(params, inputs), labels)

    for label, scaler in (("skipped", jaxscale.init(init_scale=2.0**24)), ("finite", jaxscale.init(init_scale=1.0))):
      site = jax.jit(jaxscale.value_and_grad(loss))
      compile_run, (_, _, finite) = seconds(site, scaler, params, inputs, labels)
      run, _ = seconds(site, scaler, params, inputs, labels)
      first, report = seconds(jaxscale.find_overflow, loss, scaler, params, inputs, labels)
      second, _ = seconds(jaxscale.find_overflow, loss, scaler, params, inputs, labels)
      print(f"{name} ({count / 1e3:.0f}k parameters), {label} step (finite={bool(finite)}): jitted step "
            f"{compile_run - run:.1f} s compile, {run:.2f} s run; find_overflow {first:.1f} s first, "
            f"{second:.1f} s after: {report}", flush=True)


if __name__ == "__main__":
  main()
