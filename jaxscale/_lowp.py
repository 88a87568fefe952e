"""Low-precision optimizer state: ``inner``'s floating state stored in 16 bits.

Adam keeps two float32 moments per parameter, 8 of the 12 bytes of float32
training. ``low_precision_state(inner, dtype=...)`` stores every floating
state leaf of one or more dimensions as 16-bit values times a float32
power-of-two scale per tensor, and runs ``inner`` in float32 in between::

    state32 = values * scale                           # exact: scale is 2**k
    updates, state32 = inner.update(grads, state32, params)
    scale = 2**(floor(log2(max|state32|)) - 14)        # float16; 1 for bfloat16
    values = stochastic_round(state32 / scale, dtype)  # unbiased, from a key

Why each piece (benchmarks/NOTES.md #20 has the measurements):

- Stochastic rounding: Adam's second moment moves by ``1 - b2`` = 0.1% a step,
  below bfloat16's resolution (0.4%): rounded to nearest, a moment that should
  decay stays where it is and the step size with it. Rounded at random it
  decays on average, as the float32 one does.
- The per-tensor scale, for float16 only: float16 spans 2**-24..65504 and a
  second moment of gradients of 1e-4 is 1e-8; scaled so that its largest
  element sits just below 2**15, a tensor keeps 29 binades of normal numbers
  below it. bfloat16 has float32's range and needs none (and skipping the
  reduction keeps the compiled step's temporaries smaller).
- Scalars (counts, hyperparameters, the scaler's state) and non-floating
  leaves stay as they are: they cost nothing and must stay exact.

A step that a ``dynamic_loss_scaling`` inside or outside skips leaves the
stored state and the key bit for bit as they were.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from jaxscale import _master, _optax, _policy, _skip, _tree

DTYPES = ("float16", "bfloat16")

# Headroom: the largest element stored is below 2**(_TOP + 1), so stochastic rounding up by an ulp
# stays finite in float16 (65504 < 2**16).
_TOP = 14

# State types whose floating leaves are copies of the parameters (or anchors built from them):
# 16 bits lose every update below half their ulp, the failure `master_weights` exists for.
REFUSED = {
    "COCOBState": "`optax.contrib.cocob` keeps the initial parameters `init_particles`",
    "DoGState": "`optax.contrib.dog` keeps the initial parameters `init_params`",
    "DoWGState": "`optax.contrib.dowg` keeps the initial parameters `init_params`",
    "MasterWeightsState": (
        "`master_weights` keeps the float32 master copy of the parameters (nest them the other way "
        "round: `master_weights(dynamic_loss_scaling(low_precision_state(inner)))`)"
    ),
    "MadgradState": "`optax.contrib.madgrad` keeps the initial parameters `x0`",
    "MechanicState": "`optax.contrib.mechanize` keeps the initial parameters `x0`",
    "ProdigyState": "`optax.contrib.prodigy` keeps the initial parameters `params0`",
    "SAMState": "`optax.contrib.sam` keeps the parameters before its adversarial steps in `cache`",
    "ScaleByDistanceOverGradientsState": "`optax.scale_by_distance_over_gradients` keeps the initial parameters `init_params`",
    "ScaleByLBFGSState": "`optax.lbfgs` keeps the previous parameters `params`",
    "ScheduleFreeState": "`optax.contrib.schedule_free` keeps the parameters' average `z`",
}


class LowPrecisionArray(NamedTuple):
  """One stored state leaf: ``values * scale`` is its float32 value."""

  values: jax.Array  # like the leaf, dtype float16 or bfloat16
  scale: jax.Array  # shape=(), dtype=float32; a power of two


class LowPrecisionState(NamedTuple):
  """State of :func:`low_precision_state`.

  Examples:
    >>> import jax.numpy as jnp, optax, jaxscale
    >>> state = jaxscale.low_precision_state(optax.adam(1e-3)).init(jnp.zeros(3))
    >>> state.inner_state[0].mu.values.dtype, state.inner_state[0].count.dtype
    (dtype(bfloat16), dtype('int32'))
  """

  inner_state: optax.OptState  # inner's state, each stored leaf a `LowPrecisionArray`
  key: jax.Array  # shape=(2,), dtype=uint32; a raw PRNG key, split once per step


def low_precision_state(
    inner: optax.GradientTransformation,
    *,
    dtype: Any = jnp.bfloat16,
    key: int | jax.Array = 0,
) -> optax.GradientTransformationExtraArgs:
  """Stores ``inner``'s floating state in ``dtype``: 2 bytes per element instead of 4.

  Every floating state leaf with at least one dimension (Adam's moments,
  momentum, accumulated gradients, ...) is stored as 16-bit values times a
  float32 power-of-two scale per tensor (float16; bfloat16 needs none),
  rounded stochastically from a PRNG key held in the state; ``inner`` runs in float32 on the decoded state.
  Scalars and integer leaves (counts, hyperparameters) are not touched.

  The stored value is unbiased: its expectation is the float32 state, and
  each element is within one ulp of it (relative 2**-7 for bfloat16, 2**-10
  for float16, on elements within 2**-14 of their tensor's largest; smaller
  float16 elements down to 2**-24 of it are subnormal, with the absolute error
  of its smallest ulp). The rounding noise does not accumulate: a moment with
  decay ``b`` carries about ``1 / sqrt(1 - b**2)`` steps of it.

  Compose it inside the scaler, and the scaler inside ``master_weights``:
  ``master_weights(dynamic_loss_scaling(low_precision_state(adam)), method="kahan")``
  is 16-bit parameters and state, 8 bytes per parameter in all.

  Args:
    inner: the optimizer whose state to store.
    dtype: ``jnp.bfloat16`` (the default) or ``jnp.float16``.
    key: the seed of the stochastic rounding, an int or a PRNG key.

  Returns:
    An ``optax.GradientTransformationExtraArgs`` whose state is a
    :class:`LowPrecisionState`.

  Raises:
    ValueError: for another ``dtype``; from ``init``, for an optimizer whose
      state holds a copy of the parameters, which 16 bits cannot carry:
      ``optax.contrib``'s schedule_free, sam, cocob, dog, dowg, madgrad,
      mechanize and prodigy, ``optax.lbfgs``,
      ``optax.scale_by_distance_over_gradients``, and ``master_weights``.

  Examples:
    >>> import jax.numpy as jnp, optax, jaxscale
    >>> tx = jaxscale.low_precision_state(optax.adam(1e-3))
    >>> params = jnp.ones(3)
    >>> state = tx.init(params)
    >>> updates, state = tx.update(jnp.ones(3), state, params)
    >>> updates  # Adam's first step, as in float32: -lr * g / (|g| + eps)
    Array([-0.00099999, -0.00099999, -0.00099999], dtype=float32)
    >>> state.inner_state[0].nu  # 16-bit values times a scale (1 in bfloat16, which has float32's range)
    LowPrecisionArray(values=Array([0.000999451, 0.000999451, 0.000999451], dtype=bfloat16), scale=Array(1., dtype=float32))
  """
  name = jnp.dtype(dtype).name if _is_dtype(dtype) else None
  if name not in DTYPES:
    raise ValueError(
        f"`low_precision_state` got dtype={dtype!r}; use jnp.bfloat16 or jnp.float16."
    )
  dtype = jnp.dtype(name)
  _optax.require_transformation(inner, "low_precision_state")
  inner = optax.with_extra_args_support(inner)
  seed = _master._raw_key(key, "low_precision_state") if not isinstance(key, int) else None

  def init_fn(params):
    inner_state = inner.init(params)
    _refuse_parameter_copies(inner_state)
    raw = seed if seed is not None else jax.random.PRNGKey(key)
    return LowPrecisionState(_encode(inner_state, dtype, raw), raw)

  def update_fn(updates, state, params=None, **extra_args):
    template = jax.eval_shape(inner.init, params) if params is not None else None
    inner_state = _decode(state.inner_state, template)
    updates, new_inner = inner.update(updates, inner_state, params, **extra_args)
    key, draw = jax.random.split(state.key)
    stored = _encode(new_inner, dtype, draw)
    # A scaler inside `inner` skipped: keep the stored state and the key, bit for bit.
    skipped = _skip.skipped_inside(new_inner)
    # (Only what this wrapper stores: the scaler's own state has moved on.)
    keep = lambda old, new: jnp.where(skipped, old, new)
    stored = jax.tree.map(
        lambda old, new: jax.tree.map(keep, old, new) if _is_array(new) else new,
        state.inner_state, stored, is_leaf=_is_array,
    )
    return updates, LowPrecisionState(stored, keep(state.key, key))

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def _is_dtype(dtype) -> bool:
  try:
    jnp.dtype(dtype)
  except TypeError:
    return False
  return True


def _stored(x) -> bool:
  """Whether a state leaf is stored in low precision: floating, wider than 16 bits, not a scalar."""
  return _policy.is_floating_array(x) and jnp.finfo(x.dtype).bits > 16 and x.ndim > 0 and x.size > 0


def _is_array(x) -> bool:
  return isinstance(x, LowPrecisionArray)


def _encode(tree, dtype, key):
  # An NNX Variable holds one array: the Variable goes around the stored values, not around the
  # LowPrecisionArray, whose two arrays `nnx.Optimizer` would write back into it as a State.
  leaves, treedef = jax.tree.flatten(tree, is_leaf=_tree.is_variable)
  out = [
      _encode_variable(x, dtype, jax.random.fold_in(key, i)) if _stored(_tree.unwrap_variable(x)) else x
      for i, x in enumerate(leaves)
  ]
  return jax.tree.unflatten(treedef, out)


def _encode_variable(x, dtype, key) -> LowPrecisionArray:
  """`_encode_leaf` of an array or of an NNX Variable's value; a Variable keeps the values."""
  stored = _encode_leaf(_tree.unwrap_variable(x), dtype, key)
  return stored._replace(values=_like(x, stored.values))


def _like(x, value):
  """``value`` in a Variable like ``x`` (same type and metadata) if ``x`` is an NNX Variable, else ``value``."""
  return jax.tree.map(lambda _: value, x) if _tree.is_variable(x) else value


def _encode_leaf(x: jax.Array, dtype, key) -> LowPrecisionArray:
  x = x.astype(jnp.float32)
  if dtype == jnp.bfloat16:
    # bfloat16 has float32's range: no scale, so no reduction over the new state before it is
    # stored, which would keep it in float32 in between (24 -> 8 bytes per parameter of
    # temporaries in a compiled Adam step, NOTES.md #20).
    scale = jnp.float32(1)
  else:
    biggest = jnp.max(jnp.abs(x))
    _, e = jnp.frexp(biggest)  # biggest = m * 2**e, 0.5 <= m < 1
    # A zero or non-finite tensor keeps scale 1 (inf and NaN are stored as they are).
    e = jnp.where((biggest > 0) & jnp.isfinite(biggest), e - 1 - _TOP, 0)
    scale = jnp.ldexp(jnp.float32(1), e)
  scaled = x / scale  # exact: a power of two, and no result below float32's normals that matters
  uniform = _master._uniform(key, x.shape)
  finite = jnp.isfinite(scaled)
  rounded = _master._stochastic_round(jnp.where(finite, scaled, 0), dtype, uniform)
  return LowPrecisionArray(jnp.where(finite, rounded, scaled.astype(dtype)), scale)


def _decode(tree, template):
  """The float32 (or the template's dtype) state from the stored one.

  Zipped leaf by leaf, not by structure: each stored leaf is one leaf of the
  template, which an NNX Variable around the values moves into the
  `LowPrecisionArray` (and `nnx.Optimizer` hands ``update`` no Variables at all).
  """
  leaves, treedef = jax.tree.flatten(tree, is_leaf=_is_array)
  likes = [None] * len(leaves) if template is None else jax.tree.leaves(template)

  def decode(x, like):
    if not _is_array(x):
      return x
    value = _tree.unwrap_variable(x.values).astype(jnp.float32) * x.scale
    return _like(x.values, value if like is None else value.astype(like.dtype))

  return jax.tree.unflatten(treedef, [decode(x, like) for x, like in zip(leaves, likes, strict=True)])


def _refuse_parameter_copies(inner_state) -> None:
  types = {type(x).__name__ for x in jax.tree.leaves(inner_state, is_leaf=lambda x: type(x).__name__ in REFUSED)}
  for name in sorted(types & REFUSED.keys()):
    raise ValueError(
        f"`low_precision_state` cannot hold a {name}: {REFUSED[name]}, and in 16 bits every update "
        "below half its ulp would vanish. Leave this optimizer's state in float32 (apply "
        "`low_precision_state` to the other parts of an `optax.chain` only)."
    )
