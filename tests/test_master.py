"""master_weights: equal to a float32-parameter run of the same optimizer, 16-bit updates that land
exactly, tiny true gradients kept by a float32 unscale, skipped steps, chain, Orbax, one compilation,
the wrong nesting refused, and plain float16 Adam stalling on real data where the master copy keeps
learning; the Kahan and stochastic-rounding methods against float64 references."""

import functools
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxscale
from _jit import compilations
from jaxscale import _rounding

# These tests hand the wrapper gradients of their own making, with no gradient site: the warning
# for an update without its `finite` flag is tested in tests/test_contract.py.
pytestmark = pytest.mark.filterwarnings("ignore:jaxscale. `dynamic_loss_scaling`'s update got no `finite` flag")

STEPS = 12
INF_STEP = 5


def random_grads(step, like, scale=2.0):
  """Gradients of a scaled loss, in each parameter's dtype; step INF_STEP overflows."""
  g = jax.tree.map(lambda p: (scale * jax.random.normal(jax.random.key(step), p.shape)).astype(p.dtype), like)
  if step == INF_STEP:
    g["w"] = g["w"].at[0].set(jnp.inf)
  return g


def f16_params():
  w = jax.random.normal(jax.random.key(7), (16,)).astype(jnp.float16).at[3].set(-0.0)
  return {"w": w, "b": jnp.linspace(-1, 1, 4)}  # b stays float32


def make_inner():
  return jaxscale.dynamic_loss_scaling(
      optax.chain(optax.clip_by_global_norm(10.0), optax.adamw(1e-3)), init_scale=2.0**10, growth_interval=3
  )


def run(tx, params, grads_of, steps=STEPS):
  @jax.jit
  def step(params, opt_state, grads):
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state

  opt_state, history = tx.init(params), []
  for i in range(steps):
    params, opt_state = step(params, opt_state, grads_of(i))
    history.append((params, opt_state))
  return history, step


# The two runs are two compiled programs: XLA:CPU may contract a multiply-add of Adam's moments into
# a fused multiply-add in one and not in the other (seen since the true-gradient contract: element
# 0 of `mu` one ulp apart at step 1). Each contraction skips one rounding, at most half a float32
# ulp (2**-24 relative) of the moment, and the moments carry it on with decay below 1, so after
# STEPS steps the moments, and with them the updates and the master, are within STEPS * 2**-23
# (relative) of the reference's; every other difference would be far larger.
DRIFT = STEPS * 2.0**-23


def test_equals_float32_reference_run():
  params = f16_params()
  tx = jaxscale.master_weights(make_inner())
  history, step = run(tx, (params), lambda i: (random_grads(i, params)))
  # The reference: the same inner optimizer on float32 parameters, fed the same gradients in float32.
  params32 = jax.tree.map(lambda p: p.astype(jnp.float32), (params))
  grads32 = lambda i: jax.tree.map(lambda g: g.astype(jnp.float32), (random_grads(i, params)))
  reference, _ = run(make_inner(), params32, grads32)
  before = params["w"]
  for (p, s), (p_ref, s_ref) in zip(history, reference):
    assert p["w"].dtype == jnp.float16 and p["b"].dtype == jnp.float32
    np.testing.assert_allclose(s.master["w"], p_ref["w"], rtol=DRIFT, atol=0)  # the master is the float32 run
    if bool(jaxscale.find_scaler(s).last_skipped):
      np.testing.assert_array_equal(p["w"], before)  # a skipped step moves nothing
    else:
      assert_lands(before, p["w"], s.master["w"].astype(jnp.float16))
    before = p["w"]
    np.testing.assert_allclose(p["b"], p_ref["b"], rtol=DRIFT, atol=0)  # float32 leaves pass through
    assert isinstance(s.master["b"], optax.MaskedNode)  # and have no copy
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=DRIFT, atol=0), s.inner_state, s_ref)
  assert int(jaxscale.find_scaler(history[-1][1]).skipped_steps) == 1
  assert compilations(step) == 1  # one compilation for the whole run, skipped step included


def assert_lands(before, after, target):
  """``after`` is ``target`` wherever the step from ``before`` stays within a factor of two (same
  sign: the difference is then exact in 16 bits); elsewhere within one ulp of the step's size."""
  b, a, t = (np.asarray(x).astype(np.float64) for x in (before, after, target))
  near = (np.sign(b) == np.sign(t)) & (np.abs(t) <= 2 * np.abs(b)) & (np.abs(b) <= 2 * np.abs(t))
  np.testing.assert_array_equal(a[near | (b == t)], t[near | (b == t)])
  step = np.abs(t - b)
  fi = jnp.finfo(before.dtype)
  ulp = 2.0 ** np.maximum(np.floor(np.log2(np.where(step > 0, step, 1))) - fi.nmant, fi.minexp - fi.nmant)
  assert np.all(np.abs(a - t) <= ulp)


def chex_equal(a, b):
  jax.tree.map(np.testing.assert_array_equal, a, b)


METHODS = ["float32", "kahan", "stochastic_rounding"]


def bits(tree):
  return [np.asarray(x).tobytes() for x in jax.tree.leaves(tree)]


@pytest.mark.parametrize("method", METHODS)
def test_skipped_step_leaves_everything_bitwise(method):
  params = f16_params()
  tx = jaxscale.master_weights(make_inner(), method=method)
  history, _ = run(tx, params, lambda i: random_grads(i, params), steps=INF_STEP + 1)
  (before, state_before), (after, state_after) = history[-2:]
  assert bool(jaxscale.metrics(state_after)["last_skipped"])
  assert bits(after) == bits(before)  # -0.0 in w keeps its sign
  # The master, the compensation, the key and the inner state: the whole state.
  assert bits(state_after._replace(inner_state=None)) == bits(state_before._replace(inner_state=None))
  assert bits(state_after.inner_state.inner_state) == bits(state_before.inner_state.inner_state)
  if method != "float32":  # the step before moved them, so the comparison above is not vacuous
    (older, state_older) = history[-3]
    assert bits(before) != bits(older)
    assert bits(state_before._replace(inner_state=None)) != bits(state_older._replace(inner_state=None))


@pytest.mark.parametrize(
    "method, comes_back_to", [("float32", 64000.0), ("kahan", 64000.0), ("stochastic_rounding", 63504.0)]
)
def test_a_parameter_beyond_the_range_saturates_and_comes_back(method, comes_back_to):
  """A float16 parameter whose value leaves the range is held at 65504, not inf: a skipped step
  keeps it bit for bit, and it comes back when the steps do. (It used to become inf, then NaN on
  the skipped step: inf - inf, and stay NaN for good.) The float32 master holds 66000, and so does
  Kahan's compensation (15.5 ulps of 32); stochastic rounding keeps nothing beyond 65504, and
  rounds 63504 to one of its neighbours 63488 and 63520."""
  tx = jaxscale.master_weights(jaxscale.dynamic_loss_scaling(optax.sgd(1.0), init_scale=1.0), method=method)

  @jax.jit
  def step(p, s, g):
    u, s = tx.update(g, s, p)
    return optax.apply_updates(p, u), s

  p = jnp.full(3, 65000.0, jnp.float16)
  state = tx.init(p)
  p, state = step(p, state, jnp.full(3, -1000.0, jnp.float16))  # the float32 master: 66000
  assert p.dtype == jnp.float16 and np.all(p == 65504.0)
  p_skipped, state_skipped = step(p, state, jnp.array([1.0, jnp.inf, 1.0], jnp.float16))
  assert bits(p_skipped) == bits(p)  # the scaler backs off; nothing else changes
  assert bits(state_skipped._replace(inner_state=None)) == bits(state._replace(inner_state=None))
  p, state = step(p, state, jnp.full(3, 2000.0, jnp.float16))
  assert np.all(np.abs(np.asarray(p, np.float64) - comes_back_to) <= (16 if method == "stochastic_rounding" else 0))


@pytest.mark.parametrize("method", ["float32", "kahan"])
def test_a_parameter_promoted_to_float32_is_an_error(method):
  """What `eqx.apply_updates` did with float32 updates: the float16 model came back float32, and
  master_weights went on training it in float32 without a word."""
  params = {"w": jnp.ones(3, jnp.float16), "b": jnp.zeros(2)}
  tx = jaxscale.master_weights(optax.sgd(0.1), method=method)
  state = tx.init(params)
  promoted = {**params, "w": params["w"].astype(jnp.float32)}
  message = r"initialised with a 16-bit parameter at \['w'\], and now gets one of dtype float32"
  with pytest.raises(ValueError, match=message):
    tx.update(promoted, state, promoted)


def test_an_unknown_method_or_a_stray_key_is_a_value_error():
  with pytest.raises(ValueError, match=r"method='fp32'.*'float32', 'kahan', 'stochastic_rounding'"):
    jaxscale.master_weights(optax.sgd(0.1), method="fp32")
  with pytest.raises(ValueError, match=r"`key` only with method='stochastic_rounding'"):
    jaxscale.master_weights(optax.sgd(0.1), method="kahan", key=1)
  with pytest.raises(ValueError, match=r"pass an int seed"):
    array_keyed = jaxscale.master_weights(optax.sgd(0.1), method="stochastic_rounding", key=jnp.zeros(3))
    array_keyed.init(jnp.ones(2, jnp.float16))


def sum_in_float16_steps(method, p0, steps, key=0):
  """``p0`` (float16) after ``steps`` (float32 rows) through ``master_weights(identity)``."""
  seeded = {"key": key} if method == "stochastic_rounding" else {}
  tx = jaxscale.master_weights(optax.identity(), method=method, **seeded)

  @jax.jit
  def run_all(p, us):
    def body(carry, u):
      p, s = carry
      du, s = tx.update(u, s, p)
      return (p + du, s), None  # added in float16, as `eqx.apply_updates` does

    return jax.lax.scan(body, (p, tx.init(p)), us)[0][0]

  return run_all(jnp.asarray(p0), jnp.asarray(steps))


def ulps(p):
  """The spacing of ``p``'s dtype above ``|p|`` (NumPy's and ml_dtypes' `spacing`), as float64."""
  p = np.asarray(p)
  return np.abs(np.spacing(np.abs(p))).astype(np.float64)


@pytest.mark.parametrize("dtype", [jnp.float16, jnp.bfloat16])
def test_kahan_follows_float64_within_an_ulp_where_16_bit_addition_does_not_move(dtype):
  """10,000 steps, each below half an ulp of its parameter (with a drift, so that the sum moves
  hundreds of ulps, away from zero): the Kahan parameters stay within one ulp of the float64 sum of the same
  float32 steps; plain 16-bit addition leaves every parameter where it started."""
  rng = np.random.default_rng(0)
  p0 = rng.uniform(0.01, 2.0, 64).astype(dtype) * rng.choice([-1, 1], 64).astype(dtype)
  # The drift goes away from zero: errors count in ulps of the largest value on the way.
  drift = (rng.uniform(-0.45, 0.4, (10_000, 64)) + 0.05) * np.sign(p0.astype(np.float32))
  steps = (drift * ulps(p0)).astype(np.float32)
  reference = p0.astype(np.float64) + steps.astype(np.float64).sum(axis=0)
  kahan = np.asarray(sum_in_float16_steps("kahan", p0, steps))
  # measured: 0.50 (float16), 0.53 (bfloat16)
  assert np.all(np.abs(kahan.astype(np.float64) - reference) <= ulps(kahan))
  assert np.mean(np.abs(reference - p0.astype(np.float64)) / ulps(p0)) > 100
  plain = jnp.asarray(p0)
  for u in steps[:200]:  # every step rounds away: no need for all 10,000
    plain = plain + jnp.asarray(u).astype(dtype)
  np.testing.assert_array_equal(plain, p0)


def test_stochastic_rounding_is_unbiased_and_reproducible():
  """4096 parameters at 1.0, 200 steps of -0.3 ulp each (plain float16 would stay at 1.0): the
  mean lands on the exact sum within 4 standard errors, and the key fixes every bit."""
  n, steps = 4096, 200
  p0 = np.ones(n, np.float16)
  u = np.full((steps, n), -0.3 * 2.0**-11, np.float32)
  exact = 1.0 + u.astype(np.float64).sum(axis=0)
  got = np.asarray(sum_in_float16_steps("stochastic_rounding", p0, u)).astype(np.float64)
  # Each step adds at most ulp**2 / 4 of variance (ulp 2**-11 above 1.0, 2**-12 below).
  standard_error = np.sqrt(steps / 4 / n) * 2.0**-11
  assert abs(got.mean() - exact.mean()) < 4 * standard_error
  assert got.std() > 0  # rounded at random, not to nearest
  same = np.asarray(sum_in_float16_steps("stochastic_rounding", p0, u))
  other = np.asarray(sum_in_float16_steps("stochastic_rounding", p0, u, key=jax.random.key(1)))
  assert same.tobytes() == got.astype(np.float16).tobytes() and other.tobytes() != same.tobytes()


def test_stochastic_rounding_draws_new_numbers_each_step():
  tx = jaxscale.master_weights(optax.identity(), method="stochastic_rounding", key=3)
  p = jnp.ones(1000, jnp.float16)
  state = tx.init(p)
  u = jnp.full(1000, 0.5 * 2.0**-10, jnp.float32)  # half an ulp up: up or down with equal odds
  first, state = tx.update(u, state, p)
  second, _ = tx.update(u, state, p)
  assert 0.4 < np.mean(np.asarray(first) > 0) < 0.6
  assert not np.array_equal(first, second)


def test_gradients_below_float16_subnormals_reach_the_master():
  """True gradients of 2**-30 exist in float16 only scaled; the gradient site unscales them in float32."""
  true_grad = 2.0**-30 * jnp.arange(1, 5, dtype=jnp.float32)
  scaled = (true_grad * 2.0**16).astype(jnp.float16)  # 2**-14 * k: representable
  np.testing.assert_array_equal(scaled.astype(jnp.float32), true_grad * 2.0**16)
  params = jnp.zeros(4, jnp.float16)
  tx = jaxscale.master_weights(jaxscale.dynamic_loss_scaling(optax.sgd(1.0), init_scale=2.0**16))
  state = tx.init(params)
  grads, finite = jaxscale.unscale_and_check(jaxscale.find_scaler(state), scaled)
  assert grads.dtype == jnp.float32
  np.testing.assert_array_equal(grads, true_grad)
  _, state = tx.update(grads, state, params, finite=finite)
  np.testing.assert_array_equal(state.master, -true_grad)  # exactly what float32 gives
  # Unscaled in float16 instead, every one of them would have flushed to zero.
  assert not np.any(np.asarray(scaled) * np.float16(2.0**-16))


@pytest.mark.parametrize("method", ["float32", "kahan", "stochastic_rounding"])
def test_either_nesting_trains_the_same(method):
  # The wrapper no longer unscales: around master_weights or inside it, the same true gradients give
  # the same parameters, and a skipped step keeps everything.
  params = {"w": jnp.linspace(-1, 1, 6, dtype=jnp.float16)}
  grads = [{"w": jnp.full(6, g, jnp.float32)} for g in (1e-3, jnp.inf, -2e-3, 5e-4)]
  runs = [jaxscale.master_weights(jaxscale.dynamic_loss_scaling(optax.adam(1e-2)), method=method),
          jaxscale.dynamic_loss_scaling(jaxscale.master_weights(optax.adam(1e-2), method=method))]
  finals = []
  for tx in runs:
    p, state = params, tx.init(params)
    for g in grads:
      updates, state = jax.jit(tx.update)(g, state, p)
      p = optax.apply_updates(p, updates)
    finals.append(p)
    assert int(jaxscale.find_scaler(state).skipped_steps) == 1
  np.testing.assert_array_equal(finals[0]["w"], finals[1]["w"])


def test_inside_chain_and_found_by_find_scaler():
  params = {"w": jnp.ones(3, jnp.float16)}
  tx = optax.chain(jaxscale.master_weights(make_inner()))
  opt_state = tx.init(params)
  assert float(jaxscale.find_scaler(opt_state).scale) == 2.0**10
  updates, _ = tx.update({"w": jnp.full(3, 0.5, jnp.float16)}, opt_state, params)
  assert updates["w"].dtype == jnp.float16


def test_needs_params():
  tx = jaxscale.master_weights(optax.sgd(1.0))
  with pytest.raises(ValueError, match="needs the parameters"):
    tx.update(jnp.ones(2, jnp.float16), tx.init(jnp.ones(2, jnp.float16)))


def finite_values(dtype, n, rng):
  """Random bit patterns of ``dtype``: every exponent, subnormals and zeros included; no inf/NaN."""
  bits = rng.integers(0, 2**16, n, dtype=np.uint16).view(jnp.dtype(dtype))
  return bits[np.isfinite(bits.astype(np.float32))]


def make_master(p, dtype, rng):
  rel = rng.choice([0.0, 1e-6, 1e-4, 1e-2, 0.5, 2.0, 1e3, 1e6], p.size) * rng.normal(size=p.size)
  kinds = rng.integers(0, 3, p.size)
  return np.where(
      kinds == 0, p.astype(np.float32) * (1 + rel),  # a step relative to the parameter
      np.where(kinds == 1, finite_values(dtype, 2 * p.size, rng)[: p.size].astype(np.float32),  # anywhere
               rng.normal(size=p.size) * 1e-3),  # near zero
  ).astype(np.float32)


@pytest.mark.parametrize("dtype", [jnp.float16, jnp.bfloat16])
def test_updates_land_exactly_on_the_cast_master(dtype):
  rng = np.random.default_rng(0)
  p = finite_values(dtype, 200_000, rng)
  finfo = jnp.finfo(dtype)
  extremes = np.array(
      [0.0, -0.0, float(finfo.max), -float(finfo.max), float(finfo.tiny), float(finfo.smallest_subnormal)], np.float32
  )
  p = np.concatenate([p, extremes.astype(dtype)])
  with np.errstate(over="ignore"):  # a master beyond the dtype's range is legal: it saturates
    master = make_master(p, dtype, rng)
    master[:6] = [np.inf, -np.inf, 1e30, 7e4, -1e-30, 3e-8]  # beyond the range, round to zero
  target = np.clip(master, -float(finfo.max), float(finfo.max)).astype(dtype)

  tx = jaxscale.master_weights(optax.identity())
  state = jaxscale.MasterWeightsState(jnp.asarray(master), optax.EmptyState())
  with jax.numpy_dtype_promotion("strict"):  # no silent promotion in master_weights' own code
    updates, _ = jax.jit(tx.update)(jnp.zeros(p.shape, dtype), state, jnp.asarray(p))
    assert updates.dtype == dtype  # `eqx.apply_updates` and `p + u` keep the parameters' dtype
    new = np.asarray(optax.apply_updates(jnp.asarray(p), updates))
  assert np.all(np.isfinite(new.astype(np.float32)))  # saturated, never inf
  # Values or steps below float32's smallest normal (XLA flushes them to zero; bfloat16 only), and
  # steps beyond the dtype's range (saturated) are left out.
  p64, t64, new64 = (x.astype(np.float64) for x in (p, target, new))
  tiny = lambda x: (x != 0) & (np.abs(x) < np.finfo(np.float32).tiny)
  left_out = tiny(p64) | tiny(t64) | tiny(t64 - p64) | (np.abs(t64 - p64) > float(finfo.max))
  assert dtype == jnp.bfloat16 or not np.any(tiny(p64) | tiny(t64) | tiny(t64 - p64))
  assert np.mean(left_out) < 0.02
  assert_lands(p[~left_out], new[~left_out], target[~left_out])
  near = (np.sign(p64) == np.sign(t64)) & (np.abs(t64) <= 2 * np.abs(p64)) & (np.abs(p64) <= 2 * np.abs(t64))
  assert np.sum(near & ~left_out) > 40_000 and np.mean(new64 == t64) > 0.5
  same = (target.view(np.uint16) == p.view(np.uint16)) & ~left_out
  assert np.array_equal(new.view(np.uint16)[same], p.view(np.uint16)[same])  # unchanged: bit for bit


def test_a_step_too_far_for_16_bits_lands_within_an_ulp_of_its_size():
  """A parameter falling from 60000 to 1.001 in one step: no float16 update lands on the target
  (60000's neighbours are 32 apart), so it lands within 32 of it; the next step gets there."""
  p, target = jnp.float16(60000.0), jnp.float16(1.0 + 2.0**-10)
  tx = jaxscale.master_weights(optax.identity())
  state = jaxscale.MasterWeightsState(target.astype(jnp.float32), optax.EmptyState())
  updates, state = tx.update(jnp.float16(0), state, p)
  p = optax.apply_updates(p, updates)
  assert p != target and abs(float(p) - float(target)) <= 32
  updates, _ = tx.update(jnp.float16(0), state, p)
  assert optax.apply_updates(p, updates) == target


@pytest.mark.parametrize("dtype, start, goal", [(jnp.float16, 32.0, 0.007), (jnp.bfloat16, 4096.0, 6.0)])
@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_a_step_onto_zero_keeps_its_value_where_the_float32_master_does(dtype, start, goal, jit):
  """One sgd step from `start` to `goal`, far below half an ulp of `start`: the rounded difference
  lands on 0, whose spacing (2**-24 in float16, float32's 2**-126 in bfloat16) would make the
  remainder saturate the 16-bit compensation (0.0039 of 0.007 kept in float16, 3.98 of 6 in
  bfloat16). Parameter plus compensation must hold the goal, as the float32 master does."""
  p = jnp.asarray([start], dtype)
  grad = jnp.asarray([start - goal], jnp.float32)  # exact in float32
  held = {}
  for method in ("float32", "kahan"):
    tx = jaxscale.master_weights(optax.sgd(1.0), method=method)
    update = jax.jit(tx.update) if jit else tx.update
    updates, state = update(grad, tx.init(p), p)
    new = optax.apply_updates(p, updates)
    if method == "float32":
      held[method] = np.float64(state.master[0])
    else:
      held[method] = np.float64(new[0]) + np.float64(state.compensation[0]) * ulps(new)[0]
      comp_ulp = float(jnp.finfo(dtype).eps)  # the compensation's relative spacing, 2**-nmant
  exact = start - np.float64(grad[0])  # the gradient is float32's nearest to start - goal; exact in float32
  assert held["float32"] == exact and abs(exact - goal) < 1e-6
  # The compensation is the remainder (below an ulp of `start`'s binade) in units of the new
  # parameter's ulp, rounded once to 16 bits: off by at most half its own relative spacing.
  remainder = abs(exact - float(new[0]))
  assert abs(held["kahan"] - exact) <= remainder * comp_ulp / 2, held


@pytest.mark.parametrize("method", METHODS)
def test_orbax_round_trip(tmp_path, method):
  import orbax.checkpoint as ocp

  params = f16_params()
  tx = jaxscale.master_weights(make_inner(), method=method)
  history, step = run(tx, params, lambda i: random_grads(i, params), steps=4)
  saved = {"params": history[-1][0], "opt_state": history[-1][1]}
  ckpt = ocp.StandardCheckpointer()
  ckpt.save(tmp_path / "ckpt", saved)
  ckpt.wait_until_finished()
  restored = ckpt.restore(tmp_path / "ckpt", jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), saved))
  ckpt.close()
  chex_equal(restored, saved)
  assert isinstance(restored["opt_state"], jaxscale.MasterWeightsState)
  # Continue from the restored state: the same as continuing from the saved one.
  grads = random_grads(4, params)
  chex_equal(step(restored["params"], restored["opt_state"], grads), step(saved["params"], saved["opt_state"], grads))


def digits():
  from sklearn.datasets import load_digits

  x, y = load_digits(return_X_y=True)
  return jnp.asarray(x / 16.0, jnp.float32), jnp.asarray(y)


LR, STALL_STEPS = 5e-5, 300


def test_plain_float16_adam_stalls_where_master_weights_learn():
  """Fine-tuning a linear classifier on sklearn's digits with Adam(5e-5): each update is below half a
  float16 ulp of every weight above 0.125 in magnitude, so plain float16 Adam barely moves; the
  master copy learns as float32 does."""
  x, y = digits()
  w0 = jax.random.normal(jax.random.key(0), (64, 10))

  def loss(w):
    logits = x.astype(w.dtype) @ w
    return optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), y).mean()

  def train(tx, w, steps=STALL_STEPS):
    @jax.jit
    def run_all(w):
      def body(carry, _):
        w, s = carry
        g = jax.grad(loss)(w)
        u, s = tx.update(g, s, w)
        return (optax.apply_updates(w, u), s), None

      return jax.lax.scan(body, (w, tx.init(w)), length=steps)[0][0]

    return run_all(w)

  start = float(loss(w0))
  # eps=1e-3: Adam's default 1e-8 is 0 in float16, and the always-zero pixels' 0/0 would be NaN.
  adam = optax.adam(LR, eps=1e-3)
  drop32 = start - float(loss(train(adam, w0)))
  plain = train(adam, w0.astype(jnp.float16))
  drop_plain = start - float(loss(plain))
  assert drop32 > 0.05
  # Measured: float32 0.321, plain float16 0.050 with 89% of the weights never moved; float32
  # master 0.321, kahan 0.321, stochastic rounding 0.321.
  assert np.mean(plain == w0.astype(jnp.float16)) > 0.85  # most weights never moved
  assert drop_plain < 0.25 * drop32
  for method in METHODS:
    drop = start - float(loss(train(jaxscale.master_weights(adam, method=method), w0.astype(jnp.float16))))
    assert drop > 0.95 * drop32, method


@pytest.mark.parametrize("method", METHODS)
def test_equinox_apply_updates_keeps_a_float16_model_float16(method):
  """`eqx.apply_updates` adds without casting back: the updates must have the parameters' dtype, and
  give what `optax.apply_updates` gives."""
  eqx = pytest.importorskip("equinox")
  model = eqx.nn.MLP(4, 2, 8, 1, key=jax.random.key(0))
  model = jax.tree.map(lambda x: x.astype(jnp.float16) if eqx.is_inexact_array(x) else x, model)
  tx = jaxscale.master_weights(jaxscale.dynamic_loss_scaling(optax.adam(1e-3), init_scale=2.0**8), method=method)
  opt_state = tx.init(eqx.filter(model, eqx.is_array))
  x = jax.random.normal(jax.random.key(1), (16, 4)).astype(jnp.float16)

  @eqx.filter_jit
  def step(model, opt_state):
    scaler = jaxscale.find_scaler(opt_state)
    loss = lambda m: jaxscale.scale(scaler, jnp.mean(jax.vmap(m)(x).astype(jnp.float32) ** 2))
    grads = eqx.filter_grad(loss)(model)
    updates, opt_state = tx.update(grads, opt_state, eqx.filter(model, eqx.is_array))
    return eqx.apply_updates(model, updates), optax.apply_updates(eqx.filter(model, eqx.is_array), updates), opt_state

  for _ in range(3):
    model, by_optax, opt_state = step(model, opt_state)
    arrays = jax.tree.leaves(eqx.filter(model, eqx.is_array))
    assert all(a.dtype == jnp.float16 for a in arrays)
    assert bits(arrays) == bits(by_optax)


@pytest.mark.parametrize("method", METHODS)
def test_jit_with_donation(method):
  params = f16_params()
  tx = jaxscale.master_weights(make_inner(), method=method)

  def step(params, opt_state, grads):
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state

  donating = jax.jit(step, donate_argnums=(0, 1))
  want = jax.jit(step)(params, tx.init(params), random_grads(0, params))
  got = donating(jax.tree.map(jnp.copy, params), tx.init(params), random_grads(0, params))
  assert bits(got) == bits(want)


def test_an_optimizer_factory_not_called_says_call_it():
  with pytest.raises(TypeError, match=r"call it, e.g. `master_weights\(optax.adam\(learning_rate\)\)`"):
    jaxscale.master_weights(optax.adam)


@pytest.mark.parametrize("dtype", ["float8_e4m3fn", "float8_e5m2"])
@pytest.mark.parametrize("method", METHODS)
def test_float8_parameters_are_refused_by_name(method, dtype):
  """float8_e4m3fn has no infinity, so the rounding's `nextafter(x, inf)` is NaN: every parameter
  was NaN after the first stochastically rounded step."""
  params = {"w": jnp.ones(3, dtype), "b": jnp.zeros(2)}
  with pytest.raises(ValueError, match=rf"dtype {dtype} at \['w'\]; it supports float16 and bfloat16"):
    jaxscale.master_weights(optax.sgd(1e-3), method=method).init(params)


@pytest.mark.parametrize("method", METHODS)
def test_zero_size_parameters(method):
  """An empty leaf (a (0, 3) matrix) beside a real one: it stays empty, and the other follows
  float32 SGD as without it."""
  params = {"empty": jnp.zeros((0, 3), jnp.float16), "w": jnp.ones(4, jnp.float16)}
  tx = jaxscale.master_weights(optax.sgd(0.25), method=method)
  grads = {"empty": jnp.zeros((0, 3), jnp.float32), "w": jnp.full(4, 1.0, jnp.float32)}
  updates, _ = jax.jit(tx.update)(grads, tx.init(params), params)
  new = optax.apply_updates(params, updates)
  assert new["empty"].shape == (0, 3) and new["empty"].dtype == jnp.float16
  np.testing.assert_array_equal(new["w"], np.full(4, 0.75, np.float16))  # exact in float16: no rounding



# --- float16 parameters with no master: the scaler sees their dtype and says what to write ---------

FLOAT16_NO_MASTER = (
    r"updates float16 parameters .* no float32 master copy"
    r".*jaxscale.master_weights\(jaxscale.dynamic_loss_scaling\(inner\)\)"
)


@pytest.mark.parametrize("wrap", [jax.jit, lambda f: f], ids=["jit", "eager"])
def test_float16_parameters_without_a_master_warn_at_trace_time(wrap):
  params = {"w": jnp.ones(3, jnp.float16), "b": jnp.zeros(1)}
  tx = optax.chain(optax.clip_by_global_norm(1.0), jaxscale.dynamic_loss_scaling(optax.adam(1e-3)))
  grads = {"w": jnp.ones(3, jnp.float32), "b": jnp.ones(1)}
  with pytest.warns(UserWarning, match=FLOAT16_NO_MASTER):
    wrap(tx.update)(grads, tx.init(params), params)
  # With a master (either nesting), or bfloat16 parameters (float32's range), not a word.
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    for right in (jaxscale.master_weights(jaxscale.dynamic_loss_scaling(optax.adam(1e-3))),
                  jaxscale.dynamic_loss_scaling(jaxscale.master_weights(optax.adam(1e-3)))):
      wrap(functools.partial(right.update, finite=True))(grads, right.init(params), params)
    bf16 = {"w": jnp.ones(3, jnp.bfloat16), "b": jnp.zeros(1)}
    wrap(functools.partial(tx.update, finite=True))(grads, tx.init(bf16), bf16)


@pytest.mark.parametrize("wrap", [jax.jit, lambda f: f], ids=["jit", "eager"])
def test_frozen_float16_parameters_are_not_warned_about(wrap):
  # LoRA-style: the float16 base is frozen (`set_to_zero`), only float32 adapters train. The frozen
  # weights never change, so no master copy is needed; a trained float16 partition is still warned.
  params = {"base": jnp.ones(3, jnp.float16), "lora": jnp.zeros(2)}
  grads = {"base": jnp.ones(3), "lora": jnp.ones(2)}
  inners = {"train": optax.adam(1e-3), "frozen": optax.set_to_zero()}
  frozen = jaxscale.dynamic_loss_scaling(optax.multi_transform(inners, {"base": "frozen", "lora": "train"}))
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    updates, _ = wrap(lambda g, s, p: frozen.update(g, s, p, finite=True))(grads, frozen.init(params), params)
  np.testing.assert_array_equal(updates["base"], 0)  # frozen indeed
  trained = jaxscale.dynamic_loss_scaling(optax.multi_transform(inners, {"base": "train", "lora": "frozen"}))
  with pytest.warns(UserWarning, match=FLOAT16_NO_MASTER.replace(".*", r"\(\['base'\]\).*", 1)):
    wrap(lambda g, s, p: trained.update(g, s, p, finite=True))(grads, trained.init(params), params)


def test_an_nnx_model_with_float16_parameters_and_no_master_warns():
  from flax import nnx

  import jaxscale.flax

  model = nnx.Linear(2, 1, param_dtype=jnp.float16, rngs=nnx.Rngs(0))
  tx = optax.chain(optax.clip_by_global_norm(1.0), jaxscale.dynamic_loss_scaling(optax.adam(1e-3)))
  optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)

  @nnx.jit
  def step(model, optimizer, x):
    loss = lambda model: jnp.mean(model(x).astype(jnp.float32) ** 2)
    _, grads, finite = jaxscale.flax.value_and_grad(loss)(jaxscale.find_scaler(optimizer.opt_state), model)
    optimizer.update(model, grads, finite=finite)

  with pytest.warns(UserWarning, match=FLOAT16_NO_MASTER):
    step(model, optimizer, jnp.ones((4, 2)))
  right = nnx.Optimizer(model, jaxscale.master_weights(tx), wrt=nnx.Param)
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    step(model, right, jnp.ones((4, 2)))


# --- a checkpoint restored without a target: what to write, not an AttributeError ----------------


@pytest.mark.parametrize("method", METHODS)
def test_a_state_restored_without_a_target_says_what_to_do(method):
  import flax.serialization

  params = f16_params()
  tx = jaxscale.master_weights(jaxscale.dynamic_loss_scaling(optax.adam(1e-3)), method=method)
  restored = flax.serialization.msgpack_restore(flax.serialization.to_bytes(tx.init(params)))  # nested dicts
  grads = jax.tree.map(lambda p: jnp.ones(p.shape, jnp.float32), params)
  for wrap in (jax.jit, lambda f: f):
    told = r"`master_weights`'s update takes the state its own `init` built .*got an object of type dict.*"
    with pytest.raises(TypeError, match=told + r"restore it into the structure of `tx.init\(params\)`"):
      wrap(tx.update)(grads, restored, params)
  # Restored into the target, it continues as the saved state would.
  again = flax.serialization.from_bytes(tx.init(params), flax.serialization.to_bytes(tx.init(params)))
  chex_equal(tx.update(grads, again, params), tx.update(grads, tx.init(params), params))


@pytest.mark.parametrize("dtype", [jnp.float16, jnp.bfloat16])
def test_widen_reads_every_16_bit_value_back_exactly(dtype):
  """The float32 value of every 16-bit pattern (NumPy's cast is the reference), and of a float32
  value rounded to 16 bits in the same jitted computation: the rounding is kept, where XLA may fold
  a cast there and back away (`xla_allow_excess_precision`)."""
  every = np.arange(2**16, dtype=np.uint16).view(jnp.dtype(dtype))
  want = every.astype(np.float32)
  got = np.asarray(jax.jit(_rounding.widen)(jnp.asarray(every)))
  same = (got.view(np.uint32) == want.view(np.uint32)) | (np.isnan(got) & np.isnan(want))
  assert same.all(), every[~same][:5]
  x = np.random.default_rng(0).standard_normal(10_000).astype(np.float32) * np.float32(1e3)
  rounded = np.asarray(jax.jit(lambda x: _rounding.widen(x.astype(dtype)))(jnp.asarray(x)))
  np.testing.assert_array_equal(rounded.view(np.uint32), x.astype(dtype).astype(np.float32).view(np.uint32))
  assert np.mean(rounded != x) > 0.99  # rounded: the test is not vacuous


@pytest.mark.parametrize("dtype", [jnp.float16, jnp.bfloat16])
def test_round_to_is_the_cast_there_and_back_for_every_float32_exponent(dtype):
  """`round_to` (bfloat16: XLA's `reduce_precision`; float16: the cast and `widen`) against
  ml_dtypes' rounding to nearest even through NumPy: random float32 bit patterns over every
  exponent, so the subnormals, the values that round to the largest finite value and those that
  round to inf are all there; jitted, where XLA could fold a cast there and back away."""
  bits = np.random.default_rng(1).integers(0, 2**32, 400_000, dtype=np.uint64).astype(np.uint32)
  x = bits.view(np.float32)
  x = x[np.isfinite(x) & (np.abs(x) >= np.finfo(np.float32).tiny)]  # XLA flushes float32 subnormals
  with np.errstate(over="ignore"):
    want = x.astype(dtype).astype(np.float32)
  got = np.asarray(jax.jit(lambda v: _rounding.round_to(v, dtype))(jnp.asarray(x)))
  np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))
  assert np.isinf(want).any() and np.mean(want != x) > 0.99  # not vacuous: overflows, and rounded
  if dtype == jnp.float16:  # and float16's flush to zero and its subnormals, which `reduce_precision` flushes
    assert (want == 0).any() and ((want != 0) & (np.abs(want) < float(jnp.finfo(dtype).tiny))).any()
