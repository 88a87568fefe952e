"""Gradient accumulation and loss scaling, in the orders docs/recipes.md describes.

- `dynamic_loss_scaling(MultiSteps(inner, k))`: every micro-batch is checked; an overflowing one
  is dropped alone, the scale backs off at once, and the window closes after k finite ones.
- accumulating inside the step (`lax.scan` over micro-batches, then one `tx.update`): one check
  per window; an overflow drops the whole window and the scale backs off once.
- `MultiSteps(dynamic_loss_scaling(inner), k)`: the same semantics as the scan were intended, but
  optax's MultiSteps resets its accumulator with `(1 - emit) * acc`, which leaves NaN after an
  inf, so every later window is skipped too (strict xfail: it will tell us when optax fixes it).

The MultiSteps tests feed gradients in directly (true gradients times the current scale, a power
of two, so exactly), which makes their comparisons with plain accumulation bit for bit.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxscale

K = 3
SCALE = 2.0**10
INNER = optax.adam(0.1)


def true_grads(n, *, overflow_at=()):
  """n micro-batches of gradients; those at `overflow_at` hold an inf."""
  grads = [{"w": g} for g in jax.random.normal(jax.random.key(0), (n, 4))]
  for i in overflow_at:
    grads[i] = {"w": grads[i]["w"].at[1].set(jnp.inf)}
  return grads


def feed(tx, grads, *, scaled):
  """Feeds micro-batch gradients to `tx` one by one; returns the parameters and scale after each."""
  params = {"w": jnp.ones(4)}
  state = tx.init(params)
  update = jax.jit(tx.update)
  history = []
  for g in grads:
    updates, state = update(jaxscale.scale(jaxscale.find_scaler(state), g) if scaled else g, state, params)
    params = optax.apply_updates(params, updates)
    history.append((params, float(jaxscale.find_scaler(state).scale) if scaled else None))
  return history


def plain_accumulation(grads):
  return [params for params, _ in feed(optax.MultiSteps(INNER, K), grads, scaled=False)]


def assert_params_equal(history, expected):
  jax.tree.map(np.testing.assert_array_equal, [p for p, _ in history], expected)


ORDERS = {
    "scaling_outside_accumulation": lambda: jaxscale.dynamic_loss_scaling(optax.MultiSteps(INNER, K), init_scale=SCALE),
    "accumulation_outside_scaling": lambda: optax.MultiSteps(jaxscale.dynamic_loss_scaling(INNER, init_scale=SCALE), K),
}


@pytest.mark.parametrize("order", ORDERS)
def test_without_overflow_both_orders_equal_plain_accumulation(order):
  grads = true_grads(2 * K)
  history = feed(ORDERS[order](), grads, scaled=True)
  assert_params_equal(history, plain_accumulation(grads))
  assert {scale for _, scale in history} == {SCALE}


def test_scaling_outside_drops_only_the_overflowing_micro_batch():
  # Window 2 is micro-batches 3, 4, 5; 4 overflows, so the window closes on micro-batch 6.
  grads = true_grads(3 * K, overflow_at=[K + 1])
  history = feed(ORDERS["scaling_outside_accumulation"](), grads, scaled=True)
  # Exactly plain accumulation of the same stream with micro-batch 4 removed.
  expected = plain_accumulation(grads[: K + 1] + grads[K + 2 :])
  assert_params_equal(history[: K + 1] + history[K + 2 :], expected)
  jax.tree.map(np.testing.assert_array_equal, history[K + 1][0], history[K][0])
  # The scale backs off on the overflowing micro-batch itself, within the window.
  assert [scale for _, scale in history] == [SCALE] * (K + 1) + [SCALE / 2] * (2 * K - 1)


@pytest.mark.xfail(
    strict=True,
    reason="optax.MultiSteps resets its accumulator with `(1 - emit) * acc`: NaN after an inf",
)
def test_accumulation_outside_drops_the_window():
  grads = true_grads(3 * K, overflow_at=[K + 1])
  history = feed(ORDERS["accumulation_outside_scaling"](), grads, scaled=True)
  # Window 2 is dropped whole, the scale backs off at its end, window 3 trains normally.
  expected = plain_accumulation(grads[:K] + grads[2 * K :])
  assert_params_equal(history[:K] + history[2 * K :], expected)
  assert [scale for _, scale in history] == [SCALE] * (2 * K - 1) + [SCALE / 2] * (K + 1)


def loss_fn(params, batch):
  x, y = batch
  return jnp.mean((x @ params["w"] - y) ** 2)


def windowed_step(tx, *, scaled):
  """One optimizer step on K micro-batches, accumulated inside the step by `lax.scan`."""

  def step(params, opt_state, microbatches):
    scaler = jaxscale.find_scaler(opt_state) if scaled else None

    def objective(p, mb):
      return jaxscale.scale(scaler, loss_fn(p, mb)) if scaled else loss_fn(p, mb)

    def add(total, mb):
      return jax.tree.map(jnp.add, total, jax.grad(objective)(params, mb)), None

    total, _ = jax.lax.scan(add, jax.tree.map(jnp.zeros_like, params), microbatches)
    updates, opt_state = tx.update(jax.tree.map(lambda g: g / K, total), opt_state, params)
    return optax.apply_updates(params, updates), opt_state

  return jax.jit(step)


def microbatch_windows(n_windows, *, overflow_window=None):
  x = jax.random.normal(jax.random.key(1), (n_windows, K, 8, 4))
  y = jax.random.normal(jax.random.key(2), (n_windows, K, 8))
  if overflow_window is not None:
    x = x.at[overflow_window, 1, 0, 0].set(jnp.inf)  # one micro-batch of that window
  return list(zip(x, y))


def run_windows(tx, windows, *, scaled):
  params = {"w": jnp.zeros(4)}
  opt_state, step, history = tx.init(params), windowed_step(tx, scaled=scaled), []
  for window in windows:
    params, opt_state = step(params, opt_state, window)
    history.append((params, float(jaxscale.find_scaler(opt_state).scale) if scaled else None))
  return history


def assert_params_close(history, expected):
  # Whole compiled steps: XLA fuses the scaled and the plain programs differently (an ulp apart).
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7), [p for p, _ in history], expected)


def test_accumulating_in_the_step_drops_the_window_and_backs_off_once():
  tx = jaxscale.dynamic_loss_scaling(INNER, init_scale=SCALE)
  clean = microbatch_windows(3)
  assert_params_close(run_windows(tx, clean, scaled=True), [p for p, _ in run_windows(INNER, clean, scaled=False)])

  windows = microbatch_windows(3, overflow_window=1)
  history = run_windows(tx, windows, scaled=True)
  expected = [p for p, _ in run_windows(INNER, [windows[0], windows[2]], scaled=False)]
  assert_params_close([history[0], history[2]], expected)
  jax.tree.map(np.testing.assert_array_equal, history[1][0], history[0][0])
  assert [scale for _, scale in history] == [SCALE, SCALE / 2, SCALE / 2]
