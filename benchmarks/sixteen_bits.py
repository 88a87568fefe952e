"""Sixteen bits end to end: the figures of docs/sixteen_bits.md and benchmarks/NOTES.md.

    python benchmarks/sixteen_bits.py --bytes         # persistent bytes per parameter (instant)
    python benchmarks/sixteen_bits.py --memory        # compiled peak memory and compile time: Adam at 24M and 100M,
                                                      # examples/lm.py's step
    python benchmarks/sixteen_bits.py --quality       # digits MLP, 3 seeds x 5 configurations (~2 CPU-minutes)
    python benchmarks/sixteen_bits.py --alternatives  # 16-bit representations of Adam's state on adversarial tensors
                                                      # (~10 CPU-s)
    python benchmarks/sixteen_bits.py --lm            # examples/lm.py's Transformer, 3 seeds x 5 configurations
                                                      # (~5 CPU-minutes)

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

import jax
import jax.numpy as jnp
import numpy as np
import optax

import jaxscale
from jaxscale import _rounding

LR, STEPS, SEEDS, HIDDEN = 3e-5, 1500, (0, 1, 2), 256


def adam(lr=LR):
  # eps=1e-6: Adam's default 1e-8 is below float16's subnormals (optax#1754 / #1789).
  return optax.adam(lr, eps=1e-6)


def configurations():
  """name -> (parameter dtype, transformation factory)."""
  scaled = lambda inner: jaxscale.dynamic_loss_scaling(inner, init_scale=2.0**10)
  lowp = jaxscale.low_precision_state
  return {
      "float32": (jnp.float32, lambda: adam()),
      "float16 params, no compensation": (jnp.float16, lambda: rounded_to_params(scaled(adam()))),
      "float16 + float32 master": (jnp.float16, lambda: jaxscale.master_weights(scaled(adam()))),
      "kahan + bfloat16 state": (jnp.float16, lambda: jaxscale.master_weights(scaled(lowp(adam())), method="kahan")),
      "SR + bfloat16 state": (
          jnp.float16, lambda: jaxscale.master_weights(scaled(lowp(adam())), method="stochastic_rounding")
      ),
  }


def rounded_to_params(inner):
  """``inner`` run in float32 (gradients, parameters, state), its updates rounded to the 16-bit
  parameters' dtype and added there: everything as master_weights does but the compensation."""
  def init_fn(params):
    return inner.init(jax.tree.map(lambda p: p.astype(jnp.float32), params))

  inner = optax.with_extra_args_support(inner)

  def update_fn(grads, state, params, **extra_args):  # the gradient site's `finite`, for a scaler inside
    params32 = jax.tree.map(lambda p: p.astype(jnp.float32), params)
    grads32 = jax.tree.map(lambda g: g.astype(jnp.float32), grads)
    updates, state = inner.update(grads32, state, params32, **extra_args)
    return jax.tree.map(lambda u, p: u.astype(p.dtype), updates, params), state

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)


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
    if scaled:  # true gradients, float32 for the 16-bit parameters (the gradient site's contract)
      _, g, finite = jaxscale.value_and_grad(mlp_loss)(jaxscale.find_scaler(s), p, x, y)
      u, s = tx.update(g, s, p, finite=finite)
    else:
      u, s = tx.update(jax.grad(mlp_loss)(p, x, y), s, p)
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
    print(f"| {name} | {np.mean(losses):.4f} ± {np.std(losses):.4f} | {np.mean(accs):.3f} | {per_seed} | "
          f"{np.mean(frozen):.0%} |")
  print(f"CPU time: {time.process_time() - start:.0f} s")


def persistent_bytes(tree) -> int:
  return sum(np.asarray(x).nbytes for x in jax.tree.leaves(tree))


def bytes_table(params32):
  """Bytes per parameter of the parameters and the optimizer state, from the arrays themselves."""
  n = sum(p.size for p in jax.tree.leaves(params32))
  p16 = jax.tree.map(lambda p: p.astype(jnp.float16), params32)
  scaled = jaxscale.dynamic_loss_scaling
  lowp = jaxscale.low_precision_state
  rows = {
      "float32 Adam": (params32, optax.adam(1e-3)),
      "float16 + float32 master": (p16, jaxscale.master_weights(scaled(optax.adam(1e-3)))),
      "kahan + 16-bit state": (p16, jaxscale.master_weights(scaled(lowp(optax.adam(1e-3))), method="kahan")),
      "stochastic rounding + 16-bit state": (
          p16, jaxscale.master_weights(scaled(lowp(optax.adam(1e-3))), method="stochastic_rounding")
      ),
  }
  return {name: (persistent_bytes(p) + persistent_bytes(tx.init(p))) / n for name, (p, tx) in rows.items()}


def memory_configurations():
  """name -> (parameter dtype, transformation factory), Adam around the 16-bit pieces."""
  scaled = jaxscale.dynamic_loss_scaling
  lowp = jaxscale.low_precision_state
  return {
      "float32 Adam": (jnp.float32, lambda: optax.adam(1e-3)),
      "float16 + float32 master": (jnp.float16, lambda: jaxscale.master_weights(scaled(optax.adam(1e-3)))),
      "kahan + 16-bit state": (
          jnp.float16, lambda: jaxscale.master_weights(scaled(lowp(optax.adam(1e-3))), method="kahan")
      ),
      "SR + 16-bit state": (
          jnp.float16, lambda: jaxscale.master_weights(scaled(lowp(optax.adam(1e-3))), method="stochastic_rounding")
      ),
  }


def compiled_row(step, args):
  """(peak bytes, compile seconds) of ``step`` jitted with its first two arguments donated."""
  start = time.perf_counter()
  compiled = jax.jit(step, donate_argnums=(0, 1)).lower(*args).compile()
  seconds = time.perf_counter() - start
  m = compiled.memory_analysis()
  return m.argument_size_in_bytes + m.temp_size_in_bytes + m.output_size_in_bytes - m.alias_size_in_bytes, seconds


def adam_step_rows(n_cols):
  """The Adam step alone over ten 4096 x ``n_cols`` matrices; float32 gradients given (the
  gradient site casts 16-bit parameters' gradients to float32 before it unscales them)."""
  shapes = {f"w{i}": (4096, n_cols) for i in range(10)}
  rows = {}
  for name, (dtype, make) in memory_configurations().items():
    tx = make()
    params = {k: jax.ShapeDtypeStruct(v, dtype) for k, v in shapes.items()}
    grads = {k: jax.ShapeDtypeStruct(v, jnp.float32) for k, v in shapes.items()}
    state = jax.eval_shape(tx.init, params)

    def step(p, s, g, tx=tx):
      # The flag a gradient site would pass (the step's cost does not depend on its value).
      u, s = tx.update(g, s, p, **({"finite": jnp.asarray(True)} if has_scaler(s) else {}))
      return optax.apply_updates(p, u), s

    row = compiled_row(step, (params, state, grads))
    rows[name] = row + (persistent_bytes_of((params, state)) / (10 * 4096 * n_cols),)
  return rows


def persistent_bytes_of(shapes) -> int:
  return sum(int(np.prod(x.shape)) * x.dtype.itemsize for x in jax.tree.leaves(shapes))


def lm_step_rows(width=128):
  """examples/lm.py's full training step (forward, backward, optimizer) at its defaults (width 128,
  depth 2, batch 32 x 64 bytes), float16 compute through `autocast` where the parameters are 16-bit."""
  lm, common = _lm_modules()
  from flax import nnx

  args = lm.parse_args(["--width", str(width), "--no-plot", "--no-progress"])
  float32, float16 = common.precision_run("float32"), common.precision_run("p=f16,c=f16,o=f32")
  rows = {}
  for name, (dtype, make) in memory_configurations().items():
    config = float32 if dtype == jnp.float32 else float16
    graphdef, params, rest = nnx.split(lm.build(args, config.dtype, 0, config.policy), nnx.Param, ...)
    loss_fn = jaxscale.autocast(lm.lm_loss, config.policy)
    model_loss = lambda p, w, loss_fn=loss_fn, graphdef=graphdef, rest=rest: (
        loss_fn(nnx.merge(graphdef, p, rest), w) * args.loss_weight
    )
    tx = make()
    state = jax.eval_shape(tx.init, params)

    def step(p, s, windows, tx=tx, model_loss=model_loss):
      if has_scaler(s):
        _, g, finite = jaxscale.value_and_grad(model_loss)(jaxscale.find_scaler(s), p, windows)
        u, s = tx.update(g, s, p, finite=finite)
      else:
        u, s = tx.update(jax.grad(model_loss)(p, windows), s, p)
      return optax.apply_updates(p, u), s

    shapes = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), params)
    n = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(shapes))
    windows = jax.ShapeDtypeStruct((args.batch, args.seq_len + 1), jnp.int32)
    rows[name] = compiled_row(step, (shapes, state, windows)) + (persistent_bytes_of((shapes, state)) / n,)
  return rows, n


def memory():
  """Compiled peak memory and compile time (lowered and compiled from shapes, never run)."""
  print("| configuration | step | persistent bytes/param | peak MB | x float32's peak | compile s | "
        "x float32's compile |")
  print("| --- | --- | --- | --- | --- | --- | --- |")
  tables = [(f"Adam alone, {10 * 4096 * c / 1e6:.0f}M params", adam_step_rows(c)) for c in (586, 2442)]
  lm_rows, n = lm_step_rows()
  tables.append((f"examples/lm.py full step, {n / 1e6:.2f}M params", lm_rows))
  for label, rows in tables:
    peak32, compile32, _ = rows["float32 Adam"]
    for name, (peak, seconds, per_param) in rows.items():
      print(f"| {name} | {label} | {per_param:.2f} | {peak / 1e6:.0f} | {peak / peak32:.2f} | {seconds:.1f} | "
            f"{seconds / compile32:.2f} |", flush=True)


def _lm_modules():
  sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples"))
  import _common
  import lm

  return lm, _common


# --- 16-bit representations of Adam's state, on the tensors that broke float16 -------------------

def _per_tensor_float16(x, u):
  """The float16 form that was refused: one power-of-two scale per tensor, largest element below
  2**15, stochastic rounding. Its scale flushes to 0 below float32's normals."""
  biggest = jnp.max(jnp.abs(x))
  _, e = jnp.frexp(biggest)
  e = jnp.where((biggest > 0) & jnp.isfinite(biggest), e - 15, 0)
  scale = jnp.ldexp(jnp.float32(1), e)
  return _rounding.stochastic_round(x / scale, jnp.float16, u).astype(jnp.float32) * scale


def _per_block_float16(block):
  """One scale per ``block`` consecutive elements (bitsandbytes' layout), scale clamped to
  float32's normals, stochastic rounding."""
  def store(x, u):
    flat, pad = x.ravel(), (-x.size) % block
    blocks = jnp.pad(flat, (0, pad)).reshape(-1, block)
    biggest = jnp.max(jnp.abs(blocks), axis=1, keepdims=True)
    _, e = jnp.frexp(biggest)
    e = jnp.where(biggest > 0, jnp.maximum(e - 15, -126), 0)
    scale = jnp.ldexp(jnp.float32(1), e)
    ub = jnp.pad(u.ravel(), (0, pad)).reshape(-1, block)
    back = _rounding.stochastic_round(blocks / scale, jnp.float16, ub).astype(jnp.float32) * scale
    return back.ravel()[: x.size].reshape(x.shape)
  return store


def _bfloat16(x, u):
  del u
  return x  # replaced below: rounded on its bits from the same uniform numbers' key


REPRESENTATIONS = {
    "float32 (reference)": None,
    "float16, one scale per tensor (before)": _per_tensor_float16,
    "float16, one scale per 256 elements": _per_block_float16(256),
    "float16, one scale per 32 elements": _per_block_float16(32),
    "bfloat16, no scale (adopted)": "bfloat16",
}


def adam_with_stored_state(store, grads, lr=1e-3, eps=1e-8):
  """float32 Adam on one tensor whose moments are stored by ``store`` after each step."""
  b1, b2 = 0.9, 0.999

  def body(carry, g):
    p, m, v, t, key = carry
    t = t + 1
    m, v = b1 * m + (1 - b1) * g, b2 * v + (1 - b2) * g * g
    p = p - lr * (m / (1 - b1**t)) / (jnp.sqrt(v / (1 - b2**t)) + eps)
    key, k1, k2 = jax.random.split(key, 3)
    if store == "bfloat16":
      # As `low_precision_state` stores a parameter's two moments: one hash per element, a half each.
      seeds = _rounding.leaf_key(jax.random.key_data(k1), _rounding.LOW_PRECISION_STATE, 0)
      first, second = _rounding.halves(_rounding.random_bits(seeds, m.shape))
      m = _rounding.to_bfloat16(m, first).astype(jnp.float32)
      v = _rounding.to_bfloat16(v, second).astype(jnp.float32)
    elif store is not None:
      m, v = store(m, jax.random.uniform(k1, m.shape)), store(v, jax.random.uniform(k2, v.shape))
    return (p, m, v, t, key), None

  zeros = jnp.zeros(grads.shape[1:], jnp.float32)
  return jax.jit(lambda gs: jax.lax.scan(body, (zeros, zeros, zeros, 0, jax.random.key(0)), gs)[0][0])(grads)


def alternatives():
  """Each 16-bit representation of Adam's moments on three probes, against float32 Adam:
  (a) gradients [10, 1e-6, 1e-3] in one tensor (second moments 1e-14 apart), 200 steps: the
  1e-6 element's distance moved over float32's; (b) a tensor whose gradients fall to 1e-34
  (an unused branch) for 800 steps: finite?; (c) 256 elements whose gradients span 1e-8..1e2
  (a layer's spread), 500 steps: the largest relative deviation of any element's distance moved."""
  rng = np.random.default_rng(0)
  g_a = jnp.asarray(np.tile([10.0, 1e-6, 1e-3], (200, 1)) * (1 + 0.1 * rng.standard_normal((200, 3))), jnp.float32)
  g_b = jnp.concatenate(
      [jnp.asarray(rng.standard_normal((10, 64)), jnp.float32), jnp.full((800, 64), 1e-34, jnp.float32)]
  )
  spread = 10.0 ** rng.uniform(-8, 2, 256)
  g_c = jnp.asarray(spread * (1 + 0.3 * rng.standard_normal((500, 256))), jnp.float32)
  ref = {k: np.asarray(adam_with_stored_state(None, g), np.float64) for k, g in (("a", g_a), ("b", g_b), ("c", g_c))}
  print("| representation | (a) 1e-6 element moved / float32 | (b) finite after the decay | "
        "(c) worst element moved / float32 |")
  print("| --- | --- | --- | --- |")
  for name, store in REPRESENTATIONS.items():
    a = np.asarray(adam_with_stored_state(store, g_a), np.float64)
    b = np.asarray(adam_with_stored_state(store, g_b), np.float64)
    c = np.asarray(adam_with_stored_state(store, g_c), np.float64)
    worst = np.max(np.abs(c / ref["c"] - 1))
    finite = "yes" if np.all(np.isfinite(b)) else "**NaN**"
    print(f"| {name} | {a[1] / ref['a'][1]:.3f} | {finite} | {worst:.3g} |", flush=True)


# --- examples/lm.py's Transformer over seeds ------------------------------------------------------

LM_STEPS, LM_WIDTH, LM_INIT_SCALE = 300, 64, 2.0**23


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
      "SR + bfloat16 state": (
          float16, lambda: jaxscale.master_weights(scaled(bf16_state), method="stochastic_rounding")
      ),
  }


def lm_quality(steps=LM_STEPS, width=LM_WIDTH, only=None):
  lm, _common = _lm_modules()
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
      # Functional, on the nnx.State of the parameters: the step of the gradient-site contract
      # (jaxscale.value_and_grad with the optimizer's scaler, then update).
      graphdef, params, rest = nnx.split(model, nnx.Param, ...)
      tx = make()
      loss_fn = jaxscale.autocast(lm.lm_loss, config.policy)
      model_loss = lambda p, windows, loss_fn=loss_fn, graphdef=graphdef, rest=rest: (
          loss_fn(nnx.merge(graphdef, p, rest), windows)
      )
      weighted = lambda p, windows, model_loss=model_loss: model_loss(p, windows) * args.loss_weight

      def step(params, opt_state, windows, tx=tx, weighted=weighted):
        # True gradients from the gradient site (float32 for the 16-bit parameters).
        _, grads, finite = jaxscale.value_and_grad(weighted)(jaxscale.find_scaler(opt_state), params, windows)
        updates, opt_state = tx.update(grads, opt_state, params, finite=finite)
        return optax.apply_updates(params, updates), opt_state

      step = jax.jit(step, donate_argnums=(0, 1))
      opt_state = tx.init(params)
      rng = np.random.default_rng(seed)  # the example's data order for this seed
      for _ in range(steps):
        params, opt_state = step(params, opt_state, lm.sample_windows(train_data, rng, args.batch, args.seq_len))
      eval_loss = jax.jit(model_loss)
      losses.append(float(np.mean([eval_loss(params, w) for w in eval_windows])))
      try:
        skipped = f"{int(jaxscale.metrics(opt_state)['skipped_steps'])} skipped steps"
      except FloatingPointError:  # the scale reached its floor: the run stalled, and says so
        skipped = "stalled at the scale's floor"
      print(f"  {name}, seed {seed}: {losses[-1]:.4f} ({skipped}, {time.process_time() - start:.0f} CPU-s so far)",
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
    params = {"w": jnp.zeros((512, 256)), "b": jnp.zeros(256)}
    for name, b in bytes_table(params).items():
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
