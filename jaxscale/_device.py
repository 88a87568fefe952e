"""Device capability: which 16-bit dtypes a device runs natively and fast.

    NVIDIA GPU (CUDA compute capability):
        float16   7.0+ (tensor cores), and 6.0 / 6.2 (P100, Jetson TX2: packed
                  half2 arithmetic at twice the float32 rate); not 6.1 (consumer
                  Pascal runs float16 at 1/64 of the float32 rate) nor below
        bfloat16  8.0+ (Ampere tensor cores); emulated before
    AMD GPU (ROCm, gfx architecture): float16 on every gfx9 and later;
        bfloat16 on the matrix-core parts (gfx908, gfx90a, gfx94x, gfx95x) and RDNA3+
    TPU, every generation (v2 to v6e, and Ironwood): bfloat16 native (the matrix units take
        it); float16 not fast: XLA:TPU feeds a float16 matmul its float16 operands and it costs
        what a bfloat16 one costs (same kernels, bytes and FLOPs in the compiled v5e, v5p and
        v6e programs), so float16 buys no speed there and needs loss scaling for its narrower
        range; float8 (v5e, v5p, v6e have no float8 matrix unit) gains nothing either, and
        "mixed_float8" keeps its matmuls bfloat16 on every TPU: bfloat16 is the one to use
    CPU, and anything not recognised: neither (emulated, or unknown: float32 is safe)

The recommendation prefers bfloat16 (no loss scaling needed), then float16 (with
``dynamic_loss_scaling``), then float32. Nothing here raises: a device that cannot be
read is treated as unknown.
"""

from __future__ import annotations

import re
from typing import Any, Optional

import jax

from jaxscale import _policy


def supports_float16(device: Optional[Any] = None) -> bool:
  """Whether ``device`` runs float16 natively and fast; never raises.

  Args:
    device: a ``jax.Device`` (or anything with its ``platform``,
      ``device_kind`` and ``compute_capability`` attributes); default the first
      device.

  Returns:
    A Python bool: False on a CPU, a TPU, an older GPU, or a device that cannot
    be read.

  Examples:
    >>> import types, jaxscale
    >>> jaxscale.supports_float16(types.SimpleNamespace(platform="gpu", compute_capability="7.0"))
    True
    >>> jaxscale.supports_float16(types.SimpleNamespace(platform="cpu"))
    False
  """
  return _capabilities(device)[0]


def supports_bfloat16(device: Optional[Any] = None) -> bool:
  """Whether ``device`` runs bfloat16 natively and fast; never raises.

  Args:
    device: as for :func:`supports_float16`.

  Returns:
    A Python bool: True on a TPU and on GPUs from Ampere (compute capability
    8.0) on.

  Examples:
    >>> import types, jaxscale
    >>> jaxscale.supports_bfloat16(types.SimpleNamespace(platform="tpu", device_kind="TPU v4"))
    True
  """
  return _capabilities(device)[1]


def recommended_policy(device: Optional[Any] = None) -> _policy.Policy:
  """The policy to train with on ``device``; never raises.

  ``mixed_bfloat16`` where bfloat16 is fast, else ``mixed_float16`` where
  float16 is fast, else ``float32``. Use it with :func:`needs_loss_scaling`:
  loss scaling is then on exactly when the policy computes in float16.

  On a TPU of any generation (v2 to v6e, Ironwood) that is ``mixed_bfloat16``:
  bfloat16 is what its matrix units take; a float16 matmul costs the same
  there and needs loss scaling; and ``"mixed_float8"`` runs its matmuls in
  bfloat16 on a TPU (none before Ironwood has a float8 matrix unit).

  Args:
    device: as for :func:`supports_float16`.

  Returns:
    A :class:`Policy` with float32 parameters and output.

  Examples:
    >>> import types, jaxscale
    >>> print(jaxscale.recommended_policy(types.SimpleNamespace(platform="gpu", compute_capability="7.5")))
    params=float32,compute=float16,output=float32
    >>> print(jaxscale.recommended_policy(types.SimpleNamespace(platform="tpu", device_kind="TPU v5 lite")))
    params=float32,compute=bfloat16,output=float32
  """
  float16, bfloat16 = _capabilities(device)
  name = "mixed_bfloat16" if bfloat16 else "mixed_float16" if float16 else "float32"
  return _policy.get_policy(name)


def _capabilities(device) -> tuple[bool, bool]:
  """``(float16 fast, bfloat16 fast)``; ``(False, False)`` for anything unreadable."""
  try:
    if device is None:
      device = jax.devices()[0]
    platform = str(_read(device, "platform")).lower()
    if platform == "tpu":
      return False, True
    if platform in ("gpu", "cuda", "rocm"):
      return _gpu_capabilities(device)
  except Exception:  # documented: never raises
    pass
  return False, False


def _gpu_capabilities(device) -> tuple[bool, bool]:
  capability = str(_read(device, "compute_capability")).strip().lower()
  cuda = re.fullmatch(r"(\d+)\.(\d+)", capability)
  if cuda:
    version = (int(cuda.group(1)), int(cuda.group(2)))
    return version >= (7, 0) or version in ((6, 0), (6, 2)), version >= (8, 0)
  rocm = re.fullmatch(r"gfx(\d+)([0-9a-f]{2})[a-z0-9:+-]*", capability)
  if rocm:
    major, minor = int(rocm.group(1)), rocm.group(2)
    matrix_cores = major == 9 and (minor in ("08", "0a") or minor[0] in "45")
    return major >= 9, matrix_cores or major >= 11
  return False, False


def _read(device, name) -> Any:
  """``getattr`` that turns a missing or failing attribute into None."""
  try:
    return getattr(device, name, None)
  except Exception:
    return None
