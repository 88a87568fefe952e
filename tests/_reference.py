"""The one reference model of the loss-scaling rule, independent of jaxscale's code."""

import numpy as np

f32 = np.float32
INT32_MAX = 2**31 - 1


class ReferenceScaler:
  """The loss-scaling rule in plain Python, written from `_scaler.py`'s docstring and docs/index.md (NumPy
  float32 where rounding matters): the one model of the rule the tests compare jaxscale with."""

  OPTIONS = ("scale", "growth_factor", "backoff_factor", "growth_interval", "hysteresis",
             "min_scale", "max_scale", "dynamic", "growth_tracker")

  def __init__(self, *, enabled=True, on_stall="raise", init_scale=2.0**16, growth_factor=2.0,
               backoff_factor=0.5, growth_interval=2000, hysteresis=1, min_scale=0.0,
               max_scale=float("inf"), dynamic=True):  # torch's defaults, and jaxscale's own
    self.enabled = enabled
    self.raise_on_stall = on_stall == "raise"
    self.scale = f32(init_scale) if enabled else f32(1.0)
    self.growth_factor, self.backoff_factor = f32(growth_factor), f32(backoff_factor)
    self.growth_interval, self.hysteresis = int(growth_interval), int(hysteresis)
    self.min_scale, self.max_scale = f32(min_scale), f32(max_scale)
    self.dynamic = bool(dynamic)
    self.growth_tracker, self.hysteresis_tracker = 0, self.hysteresis
    self.skipped_steps, self.last_skipped, self.stalled = 0, False, False

  @staticmethod
  def valid(o):
    """Whether options can work, as they will be stored (float32 / int32)."""
    with np.errstate(over="ignore"):
      scale, lo, hi = f32(o["scale"]), f32(o["min_scale"]), f32(o["max_scale"])
      growth, backoff = f32(o["growth_factor"]), f32(o["backoff_factor"])
    ints = [o["growth_interval"], o["hysteresis"]]
    return (
        np.isfinite(scale) and scale >= np.finfo(np.float32).tiny  # normal: no flushed reciprocal
        and np.isfinite(growth) and growth > 1
        and 0 < backoff < 1
        and all(1 <= n <= INT32_MAX for n in ints)
        and 0 <= o["growth_tracker"] <= INT32_MAX
        and np.isfinite(lo) and lo >= 0 and hi > 0
        and lo <= scale <= hi  # a back-off never raises the scale, a growth never lowers it
    )

  def options(self):
    return {name: getattr(self, name) for name in self.OPTIONS}

  def configure(self, **changes):
    for name, value in changes.items():
      if name == "scale":
        if self.enabled:
          self.scale = f32(value)
      elif name in ("growth_factor", "backoff_factor", "min_scale", "max_scale"):
        setattr(self, name, f32(value))
      elif name == "dynamic":
        self.dynamic = bool(value)
      else:
        setattr(self, name, int(value))
    if "hysteresis" in changes:  # a new tolerance starts full
      self.hysteresis_tracker = self.hysteresis

  def update(self, finite):
    """One step of the rule; returns whether the optimizer step is taken."""
    if not self.enabled:
      return True
    finite = finite and not self.stalled
    if finite:
      self.growth_tracker = min(self.growth_tracker + 1, INT32_MAX)
      if not self.dynamic:  # a static scale's tolerance counts overflows in a row: refilled here
        self.hysteresis_tracker = self.hysteresis
      if self.dynamic and self.growth_tracker >= self.growth_interval:
        with np.errstate(over="ignore"):
          grown = self.scale * self.growth_factor
        if np.isfinite(grown):
          self.scale = min(grown, self.max_scale)
        self.growth_tracker = 0
        self.hysteresis_tracker = self.hysteresis
    else:
      # Never below float32's smallest normal number, whatever `min_scale` (torch's goes on).
      floor = max(self.min_scale, f32(2.0**-126))
      at_floor = self.scale <= floor
      self.skipped_steps = min(self.skipped_steps + 1, INT32_MAX)
      self.growth_tracker = 0
      if self.dynamic:
        self.hysteresis_tracker = max(self.hysteresis_tracker - 1, 0)
      else:  # below 0: the overflows in a row past the tolerance
        self.hysteresis_tracker = max(self.hysteresis_tracker - 1, -(2**31))
      if self.dynamic and self.hysteresis_tracker == 0:
        self.scale = max(self.scale * self.backoff_factor, floor)
      if not self.dynamic:  # stalled where halving from this scale would have reached the floor
        halved = self.scale
        for _ in range(max(-self.hysteresis_tracker, 0)):
          halved = halved / 2  # exact, or 0 (then below any floor)
          if halved <= floor:
            break
        at_floor = halved <= floor
      if self.raise_on_stall and at_floor:
        self.stalled = True
    self.last_skipped = not finite
    return finite

  def torch_dict(self):
    if not self.enabled:
      return {}
    return {"scale": float(self.scale), "growth_factor": float(self.growth_factor),
            "backoff_factor": float(self.backoff_factor), "growth_interval": self.growth_interval,
            "_growth_tracker": self.growth_tracker}
