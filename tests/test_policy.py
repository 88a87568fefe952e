"""The precision policy: parsing (against jmp), casts on every leaf kind, and `needs_loss_scaling`."""

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
    [("p=f32,c=f8", "'f8'"), ("params=float32,comput=float16", "'comput'"), ("mixed_float4", "'mixed_float4'"),
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
  _, grads, finite = jaxscale.value_and_grad(loss)(scaler, params)
  updates, opt_state = tx.update(grads, opt_state, params, finite=finite)
  np.testing.assert_array_equal(optax.apply_updates(params, updates), jnp.full(3, 0.8))
  assert float(scaler.scale) == (4.0 if spec == "mixed_float16" else 1.0)



@pytest.mark.parametrize("typo, nearest", [("mixed_float61", "mixed_float16"), ("mixed-bfloat16", "mixed_bfloat16"),
                                           ("mixed_flaot8", "mixed_float8"), ("bfloat61", "bfloat16")])
def test_a_misspelt_preset_is_named_a_policy_and_the_nearest_name_suggested(typo, nearest):
  with pytest.raises(ValueError) as error:
    jaxscale.get_policy(typo)
  message = str(error.value)
  assert message.startswith(f"Unknown policy {typo!r}: neither a preset") and "Unknown dtype" not in message
  assert message.endswith(f"Did you mean {nearest!r}?")
  with pytest.raises(ValueError, match=r"Unknown dtype 'flaot16' in policy 'c=flaot16'.*Did you mean 'float16'\?"):
    jaxscale.get_policy("c=flaot16")
  with pytest.raises(ValueError) as error:
    jaxscale.get_policy("zzz")
  assert "Did you mean" not in str(error.value)


@pytest.mark.parametrize("spec, same_as", [
    ("mixed_float8,min_intensity=0", "p=f32,c=bf16,o=f32,m=f8,min_intensity=0"),
    ("Mixed_Float8, min_intensity = 100", "params=float32,compute=bfloat16,output=float32,matmul=f8,min_intensity=100"),
    ("mixed_bfloat16,c=f16", "p=f32,c=f16,o=f32"),
    ("float32,o=bf16", "p=f32,c=f32,o=bf16"),
])
def test_a_preset_followed_by_keys_is_the_preset_changed_by_them(spec, same_as):
  assert jaxscale.get_policy(spec) == jaxscale.get_policy(same_as)
@pytest.mark.parametrize(
    "spec, reduce",
    [("float32", F32), ("mixed_float16", F32), ("mixed_bfloat16", F32), ("mixed_float8", F32), ("p=bf16", BF16),
     ("p=f32,c=bf16,o=f32,reduce=bf16", BF16), ("p=f32,c=f16,r=f16", F16), ("p=f32,c=bf16,m=f8,r=bfloat16", BF16)],
)
def test_the_reduce_dtype_defaults_to_the_parameters_and_reads_back_from_str(spec, reduce):
  policy = jaxscale.get_policy(spec)
  assert policy.reduce_dtype == reduce
  assert jaxscale.get_policy(str(policy)) == policy
  # The default stays out of the string, which jmp's parser (three keys) then reads as well.
  assert ("reduce=" in str(policy)) == (reduce != policy.param_dtype)


def test_the_presets_strings_are_unchanged_by_the_reduce_dtype():
  assert str(jaxscale.get_policy("mixed_bfloat16")) == "params=float32,compute=bfloat16,output=float32"
  assert jmp.get_policy(str(jaxscale.get_policy("mixed_float16"))).compute_dtype == F16


@pytest.mark.parametrize(
    "spec, named",
    [("p=f32,reduce=f8", "'f8'"), ("p=f32,reduce=int8", "'int8'"), ("p=f32,rduce=f32", "'rduce'"),
     ("p=f32,reduce=", "''")],
)
def test_a_bad_reduce_dtype_names_the_bad_part(spec, named):
  with pytest.raises(ValueError, match=named):
    jaxscale.get_policy(spec)


@pytest.mark.parametrize("value", [jnp.int32, jnp.float8_e4m3fn, "nope", "f8"])
def test_the_constructor_refuses_a_reduce_dtype_it_cannot_reduce_in(value):
  with pytest.raises(ValueError, match="reduce_dtype"):
    jaxscale.Policy(jnp.float32, jnp.bfloat16, jnp.float32, reduce_dtype=value)
  assert jaxscale.Policy(F32, BF16, F32, reduce_dtype="bf16").reduce_dtype == BF16
