"""jaxscale in Equinox code: an `eqx.Module` trained under `eqx.filter_jit` with Optax.

The recipe is Equinox's own (`eqx.filter_value_and_grad`, `tx.update(grads, opt_state,
eqx.filter(model, eqx.is_array))`, `eqx.apply_updates`) with `dynamic_loss_scaling` as the
optimizer and the gradient line `jaxscale.equinox.filter_value_and_grad`, which hands back the
true gradients (or the same by hand: `jaxscale.scale` -> `eqx.filter_grad` ->
`jaxscale.unscale_and_check`).
Its reference is the same loop with the unwrapped optimizer on the true gradients, stepping only
on the finite batches, and a plain-Python model of the scale rule.
"""

from __future__ import annotations

import pathlib

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxscale
import jaxscale.equinox

ROOT = pathlib.Path(__file__).resolve().parents[1]
LR = 1e-2
INTERVAL = 2  # growth_interval: short, so that the runs below grow the scale too
BAD = {2: "inf input", 3: "nan input", 6: "overflows once scaled"}  # the steps whose gradients are not finite
STEPS = 9
MIXED = jaxscale.get_policy("mixed_float16")


def make_model(seed=0):
  return eqx.nn.MLP(4, 1, width_size=8, depth=2, key=jax.random.key(seed))


def batches(steps=STEPS, bad=BAD, seed=0):
  """`(x, y)` per step; the steps in `bad` give gradients with an inf or a NaN."""
  rng = np.random.default_rng(seed)
  out = []
  for step in range(steps):
    x = rng.normal(size=(16, 4)).astype(np.float32)
    y = np.sin(x.sum(1, keepdims=True)).astype(np.float32)
    if bad.get(step) == "inf input":
      x[3, 1] = np.inf
    elif bad.get(step) == "nan input":
      x[0, 0] = np.nan
    elif bad.get(step) == "overflows once scaled":
      y[5] = 1e36  # its gradient, ~1e35, overflows float32 once multiplied by the scale
    out.append((jnp.asarray(x), jnp.asarray(y)))
  return out


def loss_fn(model, x, y):
  return jnp.mean((jax.vmap(model)(x) - y) ** 2)


def mixed_loss_fn(model, x, y):
  """float16 compute, float32 parameters and loss."""
  model, x = MIXED.cast_to_compute((model, x))
  return jnp.mean((MIXED.cast_to_output(jax.vmap(model)(x)) - y) ** 2)


def params(model):
  return eqx.filter(model, eqx.is_array)


def jaxscale_step(tx, loss_fn=loss_fn, recipe="helper"):
  """One `eqx.filter_jit` training step; returns the model, the state and the scaler's metrics."""

  @eqx.filter_jit
  def step(model, opt_state, x, y):
    scaler = jaxscale.find_scaler(opt_state)
    if recipe == "by_hand":  # Equinox's own gradient of the scaled loss, unscaled and checked by hand
      grads = eqx.filter_grad(lambda m: jaxscale.scale(scaler, loss_fn(m, x, y)))(model)
      grads, finite = jaxscale.unscale_and_check(scaler, grads)
    else:
      _, grads, finite = jaxscale.equinox.filter_value_and_grad(loss_fn)(scaler, model, x, y)
    if recipe == "no_flag":  # true gradients: the wrapper checks them itself
      updates, opt_state = tx.update(grads, opt_state, params(model))
    else:
      updates, opt_state = tx.update(grads, opt_state, params(model), finite=finite)
    return eqx.apply_updates(model, updates), opt_state, jaxscale.metrics(opt_state)

  return step


def reference_run(data, inner, model):
  """The unwrapped optimizer on the true gradients, stepping only where they are finite."""

  @eqx.filter_jit
  def step(model, opt_state, x, y):
    grads = eqx.filter_grad(loss_fn)(model, x, y)
    updates, opt_state = inner.update(grads, opt_state, params(model))
    return eqx.apply_updates(model, updates), opt_state

  opt_state, models = inner.init(params(model)), []
  for i, (x, y) in enumerate(data):
    if i not in BAD:
      model, opt_state = step(model, opt_state, x, y)
    models.append(model)
  return models


def reference_scales(init_scale, steps=STEPS, bad=BAD, interval=INTERVAL):
  """torch.amp.GradScaler's rule in plain Python: the scale after each step."""
  scale, tracker, out = init_scale, 0, []
  for step in range(steps):
    if step in bad:
      scale, tracker = scale / 2, 0
    else:
      tracker += 1
      if tracker == interval:
        scale, tracker = scale * 2, 0
    out.append(scale)
  return out


def assert_same_arrays(a, b, rtol=0.0, err_msg=""):
  """The models' arrays: the same dtypes, and the same bits (or within `rtol`, or `(rtol, atol)`)."""
  rtol, atol = rtol if isinstance(rtol, tuple) else (rtol, 0)
  leaves_a, leaves_b = jax.tree.leaves(params(a)), jax.tree.leaves(params(b))
  assert len(leaves_a) == len(leaves_b)
  for x, y in zip(leaves_a, leaves_b):
    assert x.dtype == y.dtype, err_msg
    if rtol:
      np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=rtol, atol=atol, err_msg=err_msg)
    else:
      np.testing.assert_array_equal(np.asarray(x), np.asarray(y), err_msg=err_msg)


# ------------------------------------------------------------------ the training loop


INNER = {
    # A power-of-two learning rate: SGD's steps round alike in any compiled program, bit for bit.
    "sgd": (lambda: optax.sgd(2.0**-6), 0.0),
    # Adam's steps may fuse and vectorise differently in the two programs (and on each CPU: AMD
    # EPYC showed 7.3e-7 relative where one Intel machine's run had set 5e-7). Per finite step the
    # update u = lr * m_hat / (sqrt(v_hat) + eps) takes ~12 float32 roundings, and m and v carry
    # ~3 more per step: at most 12 + 4.5 t ulps of |u| <= lr * (1 - b1) / sqrt(1 - b2) = 3.2 lr at
    # step t. Summed over the 6 finite steps: 166.5 ulps (2**-24) of 3.2 lr, absolute; plus p's
    # own rounding (1 ulp of p) for the relative part. A bound near 0 must be absolute.
    "adam": (lambda: optax.adam(LR), (2.0**-24, 166.5 * 2.0**-24 * 3.2 * LR)),
}


@pytest.mark.parametrize("inner", INNER)
@pytest.mark.parametrize("recipe", ["helper", "no_flag", "by_hand"])
@pytest.mark.filterwarnings("ignore:jaxscale. `dynamic_loss_scaling`'s update got no `finite` flag")  # no_flag's
def test_training_matches_the_unwrapped_optimizer_on_true_gradients(recipe, inner):
  make_inner, rtol = INNER[inner]
  data = batches()
  tx = jaxscale.dynamic_loss_scaling(make_inner(), init_scale=2.0**15, growth_interval=INTERVAL)
  step = jaxscale_step(tx, recipe=recipe)
  model = make_model()
  opt_state = tx.init(params(model))
  expected = reference_run(data, make_inner(), model)
  scales = reference_scales(2.0**15)
  for i, (x, y) in enumerate(data):
    before = model
    model, opt_state, m = step(model, opt_state, x, y)
    # Power-of-two scales unscale exactly: the unwrapped optimizer's arrays on the true gradients.
    assert_same_arrays(model, expected[i], rtol=rtol, err_msg=f"step {i}")
    if i in BAD:
      assert_same_arrays(model, before, err_msg=f"skipped step {i}")
    assert float(m["scale"]) == scales[i], f"step {i}"
    assert bool(m["last_skipped"]) == (i in BAD)
  assert int(m["skipped_steps"]) == len(BAD)
  assert min(scales) < 2.0**15 < max(scales)  # both growth and back-off happened


def test_the_step_compiles_once_as_the_scale_changes():
  traces = []

  def counting_loss(model, x, y):
    traces.append(1)  # runs when the step is traced, not when it runs
    return loss_fn(model, x, y)

  tx = jaxscale.dynamic_loss_scaling(optax.adam(LR), init_scale=2.0**15, growth_interval=INTERVAL)
  step = jaxscale_step(tx, counting_loss)
  model = make_model()
  opt_state = tx.init(params(model))
  for x, y in batches():
    model, opt_state, _ = step(model, opt_state, x, y)
  assert len(traces) == 1


def test_a_skipped_step_leaves_the_float16_models_arrays_bit_for_bit():
  # A float16 model, float16 compute, and a scale that overflows float16 until it has backed off.
  # Float16 parameters: the helper hands back float32 gradients, and master weights keep a float32 copy.
  model = jaxscale.get_policy("float16").cast_to_param(make_model())
  tx = jaxscale.master_weights(jaxscale.dynamic_loss_scaling(optax.adam(LR), init_scale=2.0**40))
  step = jaxscale_step(tx, lambda m, x, y: loss_fn(m, x.astype(jnp.float16), y.astype(jnp.float16)))
  opt_state = tx.init(params(model))
  x, y = batches(steps=1, bad={})[0]
  skipped = 0
  while True:
    before_model, before_inner = model, opt_state.inner_state.inner_state  # adam's own state
    model, opt_state, m = step(model, opt_state, x, y)
    if not m["last_skipped"]:
      break
    skipped += 1
    assert_same_arrays(model, before_model)
    for a, b in zip(jax.tree.leaves(opt_state.inner_state.inner_state), jax.tree.leaves(before_inner)):
      np.testing.assert_array_equal(a, b)
  assert skipped > 0 and float(m["scale"]) == 2.0 ** (40 - skipped)
  assert all(leaf.dtype == jnp.float16 for leaf in jax.tree.leaves(params(model)))
  changed = [not np.array_equal(a, b)
             for a, b in zip(jax.tree.leaves(params(model)), jax.tree.leaves(params(before_model)))]
  assert all(changed)  # the first finite step moved every array


def test_the_helper_casts_float16_gradients_to_float32_before_it_unscales_them():
  # Unscaled in float16, true gradients below 2**-24 would flush to zero: the helper casts first.
  model = jaxscale.get_policy("float16").cast_to_param(make_model())
  x, y = (a.astype(jnp.float16) for a in batches(steps=1, bad={})[0])
  scale = 2.0**14
  tiny = lambda m, x, y: loss_fn(m, x, y) * jnp.float16(2.0**-20)  # true gradients around 2**-27
  _, grads, finite = jaxscale.equinox.filter_value_and_grad(tiny)(jaxscale.init(init_scale=scale), model, x, y)
  assert bool(finite)
  # The reference: Equinox's float16 gradients of the scaled loss, divided by the scale in float64.
  scaled = eqx.filter_grad(lambda m: tiny(m, x, y) * jnp.float16(scale))(model)
  for g, want in zip(jax.tree.leaves(grads), jax.tree.leaves(scaled), strict=True):
    assert g.dtype == jnp.float32
    # Dividing by a power of two is exact, and every float16 value is a float32.
    np.testing.assert_array_equal(np.asarray(g), np.asarray(want, np.float64) / scale)
  smallest = min(float(np.min(np.abs(g[g != 0]))) for g in jax.tree.leaves(grads) if np.any(g != 0))
  assert smallest < 2.0**-24  # below float16's smallest subnormal: only float32 holds it


# ------------------------------------------------------------------ the helper


@pytest.mark.parametrize("has_aux", [False, True], ids=["loss", "loss_and_aux"])
def test_helper_matches_eqx_filter_value_and_grad(has_aux):
  model = make_model()
  x, y = batches(steps=1, bad={})[0]
  fun = (lambda m, x, y: (loss_fn(m, x, y), {"n": x.shape[0]})) if has_aux else loss_fn
  value, grads, finite = jaxscale.equinox.filter_value_and_grad(fun, has_aux=has_aux)(
      jaxscale.init(init_scale=2.0**10), model, x, y=y)
  want_value, want_grads = eqx.filter_value_and_grad(fun, has_aux=has_aux)(model, x, y=y)
  assert bool(finite)
  assert jax.tree.structure(value) == jax.tree.structure(want_value)
  for a, b in zip(jax.tree.leaves(value), jax.tree.leaves(want_value)):
    np.testing.assert_array_equal(a, b)
  # Same structure, None where Equinox puts None (the activation functions, the sizes).
  assert jax.tree.structure(grads) == jax.tree.structure(want_grads)
  for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(want_grads)):
    np.testing.assert_array_equal(a, b)


def test_helper_flags_an_overflow():
  model = make_model()
  x, y = batches(steps=1, bad={})[0]
  vg = jaxscale.equinox.filter_value_and_grad(loss_fn)
  # The true gradients (~1e10) are finite; multiplied by 2**127 they overflow float32.
  assert bool(vg(jaxscale.init(init_scale=1.0), model, x, y * 1e10)[2])
  assert not bool(vg(jaxscale.init(init_scale=2.0**127), model, x, y * 1e10)[2])


@pytest.mark.parametrize("first", ["model", "opt_state"])
def test_helper_without_the_scaler_first_says_what_to_pass(first):
  model = make_model()
  opt_state = jaxscale.dynamic_loss_scaling(optax.adam(LR)).init(params(model))
  x, y = batches(steps=1, bad={})[0]
  args = (model, x, y) if first == "model" else (opt_state, model, x, y)
  with pytest.raises(TypeError, match=r"scaler state first.*jaxscale.find_scaler\(opt_state\)"):
    jaxscale.equinox.filter_value_and_grad(loss_fn)(*args)


def test_helper_with_axis_name_makes_every_device_agree():
  model = make_model()
  (x, y), (bad_x, _) = batches(steps=3, bad={1: "inf input"})[:2]
  xs, ys = jnp.stack([x, bad_x]), jnp.stack([y, y])  # device 1's batch holds an inf

  # One scaler per device, passed in (a scaler built inside the mapped function would be a constant).
  scalers = jax.tree.map(lambda a: jnp.stack([a, a]), jaxscale.init())

  def per_device(scaler, x, y, axis_name):
    vg = jaxscale.equinox.filter_value_and_grad(loss_fn, axis_name=axis_name)
    return vg(scaler, model, x, y)[2]

  assert jax.vmap(lambda *a: per_device(*a, "devices"), axis_name="devices")(scalers, xs, ys).tolist() == [False, False]
  assert jax.vmap(lambda *a: per_device(*a, None))(scalers, xs, ys).tolist() == [True, False]


def test_helper_with_has_aux_and_no_pair_says_so():
  model = make_model()
  x, y = batches(steps=1, bad={})[0]
  with pytest.raises(TypeError, match=r"has_aux=True.*must return a pair `\(loss, aux\)`"):
    jaxscale.equinox.filter_value_and_grad(loss_fn, has_aux=True)(jaxscale.init(), model, x, y)


# ------------------------------------------------------------------ state: find_scaler, metrics, checkpoints


def test_find_scaler_and_metrics_in_an_equinox_train_state():
  class TrainState(eqx.Module):  # how Equinox code often carries its state
    model: eqx.Module
    opt_state: optax.OptState

  tx = jaxscale.dynamic_loss_scaling(optax.chain(optax.clip_by_global_norm(1.0), optax.adam(LR)), init_scale=512.0)
  model = make_model()
  state = TrainState(model, tx.init(params(model)))
  assert float(jaxscale.find_scaler(state).scale) == 512.0
  assert float(jaxscale.metrics(state)["scale"]) == 512.0


def test_a_checkpoint_written_by_tree_serialise_leaves_resumes_bit_for_bit(tmp_path):
  data = batches()
  tx = jaxscale.dynamic_loss_scaling(optax.adam(LR), init_scale=2.0**15, growth_interval=3)
  step = jaxscale_step(tx, mixed_loss_fn)
  model = make_model()
  opt_state = tx.init(params(model))
  for x, y in data[:5]:
    model, opt_state, _ = step(model, opt_state, x, y)
  eqx.tree_serialise_leaves(tmp_path / "ckpt.eqx", (model, opt_state))
  saved = jaxscale.find_scaler(opt_state)
  # The checkpoint holds a scaler that differs from a fresh one (a backed-off scale, a running tracker).
  fresh = jaxscale.find_scaler(tx.init(params(make_model(seed=1))))
  assert float(saved.scale) != float(fresh.scale) and int(saved.growth_tracker) != 0

  def finish(model, opt_state):
    for x, y in data[5:]:  # step 6 overflows: the resumed run skips it too
      model, opt_state, _ = step(model, opt_state, x, y)
    return model, opt_state

  want = finish(model, opt_state)
  like = (make_model(seed=1), tx.init(params(make_model(seed=1))))
  got = finish(*eqx.tree_deserialise_leaves(tmp_path / "ckpt.eqx", like))
  assert_same_arrays(got[0], want[0])
  for a, b in zip(jax.tree.leaves(got[1]), jax.tree.leaves(want[1]), strict=True):
    assert a.dtype == b.dtype
    np.testing.assert_array_equal(a, b)
  assert int(jaxscale.find_scaler(got[1]).skipped_steps) == 3


# ------------------------------------------------------------------ mixed precision


def test_mixed_precision_with_a_float32_model():
  # float16 compute, float32 parameters: the mixed_float16 policy inside the loss.
  data = batches(bad={})
  tx = jaxscale.dynamic_loss_scaling(optax.adam(LR), init_scale=2.0**15)
  step = jaxscale_step(tx, mixed_loss_fn)
  model = make_model()
  opt_state = tx.init(params(model))
  losses = []
  for x, y in data:
    losses.append(float(loss_fn(model, x, y)))
    model, opt_state, m = step(model, opt_state, x, y)
  assert all(leaf.dtype == jnp.float32 for leaf in jax.tree.leaves(params(model)))
  assert int(m["skipped_steps"]) == 0 and losses[-1] < losses[0]


def test_master_weights_keep_a_float16_equinox_model_float16():
  model = jaxscale.get_policy("float16").cast_to_param(make_model())
  tx = jaxscale.master_weights(jaxscale.dynamic_loss_scaling(optax.adam(LR), init_scale=2.0**10))
  step = jaxscale_step(tx, lambda m, x, y: loss_fn(m, x.astype(jnp.float16), y.astype(jnp.float16)))
  opt_state = tx.init(params(model))
  for x, y in batches(steps=2, bad={}):
    model, opt_state, _ = step(model, opt_state, x, y)
  assert [leaf.dtype for leaf in jax.tree.leaves(params(model))] == [np.dtype("float16")] * 6
  # Each parameter is its master rounded to float16, or (where no float16 update can land on that,
  # or XLA keeps `p + u` in float32 inside the jitted step) one float16 ulp from it: the master
  # itself is exact, and the next step aims at it again (docs/sixteen_bits.md).
  master = jax.tree.leaves(opt_state.master)
  for p, m in zip(jax.tree.leaves(params(model)), master, strict=True):
    target = np.asarray(m.astype(jnp.float16))
    ulps = np.abs(np.asarray(p).view(np.int16).astype(np.int32) - target.view(np.int16).astype(np.int32))
    assert ulps.max() <= 1 and np.mean(ulps == 0) >= 0.9


def _equations(jaxpr):
  """Every equation of a jaxpr, those of the jaxprs nested in its equations' parameters included."""
  for eqn in jaxpr.eqns:
    yield eqn
    for param in eqn.params.values():
      for sub in param if isinstance(param, (tuple, list)) else (param,):
        sub = getattr(sub, "jaxpr", sub)  # a ClosedJaxpr's jaxpr
        if hasattr(sub, "eqns"):
          yield from _equations(sub)


class _Classifier(eqx.Module):
  """An MLP whose log-softmax head asks for float32, as a careful Equinox model does."""

  mlp: eqx.nn.MLP

  def __call__(self, x):
    return jax.nn.log_softmax(self.mlp(x).astype(jnp.float32))


def test_autocast_runs_an_equinox_models_matmuls_in_float16_and_its_softmax_in_float32():
  model = _Classifier(eqx.nn.MLP(4, 3, width_size=8, depth=2, key=jax.random.key(0)))
  # A caller that keeps the input in float32 on purpose: per-operation autocast still
  # computes the matmuls in float16, and the softmax's exp and log in float32.
  fun = jaxscale.autocast(lambda model, x: model(x.astype(jnp.float32)), MIXED)
  jaxpr = jax.make_jaxpr(lambda x: fun(model, x))(jnp.ones(4))
  eqns = list(_equations(jaxpr.jaxpr))
  dots = [e for e in eqns if e.primitive.name == "dot_general"]
  exps = [e for e in eqns if e.primitive.name in ("exp", "log")]
  assert dots and exps
  assert all(v.aval.dtype == jnp.float16 for e in dots for v in e.invars)
  assert all(v.aval.dtype == jnp.float32 for e in exps for v in e.invars)


# ------------------------------------------------------------------ the example


@pytest.mark.slow
@pytest.mark.newest_only  # an example: what users run, on the newest releases
def test_the_equinox_example_runs_and_reports_float32s_spread(capsys, monkeypatch):
  pytest.importorskip("sklearn")
  monkeypatch.syspath_prepend(str(ROOT / "examples"))
  import equinox_mlp

  results = equinox_mlp.main(["--seeds", "2", "--steps", "3", "--width", "8"])
  assert list(results) == ["float32", "float16", "float16 + jaxscale"]
  assert all(len(runs) == 2 and all(np.isfinite(r["loss"]) for r in runs) for runs in results.values())
  assert [r["scale"] for r in results["float16"]] == [1.0, 1.0]
  assert [r["scale"] for r in results["float16 + jaxscale"]] == [2.0**16, 2.0**16]
  out = capsys.readouterr().out
  low, high = sorted(r["loss"] for r in results["float32"])
  assert f"float32's held-out loss over the seeds spans [{low:.4f}, {high:.4f}]." in out
  assert "float16 + jaxscale: mean" in out


def test_the_helper_of_something_not_callable_asks_for_the_loss_function():
  with pytest.raises(TypeError, match="takes the loss function"):
    jaxscale.equinox.filter_value_and_grad(jnp.ones(2))


@pytest.mark.parametrize("wrap", [eqx.filter_jit, lambda f: f], ids=["filter_jit", "eager"])
def test_a_filter_jitted_loss_that_scales_itself_is_refused_after_an_earlier_call(wrap):
  # Called again, `eqx.filter_jit` reuses its trace and runs no Python: the gradient site traces
  # the function it wraps instead, and counts the scale there.
  model, (x, y) = make_model(), batches(steps=1, bad={})[0]
  scaler = jaxscale.init(init_scale=1024.0)

  @eqx.filter_jit
  def loss_scaled_inside(model, x, y, scaler):
    return jaxscale.scale(scaler, jnp.mean((jax.vmap(model)(x) - y) ** 2))

  loss_scaled_inside(model, x, y, scaler)  # to log the loss: its trace is cached now
  for _ in range(2):
    with pytest.raises(ValueError, match="called `jaxscale.scale` and did not unscale"):
      wrap(lambda s, m: jaxscale.equinox.filter_value_and_grad(loss_scaled_inside)(s, m, x, y, s))(scaler, model)
