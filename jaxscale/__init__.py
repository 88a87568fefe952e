"""jaxscale: dynamic loss scaling for float16 training in JAX."""

# The loss scaler and its Optax wrapper.
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
from jaxscale._grad import value_and_grad
from jaxscale._optax import DynamicLossScalingState, dynamic_loss_scaling, find_scaler
from jaxscale._torch_compat import load_state_dict, state_dict
from jaxscale._metrics import metrics

# Mixed precision around the scaler.
from jaxscale._policy import Policy, get_policy, needs_loss_scaling
from jaxscale._autocast import autocast, float8_history
from jaxscale._history import Float8History, float8_update
from jaxscale._report import PrecisionReport, precision_report
from jaxscale._compiled import CompiledReport, compiled_report
from jaxscale._master import MasterWeightsState, master_weights
from jaxscale._lowp import LowPrecisionState, low_precision_state
from jaxscale._device import recommended_policy, supports_bfloat16, supports_float16

# Seeing the float16 range.
from jaxscale._range import HISTOGRAM_EXPONENTS, RangeStats, format_range_stats, range_stats
from jaxscale._taps import tap, tap_probes
from jaxscale._suggest import ProbeResult, probe_scale, suggest_scale
from jaxscale._overflow import OverflowReport, find_overflow

__version__ = "0.1.0"

__all__ = (
    # The loss scaler and its Optax wrapper.
    "DynamicLossScalingState",
    "ScalerState",
    "all_finite",
    "configure",
    "dynamic_loss_scaling",
    "find_scaler",
    "init",
    "load_state_dict",
    "metrics",
    "raise_if_stalled",
    "scale",
    "state_dict",
    "unscale_and_check",
    "update",
    "value_and_grad",
    # Mixed precision around the scaler.
    "CompiledReport",
    "Float8History",
    "MasterWeightsState",
    "LowPrecisionState",
    "Policy",
    "PrecisionReport",
    "autocast",
    "compiled_report",
    "float8_history",
    "float8_update",
    "get_policy",
    "master_weights",
    "low_precision_state",
    "needs_loss_scaling",
    "precision_report",
    "recommended_policy",
    "supports_bfloat16",
    "supports_float16",
    # Seeing the float16 range.
    "HISTOGRAM_EXPONENTS",
    "OverflowReport",
    "ProbeResult",
    "RangeStats",
    "find_overflow",
    "format_range_stats",
    "probe_scale",
    "range_stats",
    "suggest_scale",
    "tap",
    "tap_probes",
)
