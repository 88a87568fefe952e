"""What jaxscale asks of a pytree's leaves, in one place: is it floating, and NNX's Variables unwrapped.

A low module: it imports no other part of jaxscale, so every module can use it.
"""

from __future__ import annotations

import sys
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np


def is_floating(x: Any, *, real: bool = False) -> bool:
  """Whether ``x`` is a floating array, array scalar or Python float (complex too unless ``real``).

  Python bools and ints are not, and neither is any other object (a Flax Linen
  module configured with ``dtype=`` has a ``dtype`` too), nor a PRNG key or float0.
  """
  if not isinstance(x, (jax.Array, np.ndarray, np.generic, float, complex)) or isinstance(x, bool):
    return False
  return bool(jnp.issubdtype(jnp.result_type(x), jnp.floating if real else jnp.inexact))


def is_variable(x: Any) -> bool:
  """Whether ``x`` is an NNX Variable (a pytree node around one array)."""
  nnx = sys.modules.get("flax.nnx")
  return nnx is not None and isinstance(x, nnx.Variable)


def unwrap_variable(leaf: Any) -> Any:
  """``leaf``'s value if it is an NNX Variable, else ``leaf``.

  Found through sys.modules: a Variable exists only once flax is imported, and
  jaxscale must not import it.
  """
  if not is_variable(leaf):
    return leaf
  # `get_value` is flax >= 0.12.1, which deprecates `.value`; older ones have only `.value`.
  get_value = getattr(leaf, "get_value", None)
  return get_value() if callable(get_value) else leaf.value
