"""Bit-for-bit comparisons of pytrees, shared by the tests (imported by name: a conftest.py cannot be,
as tests/distributed has its own)."""

import jax
import numpy as np


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
