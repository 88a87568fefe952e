"""One scale for several optimizers and several losses, and the torch AMP example patterns.

Each test pairs with a section of docs/recipes.md: optimizer groups and a GAN sharing one scale,
several losses, a gradient penalty (a gradient of a gradient), gradient clipping.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxscale

SCALE = 2.0**10


def assert_trees_equal(a, b):
  jax.tree.map(np.testing.assert_array_equal, a, b)


def assert_trees_differ(a, b):
  assert any(not np.array_equal(x, y) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


# --- optimizer groups: optax.multi_transform inside one wrapper --------------------------------

GROUPS = {"generator": {"w": jnp.ones(3)}, "discriminator": {"w": jnp.ones(2)}}
GROUP_GRADS = {"generator": {"w": jnp.array([0.5, -1.0, 2.0])}, "discriminator": {"w": jnp.array([3.0, -0.25])}}


def grouped():
  labels = {"generator": {"w": "generator"}, "discriminator": {"w": "discriminator"}}
  return optax.multi_transform({"generator": optax.adam(1e-2), "discriminator": optax.sgd(0.1)}, labels)


def test_optimizer_groups_share_one_scale_and_one_decision():
  tx = jaxscale.dynamic_loss_scaling(grouped(), init_scale=SCALE)
  state = tx.init(GROUPS)
  scaled = jaxscale.scale(jaxscale.find_scaler(state), GROUP_GRADS)
  updates, new_state = jax.jit(tx.update)(scaled, state, GROUPS)
  # Jitted like the wrapped update: on jax 0.5 to 0.7, eager Adam differs from jitted Adam in the last bit.
  expected, _ = jax.jit(grouped().update)(GROUP_GRADS, grouped().init(GROUPS), GROUPS)
  assert_trees_equal(updates, expected)

  # An inf in the discriminator's gradients skips both groups, and backs off once.
  scaled["discriminator"]["w"] = scaled["discriminator"]["w"].at[0].set(jnp.inf)
  updates, skipped = jax.jit(tx.update)(scaled, new_state, GROUPS)
  assert all((np.asarray(u) == 0).all() for u in jax.tree.leaves(updates))
  assert_trees_equal(skipped.inner_state, new_state.inner_state)
  assert float(jaxscale.find_scaler(skipped).scale) == SCALE / 2


# --- a GAN: two optimizers stepped one after the other, one scaler ------------------------------


def d_loss(disc, gen, real, z):
  fake = jnp.tanh(z @ gen)
  return jnp.mean(jax.nn.softplus(-(real @ disc))) + jnp.mean(jax.nn.softplus(fake @ disc))


def g_loss(gen, disc, z):
  return jnp.mean(jax.nn.softplus(-(jnp.tanh(z @ gen) @ disc)))


def step_if_finite(tx, grads, opt_state, params, finite):
  """Applies `tx` only where `finite` (torch's `scaler.step(optimizer)`), without a branch."""
  updates, new_state = tx.update(grads, opt_state, params)
  new = (optax.apply_updates(params, updates), new_state)
  return jax.tree.map(lambda n, o: jnp.where(finite, n, o), new, (params, opt_state))


TX_D, TX_G = optax.adam(1e-2), optax.adam(1e-2)


@jax.jit
def gan_step(state, real, z):
  """torch's AMP GAN loop: each optimizer skips on its own infs; the scale updates once."""
  disc, gen, opt_d, opt_g, scaler = state
  scaled = jax.grad(lambda d: jaxscale.scale(scaler, d_loss(d, gen, real, z)))(disc)
  grads, finite_d = jaxscale.unscale_and_check(scaler, scaled)
  disc, opt_d = step_if_finite(TX_D, grads, opt_d, disc, finite_d)
  # The generator sees the discriminator it has just updated, at the same scale.
  scaled = jax.grad(lambda g: jaxscale.scale(scaler, g_loss(g, disc, z)))(gen)
  grads, finite_g = jaxscale.unscale_and_check(scaler, scaled)
  gen, opt_g = step_if_finite(TX_G, grads, opt_g, gen, finite_g)
  return disc, gen, opt_d, opt_g, jaxscale.update(scaler, finite_d & finite_g)


def gan_init(scaler):
  disc, gen = jnp.full(4, 0.1), jnp.full((2, 4), 0.2)
  return disc, gen, TX_D.init(disc), TX_G.init(gen), scaler


def gan_batch(poison=None):
  real, z = jnp.ones((8, 4)), jnp.linspace(-1, 1, 16).reshape(8, 2)
  if poison == "real":  # only the discriminator's loss reads the real data
    real = real.at[0, 0].set(jnp.inf)
  if poison == "noise":  # both losses read the generator's samples (a NaN: tanh(inf) is finite)
    z = z.at[0, 0].set(jnp.nan)
  return real, z


@jax.jit
def plain_gan_step(disc, gen, opt_d, opt_g, real, z):
  """The same GAN step in plain JAX and Optax: the reference, with no jaxscale in it."""
  updates, opt_d = TX_D.update(jax.grad(d_loss)(disc, gen, real, z), opt_d, disc)
  disc = optax.apply_updates(disc, updates)
  updates, opt_g = TX_G.update(jax.grad(g_loss)(gen, disc, z), opt_g, gen)
  return disc, optax.apply_updates(gen, updates), opt_d, opt_g


def test_gan_one_scale_without_overflow_equals_unscaled_training():
  scaled = gan_init(jaxscale.init(init_scale=SCALE))
  plain = gan_init(None)[:4]
  for _ in range(3):
    scaled, plain = gan_step(scaled, *gan_batch()), plain_gan_step(*plain, *gan_batch())
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6), scaled[:4], plain)


@pytest.mark.parametrize(
    "poison, skips_d, skips_g", [("real", True, False), ("noise", True, True)], ids=["disc_only", "both"]
)
def test_gan_each_optimizer_skips_on_its_own_and_the_scale_backs_off_once(poison, skips_d, skips_g):
  before = gan_init(jaxscale.init(init_scale=SCALE))
  disc, gen, _, _, scaler = gan_step(before, *gan_batch(poison))
  assert np.array_equal(disc, before[0]) == skips_d
  assert np.array_equal(gen, before[1]) == skips_g
  assert float(scaler.scale) == SCALE / 2 and int(scaler.skipped_steps) == 1


# --- several losses -------------------------------------------------------------------------------


def two_losses(w):
  x = jnp.linspace(-2, 2, 12).reshape(4, 3)
  return jnp.mean((x @ w - 1.0) ** 2), 0.1 * jnp.sum(jnp.abs(w))


def test_several_losses_summed_or_backpropagated_separately():
  scaler = jaxscale.init(init_scale=SCALE)
  w = jnp.array([0.5, -0.25, 2.0])
  summed = jax.grad(lambda w: jaxscale.scale(scaler, sum(two_losses(w))))(w)
  # torch's `scaler.scale(loss0).backward(); scaler.scale(loss1).backward()`: gradients add up.
  separately = sum(jax.grad(lambda w, i=i: jaxscale.scale(scaler, two_losses(w)[i]))(w) for i in range(2))
  # `scale` takes a pytree of losses, too.
  as_tree = jax.grad(lambda w: sum(jaxscale.scale(scaler, two_losses(w))))(w)
  assert_trees_equal(summed, separately)
  assert_trees_equal(summed, as_tree)
  unscaled, finite = jaxscale.unscale_and_check(scaler, summed)
  assert bool(finite)
  np.testing.assert_allclose(unscaled, jax.grad(lambda w: sum(two_losses(w)))(w), rtol=1e-6)

  # An overflow in one of the losses makes the whole step skip.
  big = jax.grad(lambda w: jaxscale.scale(scaler, two_losses(w)[0] + 1e38 * two_losses(w)[1]))(w)
  assert not bool(jaxscale.unscale_and_check(scaler, big)[1])


# --- gradient penalty -----------------------------------------------------------------------------

PENALTY = 0.5


def task_loss(w):
  x = jnp.linspace(-1, 1, 8).reshape(4, 2)
  return jnp.mean(jnp.tanh(x @ w) ** 2)


def penalized_loss(w, scaler, *, unscale_first=True):
  """torch's AMP gradient penalty: the inner gradient is unscaled before the penalty is formed."""
  inner = jax.grad(lambda w: jaxscale.scale(scaler, task_loss(w)))(w)
  if unscale_first:
    inner, _ = jaxscale.unscale_and_check(scaler, inner)
  return task_loss(w) + PENALTY * sum(jnp.sum(g**2) for g in jax.tree.leaves(inner))


@pytest.mark.parametrize("init_scale", [SCALE, 2.0**70], ids=["scale_2e10", "scale_2e70"])
def test_gradient_penalty_is_formed_from_unscaled_gradients(init_scale):
  tx = jaxscale.dynamic_loss_scaling(optax.sgd(0.1), init_scale=init_scale)
  w = jnp.array([0.7, -1.3])
  opt_state = tx.init(w)
  scaler = jaxscale.find_scaler(opt_state)
  grads = jax.grad(lambda w: jaxscale.scale(scaler, penalized_loss(w, scaler)))(w)
  updates, opt_state = tx.update(grads, opt_state, w)

  # The reference in plain JAX: the penalty of the true inner gradient.
  plain = lambda w: task_loss(w) + PENALTY * jnp.sum(jax.grad(task_loss)(w) ** 2)
  expected = -0.1 * jax.grad(plain)(w)
  np.testing.assert_allclose(updates, expected, rtol=1e-5)
  assert int(jaxscale.find_scaler(opt_state).skipped_steps) == 0

  # Formed from the scaled gradients, the penalty is scale**2 too large; at 2**70 it overflows.
  wrong = jax.grad(lambda w: jaxscale.scale(scaler, penalized_loss(w, scaler, unscale_first=False)))(w)
  wrong, finite = jaxscale.unscale_and_check(scaler, wrong)
  assert not (bool(finite) and np.allclose(-0.1 * wrong, expected, rtol=1e-2))


# --- gradient clipping ----------------------------------------------------------------------------

CLIP = 1.0
W = {"w": jnp.array([1.0, -2.0, 0.5])}
TRUE_GRADS = {"w": jnp.array([3.0, 4.0, -12.0])}  # global norm 13: clipping is active


def clipped_adam():
  return optax.chain(optax.clip_by_global_norm(CLIP), optax.adam(1e-2))


def clip_inside_inner():
  tx = jaxscale.dynamic_loss_scaling(clipped_adam(), init_scale=SCALE)
  opt_state = tx.init(W)
  scaled = jaxscale.scale(jaxscale.find_scaler(opt_state), TRUE_GRADS)
  return tx.update(scaled, opt_state, W)[0]


def clip_between_unscaling_and_update():
  """torch's `scaler.unscale_(opt); clip_grad_norm_(...); scaler.step(opt)`."""
  tx = jaxscale.dynamic_loss_scaling(optax.adam(1e-2), init_scale=SCALE)
  opt_state = tx.init(W)
  scaled = jax.tree.map(lambda g: g * SCALE, TRUE_GRADS)
  grads, finite = jaxscale.unscale_and_check(jaxscale.find_scaler(opt_state), scaled)
  clip = optax.clip_by_global_norm(CLIP)
  grads, _ = clip.update(grads, clip.init(W))
  return tx.update(grads, opt_state, W, finite=finite)[0]


@pytest.mark.parametrize("recipe", [clip_inside_inner, clip_between_unscaling_and_update], ids=lambda f: f.__name__)
def test_clipping_sees_true_gradients(recipe):
  expected, _ = jax.jit(clipped_adam().update)(TRUE_GRADS, clipped_adam().init(W), W)
  # To a float32 rounding: XLA:GPU fuses the recipe's arithmetic differently (1 ulp seen on an H100).
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6), jax.jit(recipe)(), expected)


def test_clipping_outside_the_wrapper_clips_scaled_gradients():
  """The mistake the recipe warns about: clipping the scaled gradients shrinks them by the scale."""
  tx = optax.chain(optax.clip_by_global_norm(CLIP), jaxscale.dynamic_loss_scaling(optax.sgd(1.0), init_scale=SCALE))
  opt_state = tx.init(W)
  scaled = jaxscale.scale(jaxscale.find_scaler(opt_state), TRUE_GRADS)
  updates, _ = tx.update(scaled, opt_state, W)
  assert float(optax.tree.norm(updates)) == pytest.approx(CLIP / SCALE)
