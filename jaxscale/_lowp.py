"""Low-precision optimizer state: ``inner``'s floating state stored in bfloat16.

Adam keeps two float32 moments per parameter, 8 of the 12 bytes of float32
training. ``low_precision_state(inner)`` stores every floating state leaf that
``inner.update`` changes (moments, momentum, accumulated gradients; not a
hyperparameter it hands back as it received it) as bfloat16, and runs
``inner`` in float32 in between::

    state32 = float32(values)                         # exact
    updates, state32 = inner.update(grads, state32, params)
    values = stochastic_round(state32, bfloat16)      # unbiased, from a key

Why each piece (benchmarks/NOTES.md has the measurements):

- Stochastic rounding: Adam's second moment moves by ``1 - b2`` = 0.1% a step,
  below bfloat16's resolution (0.4%): rounded to nearest, a moment that should
  decay stays where it is and the step size with it. Rounded at random it
  decays on average, as the float32 one does.
- bfloat16, not float16: its 8-bit exponent holds float32's whole range, so
  every element keeps its own relative precision (2**-8), however far below
  its tensor's largest it lies. float16 holds 40 binades: with one scale per
  tensor, Adam's second moment of a gradient of 1e-6 beside one of 10 (1e-14
  apart) is stored as 0, and that element steps ``1 / eps`` too far; and the
  scale of a tensor decaying below 1e-33 flushed to 0 (``x / 0``: NaN).
  Per-block scales move the boundary (measured), not remove it, so
  float16 is refused.
- Scalars (counts, hyperparameters, the scaler's state), constants that
  ``inner.update`` returns as it received them (``optax.contrib.muon``'s
  Newton-Schulz coefficients) and non-floating leaves stay as they are: they
  cost nothing and must stay exact.

A step that a ``dynamic_loss_scaling`` inside or outside skips leaves the
stored state and the key bit for bit as they were.
"""

from __future__ import annotations

import warnings
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from jaxscale import _optax, _policy, _rounding, _scaler, _skip, _tree

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
    "ScaleByDistanceOverGradientsState": (
        "`optax.scale_by_distance_over_gradients` keeps the initial parameters `init_params`"
    ),
    "ScaleByLBFGSState": "`optax.lbfgs` keeps the previous parameters `params`",
    "ScheduleFreeState": "`optax.contrib.schedule_free` keeps the parameters' average `z`",
}




class LowPrecisionArray(NamedTuple):
  """One stored state leaf: its float32 value rounded stochastically to bfloat16."""

  values: jax.Array  # like the leaf, dtype bfloat16


class LowPrecisionState(NamedTuple):
  """State of :func:`low_precision_state`.

  Examples:
    >>> import jax.numpy as jnp, optax, jaxscale
    >>> state = jaxscale.low_precision_state(optax.adam(1e-3)).init(jnp.zeros(3))
    >>> state.inner_state[0].mu.values.dtype, state.inner_state[0].count.dtype
    (dtype(bfloat16), dtype('int32'))
  """

  inner_state: optax.OptState  # inner's state, each stored leaf a `LowPrecisionArray`
  key: jax.Array  # shape=(2,), dtype=uint32; a raw PRNG key, advanced once per step


def low_precision_state(
    inner: optax.GradientTransformation,
    *,
    dtype: Any = jnp.bfloat16,
    key: int | jax.Array = 0,
) -> optax.GradientTransformationExtraArgs:
  """Stores ``inner``'s floating state in bfloat16: 2 bytes per element instead of 4.

  Every floating state leaf with at least one element that ``inner.update``
  changes (Adam's moments, momentum, accumulated gradients, ...) is stored in
  bfloat16, rounded stochastically from a PRNG key held in the state;
  ``inner`` runs in float32 on the decoded state. Scalars, integer leaves
  (counts, hyperparameters) and constants ``inner.update`` hands back as it
  received them are not touched.

  The stored value is unbiased: its expectation is the float32 state, and
  each element is within one bfloat16 ulp of it (relative 2**-7; 2**-8 on
  average), whatever its distance from the rest of its tensor: bfloat16 has
  float32's exponent range. The rounding noise does not accumulate: a moment
  with decay ``b`` carries about ``1 / sqrt(1 - b**2)`` steps of it.

  Compose it inside the scaler, and the scaler inside ``master_weights``:
  ``master_weights(dynamic_loss_scaling(low_precision_state(adam)), method="kahan")``
  is 16-bit parameters and state, 8 bytes per parameter in all.

  Args:
    inner: the optimizer whose state to store.
    dtype: ``jnp.bfloat16`` (the default and the only one accepted: see Raises).
    key: the seed of the stochastic rounding, an int or a PRNG key.

  Returns:
    An ``optax.GradientTransformationExtraArgs`` whose state is a
    :class:`LowPrecisionState`.

  Raises:
    ValueError: for another ``dtype`` (float16's 5-bit exponent cannot hold a
      second moment's range within one tensor); from ``init``, for an
      optimizer whose state holds a copy of the parameters, which 16 bits
      cannot carry: ``optax.contrib``'s schedule_free, sam, cocob, dog, dowg,
      madgrad, mechanize and prodigy, ``optax.lbfgs``,
      ``optax.scale_by_distance_over_gradients``, and ``master_weights``.

  Examples:
    >>> import jax.numpy as jnp, optax, jaxscale
    >>> tx = jaxscale.low_precision_state(optax.adam(1e-3))
    >>> params = jnp.ones(3)
    >>> state = tx.init(params)
    >>> updates, state = tx.update(jnp.ones(3), state, params)
    >>> updates  # Adam's first step, as in float32: -lr * g / (|g| + eps)
    Array([-0.00099999, -0.00099999, -0.00099999], dtype=float32)
    >>> state.inner_state[0].nu  # 0.001 rounded down or up to a bfloat16 neighbour
    LowPrecisionArray(values=Array([0.000999451, 0.000999451, 0.000999451], dtype=bfloat16))
  """
  name = jnp.dtype(dtype).name if _is_dtype(dtype) else None
  if name == "float16":
    raise ValueError(
        "`low_precision_state` got dtype=float16, whose 5-bit exponent spans 40 binades: within one "
        "tensor, Adam's second moment of small gradients beside large ones falls below it and is "
        "stored as 0, and that element steps 1/eps too far. Use "
        "jnp.bfloat16 (the default): float32's range in 16 bits, stored and read on any device, "
        "float16 ones included."
    )
  if name != "bfloat16":
    raise ValueError(f"`low_precision_state` got dtype={dtype!r}; use jnp.bfloat16 (the default).")
  _optax.require_transformation(inner, "low_precision_state")
  inner = optax.with_extra_args_support(inner)
  seed = None if isinstance(key, int) else _rounding.raw_key(key, "low_precision_state")

  def init_fn(params):
    inner_state = inner.init(params)
    _refuse_parameter_copies(inner_state)
    changing = _changing(inner, inner_state, params)
    leaves = jax.tree.leaves(inner_state, is_leaf=_tree.is_variable)
    scaler = _scaler_leaves(inner_state)
    which = [
        c and not s and _storable(_tree.unwrap_variable(x)) for x, c, s in zip(leaves, changing, scaler, strict=True)
    ]
    raw = seed if seed is not None else jax.random.PRNGKey(key)
    return LowPrecisionState(_encode(inner_state, which, raw), raw)

  def update_fn(updates, state, params=None, **extra_args):
    _optax.require_own_state(state, LowPrecisionState, "low_precision_state")
    template = jax.eval_shape(inner.init, params) if params is not None else None
    inner_state = _decode(state.inner_state, template)
    updates, new_inner = inner.update(updates, inner_state, params, **extra_args)
    key, draw = _rounding.split_key(state.key)
    which = [_is_array(x) for x in jax.tree.leaves(state.inner_state, is_leaf=_is_array)]
    stored = _encode(new_inner, which, draw)
    # A scaler inside `inner` skipped: keep the stored state and the key, bit for bit.
    skipped = _skip.skipped_inside(new_inner)
    # (Only what this wrapper stores: the scaler's own state has moved on.)
    keep = lambda old, new: _skip.keep(~skipped, old, new)
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


def _storable(x) -> bool:
  """Whether a state leaf can be stored in bfloat16: floating, 16 bits or more, not a scalar."""
  return _policy.is_floating_array(x) and jnp.finfo(x.dtype).bits >= 16 and x.ndim > 0 and x.size > 0


def _changing(inner, inner_state, params) -> list[bool]:
  """For each leaf of ``inner_state`` (an NNX Variable one leaf): whether ``inner.update`` can change it.

  Traced once, abstractly: a leaf that the update returns as the very object it received is a
  constant (a hyperparameter in the state, such as `optax.contrib.muon`'s Newton-Schulz
  coefficients), and rounding it to 16 bits would change the optimizer. The probe is advisory: an
  ``inner`` that needs extra arguments (a `value`, an `obj_fn`, ...) cannot be traced without them
  and raises (a TypeError or its own ValueError), and then all its leaves count as changing; its
  ``update``, called with them, raises whatever is really wrong.
  """
  plain = lambda tree: jax.tree.map(_tree.unwrap_variable, tree, is_leaf=_tree.is_variable)
  leaves, treedef = jax.tree.flatten(plain(inner_state))
  changing = [True] * len(leaves)

  def probe(leaves, params):
    _, new = inner.update(params, jax.tree.unflatten(treedef, leaves), params)
    new_leaves = jax.tree.leaves(new)
    if len(new_leaves) == len(leaves):
      changing[:] = [new is not old for new, old in zip(new_leaves, leaves)]

  try:
    with warnings.catch_warnings():  # the probe's trace is not the user's step: its warnings are not theirs
      warnings.simplefilter("ignore")
      jax.eval_shape(probe, leaves, plain(params))
  except Exception:  # the probe is advisory (see the docstring)
    pass
  return changing


def _scaler_leaves(inner_state) -> list[bool]:
  """For each leaf of ``inner_state`` (an NNX Variable one leaf): whether it belongs to a loss
  scaler's state (``low_precision_state(dynamic_loss_scaling(...))``), never stored in 16 bits:
  its packed options and counters must stay exact, and its fields read its float32 arrays."""
  is_scaler = lambda x: isinstance(x, _scaler.ScalerState)
  marked = jax.tree.map(
      lambda x: jax.tree.map(lambda _: True, x) if is_scaler(x) else False,
      inner_state, is_leaf=lambda x: is_scaler(x) or _tree.is_variable(x),
  )
  return jax.tree.leaves(marked)


def _is_array(x) -> bool:
  return isinstance(x, LowPrecisionArray)


def _encode(tree, which, key):
  """``tree`` with each leaf (an NNX Variable one leaf) that ``which`` marks stored in bfloat16.

  An NNX Variable holds one array: the Variable goes around the stored values, not around the
  LowPrecisionArray, whose arrays `nnx.Optimizer` would write back into it as a State.
  """
  flat, treedef = jax.tree_util.tree_flatten_with_path(tree, is_leaf=_tree.is_variable)
  leaves = [x for _, x in flat]
  stored = [i for i, s in enumerate(which) if s]
  pairs = _pairs([flat[i][0] for i in stored], [_tree.unwrap_variable(leaves[i]) for i in stored])
  seconds = {stored[b] for b in pairs.values()}
  firsts = [i for i in stored if i not in seconds]
  seeds = _rounding.leaf_seeds(key, _rounding.LOW_PRECISION_STATE, firsts)
  out = list(leaves)
  for a, b in ((stored[a], None if b is None else stored[b]) for a, b in
               ((a, pairs.get(a)) for a in range(len(stored)) if stored[a] not in seconds)):
    x = _tree.unwrap_variable(leaves[a])
    if b is None:
      out[a] = LowPrecisionArray(_like(leaves[a], _stored(x, seeds[a])))
    else:
      first, second = _stored_pair(x, _tree.unwrap_variable(leaves[b]), seeds[a])
      out[a] = LowPrecisionArray(_like(leaves[a], first))
      out[b] = LowPrecisionArray(_like(leaves[b], second))
  return jax.tree.unflatten(treedef, out)


def _pairs(paths, leaves) -> dict[int, int]:
  """Pairs of stored leaves that share one hash per element (positions in ``leaves``, first to second).

  Two leaves pair when they have one shape and their paths differ in one attribute (a state's
  field), the one nearest the root first: Adam's ``mu['w']`` and ``nu['w']``, which one kernel
  updates, so that each element's 32 random bits round both (`_rounding.halves`). Leaves that
  differ by a dictionary key or an index (two parameters, perhaps sharded apart) and leaves
  without a partner draw their own.
  """
  names = [tuple(jax.tree_util.keystr((k,)) for k in path) for path in paths]
  pairs: dict[int, int] = {}
  taken: set[int] = set()
  for j in range(max(map(len, names), default=0)):
    groups: dict = {}
    for i, (path, name) in enumerate(zip(paths, names, strict=True)):
      if j < len(name) and i not in taken and isinstance(path[j], jax.tree_util.GetAttrKey):
        groups.setdefault((leaves[i].shape, name[:j], name[j + 1:]), []).append(i)
    for group in groups.values():
      pairs.update(zip(group[0:len(group) - 1:2], group[1::2]))
      taken.update(group[:len(group) - len(group) % 2])
  return pairs


@jax.jit
def _stored(x, seeds):
  """A state leaf's float32 value ``x`` rounded stochastically to bfloat16 with its ``seeds``.

  Compiled once per leaf shape, the seeds an argument: ``init``, called eagerly, would otherwise
  round operation by operation, compiling each operation for each leaf shape (about 6x slower,
  benchmarks/NOTES.md), and one program for all the leaves would move each leaf to the devices
  of the others. Under the caller's ``jit`` it is inlined.
  """
  return _rounding.to_bfloat16(x, _rounding.halves(_rounding.random_bits(seeds, x.shape))[0])


@jax.jit
def _stored_pair(x, y, seeds):
  """Two state leaves of one shape rounded to bfloat16 as `_stored` does, from one hash per element."""
  first, second = _rounding.halves(_rounding.random_bits(seeds, x.shape))
  return _rounding.to_bfloat16(x, first), _rounding.to_bfloat16(y, second)


def _like(x, value):
  """``value`` in a Variable like ``x`` (same type and metadata) if ``x`` is an NNX Variable, else ``value``."""
  return jax.tree.map(lambda _: value, x) if _tree.is_variable(x) else value


def _decode(tree, template):
  """The float32 state (or wider: the template's dtype, if it is) from the stored one.

  Zipped leaf by leaf, not by structure: each stored leaf is one leaf of the
  template, which an NNX Variable around the values moves into the
  `LowPrecisionArray` (and `nnx.Optimizer` hands ``update`` no Variables at all).
  """
  leaves, treedef = jax.tree.flatten(tree, is_leaf=_is_array)
  likes = [None] * len(leaves) if template is None else jax.tree.leaves(template)

  def decode(x, like):
    if not _is_array(x):
      return x
    dtype = jnp.float32 if like is None else jnp.promote_types(like.dtype, jnp.float32)
    return _like(x.values, _tree.unwrap_variable(x.values).astype(dtype))

  return jax.tree.unflatten(treedef, [decode(x, like) for x, like in zip(leaves, likes, strict=True)])


def _refuse_parameter_copies(inner_state) -> None:
  types = {type(x).__name__ for x in jax.tree.leaves(inner_state, is_leaf=lambda x: type(x).__name__ in REFUSED)}
  for name in sorted(types & REFUSED.keys()):
    raise ValueError(
        f"`low_precision_state` cannot hold a {name}: {REFUSED[name]}, and in 16 bits every update "
        "below half its ulp would vanish. Leave this optimizer's state in float32 (apply "
        "`low_precision_state` to the other parts of an `optax.chain` only)."
    )
