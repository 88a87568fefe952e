"""Shared test configuration."""

import jax
import numpy as np
import pytest


@pytest.fixture
def strict_promotion():
  """Strict dtype promotion for jaxscale's own code: catches silent float16 -> float32 upcasts.

  Not autouse: optax itself mixes Python floats and int32 counters, which strict mode rejects.
  """
  with jax.numpy_dtype_promotion("strict"):
    yield


@pytest.fixture
def x64():
  """64-bit floats on, inside the test (jax.enable_x64 from jax 0.8; jax.experimental's before)."""
  enable_x64 = getattr(jax, "enable_x64", None)
  if enable_x64 is None:
    from jax.experimental import enable_x64
  with enable_x64(True):
    yield


def bits(tree):
  """Every leaf's bytes, in order: equal lists mean bit-for-bit equal trees (-0.0 and NaN payloads too)."""
  return [np.asarray(x).tobytes() for x in jax.tree.leaves(tree)]


def assert_bitwise_equal(a, b, what=""):
  """``a`` and ``b`` have the same structure, dtypes, shapes and bits, leaf by leaf (PRNG keys by their data)."""
  assert jax.tree.structure(a) == jax.tree.structure(b), what
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
    x, y = as_numpy(x), as_numpy(y)
    assert x.dtype == y.dtype and x.shape == y.shape, what
    np.testing.assert_array_equal(x.view(np.uint8), y.view(np.uint8), err_msg=what)


def as_numpy(x):
  """A leaf as a NumPy array of at least one dimension; a PRNG key as its key data."""
  if jax.numpy.issubdtype(jax.numpy.result_type(x), jax.dtypes.prng_key):
    x = jax.random.key_data(x)
  return np.atleast_1d(np.asarray(x))
