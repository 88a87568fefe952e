"""Step time, compile time and memory of jaxscale against plain optax and its peers.

Every variant of a configuration is compiled in this one process and timed in
interleaved rounds (A B C A B C ...), so machine noise hits all alike; the
table reports medians and each median's ratio to the plain optimizer's.

    python benchmarks/bench.py --quick          # a few minutes on 2 CPU cores
    python benchmarks/bench.py                  # the full sweep (tens of minutes on 2 cores)

Writes docs/benchmarks.json (the rows and how they were made), and from it docs/benchmarks.md and
docs/benchmarks.png; `--replot docs/benchmarks.json` rewrites the last two from the first.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import platform
import re
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

import jaxscale

OPTIMIZERS = {
    "adam": lambda: optax.adam(1e-3),
    "adamw": lambda: optax.adamw(1e-3, weight_decay=0.1),
    "sgd_momentum": lambda: optax.sgd(1e-2, momentum=0.9),
    "lion": lambda: optax.lion(1e-4),
}
# The nearest keras 3 equivalents (keras's Adam adds epsilon before the bias correction).
KERAS_OPTIMIZERS = {
    "adam": lambda keras: keras.optimizers.Adam(1e-3, epsilon=1e-8),
    "adamw": lambda keras: keras.optimizers.AdamW(1e-3, weight_decay=0.1, epsilon=1e-8),
    "sgd_momentum": lambda keras: keras.optimizers.SGD(1e-2, momentum=0.9),
    "lion": lambda keras: keras.optimizers.Lion(1e-4, weight_decay=1e-3),  # optax.lion's default decay
}
SCALE = 2.0**15


# ---------------------------------------------------------------- variants
# Each variant maps an optimizer name to (init(params), step(params, state, grads)),
# where grads are the gradients of the *scaled* loss, except for the UNSCALED variants.


def optax_variant(tx):
  def step(params, state, grads):
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  return tx.init, step


def plain(opt):
  return optax_variant(OPTIMIZERS[opt]())


def jaxscale_wrapper(opt):
  """The optimizer step given scaled gradients: the gradient site's unscale and check
  (`jaxscale.unscale_and_check`, what `jaxscale.value_and_grad` does after its grad), then the
  wrapper's update on the true gradients, which checks them again and ANDs the flag."""
  tx = jaxscale.dynamic_loss_scaling(OPTIMIZERS[opt](), init_scale=SCALE)

  def step(params, state, grads):
    grads, finite = jaxscale.unscale_and_check(jaxscale.find_scaler(state), grads)
    updates, state = tx.update(grads, state, params, finite=finite)
    return optax.apply_updates(params, updates), state

  return tx.init, step


def jaxscale_train_step(opt, loss_fn):
  """jaxscale's whole training step, as its README writes it: `jaxscale.value_and_grad`, then
  the wrapper's update with the flag."""
  tx = jaxscale.dynamic_loss_scaling(OPTIMIZERS[opt](), init_scale=SCALE)

  def step(params, state, *batch):
    _, grads, finite = jaxscale.value_and_grad(loss_fn)(jaxscale.find_scaler(state), params, *batch)
    updates, state = tx.update(grads, state, params, finite=finite)
    return optax.apply_updates(params, updates), state

  return step


def jmp_apply_if_finite(opt):
  """jmp's DynamicLossScale for the scale, optax.apply_if_finite for the skip."""
  import jmp

  tx = optax.apply_if_finite(OPTIMIZERS[opt](), max_consecutive_errors=10**9)

  # The state holds jmp's arrays, not the object: its hand-written unflatten
  # rejects the placeholders `jit(...).lower` passes through it.
  def init(params):
    return (jnp.float32(SCALE), jnp.int32(0)), tx.init(params)

  def step(params, state, grads):
    (scale, counter), opt_state = state
    loss_scale = jmp.DynamicLossScale(scale, counter)
    grads = loss_scale.unscale(grads)
    finite = jmp.all_finite(grads)
    updates, opt_state = tx.update(grads, opt_state, params)
    loss_scale = loss_scale.adjust(finite)
    return optax.apply_updates(params, updates), ((loss_scale.loss_scale, loss_scale.counter), opt_state)

  return init, step


def flax_dynamic_scale(opt):
  """The pattern of flax.training.dynamic_scale.DynamicScale: tree_map where over params and state."""
  from flax.training import dynamic_scale

  inner = OPTIMIZERS[opt]()

  def init(params):
    return dynamic_scale.DynamicScale(scale=jnp.float32(SCALE)), inner.init(params)

  def step(params, state, grads):
    scale, opt_state = state
    # DynamicScale.value_and_grad does this after its grad: unscale, check, adjust.
    grads = jax.tree.map(lambda g: g / scale.scale, grads)
    finite = jnp.all(jnp.array([jnp.all(jnp.isfinite(g)) for g in jax.tree.leaves(grads)]))
    grow = scale.fin_steps == scale.growth_interval
    grown = jnp.minimum(scale.scale * scale.growth_factor, jnp.finfo(jnp.float32).max)
    fin_scale = jnp.where(grow & finite, grown, scale.scale)
    new_scale = scale.replace(
        fin_steps=jnp.where(grow | ~finite, 0, scale.fin_steps + 1),
        scale=jnp.where(finite, fin_scale, scale.scale * scale.backoff_factor),
    )
    updates, new_opt_state = inner.update(grads, opt_state, params)
    new_params = optax.apply_updates(params, updates)
    select = lambda new, old: jax.tree.map(functools.partial(jnp.where, finite), new, old)
    return select(new_params, params), (new_scale, select(new_opt_state, opt_state))

  return init, step


def mpx_optimizer_update(opt):
  """mpx, the Equinox peer: what `mpx.filter_value_and_grad` does after its gradient (check, adjust,
  unscale), then `mpx.optimizer_update` (the Optax step, then a select over parameters and state)."""
  import mpx

  inner = OPTIMIZERS[opt]()

  # The state holds mpx's arrays; its `period` and `factor` stay Python ints, static as under
  # `eqx.filter_jit`.
  def init(params):
    return (jnp.float32(SCALE), jnp.int32(0)), inner.init(params)

  def step(params, state, grads):
    (scale, counter), opt_state = state
    scaling = mpx.DynamicLossScaling(scale, jnp.float32(1.0), counter=counter)
    finite = mpx.all_finite(grads)
    scaling = scaling.adjust(finite)
    params, opt_state = mpx.optimizer_update(params, inner, opt_state, scaling.unscale(grads), finite)
    return params, ((scaling.loss_scaling, scaling.counter), opt_state)

  return init, step


def mpx_train_step(opt, loss_fn):
  """mpx's whole training step: `mpx.filter_value_and_grad` (which casts the parameters to
  float16 and scales, differentiates, checks, adjusts and unscales), then `mpx.optimizer_update`."""
  import mpx

  inner = OPTIMIZERS[opt]()

  def step(params, state, *batch):
    (scale, counter), opt_state = state
    scaling = mpx.DynamicLossScaling(scale, jnp.float32(1.0), counter=counter)
    _, scaling, finite, grads = mpx.filter_value_and_grad(lambda p: loss_fn(p, *batch), scaling)(params)
    params, opt_state = mpx.optimizer_update(params, inner, opt_state, grads, finite)
    return params, ((scaling.loss_scaling, scaling.counter), opt_state)

  return step


@functools.cache
def import_keras():
  """keras 3 on the JAX backend, or None where it cannot be imported."""
  os.environ["KERAS_BACKEND"] = "jax"  # keras reads it once, at its first import
  try:
    import keras
  except ImportError:
    return None
  return keras if keras.backend.backend() == "jax" else None


def keras_variant(opt, loss_scale):
  """The keras twin of `opt`, alone or in keras's LossScaleOptimizer, through `stateless_apply`.

  The state is the optimizer's variables as arrays, by path.
  """
  keras = import_keras()
  tx = KERAS_OPTIMIZERS[opt](keras)
  if loss_scale:  # halves on an overflow, doubles after 2000 finite steps, like the others
    tx = keras.optimizers.LossScaleOptimizer(tx, initial_scale=SCALE, name="loss_scale")

  def init(params):
    tx.build([keras.Variable(p) for p in jax.tree.leaves(params)])
    return {v.path: v.value for v in tx.variables}

  def step(params, state, grads):
    paths = [v.path for v in tx.variables]
    leaves, treedef = jax.tree.flatten(params)
    leaves, values = tx.stateless_apply([state[p] for p in paths], jax.tree.leaves(grads), leaves)
    return treedef.unflatten(leaves), dict(zip(paths, values))

  return init, step


# ---------------------------------------------------------------- skip mechanisms
# jaxscale's wrapper with another way to skip a step in place of its select on the inner update's
# outputs (`_skip.update_or_keep`), swapped in while the step is traced: everything else (the
# unscale, the check, the scaler's update) is the library's, so the rows differ only in the skip.


def skip_by_cond(finite, update, updates, inner_state, params):
  """A `lax.cond` around the inner update (Keras's and optax.apply_if_finite's mechanism)."""
  new_updates, new_state = jax.eval_shape(update, updates, inner_state, params)

  def keep(updates, inner_state, params):
    del updates, params
    return (jax.tree.map(lambda u: jnp.full(u.shape, -0.0, u.dtype), new_updates),
            jax.tree.map(lambda old, new: old.astype(new.dtype), inner_state, new_state))

  return jax.lax.cond(finite, update, keep, updates, inner_state, params)


def skip_where_produced(finite, update, updates, inner_state, params):
  """jaxscale 0.x's mechanism, kept here only to be timed: the inner update re-evaluated from its
  jaxpr, each new state leaf selected the moment it is produced (JAX internals: `jax.extend.core`,
  each equation's context). No derivative gates: timing only."""
  from jax.extend import core as jex_core

  closed, out_shape = jax.make_jaxpr(update, return_shape=True)(updates, inner_state, params)
  n_updates = len(jax.tree.leaves(out_shape[0]))
  state_vars = closed.jaxpr.outvars[n_updates:]
  produced = {v for eqn in closed.jaxpr.eqns for v in eqn.outvars}
  old = {v: o for v, o in zip(state_vars, jax.tree.leaves(inner_state)) if v in produced and state_vars.count(v) == 1}
  env = dict(zip(closed.jaxpr.constvars, closed.consts))
  env.update(zip(closed.jaxpr.invars, jax.tree.leaves((updates, inner_state, params))))
  read = lambda v: v.val if isinstance(v, jex_core.Literal) else env[v]
  for eqn in closed.jaxpr.eqns:
    with eqn.ctx.manager:
      outs = eqn.primitive.bind(*map(read, eqn.invars), **eqn.primitive.get_bind_params(eqn.params))
    for v, x in zip(eqn.outvars, outs if eqn.primitive.multiple_results else [outs]):
      env[v] = jnp.where(finite, x, old[v]) if v in old else x
  outs = [read(v) for v in closed.jaxpr.outvars]
  new_updates = [jnp.where(finite, u, jnp.asarray(-0.0, u.dtype)) for u in outs[:n_updates]]
  new_state = [x if isinstance(v, jex_core.Var) and v in old else jnp.where(finite, x, o)
               for v, x, o in zip(state_vars, outs[n_updates:], jax.tree.leaves(inner_state))]
  return jax.tree.unflatten(jax.tree.structure(out_shape), new_updates + new_state)


def jaxscale_swapping(module_name, attribute, replacement):
  """jaxscale's wrapper with one private function of the library swapped for ``replacement`` while
  the step is traced: everything else is the library's, so the rows differ only in that piece."""

  def variant(opt):
    init, step = jaxscale_wrapper(opt)

    def traced_with_swap(*args):
      import importlib

      module = importlib.import_module(f"jaxscale.{module_name}")
      library = getattr(module, attribute)
      setattr(module, attribute, replacement)
      try:
        return step(*args)
      finally:
        setattr(module, attribute, library)

    return init, traced_with_swap

  return variant


def jaxscale_skipping_by(skip):
  return jaxscale_swapping("_skip", "update_or_keep", skip)


# ---------------------------------------------------------------- finite checks
# jaxscale with another form of its finite check (`_scaler.all_finite`, which the gradient site and
# the wrapper share), swapped in while the step is traced.


def check_by_isfinite_all(tree, *, axis_name=None):
  """jmp's and optax.apply_if_finite's form: `isfinite(g).all()` per leaf, stacked, then all."""
  from jaxscale import _tree

  flags = [jnp.isfinite(g).all() for g in jax.tree.leaves(tree) if _tree.is_floating(g)]
  finite = jnp.stack(flags).all() if flags else jnp.asarray(True)
  if axis_name is not None:
    finite = jax.lax.pmin(finite.astype(jnp.int32), axis_name).astype(jnp.bool_)
  return finite


def check_by_stacked_sums(tree, *, axis_name=None):
  """The library's `g - g` sums, stacked and summed at once instead of added up in a chain."""
  from jaxscale import _tree

  sums = [jnp.sum(g - g).astype(jnp.float32) for g in jax.tree.leaves(tree) if _tree.is_floating(g)]
  finite = jnp.isfinite(jnp.stack(sums).sum()) if sums else jnp.asarray(True)
  if axis_name is not None:
    finite = jax.lax.pmin(finite.astype(jnp.int32), axis_name).astype(jnp.bool_)
  return finite


def jaxscale_checking_by(check):
  return jaxscale_swapping("_scaler", "all_finite", check)


# Name -> builder. A new peer is one more line here (and, if it steps on the true gradients, in
# UNSCALED; if it needs an optional library, a guard in its builder).
VARIANTS = {
    "plain": plain,
    "jaxscale": jaxscale_wrapper,  # skips by a select on the inner update's outputs
    "jaxscale, skip by cond": jaxscale_skipping_by(skip_by_cond),
    "jaxscale, skip where produced": jaxscale_skipping_by(skip_where_produced),
    "jaxscale, check isfinite-all": jaxscale_checking_by(check_by_isfinite_all),
    "jaxscale, check stacked sums": jaxscale_checking_by(check_by_stacked_sums),
    "jmp+apply_if_finite": jmp_apply_if_finite,
    "flax DynamicScale": flax_dynamic_scale,
    "plain keras": functools.partial(keras_variant, loss_scale=False),
    "keras LossScaleOptimizer": functools.partial(keras_variant, loss_scale=True),
    "mpx": mpx_optimizer_update,
}
# Variants that run their own training step, from the loss.
TRAIN_STEPS = {"jaxscale": jaxscale_train_step, "mpx": mpx_train_step}
UNSCALED = ("plain", "plain keras")  # stepped on the true gradients
KERAS_VARIANTS = ("plain keras", "keras LossScaleOptimizer")


# ---------------------------------------------------------------- the problems


def leaf_shapes(n_params: int, n_leaves: int) -> list[tuple[int, ...]]:
  per_leaf = max(1, n_params // n_leaves)
  return [(per_leaf,)] * n_leaves


def optimizer_problem(n_params, n_leaves, seed=0):
  keys = jax.random.split(jax.random.key(seed), 2 * n_leaves)
  shapes = leaf_shapes(n_params, n_leaves)
  params = [jax.random.normal(k, s) * 0.02 for k, s in zip(keys[:n_leaves], shapes)]
  grads = [jax.random.normal(k, s) * 1e-3 * SCALE for k, s in zip(keys[n_leaves:], shapes)]
  return params, grads


def lm_init(key, *, vocab, width, depth, seq_len):
  """A small pre-LayerNorm decoder-only Transformer, float32 master parameters."""
  keys = iter(jax.random.split(key, 4 + 6 * depth))
  dense = lambda i, o: jax.random.normal(next(keys), (i, o)) * (i**-0.5)
  params = {"embed": jax.random.normal(next(keys), (vocab, width)) * 0.02,
            "pos": jax.random.normal(next(keys), (seq_len, width)) * 0.02, "layers": []}
  for _ in range(depth):
    params["layers"].append({
        "ln1": jnp.ones(width), "qkv": dense(width, 3 * width), "proj": dense(width, width),
        "ln2": jnp.ones(width), "up": dense(width, 4 * width), "down": dense(4 * width, width),
    })
  params["ln_f"] = jnp.ones(width)
  return params


def lm_loss(params, tokens, *, heads):
  """Next-token cross-entropy with float16 compute (the parameters are cast at use)."""
  p = jax.tree.map(lambda x: x.astype(jnp.float16), params)
  x = p["embed"][tokens[:, :-1]] + p["pos"][: tokens.shape[1] - 1]
  t = x.shape[1]
  mask = jnp.tril(jnp.ones((t, t), bool))

  def norm(x, g):
    x32 = x.astype(jnp.float32)
    x32 = (x32 - x32.mean(-1, keepdims=True)) * jax.lax.rsqrt(x32.var(-1, keepdims=True) + 1e-5)
    return x32.astype(x.dtype) * g

  for layer in p["layers"]:
    q, k, v = jnp.split(norm(x, layer["ln1"]) @ layer["qkv"], 3, axis=-1)
    split = lambda y: y.reshape(*y.shape[:2], heads, -1)
    att = jnp.einsum("bqhd,bkhd->bhqk", split(q), split(k)) / np.sqrt(q.shape[-1] // heads).astype(np.float16)
    att = jax.nn.softmax(jnp.where(mask, att.astype(jnp.float32), -1e9), -1).astype(x.dtype)
    x = x + jnp.einsum("bhqk,bkhd->bqhd", att, split(v)).reshape(x.shape) @ layer["proj"]
    x = x + jax.nn.gelu(norm(x, layer["ln2"]) @ layer["up"]) @ layer["down"]
  logits = (norm(x, p["ln_f"]) @ p["embed"].T).astype(jnp.float32)
  return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()


def mlp_init(key, *, width, depth):
  """A tanh MLP of `depth` square layers, float32."""
  keys = jax.random.split(key, depth)
  return [{"w": jax.random.normal(k, (width, width)) * width**-0.5, "b": jnp.zeros(width)} for k in keys]


def mlp_loss(params, x, y):
  """Mean squared error of a float32 tanh MLP: the full step of a plain float32 model."""
  for layer in params:
    x = jnp.tanh(x @ layer["w"] + layer["b"])
  return jnp.mean((x - y) ** 2)


def train_step(variant_step, scaled, loss_fn):
  """Forward, backward (of the scaled loss for the scaled variants) and update."""

  def step(params, state, *batch):
    scale = _current_scale(state) if scaled else 1.0
    grads = jax.grad(lambda p: loss_fn(p, *batch) * scale)(params)
    return variant_step(params, state, grads)

  return step


def _current_scale(state):
  """The loss scale held by any scaled variant's state."""
  if isinstance(state, jaxscale.DynamicLossScalingState):
    return state.scaler.scale
  if isinstance(state, dict):  # keras's variables by path
    return state["loss_scale/dynamic_scale"]
  return state[0][0] if isinstance(state[0], tuple) else state[0].scale  # jmp's arrays, or Flax's


# ---------------------------------------------------------------- measuring


def peak_bytes(compiled) -> int:
  """The footprint of one call, from XLA's analysis of the compiled executable.

  Not `memory_stats()["peak_bytes_in_use"]` where a device reports it: that is the
  process's high-water mark, which every variant of a configuration shares here.
  """
  m = compiled.memory_analysis()
  # Donated arguments alias outputs: count arguments, outputs not aliased, temporaries.
  return int(m.argument_size_in_bytes + m.output_size_in_bytes - m.alias_size_in_bytes + m.temp_size_in_bytes)


def measure(config, builders, reps, *, round_s=0.02):
  """Compiles every variant, then times them in interleaved rounds.

  A round of a variant is ``steps`` calls dispatched back to back, each on the
  last one's outputs, and one wait at the end: what a training loop does. One
  call waited on alone would add the host's dispatch of every array to the
  device's time, which on a GPU is most of a millisecond and grows with the
  number of arrays, not with the work (benchmarks/NOTES.md). ``steps`` is
  the same for every variant of a configuration: enough plain steps to fill
  ``round_s`` seconds (1 for a step that already takes that long).
  """
  runs = {}
  for name, build in builders.items():
    params, state, args, step = build()
    fn = jax.jit(step, donate_argnums=(0, 1))
    t0 = time.perf_counter()
    compiled = fn.lower(params, state, *args).compile()
    compile_s = time.perf_counter() - t0
    text = compiled.as_text()
    runs[name] = dict(compiled=compiled, params=params, state=state, args=args, compile_s=compile_s,
                      copies=len(re.findall(r"= \S+ copy\(", text)), memory=peak_bytes(compiled), times=[])

  def timed(run, steps):
    t0 = time.perf_counter()
    for _ in range(steps):
      run["params"], run["state"] = run["compiled"](run["params"], run["state"], *run["args"])
    jax.block_until_ready((run["params"], run["state"]))
    return (time.perf_counter() - t0) / steps

  for _ in range(2):  # warm-up rounds
    warm = {name: timed(run, 1) for name, run in runs.items()}
  steps = int(np.clip(round(round_s / warm["plain"]), 1, 100))
  for _ in range(reps):
    for run in runs.values():
      run["times"].append(timed(run, steps))
  print(f"  ({reps} rounds of {steps} step{'s' if steps > 1 else ''} each)", flush=True)
  base = runs["plain"]
  rows = []
  for name, run in runs.items():
    ms = float(np.median(run["times"])) * 1e3
    # Each round's ratio to the plain step of the same round: their quartiles show the noise.
    round_ratios = np.asarray(run["times"]) / np.asarray(base["times"])
    rows.append(dict(config, variant=name, ms=ms, ratio=ms / (np.median(base["times"]) * 1e3),
                     ratio_q1=float(np.percentile(round_ratios, 25)), ratio_q3=float(np.percentile(round_ratios, 75)),
                     compile_s=run["compile_s"], compile_ratio=run["compile_s"] / base["compile_s"],
                     memory_mb=run["memory"] / 2**20, memory_ratio=run["memory"] / base["memory"],
                     copies=run["copies"], steps=steps))
    print(f"  {name:24s} {ms:8.2f} ms  x{rows[-1]['ratio']:.2f} ({rows[-1]['ratio_q1']:.2f}-{rows[-1]['ratio_q3']:.2f})"
          f"  compile {run['compile_s']:.2f}s (x{rows[-1]['compile_ratio']:.2f})"
          f"  mem x{rows[-1]['memory_ratio']:.3f}  copies {run['copies']}", flush=True)
  del runs
  return rows


def optimizer_builders(opt, n_params, n_leaves, variants):
  def build(variant):
    init, step = VARIANTS[variant](opt)
    params, grads = optimizer_problem(n_params, n_leaves)
    if variant in UNSCALED:  # the true gradients
      grads = [g / SCALE for g in grads]
    return params, init(params), (grads,), step

  return {v: functools.partial(build, v) for v in variants}


def lm_builders(opt, width, depth, variants, *, seq_len=128, batch=8, heads=4):
  params = lambda: lm_init(jax.random.key(0), vocab=256, width=width, depth=depth, seq_len=seq_len)
  tokens = jax.random.randint(jax.random.key(1), (batch, seq_len), 0, 256)
  return train_builders(opt, variants, params, functools.partial(lm_loss, heads=heads), (tokens,))


def mlp_builders(opt, width, depth, variants, *, batch=128):
  params = lambda: mlp_init(jax.random.key(0), width=width, depth=depth)
  x, y = jax.random.normal(jax.random.key(1), (2, batch, width))
  return train_builders(opt, variants, params, mlp_loss, (x, y))


def train_builders(opt, variants, make_params, loss_fn, batch):
  def build(variant):
    init, step = VARIANTS[variant](opt)
    params = make_params()
    if variant in TRAIN_STEPS:
      return params, init(params), batch, TRAIN_STEPS[variant](opt, loss_fn)
    return params, init(params), batch, train_step(step, variant not in UNSCALED, loss_fn)

  return {v: functools.partial(build, v) for v in variants}


# ---------------------------------------------------------------- reporting


def device_name() -> str:
  """The accelerator's kind (``NVIDIA H100 80GB HBM3``), or the CPU's model and core count."""
  device = jax.devices()[0]
  if device.platform != "cpu":
    return f"{device.platform.upper()}: {device.device_kind}"
  try:
    with open("/proc/cpuinfo") as f:
      names = re.findall(r"model name\s*:\s*(.*)", f.read())
    name = f"{names[0]} ({len(names)} cores)" if names else platform.processor()
  except OSError:
    name = platform.processor()
  return f"CPU: {name}"


def run_info(args) -> dict:
  """What produced the rows: the command, the versions and the device."""
  keras = import_keras()
  return dict(command="python benchmarks/bench.py" + (" --quick" if args.quick else ""), reps=args.reps,
              jax=jax.__version__, optax=optax.__version__, keras=keras.__version__ if keras else None,
              device=device_name(), platform=jax.devices()[0].platform)


def write_data(rows, info, path):
  """The rows and how they were made, as JSON: what `--replot` reads back."""
  with open(path, "w") as f:
    json.dump(dict(info, rows=rows), f, indent=1)
    f.write("\n")


def read_data(path):
  with open(path) as f:
    data = json.load(f)
  return data.pop("rows"), data


def write_markdown(rows, info, path):
  quick = " (quick configurations)" if "--quick" in info["command"] else ""
  lines = [
      f"# Benchmarks on {info['device'].split(': ', 1)[-1]}{quick}",
      "",
      f"Generated by `{info['command']}` (jax {info['jax']}, optax {info['optax']}) on **{info['device']}**."
      + (" No GPU was available for these figures." if info["platform"] == "cpu" else "")
      + f" The rows as data: [{os.path.basename(os.path.splitext(path)[0])}.json]"
      f"({os.path.basename(os.path.splitext(path)[0])}.json).",
      "",
      "Each configuration's variants were compiled in one process and timed in interleaved rounds "
      f"({info['reps']} rounds, medians; a round is as many steps dispatched back to back as fill "
      "20 ms of the plain step, then one wait, as a training loop runs). "
      "Ratios are to the plain optax optimizer on the true gradients; "
      "parameters and optimizer state are donated. The quartiles are those of each round's ratio "
      "to the plain step of the same round: how far this machine's noise moves a ratio. "
      "*copies* counts `copy` instructions in the "
      "optimized HLO (a copy of a donated buffer is an extra pass and an extra buffer). Memory "
      "is the compiled executable's footprint (arguments + non-aliased outputs + temporaries, "
      "from `compiled.memory_analysis()`; a device's `memory_stats()` peak is the process's, "
      "shared by every variant).",
      "",
      *skip_text(rows),
      *keras_text(rows, info),
      *missing_text(rows),
      "| problem | optimizer | params | leaves | variant | step ms | step ratio | rounds' ratios, quartiles "
      "| compile s | compile ratio | memory ratio | copies |",
      "| --- | --- | ---: | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
  ]
  for r in rows:
    lines.append(
        f"| {r['problem']} | {r['opt']} | {r['params']/1e6:.1f}M | {r['leaves']} | {r['variant']} | "
        f"{r['ms']:.2f} | {r['ratio']:.2f} | {r['ratio_q1']:.2f}-{r['ratio_q3']:.2f} | "
        f"{r['compile_s']:.2f} | {r['compile_ratio']:.2f} | {r['memory_ratio']:.3f} | {r['copies']} |"
    )
  lines += keras_table(rows)
  with open(path, "w") as f:
    f.write("\n".join(lines) + "\n")


def skip_text(rows):
  """What the `jaxscale, skip ...` rows are."""
  if not any(r["variant"].startswith("jaxscale, skip") for r in rows):
    return []
  return ["The *jaxscale, skip ...* rows are jaxscale with another way to skip a step in place of "
          "its select on the inner update's outputs: a `lax.cond` around the inner update, or the "
          "select where each state leaf is produced (jaxscale's earlier mechanism, a jaxpr "
          "interpreter kept in `bench.py` only); everything else is the library's "
          "([performance](performance.md#how-a-step-is-skipped)).", ""]


def keras_text(rows, info):
  """What the keras rows are, or why there are none."""
  if not any(r["variant"] in KERAS_VARIANTS for r in rows):
    return ["Keras 3's `LossScaleOptimizer` is not included: keras 3 with the JAX backend could not "
            "be imported (`pip install keras`, an optional `bench` dependency).", ""]
  return [
      f"Keras 3's `LossScaleOptimizer` (keras {info['keras']}, JAX backend) runs through "
      "its `stateless_apply` in the same donated `jax.jit` step, with `initial_scale=2**15` so it "
      "unscales by the same scale as the others (it also halves on an overflow and doubles after "
      "2000 finite steps), and skips with an `ops.cond` (a `lax.cond`) around the whole update. "
      "It wraps the nearest keras optimizer (`Adam`, `AdamW`, `SGD` with momentum, `Lion`, with "
      "optax's hyperparameters; keras's Adam adds epsilon before the bias correction). Its ratios "
      "in the main table are to plain **optax**, like every row's, so they include the difference "
      "between keras's optimizer and optax's: the *plain keras* row is that keras optimizer "
      "alone on the true gradients, and the second table gives `LossScaleOptimizer` relative to "
      "*plain keras*, the cost of its loss scaling alone.",
      "",
  ]


def missing_text(rows):
  """Which variants some configurations leave out (the sweep's choice, explained in the docs)."""
  config = lambda r: (r["problem"], r["opt"], r["params"], r["leaves"])
  run = {(*config(r), r["variant"]) for r in rows}
  configs = list(dict.fromkeys(config(r) for r in rows))
  left_out = {}  # the configurations a variant misses -> the variants that miss exactly those
  for v in dict.fromkeys(r["variant"] for r in rows):
    missing = tuple(c for c in configs if (*c, v) not in run)
    if missing:
      left_out.setdefault(missing, []).append(f"*{v}*")
  lines = []
  for missing, variants in left_out.items():
    names = ", ".join(variants[:-1]) + " and " + variants[-1] if len(variants) > 1 else variants[0]
    where = ", ".join(f"{p} {o} {n / 1e6:.3g}M/{leaves}" for p, o, n, leaves in missing)
    lines.append(f"{names} {'are' if len(variants) > 1 else 'is'} not run at {where} "
                 "([why](performance.md#what-the-sweep-leaves-out)).")
  return [" ".join(lines), ""] if lines else []


def keras_table(rows):
  """`keras LossScaleOptimizer` relative to `plain keras`, per configuration."""
  config = lambda r: (r["problem"], r["opt"], r["params"], r["leaves"])
  bases = {config(r): r for r in rows if r["variant"] == "plain keras"}
  lines = [
      f"| {r['problem']} | {r['opt']} | {r['params']/1e6:.1f}M | {r['leaves']} | {r['ms'] / b['ms']:.2f} | "
      f"{r['compile_s'] / b['compile_s']:.2f} | {r['memory_ratio'] / b['memory_ratio']:.3f} | "
      f"{b['copies']} -> {r['copies']} |"
      for r in rows if r["variant"] == "keras LossScaleOptimizer" and (b := bases.get(config(r)))
  ]
  if not lines:
    return []
  return [
      "",
      "`keras LossScaleOptimizer` relative to `plain keras` (the same keras optimizer, no loss scaling):",
      "",
      "| problem | optimizer | params | leaves | step ratio | compile ratio | memory ratio | copies |",
      "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |",
      *lines,
  ]


def write_chart(rows, path, device=None):
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  configs = list(dict.fromkeys((r["problem"], r["opt"], r["params"], r["leaves"]) for r in rows))
  variants = [v for v in VARIANTS if v != "plain" and any(r["variant"] == v for r in rows)]
  fig, ax = plt.subplots(figsize=(max(6, 1.1 * len(configs)), 4))
  width = 0.8 / len(variants)
  for i, v in enumerate(variants):
    found = [next((r for r in rows
                   if (r["problem"], r["opt"], r["params"], r["leaves"]) == c and r["variant"] == v), None)
             for c in configs]
    ys = [r["ratio"] if r else np.nan for r in found]
    spread = [[r["ratio"] - r["ratio_q1"] if r else 0 for r in found],
              [r["ratio_q3"] - r["ratio"] if r else 0 for r in found]]
    ax.bar(np.arange(len(configs)) + i * width, ys, width, yerr=np.clip(spread, 0, None), error_kw=dict(lw=0.6),
           label=v)
  ax.axhline(1.0, color="k", lw=0.8)
  ax.set_xticks(np.arange(len(configs)) + 0.4 - width / 2)
  ax.set_xticklabels([f"{p}\n{o}\n{n/1e6:.3g}M/{leaves}" for p, o, n, leaves in configs], fontsize=7)
  ax.set_ylabel("step time / plain optax optimizer")
  ax.set_title(f"Loss scaling overhead, {device or device_name()}", fontsize=9)
  ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1), borderaxespad=0)  # beside the bars, never on them
  fig.tight_layout()
  fig.savefig(path, dpi=120)


def main():
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--quick", action="store_true", help="a few configurations, in a few minutes")
  parser.add_argument("--reps", type=int, default=None, help="timed rounds per configuration")
  parser.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "docs"))
  parser.add_argument("--replot", metavar="DATA.json",
                      help="rewrite the table and chart of rows this script wrote (its .json), beside them")
  args = parser.parse_args()
  if args.replot:
    rows, info = read_data(args.replot)
    stem = os.path.splitext(args.replot)[0]
    write_markdown(rows, info, stem + ".md")
    write_chart(rows, stem + ".png", info["device"])
    return
  args.reps = args.reps or (7 if args.quick else 15)
  all_variants = [v for v in VARIANTS if import_keras() or v not in KERAS_VARIANTS]
  if not import_keras():
    print("keras 3 with the JAX backend is not importable: skipping", ", ".join(KERAS_VARIANTS), flush=True)

  if args.quick:
    opt_configs = [("adam", 8_000_000, 48, all_variants), ("adam", 32_000_000, 48, all_variants)]
    lm_configs = [("adam", 128, 2)]
    mlp_configs = [("adam", 1024, 6)]
  else:
    opt_configs = (
        [(o, 8_000_000, 48, all_variants) for o in OPTIMIZERS]
        + [("adam", n, 48, all_variants) for n in (1_000_000, 32_000_000, 100_000_000)]
        + [("adam", 8_000_000, 10, all_variants)]
        # The Flax pattern's compile at 1000 leaves does not finish in 2 minutes: left out there.
        + [("adam", 8_000_000, 1000, [v for v in all_variants if v != "flax DynamicScale"])]
    )
    lm_configs = [("adam", 256, 4), ("adamw", 512, 6)]
    mlp_configs = [("adam", 1024, 6)]

  rows = []
  for opt, n, leaves, variants in opt_configs:
    print(f"optimizer step: {opt}, {n/1e6:.0f}M params, {leaves} leaves", flush=True)
    config = dict(problem="optimizer step", opt=opt, params=n, leaves=leaves)
    rows += measure(config, optimizer_builders(opt, n, leaves, variants), args.reps)
  for opt, width, depth in lm_configs:
    shapes = jax.eval_shape(lambda: lm_init(jax.random.key(0), vocab=256, width=width, depth=depth, seq_len=128))
    n = sum(x.size for x in jax.tree.leaves(shapes))
    print(f"fp16 LM train step: {opt}, width {width}, depth {depth}: {n/1e6:.1f}M params", flush=True)
    config = dict(problem="fp16 LM step", opt=opt, params=n, leaves=len(jax.tree.leaves(shapes)))
    rows += measure(config, lm_builders(opt, width, depth, all_variants), args.reps)

  for opt, width, depth in mlp_configs:
    n = depth * (width * width + width)
    print(f"float32 MLP train step: {opt}, width {width}, depth {depth}: {n/1e6:.1f}M params", flush=True)
    config = dict(problem="f32 MLP step", opt=opt, params=n, leaves=2 * depth)
    rows += measure(config, mlp_builders(opt, width, depth, all_variants), args.reps)

  os.makedirs(args.out, exist_ok=True)
  stem, info = os.path.join(args.out, "benchmarks"), run_info(args)
  write_data(rows, info, stem + ".json")
  write_markdown(rows, info, stem + ".md")
  write_chart(rows, stem + ".png", info["device"])
  print("wrote", stem + ".json", ".md and .png")


if __name__ == "__main__":
  main()
