"""Exact powers of two in float32.

Loss scales, float8 scales and suggested scales are powers of two so that multiplying by them is
exact. ``2.0 ** k`` and ``exp2`` may round on some backends, and ``1 / 2**k`` is subnormal (flushed
to zero by XLA) beyond 2**126, so every room builds them here, from the exponent bits.
"""

import jax
import jax.numpy as jnp


def power_of_two(k: jax.typing.ArrayLike) -> jax.Array:
  """``2.0**k`` as float32, exactly, for integer ``k`` in [-126, 127] (float32's normal range)."""
  return jax.lax.bitcast_convert_type((jnp.asarray(k, jnp.int32) + 127) << 23, jnp.float32)
