"""Seeing the float16 range: what a cast to a narrow float does to a pytree.

Every element of every floating leaf is multiplied by ``scale`` in float32 and
cast to the target dtype (float16 unless told), and falls in exactly one class::

    input non-finite (inf, NaN)             -> `nonfinite` (counted, nothing else)
    input exactly 0                         -> `zeros`
    nonzero finite input, after the cast:
        0                                   -> `zero_fraction` (underflow: lost)
        subnormal (below the smallest normal)  -> `subnormal_fraction` (precision lost)
        non-finite                          -> `overflow_fraction` (the step is skipped)
        normal                              -> (fine)

The classes are read from the bits of the cast itself, so they round exactly as
the device does (round to nearest even), and float32 subnormals are not taken
for zeros on devices that flush them in arithmetic. Nonzero finite inputs are
also counted by binade of ``|x * scale|`` (a log2 histogram whose bins are the
same for every tree and dtype). :func:`suggest_scale` turns the largest
magnitude into a power-of-two loss scale.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxscale import _tree

# The histogram's bins: bin i counts |x * scale| in [2**e, 2**(e + 1)) for
# e = HISTOGRAM_EXPONENTS[i], every binade of float32 from its smallest
# subnormal (2**-149) to its largest normal.
HISTOGRAM_EXPONENTS = np.arange(-149, 128)
HISTOGRAM_EXPONENTS.flags.writeable = False
NBINS = len(HISTOGRAM_EXPONENTS)


class RangeStats(NamedTuple):
  """What casting a pytree (times a scale) to a narrow float does; all arrays.

  Fractions are over all ``size`` elements of the floating leaves, so
  ``zero_fraction + subnormal_fraction + overflow_fraction`` plus the normal
  values, the exact zeros and the non-finite inputs make up the whole.
  Bin ``i`` of ``histogram`` counts ``|x * scale|`` in ``[2**e, 2**(e + 1))``
  for ``e = HISTOGRAM_EXPONENTS[i]``.

  Examples:
    >>> import jax.numpy as jnp, jaxscale
    >>> stats = jaxscale.range_stats({"g": jnp.array([1e-9, 3e-6, 1.0])})
    >>> print(f"{stats.zero_fraction:.3f} {stats.subnormal_fraction:.3f}")
    0.333 0.333
    >>> jaxscale.HISTOGRAM_EXPONENTS[stats.histogram > 0]
    array([-30, -19,   0])
  """

  zero_fraction: jax.Array  # shape=(), float32; nonzero finite values that become 0
  subnormal_fraction: jax.Array  # shape=(), float32; values that become subnormal
  overflow_fraction: jax.Array  # shape=(), float32; finite values that become inf/NaN
  min_magnitude: jax.Array  # shape=(), float32; smallest nonzero |x * scale| (inf if none)
  max_magnitude: jax.Array  # shape=(), float32; largest finite-input |x * scale| (0 if none)
  histogram: jax.Array  # shape=(277,), float32; nonzero finite inputs per binade of |x * scale|
  zeros: jax.Array  # shape=(), float32; inputs exactly 0
  nonfinite: jax.Array  # shape=(), float32; inputs inf or NaN
  size: jax.Array  # shape=(), float32; all elements of the floating leaves
  leaves: Any = None  # the input's structure, a RangeStats (leaves=None) per floating leaf


def check_dtype(dtype: Any) -> np.dtype:
  """The target dtype, if a cast to it can be seen to underflow and overflow."""
  try:
    if dtype is None:  # np.dtype(None) is float64
      raise TypeError
    dtype = np.dtype(dtype)
    finfo = jnp.finfo(dtype)
  except (TypeError, ValueError):
    raise ValueError(f"`dtype` must be a floating dtype such as jnp.float16, got {dtype!r}.") from None
  with np.errstate(over="ignore"):
    saturates = np.isfinite((np.array(finfo.max, np.float32) * np.float32(2)).astype(dtype))
  if dtype.itemsize not in (1, 2, 4) or saturates or not finfo.smallest_subnormal or not _ieee_layout(dtype):
    raise ValueError(
        f"`dtype` must be float32 or narrower, with a sign bit, a zero, subnormals and an inf or NaN "
        f"above its largest value for overflow to become (float16, bfloat16, float8_e4m3fn, "
        f"float8_e5m2, ...), got {dtype}. (The `fnuz` formats keep their NaN where -0.0 would be, "
        f"and float8_e8m0fnu has no sign, zero or subnormals: their casts cannot be classified here.)"
    )
  return dtype


def _ieee_layout(dtype: np.dtype) -> bool:
  """Whether ``dtype``'s bits are classified as the counts read them: +0 all zero, a sign bit
  that only negates, and NaN's magnitude above the largest finite one."""
  with np.errstate(all="ignore"):
    probe = np.array([0.0, 1.0, -1.0, np.nan, float(jnp.finfo(dtype).max)], np.float32).astype(dtype)
  bits = probe.view(f"uint{8 * dtype.itemsize}").astype(np.uint64)
  sign = np.uint64(1 << (8 * dtype.itemsize - 1))
  return bool(bits[0] == 0 and bits[2] == bits[1] | sign and (bits[3] & ~sign) > (bits[4] & ~sign))


def magnitude_bits(x: jax.Array) -> jax.Array:
  """|x| as unsigned bits: ordered like |x|, and immune to flush-to-zero arithmetic."""
  bits = jax.lax.bitcast_convert_type(x, jnp.dtype(f"uint{8 * x.dtype.itemsize}"))
  return bits & ~np.array(1 << (8 * x.dtype.itemsize - 1), bits.dtype)


def _nonzero_bits(x: jax.Array) -> jax.Array:
  """``x != 0``, read from the bits, so that a subnormal input is nonzero.

  Tested on the whole word (``magnitude_bits(x) != 0``), LLVM turns the test
  back into a float comparison, which XLA:CPU's flush-to-zero mode answers
  with "zero" for every float32 subnormal input. Its two halves,
  tested apart, are integers to the end.
  """
  if x.dtype.itemsize < 4:
    return magnitude_bits(x) != 0
  half = jnp.dtype(f"uint{4 * x.dtype.itemsize}")
  halves = jax.lax.bitcast_convert_type(x, half)  # shape x.shape + (2,), low half first
  sign = np.array(1 << (4 * x.dtype.itemsize - 1), half)
  return (halves[..., 0] != 0) | ((halves[..., 1] & ~sign) != 0)


def _leaf_counts(x: jax.Array, scale: jax.Array, dtype: np.dtype) -> dict[str, jax.Array]:
  """One leaf's counts: one scatter-add of each element into a (class, binade) table, and a min and a max.

  One scatter rather than a reduction per class: XLA:CPU writes the operand of
  every integer reduction out (its tree-reduction rewrite), a leaf-sized array
  per count.
  """
  if x.size >= 2**31:
    raise ValueError(f"`range_stats` counts each leaf in int32; a leaf of shape {x.shape} is too large: split it.")
  # Classified in the leaf's own dtype: a float64 1e300 is a finite input that overflows, not an inf
  # input, and 1e-300 a nonzero one that underflows, though float32 holds neither.
  finite = jnp.isfinite(x)
  nonzero = finite & _nonzero_bits(x)
  scaled = x.astype(jnp.float32) * scale
  # Every class of the cast is read from its bits: XLA:GPU folds a float32 -> float16 -> float32 round
  # trip away (`xla_allow_excess_precision`), so `isfinite(cast)` there would test `scaled` itself.
  cast_bits = magnitude_bits(scaled.astype(dtype))
  normal_bits = magnitude_bits(jnp.asarray(jnp.finfo(dtype).smallest_normal, dtype))
  max_bits = magnitude_bits(jnp.asarray(jnp.finfo(dtype).max, dtype))  # above it: inf or NaN
  # The table's row: 0 normal, 1 zero, 2 subnormal, 3 overflow, 4 exact 0, 5 non-finite input; each
  # class below overrides those before it (`jnp.select` would write leaf-sized arrays out on CPU).
  row = jnp.zeros(x.shape, jnp.int32)
  for holds, value in [(cast_bits < normal_bits, 2), (cast_bits == 0, 1), (cast_bits > max_bits, 3),
                       (~nonzero, 4), (~finite, 5)]:
    row = jnp.where(holds, value, row)
  bits = magnitude_bits(scaled).astype(jnp.int32)  # float32 magnitudes fit in int32
  # Subnormal float32: value = mantissa * 2**-149, so floor(log2) = -149 + (31 - clz(mantissa)).
  exponent = jnp.where(bits >= 1 << 23, (bits >> 23) - 127, 31 - jax.lax.clz(bits) - 149)
  # A product that leaves float32's range (0 or inf) lands in the end bin on its side.
  index = row * NBINS + jnp.clip(exponent, -149, 127) + 149
  table = jnp.zeros(6 * NBINS, jnp.int32).at[index.ravel()].add(1).reshape(6, NBINS)
  as_float = lambda b: jax.lax.bitcast_convert_type(b, jnp.float32)
  return {
      "zero": table[1].sum(),
      "subnormal": table[2].sum(),
      "overflow": table[3].sum(),
      "min": as_float(jnp.min(jnp.where(nonzero & (bits != 0), bits, 0x7F800000), initial=0x7F800000)),
      "max": as_float(jnp.max(jnp.where(nonzero, bits, 0), initial=0)),
      "histogram": table[:4].sum(0),
      "zeros": table[4].sum(),
      "nonfinite": table[5].sum(),
      "size": jnp.asarray(x.size, jnp.int32),
  }


def _stats(counts: dict[str, jax.Array], leaves: Any = None) -> RangeStats:
  count = counts["size"].astype(jnp.float32)
  fraction = lambda k: jnp.where(count > 0, counts[k].astype(jnp.float32) / jnp.maximum(count, 1), 0.0)
  return RangeStats(
      zero_fraction=fraction("zero"),
      subnormal_fraction=fraction("subnormal"),
      overflow_fraction=fraction("overflow"),
      min_magnitude=counts["min"],
      max_magnitude=counts["max"],
      histogram=counts["histogram"].astype(jnp.float32),
      zeros=counts["zeros"].astype(jnp.float32),
      nonfinite=counts["nonfinite"].astype(jnp.float32),
      size=count,
      leaves=leaves,
  )


def _is_floating(x: Any) -> bool:
  return _tree.is_floating(x, real=True)


@functools.partial(jax.jit, static_argnames=("dtype",))
def stats_at_scale(tree: Any, scale: jax.Array, dtype: np.dtype) -> RangeStats:
  """`range_stats` of a checked dtype, the scale an array: one compilation whatever its value."""
  leaves, treedef = jax.tree.flatten(tree)
  per_leaf = [_leaf_counts(jnp.asarray(x), scale, dtype) if _is_floating(x) else None for x in leaves]
  present = [c for c in per_leaf if c is not None]
  if present:
    stacked = {k: jnp.stack([c[k] for c in present]) for k in present[0]}
    # float32 sums: a whole model may hold more than 2**31 elements.
    total = {k: jnp.sum(v.astype(jnp.float32), axis=0) for k, v in stacked.items() if k not in ("min", "max")}
    total.update(min=jnp.min(stacked["min"]), max=jnp.max(stacked["max"]))
  else:
    total = {k: jnp.zeros((), jnp.float32)
             for k in ("zero", "subnormal", "overflow", "max", "zeros", "nonfinite", "size")}
    total.update(min=jnp.asarray(jnp.inf, jnp.float32), histogram=jnp.zeros(NBINS, jnp.float32))
  detail = [None if c is None else _stats(c) for c in per_leaf]
  return _stats(total, jax.tree.unflatten(treedef, detail))


def range_stats(
    tree: Any, *, scale: jax.typing.ArrayLike = 1.0, dtype: jax.typing.DTypeLike = jnp.float16
) -> RangeStats:
  """What multiplying ``tree`` by ``scale`` and casting it to ``dtype`` does.

  Jittable, with no host sync: call it inside the training step (every N steps
  under ``jax.lax.cond``, or on the gradients you return) or on its own; it
  compiles once per tree structure and dtype (``scale`` may change freely).
  Its cost per leaf is one scatter-add of every element into a table of
  6 classes by 277 binades, and a min and a max: on XLA:CPU a 10M-element
  float32 leaf takes four leaf-sized int32 temporaries (the scatter's
  indices and ones, the min's and the max's operands).

  Each floating leaf is cast to float32, multiplied by ``scale`` in float32,
  and cast to ``dtype``; the classes are those of that cast, rounding to
  nearest even exactly as the device does:

  * ``zero_fraction``: nonzero finite values that become 0 (for float16, those
    with ``|x * scale| <= 2**-25``: exactly ``2**-25`` is a tie and rounds to
    the even 0).
  * ``subnormal_fraction``: values that become subnormal (nonzero, below
    ``finfo(dtype).smallest_normal``, 2**-14 for float16).
  * ``overflow_fraction``: finite values that become non-finite: inf for
    float16, bfloat16 and float8_e5m2 (for float16, ``|x * scale| >= 65520``;
    just below it rounds to the largest finite 65504); NaN for float8_e4m3fn,
    which has no inf (``|x * scale| > 464``; up to 464 rounds to 448).

  The denominator of every fraction is ``size``, all elements of the
  floating leaves. Non-finite inputs (an inf or NaN already there) are
  counted in ``nonfinite`` and in nothing else: they are not overflow of the
  cast, and no scale would change them. Exact zeros are counted in ``zeros``.
  Integer and other non-floating leaves are ignored. The product is the
  device's own float32 multiply: where it flushes float32 subnormals to zero
  (XLA does on CPUs), so do the statistics; this only
  matters for bfloat16, whose subnormals lie below float32's normals.

  Args:
    tree: a pytree of arrays: gradients (scaled or not), activations, taps.
    scale: the factor to apply first, e.g. a loss scale; a float32 scalar.
    dtype: the target dtype: float16, bfloat16, float8_e4m3fn, float8_e5m2,
      float32 or another narrow float with subnormals and an inf or NaN.

  Returns:
    A :class:`RangeStats` over all elements, whose ``leaves`` field has the
    structure of ``tree`` with a ``RangeStats`` (``leaves=None``) in place of
    each floating leaf (None for the others). ``histogram[i]`` counts the
    nonzero finite inputs with ``|x * scale|`` in
    ``[2**e, 2**(e + 1))``, ``e = HISTOGRAM_EXPONENTS[i]``; products beyond
    float32's range are counted in the end bins. So
    ``histogram.sum() + zeros + nonfinite == size``.

  Raises:
    ValueError: if ``dtype`` is not such a floating dtype, or ``scale`` is
      not a scalar.

  Examples:
    >>> import jax.numpy as jnp, jaxscale
    >>> grads = {"w": jnp.array([1e-9, 1e-6, 0.5, 0.0]), "b": jnp.array([7e4, jnp.nan])}
    >>> stats = jaxscale.range_stats(grads)
    >>> float(stats.zero_fraction), float(stats.subnormal_fraction), float(stats.overflow_fraction)
    (0.1666..., 0.1666..., 0.1666...)
    >>> float(stats.leaves["w"].zero_fraction), int(stats.zeros), int(stats.nonfinite)
    (0.25, 1, 1)
    >>> float(jaxscale.range_stats(grads, scale=1024.0).zero_fraction)
    0.0
  """
  if isinstance(scale, tuple):  # a ScalerState (a NamedTuple) would read as an array of its fields
    raise TypeError(
        f"`scale` must be a number or a scalar array, got a {type(scale).__name__}; for a scaler's "
        "scale pass `scaler.scale` (`jaxscale.find_scaler(opt_state).scale`)."
    )
  # A float32 array whatever was given, so that 1.0 and jnp.float32(1.0) share one compilation.
  scale = jnp.asarray(scale, jnp.float32)
  if scale.shape:
    raise ValueError(f"`scale` must be a scalar, got an array of shape {scale.shape}.")
  return stats_at_scale(tree, scale, check_dtype(dtype))


def format_range_stats(stats: RangeStats | dict[str, RangeStats]) -> str:
  """A Markdown table of ``stats``: one row per leaf (or per tap) and a total.

  Reads the arrays on the host: call it outside the jitted step.

  Args:
    stats: a :class:`RangeStats` (its ``leaves`` give the rows), or a dict
      of them (tap statistics, or one row per run).

  Returns:
    The table, a ``str``: path, elements, % that become zero / subnormal /
    overflow, % exact zeros and non-finite inputs, and min / max ``|x * scale|``.

  Examples:
    >>> import jax.numpy as jnp, jaxscale
    >>> grads = {"b": jnp.array([1e-9, 0.5]), "w": jnp.array([3e-6, 7e4])}
    >>> print(jaxscale.format_range_stats(jaxscale.range_stats(grads)))
    | leaf | elements | zero % | subnormal % | overflow % | exact 0 % | non-finite % | min abs | max abs |
    |---|---|---|---|---|---|---|---|---|
    | ['b'] | 2 | 50.00 | 0.00 | 0.00 | 0.00 | 0.00 | 1e-09 | 0.5 |
    | ['w'] | 2 | 0.00 | 50.00 | 50.00 | 0.00 | 0.00 | 3e-06 | 7e+04 |
    | total | 4 | 25.00 | 25.00 | 25.00 | 0.00 | 0.00 | 1e-09 | 7e+04 |
  """
  if isinstance(stats, RangeStats):
    rows = jax.tree_util.tree_flatten_with_path(stats.leaves, is_leaf=lambda s: isinstance(s, RangeStats))[0]
    rows = [(jax.tree_util.keystr(path), s) for path, s in rows] + [("total", stats)]
    first = "leaf"
  else:
    rows, first = list(stats.items()), "name"
  lines = [
      f"| {first} | elements | zero % | subnormal % | overflow % | exact 0 % | non-finite % | min abs | max abs |",
      "|---|---|---|---|---|---|---|---|---|",
  ]
  for name, s in rows:
    s = jax.device_get(s)
    count = max(float(s.size), 1.0)
    percents = [100 * float(f) for f in (s.zero_fraction, s.subnormal_fraction, s.overflow_fraction)]
    percents += [100 * float(s.zeros) / count, 100 * float(s.nonfinite) / count]
    low = "-" if np.isinf(s.min_magnitude) else f"{float(s.min_magnitude):.3g}"
    high = "-" if not s.max_magnitude else f"{float(s.max_magnitude):.3g}"
    lines.append(f"| {name} | {int(s.size)} | " + " | ".join(f"{p:.2f}" for p in percents) + f" | {low} | {high} |")
  return "\n".join(lines)
