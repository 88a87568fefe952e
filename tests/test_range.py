"""range_stats against NumPy's own casts (ml_dtypes for bfloat16 and float8)."""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import jaxscale
from _jit import compilations
from _range_reference import reference

DTYPES = {
    "float16": np.float16,
    "bfloat16": ml_dtypes.bfloat16,
    "float8_e4m3fn": ml_dtypes.float8_e4m3fn,
    "float8_e5m2": ml_dtypes.float8_e5m2,
}


def boundary_values(dtype):
  """Each limit of ``dtype`` (float32-representable), its float32 neighbours and the rounding midpoints."""
  finfo = ml_dtypes.finfo(dtype)
  sub, normal, top = (np.float32(float(v)) for v in (finfo.smallest_subnormal, finfo.smallest_normal, finfo.max))
  ulp_top = np.float32(float(top) - float(np.nextafter(top.astype(dtype), dtype(0))))
  with np.errstate(over="ignore"):
    points = [sub / 2, sub, normal - sub / 2, normal, top, top + ulp_top / 2, top + ulp_top]
  around = [np.nextafter(p, np.float32(np.inf)) for p in points] + [np.nextafter(p, np.float32(0)) for p in points]
  values = np.array(points + around, np.float32)
  # float32 normals only: CPUs flush float32 subnormals in arithmetic (bfloat16's own subnormals are there).
  values = values[np.isfinite(values) & (values >= np.finfo(np.float32).tiny)]
  return np.concatenate([values, -values, [0.0, -0.0, np.inf, -np.inf, np.nan]]).astype(np.float32)


def random_values(dtype, rng, size=3000):
  """Log-uniform magnitudes over the whole range of ``dtype`` and beyond, both signs."""
  finfo = ml_dtypes.finfo(dtype)
  lo = max(np.log2(float(finfo.smallest_subnormal)) - 4, -122)  # x * 2**-3 stays a float32 normal
  hi = min(np.log2(float(finfo.max)) + 4, 127)
  return (np.exp2(rng.uniform(lo, hi, size)) * rng.choice([-1, 1], size)).astype(np.float32)


def assert_matches(stats, expected):
  for field, value in expected.items():
    np.testing.assert_allclose(np.asarray(getattr(stats, field), np.float64), value, rtol=1e-6, err_msg=field)


@pytest.mark.parametrize("name", list(DTYPES))
def test_matches_numpy_cast_over_the_whole_range_and_at_the_boundaries(name, strict_promotion):
  dtype = DTYPES[name]
  rng = np.random.default_rng(0)
  tree = {"random": random_values(dtype, rng).reshape(30, 100),
          "half": jnp.asarray(np.exp2(rng.uniform(-24, 15.9, 200)), jnp.float16), "step": jnp.arange(3)}
  f = jax.jit(lambda tree, scale: jaxscale.range_stats(tree, scale=scale, dtype=getattr(jnp, name)))
  edges = boundary_values(dtype)
  for scale in (1.0, 2.0**-3, 3.0, 2.0**10):
    # The boundaries hit after scaling; products stay float32 normals, which every device keeps.
    with np.errstate(over="ignore"):
      scaled_edges = edges / np.float32(scale)
    tiny = np.finfo(np.float32).tiny
    subnormal_product = (np.minimum(np.abs(scaled_edges), np.abs(edges)) < tiny) & (edges != 0)
    tree["edges"] = np.where(subnormal_product, np.float32(1), scaled_edges).astype(np.float32)
    stats = f(tree, jnp.float32(scale))
    floating = [tree["edges"], np.asarray(tree["half"], np.float32), tree["random"]]
    assert_matches(stats, reference(np.concatenate([x.ravel() for x in floating]), scale, dtype))
    for key in ("random", "edges", "half"):
      assert_matches(stats.leaves[key], reference(tree[key], scale, dtype))
    assert stats.leaves["step"] is None
    assert float(stats.histogram.sum() + stats.zeros + stats.nonfinite) == float(stats.size)
  assert compilations(f) == 1


def test_float16_boundaries_one_by_one():
  """The values the issue names, each in a class of its own."""
  values = {
      "rounds to 0 (2**-25 ties to even)": [2.0**-25, np.nextafter(np.float32(2.0**-25), np.float32(0))],
      "rounds up to the smallest subnormal": [np.nextafter(np.float32(2.0**-25), np.float32(1)), 2.0**-24],
      "normal": [2.0**-14, 65504.0, 65519.0],
      "overflows": [65520.0, 1e30],
  }
  for label, expected in zip(values, ("zero_fraction", "subnormal_fraction", None, "overflow_fraction")):
    stats = jaxscale.range_stats(jnp.asarray(values[label], jnp.float32))
    for field in ("zero_fraction", "subnormal_fraction", "overflow_fraction"):
      assert float(getattr(stats, field)) == (1.0 if field == expected else 0.0), (label, field)
  stats = jaxscale.range_stats(jnp.array([np.inf, np.nan, 0.0, 1.0]))
  assert (float(stats.nonfinite), float(stats.zeros), float(stats.overflow_fraction)) == (2.0, 1.0, 0.0)


def test_e4m3fn_overflow_is_nan_beyond_its_rounding_of_448():
  stats = jaxscale.range_stats(jnp.array([448.0, 464.0, 465.0, 1e4]), dtype=jnp.float8_e4m3fn)
  assert float(stats.overflow_fraction) == 0.5  # 464 rounds to 448 (even); 465 and beyond are NaN


def test_empty_and_integer_trees():
  stats = jaxscale.range_stats({"n": jnp.arange(3), "empty": jnp.zeros((0,), jnp.float32)})
  assert float(stats.size) == 0 and float(stats.zero_fraction) == 0.0
  assert float(stats.min_magnitude) == np.inf and float(stats.max_magnitude) == 0.0
  assert jaxscale.range_stats({}).histogram.shape == (277,)


def test_format_range_stats_rows():
  stats = jaxscale.range_stats({"a": jnp.array([1e-9, 1.0]), "b": {"c": jnp.array([1e5])}})
  lines = jaxscale.format_range_stats(stats).splitlines()
  assert [line.split(" | ")[0] for line in lines[2:]] == ["| ['a']", "| ['b']['c']", "| total"]
  assert lines[2].split(" | ")[2:5] == ["50.00", "0.00", "0.00"] and lines[3].split(" | ")[4] == "100.00"


@pytest.mark.parametrize(
    "dtype",
    [jnp.int32, jnp.float64, "float4_e2m1fn", "float8_e4m3fnuz", "float8_e5m2fnuz", "float8_e8m0fnu", "not a dtype"],
)
def test_rejects_dtypes_it_cannot_see(dtype):
  dtype = getattr(jnp, dtype, dtype) if isinstance(dtype, str) else dtype
  with pytest.raises(ValueError, match="`dtype`"):
    jaxscale.range_stats(jnp.ones(2), dtype=dtype)


def test_one_compilation_whatever_form_the_scale_takes():
  tree = {"a": jnp.ones(3), "b": jnp.ones((2, 2), jnp.float16)}
  from jaxscale import _range

  before = compilations(_range.stats_at_scale)
  for scale in (1.0, 2, jnp.float32(8.0), np.float32(3.0), jnp.asarray(4.0, jnp.bfloat16)):
    jaxscale.range_stats(tree, scale=scale)
  assert compilations(_range.stats_at_scale) == before + 1


def test_under_lax_cond_every_n_steps():
  grads = {"w": jnp.array([1e-9, 1e-6, 1.0]), "b": jnp.array([7e4])}

  @jax.jit
  def step(grads, i):
    skipped = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), jax.eval_shape(jaxscale.range_stats, grads))
    return jax.lax.cond(i % 10 == 0, jaxscale.range_stats, lambda g: skipped, grads)

  direct = jaxscale.range_stats(grads)
  for a, b in zip(jax.tree.leaves(step(grads, 20)), jax.tree.leaves(direct), strict=True):
    np.testing.assert_array_equal(a, b)
  assert float(step(grads, 3).overflow_fraction) == 0.0 and float(direct.overflow_fraction) == 0.25
  assert compilations(step) == 1


def test_float64_leaves_beyond_float32_range_are_underflow_and_overflow_not_zeros_or_nonfinite(x64):
  """With x64 on, 1e300 overflows float16 (it is no inf input) and 1e-300 underflows (it is no exact 0)."""
  stats = jaxscale.range_stats(jnp.array([1e300, -1e-300, 1.0, 0.0, np.inf], jnp.float64))
  assert [float(stats.overflow_fraction * 5), float(stats.zero_fraction * 5)] == [1.0, 1.0]
  assert [float(stats.zeros), float(stats.nonfinite)] == [1.0, 1.0]
  assert float(stats.histogram.sum() + stats.zeros + stats.nonfinite) == float(stats.size)


def test_dtype_none_is_refused_as_none():
  with pytest.raises(ValueError, match="got None"):  # not as float64, which np.dtype(None) is
    jaxscale.range_stats(jnp.ones(2), dtype=None)


def test_scale_must_be_a_scalar():
  with pytest.raises(ValueError, match="`scale`.*shape \\(4,\\)"):
    jaxscale.range_stats(jnp.ones(1), scale=jnp.ones(4))


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="XLA:CPU's buffers; GPUs fuse differently")
def test_few_leaf_sized_temporaries():
  """The counts come from one scatter, not one integer reduction each: XLA:CPU writes every
  integer reduction's operand out (its tree-reduction rewrite), nine leaf-sized arrays before."""
  from jaxscale import _range

  leaf = jax.ShapeDtypeStruct((2**20,), jnp.float32)
  compiled = _range.stats_at_scale.lower({"g": leaf}, jnp.float32(1.0), np.dtype(jnp.float16)).compile()
  assert compiled.memory_analysis().temp_size_in_bytes <= 5 * leaf.size * 4


@pytest.mark.parametrize("scale", [1.0, 2.0**10], ids=["scale_1", "scale_2e10"])
def test_float32_subnormal_inputs_are_nonzero_values_not_exact_zeros(scale):
  # Three nonzero inputs that float16 flushes to zero (and that XLA:CPU's arithmetic flushes
  # too), one exact zero, one normal value: judged from the inputs' bits, as NumPy does.
  x = np.array([2.0**-127, 2.0**-149, -(2.0**-130), 0.0, 1e-3], np.float32)
  for stats in (jaxscale.range_stats(x, scale=jnp.float32(scale)), jax.jit(jaxscale.range_stats)(x, scale=scale)):
    expected = reference(x, scale, np.float16)
    assert expected["zero_fraction"] == 0.6 and expected["zeros"] == 1
    assert_matches(stats, {k: expected[k]
                           for k in ("zero_fraction", "subnormal_fraction", "overflow_fraction", "zeros")})
    assert float(stats.histogram.sum() + stats.zeros + stats.nonfinite) == float(stats.size)


def test_a_scaler_state_as_the_scale_asks_for_its_scale():
  with pytest.raises(TypeError, match=r"got a ScalerState.*scaler.scale"):
    jaxscale.range_stats(jnp.ones(2), scale=jaxscale.init())
