"""The migration guides (docs/migrating/), checked against the peers they migrate from.

For each peer, `test_same_trajectory_as_the_peer[peer]` runs a training loop written with the
peer ("before") and the same loop written with jaxscale ("after") on one sequence of gradients
that overflows now and then, and asserts the same scale, the same growth counter (jmp's
`counter`, Flax's `fin_steps`, Keras's `step_counter`, torch's growth tracker) and the same
parameters, step by step.
Each semantic difference a guide states has a test of its own, named after it, that observes it
by running the peer. torch is optional here (`importorskip`): its tests run where it is installed.
"""

from __future__ import annotations

import functools
import os

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import _sgd_loop
import jaxscale
from _jit import compilations

# These tests hand the wrapper gradients of their own making, with no gradient site: the warning
# for an update without its `finite` flag is tested in tests/test_contract.py.
pytestmark = [
    pytest.mark.newest_only,
    pytest.mark.filterwarnings("ignore:jaxscale. `dynamic_loss_scaling`'s update got no `finite` flag"),
]

LR = 2.0**-4  # a power of two, so that SGD rounds identically everywhere
INTERVAL = 3


def gradient_sequence(steps=14, size=3):
  """Per-step true gradients (multiples of 2**-10, so every product is exact); some hold an inf or a NaN."""
  rng = np.random.default_rng(0)
  grads = np.round(rng.normal(size=(steps, size)) * 64) / 1024
  for step, bad in [(4, np.inf), (5, np.nan), (10, -np.inf)]:  # two in a row, then one alone
    grads[step, 1] = bad
  return grads.astype(np.float32)


GRADS = gradient_sequence()


def linear_loss(w, g):
  """A loss whose gradient with respect to `w` is exactly `g`."""
  return jnp.sum(w * g)


def run_jaxscale(grads, inner=None, **options):
  """The "after" loop: `dynamic_loss_scaling` around SGD, one jitted step."""
  return _sgd_loop.run(grads, inner or optax.sgd(LR), **options)[0]


def assert_same_trajectory(theirs, ours):
  """Scale, growth counter (where the peer has one: None otherwise) and parameters, step by step."""
  assert len(theirs) == len(ours)
  for step, ((t_scale, t_count, t_w), (o_scale, o_count, o_w)) in enumerate(zip(theirs, ours)):
    assert t_scale == o_scale, f"step {step}: scale {t_scale} (peer) != {o_scale} (jaxscale)"
    assert t_count is None or t_count == o_count, f"step {step}: counter {t_count} (peer) != {o_count}"
    np.testing.assert_array_equal(o_w, t_w, err_msg=f"step {step}")


# ------------------------------------------------------------------ before: each peer's loop


def run_jmp(grads, *, init_scale=2.0**15, period=INTERVAL):
  """jmp's documented loop: scale, grad, unscale, all_finite, adjust, select_tree."""
  jmp = pytest.importorskip("jmp")
  tx = optax.sgd(LR)

  @jax.jit
  def step(w, opt_state, loss_scale, g):
    grads = jax.grad(lambda w: loss_scale.scale(linear_loss(w, g)))(w)
    grads = loss_scale.unscale(grads)
    finite = jmp.all_finite(grads)
    loss_scale = loss_scale.adjust(finite)
    updates, new_opt_state = tx.update(grads, opt_state, w)
    new_w = optax.apply_updates(w, updates)
    w, opt_state = jmp.select_tree(finite, (new_w, new_opt_state), (w, opt_state))
    return w, opt_state, loss_scale

  w = jnp.ones(grads.shape[1], jnp.float32)
  opt_state, loss_scale = tx.init(w), jmp.DynamicLossScale(jnp.float32(init_scale), period=period)
  trajectory = []
  for g in grads:
    w, opt_state, loss_scale = step(w, opt_state, loss_scale, g)
    trajectory.append((float(loss_scale.loss_scale), int(loss_scale.counter), np.asarray(w)))
  return trajectory


def run_flax(grads, *, init_scale=2.0**16, growth_interval=INTERVAL - 1):
  """Flax's documented loop: `DynamicScale.value_and_grad`, then a `where` on `is_fin`."""
  dynamic_scale = pytest.importorskip("flax.training.dynamic_scale")
  tx = optax.sgd(LR)

  @jax.jit
  def step(w, opt_state, ds, g):
    ds, is_fin, loss, grads = ds.value_and_grad(linear_loss)(w, g)
    updates, new_opt_state = tx.update(grads, opt_state, w)
    new_w = optax.apply_updates(w, updates)
    w, opt_state = jax.tree.map(functools.partial(jnp.where, is_fin), (new_w, new_opt_state), (w, opt_state))
    return w, opt_state, ds

  w = jnp.ones(grads.shape[1], jnp.float32)
  opt_state = tx.init(w)
  ds = dynamic_scale.DynamicScale(growth_interval=growth_interval, scale=init_scale)
  trajectory = []
  for g in grads:
    w, opt_state, ds = step(w, opt_state, ds, g)
    trajectory.append((float(ds.scale), int(ds.fin_steps), np.asarray(w)))
  return trajectory


def import_keras():
  os.environ.setdefault("KERAS_BACKEND", "jax")
  keras = pytest.importorskip("keras")
  if keras.backend.backend() != "jax":
    pytest.skip("keras runs on another backend than JAX in this process")
  return keras


def run_keras(grads, *, init_scale=2.0**15, growth_steps=INTERVAL):
  """Keras 3's LossScaleOptimizer on the JAX backend, driven statelessly under `jax.jit`."""
  keras = import_keras()
  tx = keras.optimizers.LossScaleOptimizer(
      keras.optimizers.SGD(LR), initial_scale=init_scale, dynamic_growth_steps=growth_steps
  )
  w = jnp.ones(grads.shape[1], jnp.float32)
  tx.build([keras.Variable(w)])
  paths = [v.path for v in tx.variables]
  scale_at = next(i for i, p in enumerate(paths) if p.endswith("dynamic_scale"))
  counter_at = next(i for i, p in enumerate(paths) if p.endswith("step_counter"))

  @jax.jit
  def step(w, variables, g):
    scale = variables[scale_at]  # what `tx.scale_loss` multiplies by
    scaled_grads = jax.grad(lambda w: linear_loss(w, g) * scale)(w)
    (w,), variables = tx.stateless_apply(variables, [scaled_grads], [w])
    return w, variables

  variables = [v.value for v in tx.variables]
  trajectory = []
  for g in grads:
    w, variables = step(w, variables, g)
    trajectory.append((float(variables[scale_at]), int(variables[counter_at]), np.asarray(w)))
  return trajectory


def run_apply_if_finite(grads, *, max_consecutive_errors=100):
  """optax.apply_if_finite: skips non-finite steps, never scales (its scale is always 1)."""
  tx = optax.apply_if_finite(optax.sgd(LR), max_consecutive_errors=max_consecutive_errors)

  @jax.jit
  def step(w, opt_state, g):
    updates, opt_state = tx.update(jax.grad(linear_loss)(w, g), opt_state, w)
    return optax.apply_updates(w, updates), opt_state

  w = jnp.ones(grads.shape[1], jnp.float32)
  opt_state = tx.init(w)
  trajectory = []
  for g in grads:
    w, opt_state = step(w, opt_state, g)
    trajectory.append((1.0, None, np.asarray(w)))
  return trajectory


def run_torch(grads, *, init_scale=2.0**16, growth_interval=INTERVAL, clip=None):
  """torch.amp.GradScaler's documented loop (CPU), with `unscale_` and clipping if `clip`."""
  torch = pytest.importorskip("torch")
  w = torch.nn.Parameter(torch.ones(grads.shape[1]))
  opt = torch.optim.SGD([w], lr=LR)
  scaler = torch.amp.GradScaler("cpu", init_scale=init_scale, growth_interval=growth_interval)
  trajectory = []
  for g in grads:
    opt.zero_grad()
    scaler.scale((w * torch.from_numpy(g)).sum()).backward()
    if clip is not None:
      scaler.unscale_(opt)
      torch.nn.utils.clip_grad_norm_([w], clip)
    scaler.step(opt)
    scaler.update()
    trajectory.append((scaler.get_scale(), scaler._get_growth_tracker(), w.detach().numpy().copy()))
  return trajectory


# ------------------------------------------------------------------ where they agree

PAIRS = {
    # peer: (its loop, the jaxscale options that reproduce it)
    "jmp": (run_jmp, dict(init_scale=2.0**15, growth_interval=INTERVAL, min_scale=1.0)),
    "flax": (run_flax, dict(init_scale=2.0**16, growth_interval=INTERVAL)),  # flax's INTERVAL - 1
    "keras": (run_keras, dict(init_scale=2.0**15, growth_interval=INTERVAL)),
    "optax_apply_if_finite": (run_apply_if_finite, dict(init_scale=1.0, dynamic=False)),
    "torch": (run_torch, dict(init_scale=2.0**16, growth_interval=INTERVAL)),
}


@pytest.mark.parametrize("peer", PAIRS)
def test_same_trajectory_as_the_peer(peer):
  run_peer, options = PAIRS[peer]
  theirs = run_peer(GRADS)
  ours = run_jaxscale(GRADS, **options)
  assert_same_trajectory(theirs, ours)
  scales = [s for s, *_ in ours]
  if peer != "optax_apply_if_finite":  # the sequence exercises both growth and backoff
    assert max(scales) > options["init_scale"] and min(scales) < options["init_scale"]


# ------------------------------------------------------------------ jmp


def test_jmp_min_loss_scale_is_lost_by_its_tree_unflatten():
  jmp = pytest.importorskip("jmp")
  loss_scale = jmp.DynamicLossScale(jnp.float32(2.0**10), min_loss_scale=jnp.float32(2.0**9))
  assert float(jax.tree.map(lambda x: x, loss_scale).min_loss_scale) == 1.0
  assert float(jax.jit(lambda s: s)(loss_scale).min_loss_scale) == 1.0
  # So after a trip through jit it backs off below the floor it was given ...
  adjust = jax.jit(lambda s: s.adjust(jnp.array(False)))
  assert float(adjust(adjust(loss_scale)).loss_scale) == 2.0**8
  # ... where jaxscale's `min_scale` is a leaf of the state and survives.
  state = jax.jit(lambda s: s)(jaxscale.init(init_scale=2.0**10, min_scale=2.0**9))
  down = jax.jit(lambda s: jaxscale.update(s, False))
  assert float(down(down(state)).scale) == 2.0**9


def test_jmp_min_loss_scale_defaults_to_1():
  jmp = pytest.importorskip("jmp")
  loss_scale = jmp.DynamicLossScale(jnp.float32(2.0))
  for _ in range(3):
    loss_scale = loss_scale.adjust(jnp.array(False))
  state = jaxscale.init(init_scale=2.0)
  for _ in range(3):
    state = jaxscale.update(state, False)
  assert float(loss_scale.loss_scale) == 1.0 and float(state.scale) == 0.25


def test_jmp_unscale_returns_float32_for_float16_gradients():
  jmp = pytest.importorskip("jmp")
  grads = jnp.full(3, 2.0**-20, jnp.float16)  # a float16 subnormal: the true gradient, 2**-30, is not one
  theirs = jmp.DynamicLossScale(jnp.float32(1024.0)).unscale(grads)
  unscaled, _ = jaxscale.unscale_and_check(jaxscale.init(init_scale=1024.0), grads)
  assert theirs.dtype == unscaled.dtype == jnp.float32
  assert float(theirs[0]) == float(unscaled[0]) == 2.0**-30


def test_jmp_unscale_flushes_to_zero_at_2_pow_127():
  jmp = pytest.importorskip("jmp")
  grads = jnp.float32(2.0**100)  # a true gradient of 2**-27, scaled by 2**127
  # XLA:CPU flushes the subnormal reciprocal to zero; XLA:GPU keeps subnormals, and jmp is exact there.
  flushed = 0.0 if jax.default_backend() == "cpu" else 2.0**-27
  assert float(jmp.DynamicLossScale(jnp.float32(2.0**127)).unscale(grads)) == flushed
  unscaled, _ = jaxscale.unscale_and_check(jaxscale.init(init_scale=2.0**127), grads)
  assert float(unscaled) == 2.0**-27


def test_jmp_static_loss_scale_is_dynamic_false():
  jmp = pytest.importorskip("jmp")
  static = jmp.StaticLossScale(jnp.float32(128.0))
  state = jaxscale.init(init_scale=128.0, dynamic=False)
  for finite in [True, False, True]:
    static, state = static.adjust(jnp.array(finite)), jaxscale.update(state, finite)
    assert float(static.loss_scale) == float(state.scale) == 128.0
  x = jnp.float32(3.0)
  assert float(static.scale(x)) == float(jaxscale.scale(state, x)) == 384.0
  assert int(state.skipped_steps) == 1  # jaxscale still skips (and counts) the non-finite step


def test_jmp_noop_loss_scale_is_enabled_false():
  jmp = pytest.importorskip("jmp")
  noop, state = jmp.NoOpLossScale(), jaxscale.init(enabled=False)
  grads = jnp.array([1.0, jnp.inf])
  assert noop.loss_scale == float(state.scale) == 1.0
  assert float(jaxscale.scale(state, jnp.float32(3.0))) == float(noop.scale(jnp.float32(3.0))) == 3.0
  unscaled, finite = jaxscale.unscale_and_check(state, grads)
  np.testing.assert_array_equal(unscaled, noop.unscale(grads))
  # Disabled, jaxscale checks nothing: the flag is True even for an inf (jmp.all_finite: False).
  assert bool(finite) and not bool(jmp.all_finite(grads))


@pytest.mark.parametrize(
    "tree",
    [
        {"a": jnp.ones(3), "b": jnp.zeros((2, 2), jnp.float16)},
        {"a": jnp.array([1.0, jnp.nan]), "b": jnp.ones(2)},
        (jnp.array([jnp.inf], jnp.bfloat16), jnp.arange(3)),
        {"ints_only": jnp.arange(3)},
        {},
    ],
    ids=["finite", "nan", "inf_bfloat16_and_ints", "ints_only", "empty"],
)
def test_jmp_all_finite_is_jaxscale_all_finite(tree):
  jmp = pytest.importorskip("jmp")
  assert bool(jaxscale.all_finite(tree)) == bool(jmp.all_finite(tree))


@pytest.mark.parametrize("pred", [True, False])
def test_jmp_select_tree_is_a_where_over_the_tree(pred):
  jmp = pytest.importorskip("jmp")
  a, b = {"w": jnp.ones(3), "n": jnp.int32(1)}, {"w": jnp.zeros(3), "n": jnp.int32(2)}
  expected = jmp.select_tree(jnp.array(pred), a, b)
  ours = jax.tree.map(functools.partial(jnp.where, pred), a, b)
  jax.tree.map(np.testing.assert_array_equal, ours, expected)


# ------------------------------------------------------------------ Flax DynamicScale


def test_flax_grows_one_step_later_than_torch_for_the_same_interval():
  grads = gradient_sequence()[:4]  # four finite steps
  theirs = [s for s, *_ in run_flax(grads, growth_interval=2)]
  ours = [s for s, *_ in run_jaxscale(grads, growth_interval=2)]
  assert theirs == [2.0**16, 2.0**16, 2.0**17, 2.0**17]  # on the 3rd finite step
  assert ours == [2.0**16, 2.0**17, 2.0**17, 2.0**18]  # on the 2nd, 4th, ...


def test_flax_clamps_the_scale_at_float32_max():
  grads = np.full((2, 3), 2.0**-30, np.float32)  # scaled by 2**127, still finite
  theirs = [s for s, *_ in run_flax(grads, init_scale=2.0**127, growth_interval=0)]
  ours = [s for s, *_ in run_jaxscale(grads, init_scale=2.0**127, growth_interval=1)]
  assert theirs == [float(jnp.finfo(jnp.float32).max)] * 2  # not a power of two: unscaling rounds
  assert ours == [2.0**127] * 2  # torch's rule: keep the scale when growing would overflow


def test_flax_returns_a_nan_loss_on_overflow():
  from flax.training.dynamic_scale import DynamicScale

  def loss_fn(w):  # float16 compute: 2.0 * 2**16 overflows float16
    return jnp.sum(w.astype(jnp.float16) ** 2)

  w = jnp.ones(2, jnp.float32)
  _, is_fin, loss, _ = DynamicScale().value_and_grad(loss_fn)(w)
  assert not bool(is_fin) and bool(jnp.isnan(loss))
  loss, _, finite = jaxscale.value_and_grad(loss_fn)(jaxscale.init(), w)
  assert not bool(finite) and float(loss) == 2.0  # the true loss


def test_flax_casts_gradients_to_float32():
  from flax.training.dynamic_scale import DynamicScale

  w = jnp.ones(2, jnp.float16)
  _, _, _, grads = DynamicScale(scale=1024.0).value_and_grad(lambda w: jnp.sum(w**2))(w)
  assert grads.dtype == jnp.float32
  # jaxscale casts the gradients of float16 and bfloat16 parameters, and keeps float32 ones.
  vg = jaxscale.value_and_grad(lambda w: jnp.sum(w.astype(jnp.float32) ** 2))
  for dtype in (jnp.float16, jnp.bfloat16, jnp.float32):
    _, ours, _ = vg(jaxscale.init(init_scale=1024.0), w.astype(dtype))
    assert ours.dtype == jnp.float32
    np.testing.assert_array_equal(ours, grads)  # 2 * w: exact in every dtype


def test_flax_dynamic_scale_compiles_the_step_twice():
  from flax.training.dynamic_scale import DynamicScale

  step = jax.jit(lambda ds, w: ds.value_and_grad(lambda w: jnp.sum(w**2))(w)[0])
  ds, w = DynamicScale(), jnp.ones(2)
  for _ in range(3):
    ds = step(ds, w)
  assert compilations(step) == 2  # its fields start as Python numbers, then become arrays
  ours = jax.jit(lambda s, w: jaxscale.update(s, jaxscale.value_and_grad(lambda w: jnp.sum(w**2))(s, w)[2]))
  state = jaxscale.init()
  for _ in range(3):
    state = ours(state, w)
  assert compilations(ours) == 1


def test_flax_axis_name_also_averages_the_gradients():
  from flax.training.dynamic_scale import DynamicScale

  w = jnp.ones(2)
  xs = jnp.array([[1.0, 2.0], [3.0, 6.0]])  # one row per device, mapped by vmap
  loss_fn = lambda w, x: jnp.sum(w * x)
  flax = jax.vmap(lambda x: DynamicScale().value_and_grad(loss_fn, axis_name="d")(w, x)[3], axis_name="d")
  np.testing.assert_array_equal(jax.jit(flax)(xs), [[2.0, 4.0], [2.0, 4.0]])  # the mean
  scalers = jax.tree.map(lambda a: jnp.stack([a, a]), jaxscale.init())  # one per device, passed in
  ours = jax.vmap(lambda s, x: jaxscale.value_and_grad(loss_fn, axis_name="d")(s, w, x)[1], axis_name="d")
  np.testing.assert_array_equal(jax.jit(ours)(scalers, xs), xs)  # each device's own: average them yourself


# ------------------------------------------------------------------ Keras 3 LossScaleOptimizer


def test_keras_default_initial_scale_is_2_pow_15():
  keras = import_keras()
  assert keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD()).initial_scale == 2.0**15
  assert float(jaxscale.init().scale) == 2.0**16  # torch's


def test_keras_factors_are_fixed():
  keras = import_keras()
  with pytest.raises(ValueError, match="does not support arguments"):
    keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(), growth_factor=4.0)


def test_keras_scale_grows_to_inf_and_every_later_step_is_skipped():
  grads = np.full((3, 3), 1.0, np.float32)
  theirs = run_keras(grads, init_scale=2.0**127, growth_steps=1)
  assert [s for s, *_ in theirs] == [np.inf] * 3
  np.testing.assert_array_equal(theirs[-1][-1], theirs[0][-1])  # no step after the first
  ours = run_jaxscale(grads, init_scale=2.0**127, growth_interval=1)
  assert [s for s, *_ in ours] == [2.0**127] * 3
  np.testing.assert_array_equal(ours[-1][-1], 1.0 - 3 * LR)  # every step applied


# ------------------------------------------------------------------ optax.apply_if_finite


def test_apply_if_finite_gives_up_after_max_consecutive_errors():
  grads = np.array([[1.0, np.nan, 1.0]] * 4, np.float32)
  theirs = run_apply_if_finite(grads, max_consecutive_errors=2)
  assert all(np.isfinite(w).all() for *_, w in theirs[:2]) and np.isnan(theirs[2][-1]).any()
  ours = run_jaxscale(grads, init_scale=1.0, dynamic=False)
  np.testing.assert_array_equal(ours[-1][-1], np.ones(3))  # skipped, however many in a row


def test_apply_if_finite_skipped_update_turns_minus_zero_into_zero():
  g, w = jnp.array([jnp.nan, 1.0]), jnp.array([-0.0, 1.0])
  theirs = optax.apply_if_finite(optax.sgd(LR), max_consecutive_errors=5)
  updates, _ = theirs.update(g, theirs.init(w), w)
  assert not np.signbit(optax.apply_updates(w, updates)[0])
  ours = jaxscale.dynamic_loss_scaling(optax.sgd(LR), init_scale=1.0, dynamic=False)
  updates, _ = ours.update(g, ours.init(w), w)
  assert np.signbit(optax.apply_updates(w, updates)[0])  # bit for bit unchanged


def test_apply_if_finite_counters_are_the_scaler_counters():
  tx = optax.apply_if_finite(optax.sgd(LR), max_consecutive_errors=100)
  ours = jaxscale.dynamic_loss_scaling(optax.sgd(LR), init_scale=1.0, dynamic=False)
  w = jnp.ones(3)
  state, our_state = tx.init(w), ours.init(w)
  theirs_update, ours_update = jax.jit(tx.update), jax.jit(ours.update)
  for g in GRADS:
    _, state = theirs_update(jnp.asarray(g), state, w)
    _, our_state = ours_update(jnp.asarray(g), our_state, w)
    scaler = jaxscale.find_scaler(our_state)
    assert int(state.total_notfinite) == int(scaler.skipped_steps)
    assert bool(state.last_finite) == (not bool(scaler.last_skipped))


def test_apply_if_finite_around_the_wrapper_is_refused():
  # optax's apply_if_finite keeps its inner state on a non-finite step: the scaler's back-off with it.
  around = optax.apply_if_finite(jaxscale.dynamic_loss_scaling(optax.sgd(LR), init_scale=2.0**10), 5)
  w = jnp.ones(3)
  state = around.init(w)
  _, state = around.update(jnp.array([1.0, jnp.inf, 1.0]), state, w)
  assert float(state.inner_state.scaler.scale) == 2.0**10  # the back-off to 2**9 was thrown away
  with pytest.raises(ValueError, match=r"apply_if_finite.*Drop `apply_if_finite`"):
    jaxscale.find_scaler(state)


# ------------------------------------------------------------------ torch.amp.GradScaler


def run_jaxscale_clip_in_front(grads, clip, **options):
  """The "after" loop with the clip where an Optax user puts it: in front of the wrapper."""
  tx = optax.chain(optax.clip_by_global_norm(clip), jaxscale.dynamic_loss_scaling(optax.sgd(LR), **options))

  @jax.jit
  def step(w, opt_state, g):
    _, grads, finite = jaxscale.value_and_grad(linear_loss)(jaxscale.find_scaler(opt_state), w, g)
    updates, opt_state = tx.update(grads, opt_state, w, finite=finite)
    return optax.apply_updates(w, updates), opt_state

  w = jnp.ones(grads.shape[1], jnp.float32)
  opt_state, trajectory = tx.init(w), []
  for g in grads:
    w, opt_state = step(w, opt_state, g)
    scaler = jaxscale.find_scaler(opt_state)
    trajectory.append((float(scaler.scale), int(scaler.growth_tracker), np.asarray(w)))
  return trajectory


@pytest.mark.parametrize("where", ["inside", "in_front"])
def test_torch_unscale_and_clip_matches_clipping_to_rounding(where):
  torch_run = run_torch(GRADS * 64, clip=1.0)  # large enough that every step clips
  options = dict(init_scale=2.0**16, growth_interval=INTERVAL)
  if where == "inside":
    ours = run_jaxscale(GRADS * 64, inner=optax.chain(optax.clip_by_global_norm(1.0), optax.sgd(LR)), **options)
  else:
    ours = run_jaxscale_clip_in_front(GRADS * 64, 1.0, **options)
  assert [s for s, *_ in torch_run] == [s for s, *_ in ours]
  for (*_, t_w), (*_, o_w) in zip(torch_run, ours):
    np.testing.assert_allclose(o_w, t_w, rtol=1e-6)
  # torch's clip_grad_norm_ divides by `norm + 1e-6`, optax by `norm`: the last bits differ.
  assert any((t_w != o_w).any() for (*_, t_w), (*_, o_w) in zip(torch_run, ours))


def test_torch_several_optimizers_each_skip_on_their_own():
  torch = pytest.importorskip("torch")
  g_a, g_b = np.array([1.0, 2.0], np.float32), np.array([np.inf, 1.0], np.float32)
  a, b = torch.nn.Parameter(torch.ones(2)), torch.nn.Parameter(torch.ones(2))
  opt_a, opt_b = torch.optim.SGD([a], lr=LR), torch.optim.SGD([b], lr=LR)
  scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
  scaler.scale((a * torch.from_numpy(g_a)).sum() + (b * torch.from_numpy(g_b)).sum()).backward()
  scaler.step(opt_a)
  scaler.step(opt_b)
  scaler.update()
  assert scaler.get_scale() == 2.0**9  # one backoff
  np.testing.assert_array_equal(a.detach().numpy(), 1 - LR * g_a)  # `a` stepped, `b` did not
  np.testing.assert_array_equal(b.detach().numpy(), np.ones(2))

  params = {"a": jnp.ones(2), "b": jnp.ones(2)}
  labels = {"a": "a", "b": "b"}
  tx = jaxscale.dynamic_loss_scaling(optax.multi_transform({"a": optax.sgd(LR), "b": optax.sgd(LR)}, labels),
                                     init_scale=2.0**10)
  state = tx.init(params)
  loss = lambda p: linear_loss(p["a"], g_a) + linear_loss(p["b"], g_b)
  _, grads, finite = jaxscale.value_and_grad(loss)(jaxscale.find_scaler(state), params)
  updates, state = tx.update(grads, state, params, finite=finite)
  new = optax.apply_updates(params, updates)
  np.testing.assert_array_equal(new["a"], np.ones(2))  # one wrapper: one decision, both skip
  assert float(jaxscale.find_scaler(state).scale) == 2.0**9

  # torch's behaviour: one scaler, one `unscale_and_check` and skip per optimizer, one update.
  scaler = jaxscale.init(init_scale=2.0**10)
  grads = jax.grad(lambda p: jaxscale.scale(scaler, loss(p)))(params)
  new, flags = {}, []
  for name in params:
    g, finite = jaxscale.unscale_and_check(scaler, grads[name])
    new[name] = jnp.where(finite, params[name] - LR * g, params[name])
    flags.append(finite)
  scaler = jaxscale.update(scaler, jnp.all(jnp.array(flags)))
  np.testing.assert_array_equal(new["a"], a.detach().numpy())
  np.testing.assert_array_equal(new["b"], b.detach().numpy())
  assert float(scaler.scale) == 2.0**9


def test_torch_gradient_accumulation_matches_accumulating_inside_the_step():
  torch = pytest.importorskip("torch")
  k, grads = 2, GRADS[:8]  # four windows of two micro-batches; the third holds the inf
  w = torch.nn.Parameter(torch.ones(3))
  opt = torch.optim.SGD([w], lr=LR)
  scaler = torch.amp.GradScaler("cpu", init_scale=2.0**16, growth_interval=1)
  theirs = []
  for window in grads.reshape(-1, k, 3):
    for g in window:
      scaler.scale((w * torch.from_numpy(g)).sum() / k).backward()
    scaler.step(opt)
    scaler.update()
    opt.zero_grad()
    theirs.append((scaler.get_scale(), scaler._get_growth_tracker(), w.detach().numpy().copy()))

  tx = jaxscale.dynamic_loss_scaling(optax.sgd(LR), init_scale=2.0**16, growth_interval=1)
  w = jnp.ones(3)
  opt_state = tx.init(w)

  @jax.jit
  def step(w, opt_state, window):
    grad_fn = jaxscale.value_and_grad(lambda w, g: linear_loss(w, g) / k)
    results = [grad_fn(jaxscale.find_scaler(opt_state), w, g) for g in window]
    total = sum(grads for _, grads, _ in results)
    finite = functools.reduce(jnp.logical_and, [ok for *_, ok in results])
    updates, opt_state = tx.update(total, opt_state, w, finite=finite)
    return optax.apply_updates(w, updates), opt_state

  ours = []
  for window in grads.reshape(-1, k, 3):
    w, opt_state = step(w, opt_state, window)
    scaler = jaxscale.find_scaler(opt_state)
    ours.append((float(scaler.scale), int(scaler.growth_tracker), np.asarray(w)))
  assert_same_trajectory(theirs, ours)


def test_torch_gradient_penalty_recipe_matches():
  torch = pytest.importorskip("torch")
  lam, x = 0.5, np.array([0.5, -1.0, 2.0], np.float32)
  w = torch.nn.Parameter(torch.ones(3))
  opt = torch.optim.SGD([w], lr=LR)
  scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
  loss_t = lambda w: torch.sum((w * torch.from_numpy(x)) ** 2)
  for _ in range(2):
    opt.zero_grad()
    (scaled_grad,) = torch.autograd.grad(scaler.scale(loss_t(w)), [w], create_graph=True)
    grad = scaled_grad * (1.0 / scaler.get_scale())
    scaler.scale(loss_t(w) + lam * grad.pow(2).sum()).backward()
    scaler.step(opt)
    scaler.update()

  loss = lambda w: jnp.sum((w * x) ** 2)
  tx = jaxscale.dynamic_loss_scaling(optax.sgd(LR), init_scale=2.0**10)
  params = jnp.ones(3)
  opt_state = tx.init(params)

  @jax.jit
  def step(params, opt_state):  # docs/migrating/torch.md's `penalty_step`
    scaler = jaxscale.find_scaler(opt_state)

    def penalized(p):
      inner, _ = jaxscale.unscale_and_check(scaler, jax.grad(lambda p: jaxscale.scale(scaler, loss(p)))(p))
      return loss(p) + lam * jnp.sum(inner**2)

    grads = jax.grad(lambda p: jaxscale.scale(scaler, penalized(p)))(params)
    grads, finite = jaxscale.unscale_and_check(scaler, grads)
    updates, opt_state = tx.update(grads, opt_state, params, finite=finite)
    return optax.apply_updates(params, updates), opt_state

  for _ in range(2):
    params, opt_state = step(params, opt_state)
  np.testing.assert_allclose(params, w.detach().numpy(), rtol=1e-6)


def test_torch_lr_scheduler_steps_on_skipped_steps_and_warns():
  torch = pytest.importorskip("torch")
  grads = np.array([[np.inf, 1.0], [1.0, 1.0], [np.nan, 1.0], [1.0, 1.0], [1.0, 1.0]], np.float32)
  w = torch.nn.Parameter(torch.ones(2))
  opt = torch.optim.SGD([w], lr=1.0)
  sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 0.5**step)
  scaler = torch.amp.GradScaler("cpu", growth_interval=100)
  theirs = []
  with pytest.warns(UserWarning, match=r"lr_scheduler.step\(\)` before `optimizer.step\(\)"):
    for g in grads:
      opt.zero_grad()
      scaler.scale((w * torch.from_numpy(g)).sum()).backward()
      scaler.step(opt)
      scaler.update()
      sched.step()
      theirs.append(w.detach().numpy().copy())
  # torch: the i-th iteration uses lr 0.5**i, skipped or not: steps 1, 3, 4 apply 0.5, 0.125, 0.0625.
  np.testing.assert_array_equal(theirs[-1], 1 - (0.5 + 0.125 + 0.0625))

  ours = run_jaxscale(grads, inner=optax.sgd(lambda count: 0.5**count), growth_interval=100)
  # jaxscale: the schedule counts applied steps only: 1, 0.5, 0.25.
  np.testing.assert_array_equal(ours[-1][-1], 1 - (1 + 0.5 + 0.25))


def test_torch_refuses_to_unscale_float16_gradients():
  torch = pytest.importorskip("torch")
  w = torch.nn.Parameter(torch.ones(2, dtype=torch.float16))
  opt = torch.optim.SGD([w], lr=LR)
  scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
  scaler.scale(w.float().sum()).backward()
  with pytest.raises(ValueError, match="Attempting to unscale FP16 gradients"):
    scaler.unscale_(opt)
  # jaxscale casts them to float32 first: a true gradient of 2**-30 (below float16's smallest
  # subnormal, 2**-24), scaled by 2**10, survives.
  grads, finite = jaxscale.unscale_and_check(jaxscale.init(init_scale=2.0**10), jnp.full(2, 2.0**-20, jnp.float16))
  assert grads.dtype == jnp.float32 and bool(finite) and float(grads[0]) == 2.0**-30


# ------------------------------------------------------------------ mpx (mixed-precision-for-jax, for Equinox)

MPX_PERIOD = INTERVAL


def mpx_scaling(init_scale, *, period=MPX_PERIOD, min_scale=1.0, factor=2):
  mpx = pytest.importorskip("mpx")
  return mpx.DynamicLossScaling(jnp.float32(init_scale), jnp.float32(min_scale), factor=factor, period=period)


def run_mpx(grads, *, init_scale=2.0**14):
  """mpx's documented Equinox loop: `mpx.filter_value_and_grad(fun, scaling)`, then `mpx.optimizer_update`."""
  mpx = pytest.importorskip("mpx")
  eqx = pytest.importorskip("equinox")
  tx = optax.sgd(LR)

  @eqx.filter_jit
  def step(w, opt_state, scaling, g):
    _, scaling, finite, grads = mpx.filter_value_and_grad(linear_loss, scaling)(w, g)
    w, opt_state = mpx.optimizer_update(w, tx, opt_state, grads, finite)
    return w, opt_state, scaling

  w = jnp.ones(grads.shape[1], jnp.float32)
  opt_state, scaling = tx.init(w), mpx_scaling(init_scale)
  trajectory = []
  for g in grads:
    w, opt_state, scaling = step(w, opt_state, scaling, g)
    trajectory.append((float(scaling.loss_scaling), int(scaling.counter), np.asarray(w)))
  return trajectory


def sgd_on_true_gradients(grads, *, halved=()):
  """float32 SGD from ones on the finite rows of `grads` (half the gradient at the steps in `halved`)."""
  w, out = np.ones(grads.shape[1], np.float32), []
  for step, g in enumerate(grads):
    if np.isfinite(g).all():
      w = (w - np.float32(LR) * (g / 2 if step in halved else g)).astype(np.float32)
    out.append(w)
  return out


def test_mpx_counts_period_and_halves_and_doubles_like_jaxscale():
  theirs = run_mpx(GRADS)
  ours = run_jaxscale(GRADS, init_scale=2.0**14, growth_interval=MPX_PERIOD, min_scale=1.0)
  for step, ((t_scale, t_count, _), (o_scale, o_count, _)) in enumerate(zip(theirs, ours, strict=True)):
    assert (t_scale, t_count) == (o_scale, o_count), f"step {step}"
  scales = [s for s, *_ in ours]
  assert max(scales) > 2.0**14 > min(scales)


def test_mpx_unscales_by_the_next_scale_so_a_growth_step_takes_half_the_gradient():
  theirs, ours = run_mpx(GRADS), run_jaxscale(GRADS, init_scale=2.0**14, growth_interval=MPX_PERIOD)
  scales = [2.0**14] + [s for s, *_ in ours]
  growths = {step for step in range(len(GRADS)) if scales[step + 1] > scales[step]}
  assert growths  # the sequence grows the scale
  for step, (want, (*_, w)) in enumerate(zip(sgd_on_true_gradients(GRADS), ours)):
    np.testing.assert_array_equal(w, want, err_msg=f"jaxscale, step {step}")
  for step, (want, (*_, w)) in enumerate(zip(sgd_on_true_gradients(GRADS, halved=growths), theirs)):
    np.testing.assert_array_equal(w, want, err_msg=f"mpx, step {step}")
  # The loss mpx returns is unscaled by the next scale too: half the true loss on a growth step.
  mpx = pytest.importorskip("mpx")
  w, g = jnp.ones(3), jnp.array([0.5, 0.25, 1.0])
  loss, scaling, _, grads = mpx.filter_value_and_grad(linear_loss, mpx_scaling(2.0**10, period=1))(w, g)
  assert float(scaling.loss_scaling) == 2.0**11 and float(loss) == 1.75 / 2
  np.testing.assert_array_equal(grads, g / 2)
  loss, grads, _ = jaxscale.value_and_grad(linear_loss)(jaxscale.init(init_scale=2.0**10, growth_interval=1), w, g)
  assert float(loss) == 1.75
  np.testing.assert_array_equal(grads, g)


def test_mpx_clips_the_scale_at_float16_max():
  scaling = mpx_scaling(2.0**15, period=1)
  grown = scaling.adjust(jnp.array(True))
  assert float(grown.loss_scaling) == 65504.0  # not a power of two: unscaling is no longer exact
  assert float(grown.adjust(jnp.array(False)).loss_scaling) == 32752.0
  assert float(jaxscale.update(jaxscale.init(init_scale=2.0**15, growth_interval=1), True).scale) == 2.0**16
  clipped = jaxscale.init(init_scale=2.0**15, growth_interval=1, max_scale=65504.0)
  assert float(jaxscale.update(clipped, True).scale) == 65504.0


def test_mpx_has_one_factor_for_growth_and_back_off():
  scaling = mpx_scaling(2.0**10, period=1, factor=4)
  state = jaxscale.init(init_scale=2.0**10, growth_interval=1, growth_factor=4.0, backoff_factor=0.25)
  for finite in [True, False, False]:
    scaling, state = scaling.adjust(jnp.array(finite)), jaxscale.update(state, finite)
    assert float(scaling.loss_scaling) == float(state.scale)


def test_mpx_needs_an_array_scale_and_a_min_scale():
  mpx = pytest.importorskip("mpx")
  with pytest.raises(TypeError):
    mpx.DynamicLossScaling(jnp.float32(2.0**15))  # min_loss_scaling has no default
  with pytest.raises(AttributeError):
    mpx.DynamicLossScaling(2.0**15, jnp.float32(1.0))  # a Python float has no `.ndim`
  state = jaxscale.init(init_scale=2.0)  # jaxscale: floats, and min_scale 0 (backs off below 1)
  for _ in range(3):
    state = jaxscale.update(state, False)
  assert float(state.scale) == 0.25


def test_mpx_period_and_factor_are_static_under_filter_jit():
  eqx = pytest.importorskip("equinox")
  traces = []

  @eqx.filter_jit
  def adjust(scaling):
    traces.append(1)
    return scaling.adjust(jnp.array(True))

  adjust(mpx_scaling(2.0**10, period=100))
  adjust(mpx_scaling(2.0**10, period=200))
  assert len(traces) == 2  # a new period compiles the step again
  ours = eqx.filter_jit(lambda s: (traces.append(1), jaxscale.update(s, True))[1])
  traces.clear()
  state = ours(jaxscale.init(growth_interval=100))
  ours(jaxscale.configure(state, growth_interval=200))
  assert len(traces) == 1  # jaxscale's options are arrays in the state


def test_mpx_casts_every_argument_to_float16_and_returns_float32_gradients():
  mpx = pytest.importorskip("mpx")
  eqx = pytest.importorskip("equinox")
  seen = []

  def loss(w, x):
    seen.append((w.dtype, x.dtype))
    return jnp.sum(w * x)

  w, x = jnp.ones(2, jnp.float32), jnp.ones(2, jnp.float32)
  _, _, _, grads = mpx.filter_value_and_grad(loss, mpx_scaling(2.0**10))(w, x)
  assert seen[-1] == (jnp.float16, jnp.float16) and grads.dtype == jnp.float32
  # jaxscale leaves dtypes to the model (a Policy, autocast): what goes in is what is computed.
  _, grads, _ = jaxscale.value_and_grad(loss)(jaxscale.init(init_scale=2.0**10), w, x)
  assert seen[-1] == (jnp.float32, jnp.float32) and grads.dtype == jnp.float32
  w16 = w.astype(jnp.float16)
  _, _, _, grads = mpx.filter_value_and_grad(loss, mpx_scaling(2.0**10))(w16, x)
  assert grads.dtype == jnp.float32  # so eqx.apply_updates turns a float16 model into a float32 one
  assert eqx.apply_updates(w16, grads).dtype == jnp.float32
  # jaxscale's gradients of float16 parameters are float32 too (cast before they are unscaled);
  # master weights turn them into float16 updates, so the model stays float16.
  _, ours, _ = jaxscale.value_and_grad(loss)(jaxscale.init(init_scale=2.0**10), w16, x.astype(jnp.float16))
  assert seen[-1] == (jnp.float16, jnp.float16) and ours.dtype == jnp.float32
  np.testing.assert_array_equal(ours, grads)  # x: exact in both
  tx = jaxscale.master_weights(jaxscale.dynamic_loss_scaling(optax.sgd(LR), init_scale=2.0**10))
  updates, _ = tx.update(ours, tx.init(w16), w16)
  assert eqx.apply_updates(w16, updates).dtype == jnp.float16


def test_mpx_returns_an_inf_loss_when_the_scaled_float16_loss_overflows():
  mpx = pytest.importorskip("mpx")
  w, g = jnp.ones(3), jnp.array([0.5, 0.25, 1.0])  # loss 1.75: times 65504 overflows float16
  loss, _, finite, grads = mpx.filter_value_and_grad(linear_loss, mpx_scaling(65504.0))(w, g)
  assert np.isinf(loss) and bool(finite)  # the step is taken; the logged loss is inf
  np.testing.assert_array_equal(grads, g)
  loss, grads, finite = jaxscale.value_and_grad(linear_loss)(jaxscale.init(init_scale=65504.0), w, g)
  assert float(loss) == 1.75 and bool(finite)  # `fun`'s own value, never scaled
  np.testing.assert_array_equal(grads, g)


def test_mpx_skips_only_in_optimizer_update():
  mpx = pytest.importorskip("mpx")
  w, g = jnp.ones(3), jnp.array([0.5, jnp.inf, 1.0])
  tx = optax.adam(LR)
  _, _, finite, grads = mpx.filter_value_and_grad(linear_loss, mpx_scaling(2.0**10))(w, g)
  assert not bool(finite)
  new_w, new_state = mpx.optimizer_update(w, tx, tx.init(w), grads, finite)
  np.testing.assert_array_equal(new_w, w)  # skipped, with the flag: parameters and state kept
  jax.tree.map(np.testing.assert_array_equal, new_state, tx.init(w))
  updates, _ = tx.update(grads, tx.init(w), w)
  assert np.isnan(optax.apply_updates(w, updates)).any()  # Optax alone is not told: NaN parameters
  # jaxscale's skip is in the optimizer: a plain `tx.update` of the true gradients, no flag, skips.
  ours = jaxscale.dynamic_loss_scaling(tx, init_scale=2.0**10)
  _, grads, _ = jaxscale.value_and_grad(linear_loss)(jaxscale.find_scaler(ours.init(w)), w, g)
  updates, _ = ours.update(grads, ours.init(w), w)
  np.testing.assert_array_equal(optax.apply_updates(w, updates), w)


def test_mpx_checks_finiteness_per_device():
  mpx = pytest.importorskip("mpx")
  w = jnp.ones(3)
  per_device = jnp.array([[0.5, jnp.inf, 1.0], [0.5, 0.25, 1.0]])  # one device's batch overflows

  def theirs(g):
    _, scaling, finite, _ = mpx.filter_value_and_grad(linear_loss, mpx_scaling(2.0**10))(w, g)
    return scaling.loss_scaling, finite

  def ours(scaler, g):
    _, _, finite = jaxscale.value_and_grad(linear_loss, axis_name="devices")(scaler, w, g)
    return finite

  scales, flags = jax.vmap(theirs, axis_name="devices")(per_device)
  assert flags.tolist() == [False, True] and scales.tolist() == [2.0**9, 2.0**10]  # the replicas diverge
  scalers = jax.tree.map(lambda a: jnp.stack([a, a]), jaxscale.init(init_scale=2.0**10))  # one per device
  assert jax.vmap(ours, axis_name="devices")(scalers, per_device).tolist() == [False, False]


def test_mpx_force_full_precision_is_a_boundary_cast_to_float32_with_float16_outputs():
  mpx = pytest.importorskip("mpx")
  x = jnp.array([1.0, 2.0, 3.0], jnp.float16)

  def normalise(x):
    assert x.dtype == jnp.float32
    return jax.nn.softmax(x)

  theirs = mpx.force_full_precision(normalise)(x)
  assert theirs.dtype == jnp.float16
  policy = jaxscale.get_policy("params=float32,compute=float32,output=float16")
  ours = policy.cast_to_output(normalise(*policy.cast_to_compute((x,))))
  assert ours.dtype == jnp.float16
  np.testing.assert_array_equal(ours, theirs)
  # autocast casts nothing on the way in: per operation, its softmax's exp and sum run in float32.
  per_operation = jaxscale.autocast(jax.nn.softmax, "float32")(x)
  assert per_operation.dtype == jnp.float32
  np.testing.assert_allclose(per_operation, theirs, rtol=1e-3)
