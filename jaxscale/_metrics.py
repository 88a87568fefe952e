"""Metrics: the scaler's numbers as a flat dict of arrays, for any logger.

Call ``metrics(opt_state)`` where you log, or return it from the jitted step: the values stay
on the device (no host sync inside the step), and the host reads them when it logs. Outside
``jit``, a stalled scaler raises here, as in :func:`jaxscale.find_scaler`: a run whose every
step is skipped does not go on quietly. Inside ``jit`` nothing can be read without a host sync,
so the dict reports ``stalled`` and the host checks it where it logs.
"""

from __future__ import annotations

from typing import Any

import jax
from jax.core import Tracer

from jaxscale import _optax, _scaler

_FIELDS = ("scale", "growth_tracker", "hysteresis_tracker", "skipped_steps", "last_skipped", "stalled")


def metrics(opt_state_or_scaler: Any) -> dict[str, jax.Array]:
  """The loss scaler's numbers, as a flat ``dict[str, jax.Array]`` of scalars.

  Keys: ``scale`` (float32), ``growth_tracker``, ``hysteresis_tracker``,
  ``skipped_steps`` (int32; total skipped steps), ``last_skipped`` and
  ``stalled`` (bool). Reading them does not synchronise with the device;
  converting them to Python numbers (``float(...)``) does, so do that on the
  host at your logging cadence.

  On a stalled scaler (see ``on_stall`` in :func:`jaxscale.init`), called
  outside ``jit`` it raises, as :func:`jaxscale.find_scaler` does: that one
  bool is read from the device. Inside ``jit`` it cannot, and the dict's
  ``stalled`` says it: called where you log (outside the step) on the state
  the step returned, it raises.

  Args:
    opt_state_or_scaler: a :class:`ScalerState`, or any optimizer state
      holding one (see :func:`find_scaler`).

  Returns:
    The dict, ready for ``{f"scaler/{k}": v for k, v in ...}``.

  Raises:
    ValueError: if no scaler, or more than one, is found.
    FloatingPointError: outside ``jit``, if the scaler has stalled.

  Examples:
    >>> import jaxscale
    >>> m = jaxscale.metrics(jaxscale.init(init_scale=1024.0))
    >>> sorted(m)
    ['growth_tracker', 'hysteresis_tracker', 'last_skipped', 'scale', 'skipped_steps', 'stalled']
    >>> m["scale"]
    Array(1024., dtype=float32)
  """
  scaler = opt_state_or_scaler
  if isinstance(scaler, _scaler.ScalerState):
    if not isinstance(scaler.stalled, Tracer):
      _scaler.raise_if_stalled(scaler)
  else:
    scaler = _optax.find_scaler(opt_state_or_scaler)
  return {name: getattr(scaler, name) for name in _FIELDS}
