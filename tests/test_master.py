"""master_weights: equal to a float32-parameter run of the same optimizer, exact updates, tiny true
gradients kept by a float32 unscale, skipped steps, chain, Orbax, one compilation, the wrong nesting
refused, and plain float16 Adam stalling on real data where the master copy keeps learning."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxscale

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


@pytest.mark.hand_made_gradients
def test_equals_float32_reference_run_bit_for_bit():
  params = f16_params()
  tx = jaxscale.master_weights(make_inner())
  history, step = run(tx, (params), lambda i: (random_grads(i, params)))
  # The reference: the same inner optimizer on float32 parameters, fed the same gradients in float32.
  params32 = jax.tree.map(lambda p: p.astype(jnp.float32), (params))
  grads32 = lambda i: jax.tree.map(lambda g: g.astype(jnp.float32), (random_grads(i, params)))  # noqa: E731
  reference, _ = run(make_inner(), params32, grads32)
  for (p, s), (p_ref, s_ref) in zip(history, reference):
    assert p["w"].dtype == jnp.float16 and p["b"].dtype == jnp.float32
    np.testing.assert_array_equal(s.master["w"], p_ref["w"])  # the master is the float32 run
    np.testing.assert_array_equal(p["w"], p_ref["w"].astype(jnp.float16))
    np.testing.assert_array_equal(p["b"], p_ref["b"])  # float32 leaves pass through
    assert isinstance(s.master["b"], optax.MaskedNode)  # and have no copy
    chex_equal(s.inner_state, s_ref)
  assert int(jaxscale.find_scaler(history[-1][1]).skipped_steps) == 1
  assert step._cache_size() == 1  # one compilation for the whole run, skipped step included


def chex_equal(a, b):
  jax.tree.map(np.testing.assert_array_equal, a, b)


@pytest.mark.hand_made_gradients
def test_skipped_step_leaves_everything_bitwise():
  params = f16_params()
  tx = jaxscale.master_weights(make_inner())
  history, _ = run(tx, params, lambda i: random_grads(i, params), steps=INF_STEP + 1)
  (before, state_before), (after, state_after) = history[-2:]
  assert bool(jaxscale.metrics(state_after)["last_skipped"])
  bits = lambda t: [np.asarray(x).tobytes() for x in jax.tree.leaves(t)]  # noqa: E731
  assert bits(after) == bits(before)  # -0.0 in w keeps its sign
  assert bits(state_after.master) == bits(state_before.master)
  assert bits(state_after.inner_state.inner_state) == bits(state_before.inner_state.inner_state)


@pytest.mark.hand_made_gradients
def test_gradients_below_float16_subnormals_reach_the_master():
  """True gradients of 2**-30 exist in float16 only scaled; a float32 unscale keeps them."""
  true_grad = 2.0**-30 * jnp.arange(1, 5, dtype=jnp.float32)
  scaled = (true_grad * 2.0**16).astype(jnp.float16)  # 2**-14 * k: representable
  np.testing.assert_array_equal(scaled.astype(jnp.float32), true_grad * 2.0**16)
  params = jnp.ones(4, jnp.float16)

  right = jaxscale.master_weights(jaxscale.dynamic_loss_scaling(optax.sgd(1.0), init_scale=2.0**16))
  _, state = right.update(scaled, right.init(params), params)
  np.testing.assert_array_equal(state.master, 1.0 - true_grad)  # exactly what float32 gives

  # What the other order would do: unscaling in float16 flushes every one of them to zero.
  unscaled16, _ = jaxscale.unscale_and_check(jaxscale.init(init_scale=2.0**16), scaled)
  assert unscaled16.dtype == jnp.float16 and not np.any(unscaled16)


def test_wrong_nesting_is_refused():
  wrong = jaxscale.dynamic_loss_scaling(optax.chain(optax.identity(), jaxscale.master_weights(optax.adam(1e-3))))
  with pytest.raises(ValueError, match=r"master_weights\(dynamic_loss_scaling\(inner\)\)"):
    wrong.init({"w": jnp.ones(3, jnp.float16)})


@pytest.mark.hand_made_gradients
def test_inside_chain_and_found_by_find_scaler():
  params = {"w": jnp.ones(3, jnp.float16)}
  tx = optax.chain(jaxscale.master_weights(make_inner()))
  opt_state = tx.init(params)
  assert float(jaxscale.find_scaler(opt_state).scale) == 2.0**10
  updates, _ = tx.update({"w": jnp.full(3, 0.5, jnp.float16)}, opt_state, params)
  assert updates["w"].dtype == jnp.float32


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


@pytest.mark.parametrize("dtype, gap", [(jnp.float16, 2.0**12), (jnp.bfloat16, 2.0**15)])
def test_updates_land_exactly_on_the_cast_master(dtype, gap):
  rng = np.random.default_rng(0)
  p = finite_values(dtype, 200_000, rng)
  finfo = jnp.finfo(dtype)
  extremes = np.array([0.0, -0.0, float(finfo.max), -float(finfo.max), float(finfo.tiny), float(finfo.smallest_subnormal)], np.float32)
  p = np.concatenate([p, extremes.astype(dtype)])
  with np.errstate(over="ignore"):  # a master beyond the dtype's range is a legal inf
    master = make_master(p, dtype, rng)
    master[:6] = [np.inf, -np.inf, 1e30, 7e4, -1e-30, 3e-8]  # overflow to inf, round to zero
    target = master.astype(dtype)
  # The documented domain: the parameter does not shrink by more than `gap` in one step.
  ok = np.abs(target.astype(np.float64)) * gap >= np.abs(p.astype(np.float64))
  p, master, target = p[ok], master[ok], target[ok]
  assert p.size > 100_000

  tx = jaxscale.master_weights(optax.identity())
  state = jaxscale.MasterWeightsState(jnp.asarray(master), optax.EmptyState())
  with jax.numpy_dtype_promotion("strict"):  # no silent promotion in master_weights' own code
    updates, _ = jax.jit(tx.update)(jnp.zeros(p.shape, dtype), state, jnp.asarray(p))
  new = np.asarray(optax.apply_updates(jnp.asarray(p), updates)).astype(np.float32)
  # bfloat16 spans float32's range: steps beyond it, and values or steps below its smallest normal
  # (XLA flushes float32 subnormals to zero) are left out, as the docstring says.
  step = target.astype(np.float64) - p.astype(np.float64)
  tiny = lambda x: (x != 0) & (np.abs(x) < np.finfo(np.float32).tiny)  # noqa: E731
  flushed = tiny(p.astype(np.float64)) | tiny(target.astype(np.float64)) | tiny(step) | (np.abs(step) > np.finfo(np.float32).max) & np.isfinite(step)
  assert dtype == jnp.bfloat16 or not np.any(flushed)
  assert np.mean(flushed) < 0.01
  np.testing.assert_array_equal(new[~flushed], target[~flushed].astype(np.float32))
  same = (target.view(np.uint16) == p.view(np.uint16)) & ~flushed
  new_bits = np.asarray(optax.apply_updates(jnp.asarray(p), updates)).view(np.uint16)
  assert np.array_equal(new_bits[same], p.view(np.uint16)[same])  # unchanged: bit for bit


def test_outside_the_documented_domain_no_float32_update_is_exact():
  """A parameter falling from 60000 to 1.001 in one step: the limit the docstring states."""
  p, target = jnp.float16(60000.0), jnp.float16(1.0 + 2.0**-10)
  tx = jaxscale.master_weights(optax.identity())
  updates, _ = tx.update(jnp.float16(0), jaxscale.MasterWeightsState(target.astype(jnp.float32), optax.EmptyState()), p)
  assert optax.apply_updates(p, updates) != target


@pytest.mark.hand_made_gradients
def test_orbax_round_trip(tmp_path):
  import orbax.checkpoint as ocp

  params = f16_params()
  tx = jaxscale.master_weights(make_inner())
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
  master = train(jaxscale.master_weights(adam), w0.astype(jnp.float16))
  drop_plain, drop_master = start - float(loss(plain)), start - float(loss(master))
  assert drop32 > 0.05
  # Measured: float32 0.321, plain float16 0.050 with 89% of the weights never moved, master 0.321.
  assert np.mean(plain == w0.astype(jnp.float16)) > 0.85  # most weights never moved
  assert drop_plain < 0.25 * drop32
  assert drop_master > 0.95 * drop32
