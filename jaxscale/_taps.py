"""Activation-gradient taps: range statistics of the cotangents flowing between layers.

Parameter gradients under-report underflow: it starts in the gradients of the
activations, which the backward pass computes and discards. A tap is an
identity on an activation whose derivative is the identity too, except that it
also writes :func:`range_stats` of the cotangent it passes on into the
gradient of a small "probe" argument::

    forward:  tap(x, probes, name) = x
    backward: dL/dx passes through unchanged; dL/dprobes[name] = range_stats(dL/dx)

so ``jax.grad`` with respect to the probes returns the statistics. With
``probes=None`` (or a name not in ``probes``) a tap is a plain identity: it
adds nothing to the computation, compiled or not.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
from collections.abc import Iterable, Iterator, Mapping

import jax
import jax.numpy as jnp
import numpy as np

from jaxscale import _range


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _tap(x: jax.Array, probe: _range.RangeStats, dtype: np.dtype) -> jax.Array:
  del probe, dtype
  return x


def _tap_fwd(x, probe, dtype):
  del probe, dtype
  return x, None


def _tap_bwd(dtype, residual, cotangent):
  del residual
  return cotangent, _range.stats_at_scale(cotangent, jnp.ones((), jnp.float32), dtype)._replace(leaves=None)


_tap.defvjp(_tap_fwd, _tap_bwd)

# The name sets of the `recording` blocks in progress, innermost last: `tap` adds its name to each
# (at trace time), so that `probe_scale` can tell a misspelt tap from one that saw only zeros. A
# dynamic scope, as `_scaler.uses_here`: what a block records depends on the calls inside it,
# never on what ran before, in this thread or another.
_recording: contextvars.ContextVar[tuple[set[str], ...]] = contextvars.ContextVar("jaxscale_recording", default=())


@contextlib.contextmanager
def recording() -> Iterator[set[str]]:
  """Collects the names of the :func:`tap` calls made inside the block."""
  names: set[str] = set()
  token = _recording.set((*_recording.get(), names))
  try:
    yield names
  finally:
    _recording.reset(token)


def tap_probes(names: Iterable[str]) -> dict[str, _range.RangeStats]:
  """The probes for :func:`tap`: a dict from each name to an all-zero :class:`RangeStats`.

  Pass them into the loss next to the parameters and differentiate with
  respect to them too: their gradient is the tapped statistics. Their values
  are never read.

  Args:
    names: the names given to :func:`tap` at the activations to watch.

  Returns:
    ``{name: RangeStats of zeros}``, a pytree of small float32 arrays.

  Examples:
    >>> import jaxscale
    >>> probes = jaxscale.tap_probes(["block0", "logits"])
    >>> sorted(probes), probes["block0"].histogram.shape
    (['block0', 'logits'], (277,))
  """
  if isinstance(names, str):
    raise TypeError(f"`names` must be an iterable of tap names, got the single string {names!r}; pass [{names!r}].")
  zero = jnp.zeros((), jnp.float32)
  probe = _range.RangeStats(zero, zero, zero, zero, zero, jnp.zeros(_range.NBINS, jnp.float32), zero, zero, zero)
  return {name: probe for name in names}


def tap(
    x: jax.Array,
    probes: Mapping[str, _range.RangeStats] | None,
    name: str,
    *,
    dtype: jax.typing.DTypeLike = jnp.float16,
) -> jax.Array:
  """Returns ``x``, and records the range of the gradient flowing back into it.

  In the backward pass the cotangent of ``x`` goes on unchanged (forward
  values and all other gradients stay bitwise the same), and
  ``range_stats(cotangent, scale=1.0, dtype=dtype)`` (with ``leaves=None``)
  becomes the gradient of ``probes[name]``. In a scaled backward pass the
  cotangent already carries the loss scale, so the statistics are those of
  the scaled gradients, as float16 sees them.

  Tap each name once per forward pass. Gradients of a probe add up where it
  is used more than once (a layer called twice, a tap inside ``lax.scan`` or
  ``vmap`` with the probes closed over): the counts then add up too
  (``size`` becomes a multiple of ``x.size``), but the fractions and
  magnitudes no longer mean anything. Inside a scan, pass the probes stacked
  along the scanned axis instead, one per iteration. A tap that is on is a
  ``jax.custom_vjp``, which JAX refuses to differentiate in forward mode
  (``jax.jvp``, ``jax.jacfwd``, ``jax.hessian``): pass ``probes=None`` there.

  Args:
    x: an activation (any floating array).
    probes: ``tap_probes(names)``, or None to turn every tap off.
    name: this tap's key in ``probes``. A name not in ``probes`` is not
      tapped, so one model can watch any subset of its taps.
    dtype: the dtype the statistics are taken for (static).

  Returns:
    ``x`` itself.

  Raises:
    TypeError: if ``probes`` is neither None nor a mapping.
    ValueError: if ``dtype`` is not a narrow floating dtype (see
      :func:`range_stats`).

  Examples:
    >>> import jax, jax.numpy as jnp, jaxscale
    >>> def loss(w, x, taps=None):
    ...   h = jaxscale.tap(jnp.tanh(x * w), taps, "hidden")
    ...   return jnp.sum(h) * 1e-9
    >>> probes = jaxscale.tap_probes(["hidden"])
    >>> grad_w, stats = jax.grad(loss, argnums=(0, 2))(2.0, jnp.ones(4), probes)
    >>> float(stats["hidden"].zero_fraction), int(stats["hidden"].size)
    (1.0, 4)
    >>> grad_w == jax.grad(loss)(2.0, jnp.ones(4))
    Array(True, dtype=bool, weak_type=True)
  """
  for names in _recording.get():
    names.add(name)
  if probes is None:
    return x
  if not isinstance(probes, Mapping):
    raise TypeError(f"`probes` must be the dict from `tap_probes(names)` (or None), got {type(probes).__name__}.")
  if name not in probes:
    return x
  return _tap(x, probes[name], _range.check_dtype(dtype))
