"""Autocast per operation: in the jaxpr of `jax.grad` of an autocast loss every matmul and convolution
has float16 operands and every operation of the float32 list float32 ones, whatever dtypes the model
asks for (Flax Linen and NNX layers with float32 dtypes, Equinox, scan over layers, remat, custom_vjp);
loss and gradients within float16 rounding of float32's; one compilation; nesting; NNX write-back and
BatchNorm statistics in their own dtype. The jaxprs are walked here, independently of the library."""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxscale
from _jit import compilations

# These tests hand the wrapper gradients of their own making, with no gradient site: the warning
# for an update without its `finite` flag is tested in tests/test_contract.py.
pytestmark = [
    pytest.mark.jaxpr,
    pytest.mark.filterwarnings("ignore:jaxscale. `dynamic_loss_scaling`'s update got no `finite` flag"),
]

F16, BF16, F32 = np.dtype(jnp.float16), np.dtype(jnp.bfloat16), np.dtype(jnp.float32)
MATMULS = {"dot_general", "conv_general_dilated"}
# torch.autocast's float32 list, as JAX primitives (docs/mixed_precision.md's table).
FLOAT32_OPS = {
    "exp", "exp2", "expm1", "log", "log1p", "pow", "integer_pow", "square", "rsqrt", "acos", "asin",
    "cosh", "sinh", "tan", "erf_inv", "reduce_sum", "reduce_prod", "cumsum", "cumprod", "cumlogsumexp",
}  # fmt: skip


def all_eqns(jaxpr):
  """Every equation of a jaxpr, at any depth (sub-jaxprs found among the parameters)."""
  for eqn in jaxpr.eqns:
    yield eqn
    for value in eqn.params.values():
      for item in value if isinstance(value, (tuple, list)) else (value,):
        inner = getattr(item, "jaxpr", item)
        if hasattr(inner, "eqns"):
          yield from all_eqns(inner)


def floating_operand_dtypes(eqn):
  return [np.dtype(v.aval.dtype) for v in eqn.invars if jnp.issubdtype(v.aval.dtype, jnp.floating)]


def assert_per_operation(fun, *args, compute=F16):
  """Every matmul/convolution in `fun`'s jaxpr has `compute` operands, every float32-list op float32 ones."""
  eqns = list(all_eqns(jax.make_jaxpr(fun)(*args).jaxpr))
  matmuls = [e for e in eqns if e.primitive.name in MATMULS]
  assert matmuls
  for eqn in matmuls:
    assert floating_operand_dtypes(eqn) == [compute, compute], eqn
  for eqn in eqns:
    if eqn.primitive.name in FLOAT32_OPS:
      assert all(d == F32 for d in floating_operand_dtypes(eqn)), eqn
  return eqns


def assert_close_to_float32(cast_loss, loss, *args):
  """Loss and gradients (w.r.t. the first argument) within float16 rounding of float32's, dtypes kept."""
  value, grads = jax.jit(jax.value_and_grad(cast_loss))(*args)
  ref_value, ref_grads = jax.jit(jax.value_and_grad(loss))(*args)
  assert value.dtype == F32
  np.testing.assert_allclose(value, ref_value, rtol=2e-2, atol=1e-3)
  for g, r in zip(jax.tree.leaves(grads), jax.tree.leaves(ref_grads)):
    assert g.dtype == r.dtype
    np.testing.assert_allclose(g, r, rtol=5e-2, atol=5e-3 * float(np.abs(r).max()) + 1e-6)
  assert not all(np.array_equal(g, r) for g, r in zip(jax.tree.leaves(grads), jax.tree.leaves(ref_grads)))


def assert_compiles_once(fun, *args):
  step = jax.jit(jax.value_and_grad(fun))
  for _ in range(3):
    jax.block_until_ready(step(*args))
  assert compilations(step) == 1


def import_equinox():
  """equinox 0.13.0 touches a name that jax 0.7.1 (the oldest supported) deprecates, at import."""
  with warnings.catch_warnings():
    warnings.simplefilter("ignore", DeprecationWarning)
    import equinox

  return equinox


def cross_entropy(logits, labels):
  return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()


def data(n=16, d=8, classes=5):
  x = jax.random.normal(jax.random.key(1), (n, d))
  return x, jax.random.randint(jax.random.key(2), (n,), 0, classes)


def check_model(loss, params, *args):
  cast_loss = jaxscale.autocast(loss, "mixed_float16")
  assert_per_operation(jax.grad(cast_loss), params, *args)
  assert_close_to_float32(cast_loss, loss, params, *args)
  assert_compiles_once(cast_loss, params, *args)


def test_linen_model_whose_every_layer_says_float32():
  import flax.linen as nn

  class Net(nn.Module):
    @nn.compact
    def __call__(self, x):
      x = nn.Dense(32, dtype=jnp.float32, param_dtype=jnp.float32)(x)
      x = nn.LayerNorm(dtype=jnp.float32)(nn.gelu(x))
      x = nn.Conv(4, (3,), dtype=jnp.float32)(x[..., None]).reshape(x.shape[0], -1)
      return nn.Dense(5, dtype=jnp.float32)(nn.relu(x))

  x, y = data()
  model = Net()
  params = model.init(jax.random.key(0), x)
  check_model(lambda p, x, y: cross_entropy(model.apply(p, x), y), params, x, y)


def test_nnx_model_with_float32_param_dtype_and_dtype():
  from flax import nnx

  class Net(nnx.Module):
    def __init__(self, rngs):
      kw = {"dtype": jnp.float32, "param_dtype": jnp.float32, "rngs": rngs}
      self.hidden, self.norm, self.out = nnx.Linear(8, 32, **kw), nnx.LayerNorm(32, **kw), nnx.Linear(32, 5, **kw)

    def __call__(self, x):
      return self.out(nnx.relu(self.norm(self.hidden(x))))

  x, y = data()
  graphdef, state = nnx.split(Net(nnx.Rngs(0)))
  check_model(lambda s, x, y: cross_entropy(nnx.merge(graphdef, s)(x), y), state, x, y)


def test_equinox_mlp():
  eqx = import_equinox()

  mlp = eqx.nn.MLP(8, 5, 32, depth=2, key=jax.random.key(0))
  params, static = eqx.partition(mlp, eqx.is_array)
  x, y = data()
  check_model(lambda p, x, y: cross_entropy(jax.vmap(eqx.combine(p, static))(x), y), params, x, y)


def test_lax_scan_over_layers_with_remat_and_a_custom_vjp_activation():
  @jax.custom_vjp
  def soft_clip(x):
    return 4 * jnp.tanh(x / 4)

  soft_clip.defvjp(lambda x: (soft_clip(x), x), lambda x, g: (g * (1 - jnp.tanh(x / 4) ** 2),))

  def loss(params, x, y):
    @jax.checkpoint
    def layer(h, w):
      return soft_clip(h @ w), None

    h, _ = jax.lax.scan(layer, x, params["stack"])
    return cross_entropy(h @ params["out"], y)

  keys = jax.random.split(jax.random.key(0), 2)
  params = {"stack": jax.random.normal(keys[0], (3, 8, 8)) / 3, "out": jax.random.normal(keys[1], (8, 5)) / 3}
  check_model(loss, params, *data())


def test_flax_nn_scan_and_nn_remat():
  import flax.linen as nn

  class Block(nn.Module):
    @nn.compact
    def __call__(self, h, _):
      return nn.LayerNorm(dtype=jnp.float32)(nn.tanh(nn.Dense(8, dtype=jnp.float32)(h))), None

  class Net(nn.Module):
    @nn.compact
    def __call__(self, x):
      stack = nn.scan(nn.remat(Block), variable_axes={"params": 0}, split_rngs={"params": True}, length=3)
      h, _ = stack()(x, None)
      return nn.Dense(5, dtype=jnp.float32)(h)

  x, y = data()
  model = Net()
  params = model.init(jax.random.key(0), x)
  check_model(lambda p, x, y: cross_entropy(model.apply(p, x), y), params, x, y)


def float32_list_cases():
  """One function per entry of the float32 list, on float16 inputs in range for it."""
  x = jnp.linspace(0.1, 0.9, 12, dtype=jnp.float16).reshape(3, 4)
  return {
      "exp": (jnp.exp, x), "exp2": (jnp.exp2, x), "expm1": (jnp.expm1, x), "log": (jnp.log, x),
      "log1p": (jnp.log1p, x), "pow": (lambda a: a ** (a + 1), x), "integer_pow": (lambda a: a ** 3, x),
      "square": (jnp.square, x), "rsqrt": (jax.lax.rsqrt, x), "acos": (jnp.arccos, x),
      "asin": (jnp.arcsin, x), "cosh": (jnp.cosh, x), "sinh": (jnp.sinh, x), "tan": (jnp.tan, x),
      "erf_inv": (jax.scipy.special.erfinv, x),
      "reduce_sum": (lambda a: jax.lax.reduce(a, np.float16(0), jax.lax.add, (1,)), x),
      "reduce_prod": (lambda a: jax.lax.reduce(a, np.float16(1), jax.lax.mul, (1,)), x),
      "cumsum": (lambda a: jax.lax.cumsum(a, axis=1), x), "cumprod": (lambda a: jax.lax.cumprod(a, axis=1), x),
      "cumlogsumexp": (lambda a: jax.lax.cumlogsumexp(a, axis=1), x),
  }  # fmt: skip


@pytest.mark.parametrize("name", sorted(FLOAT32_OPS))
def test_each_float32_list_operation_runs_in_float32(name):
  fun, x = float32_list_cases()[name]
  cast = jaxscale.autocast(fun, "p=f16,c=f16,o=f32")  # the program is all float16, the op is not
  eqns = [e for e in all_eqns(jax.make_jaxpr(cast)(x).jaxpr) if e.primitive.name == name]
  assert eqns and all(floating_operand_dtypes(e) and set(floating_operand_dtypes(e)) == {F32} for e in eqns)
  in_float32 = np.asarray(fun(x.astype(jnp.float32)))
  np.testing.assert_allclose(cast(x), in_float32.astype(np.float16).astype(np.float32), rtol=1e-3)

def test_autocast_dtypes_in_and_out(strict_promotion):
  """`fun` is traced in its arguments' own dtypes; the matmul runs in float16; integers and keys untouched."""
  seen = {}

  def fun(params, batch, *, key, step):
    seen.update(w=params["w"].dtype, x=batch["x"].dtype, label=batch["label"].dtype, key=key.dtype)
    y = batch["x"] @ params["w"]
    return {"loss": jnp.sum(y), "count": step + 1, "key": key}

  args = ({"w": jnp.ones((3, 2))}, {"x": jnp.ones((4, 3)), "label": jnp.arange(4)})
  kwargs = {"key": jax.random.key(1), "step": jnp.int32(2)}
  cast = jaxscale.autocast(fun, "mixed_float16")
  out = jax.jit(cast)(*args, **kwargs)
  assert seen["w"] == seen["x"] == F32
  assert seen["label"] == np.dtype(jnp.int32) and jax.dtypes.issubdtype(seen["key"], jax.dtypes.prng_key)
  assert out["loss"].dtype == F32 and out["count"].dtype == np.dtype(jnp.int32)
  assert jax.dtypes.issubdtype(out["key"].dtype, jax.dtypes.prng_key)
  program = jax.make_jaxpr(lambda *a: cast(*a, **kwargs))(*args).jaxpr
  dots = [e for e in all_eqns(program) if e.primitive.name == "dot_general"]
  assert [floating_operand_dtypes(e) for e in dots] == [[F16, F16]]


def test_autocast_gradients_arrive_in_float32(strict_promotion):
  w = jax.random.normal(jax.random.key(0), (8, 4))
  x = jax.random.normal(jax.random.key(1), (16, 8))

  def loss(w, x):
    return jnp.mean(jnp.tanh(x @ w) ** 2)

  grads = jax.jit(jax.grad(jaxscale.autocast(loss, "mixed_float16")))(w, x)
  assert grads.dtype == F32
  # Reference, written by hand: the matmul and tanh in float16, the square and the mean in float32.
  by_hand = jax.jit(jax.grad(lambda w: jnp.mean(jnp.tanh(x.astype(F16) @ w.astype(F16)).astype(F32) ** 2)))(w)
  np.testing.assert_array_equal(grads, by_hand)
  exact = jax.grad(loss)(w, x)
  np.testing.assert_allclose(grads, exact, atol=2e-3)
  assert not np.array_equal(grads, exact)  # it really ran in float16


def test_a_nested_float32_region_stays_float32():
  """The user's override wins, as in torch: `autocast(g, "float32")` inside an autocast region."""
  w = jnp.ones((3, 3))

  def fun(x):
    y = x @ w  # float16
    return jaxscale.autocast(lambda y: jnp.tanh(y @ w) @ w, "float32")(y) @ w  # float32 inside, then float16

  cast = jaxscale.autocast(fun, "mixed_float16")
  x = jnp.ones((2, 3))
  for transform in (lambda f: f, jax.grad):
    target = cast if transform is not jax.grad else (lambda x: jnp.sum(cast(x)))
    dots = [e for e in all_eqns(jax.make_jaxpr(transform(target))(x).jaxpr) if e.primitive.name == "dot_general"]
    dtypes = [floating_operand_dtypes(e) for e in dots]
    assert dtypes.count([F32, F32]) == (2 if transform is not jax.grad else 4), dtypes
    assert dtypes.count([F16, F16]) == (2 if transform is not jax.grad else 4), dtypes
  np.testing.assert_allclose(cast(x), fun(x), rtol=1e-2)


def test_enabled_is_one_rule_for_booleans():
  """`enabled` takes what `jaxscale.init(enabled=)` takes: a bool, NumPy's included."""
  inner = lambda x: x @ x
  assert jaxscale.autocast(inner, "mixed_float16", enabled=False) is inner
  assert jaxscale.autocast(inner, "mixed_float16", enabled=np.False_) is inner
  jaxscale.init(enabled=np.True_)
  on = jaxscale.autocast(inner, "mixed_float16", enabled=np.True_)
  assert on is not inner and on(jnp.ones((2, 2))).dtype == F32
  for bad in (1, "yes", None, jnp.bool_(True)):
    with pytest.raises(TypeError, match="enabled"):
      jaxscale.init(enabled=bad)
    with pytest.raises(TypeError, match="enabled"):
      jaxscale.autocast(inner, "mixed_float16", enabled=bad)


def regression_data():
  x = jax.random.normal(jax.random.key(0), (64, 8))
  y = jnp.sin(x @ jax.random.normal(jax.random.key(1), (8, 1)))
  return x, y


def test_linen_model_trains_in_float16_without_dtype():
  import flax.linen as nn

  class MLP(nn.Module):  # no dtype= anywhere
    @nn.compact
    def __call__(self, x):
      return nn.Dense(1)(nn.relu(nn.Dense(32)(x)))

  model, (x, y) = MLP(), regression_data()
  params = model.init(jax.random.key(2), x)
  policy = jaxscale.get_policy("mixed_float16")
  apply = jaxscale.autocast(model.apply, policy)
  tx = jaxscale.dynamic_loss_scaling(optax.adam(1e-2), enabled=jaxscale.needs_loss_scaling(policy))

  def loss_fn(params, x, y):
    return jnp.mean((apply(params, x) - y) ** 2)

  dots = [e for e in all_eqns(jax.make_jaxpr(apply)(params, x).jaxpr) if e.primitive.name == "dot_general"]
  assert dots and all(floating_operand_dtypes(e) == [F16, F16] for e in dots)  # the matmuls run in float16

  @jax.jit
  def step(params, opt_state):
    scaler = jaxscale.find_scaler(opt_state)
    loss, grads = jax.value_and_grad(lambda p: jaxscale.scale(scaler, loss_fn(p, x, y)))(params)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss / scaler.scale

  opt_state = tx.init(params)
  losses = []
  for _ in range(60):
    params, opt_state, loss = step(params, opt_state)
    losses.append(float(loss))
  assert losses[-1] < 0.3 * losses[0]
  assert all(leaf.dtype == F32 for leaf in jax.tree.leaves(params))
  assert compilations(step) == 1


def test_nnx_model_trains_in_float16_without_dtype():
  from flax import nnx

  class MLP(nnx.Module):  # no dtype= anywhere
    def __init__(self, rngs):
      self.hidden, self.out = nnx.Linear(8, 32, rngs=rngs), nnx.Linear(32, 1, rngs=rngs)

    def __call__(self, x):
      return self.out(nnx.relu(self.hidden(x)))

  model, (x, y) = MLP(nnx.Rngs(0)), regression_data()
  policy = jaxscale.get_policy("mixed_float16")
  optimizer = nnx.Optimizer(model, jaxscale.dynamic_loss_scaling(optax.adam(1e-2)), wrt=nnx.Param)
  seen = []

  def loss_fn(model, x, y):
    pred = model(x)
    seen.append(pred.dtype)
    return jnp.mean((pred - y) ** 2)

  cast_loss = jaxscale.autocast(loss_fn, policy)

  @nnx.jit
  def step(model, optimizer):
    scaler = jaxscale.find_scaler(optimizer.opt_state)
    loss, grads = nnx.value_and_grad(lambda m: jaxscale.scale(scaler, cast_loss(m, x, y)))(model)
    optimizer.update(model, grads)
    return loss / scaler.scale

  losses = [float(step(model, optimizer)) for _ in range(60)]
  assert seen == [F32]  # traced once, in the model's own dtypes (the matmuls ran in float16)
  assert losses[-1] < 0.3 * losses[0]
  assert all(leaf.dtype == F32 for leaf in jax.tree.leaves(nnx.state(model, nnx.Param)))


def test_nnx_state_assigned_inside_autocast_reaches_the_module():
  """Dropout's RNG count and a statistic assigned in the region advance as without autocast."""
  from flax import nnx

  class Counting(nnx.Module):
    def __init__(self, rngs):
      self.drop = nnx.Dropout(0.5, rngs=rngs)
      self.total = nnx.BatchStat(jnp.zeros(3))

    def __call__(self, x):
      self.total[...] = self.total[...] + x.sum(0)
      return self.drop(x)

  x = jnp.ones((4, 3))
  plain, cast = Counting(nnx.Rngs(0)), Counting(nnx.Rngs(0))
  run = jaxscale.autocast(lambda m, x: m(x), "mixed_float16")
  jitted = nnx.jit(run)
  for call in (run, run, jitted, jitted):
    expected, got = plain(x), call(cast, x)
    assert got.dtype == F32
    np.testing.assert_array_equal(got == 0, expected == 0)  # the same dropout masks, step by step
  assert cast.total[...].dtype == F32
  np.testing.assert_array_equal(cast.total[...], plain.total[...])


def test_autocast_of_an_nnx_module_or_its_method_casts_the_module():
  """`autocast(model, policy)(x)`: the parameters live in `fun` itself, not in its arguments.
  Uncast, NNX promotes the float16 input back to float32 and nothing runs in float16."""
  from flax import nnx

  class Net(nnx.Module):
    def __init__(self, rngs):
      self.linear, self.drop = nnx.Linear(4, 3, rngs=rngs), nnx.Dropout(0.5, rngs=rngs)

    def __call__(self, x):
      return self.drop(self.linear(x))

    def logits(self, x):
      return self.linear(x)

  x = jnp.ones((2, 4))
  for make in (lambda m: m.linear, lambda m: m.logits):
    model = Net(nnx.Rngs(0))
    run = jaxscale.autocast(make(model), "mixed_float16")
    dots = [e for e in all_eqns(jax.make_jaxpr(run)(x).jaxpr) if e.primitive.name == "dot_general"]
    assert [e.outvars[0].aval.dtype for e in dots] == [F16]
    assert run(x).dtype == F32 and model.linear.kernel[...].dtype == F32
  plain, cast = Net(nnx.Rngs(0)), Net(nnx.Rngs(0))
  for _ in range(2):  # the dropout RNG count inside the module advances as without autocast
    np.testing.assert_array_equal(jaxscale.autocast(cast, "mixed_float16")(x) == 0, plain(x) == 0)


def test_what_an_nnx_call_assigns_is_written_back_in_the_variables_own_dtype():
  """A float32 statistic stays float32 under a bfloat16-parameter policy (it used to become `param_dtype`)."""
  from flax import nnx

  class Accumulate(nnx.Module):
    def __init__(self):
      self.total = nnx.BatchStat(jnp.zeros(3, jnp.float32))
      self.kernel = nnx.Param(jnp.ones((3, 3), jnp.bfloat16))

    def __call__(self, x):
      self.total[...] = self.total[...] + jnp.sum(x @ self.kernel.astype(jnp.float32), axis=0) * 1e-3
      return x

  x = jnp.full((4, 3), 1.0 / 3.0)
  plain, cast = Accumulate(), Accumulate()
  run = jaxscale.autocast(cast, "p=bf16,c=f16,o=f32")
  for _ in range(3):
    plain(x)
    run(x)
  assert cast.total[...].dtype == F32 and cast.kernel[...].dtype == BF16
  np.testing.assert_allclose(cast.total[...], plain.total[...], rtol=1e-3)
  assert not np.array_equal(cast.total[...], np.asarray(cast.total[...]).astype(BF16).astype(F32))


BATCHES, BATCH, FEATURES = 2000, 64, 4


def batchnorm_data():
  """Batches whose mean is exactly 0.5 and (biased) variance exactly 1.02 in every feature."""
  z = np.random.default_rng(0).standard_normal((BATCHES, BATCH, FEATURES))
  z = (z - z.mean(1, keepdims=True)) / z.std(1, keepdims=True)
  return jnp.asarray(0.5 + np.sqrt(1.02) * z, jnp.float32)


def test_linen_batchnorm_statistics_stay_float32_under_autocast():
  import flax.linen as nn

  model = nn.BatchNorm(use_running_average=False, momentum=0.99)
  xs = batchnorm_data()
  variables = model.init(jax.random.key(0), xs[0])

  def run(apply):
    def body(stats, x):
      _, updates = apply({"params": variables["params"], "batch_stats": stats}, x, mutable=["batch_stats"])
      return updates["batch_stats"], None

    return jax.jit(lambda stats: jax.lax.scan(body, stats, xs)[0])(variables["batch_stats"])

  plain, cast = run(model.apply), run(jaxscale.autocast(model.apply, "mixed_float16"))
  for name in ("mean", "var"):
    assert cast[name].dtype == F32
    np.testing.assert_allclose(cast[name], plain[name], rtol=1e-6)
  np.testing.assert_allclose(plain["mean"], 0.5, atol=1e-4)
  np.testing.assert_allclose(plain["var"], 1.02, atol=1e-4)


def test_nnx_batchnorm_statistics_stay_float32_under_autocast():
  from flax import nnx

  xs = batchnorm_data()

  def run(wrap):
    graphdef, state = nnx.split(nnx.BatchNorm(FEATURES, momentum=0.99, rngs=nnx.Rngs(0)))

    def body(state, x):
      model = nnx.merge(graphdef, state)
      wrap(model)(x)
      return nnx.state(model), None

    return nnx.merge(graphdef, jax.jit(lambda s: jax.lax.scan(body, s, xs)[0])(state))

  plain, cast = run(lambda m: m), run(lambda m: jaxscale.autocast(m, "mixed_float16"))
  for name in ("mean", "var"):
    got, expected = getattr(cast, name)[...], getattr(plain, name)[...]
    assert got.dtype == F32
    np.testing.assert_allclose(got, expected, rtol=1e-6)
  np.testing.assert_allclose(plain.mean[...], 0.5, atol=1e-4)
  np.testing.assert_allclose(plain.var[...], 1.02, atol=1e-4)


def make_call_primitive(name, check=None):
  """A higher-order primitive jaxscale has never seen: its parameter `body` is a closed jaxpr
  (`check`, given, refuses some bodies in its abstract evaluation, as a primitive tied to a
  sub-program's form would)."""
  from jax.extend import core

  prim = core.Primitive(name)
  prim.multiple_results = True
  prim.def_impl(lambda *args, body, tag: core.jaxpr_as_fun(body)(*args))

  def abstract(*avals, body, tag):
    if check is not None:
      check(body)
    return body.out_avals

  prim.def_abstract_eval(abstract)
  return lambda inner: lambda x: prim.bind(x, body=jax.make_jaxpr(inner)(x), tag="kept")[0]


def test_an_unknown_higher_order_primitive_is_autocast_by_the_generic_rule():
  """Its body is autocast with its signature kept, every other parameter passes as it was."""
  calling = make_call_primitive("my_call")
  x = jnp.ones((2, 2))
  jaxpr = jax.make_jaxpr(jaxscale.autocast(calling(lambda x: jnp.exp(x @ x)), "mixed_float16"))(x).jaxpr
  (eqn,) = [e for e in all_eqns(jaxpr) if e.primitive.name == "my_call"]
  assert eqn.params["tag"] == "kept" and eqn.params["body"].in_avals == eqn.params["body"].out_avals
  dtypes = [floating_operand_dtypes(e) for e in all_eqns(jaxpr) if e.primitive.name in ("dot_general", "exp")]
  assert dtypes == [[F16, F16], [F32]]


def test_a_primitive_that_cannot_be_rebuilt_is_an_error_naming_it_and_the_jax_version():
  def only_float32_bodies(body):
    if any(e.primitive.name == "dot_general" and e.invars[0].aval.dtype != F32 for e in body.jaxpr.eqns):
      raise TypeError("my_strict_call takes float32 matmuls only")

  calling = make_call_primitive("my_strict_call", only_float32_bodies)
  x = jnp.ones((2, 2))
  message = f"`jaxscale` cannot rebuild the higher-order primitive `my_strict_call` on jax {jax.__version__}"
  with pytest.raises(NotImplementedError, match=message):
    jax.make_jaxpr(jaxscale.autocast(calling(lambda x: x @ x), "mixed_float16"))(x)
  jax.make_jaxpr(jaxscale.autocast(calling(lambda x: x + 1), "mixed_float16"))(x)  # nothing to rebuild


def test_vmap_jvp_and_hessian_of_an_autocast_function():
  w = jax.random.normal(jax.random.key(0), (4, 4)) / 2
  xs = jax.random.normal(jax.random.key(1), (3, 4))

  def f(w, x):
    return jnp.sum(jnp.tanh(x @ w) ** 2)

  cast = jaxscale.autocast(f, "mixed_float16")
  np.testing.assert_allclose(jax.vmap(cast, (None, 0))(w, xs), jax.vmap(f, (None, 0))(w, xs), rtol=2e-2)
  (value, tangent), (ref_value, ref_tangent) = (jax.jvp(g, (w, xs[0]), (w, xs[0])) for g in (cast, f))
  np.testing.assert_allclose([value, tangent], [ref_value, ref_tangent], rtol=2e-2)
  hessian = jax.jit(jax.hessian(cast))(w, xs[0])
  assert hessian.dtype == F32 and hessian.shape == (4, 4, 4, 4)
  np.testing.assert_allclose(hessian, jax.hessian(f)(w, xs[0]), atol=3e-2 * float(jnp.abs(hessian).max()))
  # Second-order: the matmuls of the gradient's own gradient are float16 too.
  assert_per_operation(jax.hessian(cast), w, xs[0])


def test_an_equinox_module_as_fun():
  eqx = import_equinox()

  mlp = eqx.nn.MLP(4, 2, 8, depth=1, key=jax.random.key(0))
  x = jnp.ones(4)
  cast = jaxscale.autocast(mlp, "mixed_float16")
  assert_per_operation(cast, x)
  np.testing.assert_allclose(cast(x), mlp(x), rtol=2e-2, atol=1e-3)


def test_a_nested_float32_region_closing_over_the_outer_trace_stays_float32():
  """The inner region's only traced values are closed over (its argument is a constant)."""
  x = jnp.ones((2, 3))

  def fun(w):
    return jaxscale.autocast(lambda x: x @ w, "float32")(x) @ w

  report = jaxscale.precision_report(jaxscale.autocast(fun, "mixed_float16"), jnp.ones((3, 3)))
  assert report.matmul_flops == {"float32": 2 * 2 * 3 * 3, "float16": 2 * 2 * 3 * 3}


def test_autocast_of_something_not_callable_says_the_function_comes_first():
  with pytest.raises(TypeError, match="takes the function first"):
    jaxscale.autocast("mixed_float16", lambda x: x)


def test_a_python_float_that_float16_cannot_hold_keeps_its_operation_wide():
  """`(x @ w) / 70000.0`: 70000.0 is inf in float16 and the quotient was 0; 3.0 still follows float16."""
  x, w = jnp.full((2, 3), 100.0, F32), jnp.full((3, 2), 100.0, F32)
  cast = jaxscale.autocast(lambda x, w: ((x @ w) / 70000.0, (x @ w) / 3.0, (x @ w) * 1e-6), "p=f32,c=f16,o=f32")
  big, small, tiny = cast(x, w)
  np.testing.assert_allclose(big, 30000.0 / 70000.0, rtol=2**-10)  # x @ w = 30000 in float16: exact
  np.testing.assert_allclose(tiny, 30000.0 * 1e-6, rtol=2**-10)  # 1e-6 is subnormal in float16
  eqns = [e for e in all_eqns(jax.make_jaxpr(cast)(x, w).jaxpr) if e.primitive.name in ("div", "mul")]
  assert [e.outvars[0].aval.dtype for e in eqns] == [F32, F16, F32]
  np.testing.assert_allclose(small, 10000.0, rtol=2**-11)


def compiles_during(call, caplog):
  """How many XLA programs `call()` compiles (jax.log_compiles's records)."""
  import logging

  caplog.clear()
  with jax.log_compiles(True), caplog.at_level(logging.WARNING):
    jax.block_until_ready(call())
  return sum(
      "Finished XLA compilation" in r.getMessage() or "Compiling" in r.getMessage() and "XLA" in r.getMessage()
      for r in caplog.records
  )


@pytest.mark.parametrize("transform", ["grad", "vmap", "plain"])
def test_an_autocast_function_called_eagerly_compiles_once(transform, caplog):
  """Eager `jax.grad(autocast(f))` compiled two programs per call (270-610 ms), `vmap` one."""
  w, x = jnp.ones((4, 4)), jnp.ones((3, 4))
  cast = jaxscale.autocast(lambda w, x: jnp.sum(jnp.tanh(x @ w)), "mixed_float16")
  fn = {"grad": jax.grad(cast), "vmap": jax.vmap(cast, (None, 0)), "plain": cast}[transform]
  assert compiles_during(lambda: fn(w, x), caplog) >= 1
  for _ in range(2):
    assert compiles_during(lambda: fn(w, x), caplog) == 0


def test_custom_vjp_and_custom_jvp_rules_are_autocast_under_grad():
  """Their matmuls ran in float32 under `grad` (forward 120 FLOPs float16, gradient 480 float32)."""

  @jax.custom_vjp
  def linear(x, w):
    return x @ w

  linear.defvjp(lambda x, w: (x @ w, (x, w)), lambda res, g: (g @ res[1].T, res[0].T @ g))

  @jax.custom_jvp
  def square_matmul(h):
    return h @ h.T

  square_matmul.defjvp(lambda p, t: (p[0] @ p[0].T, t[0] @ p[0].T + p[0] @ t[0].T))

  def loss(w, x):
    return jnp.sum(square_matmul(jnp.tanh(linear(x, w))))

  w = jax.random.normal(jax.random.key(0), (4, 3)) / 2
  x = jax.random.normal(jax.random.key(1), (5, 4))
  cast = jaxscale.autocast(loss, "mixed_float16")
  report = jaxscale.precision_report(jax.grad(cast), w, x)
  assert set(report.matmul_flops) == {"float16"}
  # forward: x @ w (2*5*4*3) and h @ h.T (2*5*3*5); backward: the JVP rule's two products
  # (transposed), and the bwd rule's g @ w.T and x.T @ g.
  assert report.matmul_flops["float16"] == 120 + 150 + 2 * 150 + 2 * 120
  assert_close_to_float32(cast, loss, w, x)


def test_float16_values_flow_through_calls_custom_jvp_activations_stop_gradient_and_names():
  """They were converted back to float32 at each: everything elementwise after a ReLU ran in float32."""
  from jax.ad_checkpoint import checkpoint_name

  scale = jax.jit(lambda h: h * 2)

  def fun(w, x):
    h = jax.nn.relu(x @ w)
    h = jax.nn.silu(scale(h)) + jax.nn.gelu(h, approximate=False)  # (approximate: a cube, float32's)
    h = checkpoint_name(h, "hidden") + jax.lax.stop_gradient(h)
    return jnp.tanh(h) @ w

  w, x = jnp.ones((4, 4)), jnp.ones((2, 4))
  jaxpr = jax.make_jaxpr(jaxscale.autocast(fun, "mixed_float16"))(w, x).jaxpr
  for eqn in all_eqns(jaxpr):
    if eqn.primitive.name in ("tanh", "add", "mul", "max", "logistic", "name", "stop_gradient"):
      assert F32 not in floating_operand_dtypes(eqn), eqn
  assert not [e for e in jaxpr.eqns if e.primitive.name == "convert_element_type" and e.params["new_dtype"] == F32][:-1]


def test_a_checkpointed_block_saves_float16_residuals():
  def fun(w, x):
    return jnp.sum(jax.checkpoint(lambda h: jnp.tanh(h @ w) @ w)(x))

  w, x = jnp.ones((4, 4)), jnp.ones((2, 4))
  jaxpr = jax.make_jaxpr(jaxscale.autocast(fun, "mixed_float16"))(w, x).jaxpr
  (remat,) = [e for e in all_eqns(jaxpr) if e.primitive.name in ("checkpoint", "remat", "remat2")]
  assert [v.aval.dtype for v in remat.outvars] == [F16]
  assert [d for e in all_eqns(jaxpr) if e.primitive.name == "tanh" for d in floating_operand_dtypes(e)] == [F16]


def test_stateful_equinox_layers():
  """BatchNorm under vmap and SpectralNorm failed with "Attempted to use old state"."""
  eqx = import_equinox()

  linear = eqx.nn.Linear(3, 3, key=jax.random.key(1))
  norm, state = eqx.nn.make_with_state(eqx.nn.BatchNorm)(3, axis_name="batch", mode="ema")

  def model(x, state):
    return jax.vmap(lambda x, s: norm(linear(x), s), axis_name="batch", in_axes=(0, None), out_axes=(0, None))(x, state)

  x = jax.random.normal(jax.random.key(0), (8, 3))
  (y, new), (ref_y, ref_new) = jaxscale.autocast(model, "mixed_float16")(x, state), model(x, state)
  assert y.dtype == F32
  # BatchNorm normalises by the batch's own statistics: outputs of magnitude ~1, computed from
  # float16 products (relative 2**-11 each, 3 terms): 1e-2 covers them with a wide margin.
  np.testing.assert_allclose(y, ref_y, atol=1e-2)
  for got, expected in zip(jax.tree.leaves(new), jax.tree.leaves(ref_new)):
    assert got.dtype == expected.dtype
    np.testing.assert_allclose(got, expected, atol=1e-2)

  spectral, sstate = eqx.nn.make_with_state(eqx.nn.SpectralNorm)(linear, "weight", key=jax.random.key(3))
  (y, _), (ref_y, _) = jaxscale.autocast(spectral, "mixed_float16")(x[0], sstate), spectral(x[0], sstate)
  np.testing.assert_allclose(y, ref_y, atol=1e-2)


LINEAR_ALGEBRA = {
    "solve": lambda a: jnp.linalg.solve(a, a @ a),
    "inv": lambda a: jnp.linalg.inv(a @ a),
    "expm": lambda a: jax.scipy.linalg.expm(a @ a / 10),
    "cg": lambda a: jax.scipy.sparse.linalg.cg(lambda v: (a @ a.T) @ v, a[0])[0],
}


@pytest.mark.parametrize("name", sorted(LINEAR_ALGEBRA))
def test_linear_solves_run_and_a_float32_region_around_them_is_float32(name):
  """`custom_linear_solve` (solve, inv, expm, cg) was refused, the nested float32 region too."""
  fun = LINEAR_ALGEBRA[name]
  a = jnp.eye(3) * 3 + 0.1 * jax.random.normal(jax.random.key(5), (3, 3))
  reference = np.asarray(jax.jit(fun)(a.astype(np.float64) if jax.config.jax_enable_x64 else a))
  cast = jaxscale.autocast(fun, "mixed_float16")
  # The matrix is well conditioned (|a - 3 I| <= 0.3: condition number below 2 for a, 4 for a @ a),
  # so float16's 2**-11 per product grows by at most the condition number and a few roundings.
  np.testing.assert_allclose(cast(a), reference, rtol=2e-2, atol=2e-2 * np.abs(reference).max())
  assert jax.grad(lambda a: jnp.sum(cast(a)))(a).dtype == F32
  wide = jaxscale.autocast(lambda a: jaxscale.autocast(fun, "float32")(a), "mixed_float16")
  np.testing.assert_allclose(wide(a), reference, rtol=1e-5, atol=1e-5 * np.abs(reference).max())
  report = jaxscale.precision_report(wide, a)
  assert set(report.matmul_flops) == {"float32"}
