"""low_precision_state: the stored state's error and bias against float64, Adam's second moment
decaying where round-to-nearest bfloat16 sticks, counts and scalars untouched, and the composition
`master_weights(dynamic_loss_scaling(low_precision_state(adam)))`: 16-bit training state of at most
8 bytes per parameter, skipped steps bit for bit, jit with donation, Orbax."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxscale
from _jit import compilations
from jaxscale import _lowp, _rounding

# These tests hand the wrapper gradients of their own making, with no gradient site: the warning
# for an update without its `finite` flag is tested in tests/test_contract.py.
pytestmark = pytest.mark.filterwarnings("ignore:jaxscale. `dynamic_loss_scaling`'s update got no `finite` flag")

def spread(n=4096, seed=0):
  """Values over 60 decades, both signs: what Adam's second moment looks like in a tensor whose
  gradients span 30 decades (float16 with one scale per tensor held 12)."""
  rng = np.random.default_rng(seed)
  return (10.0 ** rng.uniform(-36, 24, n) * rng.choice([-1, 1], n)).astype(np.float32)


@pytest.mark.parametrize("half", [0, 1])
def test_round_trip_within_one_ulp_of_every_element_and_unbiased(half):
  """Each half of one hash's bits (the two moments of a parameter share it) rounds unbiasedly."""
  x = spread()

  def to_bfloat16(x, key):
    bits = _rounding.random_bits(_rounding.leaf_key(key, _rounding.LOW_PRECISION_STATE, 0), x.shape)
    return _rounding.to_bfloat16(x, _rounding.halves(bits)[half])

  stored = jax.jit(to_bfloat16)(jnp.asarray(x), jax.random.PRNGKey(0))
  assert stored.dtype == jnp.bfloat16
  back = np.asarray(stored.astype(jnp.float32)).astype(np.float64)
  x64 = x.astype(np.float64)
  # One bfloat16 ulp, at most 2**-7 of the value (7 stored mantissa bits), for every element:
  # bfloat16 has float32's exponent range, so no element is far from its tensor's largest.
  assert np.all(np.abs(back - x64) <= 2.0**-7 * np.abs(x64))
  assert np.mean(back != x64) > 0.9  # rounded: the test is not vacuous
  # Unbiased: the mean over 256 keys is within 5 standard errors of each value (each draw is off
  # by at most an ulp, so its standard deviation is at most half an ulp).
  many = jax.jit(jax.vmap(lambda k: to_bfloat16(jnp.asarray(x), k).astype(jnp.float32)))(
      jax.random.split(jax.random.PRNGKey(1), 256))
  mean = np.asarray(many, np.float64).mean(axis=0)
  assert np.all(np.abs(mean - x64) <= 5 * 0.5 * 2.0**-7 * np.abs(x64) / np.sqrt(256))
  # The largest float32 values stay finite, infinities stay infinite, NaN stays NaN.
  edges = jnp.asarray([3.4e38, -3.4e38, np.inf, -np.inf, np.nan], jnp.float32)
  got = np.asarray(to_bfloat16(edges, jax.random.PRNGKey(2)).astype(jnp.float32))
  assert np.all(np.isfinite(got[:2])) and list(got[2:4]) == [np.inf, -np.inf] and np.isnan(got[4])


def test_the_two_halves_of_a_hash_round_independently():
  """A parameter's two moments round from the two halves of one hash per element: their rounding
  decisions must be uncorrelated, or the moments' errors would add up instead of averaging out.
  x halfway between two bfloat16 neighbours rounds up with probability 1/2 from either half; over
  n = 2**16 elements the correlation of two independent fair coins has standard deviation
  1/sqrt(n) = 2**-8, and 5 of them bound it."""
  n = 2**16
  x = jnp.full(n, 1.0 + 2.0**-8, jnp.float32)  # halfway between 1 and 1 + 2**-7
  bits = _rounding.random_bits(_rounding.leaf_key(jax.random.PRNGKey(3), _rounding.LOW_PRECISION_STATE, 0), (n,))
  up = [np.asarray(_rounding.to_bfloat16(x, h).astype(jnp.float32)) > 1.0 for h in _rounding.halves(bits)]
  for u in up:
    assert abs(u.mean() - 0.5) <= 5 * 0.5 / np.sqrt(n)
  assert abs(np.corrcoef(up[0], up[1])[0, 1]) <= 5 / np.sqrt(n)
  # Neighbouring elements too: a counter hash with poor mixing rounds runs of them alike.
  assert abs(np.corrcoef(up[0][:-1], up[0][1:])[0, 1]) <= 5 / np.sqrt(n)


def test_adams_second_moment_decays_where_bfloat16_rounded_to_nearest_sticks():
  """Gradients of 1 for 500 steps, then of 0.1: the float64 second moment (b2 = 0.999) falls by
  86% over the next 2000 steps. Stored through low_precision_state it follows within 3%; a bfloat16
  moment rounded to nearest (optax's `mu_dtype` way, for nu) never moves from 1.0."""
  b2, before, after = 0.999, 500, 2000
  g = np.concatenate([np.ones(before), np.full(after, 0.1)])
  nu = 0.0
  for gi in g:
    nu = b2 * nu + (1 - b2) * gi**2
  tx = jaxscale.low_precision_state(optax.scale_by_adam(b2=b2))
  params = jnp.zeros(256)

  def body(state, gi):
    _, state = tx.update(jnp.full(256, gi, jnp.float32), state, params)
    return state, None

  state = jax.jit(lambda s, gs: jax.lax.scan(body, s, gs)[0])(tx.init(params), jnp.asarray(g, jnp.float32))
  stored = _lowp._decode(state.inner_state, None).nu
  assert abs(np.mean(stored) / nu - 1) < 0.03
  # Round to nearest, in bfloat16 (the value after the first 500 steps, 0.39, stuck as well).
  nearest = jnp.bfloat16(0)
  for gi in g:
    nearest = (b2 * nearest.astype(jnp.float32) + (1 - b2) * jnp.float32(gi) ** 2).astype(jnp.bfloat16)
  assert float(nearest) > 2 * nu


def test_counts_scalars_and_constants_are_untouched():
  tx = jaxscale.low_precision_state(optax.chain(
      optax.inject_hyperparams(optax.adam)(learning_rate=1e-3), optax.scale_by_adam(mu_dtype=jnp.bfloat16)
  ))
  params = {"w": jnp.ones((4, 3)), "b": jnp.zeros(3)}
  state = tx.init(params)
  for _ in range(2):
    _, state = tx.update(jax.tree.map(jnp.ones_like, params), state, params)
  injected, adam_state = state.inner_state
  hyper = injected.hyperparams
  assert hyper["learning_rate"].dtype == jnp.float32 and float(hyper["learning_rate"]) == np.float32(1e-3)
  assert injected.inner_state[0].count.dtype == jnp.int32 and int(injected.inner_state[0].count) == 2
  assert isinstance(injected.inner_state[0].nu["w"], _lowp.LowPrecisionArray)
  assert adam_state.mu["w"].values.dtype == jnp.bfloat16  # already 16 bits: stored stochastically too


def test_a_vector_hyperparameter_in_the_state_is_not_rounded():
  """Muon's Newton-Schulz coefficients live in its state, and its update hands them back
  unchanged: they stay float32, bit for bit, and Muon's momentum is stored."""
  coeffs = (3.4445, -4.7750, 2.0315)
  tx = jaxscale.low_precision_state(optax.contrib.muon(1e-3, ns_coeffs=coeffs))
  params = {"w": jnp.ones((8, 4))}
  state = tx.init(params)
  for i in range(3):
    _, state = jax.jit(tx.update)({"w": jax.random.normal(jax.random.key(i), (8, 4))}, state, params)
  leaves = jax.tree.leaves(state.inner_state, is_leaf=lambda x: isinstance(x, _lowp.LowPrecisionArray))
  stored = [x for x in leaves if isinstance(x, _lowp.LowPrecisionArray)]
  vectors = [x for x in leaves if not isinstance(x, _lowp.LowPrecisionArray) and x.shape == (3,)]
  assert [x.values.shape for x in stored] == [(8, 4)]  # the momentum
  assert len(vectors) == 1 and vectors[0].dtype == jnp.float32
  np.testing.assert_array_equal(vectors[0], np.asarray(coeffs, np.float32))


def test_master_weights_inside_is_refused():
  """Its float32 master is a copy of the parameters: in 16 bits it would be plain 16-bit training."""
  wrong = jaxscale.low_precision_state(jaxscale.master_weights(optax.adam(1e-3)))
  message = r"cannot hold a MasterWeightsState.*master_weights\(dynamic_loss_scaling\(low_precision_state\(inner\)\)\)"
  with pytest.raises(ValueError, match=message):
    wrong.init({"w": jnp.ones(3, jnp.float16)})


def test_float16_and_other_dtypes_are_value_errors():
  with pytest.raises(ValueError, match=r"dtype=float16, whose 5-bit exponent spans 40 binades.*Use jnp.bfloat16"):
    jaxscale.low_precision_state(optax.adam(1e-3), dtype=jnp.float16)
  for dtype in [jnp.float32, "float8_e4m3fn", "bf16", jnp.int8]:
    with pytest.raises(ValueError, match=r"use jnp.bfloat16 \(the default\)"):
      jaxscale.low_precision_state(optax.adam(1e-3), dtype=dtype)


def state_bytes(tree) -> int:
  return sum(np.asarray(x).nbytes for x in jax.tree.leaves(tree))


def sixteen_bit_adam(method):
  inner = jaxscale.dynamic_loss_scaling(jaxscale.low_precision_state(optax.adam(1e-3)), init_scale=2.0**8)
  return jaxscale.master_weights(inner, method=method)


def params16():
  key = jax.random.key(0)
  return {"w": jax.random.normal(key, (256, 64)).astype(jnp.float16), "b": jnp.zeros(64, jnp.float16)}


def grads_at(step, params):
  g = jax.tree.map(lambda p: (jax.random.normal(jax.random.key(step), p.shape) * 4).astype(p.dtype), params)
  return {**g, "w": g["w"].at[3, 5].set(jnp.inf)} if step == 2 else g


@pytest.mark.parametrize("method, most", [("kahan", 8.0), ("stochastic_rounding", 6.0)])
def test_sixteen_bit_training_state_bytes_per_parameter(method, most):
  params = params16()
  n = sum(p.size for p in jax.tree.leaves(params))
  state = sixteen_bit_adam(method).init(params)
  per_param = (state_bytes(params) + state_bytes(state)) / n
  assert most < per_param <= most + 0.02  # the scalars: counts, scales, the scaler, the keys
  float32_adam = (state_bytes(jax.tree.map(lambda p: p.astype(jnp.float32), params)) * 3) / n
  assert float32_adam == 12.0


@pytest.mark.parametrize("method", ["kahan", "stochastic_rounding"])
def test_composition_skips_bit_for_bit_under_jit_with_donation(method):
  tx = sixteen_bit_adam(method)

  def step(params, state, grads):
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  donating = jax.jit(step, donate_argnums=(0, 1))
  plain = jax.jit(step)
  params = params16()
  state = tx.init(params)
  for i in range(4):
    want = plain(params, state, grads_at(i, params))
    before = bits(without_scaler((params, state)))
    params, state = donating(params, state, grads_at(i, params))
    assert bits((params, state)) == bits(want)
    assert all(p.dtype == jnp.float16 for p in jax.tree.leaves(params))
    # The inf step: parameters, compensation or key, stored moments and their key as they were.
    assert bool(jaxscale.find_scaler(state).last_skipped) == (i == 2)
    assert (bits(without_scaler((params, state))) == before) == (i == 2)
  assert compilations(donating) == 1


def bits(tree):
  return [np.asarray(x).tobytes() for x in jax.tree.leaves(tree)]


def without_scaler(tree):
  is_scaler = lambda x: isinstance(x, jaxscale.ScalerState)
  return jax.tree.map(lambda x: None if is_scaler(x) else x, tree, is_leaf=is_scaler)


def test_a_scaler_inside_keeps_the_stored_state_and_the_key():
  tx = jaxscale.low_precision_state(jaxscale.dynamic_loss_scaling(optax.adam(1e-3)))
  params = jnp.ones(8)
  state = tx.init(params)
  _, state = tx.update(jnp.ones(8), state, params)
  _, skipped = jax.jit(tx.update)(jnp.full(8, jnp.inf), state, params)
  assert bool(jaxscale.find_scaler(skipped).last_skipped)
  assert bits(without_scaler(skipped)) == bits(without_scaler(state))  # the stored moments and the key


def test_orbax_round_trip_continues_bit_for_bit(tmp_path):
  import orbax.checkpoint as ocp

  tx = sixteen_bit_adam("kahan")

  @jax.jit
  def step(p, s, g):
    u, s = tx.update(g, s, p)
    return optax.apply_updates(p, u), s

  params = params16()
  state = tx.init(params)
  for i in range(3):
    params, state = step(params, state, grads_at(i, params))
  saved = {"params": params, "opt_state": state}
  ckpt = ocp.StandardCheckpointer()
  ckpt.save(tmp_path / "ckpt", saved)
  ckpt.wait_until_finished()
  restored = ckpt.restore(tmp_path / "ckpt", jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), saved))
  ckpt.close()
  assert jax.tree.structure(restored) == jax.tree.structure(saved)
  grads = grads_at(3, params)
  assert bits(step(restored["params"], restored["opt_state"], grads)) == bits(step(params, state, grads))


def test_trains_like_float32():
  """A linear regression with Adam(1e-3), 300 steps: the held-out loss of the 16-bit state within
  0.5% of float32's (measured: +0.001%)."""
  params = {"w": jax.random.normal(jax.random.key(0), (32, 8)), "b": jnp.zeros(8)}
  loss = lambda p, x: jnp.mean((x @ p["w"] + p["b"] - 1.0) ** 2)

  def train(tx):
    def body(carry, i):
      p, s = carry
      g = jax.grad(loss)(p, jax.random.normal(jax.random.key(i), (16, 32)))
      u, s = tx.update(g, s, p)
      return (optax.apply_updates(p, u), s), None

    final = jax.jit(lambda p: jax.lax.scan(body, (p, tx.init(p)), jnp.arange(300))[0][0])(params)
    return float(loss(final, jax.random.normal(jax.random.key(999), (256, 32))))

  reference = train(optax.adam(1e-3))
  assert abs(train(jaxscale.low_precision_state(optax.adam(1e-3))) / reference - 1) < 0.005


def tiny_nnx_model(param_dtype):
  """An Embed, and a Linear and a LayerNorm in an nnx.List: nested Params of three shapes."""
  from flax import nnx

  class Model(nnx.Module):
    def __init__(self, rngs):
      kw = {"param_dtype": param_dtype, "rngs": rngs}
      self.embed = nnx.Embed(5, 4, **kw)
      self.blocks = nnx.List([nnx.Linear(4, 4, **kw), nnx.LayerNorm(4, **kw)])

  return Model(nnx.Rngs(0))


@pytest.mark.parametrize("build, param_dtype", [
    (lambda: jaxscale.low_precision_state(optax.adam(1e-3)), jnp.float32),
    (lambda: sixteen_bit_adam("kahan"), jnp.float16),
    (lambda: sixteen_bit_adam("stochastic_rounding"), jnp.float16),
], ids=["float32-params", "kahan", "stochastic_rounding"])
def test_nnx_optimizer_steps_like_the_plain_parameter_tree(build, param_dtype):
  """Through `nnx.Optimizer`, whose `init` sees Variables and `update` plain arrays (and which writes
  the new state back into its Variables), bit for bit the steps on the plain parameter dict. The
  second update used to fail: the Variable around each stored leaf came back holding a State."""
  from flax import nnx

  model = tiny_nnx_model(param_dtype)
  optimizer = nnx.Optimizer(model, build(), wrt=nnx.Param)
  tx = build()
  params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
  state = tx.init(params)
  grads = lambda step, tree: jax.tree.map(
      lambda p: (jax.random.normal(jax.random.key(step), p.shape) * 4).astype(p.dtype), tree
  )

  @nnx.jit
  def nnx_step(model, optimizer, step):
    optimizer.update(model, grads(step, nnx.state(model, nnx.Param)))

  @jax.jit
  def plain_step(params, state, step):
    updates, state = tx.update(grads(step, params), state, params)
    return optax.apply_updates(params, updates), state

  for step in range(3):
    nnx_step(model, optimizer, step)
    params, state = plain_step(params, state, step)
  assert bits(nnx.to_pure_dict(nnx.state(model, nnx.Param))) == bits(params)
  assert bits(optimizer.opt_state) == bits(state)


def test_an_optimizer_factory_not_called_says_call_it():
  with pytest.raises(TypeError, match=r"call it, e.g. `low_precision_state\(optax.adam\(learning_rate\)\)`"):
    jaxscale.low_precision_state(optax.adam)


def adam_run(tx, params, grads, *, donate=False):
  """``params`` after one step of ``tx`` per row of ``grads`` (float32), and the sum of the
  absolute float32 Adam updates of the same run (the scale of the rounding's error below)."""
  def body(carry, g):
    p, s = carry
    u, s = tx.update(g.astype(jnp.float32), s, p)
    return (optax.apply_updates(p, u), s), None

  return jax.jit(lambda p, gs: jax.lax.scan(body, (p, tx.init(p)), gs)[0][0])(params, grads)


def adam_reference(params, grads, lr):
  """float32 Adam, unwrapped, and the sum of the absolute values of its updates."""
  tx = optax.adam(lr)

  def body(carry, g):
    p, s, moved = carry
    u, s = tx.update(g, s, p)
    return (optax.apply_updates(p, u), s, moved + jnp.abs(u)), None

  final, _, moved = jax.jit(lambda p, gs: jax.lax.scan(body, (p, tx.init(p), jnp.zeros_like(p)), gs)[0])(params, grads)
  return np.asarray(final, np.float64), np.asarray(moved, np.float64)


# Tolerance against float32 Adam, from the noise the stored moments carry. Each step rounds each
# moment stochastically to bfloat16: an unbiased error of at most one ulp, 2**-7 of the value
# (standard deviation at most half of that). A moment with decay b keeps the errors of its last
# ~1 / (1 - b) steps, a random walk damped by b: a standard deviation of about
# 2**-8 / sqrt(1 - b**2), 1.2% for m (b1 = 0.9) and 8.7% for v (b2 = 0.999), 4.4% in sqrt(v).
# An update m / sqrt(v) is then within about 4.6% (one standard deviation) of float32's, and the
# parameters, a sum of such updates with errors correlated over v's memory, within 5 standard
# deviations, 25% of the distance float32's updates moved them; plus float32's own rounding of the
# sums (1e-6 of the parameters' size). The defects this catches are far outside it: NaN, or the
# 4.5x too long step of an element whose second moment was stored as 0.
def assert_follows_float32_adam(got, params, grads, lr, *, parameter_rounding=lambda want, moved: 0.0):
  want, moved = adam_reference(params, grads, lr)
  got = np.asarray(got, np.float64)
  assert np.all(np.isfinite(got))
  tolerance = 0.25 * moved + 1e-6 * np.abs(want) + parameter_rounding(want, moved)
  assert np.all(np.abs(got - want) <= tolerance)


@pytest.mark.parametrize("tiny", [1e-34, 1e-38, 0.0])
def test_no_nan_when_the_state_decays_to_float32s_smallest(tiny):
  """A group of parameters whose gradients fall to ``tiny`` (an unused branch, a frozen group):
  Adam's moments decay by 0.9 and 0.999 a step, through float32's subnormals to 0. float16 state
  with one scale per tensor turned the parameters into NaN at step ~695 (the scale flushed to 0);
  bfloat16 follows float32 Adam all the way."""
  params = jnp.linspace(-1.0, 1.0, 64)
  active = jax.random.normal(jax.random.key(0), (10, 64))
  grads = jnp.concatenate([active, jnp.full((800, 64), tiny, jnp.float32)])
  got = adam_run(jaxscale.low_precision_state(optax.adam(1e-3)), params, grads)
  assert_follows_float32_adam(got, params, grads, 1e-3)


def test_an_element_far_below_its_tensors_largest_moves_as_in_float32():
  """Gradients [10, 1e-6, 1e-3] in one tensor: the second moments are 1e-14 apart. With float16
  and one scale per tensor the 1e-6 element's moment was stored as 0 and it moved 4.5x too far."""
  params = jnp.zeros(3)
  noise = 1 + 0.1 * jax.random.normal(jax.random.key(1), (200, 3))
  grads = jnp.tile(jnp.asarray([10.0, 1e-6, 1e-3]), (200, 1)) * noise
  got = adam_run(jaxscale.low_precision_state(optax.adam(1e-3)), params, grads)
  assert_follows_float32_adam(got, params, grads, 1e-3)


@pytest.mark.parametrize("method", ["kahan", "stochastic_rounding"])
def test_the_full_stack_on_decaying_gradients_has_no_nan(method):
  """`master_weights(dynamic_loss_scaling(low_precision_state(adam)))` on float16 parameters whose
  gradients decay to 1e-34 and stay there for 800 steps: finite, no step skipped, and the float32
  master within a float16 ulp of float32 Adam's parameters."""
  tx = jaxscale.master_weights(
      jaxscale.dynamic_loss_scaling(jaxscale.low_precision_state(optax.adam(1e-3)), init_scale=1.0), method=method)
  params = jnp.linspace(-1.0, 1.0, 64)
  grads = jnp.concatenate([jax.random.normal(jax.random.key(0), (10, 64)), jnp.full((800, 64), 1e-34, jnp.float32)])

  def body(carry, g):
    p, s = carry
    u, s = tx.update(g, s, p)
    return (optax.apply_updates(p, u), s), None

  final, state = jax.jit(lambda p, gs: jax.lax.scan(body, (p, tx.init(p)), gs)[0])(params.astype(jnp.float16), grads)
  assert int(jaxscale.metrics(state)["skipped_steps"]) == 0

  def parameter_rounding(want, moved):
    ulp = 2.0**-10 * np.maximum(np.abs(want), 2.0**-14)  # float16's ulp, at most 2**-10 of the value
    if method == "kahan":
      return ulp  # the last rounding (half an ulp) and the compensation's own
    # Stochastic rounding: each step adds an unbiased error within one ulp, of variance at most
    # f (1 - f) ulp**2 <= ulp * |u| (f, the rounded fraction, is at most |u| / ulp): over the run,
    # variance <= ulp * moved; 6 standard deviations, plus one ulp for the bounded increments.
    return 6 * np.sqrt(ulp * moved) + ulp

  assert_follows_float32_adam(final, params, grads, 1e-3, parameter_rounding=parameter_rounding)


def test_bfloat16_parameters_with_float32_gradients():
  """Adam on bfloat16 parameters takes bfloat16 moments from `init`; float32 gradients promote
  them. The state stays bfloat16 from step to step (one compilation), and the updates are float32
  Adam's on the same parameters: equal at the first step (the state is still exact), within the
  rounding derived above at the next."""
  tx = jaxscale.low_precision_state(optax.adam(1e-3))
  ref = optax.adam(1e-3)
  params = jax.random.normal(jax.random.key(0), (32,)).astype(jnp.bfloat16)
  state, ref_state = tx.init(params), ref.init(params.astype(jnp.float32))
  update = jax.jit(tx.update)
  for i in range(2):
    g = jax.random.normal(jax.random.key(i + 1), (32,))
    m_before = np.abs(np.asarray(ref_state[0].mu, np.float64))
    u, state = update(g, state, params)
    want, ref_state = ref.update(g, ref_state, params.astype(jnp.float32))
    # At the second step m and v come from one rounding of the first's, each within 2**-7 of it:
    # m's error b1 * 2**-7 * |m_before| (bias-corrected by 1 - b1**2, and divided as m is), v's
    # 2**-7, 2**-8 in sqrt(v), within 2**-7 of the update with its second-order terms.
    v_hat = np.asarray(ref_state[0].nu, np.float64) / (1 - 0.999**2)
    want = np.asarray(want, np.float64)
    tol = 2.0**-7 * (np.abs(want) + 1e-3 * 0.9 * m_before / (1 - 0.9**2) / (np.sqrt(v_hat) + 1e-8))
    # At the first step the state is still exact, and the two programs (one jitted, the reference
    # op by op) differ only in how XLA fuses Adam's float32 arithmetic: about 6 roundings of
    # 2**-24 each (m, v, the two bias corrections, sqrt, the quotient), 8 ulps allowed (jax 0.7.1
    # measured 1: 1.2e-10 on an update of 1e-3).
    first = 8 * 2.0**-24 * np.abs(want)
    assert np.all(np.abs(np.asarray(u, np.float64) - want) <= (first if i == 0 else tol))
    assert state.inner_state[0].nu.values.dtype == jnp.bfloat16
  assert compilations(update) == 1


def test_master_weights_and_the_state_draw_independent_numbers():
  """Both default to key 0. A parameter and a state element each exactly halfway between two
  neighbours round up with odds 1/2: on the same random numbers they always agreed, on
  independent ones they agree half the time."""
  n = 4096
  tx = jaxscale.master_weights(jaxscale.low_precision_state(optax.trace(decay=0.5)), method="stochastic_rounding")
  params = jnp.full(n, 2048, jnp.float16)  # float16's ulp there is 2
  state = tx.init(params)
  g = jnp.full(n, 1 + 2.0**-8, jnp.float32)  # bfloat16's ulp at 1 is 2**-7: halfway
  u, state = tx.update(g, state, params)
  # 2048 + g, over float16's ulp of 2: a fraction of 1/2 + 2**-9, as good as halfway.
  param_up = np.asarray(optax.apply_updates(params, u)) > 2049
  state_up = np.asarray(state.inner_state.inner_state.trace.values, np.float32) > 1
  assert 0.4 < param_up.mean() < 0.6 and 0.4 < state_up.mean() < 0.6
  assert 0.45 < np.mean(param_up == state_up) < 0.55  # 4096 draws: 3 standard errors is 0.023


# --- a scaler inside is never stored in 16 bits; a state restored without a target is told ---------


@pytest.mark.parametrize("wrap", [jax.jit, lambda f: f], ids=["jit", "eager"])
def test_a_scaler_inside_stays_float32_and_steps_as_the_right_nesting(wrap):
  # `master_weights(low_precision_state(dynamic_loss_scaling(adam)))`: the scaler's packed options
  # and counters pass through untouched, and it scales, backs off and grows as in the documented
  # `master_weights(dynamic_loss_scaling(low_precision_state(adam)))`.
  options = dict(init_scale=3.0 * 2.0**10, growth_interval=2, backoff_factor=0.3)  # not bfloat16-exact
  adam = optax.adam(1e-3)
  inside = jaxscale.master_weights(jaxscale.low_precision_state(jaxscale.dynamic_loss_scaling(adam, **options)))
  right = jaxscale.master_weights(jaxscale.dynamic_loss_scaling(jaxscale.low_precision_state(adam), **options))
  params = params16()
  states = [inside.init(params), right.init(params)]
  for i in range(5):
    grads = grads_at(i, params)
    states = [wrap(tx.update)(grads, s, params)[1] for tx, s in zip((inside, right), states)]
    found = [jaxscale.find_scaler(s) for s in states]
    assert all(leaf.dtype in (jnp.float32, jnp.int32, jnp.bool_) for leaf in jax.tree.leaves(found[0]))
    assert bits(found[0]) == bits(found[1]), i
    assert jaxscale.metrics(states[0]).keys() == jaxscale.metrics(states[1]).keys()
  # Grown at step 1, backed off at step 2 (the inf), grown at step 4: float32 arithmetic.
  assert float(found[0].scale) == np.float32(np.float32(6144.0) * np.float32(0.3)) * 2


@pytest.mark.parametrize("wrap", [jax.jit, lambda f: f], ids=["jit", "eager"])
def test_a_state_restored_without_a_target_says_what_to_do(wrap):
  import flax.serialization

  params = params16()
  stack = jaxscale.master_weights(jaxscale.dynamic_loss_scaling(jaxscale.low_precision_state(optax.adam(1e-3))))
  for tx, name in ((jaxscale.low_precision_state(optax.adam(1e-3)), "low_precision_state"), (stack, "master_weights")):
    restored = flax.serialization.msgpack_restore(flax.serialization.to_bytes(tx.init(params)))  # nested dicts
    grads = jax.tree.map(lambda p: jnp.ones(p.shape, jnp.float32), params)
    told = rf"`{name}`'s update takes the state its own `init` built.*got an object of type dict.*"
    with pytest.raises(TypeError, match=told + r"restore it into the structure of `tx.init\(params\)`"):
      wrap(tx.update)(grads, restored, params)
  # Where only the inner part came back as a dict, the transformation holding it says so.
  tx = jaxscale.dynamic_loss_scaling(jaxscale.low_precision_state(optax.adam(1e-3)))
  params = jax.tree.map(lambda p: p.astype(jnp.float32), params)
  state = tx.init(params)
  state = state._replace(inner_state=flax.serialization.to_state_dict(state.inner_state))
  with pytest.raises(TypeError, match="`low_precision_state`'s update takes the state its own `init` built"):
    wrap(tx.update)(grads, state, params)


def test_a_parameters_two_moments_share_a_hash_and_parameters_do_not():
  """Adam's ``mu['w']`` and ``nu['w']`` (one kernel updates both) round from the two halves of one
  hash per element; two parameters of one shape (perhaps sharded apart) each draw their own, as
  does an optimizer with one moment per parameter."""
  params = {"a": jnp.ones((3, 2)), "b": jnp.ones((3, 2)), "c": [jnp.ones(4), jnp.ones(5)]}

  def pairs(tx):
    flat = [(path, x) for path, x in jax.tree_util.tree_flatten_with_path(tx.init(params))[0] if x.ndim]
    found = _lowp._pairs([path for path, _ in flat], [x for _, x in flat])
    name = lambda i: jax.tree_util.keystr(flat[i][0])
    return sorted((name(a), name(b)) for a, b in found.items())

  assert pairs(optax.chain(optax.clip(1.0), optax.adamw(1e-3))) == [
      (f"[1][0].mu{k}", f"[1][0].nu{k}") for k in ("['a']", "['b']", "['c'][0]", "['c'][1]")]
  assert pairs(optax.sgd(0.1, momentum=0.9)) == pairs(optax.lion(1e-3)) == []
