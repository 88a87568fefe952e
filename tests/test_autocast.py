"""Autocast per operation: in the jaxpr of `jax.grad` of an autocast loss every matmul and convolution
has float16 operands and every operation of the float32 list float32 ones, whatever dtypes the model
asks for (Flax Linen and NNX layers with float32 dtypes, Equinox, scan over layers, remat, custom_vjp);
loss and gradients within float16 rounding of float32's; one compilation; nesting; NNX write-back and
BatchNorm statistics in their own dtype. The jaxprs are walked here, independently of the library."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxscale

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
  assert step._cache_size() == 1


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
      kw = dict(dtype=jnp.float32, param_dtype=jnp.float32, rngs=rngs)
      self.hidden, self.norm, self.out = nnx.Linear(8, 32, **kw), nnx.LayerNorm(32, **kw), nnx.Linear(32, 5, **kw)

    def __call__(self, x):
      return self.out(nnx.relu(self.norm(self.hidden(x))))

  x, y = data()
  graphdef, state = nnx.split(Net(nnx.Rngs(0)))
  check_model(lambda s, x, y: cross_entropy(nnx.merge(graphdef, s)(x), y), state, x, y)


def test_equinox_mlp():
  import equinox as eqx

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
      "erf_inv": (jax.scipy.special.erfinv, x), "reduce_sum": (lambda a: jax.lax.reduce_sum_p.bind(a, axes=(1,), out_sharding=None), x),
      "reduce_prod": (lambda a: jax.lax.reduce_prod_p.bind(a, axes=(1,), out_sharding=None), x),
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
