"""A byte-level Transformer language model on the Python standard library's own source.

Three runs of the same Flax NNX model, seed and data order: float32; float16
compute (float32 parameters) without loss scaling; float16 with jaxscale,
starting from the scale that one probe step suggests (`--init-scale auto`,
`jaxscale.probe_scale`). Then the evidence: how many gradient elements, of the
parameters and of every block's output and the logits (`jaxscale.tap`), are
zero or subnormal in float16 with and without jaxscale's scale, as tables and
a histogram of log2|g| per tapped layer (`jaxscale.plot.range_histogram`).

By default the loss is weighted by 1e-3 (Adam's eps too, so float32 trains the
same up to rounding): every gradient is 1000 times smaller, the logit gradients
as small as those of a mean loss over two million tokens (a real language
model's batch) rather than this batch's two thousand. Most activation gradients
then fall below float16's smallest subnormal (2^-24) and flush to zero: float16
alone loses to float32, and jaxscale's scale recovers it.

    python examples/lm.py                             # float16 loses, jaxscale recovers
                                                      # (about 9 minutes on 2 idle CPU cores)
    python examples/lm.py --loss-weight 1 --steps 600  # the plain loss: float16 alone is close to float32 at this size
    python examples/lm.py --loss-weight 2048 --runs 2 --steps 200 --init-scale 65536  # summed loss:
                                                                                      # torch's start skips 11 steps
    python examples/lm.py --steps 5000 --width 512 --depth 8 --seq-len 256 --batch 64  # a GPU

`--precision` replaces the three runs with runs in the policies you choose, through jaxscale's
mixed-precision pieces (`get_policy`, `autocast`, `needs_loss_scaling`, `master_weights`):

    python examples/lm.py --precision auto                                # what jaxscale recommends for this device
    python examples/lm.py --precision float32 --precision mixed_bfloat16  # several policies, one table
    python examples/lm.py --precision mixed_bfloat16 --precision mixed_float8  # float8 matmuls (docs/float8.md)
    python examples/lm.py --precision params=float16,compute=float16,output=float32  # float32 master weights
    python examples/lm.py --precision mixed_float16 --tensorboard runs/lm # log the loss and jaxscale.metrics

The NNX recipe is in `make_train_step`; see also `jaxscale.flax`.
"""

from __future__ import annotations

import argparse
import math
import os
import sysconfig

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import jaxscale
import jaxscale.flax
import jaxscale.plot

import _common  # examples/, on the path when this file runs as a script

VOCAB = 256  # bytes


def load_stdlib_bytes(max_bytes: int) -> np.ndarray:
  """The first ``max_bytes`` of the standard library's ``.py`` files, in sorted path order."""
  root = sysconfig.get_paths()["stdlib"]
  chunks, total = [], 0
  for directory, subdirs, files in os.walk(root):
    # Installed packages are not the standard library, and differ between machines.
    subdirs[:] = sorted(d for d in subdirs if d not in ("site-packages", "dist-packages", "__pycache__"))
    for name in sorted(f for f in files if f.endswith(".py")):
      with open(os.path.join(directory, name), "rb") as f:
        chunks.append(f.read())
      total += len(chunks[-1])
      if total >= max_bytes:
        return np.frombuffer(b"".join(chunks)[:max_bytes], np.uint8)
  return np.frombuffer(b"".join(chunks), np.uint8)


def sample_windows(data: np.ndarray, rng: np.random.Generator, batch: int, seq_len: int) -> np.ndarray:
  starts = rng.integers(0, len(data) - seq_len - 1, size=batch)
  return np.stack([data[s : s + seq_len + 1] for s in starts]).astype(np.int32)


class CausalSelfAttention(nnx.Module):
  """Multi-head causal self-attention; the softmax runs in float32, as mixed precision usually does."""

  def __init__(self, width: int, heads: int, *, dtype, init, rngs: nnx.Rngs):
    kw = dict(dtype=dtype, param_dtype=jnp.float32, kernel_init=init, rngs=rngs)
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
  """A pre-LayerNorm Transformer block."""

  def __init__(self, width: int, heads: int, *, dtype, init, rngs: nnx.Rngs):
    kw = dict(dtype=dtype, param_dtype=jnp.float32, rngs=rngs)
    self.ln1 = nnx.LayerNorm(width, **kw)
    self.attn = CausalSelfAttention(width, heads, dtype=dtype, init=init, rngs=rngs)
    self.ln2 = nnx.LayerNorm(width, **kw)
    self.up = nnx.Linear(width, 4 * width, kernel_init=init, **kw)
    self.down = nnx.Linear(4 * width, width, kernel_init=init, **kw)

  def __call__(self, x):
    x = x + self.attn(self.ln1(x))
    return x + self.down(nnx.gelu(self.up(self.ln2(x))))


class TransformerLM(nnx.Module):
  """Bytes in, next-byte logits out; computes in ``dtype`` with float32 parameters (`build` casts them).

  ``layer_dtypes=False`` builds the layers without Flax's ``dtype=`` arguments:
  they compute in the dtype of what reaches them, which `jaxscale.autocast`
  decides (``dtype`` is then the compute dtype that autocast will give them).
  """

  def __init__(self, *, width, depth, heads, seq_len, dtype, init_std, rngs: nnx.Rngs, layer_dtypes=True):
    init = nnx.initializers.normal(init_std)
    layer_dtype = dtype if layer_dtypes else None
    kw = dict(dtype=layer_dtype, param_dtype=jnp.float32, rngs=rngs)
    self.dtype = dtype
    self.embed = nnx.Embed(VOCAB, width, embedding_init=init, **kw)
    self.pos = nnx.Param(init(rngs.params(), (seq_len, width), jnp.float32))
    self.blocks = nnx.List([Block(width, heads, dtype=layer_dtype, init=init, rngs=rngs) for _ in range(depth)])
    self.ln = nnx.LayerNorm(width, **kw)
    self.head = nnx.Linear(width, VOCAB, kernel_init=init, **kw)

  def __call__(self, tokens, taps=None):
    """``taps``: `jaxscale.tap_probes(tap_names(model))` to record the gradients of every block's output
    and of the logits (see `gradient_range`), or None."""
    seq_len = tokens.shape[-1]
    x = self.embed(tokens) + self.pos[:seq_len].astype(self.dtype)
    for i, block in enumerate(self.blocks):
      x = jaxscale.tap(block(x), taps, f"block{i}")
    return jaxscale.tap(self.head(self.ln(x)), taps, "logits")


def tap_names(model: TransformerLM) -> list[str]:
  return [f"block{i}" for i in range(len(model.blocks))] + ["logits"]


def scale_text(scale: float) -> str:
  """A loss scale as a power of two, where it is one."""
  exponent = math.log2(scale)
  return f"2^{exponent:g}" if exponent == int(exponent) else f"{scale:g}"


def lm_loss(model: TransformerLM, windows: jax.Array, taps=None) -> jax.Array:
  """Mean next-byte cross-entropy, in float32 whatever the compute dtype."""
  logits = model(windows[:, :-1], taps)
  return optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), windows[:, 1:]).mean()


def make_train_step(loss_fn, loss_weight: float, traces: _common.TraceCounter):
  """The NNX recipe: `jaxscale.flax.value_and_grad` with the scaler found in the optimizer, then `update`.

  ``loss_fn`` is `lm_loss`, or `lm_loss` through `jaxscale.autocast`. The step
  returns the loss and `jaxscale.metrics`, as device arrays: nothing in it
  waits for the device.
  """

  @nnx.jit
  @traces
  def train_step(model, optimizer, windows):
    def weighted_loss(model):
      loss = loss_fn(model, windows)
      return loss * loss_weight, loss

    scaler = jaxscale.find_scaler(optimizer.opt_state)
    # Scales the loss, differentiates, unscales and checks: `grads` are the true gradients.
    (_, loss), grads, finite = jaxscale.flax.value_and_grad(weighted_loss, has_aux=True)(scaler, model)
    optimizer.update(model, grads, finite=finite)  # skips the step on inf/NaN
    return loss, jaxscale.metrics(optimizer.opt_state)

  return train_step


@nnx.jit
def gradient_range(model, windows, scale, loss_weight):
  """`jaxscale.range_stats` of the gradients that exist during backprop, for the loss scaled by ``scale``.

  The gradient of every block's output and of the logits (read by the model's
  taps), in the model's compute dtype, and the parameter gradients, cast to float16.
  """
  scaler = jaxscale.init(init_scale=scale)
  fn = lambda model, taps: jaxscale.scale(scaler, lm_loss(model, windows, taps) * loss_weight)
  param_grads, tap_stats = nnx.grad(fn, argnums=(0, 1))(model, jaxscale.tap_probes(tap_names(model)))
  return {**tap_stats, "parameter gradients": jaxscale.range_stats(param_grads)}


def build(args, dtype, seed, policy: jaxscale.Policy | None = None):
  """The model, computing in ``dtype``; given a ``policy``, without ``dtype=`` in its layers, and with its
  parameters stored in the policy's param dtype (the float32 initialization, rounded)."""
  model = TransformerLM(
      width=args.width,
      depth=args.depth,
      heads=args.heads,
      seq_len=args.seq_len,
      dtype=dtype,
      init_std=args.init_std,
      rngs=nnx.Rngs(seed),
      layer_dtypes=policy is None,
  )
  if policy is not None:
    nnx.update(model, policy.cast_to_param(nnx.state(model, nnx.Param)))
  return model


def gradient_evidence(args, model16, scale, windows):
  """`gradient_range` three ways: float32 compute (the reference), float16 without and with the scale."""
  model32 = build(args, jnp.float32, args.seed)
  nnx.update(model32, nnx.state(model16, nnx.Param))
  variants = {
      "float32 (reference)": gradient_range(model32, windows, 1.0, args.loss_weight),
      "float16, no scaling": gradient_range(model16, windows, 1.0, args.loss_weight),
      f"float16 x {scale_text(scale)} (jaxscale)": gradient_range(model16, windows, scale, args.loss_weight),
  }
  print(f"\nThe gradients in float16 at the end of the float16 + jaxscale run, one held-out batch, loss weight "
        f"{args.loss_weight:g}. With float32 compute, zero % is what a cast to float16 would flush; with float16 "
        "compute the gradients are float16 already, and what was flushed is in exact 0 %.")
  for label, stats in variants.items():
    print(f"\n{label}:\n" + jaxscale.format_range_stats(stats))
  return variants


def start_scale(args, train_data) -> float:
  """jaxscale's first loss scale: ``--init-scale``, or with ``auto`` `jaxscale.probe_scale`'s.

  The probe is one float32 forward and backward pass of the weighted loss on
  the first training batch, taps included: the largest gradient there, of a
  parameter or of an activation, decides the largest scale float16 holds.
  Prints the probe's suggestion and the gradients' range in float16 at the
  scale chosen.
  """
  model32 = build(args, jnp.float32, args.seed)
  first = sample_windows(train_data, np.random.default_rng(args.seed), args.batch, args.seq_len)  # train_runs' first
  loss = lambda model, windows, taps=None: lm_loss(model, windows, taps) * args.loss_weight
  probe = nnx.jit(lambda m, w: jaxscale.probe_scale(loss, m, w, taps=tap_names(m), grad=nnx.grad))(model32, first)
  suggested = float(probe.scale)
  print(f"Probe step (float32, first training batch): largest gradient {float(probe.max_magnitude):.3g}, "
        f"suggested start scale {scale_text(suggested)} (float16's largest value / 8, rounded down to a power "
        "of two).")
  if args.init_scale == "auto":
    scale, stats = suggested, {**probe.taps, "parameter gradients": probe.stats}
  else:
    scale, stats = args.init_scale, gradient_range(model32, first, args.init_scale, args.loss_weight)
  print(f"Start scale {scale_text(scale)}{' (auto)' if args.init_scale == 'auto' else ''}; the first batch's "
        "gradients in float16 at it:\n" + jaxscale.format_range_stats(stats) + "\n")
  return scale


def parse_args(argv=None) -> argparse.Namespace:
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=_common.HelpFormatter)
  _common.add_flags(parser, steps=400, batch=32, lr=3e-3, loss_weight=1e-3, out="lm.png", init_scale="auto")
  parser.add_argument("--width", type=int, default=128, help="model width (embedding size)")
  parser.add_argument("--depth", type=int, default=2, help="Transformer blocks")
  parser.add_argument("--heads", type=int, default=4, help="attention heads (must divide --width)")
  parser.add_argument("--seq-len", type=int, default=64, help="bytes per training window")
  parser.add_argument("--init-std", type=float, default=0.02, help="std of every weight's normal init")
  parser.add_argument("--data-mb", type=float, default=4.0, help="megabytes of stdlib source to read")
  parser.add_argument("--eval-batches", type=int, default=8, help="held-out batches per evaluation")
  parser.add_argument("--grad-hist", default="lm_grads.png", help="where to write the gradient histogram")
  return parser.parse_args(argv)


def load_data(args: argparse.Namespace) -> tuple[np.ndarray, list[np.ndarray]]:
  """The training bytes, and the held-out windows every evaluation uses (the same whatever the seed)."""
  data = load_stdlib_bytes(int(args.data_mb * 2**20))
  split = int(0.9 * len(data))
  train_data, heldout = data[:split], data[split:]
  eval_rng = np.random.default_rng(10_000)
  eval_windows = [sample_windows(heldout, eval_rng, args.batch, args.seq_len) for _ in range(args.eval_batches)]
  print(f"{len(data) / 2**20:.1f} MiB of {sysconfig.get_paths()['stdlib']}/**.py: "
        f"{len(train_data):,} training bytes, {len(heldout):,} held out; {jax.devices()[0].platform}")
  return train_data, eval_windows


def make_optimizer(args: argparse.Namespace, config: _common.RunConfig) -> optax.GradientTransformation:
  """Adam with warmup and cosine decay, inside jaxscale's wrapper (disabled for the unscaled runs).

  The runs are compared at the end, where a decayed learning rate makes the
  final loss depend less on the path that led there. Skipped steps do not
  advance the schedule. For 16-bit parameters, `jaxscale.master_weights` goes
  around the scaler: Adam updates a float32 copy, with the float32 gradients of
  `jaxscale.flax.value_and_grad` (which casts them before it unscales them).
  """
  schedule = optax.warmup_cosine_decay_schedule(
      0.0, args.lr, warmup_steps=max(1, args.steps // 20), decay_steps=args.steps, end_value=args.lr / 10
  )
  # A disabled scaler never scales, and `main` probes for `--init-scale auto` only when a run scales.
  init_scale = args.init_scale if config.scaling else 1.0
  tx = jaxscale.dynamic_loss_scaling(
      optax.adam(schedule, eps=1e-8 * args.loss_weight), enabled=config.scaling, init_scale=init_scale,
      growth_interval=args.growth_interval,
  )
  return jaxscale.master_weights(tx) if config.master_weights else tx


def train_runs(args: argparse.Namespace, train_data: np.ndarray, eval_windows: list[np.ndarray]):
  """The selected runs, one after the other; returns their results, and the last model and its optimizer."""
  results = []
  for config in _common.selected_runs(args):
    model = build(args, config.dtype, args.seed, config.policy)
    optimizer = nnx.Optimizer(model, make_optimizer(args, config), wrt=nnx.Param)
    loss_fn = lm_loss if config.policy is None else jaxscale.autocast(lm_loss, config.policy)
    traces = _common.TraceCounter()
    train_step = make_train_step(loss_fn, args.loss_weight, traces)
    eval_loss = nnx.jit(loss_fn)
    rng = np.random.default_rng(args.seed)
    batches = (sample_windows(train_data, rng, args.batch, args.seq_len) for _ in range(args.steps))
    evaluate = lambda: {"loss": float(np.mean([eval_loss(model, w) for w in eval_windows]))}
    results.append(_common.train(config, lambda w: train_step(model, optimizer, w), batches, evaluate, args))
    traces.assert_once()
  return results, model, optimizer


def main(argv=None):
  args = parse_args(argv)
  train_data, eval_windows = load_data(args)
  if any(config.scaling for config in _common.selected_runs(args)):
    args.init_scale = start_scale(args, train_data)

  results, model, _ = train_runs(args, train_data, eval_windows)

  setting = f"loss weight {args.loss_weight:g}, depth {args.depth}, init std {args.init_std:g}"
  if not args.no_plot:
    _common.plot_runs(results, args.out, title=f"byte-level Transformer LM on the Python stdlib, "
                      f"depth {args.depth}, init std {args.init_std:g}, loss x {args.loss_weight:g}")
  if results[-1].name == _common.RUNS[-1].name:
    panels = gradient_evidence(args, model, results[-1].final_scale, eval_windows[0])
    if not args.no_plot:
      jaxscale.plot.range_histogram(panels, path=args.grad_hist, columns=2, title=f"gradients at the end of the "
                                    f"float16 + jaxscale run ({setting}), one held-out batch")
      print(f"wrote {args.grad_hist}")
  n_params = sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
  print(f"\nbyte-level Transformer, {n_params:,} parameters, width {args.width}, depth {args.depth}, "
        f"seq {args.seq_len}, batch {args.batch}, {args.steps} steps, loss weight {args.loss_weight:g}, "
        f"init std {args.init_std:g}\n")
  print(_common.results_table(results))
  return results


if __name__ == "__main__":
  main()
