"""jaxscale: dynamic loss scaling for float16 training in JAX."""

from jaxscale._autocast import autocast
from jaxscale._device import recommended_policy, supports_bfloat16, supports_float16
from jaxscale._grad import value_and_grad
from jaxscale._master import MasterWeightsState, master_weights
from jaxscale._metrics import metrics
from jaxscale._optax import DynamicLossScalingState, dynamic_loss_scaling, find_scaler
from jaxscale._policy import Policy, get_policy, needs_loss_scaling
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
    "DynamicLossScalingState",
    "MasterWeightsState",
    "Policy",
    "ScalerState",
    "all_finite",
    "autocast",
    "configure",
    "dynamic_loss_scaling",
    "find_scaler",
    "get_policy",
    "init",
    "load_state_dict",
    "master_weights",
    "metrics",
    "needs_loss_scaling",
    "raise_if_stalled",
    "recommended_policy",
    "scale",
    "state_dict",
    "supports_bfloat16",
    "supports_float16",
    "unscale_and_check",
    "update",
    "value_and_grad",
)
