"""Shared test configuration.

The hooks for every test, the docstrings' examples included, are in the repository root's conftest.py.
"""

import jax
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

