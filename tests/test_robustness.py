"""What a new user hits first: stock optimizers under jit, the flag's contract, gradients through a
skipped step, the fallback of the wrapper's fast path, and the helpers on unusual inputs.

The full optax catalogue is in tests/test_catalogue.py; option validation in tests/test_options.py.
"""

import re
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxscale
from _bitwise import assert_bitwise_equal

# These tests hand the wrapper gradients of their own making, with no gradient site: the warning
# for an update without its `finite` flag is tested in tests/test_contract.py.
pytestmark = pytest.mark.filterwarnings("ignore:jaxscale. `dynamic_loss_scaling`'s update got no `finite` flag")

PARAMS = {"w": jnp.linspace(-1.0, 1.0, 6).reshape(2, 3), "b": jnp.arange(3.0)}
GRADS = jax.tree.map(lambda p: jnp.cos(p) * 2.0**-4, PARAMS)
SCALE = 2.0**8


def poisoned(grads, bad=None):
  """The true gradients the wrapper takes, with an inf or a NaN in one leaf if ``bad``."""
  return grads if bad is None else {**grads, "b": grads["b"].at[1].set(bad)}


# --- a new state leaf that is a constant becomes a jaxpr literal ----------------------------------

CONSTANT_STATE = {
    "optimistic_gradient_descent": lambda: optax.optimistic_gradient_descent(0.1),
    "optimistic_adam": lambda: optax.optimistic_adam(0.1),
    "scale_by_optimistic_gradient": lambda: optax.scale_by_optimistic_gradient(),
    "contrib_dog": lambda: optax.contrib.dog(),
}


@pytest.mark.filterwarnings("ignore:`optimistic_adam` is deprecated:DeprecationWarning")
@pytest.mark.parametrize("make", CONSTANT_STATE.values(), ids=CONSTANT_STATE.keys())
def test_optimizers_whose_state_holds_a_constant_jit(make):
  tx, inner = jaxscale.dynamic_loss_scaling(make(), init_scale=SCALE), make()
  state, inner_state = tx.init(PARAMS), inner.init(PARAMS)
  step = jax.jit(tx.update)
  updates, state = step(poisoned(GRADS), state, PARAMS)
  want, inner_state = jax.jit(inner.update)(GRADS, inner_state, PARAMS)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6), updates, want)
  skipped, after = step(poisoned(GRADS, jnp.inf), state, PARAMS)
  assert_bitwise_equal(after.inner_state, state.inner_state)
  assert all((np.asarray(u) == 0).all() for u in jax.tree.leaves(skipped))


def python_scalar_updates():
  """An inner transformation whose updates and new state are Python scalars, not arrays."""
  return optax.GradientTransformation(lambda p: {"n": 0},
                                      lambda u, s, p=None: (jax.tree.map(lambda _: 0.5, u), {"n": 1}))


@pytest.mark.parametrize("jit", [True, False], ids=["jit", "eager"])
def test_inner_returning_python_scalars(jit):
  tx = jaxscale.dynamic_loss_scaling(python_scalar_updates(), init_scale=SCALE)
  state = tx.init(PARAMS)
  update = jax.jit(tx.update) if jit else tx.update
  updates, new_state = update(poisoned(GRADS), state, PARAMS)
  assert all(float(u) == 0.5 for u in jax.tree.leaves(updates))
  assert int(new_state.inner_state["n"]) == 1
  updates, new_state = update(poisoned(GRADS, jnp.nan), state, PARAMS)
  assert all(float(u) == 0.0 for u in jax.tree.leaves(updates))
  assert int(new_state.inner_state["n"]) == 0


@pytest.mark.parametrize("jit", [True, False], ids=["jit", "eager"])
def test_inner_changing_its_state_structure_is_a_clear_error(jit):
  growing = optax.GradientTransformation(lambda p: (), lambda u, s, p=None: (u, (jnp.zeros(()),)))
  tx = jaxscale.dynamic_loss_scaling(growing)
  update = jax.jit(tx.update) if jit else tx.update
  with pytest.raises(ValueError) as error:
    update(GRADS, tx.init(PARAMS), PARAMS)
  # Word for word around the structures (a fragment match would let a mangled message through).
  assert re.fullmatch(
      r"`dynamic_loss_scaling` keeps the inner optimizer's state on a skipped step, so the inner update must "
      r"return a state of the structure it was given; it was given PyTreeDef\(\(\)\) and returned "
      r"PyTreeDef\(\(\*,\)\)\. Build the state's final structure in the optimizer's `init`\.",
      str(error.value),
  ), str(error.value)


# --- eager and jit: one algorithm ------------------------------------------------------------------

SKIP_INNERS = {
    "adam": lambda: optax.adam(1e-2),
    "chain_clip_adamw": lambda: optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-2)),
    "optimistic_adam": lambda: optax.optimistic_adam(0.1),
}


@pytest.mark.filterwarnings("ignore:`optimistic_adam` is deprecated:DeprecationWarning")
@pytest.mark.parametrize("make", SKIP_INNERS.values(), ids=SKIP_INNERS.keys())
def test_eager_and_jitted_steps_agree_and_skip_bit_for_bit(make):
  tx = jaxscale.dynamic_loss_scaling(make(), init_scale=SCALE)
  state = tx.init(PARAMS)
  batches = [poisoned(GRADS), poisoned(GRADS, jnp.inf), poisoned(GRADS), poisoned(GRADS, jnp.nan)]

  def run(update):
    s, out = state, []
    for g in batches:
      updates, s = update(g, s, PARAMS)
      out.append((updates, s))
    return out

  eager, jitted = run(tx.update), run(jax.jit(tx.update))
  # Same values; XLA fuses the compiled step, so equal within the last bit of Adam's rounding.
  for (u_eager, s_eager), (u_jit, s_jit) in zip(eager, jitted):
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6, atol=0), (u_eager, s_eager), (u_jit, s_jit))
  for out in (eager, jitted):  # on the skipped steps, bit for bit the state they were given
    assert_bitwise_equal(out[1][1].inner_state, out[0][1].inner_state)
    assert_bitwise_equal(out[3][1].inner_state, out[2][1].inner_state)


# --- the flag's contract --------------------------------------------------------------------------

# Each flag that is not a boolean scalar, refused by `update` (eagerly and at trace time) and by the
# wrapper's `finite=`. A message given in full (ending in ".") must be that sentence word for word;
# otherwise it must name `finite` and what it must be.
BAD_FLAGS = {
    "vector": (jnp.array([True, False]), ValueError,
               "`finite` must be a bool scalar of shape (), got shape (2,); reduce it first, e.g. with `.all()`."),
    "string": ("yes", TypeError,
               "`finite` must be a bool scalar (such as the flag of `unscale_and_check`), got 'yes' of type str; "
               "compare explicitly, e.g. `jnp.isfinite(x).all()`."),
    "float32_one": (jnp.float32(1.0), TypeError,
                    "`finite` must be a bool scalar (such as the flag of `unscale_and_check`), got an array of dtype "
                    "float32; compare explicitly, e.g. `jnp.isfinite(x).all()`."),
    "float_nan": (jnp.float32(jnp.nan), TypeError, "bool"),
    "float_one": (1.0, TypeError, "bool"),
    "int": (jnp.int32(1), TypeError, "bool"),
}


@pytest.mark.parametrize("flag, error, message", BAD_FLAGS.values(), ids=BAD_FLAGS.keys())
def test_update_refuses_a_flag_that_is_not_a_boolean_scalar(flag, error, message):
  state = jaxscale.init()
  tx = jaxscale.dynamic_loss_scaling(optax.sgd(0.1))
  calls = [lambda: jaxscale.update(state, flag), lambda: tx.update(GRADS, tx.init(PARAMS), PARAMS, finite=flag)]
  if not isinstance(flag, str):  # refused at trace time too
    calls.append(lambda: jax.jit(jaxscale.update)(state, flag))
  for call in calls:
    with pytest.raises(error) as caught:
      call()
    if message.endswith("."):
      assert str(caught.value) == message
    else:
      assert re.search(f"`finite`.*{message}", str(caught.value))


@pytest.mark.parametrize("flag", [True, False, np.bool_(False), jnp.array(True)],
                         ids=["true", "false", "numpy", "array"])
def test_update_takes_boolean_scalars(flag):
  state = jaxscale.update(jaxscale.init(init_scale=SCALE), flag)
  assert float(state.scale) == (SCALE if bool(flag) else SCALE / 2)
  assert all(field.shape == () for field in state.fields().values())


# The wrapper built with `axis_name` agrees over the axis when the flag comes in with `finite=`:
# tests/distributed/test_shard_map.py::test_wrapper_agrees_on_a_flag_passed_in (8 simulated devices).


# --- gradients through a skipped step --------------------------------------------------------------


def meta_loss(lr, params, grads, opt_state, *, make=optax.sgd):
  tx = jaxscale.dynamic_loss_scaling(optax.inject_hyperparams(make)(learning_rate=lr), init_scale=SCALE)
  opt_state = opt_state._replace(inner_state=opt_state.inner_state._replace(
      hyperparams={**opt_state.inner_state.hyperparams, "learning_rate": lr}))
  updates, _ = tx.update(grads, opt_state, params)
  return sum(jnp.sum(p**2) for p in jax.tree.leaves(optax.apply_updates(params, updates)))


@pytest.mark.parametrize("make", [optax.sgd, optax.adam], ids=["sgd", "adam"])
@pytest.mark.parametrize("jit", [True, False], ids=["jit", "eager"])
def test_gradients_through_a_skipped_step_are_finite(make, jit):
  tx = jaxscale.dynamic_loss_scaling(optax.inject_hyperparams(make)(learning_rate=0.1), init_scale=SCALE)
  opt_state = tx.init(PARAMS)
  grad_fn = jax.grad(meta_loss, argnums=(0, 1))
  if jit:
    grad_fn = jax.jit(grad_fn, static_argnames="make")
  for bad in [jnp.inf, jnp.nan]:
    d_lr, d_params = grad_fn(jnp.float32(0.1), PARAMS, poisoned(GRADS, bad), opt_state, make=make)
    # The step was skipped: the loss is sum(params**2), whatever the learning rate.
    assert float(d_lr) == 0.0
    assert_bitwise_equal(d_params, jax.tree.map(lambda p: 2 * p, PARAMS))
  # A finite step still has its true gradient (SGD: d/dlr sum((p - lr g)^2) = -2 sum((p - lr g) g)).
  d_lr, _ = grad_fn(jnp.float32(0.1), PARAMS, poisoned(GRADS), opt_state, make=make)
  if make is optax.sgd:
    want = sum(-2 * jnp.sum((p - 0.1 * g) * g) for p, g in zip(jax.tree.leaves(PARAMS), jax.tree.leaves(GRADS)))
    np.testing.assert_allclose(d_lr, want, rtol=1e-5)
  assert np.isfinite(float(d_lr)) and float(d_lr) != 0.0


def test_gradient_wrt_the_incoming_gradients_of_a_skipped_step_is_zero():
  tx = jaxscale.dynamic_loss_scaling(optax.adam(0.1), init_scale=SCALE)
  opt_state = tx.init(PARAMS)

  def loss(grads):
    updates, _ = tx.update(grads, opt_state, PARAMS)
    return sum(jnp.sum(u) for u in jax.tree.leaves(updates))

  d = jax.jit(jax.grad(loss))(poisoned(GRADS, jnp.inf))
  assert all((np.asarray(x) == 0).all() for x in jax.tree.leaves(d))


# --- a batched (vmapped) scaler ---------------------------------------------------------------------


def batched(n=3, **options):
  return jax.vmap(lambda _: jaxscale.init(**options))(jnp.arange(n))


def test_state_dict_of_a_batched_scaler_is_a_clear_error():
  with pytest.raises(ValueError, match=r"batch.*\(3,\).*state_dict"):
    jaxscale.state_dict(batched())
  with pytest.raises(ValueError, match=r"batch.*\(3,\)"):
    jaxscale.load_state_dict(batched(), jaxscale.state_dict(jaxscale.init()))


def test_raise_if_stalled_on_a_batched_scaler_names_the_stalled_ones():
  states = batched(init_scale=2.0, min_scale=2.0, on_stall="raise")
  jaxscale.raise_if_stalled(states)  # none stalled
  flags = jnp.array([True, False, True])
  states = jax.vmap(jaxscale.update)(states, flags)
  with pytest.raises(FloatingPointError, match=r"\(scalers \[1\] of a batch of shape \(3,\)\)"):
    jaxscale.raise_if_stalled(states)


# --- all_finite on complex and NumPy leaves ----------------------------------------------------------


def test_raise_if_stalled_names_the_stalled_scalers_of_a_2d_batch():
  stall = jax.vmap(jax.vmap(jaxscale.update))
  state = jax.vmap(jax.vmap(lambda _: jaxscale.init(init_scale=2.0, min_scale=1.0, on_stall="raise")))(
      jnp.zeros((2, 2)))
  flags = jnp.array([[True, False], [True, True]])
  state = stall(stall(state, flags), flags)
  with pytest.raises(FloatingPointError) as caught:
    jaxscale.raise_if_stalled(state)
  assert "(scalers [[0, 1]] of a batch of shape (2, 2))" in str(caught.value)
  assert "`min_scale` (1.0)" in str(caught.value) or "`min_scale` ([1.])" in str(caught.value)


def test_all_finite_checks_both_parts_of_complex_leaves_without_warning():
  ok = jnp.asarray([1 + 2j, 3 - 1j], jnp.complex64)
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    assert bool(jaxscale.all_finite({"z": ok}))
    for bad in [complex(np.inf, 0), complex(0, np.inf), complex(np.nan, 1), complex(1, np.nan)]:
      assert not bool(jaxscale.all_finite({"z": ok.at[1].set(bad)})), bad
      assert not bool(jaxscale.unscale_and_check(jaxscale.init(), {"z": ok.at[1].set(bad)})[1]), bad


def test_all_finite_and_unscale_take_numpy_leaves_holding_inf_without_warning():
  tree = {"a": np.array([1.0, np.inf], np.float32), "b": np.array([np.nan], np.float16), "n": np.arange(3)}
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    assert not bool(jaxscale.all_finite(tree))
    _, finite = jaxscale.unscale_and_check(jaxscale.init(init_scale=0.5), tree)
    assert not bool(finite)
    assert bool(jaxscale.all_finite({"a": np.ones(3, np.float32)}))
