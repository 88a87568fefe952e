"""What a trace knows about gradients: scaled, or already unscaled (and their flag).

Two mistakes train without a word, because scaled and unscaled gradients are
arrays of the same shapes and dtypes: feeding the wrapper gradients that
:func:`jaxscale.value_and_grad` already unscaled (``TrainState.apply_gradients``
or ``nnx.Optimizer.update`` cannot pass ``finite=``), which divides them by the
scale twice; and feeding it gradients of a loss that was never scaled, which
divides true gradients by the scale once. Neither can be seen in the values,
but both can be seen while tracing, from the Python objects involved:

- :func:`jaxscale.scale` notes the scale array (or tracer) it multiplied by,
  and that some loss was scaled (since an update last recognised its scale);
- :func:`jaxscale.unscale_and_check` notes each unscaled leaf it returned,
  with the finite flag that goes with it, and that the scale last unscaled.

The wrapper's update looks these up at trace time: leaves it was given that
are known unscaled bring their flag with them (so they are not unscaled
again), and a scale no loss was multiplied by is reported. Nothing here enters
the computation: the compiled step, its cache and its cost are unchanged.
Entries hold weak references to the objects they describe (a tracer dies
with its trace) and disappear with them.
"""

from __future__ import annotations

import weakref
from typing import Any

# id(scale) -> (weak reference to it, whether a loss was scaled by it, the last use).
_scales: dict[int, tuple[weakref.ref, bool, str]] = {}
# id(leaf) -> (weak reference to it, its finite flag).
_unscaled: dict[int, tuple[weakref.ref, Any]] = {}


def _lookup(table: dict, x: Any):
  entry = table.get(id(x))
  return entry if entry is not None and entry[0]() is x else None


def _note(table: dict, x: Any, *rest: Any) -> None:
  key = id(x)
  try:
    ref = weakref.ref(x, lambda _, key=key, table=table, forget=_forget: forget(table, key))
  except TypeError:  # a Python or NumPy scalar: nothing to recognise it by later
    return
  table[key] = (ref, *rest)


def _forget(table: dict, key: int) -> None:
  entry = table.get(key)
  if entry is not None and entry[0]() is None:
    del table[key]


_scaled_since = False


def note_scaled(scale: Any) -> None:
  """Records that a loss was multiplied by ``scale``."""
  global _scaled_since
  _scaled_since = True
  _note(_scales, scale, True, "scaled")


def note_unscaled(scale: Any, leaves: list[Any], finite: Any) -> None:
  """Records that ``leaves`` are unscaled by ``scale``, with their ``finite`` flag."""
  entry = _lookup(_scales, scale)
  _note(_scales, scale, entry is not None and entry[1], "unscaled")
  for leaf in leaves:
    _note(_unscaled, leaf, finite)


def unscaled_flag(leaf: Any) -> Any:
  """The finite flag of ``leaf`` if it is a known unscaled gradient, else None."""
  entry = _lookup(_unscaled, leaf)
  return None if entry is None else entry[1]


def use_of(scale: Any) -> tuple[bool, str | None]:
  """``(scaled, last)``: whether a loss was scaled by ``scale``, and its last use (None if never used)."""
  entry = _lookup(_scales, scale)
  return (False, None) if entry is None else (entry[1], entry[2])


def scaled_since() -> bool:
  """Whether any loss was scaled since :func:`forget_scaled_since` (or ever).

  What the wrapper cannot recognise is not always a mistake: control flow
  (``lax.cond`` in ``optax.MultiSteps``, a ``scan``) and a second ``jax.jit``
  hand it new tracers or arrays of a scale that was used before them. A
  program that forgot to scale its loss never scales one.
  """
  return _scaled_since


def forget_scaled_since() -> None:
  """Called by an update that recognised its scale: what follows is judged afresh."""
  global _scaled_since
  _scaled_since = False
