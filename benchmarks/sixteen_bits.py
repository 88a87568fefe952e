"""Sixteen bits end to end: the figures of docs/sixteen_bits.md and benchmarks/NOTES.md #20.

    python benchmarks/sixteen_bits.py --bytes         # persistent bytes per parameter (instant)
    python benchmarks/sixteen_bits.py --memory        # compiled peak memory, 100M Adam + small LM (lowered and compiled, not run)
    python benchmarks/sixteen_bits.py --quality       # digits MLP, 3 seeds x 7 configurations (~2 CPU-minutes)
    python benchmarks/sixteen_bits.py --alternatives  # low_precision_state's representations (~1 CPU-minute)
    python benchmarks/sixteen_bits.py --lm            # examples/lm.py's Transformer, 3 seeds x 5 configurations (~5 CPU-minutes)

The quality task: sklearn's digits (1437 train / 360 test images of 8x8), an MLP 64-256-10 with
float16 computation where parameters are 16-bit, full-batch Adam(lr=3e-5) for 1500 steps: each update
is below half a float16 ulp of most weights, so plain 16-bit parameters barely move.

The LM task (`--lm`): examples/lm.py's byte-level Transformer and data, its pieces imported (`build`,
`lm_loss`, `make_optimizer`, `load_data`, `sample_windows`), as `examples/lm.py --width 64 --steps 300
--precision p=f16,c=f16,o=f32` builds a float16-parameter run: parameters stored in float16, float16
compute through `jaxscale.autocast`, the example's default loss weight 1e-3 and its warmup-cosine
Adam (eps 1e-11); the loss scale starts at 2**23 (what the example's probe suggests at width 64).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax

import jaxscale
from jaxscale import _lowp

LR, STEPS, SEEDS, HIDDEN = 3e-5, 1500, (0, 1, 2), 256


def adam(lr=LR):
  # eps=1e-6: Adam's default 1e-8 is below float16's subnormals (optax#1754 / #1789).
  return optax.adam(lr, eps=1e-6)


def configurations():
  """name -> (parameter dtype, transformation factory)."""
  scaled = lambda inner: jaxscale.dynamic_loss_scaling(inner, init_scale=2.0**10)
  return {
      "float32": (jnp.float32, lambda: adam()),
      "float16 params, no compensation": (jnp.float16, lambda: rounded_to_params(scaled(adam()))),
      "float16 + float32 master": (jnp.float16, lambda: jaxscale.master_weights(scaled(adam()))),
      "kahan + bfloat16 state": (jnp.float16, lambda: jaxscale.master_weights(scaled(jaxscale.low_precision_state(adam())), method="kahan")),
      "kahan + float16 state": (jnp.float16, lambda: jaxscale.master_weights(scaled(jaxscale.low_precision_state(adam(), dtype=jnp.float16)), method="kahan")),
      "SR + bfloat16 state": (jnp.float16, lambda: jaxscale.master_weights(scaled(jaxscale.low_precision_state(adam())), method="stochastic_rounding")),
      "SR + float16 state": (jnp.float16, lambda: jaxscale.master_weights(scaled(jaxscale.low_precision_state(adam(), dtype=jnp.float16)), method="stochastic_rounding")),
  }


def rounded_to_params(inner):
  """``inner`` run in float32 (gradients, parameters, state), its updates rounded to the 16-bit
  parameters' dtype and added there: everything as master_weights does but the compensation."""
  def init_fn(params):
    return inner.init(jax.tree.map(lambda p: p.astype(jnp.float32), params))

  def update_fn(grads, state, params):
    params32 = jax.tree.map(lambda p: p.astype(jnp.float32), params)
    grads32 = jax.tree.map(lambda g: g.astype(jnp.float32), grads)
    updates, state = inner.update(grads32, state, params32)
    return jax.tree.map(lambda u, p: u.astype(p.dtype), updates, params), state

  return optax.GradientTransformation(init_fn, update_fn)


def digits():
  from sklearn.datasets import load_digits

  x, y = load_digits(return_X_y=True)
  x = (x / 16.0).astype(np.float32)
  rng = np.random.default_rng(0)
  order = rng.permutation(len(x))
  x, y = x[order], y[order]
  return (jnp.asarray(x[:1437]), jnp.asarray(y[:1437])), (jnp.asarray(x[1437:]), jnp.asarray(y[1437:]))


def mlp_init(seed, dtype):
  k1, k2 = jax.random.split(jax.random.key(seed))
  params = {
      "w1": jax.random.normal(k1, (64, HIDDEN)) * 64**-0.5, "b1": jnp.zeros(HIDDEN),
      "w2": jax.random.normal(k2, (HIDDEN, 10)) * HIDDEN**-0.5, "b2": jnp.zeros(10),
  }
  return jax.tree.map(lambda p: p.astype(dtype), params)


def mlp_loss(params, x, y):
  dtype = params["w1"].dtype
  h = jax.nn.relu(x.astype(dtype) @ params["w1"] + params["b1"])
  logits = (h @ params["w2"] + params["b2"]).astype(jnp.float32)
  return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()


def has_scaler(opt_state) -> bool:
  try:
    jaxscale.find_scaler(opt_state)
  except ValueError:
    return False
  return True


def train(tx, params, data, steps=STEPS):
  (x, y), _ = data
  scaled = has_scaler(tx.init(params))

  def body(carry, _):
    p, s = carry
    if scaled:
      scaler = jaxscale.find_scaler(s)
      g = jax.grad(lambda p: jaxscale.scale(scaler, mlp_loss(p, x, y)))(p)
    else:
      g = jax.grad(mlp_loss)(p, x, y)
    u, s = tx.update(g, s, p)
    return (optax.apply_updates(p, u), s), None

  return jax.jit(lambda p: jax.lax.scan(body, (p, tx.init(p)), length=steps)[0])(params)


def quality():
  data = digits()
  (_, _), (xt, yt) = data
  print(f"digits MLP 64-{HIDDEN}-10, Adam({LR}), {STEPS} full-batch steps, seeds {SEEDS}: held-out loss / accuracy")
  print("| configuration | held-out loss (mean ± std over seeds) | accuracy | per seed | weights never moved |")
  print("| --- | --- | --- | --- | --- |")
  start = time.process_time()
  for name, (dtype, make) in configurations().items():
    losses, accs, frozen = [], [], []
    for seed in SEEDS:
      p0 = mlp_init(seed, dtype)
      p, _ = train(make(), p0, data)
      losses.append(float(mlp_loss(p, xt, yt)))
      h = jax.nn.relu(xt.astype(p["w1"].dtype) @ p["w1"] + p["b1"])
      accs.append(float(jnp.mean(jnp.argmax(h @ p["w2"] + p["b2"], -1) == yt)))
      frozen.append(float(np.mean(np.asarray(p["w1"]) == np.asarray(p0["w1"]))))
    per_seed = ", ".join(f"{v:.4f}" for v in losses)
    print(f"| {name} | {np.mean(losses):.4f} ± {np.std(losses):.4f} | {np.mean(accs):.3f} | {per_seed} | {np.mean(frozen):.0%} |")
  print(f"CPU time: {time.process_time() - start:.0f} s")


def persistent_bytes(tree) -> int:
  return sum(np.asarray(x).nbytes for x in jax.tree.leaves(tree))


def bytes_table(params32):
  """Bytes per parameter of the parameters and the optimizer state, from the arrays themselves."""
  n = sum(p.size for p in jax.tree.leaves(params32))
  p16 = jax.tree.map(lambda p: p.astype(jnp.float16), params32)
  scaled = jaxscale.dynamic_loss_scaling
  rows = {
      "float32 Adam": (params32, optax.adam(1e-3)),
      "float16 + float32 master": (p16, jaxscale.master_weights(scaled(optax.adam(1e-3)))),
      "kahan + 16-bit state": (p16, jaxscale.master_weights(scaled(jaxscale.low_precision_state(optax.adam(1e-3))), method="kahan")),
      "stochastic rounding + 16-bit state": (p16, jaxscale.master_weights(scaled(jaxscale.low_precision_state(optax.adam(1e-3))), method="stochastic_rounding")),
  }
  return {name: (persistent_bytes(p) + persistent_bytes(tx.init(p))) / n for name, (p, tx) in rows.items()}


def lm_params(vocab=512, width=256, depth=4, dtype=jnp.float32):
  keys = iter(jax.random.split(jax.random.key(0), 2 * depth + 2))
  params = {"embed": jax.random.normal(next(keys), (vocab, width)) * 0.02, "out": jax.random.normal(next(keys), (width, vocab)) * 0.02}
  for i in range(depth):
    params[f"up{i}"] = jax.random.normal(next(keys), (width, 4 * width)) * width**-0.5
    params[f"down{i}"] = jax.random.normal(next(keys), (4 * width, width)) * (4 * width) ** -0.5
  return jax.tree.map(lambda p: p.astype(dtype), params)


def lm_loss(params, tokens):
  dtype = params["embed"].dtype
  h = params["embed"][tokens[:, :-1]]
  for i in range(len([k for k in params if k.startswith("up")])):
    h = h + jax.nn.gelu(h @ params[f"up{i}"]) @ params[f"down{i}"]
  logits = (h @ params["out"]).astype(jnp.float32)
  del dtype
  return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()


def memory():
  """Compiled peak memory (lowered and compiled from shapes, never run), donated params and state."""
  big = {f"w{i}": jax.ShapeDtypeStruct((4096, 2442), jnp.float32) for i in range(10)}  # 100.0M
  small = jax.eval_shape(lm_params)
  scaled = jaxscale.dynamic_loss_scaling
  configs = {
      "float32 Adam": (jnp.float32, lambda: optax.adam(1e-3)),
      "float16 + float32 master": (jnp.float16, lambda: jaxscale.master_weights(scaled(optax.adam(1e-3)))),
      "kahan + 16-bit state": (jnp.float16, lambda: jaxscale.master_weights(scaled(jaxscale.low_precision_state(optax.adam(1e-3))), method="kahan")),
      "SR + 16-bit state": (jnp.float16, lambda: jaxscale.master_weights(scaled(jaxscale.low_precision_state(optax.adam(1e-3))), method="stochastic_rounding")),
  }
  print("| configuration | model | params | persistent bytes/param | arguments MB | temporaries MB | peak MB (args + temps + non-aliased outputs) |")
  print("| --- | --- | --- | --- | --- | --- | --- |")
  for model, shapes in [("Adam step, grads given", big), ("LM-like step (fwd+bwd), batch 16x128", small)]:
    n = sum(int(np.prod(s.shape)) for s in jax.tree.leaves(shapes))
    for name, (dtype, make) in configs.items():
      tx = make()
      params = jax.tree.map(lambda s, dtype=dtype: jax.ShapeDtypeStruct(s.shape, dtype), shapes)
      state = jax.eval_shape(tx.init, params)
      nbytes = sum(int(np.prod(x.shape)) * x.dtype.itemsize for x in jax.tree.leaves((params, state)))
      if model.startswith("Adam"):
        def step(p, s, g, tx=tx):
          u, s = tx.update(g, s, p)
          return optax.apply_updates(p, u), s
        args = (params, state, params)
      else:
        def step(p, s, tokens, tx=tx):
          if has_scaler(s):
            g = jax.grad(lambda p: jaxscale.scale(jaxscale.find_scaler(s), lm_loss(p, tokens)))(p)
          else:
            g = jax.grad(lm_loss)(p, tokens)
          u, s = tx.update(g, s, p)
          return optax.apply_updates(p, u), s
        args = (params, state, jax.ShapeDtypeStruct((16, 129), jnp.int32))
      compiled = jax.jit(step, donate_argnums=(0, 1)).lower(*args).compile()
      m = compiled.memory_analysis()
      peak = m.argument_size_in_bytes + m.temp_size_in_bytes + m.output_size_in_bytes - m.alias_size_in_bytes
      print(f"| {name} | {model} | {n / 1e6:.1f}M | {nbytes / n:.2f} | {m.argument_size_in_bytes / 1e6:.0f} | {m.temp_size_in_bytes / 1e6:.0f} | {peak / 1e6:.0f} |")


# --- low_precision_state's representations, swapped in for the measurement only -------------------

def _nearest(scaled: bool):
  def encode(x, dtype, key):
    del key
    x = x.astype(jnp.float32)
    if not scaled:
      return _lowp.LowPrecisionArray(x.astype(dtype), jnp.float32(1))
    stored = ENCODE(x, dtype, jax.random.key(0))
    biggest_scale = stored.scale
    return _lowp.LowPrecisionArray((x / biggest_scale).astype(dtype), biggest_scale)
  return encode


def _stochastic_unscaled(x, dtype, key):
  x = x.astype(jnp.float32)
  uniform = jax.random.uniform(key, x.shape, jnp.float32)
  big = float(jnp.finfo(dtype).max)
  return _lowp.LowPrecisionArray(jaxscale._master._stochastic_round(jnp.clip(x, -big, big), dtype, uniform), jnp.float32(1))


ENCODE = _lowp._encode_leaf


def alternatives():
  """Each representation on (a) Adam's second moment fed gradients that drop tenfold (b2 = 0.999),
  against float64; (b) the digits MLP in float32 parameters with the state stored that way."""
  variants = {
      "round to nearest, no scale": _nearest(False),
      "round to nearest, per-tensor scale": _nearest(True),
      "stochastic, no scale": _stochastic_unscaled,
      "stochastic, per-tensor scale (adopted)": ENCODE,
  }
  b2, before, after = 0.999, 500, 2000
  g = np.concatenate([np.ones(before), np.full(after, 0.1)]) * 1e-3  # gradients of 1e-3: nu ~ 1e-6
  nu64 = 0.0
  for gi in g:
    nu64 = b2 * nu64 + (1 - b2) * gi**2
  data = digits()
  (_, _), (xt, yt) = data
  ref = [float(mlp_loss(train(adam(), mlp_init(s, jnp.float32), data, steps=600)[0], xt, yt)) for s in SEEDS]
  print(f"float32 state: digits held-out loss after 600 steps {np.mean(ref):.4f} ± {np.std(ref):.4f}")
  print("| representation | dtype | Adam nu after the drop / float64 (gradients 1e-3 -> 1e-4) | digits loss, 600 steps (3 seeds) |")
  print("| --- | --- | --- | --- |")
  for name, encode in variants.items():
    _lowp._encode_leaf = encode
    try:
      for dtype in (jnp.bfloat16, jnp.float16):
        tx = jaxscale.low_precision_state(optax.scale_by_adam(b2=b2), dtype=dtype)
        params = jnp.zeros(256)

        def body(state, gi, tx=tx, params=params):
          return tx.update(jnp.full(256, gi, jnp.float32), state, params)[1], None

        state = jax.jit(lambda s, gs, body=body: jax.lax.scan(body, s, gs)[0])(tx.init(params), jnp.asarray(g, jnp.float32))
        nu = float(np.mean(_lowp._decode(state.inner_state, None).nu))
        losses = [float(mlp_loss(train(jaxscale.low_precision_state(adam(), dtype=dtype), mlp_init(s, jnp.float32), data, steps=600)[0], xt, yt)) for s in SEEDS]
        print(f"| {name} | {jnp.dtype(dtype).name} | {nu / nu64:.3f} | {np.mean(losses):.4f} ± {np.std(losses):.4f} |")
    finally:
      _lowp._encode_leaf = ENCODE


# --- examples/lm.py's Transformer over seeds ------------------------------------------------------

LM_STEPS, LM_WIDTH, LM_INIT_SCALE = 300, 64, 2.0**23
# The plain float16 baseline gives float16 gradients to `dynamic_loss_scaling` on purpose: that is what it shows.
FLOAT16_GRADIENTS = r"jaxscale: `dynamic_loss_scaling` was given float16 gradients"


def lm_configurations(args, lm, common):
  """name -> (precision policy, transformation factory): examples/lm.py's optimizer, and around it the
  16-bit pieces. ``args`` are the example's own (its schedule, eps, growth interval, init scale)."""
  float32, float16 = common.precision_run("float32"), common.precision_run("p=f16,c=f16,o=f32")

  def scaled(wrap_adam):
    # make_optimizer's dynamic_loss_scaling(adam) with ``wrap_adam`` applied to its Adam.
    schedule = optax.warmup_cosine_decay_schedule(
        0.0, args.lr, warmup_steps=max(1, args.steps // 20), decay_steps=args.steps, end_value=args.lr / 10)
    adam = optax.adam(schedule, eps=1e-8 * args.loss_weight)
    return jaxscale.dynamic_loss_scaling(wrap_adam(adam), init_scale=args.init_scale,
                                         growth_interval=args.growth_interval)

  bf16_state = lambda adam: jaxscale.low_precision_state(adam, dtype=jnp.bfloat16)
  return {
      "float32": (float32, lambda: lm.make_optimizer(args, float32)),
      "float16 params, no master (dynamic_loss_scaling(adam))": (float16, lambda: scaled(lambda a: a)),
      "float16 + float32 master": (float16, lambda: lm.make_optimizer(args, float16)),
      "kahan + bfloat16 state": (float16, lambda: jaxscale.master_weights(scaled(bf16_state), method="kahan")),
      "SR + bfloat16 state": (float16, lambda: jaxscale.master_weights(scaled(bf16_state), method="stochastic_rounding")),
  }


def lm_quality(steps=LM_STEPS, width=LM_WIDTH, only=None):
  sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples"))
  import _common
  import lm
  from flax import nnx

  args = lm.parse_args(["--width", str(width), "--steps", str(steps), "--no-plot", "--no-progress"])
  args.init_scale = LM_INIT_SCALE
  train_data, eval_windows = lm.load_data(args)
  configs = lm_configurations(args, lm, _common)
  print(f"examples/lm.py, width {width}, depth {args.depth}, seq {args.seq_len}, batch {args.batch}, {steps} steps, "
        f"loss weight {args.loss_weight:g}, start scale 2^{np.log2(LM_INIT_SCALE):g}, seeds {SEEDS}: held-out loss")
  results = {}
  start = time.process_time()
  for name, (config, make) in configs.items():
    if only is not None and name not in only:
      continue
    losses = []
    for seed in SEEDS:
      model = lm.build(args, config.dtype, seed, config.policy)
      # Functional rather than through nnx.Optimizer: inside nnx.Optimizer.update, low_precision_state's
      # decode fails (a pytree structure error between the stored state and jax.eval_shape(init, params));
      # on the nnx.State of the parameters it runs. The step is make_train_step's: scale with the
      # optimizer's scaler, differentiate, update.
      graphdef, params, rest = nnx.split(model, nnx.Param, ...)
      tx = make()
      loss_fn = jaxscale.autocast(lm.lm_loss, config.policy)
      model_loss = lambda p, windows, loss_fn=loss_fn, graphdef=graphdef, rest=rest: loss_fn(nnx.merge(graphdef, p, rest), windows)

      def step(params, opt_state, windows, tx=tx, model_loss=model_loss):
        scaler = jaxscale.find_scaler(opt_state)
        grads = jax.grad(lambda p: jaxscale.scale(scaler, model_loss(p, windows) * args.loss_weight))(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

      step = jax.jit(step, donate_argnums=(0, 1))
      opt_state = tx.init(params)
      rng = np.random.default_rng(seed)  # the example's data order for this seed
      with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=FLOAT16_GRADIENTS)
        for _ in range(steps):
          params, opt_state = step(params, opt_state, lm.sample_windows(train_data, rng, args.batch, args.seq_len))
      eval_loss = jax.jit(model_loss)
      losses.append(float(np.mean([eval_loss(params, w) for w in eval_windows])))
      skipped = int(jaxscale.metrics(opt_state)["skipped_steps"])
      print(f"  {name}, seed {seed}: {losses[-1]:.4f} ({skipped} skipped steps, {time.process_time() - start:.0f} CPU-s so far)",
            flush=True)
    results[name] = losses
  lo, hi = (min(results["float32"]), max(results["float32"])) if "float32" in results else (np.nan, np.nan)
  print(f"float32's seed spread (min-max): {lo:.4f} .. {hi:.4f}")
  print("| configuration | held-out loss, mean | per seed (0, 1, 2) | mean inside float32's min-max |")
  print("| --- | --- | --- | --- |")
  for name, losses in results.items():
    mean = float(np.mean(losses))
    inside = "yes" if lo <= mean <= hi else "no"
    print(f"| {name} | {mean:.4f} | {', '.join(f'{v:.4f}' for v in losses)} | {inside} |")
  print(f"CPU time: {time.process_time() - start:.0f} s")
  return results


def main():
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--bytes", action="store_true")
  parser.add_argument("--memory", action="store_true")
  parser.add_argument("--quality", action="store_true")
  parser.add_argument("--alternatives", action="store_true")
  parser.add_argument("--lm", action="store_true")
  parser.add_argument("--lm-steps", type=int, default=LM_STEPS, help="with --lm: training steps per run")
  parser.add_argument("--lm-only", action="append", help="with --lm: only this configuration (repeatable)")
  args = parser.parse_args()
  if args.bytes:
    for name, b in bytes_table(jax.tree.map(jnp.asarray, lm_params())).items():
      print(f"{name}: {b:.2f} bytes/param")
  if args.memory:
    memory()
  if args.quality:
    quality()
  if args.alternatives:
    alternatives()
  if args.lm:
    lm_quality(steps=args.lm_steps, only=args.lm_only)


if __name__ == "__main__":
  main()
