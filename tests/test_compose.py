"""One scale for several optimizers and several losses, and the torch AMP example patterns.

Each test pairs with a section of docs/recipes.md: optimizer groups and a GAN sharing one scale,
several losses, a gradient penalty (a gradient of a gradient), gradient clipping anywhere in the
chain. The wrapper's update takes the true gradients of the gradient site
(`jaxscale.value_and_grad`, or `jaxscale.scale` -> `jax.grad` -> `jaxscale.unscale_and_check`);
each reference is plain JAX and Optax on the true gradients.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxscale

# These tests hand the wrapper gradients of their own making, with no gradient site: the warning
# for an update without its `finite` flag is tested in tests/test_contract.py.
pytestmark = pytest.mark.filterwarnings("ignore:jaxscale. `dynamic_loss_scaling`'s update got no `finite` flag")

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
  updates, new_state = jax.jit(tx.update)(GROUP_GRADS, state, GROUPS)
  # Jitted like the wrapped update: on jax 0.5 to 0.7, eager Adam differs from jitted Adam in the last bit.
  expected, _ = jax.jit(grouped().update)(GROUP_GRADS, grouped().init(GROUPS), GROUPS)
  assert_trees_equal(updates, expected)

  # An inf in the discriminator's gradients skips both groups, and backs off once.
  grads = jax.tree.map(lambda g: g, GROUP_GRADS)
  grads["discriminator"]["w"] = grads["discriminator"]["w"].at[0].set(jnp.inf)
  updates, skipped = jax.jit(tx.update)(grads, new_state, GROUPS)
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
  _, grads, finite_d = jaxscale.value_and_grad(d_loss)(scaler, disc, gen, real, z)
  disc, opt_d = step_if_finite(TX_D, grads, opt_d, disc, finite_d)
  # The generator sees the discriminator it has just updated, at the same scale.
  _, grads, finite_g = jaxscale.value_and_grad(g_loss)(scaler, gen, disc, z)
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
  want = jax.grad(lambda w: sum(two_losses(w)))(w)  # plain JAX, no scale
  # The scale is a power of two, so scaling and unscaling are exact; what may differ is the order
  # in which XLA adds the two losses' gradients: a few roundings of 2**-24 each.
  close = lambda got: np.testing.assert_allclose(got, want, rtol=1e-6)
  # The recipe: one `value_and_grad` of the sum, the parts returned for logging.
  (total, parts), grads, finite = jaxscale.value_and_grad(
      lambda w: (sum(two_losses(w)), two_losses(w)), has_aux=True)(scaler, w)
  assert bool(finite) and float(total) == pytest.approx(float(sum(parts)))
  close(grads)
  # torch's `scaler.scale(loss0).backward(); scaler.scale(loss1).backward()`: the true gradients add up.
  close(sum(jaxscale.value_and_grad(lambda w, i=i: two_losses(w)[i])(scaler, w)[1] for i in range(2)))
  # By hand, `scale` takes a pytree of losses, too.
  unscaled, finite = jaxscale.unscale_and_check(
      scaler, jax.grad(lambda w: sum(jaxscale.scale(scaler, two_losses(w))))(w))
  assert bool(finite)
  close(unscaled)

  # An overflow in one of the losses makes the whole step skip.
  _, _, finite = jaxscale.value_and_grad(lambda w: two_losses(w)[0] + 1e38 * two_losses(w)[1])(scaler, w)
  assert not bool(finite)


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


def penalty_step(tx, *, unscale_first=True):
  """One jitted step, its outer gradient by hand as well: `scale` -> `grad` -> `unscale_and_check`."""

  @jax.jit
  def step(w, opt_state):
    scaler = jaxscale.find_scaler(opt_state)
    grads = jax.grad(lambda w: jaxscale.scale(scaler, penalized_loss(w, scaler, unscale_first=unscale_first)))(w)
    grads, finite = jaxscale.unscale_and_check(scaler, grads)
    return tx.update(grads, opt_state, w, finite=finite)

  return step


@pytest.mark.parametrize("init_scale", [SCALE, 2.0**70], ids=["scale_2e10", "scale_2e70"])
def test_gradient_penalty_is_formed_from_unscaled_gradients(init_scale):
  tx = jaxscale.dynamic_loss_scaling(optax.sgd(0.1), init_scale=init_scale)
  w = jnp.array([0.7, -1.3])
  updates, opt_state = penalty_step(tx)(w, tx.init(w))

  # The reference in plain JAX: the penalty of the true inner gradient.
  plain = lambda w: task_loss(w) + PENALTY * jnp.sum(jax.grad(task_loss)(w) ** 2)
  expected = -0.1 * jax.grad(plain)(w)
  np.testing.assert_allclose(updates, expected, rtol=1e-5)
  assert int(jaxscale.find_scaler(opt_state).skipped_steps) == 0

  # Formed from the scaled gradients, the penalty is scale**2 too large; at 2**70 it overflows.
  wrong, opt_state = penalty_step(tx, unscale_first=False)(w, tx.init(w))
  if init_scale == 2.0**70:
    assert bool(jaxscale.find_scaler(opt_state).last_skipped)
  else:
    assert not np.allclose(wrong, expected, rtol=1e-2)


# --- gradient clipping ----------------------------------------------------------------------------

CLIP = 1.0
W = {"w": jnp.array([1.0, -2.0, 0.5])}
TRUE_GRADS = {"w": jnp.array([3.0, 4.0, -12.0])}  # global norm 13: clipping is active


def clipped_adam():
  return optax.chain(optax.clip_by_global_norm(CLIP), optax.adam(1e-2))


def linear_loss(params, grads=TRUE_GRADS):
  """A loss whose gradient with respect to `params` is exactly `grads`."""
  return jnp.sum(params["w"] * grads["w"])


def clip_inside_inner():
  tx = jaxscale.dynamic_loss_scaling(clipped_adam(), init_scale=SCALE)
  opt_state = tx.init(W)
  _, grads, finite = jaxscale.value_and_grad(linear_loss)(jaxscale.find_scaler(opt_state), W)
  return tx.update(grads, opt_state, W, finite=finite)[0]


def clip_in_front_of_the_wrapper():
  """The clip where an Optax user puts it by habit: it sees true gradients, as after torch's `unscale_`."""
  tx = optax.chain(optax.clip_by_global_norm(CLIP), jaxscale.dynamic_loss_scaling(optax.adam(1e-2), init_scale=SCALE))
  opt_state = tx.init(W)
  _, grads, finite = jaxscale.value_and_grad(linear_loss)(jaxscale.find_scaler(opt_state), W)
  return tx.update(grads, opt_state, W, finite=finite)[0]


def clip_between_the_gradient_site_and_update():
  """torch's `scaler.unscale_(opt); clip_grad_norm_(...); scaler.step(opt)`, by hand."""
  tx = jaxscale.dynamic_loss_scaling(optax.adam(1e-2), init_scale=SCALE)
  opt_state = tx.init(W)
  _, grads, finite = jaxscale.value_and_grad(linear_loss)(jaxscale.find_scaler(opt_state), W)
  grads, _ = optax.clip_by_global_norm(CLIP).update(grads, optax.EmptyState())
  return tx.update(grads, opt_state, W, finite=finite)[0]


RECIPES = [clip_inside_inner, clip_in_front_of_the_wrapper, clip_between_the_gradient_site_and_update]


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda f: f.__name__)
def test_clipping_sees_true_gradients(recipe):
  expected, _ = jax.jit(clipped_adam().update)(TRUE_GRADS, clipped_adam().init(W), W)
  # To a float32 rounding: XLA:GPU fuses the recipe's arithmetic differently (1 ulp seen on an H100).
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6), jax.jit(recipe)(), expected)


def test_a_clip_in_front_trains_like_clip_and_inner_on_the_true_gradients():
  """Under the old contract the clip in front saw scaled gradients and shrank every step by the
  scale; now the run is the clipped optimizer's on the true gradients, an overflow skipped."""
  stream = [TRUE_GRADS, {"w": TRUE_GRADS["w"] / 64}, {"w": TRUE_GRADS["w"].at[1].set(jnp.inf)}, {"w": -TRUE_GRADS["w"]}]
  tx = optax.chain(optax.clip_by_global_norm(CLIP), jaxscale.dynamic_loss_scaling(optax.adam(1e-2), init_scale=SCALE))

  @jax.jit
  def step(w, opt_state, g):
    _, grads, finite = jaxscale.value_and_grad(linear_loss)(jaxscale.find_scaler(opt_state), w, g)
    updates, opt_state = tx.update(grads, opt_state, w, finite=finite)
    return optax.apply_updates(w, updates), opt_state

  reference = clipped_adam()
  reference_step = jax.jit(lambda w, s, g: (lambda u, s: (optax.apply_updates(w, u), s))(*reference.update(g, s, w)))
  w, opt_state, want, want_state = W, tx.init(W), W, reference.init(W)
  for i, g in enumerate(stream):
    before = w
    w, opt_state = step(w, opt_state, g)
    if np.isfinite(g["w"]).all():  # the reference steps on the finite gradients only
      want, want_state = reference_step(want, want_state, g)
    else:
      assert_trees_equal(w, before)  # skipped, bit for bit
    # As in test_clipping_sees_true_gradients: to a float32 rounding per step (4 steps: 4 ulps).
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=4e-7 * (i + 1)), w, want)
  scaler = jaxscale.find_scaler(opt_state)
  assert float(scaler.scale) == SCALE / 2 and int(scaler.skipped_steps) == 1


# --- what follows the wrapper in a chain acts on its skipped steps: refused, the wrapper outermost --

AFTER = {
    "momentum_after": lambda: optax.chain(jaxscale.dynamic_loss_scaling(optax.sgd(0.1)), optax.trace(0.9)),
    "adamw_by_hand": lambda: optax.chain(
        jaxscale.dynamic_loss_scaling(optax.scale_by_adam()), optax.add_decayed_weights(1e-2),
        optax.scale_by_learning_rate(optax.linear_schedule(1e-2, 0.0, 100))),
    "adamw_by_hand_constant_lr": lambda: optax.chain(
        jaxscale.dynamic_loss_scaling(optax.scale_by_adam()), optax.add_decayed_weights(1e-2),
        optax.scale_by_learning_rate(1e-2)),
    "nested_chain": lambda: optax.chain(optax.chain(jaxscale.dynamic_loss_scaling(optax.sgd(0.1))), optax.trace(0.9)),
    "named_chain": lambda: optax.named_chain(("scaled", jaxscale.dynamic_loss_scaling(optax.sgd(0.1))),
                                             ("momentum", optax.trace(0.9))),
}
OUTERMOST = {
    "momentum_after": lambda: jaxscale.dynamic_loss_scaling(optax.chain(optax.sgd(0.1), optax.trace(0.9))),
    "adamw_by_hand": lambda: jaxscale.dynamic_loss_scaling(optax.chain(
        optax.scale_by_adam(), optax.add_decayed_weights(1e-2),
        optax.scale_by_learning_rate(optax.linear_schedule(1e-2, 0.0, 100)))),
}
POISONED = [{"w": jnp.array([0.5, -1.0, 2.0])}, {"w": jnp.array([0.5, jnp.inf, 2.0])}]


@pytest.mark.parametrize("wrap", [jax.jit, lambda f: f], ids=["jit", "eager"])
@pytest.mark.parametrize("name", AFTER)
def test_a_transformation_after_the_wrapper_is_refused_where_the_scaler_is_found(name, wrap):
  tx = AFTER[name]()
  opt_state = tx.init(W)
  if type(opt_state) is dict:
    pytest.skip("this optax's named_chain keeps its state in a plain dict, whose order jit sorts: not checked")
  with pytest.raises(ValueError, match=r"transformation after `dynamic_loss_scaling`.*Wrap the whole chain"):
    wrap(jaxscale.find_scaler)(opt_state)
  with pytest.raises(ValueError, match="transformation after `dynamic_loss_scaling`"):
    wrap(jaxscale.metrics)(opt_state)
  # Why: fed the gradient site's true gradients without `find_scaler`, the skipped step moves W.
  _, opt_state = tx.update(POISONED[0], opt_state, W)
  updates, _ = tx.update(POISONED[1], opt_state, W)
  assert_trees_differ(optax.apply_updates(W, updates), W)


@pytest.mark.parametrize("name", OUTERMOST)
def test_the_wrapper_outermost_skips_what_it_wraps_bit_for_bit(name):
  tx = OUTERMOST[name]()

  @jax.jit
  def step(w, opt_state, g):
    _, grads, finite = jaxscale.value_and_grad(linear_loss)(jaxscale.find_scaler(opt_state), w, g)
    updates, opt_state = tx.update(grads, opt_state, w, finite=finite)
    return optax.apply_updates(w, updates), opt_state

  w, opt_state = step(W, tx.init(W), POISONED[0])
  after, new_state = step(w, opt_state, POISONED[1])
  assert_trees_equal(after, w)  # the momentum, the weight decay and the schedule all skipped
  assert_trees_equal(new_state.inner_state, opt_state.inner_state)


def test_nnx_and_linen_states_with_a_transformation_after_the_wrapper_are_refused():
  from flax import nnx
  from flax.training import train_state

  tx = AFTER["momentum_after"]()
  model = nnx.Linear(3, 1, rngs=nnx.Rngs(0))
  optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
  with pytest.raises(ValueError, match="transformation after `dynamic_loss_scaling`"):
    jaxscale.find_scaler(optimizer.opt_state)
  state = train_state.TrainState.create(apply_fn=None, params={"w": jnp.ones(3)}, tx=tx)
  with pytest.raises(ValueError, match="transformation after `dynamic_loss_scaling`"):
    jax.jit(jaxscale.find_scaler)(state)
  # A clip in front, and a user's own tuple around the state, pass.
  ok = optax.chain(optax.clip_by_global_norm(1.0), jaxscale.dynamic_loss_scaling(optax.sgd(0.1)))
  jaxscale.find_scaler((ok.init(W), {"w": jnp.ones(3)}))
