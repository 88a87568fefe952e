"""jaxscale: dynamic loss scaling for float16 training in JAX."""

from jaxscale._grad import value_and_grad
from jaxscale._range import HISTOGRAM_EXPONENTS, RangeStats, format_range_stats, range_stats
from jaxscale._suggest import ProbeResult, probe_scale, suggest_scale
from jaxscale._taps import tap, tap_probes
from jaxscale._optax import DynamicLossScalingState, dynamic_loss_scaling, find_scaler
from jaxscale._scaler import (
    ScalerState,
    all_finite,
    configure,
    init,
    raise_if_stalled,
    scale,
    unscale_and_check,
    update,
)
from jaxscale._torch_compat import load_state_dict, state_dict

__version__ = "0.1.0"

__all__ = (
    "HISTOGRAM_EXPONENTS",
    "ProbeResult",
    "RangeStats",
    "format_range_stats",
    "probe_scale",
    "range_stats",
    "suggest_scale",
    "tap",
    "tap_probes",
    "DynamicLossScalingState",
    "ScalerState",
    "all_finite",
    "configure",
    "dynamic_loss_scaling",
    "find_scaler",
    "init",
    "load_state_dict",
    "raise_if_stalled",
    "scale",
    "state_dict",
    "unscale_and_check",
    "update",
    "value_and_grad",
)
