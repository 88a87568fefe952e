"""Delayed scaling (`autocast(..., delayed=True)`, `float8_history`, `float8_update`) against independent
references: each tensor's scale from a plain-Python model of the rule over its history, its float8
values from ml_dtypes' rounding of exact float64 values, the products in float64; the history's
update against a plain-Python model of the window; the misuses a user meets, each an error that says
what to do."""

import math
import warnings

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import optax
import pytest

import jaxscale

pytestmark = pytest.mark.jaxpr

E4M3, E5M2 = np.dtype(ml_dtypes.float8_e4m3fn), np.dtype(ml_dtypes.float8_e5m2)
POLICY = "mixed_float8,min_intensity=0"  # the models here are small: every matmul in float8
# The float32 sum of a K-term dot of exact float8 products (Higham 3.1, unit roundoff 2**-24 on a CPU),
# then one rounding to bfloat16 (half an ulp: 2**-8 relative).
F32_UNIT, BF16_UNIT = 2.0**-24, 2.0**-8


def largest(dtype) -> float:
  return float(ml_dtypes.finfo(dtype).max)


def model_exponent(window, dtype) -> int:
  """The rule in plain Python: the largest k with 2 * max(window) * 2**k <= the format's largest value
  (one power of two of headroom), 0 for a window of zeros, within [-126, 126]."""
  amax = 2.0 * max(float(v) for v in window)
  if not (math.isfinite(amax) and amax > 0):
    return 0
  k = 0
  while math.ldexp(amax, k) > largest(dtype):
    k -= 1
  while math.ldexp(amax, k + 1) <= largest(dtype):
    k += 1
  return max(-126, min(126, k))


def model_quantize(x, k, dtype):
  """x * 2**k clipped to the format's range and rounded once by ml_dtypes; and the maximum the step
  records: max |q| / 2**k, or 16 times the largest value's where it was reached."""
  y = np.clip(np.ldexp(np.asarray(x, np.float64), k), -largest(dtype), largest(dtype))
  q = y.astype(dtype)
  top = float(np.max(np.abs(q.astype(np.float64))))
  return q, math.ldexp(16 * top if top >= largest(dtype) else top, -k)


def matmul_loss(w, x, c):
  return jnp.sum(jnp.dot(x, w).astype(jnp.float32) * c)


def problem(seed=0, shape=(32, 48, 16)):
  m, k, n = shape
  rng = np.random.default_rng(seed)
  w = rng.standard_normal((k, n)).astype(np.float32) * 0.05
  x = rng.standard_normal((m, k)).astype(np.float32) * 3.0
  c = rng.standard_normal((m, n)).astype(np.float32) * 1e-3
  return w, x, c


def history_of(rows, length=4):
  """A history whose window holds `rows` ([matmuls, 3] maxima) in its newest slot, zeros behind."""
  rows = jnp.asarray(rows, jnp.float32)
  return jaxscale.Float8History(jnp.zeros((*rows.shape, length)).at[..., 0].set(rows), jnp.zeros_like(rows),
                                jnp.zeros(()))


# --- the delayed step against the model ----------------------------------------------------------


@pytest.mark.parametrize("grown", [1.0, 8.0], ids=["in-range", "grown-past-its-scale"])
def test_a_delayed_matmul_is_the_models_product_and_reports_the_models_maxima(grown):
  w, x, c = problem()
  # The history saw x and w as they are (or 8 times smaller: they have since grown and saturate).
  hist_x, hist_w, hist_g = np.abs(x).max() / grown, np.abs(w).max() / grown, 1e-3
  f = jaxscale.autocast(matmul_loss, POLICY, delayed=True)
  history = history_of([[hist_x, hist_w, hist_g]])
  value = f(history, w, x, c)
  seen, grad_w = jax.grad(f, argnums=(0, 1))(history, w, x, c)

  kx, kw, kg = model_exponent([hist_x], E4M3), model_exponent([hist_w], E4M3), model_exponent([hist_g], E5M2)
  qx, seen_x = model_quantize(x, kx, E4M3)
  qw, seen_w = model_quantize(w, kw, E4M3)
  exact = np.ldexp(qx.astype(np.float64) @ qw.astype(np.float64), -(kx + kw))
  # Each product element: the float32 sum of K exact float8 products (Higham's gamma_K = K u / (1 - K u),
  # under 1.01 K u for K u below 0.01: the 1.01), then one rounding to bfloat16. The loss multiplies by c
  # and sums M N terms in float32: gamma_MN of the sum of their magnitudes more.
  terms = np.ldexp(np.abs(qx.astype(np.float64)) @ np.abs(qw.astype(np.float64)), -(kx + kw))
  bound_y = 1.01 * x.shape[1] * F32_UNIT * terms + BF16_UNIT * np.abs(exact)
  reference_value = float(np.sum(exact * c))
  bound_loss = np.sum(bound_y * np.abs(c)) + 1.01 * c.size * F32_UNIT * np.sum(np.abs(exact * c) + bound_y * np.abs(c))
  assert abs(float(value) - reference_value) <= bound_loss, (value, reference_value)

  # The backward: dW = x^T g, with g (c in bfloat16, the product's dtype) quantized with its own delayed scale.
  g = np.asarray(jnp.asarray(c).astype(jnp.bfloat16).astype(jnp.float32), np.float64)
  qg, seen_g = model_quantize(g, kg, E5M2)
  exact_dw = np.ldexp(qx.astype(np.float64).T @ qg.astype(np.float64), -(kx + kg))
  terms_dw = np.ldexp(np.abs(qx.astype(np.float64)).T @ np.abs(qg.astype(np.float64)), -(kx + kg))
  np.testing.assert_array_less(np.abs(np.asarray(grad_w, np.float64) - exact_dw),
                               1.01 * x.shape[0] * F32_UNIT * terms_dw + 1e-30)  # gamma_M, as above
  # The maxima seen leave as the gradient of the history's slot, exactly (scaled by powers of two).
  np.testing.assert_array_equal(np.asarray(seen.seen), np.float32([[seen_x, seen_w, seen_g]]))
  if grown > 1:
    assert seen_x == math.ldexp(16 * largest(E4M3), -kx)  # saturated: recorded 16 times the range
    assert float(jaxscale.float8_update(history, seen).saturated) == 2  # x and w, not the gradient


def test_calibration_records_each_tensors_own_maximum():
  w, x, c = problem(1)
  f = jaxscale.autocast(matmul_loss, POLICY, delayed=True)
  history = jaxscale.float8_history(f, w, x, c, length=3)
  assert history.amax.shape == (1, 3, 3) and history.seen.shape == (1, 3)
  g = np.asarray(jnp.asarray(c).astype(jnp.bfloat16).astype(jnp.float32))  # d loss / d product, in bfloat16
  np.testing.assert_array_equal(np.asarray(history.amax[0, :, 0]),
                                np.float32([np.abs(x).max(), np.abs(w).max(), np.abs(g).max()]))
  np.testing.assert_array_equal(np.asarray(history.amax[..., 1:]), 0)
  assert float(history.saturated) == 0


def test_update_is_the_models_window():
  rng = np.random.default_rng(2)
  window = rng.uniform(0.1, 10, (2, 3, 4)).astype(np.float32)
  history = jaxscale.Float8History(jnp.asarray(window), jnp.zeros((2, 3)), jnp.zeros(()))
  seen_values = rng.uniform(0.1, 10, (2, 3)).astype(np.float32)
  seen_values[1, 2] = np.nan  # a step whose gradient held a NaN: the row keeps its largest
  seen_values[0, 1] = np.inf
  new = jaxscale.float8_update(history, jaxscale.Float8History(jnp.zeros_like(window), jnp.asarray(seen_values),
                                                               jnp.zeros(())))
  expected = np.empty_like(window)
  for i in range(2):
    for j in range(3):
      newest = seen_values[i, j] if np.isfinite(seen_values[i, j]) else window[i, j].max()
      expected[i, j] = [newest, *window[i, j, :-1]]  # newest first, the oldest forgotten
  np.testing.assert_array_equal(np.asarray(new.amax), expected)
  np.testing.assert_array_equal(np.asarray(new.seen), 0)
  # Saturated: the model's exponent of the newest maximum below the one the window gave.
  dtypes = (E4M3, E4M3, E5M2)
  saturated = sum(model_exponent([expected[i, j, 0]], dtypes[j]) < model_exponent(window[i, j], dtypes[j])
                  for i in range(2) for j in range(3))
  assert float(new.saturated) == saturated


def test_a_training_loop_with_delayed_scaling_converges_as_current_scaling_does():
  """Adam on a least-squares problem whose optimum is exact (loss 0), 60 steps at lr 3e-2: each weight
  may move 1.8, past every entry of the solution (0.3 times a unit normal), so a run whose gradients keep
  their sign and rough size falls far below a tenth of its initial loss; float8's error (e5m2: 2**-3 of
  a value) does not flip a gradient's sign. Both loops must, and the history must never saturate. (How
  close delayed runs stay to current ones is measured on real training: benchmarks/float8_quality.py.)"""
  rng = np.random.default_rng(3)
  x = jnp.asarray(rng.standard_normal((64, 32)), jnp.float32)
  target = x @ jnp.asarray(rng.standard_normal((32, 16)) * 0.3, jnp.float32)

  def loss(w, x):
    return jnp.mean(jnp.square(jnp.dot(x, w).astype(jnp.float32) - target))

  tx = optax.adam(3e-2)
  current = jaxscale.autocast(loss, POLICY)
  delayed = jaxscale.autocast(loss, POLICY, delayed=True)
  w0 = jnp.zeros((32, 16))
  history = jaxscale.float8_history(delayed, w0 + 0.01, x)

  @jax.jit
  def step(w, opt, history):
    value, (seen, grads) = jax.value_and_grad(delayed, argnums=(0, 1))(history, w, x)
    updates, opt = tx.update(grads, opt, w)
    return optax.apply_updates(w, updates), opt, jaxscale.float8_update(history, seen), value

  @jax.jit
  def reference_step(w, opt):
    value, grads = jax.value_and_grad(current)(w, x)
    updates, opt = tx.update(grads, opt, w)
    return optax.apply_updates(w, updates), opt, value

  w, opt, w_ref, opt_ref = w0, tx.init(w0), w0, tx.init(w0)
  for _ in range(60):
    w, opt, history, value = step(w, opt, history)
    w_ref, opt_ref, value_ref = reference_step(w_ref, opt_ref)
  initial = float(loss(w0, x))
  assert float(value) < initial / 10 and float(value_ref) < initial / 10
  assert float(history.saturated) == 0


def test_matmuls_in_a_loop_body_keep_current_scaling_and_are_not_counted():
  w, x, c = problem(4)

  def looped(w, x, c):
    def body(carry, _):
      return carry + jnp.dot(x, w).astype(jnp.float32), None
    total, _ = jax.lax.scan(body, jnp.zeros((x.shape[0], w.shape[1])), None, length=2)
    return jnp.sum(total * c) + matmul_loss(w, x, c)

  f = jaxscale.autocast(looped, POLICY, delayed=True)
  history = jaxscale.float8_history(f, w, x, c)
  assert history.matmuls == 1  # the one outside the loop
  report = jaxscale.precision_report(f, history, w, x, c)
  assert set(report.matmul_flops) == {"float8_e4m3fn"}


def test_the_history_is_a_pytree_of_arrays_that_checkpoints():
  w, x, c = problem(5)
  f = jaxscale.autocast(matmul_loss, POLICY, delayed=True)
  history = jaxscale.float8_history(f, w, x, c)
  leaves, treedef = jax.tree.flatten(history)
  assert [leaf.dtype for leaf in leaves] == [jnp.float32] * 3
  restored = jax.tree.unflatten(treedef, [np.asarray(leaf) for leaf in leaves])
  assert float(f(restored, w, x, c)) == float(f(history, w, x, c))


# --- misuse ----------------------------------------------------------------------------------------


def calibrated(seed=0):
  """`(f, history, w, x, c)`: the delayed `matmul_loss` and its history, calibrated on `problem(seed)`."""
  w, x, c = problem(seed)
  f = jaxscale.autocast(matmul_loss, POLICY, delayed=True)
  return f, jaxscale.float8_history(f, w, x, c), w, x, c


def test_a_delayed_function_called_without_its_history_says_how_to_make_one():
  w, x, c = problem()
  f = jaxscale.autocast(matmul_loss, POLICY, delayed=True)
  with pytest.raises(TypeError, match=r"takes a `jaxscale.Float8History` first.*float8_history"):
    f(w, x, c)


def test_a_history_of_another_function_is_refused_with_both_counts():
  w, x, c = problem()
  f = jaxscale.autocast(matmul_loss, POLICY, delayed=True)
  with pytest.raises(ValueError, match=r"holds 2 float8 matmuls; called with these arguments, it runs 1"):
    f(history_of(np.ones((2, 3))), w, x, c)


def test_delayed_needs_a_float8_policy_and_a_bool():
  with pytest.raises(ValueError, match="has none: use 'mixed_float8'"):
    jaxscale.autocast(matmul_loss, "mixed_bfloat16", delayed=True)
  with pytest.raises(TypeError, match="`delayed` must be a Python bool"):
    jaxscale.autocast(matmul_loss, POLICY, delayed="yes")


def test_delayed_and_weights_are_refused_together():
  @jax.jit
  def step(w):
    return jaxscale.autocast(matmul_loss, POLICY, delayed=True, weights=w)

  with pytest.raises(ValueError, match="`delayed=True` or `weights=`, not both"):
    step(jnp.ones((4, 4)))


def test_float8_history_takes_a_delayed_function_and_a_positive_length():
  w, x, c = problem()
  with pytest.raises(TypeError, match="made with `jaxscale.autocast"):
    jaxscale.float8_history(jaxscale.autocast(matmul_loss, POLICY), w, x, c)
  f = jaxscale.autocast(matmul_loss, POLICY, delayed=True)
  with pytest.raises(ValueError, match="at least 1; got 0"):
    jaxscale.float8_history(f, w, x, c, length=0)


def test_float8_update_refuses_what_is_not_the_historys_gradient():
  f, history, w, x, c = calibrated()
  _, grads = jax.grad(f, argnums=(0, 1))(history, w, x, c)
  with pytest.raises(TypeError, match="`seen` must be a `jaxscale.Float8History`.*argnums"):
    jaxscale.float8_update(history, grads)  # the parameters' gradient, not the history's
  with pytest.raises(ValueError, match="maxima for 2 float8 matmuls and a history of 1"):
    jaxscale.float8_update(history, history_of(np.ones((2, 3))))


def test_a_loss_scaler_is_refused_at_the_gradient_site():
  """Its unscale would divide the recorded maxima by the scale, and the gradient column would see scaled
  gradients against a history calibrated without: clipped, without a word (found by an adversarial pass)."""
  f, history, w, x, c = calibrated()
  with pytest.raises(TypeError, match=r"needs no loss scaling.*jax.value_and_grad\(f, argnums=\(0, 1\)\)"):
    jaxscale.value_and_grad(f, argnums=(0, 1))(jaxscale.init(), history, w, x, c)


def test_the_signature_has_the_history_in_front():
  import inspect

  w, x, c = problem()
  f = jaxscale.autocast(matmul_loss, POLICY, delayed=True)
  assert list(inspect.signature(f).parameters) == ["history", "w", "x", "c"]
  history = jaxscale.float8_history(f, w, x, c)
  # `jax.jit` reads the names from it: donating `c` donates c, not x.
  with warnings.catch_warnings():  # c's buffer is not reused (the output is a scalar): JAX says so
    warnings.simplefilter("ignore")
    lowered = jax.jit(f, donate_argnames="c").lower(history, w, x, c)
  donated = [info.donated for info in jax.tree.leaves(lowered.args_info)]
  assert donated == [False, False, False, False, False, True]  # history's three leaves, w, x, c


def test_the_history_round_trips_through_flax_serialization():
  serialization = pytest.importorskip("flax.serialization")
  f, history, w, x, c = calibrated()
  restored = serialization.from_bytes(history, serialization.to_bytes(history))
  assert isinstance(restored, jaxscale.Float8History)
  np.testing.assert_array_equal(np.asarray(restored.amax), np.asarray(history.amax))
  as_dict = serialization.to_state_dict(history)
  assert float(f(jaxscale.Float8History(**as_dict), w, x, c)) == float(f(history, w, x, c))


def test_calibration_with_has_aux_differentiates_the_loss_alone():
  w, x, c = problem(6)
  with_aux = jaxscale.autocast(lambda w, x, c: (matmul_loss(w, x, c), {"y": jnp.dot(x, w)}), POLICY, delayed=True)
  plain = jaxscale.autocast(matmul_loss, POLICY, delayed=True)
  aux_rows = np.asarray(jaxscale.float8_history(with_aux, w, x, c, has_aux=True).amax[..., 0])
  plain_row = np.asarray(jaxscale.float8_history(plain, w, x, c).amax[0, :, 0])
  np.testing.assert_array_equal(aux_rows[0], plain_row)  # the loss's matmul: its gradient the loss's
  np.testing.assert_array_equal(aux_rows[1], 0)  # the aux output's: no gradient runs it back, it records nothing


@pytest.mark.parametrize("misuse", ["swapped", "the history twice", "the history's slot moved"])
def test_float8_update_of_what_cannot_be_a_history_and_its_gradient(misuse):
  f, history, w, x, c = calibrated()
  seen, _ = jax.grad(f, argnums=(0, 1))(history, w, x, c)
  args = {"swapped": (seen, history), "the history twice": (history, history),
          "the history's slot moved": (history._replace(seen=history.seen - 1e-3), seen)}[misuse]
  with pytest.raises(ValueError, match="cannot be a history and its gradient"):
    jaxscale.float8_update(*args)
  # Under `jit` no value can be read: the counter a run logs says it, NaN.
  assert np.isnan(float(jax.jit(jaxscale.float8_update)(*args).saturated))
  assert float(jax.jit(jaxscale.float8_update)(history, seen).saturated) == 0


def test_a_finite_value_past_float32_once_scaled_saturates_rather_than_becoming_nan():
  w, x, c = problem()
  f = jaxscale.autocast(matmul_loss, POLICY, delayed=True)
  tiny = history_of([[1e-30, np.abs(w).max(), 1e-3]])  # x's scale 2**k near 2**100
  x = x.copy()
  x[0, 0] = 1e30  # 1e30 * 2**100 overflows float32
  assert np.isfinite(float(f(tiny, w, x, c)))
  seen, _ = jax.grad(f, argnums=(0, 1))(tiny, w, x, c)
  assert float(jaxscale.float8_update(tiny, seen).saturated) == 1


def test_length_takes_any_integer_and_says_so():
  w, x, c = problem()
  f = jaxscale.autocast(matmul_loss, POLICY, delayed=True)
  assert jaxscale.float8_history(f, w, x, c, length=np.int64(3)).amax.shape[-1] == 3
  with pytest.raises(ValueError, match="an int of at least 1; got 16.0"):
    jaxscale.float8_history(f, w, x, c, length=16.0)


def test_differentiating_without_the_history_warns_at_the_users_line():
  f, history, w, x, c = calibrated()
  with pytest.warns(UserWarning, match=r"not with respect to its `Float8History`.*argnums=\(0, 1\)") as caught:
    jax.grad(f, argnums=1)(history, w, x, c)
  assert caught[0].filename == __file__
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    jax.grad(f, argnums=(0, 1))(history, w, x, c)  # both: no warning
    f(history, w, x, c)  # evaluated, not differentiated: none either
