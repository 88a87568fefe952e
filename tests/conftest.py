"""Shared test configuration."""

import jax
import pytest


@pytest.fixture
def strict_promotion():
  """Strict dtype promotion for jaxscale's own code: catches silent float16 -> float32 upcasts.

  Not autouse: optax itself mixes Python floats and int32 counters, which strict mode rejects.
  """
  with jax.numpy_dtype_promotion("strict"):
    yield
