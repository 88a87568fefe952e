"""Metrics: the scaler's numbers as a flat dict of arrays, for any logger.

Return ``metrics(opt_state)`` from the jitted step: the values stay on the device
(no host sync inside the step), and the host reads them when it logs.
"""

from __future__ import annotations

from typing import Any

import jax

from jaxscale import _optax, _scaler

_FIELDS = ("scale", "growth_tracker", "hysteresis_tracker", "skipped_steps", "last_skipped", "stalled")


def metrics(opt_state_or_scaler: Any) -> dict[str, jax.Array]:
  """The loss scaler's numbers, as a flat ``dict[str, jax.Array]`` of scalars.

  Keys: ``scale`` (float32), ``growth_tracker``, ``hysteresis_tracker``,
  ``skipped_steps`` (int32; total skipped steps), ``last_skipped`` and
  ``stalled`` (bool). Reading them does not synchronise with the device;
  converting them to Python numbers (``float(...)``) does, so do that on the
  host at your logging cadence.

  Args:
    opt_state_or_scaler: a :class:`ScalerState`, or any optimizer state
      holding one (see :func:`find_scaler`).

  Returns:
    The dict, ready for ``{f"scaler/{k}": v for k, v in ...}``.

  Raises:
    ValueError: if no scaler, or more than one, is found.

  Examples:
    >>> import jaxscale
    >>> m = jaxscale.metrics(jaxscale.init(init_scale=1024.0))
    >>> sorted(m)
    ['growth_tracker', 'hysteresis_tracker', 'last_skipped', 'scale', 'skipped_steps', 'stalled']
    >>> m["scale"]
    Array(1024., dtype=float32)
  """
  scaler = opt_state_or_scaler
  if not isinstance(scaler, _scaler.ScalerState):
    scaler = _optax.scaler_of(opt_state_or_scaler)  # a stalled one too: `stalled` is reported
  return {name: getattr(scaler, name) for name in _FIELDS}
