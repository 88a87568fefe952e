"""`find_overflow`: the operation, pass, layer and iteration that made the first inf or NaN of a scaled step.

Each overflow below is built so that which operation must make it is known beforehand (a layer
whose weights alone exceed float16 once multiplied, a cotangent that grows by a known factor per
layer, a `log` of 0), and the report is checked against that and against NumPy on the
operation's inputs. Whether it finds one at all is checked against the gradient site itself:
`jaxscale.value_and_grad`'s finite flag is False exactly when the report reaches the gradients.
"""

from __future__ import annotations

import linecache

import equinox as eqx
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxscale
import jaxscale.equinox

F16_MAX = float(np.finfo(np.float16).max)  # 65504
F16_INF_FROM = 65520.0  # the midpoint between 65504 and 2^16: from it on, rounding to float16 gives inf


def step_is_finite(fun, scaler, *args, argnums=0, has_aux=False):
  """The gradient site's verdict on the same loss, arguments and scaler.

  Run operation by operation (no `jit`), as `find_overflow` runs them: each value is rounded to
  its dtype, where a compiled step may keep a fused float16 intermediate in float32 (XLA's
  excess precision) and not overflow.
  """
  with jax.disable_jit():
    return bool(jaxscale.value_and_grad(fun, argnums=argnums, has_aux=has_aux)(scaler, *args)[2])


def source_line(report) -> str:
  """The text of the line the report names."""
  path, _, line = report.source.rpartition(":")
  assert path == __file__, report.source  # the test's own line, not JAX's, Flax's or Equinox's
  return linecache.getline(path, int(line))


class MLP(nn.Module):
  @nn.compact
  def __call__(self, x):
    x = jnp.tanh(nn.Dense(8, dtype=jnp.float16)(x))
    x = nn.relu(nn.Dense(8, dtype=jnp.float16)(x))  # Dense_1: the layer that overflows
    return nn.Dense(1, dtype=jnp.float16)(x)


def test_flax_layer_that_overflows_in_the_forward_pass_is_named():
  model = MLP()
  x = jnp.asarray(np.random.default_rng(0).normal(0, 3, (4, 3)), jnp.float32)
  params = model.init(jax.random.key(0), x)
  # Dense_0's bias at 5 saturates its tanh near 1, and Dense_1's kernel at 1e4 makes each of its
  # outputs a sum of 8 such products by 1e4: near 8e4, beyond float16.
  p = params["params"]
  params = {"params": {
      **p,
      "Dense_0": {**p["Dense_0"], "bias": jnp.full(8, 5.0)},
      "Dense_1": {**p["Dense_1"], "kernel": jnp.full((8, 8), 1e4)},
  }}

  def loss(params, x):
    return jnp.mean(model.apply(params, x).astype(jnp.float32) ** 2)

  scaler = jaxscale.init(init_scale=1.0)
  report = jaxscale.find_overflow(loss, scaler, params, x)
  assert (report.primitive, report.phase, report.dtype, report.made) == ("dot_general", "forward", "float16", "inf")
  assert report.name_stack == "MLP/Dense_1" and "Dense_1: the layer" in source_line(report) and report.skips_step
  assert report.iteration == () and report.scale == 1.0
  # NumPy on Dense_1's inputs: Dense_0's activations and Dense_1's kernel, in float16.
  p = params["params"]
  h = np.tanh((np.asarray(x, np.float16) @ np.asarray(p["Dense_0"]["kernel"], np.float16)
               + np.asarray(p["Dense_0"]["bias"], np.float16)).astype(np.float32)).astype(np.float16)
  kernel = np.asarray(p["Dense_1"]["kernel"], np.float16)
  assert report.max_input_magnitude == max(np.abs(h).max(), np.abs(kernel).max())
  assert np.abs(h.astype(np.float32) @ kernel.astype(np.float32)).max() > F16_MAX  # it must overflow there
  assert not step_is_finite(loss, scaler, params, x)
  # Under autocast, which re-runs each operation, the layer and the line are the same.
  cast = jaxscale.find_overflow(jaxscale.autocast(loss, "mixed_float16"), scaler, params, x)
  assert (cast.primitive, cast.name_stack, cast.source, cast.max_input_magnitude) == (
      report.primitive, report.name_stack, report.source, report.max_input_magnitude)
  assert str(report).startswith("dot_general in `MLP/Dense_1` (test_find_overflow.py:")
  assert "overflowed float16 in the forward pass at loss scale 1: its inputs reach 1e+04" in str(report)


def linear_stack(w, x, layers=4):
  """``layers`` float16 matmuls by ``w``, as a scan over layers, loss in float32."""

  def layer(x, w):
    return x @ w, None

  x, _ = jax.lax.scan(layer, x.astype(jnp.float16), w.astype(jnp.float16))
  return jnp.sum(x.astype(jnp.float32))


@pytest.mark.parametrize("log2_scale", [12, 10, 8, 7])
def test_backward_only_overflow_at_too_large_a_scale_names_the_layer(log2_scale):
  # x @ (4 I) per layer: the forward pass stays tiny (1e-3 * 4^4 = 0.256); the backward pass
  # multiplies the cotangent by 4 per layer, from the scale at the top.
  layers, d = 4, 3
  w = jnp.broadcast_to(4 * jnp.eye(d), (layers, d, d))
  x = jnp.full((2, d), 1e-3)
  scaler = jaxscale.init(init_scale=2.0**log2_scale)
  report = jaxscale.find_overflow(linear_stack, scaler, w, x, argnums=(0, 1))
  # The cotangent of layer i's output is scale * 4^(layers - 1 - i); layer i's input gets 4 times
  # it, and the backward pass runs from the top layer down.
  cotangent_out = [2.0**log2_scale * 4.0 ** (layers - 1 - i) for i in range(layers)]
  overflowing = [i for i in range(layers) if 4 * cotangent_out[i] > F16_MAX]
  assert step_is_finite(linear_stack, scaler, w, x, argnums=(0, 1)) == (report is None) == (not overflowing)
  assert jaxscale.find_overflow(linear_stack, jaxscale.init(init_scale=1.0), w, x) is None  # the forward pass
  if report is None:
    return
  first = max(overflowing)
  assert (report.primitive, report.phase, report.dtype) == ("dot_general", "backward", "float16")
  assert report.iteration == (first,)
  assert report.max_input_magnitude == cotangent_out[first] and "x @ w" in source_line(report)
  assert f"in the backward pass at iteration {first} at loss scale 2^{log2_scale}:" in str(report)
  if first == 0:  # the cotangent of the first layer's input is x's gradient: not one of w's
    report = jaxscale.find_overflow(linear_stack, scaler, w, x)
    assert (report.iteration, report.reaches) == ((0,), "") and step_is_finite(linear_stack, scaler, w, x)


def test_scan_over_layers_reports_the_forward_iteration():
  layers, d = 5, 4
  rng = np.random.default_rng(1)
  w = rng.normal(0, 0.5, (layers, d, d)).astype(np.float32)
  w[3] = 3e4  # layer 3's outputs sum 4 products of inputs >= 1 by 3e4: >= 1.2e5
  x = jnp.asarray(rng.normal(0, 1, (2, d)), jnp.float32)

  def loss(w, x):
    def layer(x, w):
      return jax.nn.relu(x @ w) + 1.0, None  # >= 1

    x, _ = jax.lax.scan(layer, x.astype(jnp.float16), jnp.asarray(w, jnp.float16))
    return jnp.mean(x.astype(jnp.float32))

  scaler = jaxscale.init(init_scale=1.0)
  report = jaxscale.find_overflow(loss, scaler, jnp.asarray(w), x)
  assert (report.primitive, report.phase, report.iteration) == ("dot_general", "forward", (3,)) and report.skips_step
  # NumPy: the activations reaching layer 3, in float16 as the scan computes them.
  h = np.asarray(x, np.float16)
  for i in range(3):
    h = np.maximum(h.astype(np.float32) @ w[i].astype(np.float16).astype(np.float32), 0).astype(np.float16) + 1
  assert report.max_input_magnitude == max(np.abs(h).max(), float(np.float16(3e4)))
  assert not step_is_finite(loss, scaler, jnp.asarray(w), x)


def test_log_of_zero():
  # The gradient of sum(w * log(x)) with respect to w is log(x): the forward log's -inf reaches it.
  def loss(w, x):
    return jnp.sum(w * jnp.log(x))

  w, x = jnp.ones(3), jnp.array([2.0, 0.0, 0.5])
  scaler = jaxscale.init()
  report = jaxscale.find_overflow(loss, scaler, w, x)
  assert (report.primitive, report.phase, report.made, report.dtype) == ("log", "forward", "-inf", "float32")
  assert report.max_input_magnitude == np.abs(np.asarray(x)).max() and "jnp.log(x)" in source_line(report)
  assert not step_is_finite(loss, scaler, w, x)
  # With respect to x, the gradient is w / x, times the scale: the backward division by 0 skips
  # the step, and is reported before the forward -inf, which reaches only the loss.
  report = jaxscale.find_overflow(loss, scaler, w, x, argnums=1)
  assert (report.primitive, report.phase, report.made) == ("div", "backward", "inf")
  assert report.max_input_magnitude == max(2.0**16, 2.0) and "jnp.log(x)" in source_line(report)
  assert not step_is_finite(loss, scaler, w, x, argnums=1)


def test_jitted_function_with_aux():
  @jax.jit
  def loss(w, x):
    y = x @ w
    return jnp.sum(jnp.exp(y)), {"y": y}  # exp overflows float32 above log(3.4e38) = 88.7

  w = jnp.array([[60.0], [20.0]])
  x = jnp.array([[1.0, 2.0], [1.0, 1.0]])
  scaler = jaxscale.init()
  report = jaxscale.find_overflow(loss, scaler, w, x, has_aux=True)
  assert (report.primitive, report.phase, report.made) == ("exp", "forward", "inf")
  assert report.max_input_magnitude == np.abs(np.asarray(x) @ np.asarray(w)).max() == 100.0
  assert "jnp.exp(y)" in source_line(report)
  assert not step_is_finite(loss, scaler, w, x, has_aux=True)
  assert jaxscale.find_overflow(loss, scaler, w / 10, x, has_aux=True) is None
  with pytest.raises(TypeError, match="has_aux=True"):  # a pair is not a scalar loss
    jaxscale.find_overflow(loss, scaler, w, x)


def test_equinox_model():
  model = eqx.nn.MLP(4, 1, width_size=8, depth=2, activation=jax.nn.sigmoid, key=jax.random.key(0))
  model = eqx.tree_at(lambda m: m.layers[-1].weight, model, jnp.full((1, 8), 2e4))  # sigmoid in (0, 1): up to 8 * 2e4
  model = jax.tree.map(lambda p: p.astype(jnp.float16) if eqx.is_inexact_array(p) else p, model)
  x = jnp.asarray(np.random.default_rng(2).normal(size=(3, 4)), jnp.float16)

  def loss(model, x):
    return jnp.mean(jax.vmap(model)(x).astype(jnp.float32) ** 2)  # the model's call

  scaler = jaxscale.init(init_scale=1.0)
  report = jaxscale.find_overflow(loss, scaler, model, x)
  assert (report.primitive, report.phase, report.dtype) == ("dot_general", "forward", "float16") and report.skips_step
  with jax.disable_jit():  # as `step_is_finite`, with Equinox's own gradient site
    assert not jaxscale.equinox.filter_value_and_grad(loss)(scaler, model, x)[2]
  assert "the model's call" in source_line(report)  # the user's line, not Equinox's
  # NumPy on the last layer's inputs: its weight and the activations of the layers before.
  h = np.asarray(x, np.float32)
  for layer in model.layers[:-1]:
    z = (h @ np.asarray(layer.weight, np.float32).T).astype(np.float16) + np.asarray(layer.bias)
    h = (1 / (1 + np.exp(-z.astype(np.float32)))).astype(np.float16).astype(np.float32)
  assert report.max_input_magnitude == max(float(np.float16(2e4)), np.abs(h).max())
  assert h.sum(axis=1).max() * 2e4 > F16_MAX  # the last layer's sums exceed float16


def test_flax_nnx_model_names_the_line_of_the_layer():
  from flax import nnx

  class Net(nnx.Module):
    def __init__(self, rngs):
      # sigmoid(5 + small) > 0.99, and 8 of them times 2e4 exceed float16.
      constant = nnx.initializers.constant
      self.hidden = nnx.Linear(4, 8, dtype=jnp.float16, bias_init=constant(5.0), rngs=rngs)
      self.head = nnx.Linear(8, 1, dtype=jnp.float16, kernel_init=constant(2e4), rngs=rngs)

    def __call__(self, x):
      h = nnx.sigmoid(self.hidden(x))
      return self.head(h)  # the layer that overflows

  net = Net(nnx.Rngs(0))
  x = jnp.asarray(np.random.default_rng(3).normal(0, 0.1, (2, 4)), jnp.float32)

  def loss(net, x):
    return jnp.mean(net(x).astype(jnp.float32) ** 2)

  scaler = jaxscale.init(init_scale=1.0)
  report = jaxscale.find_overflow(loss, scaler, net, x)
  assert (report.primitive, report.phase, report.dtype) == ("dot_general", "forward", "float16")
  assert "the layer that overflows" in source_line(report) and report.max_input_magnitude == float(np.float16(2e4))
  assert not step_is_finite(loss, scaler, net, x)


def test_all_finite_gives_none_and_a_finite_step():
  model = MLP()
  x = jnp.ones((2, 3))
  params = model.init(jax.random.key(0), x)

  def loss(params, x):
    return jnp.mean(model.apply(params, x).astype(jnp.float32) ** 2)

  scaler = jaxscale.init()  # 2^16: the float32 loss and its float16 gradients fit
  assert jaxscale.find_overflow(loss, scaler, params, x) is None
  assert step_is_finite(loss, scaler, params, x)


def test_a_float16_loss_overflows_at_its_scaling():
  x = jnp.full((4,), 3.0, jnp.float16)
  loss = lambda x: jnp.mean(x * x)  # 9, in float16: 9 * 2^16 does not fit it
  report = jaxscale.find_overflow(loss, jaxscale.init(), x)
  # Both passes overflow there: the forward 9 * 2^16, and the backward the seed times the scale,
  # 2^16, cast to float16; the backward's reaches the gradients, so it is the one reported.
  assert (report.name_stack, report.phase, report.dtype, report.primitive) == (
      "loss_scaling", "backward", "float16", "convert_element_type")
  assert report.max_input_magnitude == 2.0**16 and "return the loss in float32" in str(report)
  assert not step_is_finite(loss, jaxscale.init(), x)


@pytest.mark.parametrize("policy", ["mixed_float16", "mixed_float8"])
def test_under_autocast(policy):
  def loss(w, x):
    return jnp.mean((x @ w) ** 2)  # float32 code: its matmul runs in the policy's dtype

  w = jnp.full((8, 2), 1e4)
  x = jnp.ones((2, 8))
  scaler = jaxscale.init(init_scale=1.0)
  assert jaxscale.find_overflow(loss, scaler, w, x) is None  # 8e4 and its square fit float32
  cast = jaxscale.autocast(loss, policy)
  if policy == "mixed_float8":
    # The 2-wide product is below float8's tile of 16: it stays bfloat16, and autocast says so.
    with pytest.warns(UserWarning, match="runs none of its 1 matmuls in float8"):
      assert jaxscale.find_overflow(cast, scaler, w, x) is None and step_is_finite(cast, scaler, w, x)
    return
  report = jaxscale.find_overflow(cast, scaler, w, x)
  assert (report.primitive, report.phase, report.dtype) == ("dot_general", "forward", "float16")
  assert report.max_input_magnitude == 1e4 and "x @ w" in source_line(report) and report.skips_step
  assert not step_is_finite(cast, scaler, w, x)


@pytest.mark.parametrize("head", ["tanh", "mean"])
def test_an_inf_that_reaches_no_gradient_does_not_skip_the_step(head):
  # tanh(inf) = 1, with derivative 0 there: the float16 matmul's inf stops at the tanh. A mean of
  # the matmul is inf, but its gradient does not read it: x / size, times the seed.
  def loss(w, x):
    y = x @ w
    return jnp.mean(jnp.tanh(y) if head == "tanh" else y)

  w, x = jnp.full((8, 2), 1e4), jnp.ones((2, 8))
  cast, scaler = jaxscale.autocast(loss, "mixed_float16"), jaxscale.init(init_scale=1.0)
  report = jaxscale.find_overflow(cast, scaler, w, x)
  assert (report.primitive, report.skips_step) == ("dot_general", False) and step_is_finite(cast, scaler, w, x)
  assert report.reaches == ("" if head == "tanh" else "loss")
  reached = "neither the loss nor the gradients" if head == "tanh" else "the loss but no gradient"
  assert str(report).endswith(f"it reaches {reached}, so the step is not skipped for it.")


def test_a_non_finite_argument_is_named():
  x = {"image": jnp.array([1.0, jnp.nan]), "label": jnp.array([0.0, 1.0])}
  report = jaxscale.find_overflow(lambda w, batch: jnp.sum(w * batch["image"]), jaxscale.init(), jnp.ones(2), x)
  assert (report.primitive, report.name_stack, report.made, report.max_input_magnitude) == (
      "argument", "args[1]['image']", "NaN", 1.0)
  assert str(report) == "`fun`'s argument `args[1]['image']` (float32) holds NaN before any operation runs."


def test_while_loop_cond_checkpoint_and_custom_vjp():
  @jax.custom_vjp
  def amplify(x):
    return x

  def amplify_fwd(x):
    return x, None

  def amplify_bwd(_, g):
    return (g * jnp.float16(1e3),)  # the backward overflow: 1e3 times the cotangent

  amplify.defvjp(amplify_fwd, amplify_bwd)

  def loss(w, x):  # x, not differentiated, goes through a while loop (which has no reverse mode)
    def body(carry):
      i, y = carry
      return i + 1, jax.lax.cond(i % 2 == 0, lambda y: y * 2, lambda y: y + y, y)

    _, y = jax.lax.while_loop(lambda carry: carry[0] < 20, body, (0, x))
    # Not differentiated, `relu` and `amplify` of y stay `custom_jvp` / `custom_vjp` calls.
    y = amplify(jax.nn.relu(y))
    return jnp.sum(amplify(jax.checkpoint(jnp.multiply)(w, y)).astype(jnp.float32))

  def first_inf(start):
    """NumPy: the iteration of the loop whose doubling first leaves float16, or None."""
    y = np.float16(start)
    with np.errstate(over="ignore"):
      for i in range(20):
        y = np.float16(y * np.float16(2))
        if np.isinf(y):
          return i
    return None

  w = jnp.ones(2, jnp.float16)
  x = jnp.array([2.0**-3, 1.0], jnp.float16)
  first = first_inf(1.0)
  scaler = jaxscale.init(init_scale=1.0)
  report = jaxscale.find_overflow(loss, scaler, w, x)
  # The branch taken at that iteration: `y * 2` at an even one, `y + y` at an odd one.
  assert (report.primitive, report.phase, report.iteration) == ("mul" if first % 2 == 0 else "add", "forward", (first,))
  assert report.max_input_magnitude == 2.0**first and not step_is_finite(loss, scaler, w, x)  # y before its doubling
  # Started at 2^-6 the loop stays finite (2^-6 * 2^20 = 2^14), and the backward pass overflows
  # in the custom rule: 1e3 times the cotangent, which is the scale, 2^7.
  x = jnp.array([2.0**-6, 2.0**-7], jnp.float16)
  assert first_inf(2.0**-6) is None
  scaler = jaxscale.init(init_scale=2.0**7)
  report = jaxscale.find_overflow(loss, scaler, w, x)
  assert (report.primitive, report.phase, report.iteration) == ("mul", "backward", ())
  # The custom rule's operations are the custom function's, at the line that calls it.
  assert report.max_input_magnitude == float(np.float16(1e3)) and "amplify(jax.checkpoint" in source_line(report)
  assert not step_is_finite(loss, scaler, w, x)


def test_wrong_uses_are_errors_that_say_what_to_write():
  scaler = jaxscale.init()
  x = jnp.ones(3)
  with pytest.raises(TypeError, match="ScalerState"):
    jaxscale.find_overflow(lambda x: jnp.sum(x), {"scale": 1.0}, x)
  with pytest.raises(TypeError, match="loss function first"):
    jaxscale.find_overflow(scaler, lambda x: jnp.sum(x), x)
  with pytest.raises(ValueError, match="argnums=2.*names no positional argument"):
    jaxscale.find_overflow(lambda x, y: jnp.sum(x * y), scaler, x, x, argnums=2)
  with pytest.raises(TypeError, match=r"scalar loss.*shape \(3,\).*jnp.mean"):
    jaxscale.find_overflow(lambda x: x * 2, scaler, x)
  with pytest.raises(TypeError, match="floating loss.*int32"):
    jaxscale.find_overflow(lambda x: jnp.sum(x).astype(jnp.int32), scaler, x)
  with pytest.raises(TypeError, match="outside `jit`"):
    jax.jit(lambda x: jaxscale.find_overflow(lambda x: jnp.sum(x), scaler, x))(x)


def test_an_unknown_higher_order_primitive_is_refused_by_name():
  def loss(a, b):
    solve = lambda matvec, b: b / a
    x = jax.lax.custom_linear_solve(lambda x: a * x, b, solve, transpose_solve=solve)
    return jnp.sum(x)

  with pytest.raises(NotImplementedError, match="custom_linear_solve"):
    jaxscale.find_overflow(loss, jaxscale.init(), jnp.ones(3), jnp.ones(3))


def test_argnums_picks_what_is_differentiated():
  # The gradient of sum(x * y) with respect to y is the scale times x (2 * 6e4 > 65504), with
  # respect to x the scale times y (2): only differentiating y overflows.
  x = jnp.full(2, 6e4, jnp.float16)
  y = jnp.full(2, 1.0, jnp.float16)

  def loss(x, y):
    return jnp.sum((x * y).astype(jnp.float32))

  scaler = jaxscale.init(init_scale=2.0)
  assert jaxscale.find_overflow(loss, scaler, x, y, argnums=0) is None
  report = jaxscale.find_overflow(loss, scaler, x, y, argnums=1)
  assert (report.primitive, report.phase) == ("mul", "backward")
  assert report.max_input_magnitude == float(np.float16(6e4))


# Each case eagerly and with the loss jitted as a user would; the jitted half in the slow tier.
JIT = pytest.mark.parametrize("jit", [False, pytest.param(True, marks=pytest.mark.slow)], ids=["eager", "jit"])


def contrastive_loss(z, labels, mask=None):
  """A SimCLR-style loss: float16 similarities, the diagonal masked with -inf (here, or the
  additive ``mask`` given), a temperature."""
  import optax

  z = z.astype(jnp.float16)
  if mask is None:
    sim = jnp.where(jnp.eye(z.shape[0], dtype=bool), -jnp.inf, z @ z.T)
  else:
    sim = z @ z.T + mask
  logits = sim / jnp.float16(1e-3)  # the float16 division that overflows
  return optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), labels).mean()


@JIT
@pytest.mark.parametrize("given", [False, True], ids=["mask_made", "mask_given"])
def test_a_masks_minus_inf_does_not_hide_the_operations_own_overflow(given, jit):
  z = jnp.asarray(np.random.default_rng(0).normal(0, 10, (4, 8)), jnp.float32)
  labels = jnp.array([1, 0, 3, 2])
  mask = jnp.where(jnp.eye(4, dtype=bool), -jnp.inf, 0.0).astype(jnp.float16) if given else None
  loss = jax.jit(contrastive_loss) if jit else contrastive_loss
  scaler = jaxscale.init(init_scale=1.0)
  report = jaxscale.find_overflow(loss, scaler, z, labels, mask)
  # NumPy: the off-diagonal similarities beyond 65504 * 1e-3 overflow the division; the
  # diagonal's -inf was there before it.
  z16 = np.asarray(z, np.float16)
  sim = (z16.astype(np.float32) @ z16.T.astype(np.float32)).astype(np.float16)
  quotient = sim.astype(np.float32) / np.float32(np.float16(1e-3))
  off = ~np.eye(4, dtype=bool)
  assert (np.abs(quotient[off]) >= F16_INF_FROM).any()
  assert (report.primitive, report.phase, report.dtype) == ("div", "forward", "float16") and report.skips_step
  assert "the float16 division" in source_line(report)
  overflows = {"inf": (quotient[off] >= F16_INF_FROM).any(), "-inf": (quotient[off] <= -F16_INF_FROM).any()}
  assert report.made == " and ".join(name for name, held in overflows.items() if held)
  assert report.max_input_magnitude == max(np.abs(sim[off]).max(), float(np.float16(1e-3)))
  assert not step_is_finite(contrastive_loss, scaler, z, labels, mask)


def tanh_head(w, x):
  return jnp.mean(jnp.tanh(x.astype(jnp.float16) @ w.astype(jnp.float16)).astype(jnp.float32))


@JIT
@pytest.mark.parametrize("bad", [np.inf, -np.inf, np.nan], ids=["inf", "-inf", "nan"])
def test_a_non_finite_argument_is_named_whatever_it_holds(bad, jit):
  # tanh saturates the sample's inf to 1 with derivative 0, and the backward matmul multiplies
  # that 0 by the inf: a NaN that no operation made from finite inputs.
  w, x = jnp.ones((3, 1)), jnp.ones((2, 3)).at[1, 2].set(bad)
  scaler = jaxscale.init(init_scale=2.0**11)
  report = jaxscale.find_overflow(jax.jit(tanh_head) if jit else tanh_head, scaler, w, x)
  held = {np.inf: "inf", -np.inf: "-inf"}.get(bad, "NaN")
  assert (report.primitive, report.name_stack, report.made) == ("argument", "args[1]", held) and report.skips_step
  assert str(report) == f"`fun`'s argument `args[1]` (float32) holds {held} before any operation runs."
  assert not step_is_finite(tanh_head, scaler, w, x)


@JIT
def test_an_inf_in_the_batch_skips_the_step_even_beside_an_overflow_that_reaches_only_the_loss(jit):
  def loss(w, batch):
    x, y = batch["x"], batch["y"]
    return jnp.mean(x @ w) + jnp.sum(jnp.exp(100.0 * y))  # exp(100) overflows float32: the loss only

  w, batch = jnp.ones((3, 1)), {"x": jnp.ones((2, 3)).at[0, 1].set(jnp.inf), "y": jnp.ones(2)}
  scaler = jaxscale.init(init_scale=1.0)
  report = jaxscale.find_overflow(jax.jit(loss) if jit else loss, scaler, w, batch)
  assert not step_is_finite(loss, scaler, w, batch)  # the gradient is x's column means: inf
  assert report.skips_step and (report.primitive, report.name_stack, report.made) == ("argument", "args[1]['x']", "inf")
  # Without the inf, the exp's overflow is reported, and it is not what skips a step.
  batch["x"] = jnp.ones((2, 3))
  report = jaxscale.find_overflow(jax.jit(loss) if jit else loss, scaler, w, batch)
  assert (report.primitive, report.reaches) == ("exp", "loss") and step_is_finite(loss, scaler, w, batch)


@JIT
def test_nnx_batchnorm_statistics_are_not_differentiated(jit):
  from flax import nnx

  import jaxscale.flax

  # Normalised by rsqrt(1e-4 + eps) ~ 95: the statistics' derivative, rsqrt(v) / v ~ 1e6, would
  # overflow float16, but the gradient site differentiates only the nnx.Params (scale, bias).
  model = nnx.BatchNorm(4, use_running_average=True, dtype=jnp.float16, param_dtype=jnp.float16, rngs=nnx.Rngs(0))
  model.var[...] = jnp.full(4, 1e-4, jnp.float16)
  x = jnp.asarray(np.random.default_rng(0).normal(0, 1, (8, 4)), jnp.float32)

  def loss(model, x):
    return jnp.mean(model(x).astype(jnp.float32) ** 2)

  scaler = jaxscale.init(init_scale=1.0)
  assert jaxscale.find_overflow(nnx.jit(loss) if jit else loss, scaler, model, x) is None
  site = jaxscale.flax.value_and_grad(loss)
  assert site(scaler, model, x)[2] and nnx.jit(site)(scaler, model, x)[2]
  # What the site leaves out is there: differentiated with respect to the statistics, it overflows.
  stats = nnx.grad(loss, argnums=nnx.DiffState(0, nnx.BatchStat))(model, x)
  assert not np.isfinite(np.asarray(stats["var"][...])).all()


@JIT
def test_an_equinox_float_field_is_not_differentiated(jit):
  class Scaled(eqx.Module):
    w: jax.Array
    temperature: float  # a plain float: `eqx.filter_grad` leaves it alone

  def loss(model, x):
    return jnp.sum(model.w * x / model.temperature)

  model, x = Scaled(jnp.ones(3), 1e-20), jnp.full(3, 1e-10)
  # d loss / d temperature = -(w x) t**-2, and t**-2 = 1e40 overflows float32; the site never computes it.
  with np.errstate(over="ignore"):
    assert np.isinf(np.float32(1e-20) ** np.float32(-2))
  scaler = jaxscale.init(init_scale=1.0)
  assert jaxscale.find_overflow(eqx.filter_jit(loss) if jit else loss, scaler, model, x) is None
  site = jaxscale.equinox.filter_value_and_grad(loss)
  assert site(scaler, model, x)[2] and eqx.filter_jit(site)(scaler, model, x)[2]
  # A dict holding the same float is differentiated, as `jaxscale.value_and_grad` does.
  plain = {"w": jnp.ones(3), "temperature": 1e-20}
  report = jaxscale.find_overflow(lambda p, x: jnp.sum(p["w"] * x / p["temperature"]), scaler, plain, x)
  assert report.skips_step and report.phase == "backward"


@JIT
def test_a_true_gradient_that_overflows_in_the_unscaling_at_a_scale_below_1(jit):
  # u = 1e30 w = 1 and 1e30 (u - 1) stay finite forward; the gradient is 1e30 * 1e30 = 1e60,
  # beyond float32: at scale 2^-100 the backward pass carries 7.9e29, and the unscaling overflows.
  def loss(w):
    return jnp.sum(1e30 * (w * 1e30 - 1.0))

  w = jnp.full(2, 1e-30)
  scaler = jaxscale.init(init_scale=2.0**-100)  # `min_scale` is 0 by default: reachable
  report = jaxscale.find_overflow(jax.jit(loss) if jit else loss, scaler, w)
  scaled = np.float32(2.0**-100) * np.float32(1e30) * np.float32(1e30)  # what the backward pass carries
  assert np.isfinite(scaled) and float(scaled) * 2.0**100 > float(np.finfo(np.float32).max)
  assert (report.primitive, report.phase, report.name_stack) == ("mul", "backward", "loss_scaling")
  assert report.dtype == "float32"
  assert report.skips_step and not step_is_finite(loss, scaler, w)
  assert "the scale is below 1, and the true (unscaled) gradient does not fit float32" in str(report)
  # At scale 1 the backward multiply itself overflows, at the user's line.
  report = jaxscale.find_overflow(loss, jaxscale.init(init_scale=1.0), w)
  assert (report.primitive, report.phase, report.name_stack) == ("mul", "backward", "")


def folded(w, x):
  h = (x * w).astype(jnp.float16)
  y = h * 300 * 300  # XLA folds 300 * 300 into one float16 constant: inf
  return jnp.mean(y.astype(jnp.float32) ** 2) * 1e-9


@JIT
def test_a_compiled_step_that_overflows_where_the_op_by_op_run_does_not_is_reported(jit):
  w, x = jnp.full(2, 0.5), jnp.ones(2)
  scaler = jaxscale.init(init_scale=1.0)
  # The reference: the gradient site itself, compiled (skipped where XLA folds the constants: it
  # does on jax 0.10, not on 0.12) and operation by operation (not skipped).
  compiled_finite = bool(jax.jit(jaxscale.value_and_grad(folded))(scaler, w, x)[2])
  assert step_is_finite(folded, scaler, w, x)
  assert np.float16(np.float16(0.5) * np.float16(300)) * np.float16(300) == 45000  # op by op: it fits
  report = jaxscale.find_overflow(jax.jit(folded) if jit else folded, scaler, w, x)
  if compiled_finite:
    assert report is None
    return
  assert report.compiled and report.skips_step
  assert (report.primitive, report.phase, report.dtype, report.made) == ("mul", "forward", "float16", "inf")
  assert "XLA folds" in source_line(report) and report.max_input_magnitude == 300.0  # h * 300 = 150, and 300
  assert str(report).startswith("In the compiled step only (run operation by operation, every value is finite")


@JIT
def test_a_derivative_factor_of_a_float16_division_is_backward(jit):
  def loss(w, y):
    return jnp.sum((w / y).astype(jnp.float32))  # the division

  w, y = jnp.ones(2, jnp.float16), jnp.full(2, 2.0**-8, jnp.float16)
  scaler = jaxscale.init(init_scale=1.0)
  report = jaxscale.find_overflow(jax.jit(loss) if jit else loss, scaler, w, y, argnums=1)
  # d(w / y)/dy = -w y**-2 = -2^16: float16's y**-2 overflows; w / y = 256 fits.
  assert 2.0**16 >= F16_INF_FROM and not step_is_finite(loss, scaler, w, y, argnums=1)
  assert (report.primitive, report.phase, report.derivative_of, report.division_by_zero) == (
      "integer_pow", "backward", "div", False)
  assert "the division" in source_line(report) and report.skips_step
  assert ", in the derivative of `div`, overflowed float16 in the backward pass" in str(report)
  assert jaxscale.find_overflow(loss, scaler, w, y, argnums=0) is None  # d/dw = 1 / y: no factor


def where_trap(x):
  return jnp.sum(jnp.where(x > 0, jnp.sqrt(x), 0.0))  # the where trap


def norm_loss(x):
  return jnp.linalg.norm(x)  # the norm at 0


@JIT
@pytest.mark.parametrize("loss", [where_trap, norm_loss], ids=["where", "norm"])
def test_a_division_by_zero_in_a_derivative_is_named_so(loss, jit):
  # sqrt's derivative is 0.5 / sqrt(x): at x = 0, 1 / 0, and the backward pass's 0 times it is NaN.
  x = jnp.array([0.0, 0.0, 0.0]) if loss is norm_loss else jnp.array([0.0, 4.0])
  scaler = jaxscale.init(init_scale=1.0)
  report = jaxscale.find_overflow(jax.jit(loss) if jit else loss, scaler, x)
  assert (report.primitive, report.phase, report.derivative_of, report.division_by_zero, report.made) == (
      "div", "backward", "sqrt", True, "inf")
  assert report.skips_step and not step_is_finite(loss, scaler, x)
  assert "the where trap" in source_line(report) or "the norm at 0" in source_line(report)
  assert ", in the derivative of `sqrt`, divided by zero in the backward pass" in str(report)


def test_the_source_of_an_operation_in_a_jitted_library_function_is_the_users_call():
  def loss(x):
    z = jax.nn.standardize(x.astype(jnp.float16))  # the library call
    return jnp.sum(z.astype(jnp.float32))

  x = jnp.array([300.0, 1.0, 2.0])  # its variance squares 300: 9e4, beyond float16
  report = jaxscale.find_overflow(loss, jaxscale.init(init_scale=1.0), x)
  assert 300.0**2 >= F16_INF_FROM
  assert report.primitive in ("square", "integer_pow", "mul") and report.dtype == "float16"
  assert "the library call" in source_line(report)


@pytest.mark.parametrize("block", [0, 1])
def test_nnx_blocks_are_told_apart_by_their_path(block):
  from flax import nnx

  class Net(nnx.Module):
    def __init__(self, rngs):
      self.blocks = nnx.List([nnx.Linear(4, 4, dtype=jnp.float16, rngs=rngs) for _ in range(2)])
      self.blocks[block].kernel[...] = jnp.full((4, 4), 3e4)  # 4 * 3e4 and more: beyond float16

    def __call__(self, x):
      for layer in self.blocks:
        x = layer(x)
      return x

  net = Net(nnx.Rngs(0))

  def loss(net, x):
    return jnp.mean(net(x).astype(jnp.float32) ** 2)

  scaler = jaxscale.init(init_scale=1.0)
  report = jaxscale.find_overflow(loss, scaler, net, jnp.ones((2, 4)))
  assert report.primitive == "dot_general" and report.name_stack == f"Net/blocks[{block}]"
  assert not step_is_finite(loss, scaler, net, jnp.ones((2, 4)))
  assert "__call__" not in nnx.Linear.__dict__ or nnx.Linear.__call__.__name__ == "__call__"  # put back as it was
