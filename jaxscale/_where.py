"""Where a trace-time warning points: the first frame of the user's code.

A warning raised while JAX traces a function has jaxscale's frames and JAX's tracing machinery
between it and the line that called the function; a fixed ``stacklevel`` lands in one of them.
A low module: it imports no other part of jaxscale.
"""

from __future__ import annotations

import os
import sys

# The libraries between a user's call and jaxscale's warning (those loaded; one not loaded is not on the stack).
_LIBRARIES = ("jaxscale", "jax", "jaxlib", "flax", "equinox", "optax")


def user_stacklevel() -> int:
  """The ``stacklevel`` that makes ``warnings.warn``, called by this function's caller, name the
  first frame outside jaxscale, JAX and the libraries it is called through (1: the caller itself)."""
  files = (getattr(sys.modules.get(name), "__file__", None) for name in _LIBRARIES)
  skipped = tuple(os.path.dirname(file) + os.sep for file in files if isinstance(file, str))
  frame, level = sys._getframe(1), 1
  while frame.f_back is not None and _skipped(frame.f_code.co_filename, skipped):
    frame, level = frame.f_back, level + 1
  return level


# The standard library's own modules (`contextlib`, `functools`), which JAX's tracing calls through.
_STDLIB = os.path.dirname(os.__file__)


def _skipped(filename: str, libraries: tuple) -> bool:
  return filename.startswith(libraries) or os.path.dirname(filename) == _STDLIB
