"""A start scale that skips nothing: the largest safe power of two, from one probe step.

Every peer starts its loss scale at a fixed guess (torch and Flax 2**16, Keras
2**15, Megatron-LM 2**32) and skips steps while it backs off into range. The
gradients of one step say where that range is::

    m = max |g| over the (unscaled) gradients and tapped activation gradients
    scale = 2**floor(log2(max_finite(dtype) / m)) / headroom

:func:`suggest_scale` does this for a pytree; :func:`probe_scale` runs the
probe step, then a second one at the scale found, to report what underflows
there.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.core import Tracer

from jaxscale import _numerics, _range, _taps, _tree

DEFAULT_HEADROOM = 8.0
_FALLBACK_SCALE = 2.0**16  # torch's init_scale, when the gradients say nothing


def _max_magnitude(tree: Any) -> jax.Array:
  """Largest |x| over the finite elements of the floating leaves, as float32 bits (int32).

  A :class:`RangeStats` in the tree (tap statistics) counts with its ``max_magnitude``.
  """
  maxima = [jnp.zeros((), jnp.int32)]
  for x in jax.tree.leaves(tree, is_leaf=lambda x: isinstance(x, _range.RangeStats)):
    if isinstance(x, _range.RangeStats):
      maxima.append(jax.lax.bitcast_convert_type(x.max_magnitude, jnp.int32))
    elif _tree.is_floating(x, real=True):
      x = jnp.asarray(x)
      # Finite in its own dtype: a float64 1e300 must shrink the scale, though float32 holds it as inf.
      bits = _range.magnitude_bits(x.astype(jnp.float32)).astype(jnp.int32)
      maxima.append(jnp.max(jnp.where(jnp.isfinite(x), bits, 0), initial=0))
  return jnp.max(jnp.stack(maxima))


def _check_headroom(headroom: float) -> int:
  try:  # a Python, NumPy or concrete JAX number; not a string, a bool or a tracer
    value = float(headroom) if np.issubdtype(np.asarray(headroom).dtype, np.number) else 0.0
  except TypeError:
    value = 0.0
  exponent = np.log2(value) if 1 <= value < np.inf else 0.5
  if exponent != int(exponent):
    raise ValueError(f"`headroom` must be a power of two >= 1 (such as 8.0), got {headroom!r}.")
  return int(exponent)


def _scale_for(bits: jax.Array, dtype: np.dtype, headroom: int) -> jax.Array:
  """2**k for the largest k with m * 2**k <= max finite, over 2**headroom; m's float32 bits in."""
  top = int(np.array(jnp.finfo(dtype).max, np.float32).view(np.int32))
  # m = (1 + mantissa) * 2**exponent; m * 2**k <= top iff k <= top's exponent - m's, less one
  # when m's mantissa is the larger. Float32 subnormal maxima count as 2**-127: the clip decides.
  exponent = jnp.maximum(bits >> 23, 0) - 127
  k = (top >> 23) - 127 - exponent - ((bits & 0x7FFFFF) > (top & 0x7FFFFF)).astype(jnp.int32) - headroom
  k = jnp.where(bits >= 0x7F800000, -126, k)  # beyond float32's range (a float64 leaf): the smallest
  scale = _numerics.power_of_two(jnp.clip(k, -126, 127))
  return jnp.where(bits > 0, scale, jnp.float32(_FALLBACK_SCALE))


def suggest_scale(
    tree: Any, *, dtype: jax.typing.DTypeLike = jnp.float16, headroom: float = DEFAULT_HEADROOM
) -> jax.Array:
  """The largest power-of-two loss scale at which no element of ``tree`` overflows, over ``headroom``.

  ``tree`` holds unscaled gradients: parameter gradients, and activation
  gradients or the :class:`RangeStats` that :func:`tap` collected for them
  (each counts with its ``max_magnitude``); :func:`probe_scale` does it all. At the returned scale ``s``,
  ``max |x| * s * headroom <= finfo(dtype).max``, and ``2 * s * headroom``
  would exceed it (overflow, or within the last half ulp below 65520 for
  float16, round down onto 65504). The default headroom of 2**3 leaves room for gradients
  8 times larger than the probe's (later batches, the first updates, the
  activation gradients nobody tapped) at the cost of 3 binades at the small
  end; a larger spike is one skipped step per halving, as usual.

  Non-finite elements are ignored (no scale would make them finite; the
  scaler skips such a step whatever its scale). A tree with no nonzero finite
  element says nothing, and gives 2**16, torch's default start. The result
  is clipped to float32's normal powers of two, 2**-126 to 2**127.

  Args:
    tree: a pytree of unscaled gradients and tap statistics (non-floating
      leaves are ignored).
    dtype: the dtype the scaled gradients must fit (static).
    headroom: a power of two >= 1 to divide the largest safe scale by.

  Returns:
    The scale, a float32 scalar array (jittable: no host sync).

  Raises:
    ValueError: if ``headroom`` is not a power of two >= 1, or ``dtype`` not
      a narrow floating dtype.

  Examples:
    >>> import jax.numpy as jnp, jaxscale
    >>> grads = {"w": jnp.array([3e-3, -1.0e-6]), "b": jnp.array([2.0])}
    >>> jaxscale.suggest_scale(grads)  # 2 * 2**14 <= 65504 < 2 * 2**15
    Array(2048., dtype=float32)
    >>> jaxscale.suggest_scale(grads, headroom=1)
    Array(16384., dtype=float32)
    >>> jaxscale.suggest_scale(grads, dtype=jnp.bfloat16)
    Array(1.0633824e+37, dtype=float32)
  """
  return _scale_for(_max_magnitude(tree), _range.check_dtype(dtype), _check_headroom(headroom))


class ProbeResult(NamedTuple):
  """What :func:`probe_scale` found; all arrays.

  Examples:
    >>> import jax.numpy as jnp, jaxscale
    >>> probe = jaxscale.probe_scale(lambda w: jnp.sum(w * 1e-3), jnp.ones(4))
    >>> float(probe.scale), float(probe.max_magnitude), float(probe.stats.zero_fraction)  # 2**25 * 1e-3 < 65504, over 8
    (4194304.0, 0.0010000000474974513, 0.0)
  """

  scale: jax.Array  # shape=(), float32; the suggested start scale
  stats: _range.RangeStats  # the parameter gradients at `scale`, cast to the dtype
  taps: dict[str, _range.RangeStats]  # each tap's activation gradients at `scale`
  max_magnitude: jax.Array  # shape=(), float32; largest unscaled |gradient|, taps included


def _check_taps(names: list[str], seen: set[str], stats: dict[str, _range.RangeStats]) -> None:
  """Raises if a named tap is not in ``loss_fn``: its statistics would read as all zero.

  The names are those ``tap`` was called with while ``loss_fn`` was traced; a
  ``loss_fn`` jitted on its own and already traced calls no ``tap``, so there
  the statistics' ``size`` decides where it is known (eagerly).
  """
  missing = [n for n in names if n not in seen]
  if missing and not seen:
    missing = [n for n in missing if not isinstance(stats[n].size, Tracer) and float(stats[n].size) == 0]
  if missing:
    raise ValueError(
        f"`probe_scale` was given taps {missing} that `loss_fn` never taps; the `jaxscale.tap` names "
        f"it calls are {sorted(seen) if seen else 'none'}. Check the spelling, and that `loss_fn` "
        "passes its `taps` argument on to `jaxscale.tap`."
    )


def probe_scale(
    loss_fn: Callable[..., jax.Array],
    params: Any,
    *args: Any,
    taps: Iterable[str] = (),
    dtype: jax.typing.DTypeLike = jnp.float16,
    headroom: float = DEFAULT_HEADROOM,
    grad: Callable[..., Callable[..., Any]] = jax.grad,
) -> ProbeResult:
  """One probe step of the real loss on a real batch: a start scale and what underflows at it.

  Differentiates ``loss_fn(params, *args)`` (with ``taps=tap_probes(taps)``
  as a keyword when ``taps`` are named) once unscaled, takes
  :func:`suggest_scale` of the parameter and tapped activation gradients,
  and differentiates again with the loss multiplied by that scale to report
  :func:`range_stats` of both there. Run the probe in float32 to see what
  float16 would do at each scale; in float16 it is the real thing (but an
  unscaled float16 pass may already have lost its small gradients, which do
  not decide the scale). A 16-bit loss caps the scale further: the scaled
  loss, and the scale (its cotangent), are held in the loss's own dtype, so
  ``max(|loss|, 1) * scale * headroom`` must fit there too (return a
  float32 loss, as ``mixed_float16`` does, to avoid it).

  Traceable: call it under ``jax.jit`` (``nnx.jit`` for NNX) to compile it
  once. Eagerly it runs op by op.

  Args:
    loss_fn: ``loss_fn(params, *args[, taps=probes])`` returning a scalar loss.
    params: what to differentiate: a pytree of parameters, or an NNX module
      with ``grad=nnx.grad``.
    *args: the batch and anything else ``loss_fn`` takes.
    taps: the names of the :func:`tap` calls in ``loss_fn`` to take into
      account; empty: ``loss_fn`` is called without ``taps``.
    dtype: the dtype of the scaled gradients (float16 unless told).
    headroom: as in :func:`suggest_scale`.
    grad: the differentiation to use (``jax.grad``, ``nnx.grad``).

  Raises:
    TypeError: if ``taps`` is a single string rather than a list of names.
    ValueError: if a name in ``taps`` is not tapped by ``loss_fn``.

  Returns:
    A :class:`ProbeResult`; pass ``float(result.scale)`` as ``init_scale``
    to :func:`jaxscale.dynamic_loss_scaling` or :func:`jaxscale.init`.

  Examples:
    >>> import jax, jax.numpy as jnp, optax, jaxscale
    >>> def loss_fn(w, x, taps=None):
    ...   h = jaxscale.tap(jnp.tanh(x @ w), taps, "hidden")
    ...   return jnp.mean(h ** 2) * 1e-9  # gradients ~1e-10: all zero in float16
    >>> w, x = jnp.full((4, 3), 0.1), jnp.ones((8, 4))
    >>> float(jaxscale.range_stats(jax.grad(loss_fn)(w, x)).zero_fraction)
    1.0
    >>> probe = jaxscale.probe_scale(loss_fn, w, x, taps=["hidden"])
    >>> float(probe.scale) == 2.0**45, float(probe.stats.zero_fraction), float(probe.taps["hidden"].zero_fraction)
    (True, 0.0, 0.0)
    >>> tx = jaxscale.dynamic_loss_scaling(optax.sgd(0.1), init_scale=float(probe.scale))
  """
  dtype = _range.check_dtype(dtype)
  headroom_exponent = _check_headroom(headroom)
  if isinstance(taps, str):
    raise TypeError(f"`taps` must be a list of tap names, got the single string {taps!r}; pass [{taps!r}].")
  names = list(taps)
  probes = _taps.tap_probes(names) if names else None

  def measure(scale):
    def scaled_loss(params, probes):
      loss = loss_fn(params, *args, **({} if probes is None else {"taps": probes}))
      return loss * jnp.asarray(scale, loss.dtype), loss

    if probes is None:
      grads, loss = grad(scaled_loss, has_aux=True)(params, None)
      return (grads, {}), loss
    return grad(scaled_loss, argnums=(0, 1), has_aux=True)(params, probes)

  with _taps.recording() as seen:
    gradients, loss = measure(1.0)
  _check_taps(names, seen, gradients[1])
  bits = _max_magnitude(gradients)
  scale = _scale_for(bits, dtype, headroom_exponent)
  loss_dtype = jnp.dtype(loss.dtype)
  if jnp.finfo(loss_dtype).bits < 32:
    # A 16-bit loss is scaled in its own dtype, and the scale is its cotangent: both must fit there.
    seed = _max_magnitude([jnp.abs(loss).astype(jnp.float32), jnp.float32(1.0)])
    scale = jnp.minimum(scale, _scale_for(seed, _range.check_dtype(loss_dtype), headroom_exponent))
  scaled_grads, scaled_taps = measure(scale)[0]
  return ProbeResult(
      scale=scale,
      stats=_range.range_stats(scaled_grads, dtype=dtype),
      taps=scaled_taps,
      max_magnitude=jax.lax.bitcast_convert_type(bits, jnp.float32),
  )
