"""Fault injection in real float16 training: inf and NaN in gradient leaves, in the loss, in batches.

A small MLP regression trains for a few hundred jitted steps (float32 parameters, float16 compute,
Adam wrapped in `dynamic_loss_scaling`). A seeded schedule poisons single steps (an inf or a NaN in
one element of one gradient leaf, a loss multiplied by inf or NaN, a batch holding a NaN, an inf or a
value that overflows float16) and two bursts long enough to drive the scale down to `min_scale`.
After every step: parameters and optimizer state hold only finite values, a poisoned step was
skipped (parameters and Adam's state bit for bit unchanged, updates all -0.0) and a clean one taken,
and Adam's step count is the number of clean steps so far. Training still converges: the final loss
is close to that of a run fed only the clean steps. One compilation serves all of it.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax

import jaxscale
from _bitwise import bits
from _jit import compilations

STEPS = 300
BURSTS = [(100, 12), (200, 12)]  # (first step, length): 2**10 -> 2**4 takes 6 back-offs
INIT_SCALE, MIN_SCALE, MAX_SCALE = 2.0**10, 2.0**4, 2.0**12
SIZES = (8, 32, 32, 1)
BATCH = 32
KINDS = ("grad_inf", "grad_-inf", "grad_nan", "loss_inf", "loss_nan", "batch_nan", "batch_inf", "batch_overflow")


def make_tx():
  # max_scale keeps clean steps from overflowing float16 by themselves: then the only skipped
  # steps are the poisoned ones, and the test can name each.
  # on_stall="skip": a burst overflows at the floor and the run must go on afterwards (the
  # default, "raise", would stop it there, as tests/test_contract.py checks).
  return jaxscale.dynamic_loss_scaling(
      optax.adam(1e-2), init_scale=INIT_SCALE, min_scale=MIN_SCALE, max_scale=MAX_SCALE, growth_interval=8,
      on_stall="skip",
  )


def init_params():
  keys = jax.random.split(jax.random.key(0), len(SIZES) - 1)
  return [
      {"w": jax.random.normal(k, (m, n)) / np.sqrt(m), "b": jnp.zeros(n)}
      for k, m, n in zip(keys, SIZES[:-1], SIZES[1:])
  ]


def forward(params, x):
  h = x.astype(jnp.float16)
  for i, layer in enumerate(params):
    h = h @ layer["w"].astype(jnp.float16) + layer["b"].astype(jnp.float16)
    if i < len(params) - 1:
      h = jnp.tanh(h)
  return h.astype(jnp.float32)


def mse(params, x, y):
  return jnp.mean((forward(params, x) - y) ** 2)


@jax.jit
def train_step(params, opt_state, x, y, loss_factor, grad_poison):
  tx = make_tx()
  loss_fn = lambda p: mse(p, x, y) * loss_factor
  _, grads, finite = jaxscale.value_and_grad(loss_fn)(jaxscale.find_scaler(opt_state), params)
  grads = jax.tree.map(jnp.add, grads, grad_poison)  # a fault after the gradient site
  updates, opt_state = tx.update(grads, opt_state, params, finite=finite)
  return optax.apply_updates(params, updates), opt_state, updates


def dataset(n_batches, rng):
  x = rng.normal(size=(n_batches, BATCH, SIZES[0])).astype(np.float32)
  w = np.linspace(-1, 1, SIZES[0], dtype=np.float32)
  y = (np.sin(x @ w) + 0.5 * x[..., 0] ** 2)[..., None].astype(np.float32)
  return x, y


def schedule(rng):
  """The poison of every step: None for a clean step, else one of KINDS."""
  kinds = [None] * STEPS
  for i in range(20, 200):  # the last 88 steps are clean: the scale grows back
    if rng.random() < 0.15:
      kinds[i] = KINDS[rng.integers(len(KINDS))]
  for start, length in BURSTS:
    for i in range(start, start + length):
      kinds[i] = KINDS[i % len(KINDS)]
    kinds[start + length] = None  # the step after a burst is clean
  return kinds


def poisoned_inputs(kind, x, y, params, rng):
  """The step's arguments with `kind` injected; all-zero poison and a factor of 1 when clean."""
  x = x.copy()
  loss_factor = np.float32(1.0)
  poison = jax.tree.map(lambda p: np.zeros(p.shape, np.float32), params)
  if kind is None:
    return x, y, loss_factor, poison
  where, what = kind.split("_", 1)
  bad = {"inf": np.inf, "-inf": -np.inf, "nan": np.nan, "overflow": 1e5}[what]  # 1e5 > float16's 65504
  if where == "grad":
    leaves, treedef = jax.tree.flatten(poison)
    leaf = leaves[rng.integers(len(leaves))]
    leaf.reshape(-1)[rng.integers(leaf.size)] = bad
    poison = jax.tree.unflatten(treedef, leaves)
  elif where == "loss":
    loss_factor = np.float32(bad)
  else:
    x[rng.integers(BATCH), rng.integers(SIZES[0])] = bad
  return x, y, loss_factor, poison


def all_finite_on_host(tree):
  return all(np.isfinite(np.asarray(leaf)).all() for leaf in jax.tree.leaves(tree)
             if np.issubdtype(np.asarray(leaf).dtype, np.floating))


def adam_count(opt_state):
  return int(opt_state.inner_state[0].count)


def test_training_survives_injected_faults():
  rng = np.random.default_rng(11)
  xs, ys = dataset(STEPS, rng)
  kinds = schedule(rng)
  x_eval, y_eval = dataset(4, np.random.default_rng(12))
  x_eval, y_eval = x_eval.reshape(-1, SIZES[0]), y_eval.reshape(-1, 1)
  tx = make_tx()

  params = init_params()
  opt_state = tx.init(params)
  clean_taken = 0
  for i, kind in enumerate(kinds):
    args = poisoned_inputs(kind, xs[i], ys[i], params, rng)
    before = bits((params, opt_state.inner_state))
    params, opt_state, updates = train_step(params, opt_state, *args)
    assert all_finite_on_host((params, opt_state)), f"step {i} ({kind}) left a non-finite value"
    scaler = jax.device_get(jaxscale.find_scaler(opt_state))
    assert bool(scaler.last_skipped) == (kind is not None), f"step {i} ({kind})"
    if kind is None:
      clean_taken += 1
      assert bits((params, opt_state.inner_state)) != before, f"clean step {i} changed nothing"
    else:
      assert bits((params, opt_state.inner_state)) == before, f"poisoned step {i} ({kind}) moved the state"
      assert all(not u.any() and np.signbit(u).all() for u in jax.tree.leaves(jax.device_get(updates)))
    assert adam_count(opt_state) == clean_taken
    assert MIN_SCALE <= float(scaler.scale) <= MAX_SCALE
    for start, length in BURSTS:
      if i == start + length - 1:  # a burst ends: it drove the scale to its floor, and held it there
        assert float(scaler.scale) == MIN_SCALE, f"burst at {start}"

  n_poisoned = sum(kind is not None for kind in kinds)
  scaler = jax.device_get(jaxscale.find_scaler(opt_state))
  assert int(scaler.skipped_steps) == n_poisoned
  assert {k for k in kinds if k} == set(KINDS) and n_poisoned > 40
  assert float(scaler.scale) == MAX_SCALE  # grew back after the last burst, up to its ceiling

  # The same model fed only the clean steps, through the same compiled step.
  reference, ref_state = init_params(), tx.init(init_params())
  for i, kind in enumerate(kinds):
    if kind is None:
      reference, ref_state, _ = train_step(reference, ref_state, *poisoned_inputs(None, xs[i], ys[i], reference, rng))
  assert compilations(train_step) == 1

  start_loss = float(mse(init_params(), x_eval, y_eval))
  final_loss = float(mse(params, x_eval, y_eval))
  clean_loss = float(mse(reference, x_eval, y_eval))
  print(f"losses: start {start_loss:.4f}, clean run {clean_loss:.4f}, poisoned run {final_loss:.4f}")
  assert clean_loss < 0.2 * start_loss  # the reference run itself learned something
  assert final_loss <= 1.05 * clean_loss + 1e-3, (start_loss, final_loss, clean_loss)
