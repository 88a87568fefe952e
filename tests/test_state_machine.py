"""A Hypothesis state machine: jaxscale against an independent plain-Python model of the rule.

The machine drives, side by side, the functional API (`update` after `unscale_and_check`, or with a
flag given), the jitted `dynamic_loss_scaling` wrapper around SGD with momentum, and `Model` below
(written from the rule in `_scaler.py`'s docstring and docs/index.md, in NumPy float32 where rounding
matters, and float64 for the parameters). Rules: option changes through `configure`, steps whose
gradients are finite, overflow, or hold an inf or a NaN (in the scaled buffer, or with the flag passed
as `finite=`), `state_dict` round trips, resuming a torch state dict in a freshly built scaler, and
Flax-serialization checkpoints. After every rule the scaler fields, the parameters and the inner
state agree with the model; a skipped step leaves parameters and inner state bit for bit as they were.

Every step function is jitted once for the whole run: changing options must not retrace.
"""

import collections
import math
import os

import flax.serialization
import hypothesis
import pytest
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import optax
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

import jaxscale
from _reference import ReferenceScaler
from _bitwise import bits

# 100 runs of 50 steps, each step checked against the reference model: the full run's.
# These tests hand the wrapper gradients of their own making, with no gradient site: the warning
# for an update without its `finite` flag is tested in tests/test_contract.py.
pytestmark = [
    pytest.mark.slow,
    pytest.mark.filterwarnings("ignore:jaxscale. `dynamic_loss_scaling`'s update got no `finite` flag"),
]

f32 = np.float32
INT32_MAX = 2**31 - 1
LR, MOMENTUM = 2.0**-5, 0.5
# "z" never gets a gradient and starts at -0.0: a skipped step must leave its sign alone.
PARAMS = {"w": jnp.array([0.5, -1.0, 2.0]), "b": jnp.array([0.25, 0.0]), "z": jnp.array([-0.0, -0.0])}
POISONABLE = ("w", "b")


def inner():
  return optax.sgd(LR, momentum=MOMENTUM)


class Model(ReferenceScaler):
  """The reference rule, plus SGD with momentum on the parameters (float64)."""

  def __init__(self, **options):
    super().__init__(**options)
    self.params = {k: np.asarray(v, np.float64) for k, v in PARAMS.items()}
    self.trace = {k: np.zeros_like(v) for k, v in self.params.items()}
    self.moved = 0.0  # sum of |updates| so far: bounds the float32 rounding the parameters gathered

  def step(self, finite, grads):
    """One step; returns whether the optimizer step was taken."""
    taken = self.update(finite)
    if taken:
      self._sgd(grads)
    return taken

  def _sgd(self, grads):
    for k in self.params:
      g = np.asarray(grads[k], np.float64) if k in grads else 0.0
      self.trace[k] = g + MOMENTUM * self.trace[k]
      self.params[k] = self.params[k] - LR * self.trace[k]
      self.moved += float(np.max(np.abs(LR * self.trace[k]), initial=0.0))



# One wrapper per value of `enabled` (the only option the wrapper reads at construction); every
# other option lives in the state, so one compiled step serves every configuration.
TXS = {enabled: jaxscale.dynamic_loss_scaling(inner(), enabled=enabled) for enabled in (True, False)}


TRACES = collections.Counter()  # how often each step function was traced, over the whole run


def _wrapper_steps(tx, enabled):
  @jax.jit
  def checked(params, opt_state, scaled_grads):
    """The gradient site by hand (unscale and check with the optimizer's own scaler), then the update."""
    TRACES["checked", enabled] += 1
    grads, finite = jaxscale.unscale_and_check(jaxscale.find_scaler(opt_state), scaled_grads)
    updates, opt_state = tx.update(grads, opt_state, params, finite=finite)
    return optax.apply_updates(params, updates), opt_state, updates

  @jax.jit
  def flagged(params, opt_state, grads, finite):
    TRACES["flagged", enabled] += 1
    updates, opt_state = tx.update(grads, opt_state, params, finite=finite)
    return optax.apply_updates(params, updates), opt_state, updates

  return checked, flagged


WRAPPER_STEPS = {enabled: _wrapper_steps(tx, enabled) for enabled, tx in TXS.items()}


@jax.jit
def functional_checked(state, scaled_grads):
  TRACES["functional_checked"] += 1
  grads, finite = jaxscale.unscale_and_check(state, scaled_grads)
  return jaxscale.update(state, finite), grads


@jax.jit
def functional_flagged(state, finite):
  TRACES["functional_flagged"] += 1
  return jaxscale.update(state, finite)


POWERS = st.integers(-8, 126).map(lambda e: 2.0**e)
SCALES = st.one_of(POWERS, st.sampled_from([3.0, 1000.0, 0.3, 12345.678, 2.0**127]))
GROWTH = st.sampled_from([2.0, 4.0, 3.0, 1.5, 1.0 + 2.0**-20])
BACKOFF = st.sampled_from([0.5, 0.75, 0.6, 0.9])  # >= 0.5: 40 back-offs keep every scale normal
INTERVALS = st.one_of(st.integers(1, 5), st.just(INT32_MAX))
HYSTERESIS = st.integers(1, 3)


def bounds(data, scale):
  """min_scale <= scale <= max_scale, sometimes tight."""
  with np.errstate(over="ignore"):
    return _bounds(data, scale)


def _bounds(data, scale):
  lo = data.draw(st.one_of(st.just(0.0), st.integers(0, 4).map(lambda k: float(f32(scale) * f32(2.0**-k)))))
  hi = data.draw(st.one_of(st.just(math.inf), st.integers(0, 4).map(lambda k: float(f32(scale) * f32(2.0**k)))))
  return lo, hi


def true_grads(data):
  """Exactly representable gradients: small integers times a power of two."""
  e = data.draw(st.integers(-3, 0), label="gradient exponent")
  out = {}
  for k in POISONABLE:
    m = data.draw(st.lists(st.integers(-7, 7), min_size=PARAMS[k].size, max_size=PARAMS[k].size), label=k)
    out[k] = np.asarray(m, np.float32) * f32(2.0**e)
  out["z"] = np.zeros(PARAMS["z"].shape, np.float32)
  return out


def poison(data, grads):
  kind = data.draw(st.sampled_from([np.inf, -np.inf, np.nan]), label="poison")
  leaf = data.draw(st.sampled_from(POISONABLE), label="poisoned leaf")
  index = data.draw(st.integers(0, grads[leaf].size - 1), label="poisoned index")
  grads = dict(grads)
  grads[leaf] = grads[leaf].copy()
  grads[leaf][index] = kind
  return grads


class ScalerMachine(RuleBasedStateMachine):

  @initialize(data=st.data())
  def start(self, data):
    enabled = data.draw(st.sampled_from([True, True, True, False]), label="enabled")
    scale = data.draw(SCALES, label="init_scale")
    lo, hi = bounds(data, scale) if enabled else (0.0, math.inf)
    options = dict(
        init_scale=scale, growth_factor=data.draw(GROWTH), backoff_factor=data.draw(BACKOFF),
        growth_interval=data.draw(INTERVALS), hysteresis=data.draw(HYSTERESIS),
        min_scale=lo, max_scale=hi, dynamic=data.draw(st.booleans(), label="dynamic"),
        on_stall=data.draw(st.sampled_from(["skip", "raise"]), label="on_stall"),
    )
    self.model = Model(enabled=enabled, **options)
    self.functional = jaxscale.init(enabled=enabled, **options)
    tx = jaxscale.dynamic_loss_scaling(inner(), enabled=enabled, **options)
    self.params, self.opt_state = PARAMS, tx.init(PARAMS)
    self.checked, self.flagged = WRAPPER_STEPS[enabled]

  # -- options ---------------------------------------------------------------------------------

  @rule(data=st.data())
  def configure(self, data):
    m = self.model
    names = data.draw(st.sets(st.sampled_from(Model.OPTIONS), min_size=1, max_size=4), label="changed")
    changes = {}
    if "scale" in names:
      changes["scale"] = data.draw(SCALES, label="scale")
    if "min_scale" in names or "max_scale" in names:
      lo, hi = bounds(data, changes.get("scale", m.scale))
      if "min_scale" in names:
        changes["min_scale"] = lo
      if "max_scale" in names:
        changes["max_scale"] = hi
    draws = dict(growth_factor=GROWTH, backoff_factor=BACKOFF, growth_interval=INTERVALS,
                 hysteresis=HYSTERESIS, dynamic=st.booleans(),
                 growth_tracker=st.one_of(st.integers(0, 6), st.sampled_from([INT32_MAX - 1, INT32_MAX])))
    for name in names & draws.keys():
      changes[name] = data.draw(draws[name], label=name)
    # On a disabled scaler the scale stays 1.0; its bounds are then checked against the scale asked for.
    merged = {**m.options(), **changes}
    if not Model.valid(merged):
      hypothesis.event("configure: drew an invalid combination, not applied")
      return
    hypothesis.event(f"configure: {sorted(changes)}")
    self.functional = jaxscale.configure(self.functional, **changes)
    self.opt_state = self.opt_state._replace(scaler=jaxscale.configure(self.opt_state.scaler, **changes))
    m.configure(**changes)

  @precondition(lambda self: self.model.enabled)
  @rule()
  def near_saturation(self):
    # Two steps from int32's end of the skipped-step counter (a long run would get here).
    count = jnp.array(INT32_MAX - 1, jnp.int32)
    self.functional = self.functional.replace(skipped_steps=count)
    self.opt_state = self.opt_state._replace(scaler=self.opt_state.scaler.replace(skipped_steps=jnp.array(count)))
    self.model.skipped_steps = INT32_MAX - 1

  # -- steps ------------------------------------------------------------------------------------

  @rule(data=st.data())
  def scaled_step(self, data):
    """Gradients of the scaled loss: maybe poisoned, maybe overflowing at a large scale."""
    grads = true_grads(data)
    if self.model.enabled and data.draw(st.booleans(), label="poisoned"):
      grads = poison(data, grads)
    with np.errstate(over="ignore", invalid="ignore"):
      scaled = {k: g * self.model.scale for k, g in grads.items()}  # float32, as the loss scaling makes them
    finite = all(np.isfinite(g).all() for g in scaled.values())
    hypothesis.event(f"scaled step: {'finite' if finite else 'not finite'}")

    self.functional, unscaled = functional_checked(self.functional, scaled)
    if finite:
      for k in grads:  # within the two roundings of torch's g * fl(1/scale)
        np.testing.assert_allclose(unscaled[k], grads[k], rtol=3e-7, atol=0)
    self._wrapper_step(self.checked, (scaled,), finite, grads)

  @rule(data=st.data(), finite=st.booleans())
  def flagged_step(self, data, finite):
    """True gradients with a flag: the flag given is ANDed with the wrapper's own check (the
    gradients are poisoned only where the flag is False, so the flag decides)."""
    grads = true_grads(data)
    if self.model.enabled and not finite and data.draw(st.booleans(), label="poisoned"):
      grads = poison(data, grads)
    hypothesis.event(f"flagged step: {finite}")
    self.functional = functional_flagged(self.functional, jnp.asarray(finite))
    self._wrapper_step(self.flagged, (grads, jnp.asarray(finite)), finite, grads)

  def _wrapper_step(self, step, args, finite, grads):
    before = bits((self.params, self.opt_state.inner_state))
    self.params, self.opt_state, updates = step(self.params, self.opt_state, *args)
    taken = self.model.step(finite, grads)
    if not taken:
      assert bits((self.params, self.opt_state.inner_state)) == before
      for u in jax.tree.leaves(updates):
        assert not np.asarray(u).any() and np.signbit(u).all(), "a skipped update must be -0.0"
    if self.model.stalled:
      hypothesis.event("stalled")

  # -- state dicts and checkpoints --------------------------------------------------------------

  @rule()
  def state_dict_round_trip(self):
    for state in (self.functional, self.opt_state.scaler):
      d = jaxscale.state_dict(state)
      assert d == self.model.torch_dict()
      again = jaxscale.load_state_dict(state, d)
      assert bits(again) == bits(state)

  @precondition(lambda self: self.model.enabled)
  @rule()
  def resume_torch_dict_in_a_fresh_scaler(self):
    """A torch state dict loaded into a newly built scaler with this run's other options."""
    m = self.model
    d = jaxscale.state_dict(self.functional)
    fresh = dict(init_scale=float(m.scale), hysteresis=m.hysteresis, min_scale=float(m.min_scale),
                 max_scale=float(m.max_scale), dynamic=m.dynamic,
                 on_stall="raise" if m.raise_on_stall else "skip")
    self.functional = jaxscale.load_state_dict(jaxscale.init(**fresh), d)
    self.opt_state = self.opt_state._replace(scaler=jaxscale.load_state_dict(jaxscale.init(**fresh), d))
    m.hysteresis_tracker, m.skipped_steps, m.last_skipped, m.stalled = m.hysteresis, 0, False, False

  @rule()
  def checkpoint(self):
    everything = {"functional": self.functional, "params": self.params, "opt_state": self.opt_state}
    template = {"functional": jaxscale.init(), "params": PARAMS, "opt_state": TXS[True].init(PARAMS)}
    restored = flax.serialization.from_bytes(template, flax.serialization.to_bytes(everything))
    restored = jax.tree.map(jnp.asarray, restored)
    assert jax.tree.structure(restored) == jax.tree.structure(everything)
    assert bits(restored) == bits(everything)
    self.functional, self.params, self.opt_state = restored["functional"], restored["params"], restored["opt_state"]

  # -- agreement --------------------------------------------------------------------------------

  @invariant()
  def agrees_with_the_model(self):
    m = self.model
    for state in (jax.device_get(self.functional), jax.device_get(self.opt_state.scaler)):
      assert state.scale == m.scale and state.scale.dtype == np.float32
      assert int(state.growth_tracker) == m.growth_tracker
      assert int(state.hysteresis_tracker) == m.hysteresis_tracker
      assert int(state.skipped_steps) == m.skipped_steps
      assert bool(state.last_skipped) == m.last_skipped
      assert bool(state.stalled) == m.stalled
      for name in ("growth_factor", "backoff_factor", "min_scale", "max_scale"):
        assert getattr(state, name) == getattr(m, name), name
      assert (int(state.growth_interval), int(state.hysteresis), bool(state.dynamic)) == (
          m.growth_interval, m.hysteresis, m.dynamic)
    tol = 4e-7 * (1.0 + m.moved)
    for k, p in self.params.items():
      np.testing.assert_allclose(p, m.params[k], rtol=1e-6, atol=tol, err_msg=k)
      np.testing.assert_allclose(self.opt_state.inner_state[0].trace[k], m.trace[k], rtol=1e-6, atol=tol, err_msg=k)
    assert np.signbit(self.params["z"]).all() and not np.asarray(self.params["z"]).any()

  def teardown(self):
    # Options, flags and scales changed freely, states came back from checkpoints: one trace each.
    assert all(n == 1 for n in TRACES.values()), TRACES


ScalerMachine.TestCase.settings = hypothesis.settings(
    # tests/MUTATION.md runs it shorter, once per mutant.
    max_examples=int(os.environ.get("JAXSCALE_STATE_MACHINE_EXAMPLES", "100")), stateful_step_count=50,
    deadline=None, derandomize=True, database=None,
    suppress_health_check=[hypothesis.HealthCheck.too_slow],
)
test_scaler_state_machine = ScalerMachine.TestCase
