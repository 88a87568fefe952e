"""Every transformation in `optax` and `optax.contrib`, wrapped in `dynamic_loss_scaling` and jitted.

The catalogue is enumerated, not listed: every public function of the two modules whose required
arguments are all in ARGS (by name) and which then returns a GradientTransformation is tested, so a
new optax release brings its new transformations in. A function annotated to return a
GradientTransformation that cannot be built from ARGS fails `test_the_catalogue_is_complete` until
it is added to ARGS, BUILDERS or NOT_HERE (with the reason).

For each: two finite steps equal the unwrapped optimizer's (on the true gradients; both jitted),
then an inf step and a NaN step leave the parameters and the inner state bit for bit as they were.
Extra arguments (`value`, `grad`, `value_fn`: L-BFGS's line search, `reduce_on_plateau`,
`polyak_sgd`, `momo`) are passed to both.

Finite steps are compared within 2 ulp-ish (rtol 4e-6), not bit for bit: the wrapped and the
unwrapped steps are two XLA programs, and XLA fuses them differently (a moment recomputed inside
another fusion, a fused multiply-add), which moves the last bit of some optimizers and not others,
depending on the XLA release. Op by op the two agree bit for bit (tests/test_optax.py).

The fast tier runs one transformation of each state signature, the full run (CI) all of them, and
the sessions on the other JAX releases (noxfile.py) one of each signature again: `TESTED` below.
"""

import inspect
import os
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxscale
from _bitwise import as_numpy, assert_bitwise_equal
from _jit import compilations

# These tests hand the wrapper gradients of their own making, with no gradient site: the warning
# for an update without its `finite` flag is tested in tests/test_contract.py.
pytestmark = pytest.mark.filterwarnings("ignore:jaxscale. `dynamic_loss_scaling`'s update got no `finite` flag")

# Positive parameters, so positive gradients: optax 0.2.5's scale_by_distance_over_gradients takes
# the square root of the gradients, and a NaN parameter would make the wrapper skip (rightly).
PARAMS = {"w": jnp.linspace(0.25, 1.0, 12, dtype=jnp.float32).reshape(3, 4), "b": jnp.linspace(0.5, 2.0, 4)}
SCALE = 2.0**10


def loss_fn(params):
  """The objective whose gradients are fed in: extra arguments must agree with them."""
  return sum(jnp.sum(0.5 * p**2 + 0.25 * p) for p in jax.tree.leaves(params))


def adam():
  return optax.adam(0.1)


# Required arguments, by name: each a function building the value.
ARGS = {
    "learning_rate": lambda: 0.1,
    "step_size": lambda: 0.1,
    "max_delta": lambda: 0.5,
    "threshold": lambda: 0.5,
    "max_norm": lambda: 0.5,
    "clipping": lambda: 0.5,
    "decay": lambda: 0.9,
    "eta": lambda: 0.01,
    "gamma": lambda: 0.55,
    "max_backtracking_steps": lambda: 4,
    "max_linesearch_steps": lambda: 4,
    "max_consecutive_errors": lambda: 2,
    "step_size_fn": lambda: lambda count: 0.1 / (1.0 + count),
    "inner": adam,
    "tx": adam,
    "base_optimizer": adam,
    "optimizer": adam,
    "adv_optimizer": lambda: optax.sgd(0.05),
    "should_transform_fn": lambda: lambda count: count % 2 == 0,
    "mask": lambda: {"w": True, "b": False},
    "freeze_mask": lambda: {"w": False, "b": True},
    "transforms": lambda: {"a": optax.adam(0.1), "s": optax.sgd(0.1)},
    "param_labels": lambda: {"w": "a", "b": "s"},
    "f": lambda: lambda updates, params=None: jax.tree.map(lambda u: 0.5 * u, updates),
    "measure": lambda: lambda updates, *_: optax.tree.norm(updates),
    "measure_name": lambda: "norm",
}

def seeded(fn):
  """The seed argument: `key` from optax 0.2.6 (without it, a warning), `seed` before."""
  return {"key": 0} if "key" in inspect.signature(fn).parameters else {"seed": 0}


# Transformations built otherwise than from ARGS.
BUILDERS = {
    "optax.chain": lambda: optax.chain(optax.clip_by_global_norm(0.5), optax.adam(0.1)),
    "optax.named_chain": lambda: optax.named_chain(("clip", optax.clip_by_global_norm(0.5)), ("adam", optax.adam(0.1))),
    "optax.stateless_with_tree_map": lambda: optax.stateless_with_tree_map(lambda g, p: 0.5 * g),
    # A random key in the state: on a skipped step it does not advance either.
    "optax.add_noise": lambda: optax.add_noise(0.01, 0.55, **seeded(optax.add_noise)),
    "optax.noisy_sgd": lambda: optax.noisy_sgd(0.1, **seeded(optax.noisy_sgd)),
}

# Not exercised here, and why. None of them is refused by the wrapper.
NOT_HERE = {
    "optax.inject_hyperparams": "returns a factory, not a transformation (tests/test_optax.py wraps its result)",
    "optax.inject_stateful_hyperparams": "returns a factory, not a transformation",
    "optax.lookahead": "takes `optax.LookaheadParams`, not plain parameters "
                       "(an optax calling convention, not a limit of the wrapper)",
    "optax.contrib.dpsgd": "takes per-example gradients (a leading batch axis), which these shared gradients are not",
    "optax.contrib.differentially_private_aggregate": "takes per-example gradients, like dpsgd",
    "optax.contrib.hutchinson_estimator_diag_hessian": "estimates a Hessian diagonal, it makes no updates "
                                                       "(sophia, which uses it, is tested)",
    "optax.measure_with_ema": "returns a measurement, not updates (a monitor for inside a chain)",
    "optax.contrib.scale_by_muon": "takes matrices only; `optax.contrib.muon`, which routes the other leaves to Adam, "
                                   "is tested",
}

# Transformations that take extra arguments, and which.
EXTRA_ARGS = {
    "optax.lbfgs": ("value", "grad", "value_fn"),
    "optax.scale_by_backtracking_linesearch": ("value", "grad", "value_fn"),
    "optax.scale_by_zoom_linesearch": ("value", "grad", "value_fn"),
    "optax.polyak_sgd": ("value",),
    "optax.scale_by_polyak": ("value",),
    "optax.contrib.momo": ("value",),
    "optax.contrib.momo_adam": ("value",),
    "optax.contrib.reduce_on_plateau": ("value",),
    "optax.contrib.sophia": ("obj_fn",),
}

# Finite steps compared more loosely, and why.
RTOL = {
    # Five Newton-Schulz iterations of matrix products amplify a last-bit difference of the two
    # programs' fusions (1e-6 relative after one step, 3e-5 after two).
    "optax.contrib.muon": 1e-4,
}


# Through `low_precision_state` (bfloat16): the optimizers whose state holds a copy of the
# parameters are refused at `init` (16 bits lose every update below half their ulp); the rest
# follow the float32 optimizer within bfloat16's rounding, and skip bit for bit.
LOW_PRECISION_REFUSED = {
    "optax.contrib.cocob", "optax.contrib.scale_by_cocob", "optax.contrib.dog", "optax.contrib.dowg",
    "optax.contrib.madgrad", "optax.contrib.scale_by_madgrad", "optax.contrib.mechanize",
    "optax.contrib.prodigy", "optax.contrib.sam", "optax.scale_by_distance_over_gradients",
    "optax.lbfgs", "optax.scale_by_lbfgs", "optax.contrib.schedule_free",
    "optax.contrib.schedule_free_adamw", "optax.contrib.schedule_free_sgd",
}
# Parameters' distance from the float32 run, relative to how far they moved, after three steps.
LOW_PRECISION_RTOL = {
    # Newton-Schulz on these rank-one gradients: the near-zero singular directions amplify any
    # rounding of the momentum to the size of the step (in float32, a last-bit difference: RTOL).
    "optax.contrib.muon": 2.0,
    # The projection onto the gradients' top singular vectors, stored in bfloat16, is orthonormal
    # only to bfloat16's precision: each of its elements within 2**-7, the projected gradient and
    # the update projected back each within about 2**-7 * sqrt(4) (four rows), Adam's normalization
    # in between amplifying small components; 4% and 5.6% after three steps on two random streams.
    "optax.contrib.galore": 0.1,
    "optax.contrib.scale_by_galore": 0.1,
}


def enumerate_catalogue():
  """(name, factory) for every transformation buildable from ARGS, and the names that are not."""
  built, missing = {}, []
  for module in (optax, optax.contrib):
    for attr in sorted(dir(module)):
      name = f"{module.__name__}.{attr}"
      fn = getattr(module, attr)
      if attr.startswith("_") or not inspect.isfunction(fn) or name in NOT_HERE:
        continue
      if name in BUILDERS:
        built[name] = BUILDERS[name]
        continue
      try:
        params = inspect.signature(fn).parameters.values()
      except (TypeError, ValueError):
        continue
      required = [
          p.name for p in params if p.default is p.empty and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
      ]
      annotated = "GradientTransformation" in str(inspect.signature(fn).return_annotation)
      if any(r not in ARGS for r in required):
        if annotated:
          missing.append(name)
        continue
      build = lambda fn=fn, required=tuple(required): fn(**{r: ARGS[r]() for r in required})
      try:
        with warnings.catch_warnings():
          warnings.simplefilter("ignore", DeprecationWarning)
          tx = build()
      except Exception as error:  # a function that is not a transformation factory
        if annotated:
          missing.append(f"{name} ({type(error).__name__}: {error})")
        continue
      if isinstance(tx, optax.GradientTransformation):
        built[name] = build
  return built, missing


CATALOGUE, MISSING = enumerate_catalogue()


def state_signature(name):
  """What the wrapper and `low_precision_state` see of a transformation, beyond its own numerics.

  They select, store and restore the inner state leaf by leaf, by its dtype (keys, counts and flags
  pass through, floats are rounded to bfloat16), rank, weak type and emptiness; the extra arguments
  pass through to the inner. Two transformations of one signature go through the same jaxscale
  code; only optax's arithmetic differs between them. A transformation with a tolerance of its own
  (its arithmetic amplifies XLA's fusion choices) has a signature of its own.
  """
  with warnings.catch_warnings():
    warnings.simplefilter("ignore", DeprecationWarning)
    state = jax.eval_shape(CATALOGUE[name]().init, PARAMS)
  leaves = frozenset((str(x.dtype), x.ndim, x.weak_type, x.size == 0) for x in jax.tree.leaves(state))
  own_tolerance = name in RTOL or name in LOW_PRECISION_RTOL
  return leaves, EXTRA_ARGS.get(name, ()), name in LOW_PRECISION_REFUSED, name if own_tolerance else None


def one_per_signature():
  """The first transformation (by name) of each `state_signature`: about a quarter of the catalogue."""
  chosen = {}
  for name in sorted(CATALOGUE):
    chosen.setdefault(state_signature(name), name)
  return sorted(chosen.values())


# The whole catalogue runs with the newest optax in CI's full run, one transformation of each
# signature in the fast tier (the others go through the same jaxscale code as one of those).
# noxfile.py's sessions on other JAX releases set JAXSCALE_CATALOGUE=one-per-signature: what differs
# between JAX releases is how jaxscale's compiled skip and storage treat each kind of state leaf,
# which one transformation of each signature shows, at a quarter of the compilations.
ONE_PER_SIGNATURE = one_per_signature()
TESTED = ONE_PER_SIGNATURE if os.environ.get("JAXSCALE_CATALOGUE") == "one-per-signature" else [
    name if name in ONE_PER_SIGNATURE else pytest.param(name, marks=pytest.mark.slow) for name in sorted(CATALOGUE)
]


def test_the_catalogue_is_complete():
  assert not MISSING, f"add these to ARGS, BUILDERS or NOT_HERE in {__file__}: {MISSING}"
  assert len(CATALOGUE) >= 100  # optax 0.2.5 has about 110 such functions


def assert_close(a, b, what, rtol):
  assert jax.tree.structure(a) == jax.tree.structure(b), what
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
    x, y = as_numpy(x), as_numpy(y)
    assert x.dtype == y.dtype, what
    if jnp.issubdtype(x.dtype, jnp.inexact):
      np.testing.assert_allclose(x, y, rtol=rtol, atol=1e-7, err_msg=what)
    elif x.dtype != jax.dtypes.float0:
      np.testing.assert_array_equal(x, y, err_msg=what)


def strong(state):
  """The state with no weak-typed leaf: L-BFGS's `init` has some, its `update` none, and the step
  would compile twice (for the optimizer alone as well)."""
  def strengthen(x):
    x = jnp.asarray(x) if not isinstance(x, jax.Array) else x
    return x if jnp.issubdtype(x.dtype, jax.dtypes.prng_key) else jnp.asarray(x, x.dtype)

  return jax.tree.map(strengthen, state)


def extra_args(name, params):
  values = dict(value=loss_fn(params), grad=jax.grad(loss_fn)(params), value_fn=loss_fn, obj_fn=loss_fn)
  return {k: values[k] for k in EXTRA_ARGS.get(name, ())}


def steps(name, tx, inner):
  """Jitted training steps of the wrapped ``tx`` (the true gradients of ``jaxscale.value_and_grad``,
  one leaf poisoned with 0, inf or NaN) and of ``inner`` alone (true gradients of ``jax.grad``)."""

  @jax.jit
  def wrapped_step(params, state, poison):
    _, grads, finite = jaxscale.value_and_grad(loss_fn)(jaxscale.find_scaler(state), params)
    grads = {**grads, "b": grads["b"].at[1].add(poison)}  # poison: 0, inf or NaN
    updates, state = tx.update(grads, state, params, finite=finite, **extra_args(name, params))
    return optax.apply_updates(params, updates), state

  @jax.jit
  def inner_step(params, state):
    updates, state = inner.update(jax.grad(loss_fn)(params), state, params, **extra_args(name, params))
    return optax.apply_updates(params, updates), state

  return wrapped_step, inner_step


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
@pytest.mark.parametrize("name", TESTED)
def test_wrapped_equals_inner_and_skips_bit_for_bit(name):
  make = CATALOGUE[name]
  tx = jaxscale.dynamic_loss_scaling(make(), init_scale=SCALE)
  inner = optax.with_extra_args_support(make())
  wrapped_step, inner_step = steps(name, tx, inner)

  params, state = PARAMS, strong(tx.init(PARAMS))
  want_params, want_state = PARAMS, strong(inner.init(PARAMS))
  for step in range(2):
    want_params, want_state = inner_step(want_params, want_state)
    assert all(np.isfinite(x).all() for x in jax.tree.leaves(want_params)), f"{name} alone: not finite"
    params, state = wrapped_step(params, state, jnp.float32(0))
    assert_close((params, state.inner_state), (want_params, want_state), f"{name}, finite step {step}",
                 RTOL.get(name, 4e-6))
  for poison in [jnp.inf, jnp.nan]:
    new_params, new_state = wrapped_step(params, state, jnp.float32(poison))
    assert_bitwise_equal(new_params, params, f"{name}: parameters after a {poison} step")
    assert_bitwise_equal(new_state.inner_state, state.inner_state, f"{name}: inner state after a {poison} step")
    assert bool(new_state.scaler.last_skipped)
    state = new_state
  assert float(state.scaler.scale) == SCALE / 4
  assert compilations(wrapped_step) == compilations(inner_step) == 1


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
@pytest.mark.parametrize("name", TESTED)
def test_low_precision_state_follows_inner_and_skips_bit_for_bit(name):
  make = CATALOGUE[name]
  tx = jaxscale.dynamic_loss_scaling(jaxscale.low_precision_state(make()), init_scale=SCALE)
  if name in LOW_PRECISION_REFUSED:
    with pytest.raises(ValueError, match="`low_precision_state` cannot hold a .*State: .*keeps"):
      tx.init(PARAMS)
    return
  inner = optax.with_extra_args_support(make())
  wrapped_step, inner_step = steps(name, tx, inner)

  params, state = PARAMS, strong(tx.init(PARAMS))
  want_params, want_state = PARAMS, strong(inner.init(PARAMS))
  for _ in range(3):
    want_params, want_state = inner_step(want_params, want_state)
    params, state = wrapped_step(params, state, jnp.float32(0))
  rtol = LOW_PRECISION_RTOL.get(name, 0.02)
  for got, want, start in zip(jax.tree.leaves(params), jax.tree.leaves(want_params), jax.tree.leaves(PARAMS)):
    assert got.dtype == want.dtype
    assert np.all(np.abs(got - want) <= rtol * (np.abs(want - start) + 1e-3)), name
  stored = jaxscale._lowp._decode(state.inner_state.inner_state, None)
  assert jax.tree.structure(stored) == jax.tree.structure(want_state)
  for got, want in zip(jax.tree.leaves(stored), jax.tree.leaves(want_state)):
    got, want = as_numpy(got), as_numpy(want)
    assert got.dtype == want.dtype and got.shape == want.shape, name
    if not jnp.issubdtype(want.dtype, jnp.inexact):  # counts and flags: not stored in 16 bits
      np.testing.assert_array_equal(got, want, err_msg=name)
  for poison in [jnp.inf, jnp.nan]:
    new_params, new_state = wrapped_step(params, state, jnp.float32(poison))
    assert_bitwise_equal(new_params, params, f"{name}: parameters after a {poison} step")
    assert_bitwise_equal(new_state.inner_state, state.inner_state, f"{name}: stored state after a {poison} step")
    state = new_state
  assert compilations(wrapped_step) == 1
