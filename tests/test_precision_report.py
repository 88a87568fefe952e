"""The precision report: its FLOP counts against counts made by hand from the shapes, the dtypes it names,
and the case it exists for: a Flax ResNet whose layers say `dtype=jnp.float32` runs 0% of its convolutions
in float16 under a jmp-style boundary cast, 100% under autocast, forward and backward."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxscale

pytestmark = pytest.mark.jaxpr

B, D, H, C = 4, 8, 16, 3


def two_layers(params, x):
  return jnp.sum(jnp.tanh(x @ params["w1"]) @ params["w2"])


def params_and_x(dtype=jnp.float32):
  return {"w1": jnp.ones((D, H), dtype), "w2": jnp.ones((H, C), dtype)}, jnp.ones((B, D), dtype)


def test_two_layer_model_forward_and_backward_by_hand():
  forward = 2 * B * D * H + 2 * B * H * C
  # jax.grad with respect to the parameters: dW2 = h^T g, dh = g W2^T, dW1 = x^T dh (no dx).
  backward = 2 * B * H * C + 2 * B * C * H + 2 * B * D * H
  params, x = params_and_x()
  assert jaxscale.precision_report(two_layers, params, x).matmul_flops == {"float32": forward}
  cast = jaxscale.autocast(two_layers, "mixed_float16")
  assert jaxscale.precision_report(cast, params, x).matmul_flops == {"float16": forward}
  report = jaxscale.precision_report(jax.grad(cast), params, x)
  assert report.matmul_flops == {"float16": forward + backward}
  assert report.share(jnp.float16) == 1.0 and report.share("float32") == 0.0
  assert report.float32_ops_in_16_bits == {} and report.while_loops == 0


def test_a_walk_of_the_jaxpr_by_hand_agrees():
  """Every dot_general's 2*M*N*K, read off its operand shapes one by one."""
  params, x = params_and_x()
  fun = jax.grad(jaxscale.autocast(two_layers, "mixed_float16"))
  total = 0

  def walk(jaxpr):
    nonlocal total
    for eqn in jaxpr.eqns:
      if eqn.primitive.name == "dot_general":
        (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
        lhs, rhs = (v.aval.shape for v in eqn.invars)
        m = np.prod([s for i, s in enumerate(lhs) if i not in lc and i not in lb])
        n = np.prod([s for i, s in enumerate(rhs) if i not in rc and i not in rb])
        k, b = np.prod([lhs[i] for i in lc]), np.prod([lhs[i] for i in lb])
        total += 2 * b * m * n * k
      for value in eqn.params.values():
        if hasattr(value, "jaxpr"):
          walk(value.jaxpr)

  walk(jax.make_jaxpr(fun)(params, x).jaxpr)
  assert jaxscale.precision_report(fun, params, x).matmul_flops == {"float16": total}


def test_convolution_scan_and_while_loop():
  x = jnp.ones((2, 8, 8, 3))
  kernel = jnp.ones((3, 3, 3, 5))

  def conv(x, kernel):
    return jax.lax.conv_general_dilated(x, kernel, (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC"))

  assert jaxscale.precision_report(conv, x, kernel).matmul_flops == {"float32": 2 * (2 * 8 * 8 * 5) * (3 * 3 * 3)}
  grouped = lambda x, k: jax.lax.conv_general_dilated(
      x, k, (2, 2), "VALID", dimension_numbers=("NHWC", "HWIO", "NHWC"), feature_group_count=2)
  report = jaxscale.precision_report(grouped, jnp.ones((1, 9, 9, 4)), jnp.ones((3, 3, 2, 6)))
  assert report.matmul_flops == {"float32": 2 * (1 * 4 * 4 * 6) * (3 * 3 * 2)}

  w = jnp.ones((3, D, D), jnp.float16)
  stacked = lambda w, h: jax.lax.scan(lambda h, w: (h @ w, None), h, w)[0]
  report = jaxscale.precision_report(stacked, w, jnp.ones((B, D), jnp.float16))
  assert report.matmul_flops == {"float16": 3 * 2 * B * D * D}
  looped = lambda w, h: jax.lax.while_loop(lambda c: c[0] < 5, lambda c: (c[0] + 1, c[1] @ w), (0, h))[1]
  report = jaxscale.precision_report(looped, w[0], jnp.ones((B, D), jnp.float16))
  assert report.matmul_flops == {"float16": 2 * B * D * D} and report.while_loops == 1
  assert "while loops counted once: 1" in str(report)


def test_float32_list_operations_in_16_bits_are_named():
  def f(x):
    return jnp.log(jnp.sum(jnp.exp(x @ x)))

  x = jnp.ones((3, 3), jnp.float16)
  report = jaxscale.precision_report(f, x)
  assert report.float32_ops_in_16_bits == {"exp": 1, "log": 1}  # jnp.sum already sums float16 in float32
  assert "float32-list operations in 16 bits: exp x1, log x1" in str(report)
  assert jaxscale.precision_report(jaxscale.autocast(f, "p=f16,c=f16,o=f16"), x).float32_ops_in_16_bits == {}


def test_arguments_that_are_not_arrays_pass_as_they_are():
  import flax.linen as nn

  model = nn.Dense(3)
  variables = model.init(jax.random.key(0), jnp.ones((2, 4)))
  report = jaxscale.precision_report(model.apply, variables, jnp.ones((2, 4)), mutable=False)
  assert report.matmul_flops == {"float32": 2 * 2 * 4 * 3}


def resnet():
  import flax.linen as nn

  class Block(nn.Module):
    features: int

    @nn.compact
    def __call__(self, x, train):
      conv = lambda f, k, s=1: nn.Conv(f, (k, k), (s, s), use_bias=False, dtype=jnp.float32)
      norm = lambda: nn.BatchNorm(use_running_average=not train, dtype=jnp.float32)
      y = nn.relu(norm()(conv(self.features, 3)(x)))
      y = norm()(conv(self.features, 3)(y))
      return nn.relu(y + (conv(self.features, 1)(x) if x.shape[-1] != self.features else x))

  class ResNet(nn.Module):
    @nn.compact
    def __call__(self, x, train=True):
      x = nn.Conv(8, (3, 3), dtype=jnp.float32)(x)
      for features in (8, 16):
        x = Block(features)(x, train)
      return nn.Dense(10, dtype=jnp.float32)(jnp.mean(x, axis=(1, 2)))

  return ResNet()


@pytest.mark.parametrize("backward", [False, True], ids=["forward", "grad"])
def test_resnet_with_explicit_float32_dtypes(backward):
  model = resnet()
  x = jnp.ones((2, 8, 8, 3))
  variables = model.init(jax.random.key(0), x)
  policy = jaxscale.get_policy("mixed_float16")

  def loss(apply):
    def fun(params, x):
      logits, _ = apply({"params": params, "batch_stats": variables["batch_stats"]}, x, mutable=["batch_stats"])
      return jnp.mean(logits**2)

    return jax.grad(fun) if backward else fun

  boundary = loss(lambda v, x, **kw: model.apply(*policy.cast_to_compute((v, x)), **kw))
  per_op = loss(jaxscale.autocast(model.apply, policy))
  before = jaxscale.precision_report(boundary, variables["params"], x)
  after = jaxscale.precision_report(per_op, variables["params"], x)
  assert before.share("float16") == 0.0 and after.share("float16") == 1.0
  assert sum(before.matmul_flops.values()) == sum(after.matmul_flops.values())
  assert "16-bit: 0.0%" in str(before) and "16-bit: 100.0%" in str(after)


def test_a_report_of_something_not_callable_says_the_function_comes_first():
  with pytest.raises(TypeError, match="takes the function first"):
    jaxscale.precision_report(jnp.ones(2), jnp.ones(2))


def test_operations_are_counted_per_dtype():
  """Counted by hand: the matmul, its tanh and the sum (float32's reduction, 16-bit operands cast first)."""
  w, x = jnp.ones((3, 4)), jnp.ones((2, 3))
  report = jaxscale.precision_report(jaxscale.autocast(lambda w, x: jnp.sum(jnp.tanh(x @ w)), "mixed_float16"), w, x)
  assert report.matmul_counts == {"float16": 1}
  # float16: the two casts to it, the matmul, tanh; float32: the cast of tanh's output, the sum.
  assert report.op_counts == {"float16": 4, "float32": 2}
  stacked = lambda w, h: jax.lax.scan(lambda h, w: (jnp.tanh(h @ w), None), h, w)[0]
  report = jaxscale.precision_report(stacked, jnp.ones((5, 3, 3)), jnp.ones((2, 3)))
  assert report.matmul_counts == {"float32": 5} and report.op_counts == {"float32": 10}  # a scan's body 5 times
  assert str(report).splitlines()[:2] == [
      "dtype       matmul FLOPs   share  matmuls", "float32              180  100.0%        5"]


def test_named_axes_are_bound_by_axis_env():
  """A Flax BatchNorm(axis_name=...) model, meant for pmap, failed with "unbound axis name"."""
  import flax.linen as nn

  class Net(nn.Module):
    @nn.compact
    def __call__(self, x):
      return nn.BatchNorm(use_running_average=False, axis_name="batch")(nn.Dense(4)(x))

  x, model = jnp.ones((2, 3)), Net()
  variables = jax.vmap(lambda x: model.init(jax.random.key(0), x), axis_name="batch")(x[None])
  variables = jax.tree.map(lambda leaf: leaf[0], variables)  # the one device's

  def apply(variables, x):
    return model.apply(variables, x, mutable=["batch_stats"])[0]

  with pytest.raises(NameError, match="batch"):
    jaxscale.precision_report(apply, variables, x)
  report = jaxscale.precision_report(jaxscale.autocast(apply, "mixed_float16"), variables, x, axis_env={"batch": 8})
  assert report.matmul_flops == {"float16": 2 * 2 * 3 * 4}  # counted once: per device
