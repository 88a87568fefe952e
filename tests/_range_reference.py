"""A NumPy reference for `jaxscale.range_stats`: NumPy's own casts (ml_dtypes for bfloat16, float8)."""

import warnings

import ml_dtypes
import numpy as np


def reference(x, scale, dtype):
  """The classes, histogram and magnitudes of ``x * scale`` cast to ``dtype``, in NumPy."""
  x = np.asarray(x, np.float32).ravel()
  finite = np.isfinite(x)
  nonzero = finite & (x != 0)
  with warnings.catch_warnings(), np.errstate(over="ignore", invalid="ignore"):
    warnings.simplefilter("ignore")
    scaled = x * np.float32(scale)
    cast = scaled.astype(dtype).astype(np.float64)
  tiny = float(ml_dtypes.finfo(dtype).smallest_normal)
  magnitude = np.abs(scaled[nonzero]).astype(np.float64)
  exponents = np.clip(np.floor(np.log2(np.where(magnitude > 0, magnitude, 2.0**-200))), -149, 127)
  n = max(x.size, 1)
  return {
      "zero_fraction": np.sum(nonzero & (cast == 0)) / n,
      "subnormal_fraction": np.sum(nonzero & np.isfinite(cast) & (cast != 0) & (np.abs(cast) < tiny)) / n,
      "overflow_fraction": np.sum(nonzero & ~np.isfinite(cast)) / n,
      "min_magnitude": magnitude[magnitude > 0].min() if np.any(magnitude > 0) else np.inf,
      "max_magnitude": magnitude.max() if magnitude.size else 0.0,
      "histogram": np.bincount((exponents + 149).astype(int), minlength=277),
      "zeros": np.sum(finite & (x == 0)),
      "nonfinite": np.sum(~finite),
      "size": x.size,
  }
