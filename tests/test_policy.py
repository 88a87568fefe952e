"""The precision policy and autocast: parsing (against jmp), casts on every leaf kind, dtypes in and
out, gradients in float32, nesting, and Flax Linen / NNX models trained in float16 with no dtype=."""

import jax
import jax.numpy as jnp
import jmp
import numpy as np
import optax
import pytest

import jaxscale

F16, BF16, F32 = np.dtype(jnp.float16), np.dtype(jnp.bfloat16), np.dtype(jnp.float32)


@pytest.mark.parametrize(
    "spec",
    ["p=f32,c=f16,o=f32", "params=float32,compute=float16,output=float32", "c=f16", "p=f16,c=bf16",
     "params=bfloat16", "f32", "full", "half", "float16", "bf16", "o=f16"],
)
def test_parse_matches_jmp(spec):
  ours, theirs = jaxscale.get_policy(spec), jmp.get_policy(spec)
  assert (ours.param_dtype, ours.compute_dtype, ours.output_dtype) == tuple(
      np.dtype(d) for d in (theirs.param_dtype, theirs.compute_dtype, theirs.output_dtype)
  )


@pytest.mark.parametrize(
    "spec, dtypes",
    [("float32", (F32, F32, F32)), ("mixed_float16", (F32, F16, F32)), ("mixed_bfloat16", (F32, BF16, F32)),
     (" Params = F32 , Compute = BF16 ", (F32, BF16, BF16))],
)
def test_presets_and_spacing(spec, dtypes):
  policy = jaxscale.get_policy(spec)
  assert (policy.param_dtype, policy.compute_dtype, policy.output_dtype) == dtypes
  assert jaxscale.get_policy(str(policy)) == policy  # str() round-trips
  assert jaxscale.get_policy(policy) is policy


@pytest.mark.parametrize(
    "spec, named",
    [("p=f32,c=f8", "'f8'"), ("params=float32,comput=float16", "'comput'"), ("mixed_float8", "'mixed_float8'"),
     ("", "''"), ("c=", "''")],
)
def test_bad_specs_name_the_bad_part(spec, named):
  with pytest.raises(ValueError, match=named) as info:
    jaxscale.get_policy(spec)
  assert "mixed_float16" in str(info.value) or "'compute'" in str(info.value)


def test_with_output_dtype_like_jmp():
  policy = jaxscale.get_policy("p=f32,c=f16").with_output_dtype(jnp.float32)
  theirs = jmp.get_policy("p=f32,c=f16").with_output_dtype(jnp.float32)
  assert policy == jaxscale.get_policy("mixed_float16") and np.dtype(theirs.output_dtype) == policy.output_dtype


def test_bad_types():
  with pytest.raises(TypeError, match="string"):
    jaxscale.get_policy(16)
  with pytest.raises(ValueError, match="compute_dtype.*int32"):
    jaxscale.Policy(jnp.float32, jnp.int32, jnp.float32)
  with pytest.raises(ValueError, match="param_dtype.*None"):  # np.dtype(None) is float64
    jaxscale.Policy(None, jnp.float16, jnp.float32)


@pytest.mark.parametrize("name, dtype", [("f16", F16), ("F32", F32), ("bf16", BF16), ("half", F16), ("float16", F16)])
def test_constructor_reads_dtype_names_as_get_policy_does(name, dtype):
  # NumPy reads "f16" as float128: loss scaling would be silently off.
  policy = jaxscale.Policy("f32", name, "f32")
  assert policy.compute_dtype == dtype == jaxscale.get_policy(f"c={name}").compute_dtype
  assert jaxscale.needs_loss_scaling(policy) == (dtype == F16)


@pytest.mark.parametrize("name", ["f8", "f4", "e", "float128", "halfs"])
def test_constructor_refuses_names_get_policy_refuses(name):
  with pytest.raises(ValueError, match=f"compute_dtype.*{name!r}.*f16"):
    jaxscale.Policy(jnp.float32, name, jnp.float32)
  with pytest.raises(ValueError, match="float128|longdouble"):
    jaxscale.Policy(jnp.float32, np.longdouble, jnp.float32)


def test_policy_is_hashable_static_arg():
  calls = []

  def cast(x, policy):
    calls.append(policy)
    return policy.cast_to_compute(x)

  f = jax.jit(cast, static_argnums=1)
  assert f(jnp.ones(2), jaxscale.get_policy("mixed_float16")).dtype == F16
  assert f(jnp.ones(2), jaxscale.get_policy("p=f32,c=f16,o=f32")).dtype == F16
  assert len(calls) == 1  # equal policies hash equal: no retrace
  assert jaxscale.Policy(jnp.float32, jnp.float16, jnp.float32) == jaxscale.get_policy("mixed_float16")


def every_leaf_kind():
  return {
      "f32": jnp.ones((2, 3)),
      "f64_numpy": np.ones(2),
      "nested": [jnp.ones(1, jnp.bfloat16), (np.float32(2.0), {"f16": jnp.ones(2, jnp.float16)})],
      "int": jnp.arange(3),
      "bool": jnp.array([True, False]),
      "typed_key": jax.random.key(0),
      "raw_key": jax.random.PRNGKey(0),
      "float0": np.zeros((2,), jax.dtypes.float0),
      "python_float": 0.5,
      "none": None,
  }


@pytest.mark.parametrize("method, dtype", [("cast_to_param", F32), ("cast_to_compute", F16), ("cast_to_output", BF16)])
def test_casts_only_floating_leaves(method, dtype):
  policy = jaxscale.Policy(jnp.float32, jnp.float16, jnp.bfloat16)
  tree = every_leaf_kind()
  out = jax.jit(getattr(policy, method))(tree) if method != "cast_to_param" else getattr(policy, method)(tree)
  assert jax.tree.structure(out) == jax.tree.structure(tree)
  for path, before in jax.tree.leaves_with_path(tree):
    after = dict(jax.tree.leaves_with_path(out))[path]
    floating = hasattr(before, "dtype") and jnp.issubdtype(before.dtype, jnp.floating)
    if floating:
      assert after.dtype == dtype, path
      np.testing.assert_array_equal(np.asarray(after, np.float32), np.asarray(before, np.float32))
    elif isinstance(before, float):
      assert after == before
    else:
      assert after.dtype == before.dtype, path


def test_objects_with_a_floating_dtype_attribute_are_not_arrays():
  """A Linen module configured with `dtype=` (an argument, or the owner of `model.apply`) passes as it is."""
  import flax.linen as nn

  dense = nn.Dense(3, dtype=jnp.float32)
  assert jaxscale.get_policy("mixed_float16").cast_to_compute({"m": dense})["m"] is dense
  variables = dense.init(jax.random.key(0), jnp.ones((2, 4)))
  assert jaxscale.autocast(dense.apply, "mixed_float16")(variables, jnp.ones((2, 4))).dtype == F32


def test_needs_loss_scaling():
  assert jaxscale.needs_loss_scaling("mixed_float16") is True
  assert jaxscale.needs_loss_scaling(jnp.float16) is True
  assert jaxscale.needs_loss_scaling(jaxscale.get_policy("p=f16,c=f16")) is True
  for off in ("mixed_bfloat16", "float32", jnp.bfloat16, "float32", np.dtype("float32")):
    assert jaxscale.needs_loss_scaling(off) is False
  for bad in (object(), None):  # np.dtype(None) is float64
    with pytest.raises(TypeError, match="needs_loss_scaling"):
      jaxscale.needs_loss_scaling(bad)


@pytest.mark.parametrize("spec", ["mixed_float16", "mixed_bfloat16", "float32"])
def test_needs_loss_scaling_as_enabled(spec):
  """One script, any precision: the scaler is on for float16 only, and the run steps as unwrapped."""
  policy = jaxscale.get_policy(spec)
  tx = jaxscale.dynamic_loss_scaling(optax.sgd(0.1), enabled=jaxscale.needs_loss_scaling(policy), init_scale=4.0)
  params = jnp.ones(3)
  opt_state = tx.init(params)
  loss = jaxscale.autocast(lambda w: jnp.sum(w * w), policy)
  scaler = jaxscale.find_scaler(opt_state)
  grads = jax.grad(lambda w: jaxscale.scale(scaler, loss(w)))(params)
  updates, opt_state = tx.update(grads, opt_state, params)
  np.testing.assert_array_equal(optax.apply_updates(params, updates), jnp.full(3, 0.8))
  assert float(scaler.scale) == (4.0 if spec == "mixed_float16" else 1.0)


def test_autocast_dtypes_in_and_out(strict_promotion):
  seen = {}

  def fun(params, batch, *, key, step):
    seen.update(w=params["w"].dtype, x=batch["x"].dtype, label=batch["label"].dtype, key=key.dtype)
    y = batch["x"] @ params["w"]
    seen["y"] = y.dtype
    return {"loss": jnp.sum(y), "count": step + 1}

  out = jax.jit(jaxscale.autocast(fun, "mixed_float16"))(
      {"w": jnp.ones((3, 2))}, {"x": jnp.ones((4, 3)), "label": jnp.arange(4)}, key=jax.random.key(1), step=jnp.int32(2)
  )
  assert seen["w"] == seen["x"] == seen["y"] == F16
  assert seen["label"] == np.dtype(jnp.int32) and jax.dtypes.issubdtype(seen["key"], jax.dtypes.prng_key)
  assert out["loss"].dtype == F32 and out["count"].dtype == np.dtype(jnp.int32)


def test_autocast_gradients_arrive_in_float32(strict_promotion):
  w = jax.random.normal(jax.random.key(0), (8, 4))
  x = jax.random.normal(jax.random.key(1), (16, 8))

  def loss(w, x):
    return jnp.mean(jnp.tanh(x @ w) ** 2)

  grads = jax.jit(jax.grad(jaxscale.autocast(loss, "mixed_float16")))(w, x)
  assert grads.dtype == F32
  # Reference: the same computation cast by hand.
  by_hand = jax.jit(jax.grad(lambda w: loss(w.astype(jnp.float16), x.astype(jnp.float16)).astype(jnp.float32)))(w)
  np.testing.assert_array_equal(grads, by_hand)
  exact = jax.grad(loss)(w, x)
  np.testing.assert_allclose(grads, exact, atol=2e-3)
  assert not np.array_equal(grads, exact)  # it really ran in float16


def test_autocast_nesting_innermost_governs_and_disabled_is_identity():
  seen = []

  def inner(x):
    seen.append(("inner", x.dtype))
    return x * 2

  def outer(x, inner_fn):
    seen.append(("outer", x.dtype))
    y = inner_fn(x)
    seen.append(("after inner", y.dtype))
    return y

  x = jnp.ones(2)
  f16 = "mixed_float16"
  out = jaxscale.autocast(lambda x: outer(x, jaxscale.autocast(inner, "float32")), f16)(x)
  assert seen == [("outer", F16), ("inner", F32), ("after inner", F32)] and out.dtype == F32
  seen.clear()
  jaxscale.autocast(lambda x: outer(x, jaxscale.autocast(inner, f16, enabled=False)), f16)(x)
  # Like torch.autocast(enabled=False): the region runs in whatever its inputs already are.
  assert seen == [("outer", F16), ("inner", F16), ("after inner", F16)]
  assert jaxscale.autocast(inner, f16, enabled=False) is inner
  with pytest.raises(ValueError, match="enabled"):
    jaxscale.autocast(inner, f16, enabled=1)


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

  dots = [e for e in jax.make_jaxpr(apply)(params, x).jaxpr.eqns if "dot_general" in str(e)]
  assert dots and all(e.outvars[0].aval.dtype == F16 for e in dots)  # the matmuls run in float16

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
  assert step._cache_size() == 1


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
  assert seen == [F16]  # traced once, and the model ran in float16
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
    dots = [e for e in jax.make_jaxpr(run)(x).jaxpr.eqns if e.primitive.name == "dot_general"]
    assert [e.outvars[0].aval.dtype for e in dots] == [F16]
    assert run(x).dtype == F32 and model.linear.kernel[...].dtype == F32
  plain, cast = Net(nnx.Rngs(0)), Net(nnx.Rngs(0))
  for _ in range(2):  # the dropout RNG count inside the module advances as without autocast
    np.testing.assert_array_equal(jaxscale.autocast(cast, "mixed_float16")(x) == 0, plain(x) == 0)
