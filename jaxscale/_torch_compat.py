"""Moving scaler state to and from torch.amp.GradScaler's ``state_dict``."""

from __future__ import annotations

from typing import Any, Mapping

import jax

from jaxscale import _scaler

# torch.amp.GradScaler.state_dict() keys, mapped to ScalerState fields.
_TORCH_KEYS = {
    "scale": "scale",
    "growth_factor": "growth_factor",
    "backoff_factor": "backoff_factor",
    "growth_interval": "growth_interval",
    "_growth_tracker": "growth_tracker",
}


def state_dict(state: _scaler.ScalerState) -> dict[str, float | int]:
  """Returns torch.amp.GradScaler's ``state_dict()`` for this state.

  Plain Python numbers under exactly torch's keys, so
  ``torch_scaler.load_state_dict(jaxscale.state_dict(state))`` works. As in
  torch, a disabled scaler gives ``{}``. Options torch does not have
  (``min_scale``, ``hysteresis``, ...) are not included: checkpoint the
  :class:`ScalerState` itself (Orbax, Flax serialization) to keep them.

  Args:
    state: the scaler state.

  Returns:
    A dict of Python numbers under torch's keys (``scale``, ``growth_factor``,
    ``backoff_factor``, ``growth_interval``, ``_growth_tracker``), or ``{}``
    for a disabled state.

  Raises:
    ValueError: if ``state`` is a batch of scalers (its leaves have a leading
      axis, as after ``jax.vmap``): torch's dict holds one scaler.

  Examples:
    >>> import jaxscale
    >>> jaxscale.state_dict(jaxscale.init())
    {'scale': 65536.0, 'growth_factor': 2.0, 'backoff_factor': 0.5, 'growth_interval': 2000, '_growth_tracker': 0}
  """
  _require_one_scaler(state, "state_dict")
  state = jax.device_get(state)
  if not state.enabled:
    return {}
  return {key: getattr(state, field).item() for key, field in _TORCH_KEYS.items()}


def load_state_dict(state: _scaler.ScalerState, d: Mapping[str, Any]) -> _scaler.ScalerState:
  """Returns ``state`` with the values of a torch GradScaler ``state_dict``.

  ``d`` may come from ``torch.amp.GradScaler.state_dict()`` (Python numbers
  or tensors) or from :func:`state_dict`. Options torch does not know keep
  their values from ``state``. As in torch, loading into a disabled state
  does nothing.

  Args:
    state: the scaler state to load into; it supplies the options torch does
      not have.
    d: a torch ``GradScaler`` state dict.

  Returns:
    ``state`` with the scale, the growth tracker and torch's options from ``d``.

  Raises:
    ValueError: if ``state`` is a batch of scalers (after ``jax.vmap``), if
      ``d`` is empty (saved from a disabled scaler), lacks one of torch's
      keys, has a key torch does not write, or holds an out-of-range value.

  Examples:
    >>> import jaxscale
    >>> d = {"scale": 1024.0, "growth_factor": 2.0, "backoff_factor": 0.5,
    ...      "growth_interval": 100, "_growth_tracker": 7}
    >>> state = jaxscale.load_state_dict(jaxscale.init(), d)
    >>> float(state.scale), int(state.growth_tracker), int(state.growth_interval)
    (1024.0, 7, 100)
  """
  _require_one_scaler(state, "load_state_dict")
  if not bool(jax.device_get(state.enabled)):
    return state
  if not d:
    raise ValueError(
        "The state dict is empty: it was probably saved from a disabled scaler."
    )
  missing = sorted(set(_TORCH_KEYS) - set(d))
  unknown = sorted(set(d) - set(_TORCH_KEYS))
  if missing or unknown:
    raise ValueError(
        f"Not a torch.amp.GradScaler state dict: missing keys {missing}, "
        f"unexpected keys {unknown}; expected exactly {sorted(_TORCH_KEYS)}."
    )
  values = {field: _to_python(d[key]) for key, field in _TORCH_KEYS.items()}
  return _scaler.configure(state, **values)


def _require_one_scaler(state: _scaler.ScalerState, name: str) -> None:
  _scaler.require_state(state, name)
  shape = jax.numpy.shape(state.scale)
  if shape != ():
    raise ValueError(
        f"`{name}` takes one scaler, but this state holds a batch of them (its leaves have shape "
        f"{shape}, as after `jax.vmap`); pick one first, e.g. "
        f"`{name}(jax.tree.map(lambda x: x[i], state))`."
    )


def _to_python(value: Any) -> float | int:
  return value.item() if hasattr(value, "item") else value
