"""Master weights: float16 / bfloat16 parameters that still take updates below half an ulp.

A step on 16-bit parameters loses every update below half a unit in the last
place (for float16 near 1.0: 2**-11), so a small learning rate stops learning.
``master_weights(inner, method=...)`` keeps what the parameters cannot hold::

    grads32 = float32(grads)                  # true gradients: the gradient site
                                              # (jaxscale.value_and_grad) cast them to
                                              # float32 before it unscaled them
    "float32":  x = master                    # a float32 copy of each parameter
    "kahan":    x = float32(params) + comp * ulp(params)   # a 16-bit compensation
    "stochastic_rounding": x = float32(params)              # nothing kept
    updates32, inner_state = inner.update(grads32, inner_state, x)
    x = x + updates32                         # in float32
    new = round(x) to the parameters' dtype   # to nearest (stochastically for
                                              # "stochastic_rounding"), saturating
    "float32": master = x;  "kahan": comp = (x - new) / ulp(new)
    updates = new - params, in the parameters' dtype, chosen so that
              params + updates == new when added in that dtype

The updates keep the parameters' dtype, so ``optax.apply_updates`` and
``eqx.apply_updates`` (which does not cast back) both give 16-bit parameters.
A step skipped by a ``dynamic_loss_scaling`` inside is read from its
``ScalerState.last_skipped``: parameters, master, compensation, key and inner
state then stay bit for bit. Parameters of 32 or more bits pass through.

Anchors: Micikevicius et al. 2018 (float32 master weights, torch.amp's and
apex's practice); Zamirai et al. 2020 (arXiv 2010.06192: Kahan summation and
stochastic rounding recover float32 quality with 16-bit weights alone). The
compensation here is stored in units of the parameter's ulp, not as a raw
16-bit value: raw, a float16 compensation of a weight below 0.125 is subnormal
and keeps only a few bits (measured in benchmarks/NOTES.md).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxscale import _optax, _policy, _rounding, _skip

METHODS = ("float32", "kahan", "stochastic_rounding")


class MasterWeightsState(NamedTuple):
  """State of :func:`master_weights`; a field its method does not use is ``None``.

  Examples:
    >>> import jax.numpy as jnp, optax, jaxscale
    >>> params = {"w": jnp.ones(2, jnp.float16), "b": jnp.zeros(1)}
    >>> state = jaxscale.master_weights(optax.sgd(0.1)).init(params)
    >>> state.master["w"].dtype, state.master["b"]  # float32 params need no copy
    (dtype('float32'), MaskedNode())
    >>> state = jaxscale.master_weights(optax.sgd(0.1), method="kahan").init(params)
    >>> state.master, state.compensation["w"]  # in units of each parameter's ulp
    (None, Array([0., 0.], dtype=float16))
  """

  master: Any  # "float32": like params, a float32 copy of each 16-bit leaf, `optax.MaskedNode()` elsewhere
  inner_state: optax.OptState
  compensation: Any = None  # "kahan": like params, each 16-bit leaf's remainder in units of its ulp, same dtype
  key: Any = None  # "stochastic_rounding": shape=(2,), dtype=uint32; a raw PRNG key, advanced once per step



def master_weights(
    inner: optax.GradientTransformation,
    *,
    method: str = "float32",
    key: int | jax.Array | None = None,
) -> optax.GradientTransformationExtraArgs:
  """Runs ``inner`` for float16 / bfloat16 parameters without losing small updates.

  Used as ``master_weights(dynamic_loss_scaling(inner))``, with the true
  gradients of :func:`jaxscale.value_and_grad`, which casts the gradients of
  16-bit parameters to float32 *before* it unscales them (unscaled in
  float16, true gradients below 2**-24 would flush to zero again). The other
  order, ``dynamic_loss_scaling(master_weights(inner))``, trains the same.
  ``inner`` always runs in float32, on float32 gradients and parameters; wrap
  it in :func:`jaxscale.low_precision_state` to store its state in 16 bits.

  Methods, with the persistent bytes each adds per float16 parameter:

  - ``"float32"`` (4 bytes): a float32 master copy; the parameters are the
    master rounded to their dtype. Equal to a float32 run of ``inner``.
  - ``"kahan"`` (2 bytes): a 16-bit compensation carries what rounding the
    parameter lost, in units of its ulp; parameter plus compensation hold
    about 22 bits for float16 (16 for bfloat16), and updates far below
    half an ulp accumulate.
  - ``"stochastic_rounding"`` (0 bytes; one 8-byte key in all): each new
    parameter is rounded up or down at random, with the probability that
    makes its expected value exact. The key advances once per step; with
    replicated parameters every device draws the same numbers.

  The updates have the parameters' dtype and land exactly on the new
  parameter when added in that dtype (``optax.apply_updates``,
  ``eqx.apply_updates``, ``p + u``), whenever the parameter keeps its sign
  and does not shrink by more than half in one step; otherwise they land
  within half an ulp of the step's size (the next step corrects it: the
  float32 master and the compensation count from where it landed). A step
  that leaves a parameter unchanged gives ``-0.0``, which keeps every bit.
  Parameters beyond the dtype's range saturate at its largest finite value
  (an infinite parameter could never come back); float32, float64 and
  non-floating parameters pass through to ``inner`` untouched.

  A step that a ``dynamic_loss_scaling`` inside skips (its
  ``ScalerState.last_skipped``) leaves the parameters, the master, the
  compensation, the key and the inner state bit for bit as they were.

  Args:
    inner: the optimizer, usually ``dynamic_loss_scaling(...)`` around it.
    method: ``"float32"``, ``"kahan"`` or ``"stochastic_rounding"``.
    key: ``"stochastic_rounding"``'s seed, an int or a PRNG key (default 0).

  Returns:
    An ``optax.GradientTransformationExtraArgs`` whose state is a
    :class:`MasterWeightsState`. Its ``update`` needs ``params``; extra
    arguments go on to ``inner``.

  Raises:
    ValueError: for an unknown ``method``, a ``key`` given to another
      method; from ``init``, for a parameter narrower than 16 bits (float8);
      from ``update``, when it is called without ``params``.

  Examples:
    >>> import jax.numpy as jnp, optax, jaxscale
    >>> params = jnp.ones(2, jnp.float16)
    >>> tx = jaxscale.master_weights(optax.sgd(1e-4), method="kahan")
    >>> state = tx.init(params)
    >>> for _ in range(10):  # each step alone is below float16's half-ulp at 1.0
    ...   updates, state = tx.update(jnp.ones(2, jnp.float16), state, params)
    ...   params = optax.apply_updates(params, updates)
    >>> params  # plain sgd(1e-4) would leave them at 1.0
    Array([0.999, 0.999], dtype=float16)
  """
  if method not in METHODS:
    raise ValueError(
        f"`master_weights` got method={method!r}; use one of "
        + ", ".join(repr(m) for m in METHODS) + "."
    )
  if key is not None and method != "stochastic_rounding":
    raise ValueError(
        f"`master_weights` got a `key` with method={method!r}, which draws no random numbers; "
        "pass `key` only with method='stochastic_rounding'."
    )
  _optax.require_transformation(inner, "master_weights")
  inner = optax.with_extra_args_support(inner)

  def init_fn(params):
    _refuse_unsupported(params)
    narrow = lambda f: jax.tree.map(lambda p: f(p) if _is_narrow(p) else optax.MaskedNode(), params)
    state = MasterWeightsState(
        master=narrow(lambda p: p.astype(jnp.float32)) if method == "float32" else None,
        inner_state=(),  # `inner`'s, once it can see the float32 values
        compensation=narrow(jnp.zeros_like) if method == "kahan" else None,
        key=_rounding.raw_key(0 if key is None else key, "master_weights") if method == "stochastic_rounding" else None,
    )
    return state._replace(inner_state=inner.init(_float32_params(params, state)))

  def update_fn(updates, state, params=None, **extra_args):
    if params is None:
      raise ValueError(
          "`master_weights` needs the parameters: call `tx.update(grads, opt_state, params)`."
      )
    _optax.require_own_state(state, MasterWeightsState, "master_weights")
    _check_params_match(params, state)
    full = _float32_params(params, state)
    grads = jax.tree.map(lambda g, p: g.astype(jnp.float32) if _is_narrow(p) else g, updates, params)
    inner_updates, inner_state = inner.update(grads, state.inner_state, full, **extra_args)
    skipped = _skip.skipped_inside(inner_state)
    if method == "float32":
      master = optax.apply_updates(full, inner_updates)  # on a skipped step: master + -0.0, bit for bit
      # Written before the parameters are rounded from it, on a TPU (`_apart_on_tpu`).
      master = jax.tree.map(_apart_on_tpu, master)
      new_state = MasterWeightsState(_only_narrow(params, master), inner_state)
      to_master = lambda p, m: _skip.mask(~skipped, _step_to(
          p.astype(jnp.float32), _rounding.round_to(_clip_to(p.dtype, m), p.dtype), p.dtype)[0])
      updates = jax.tree.map(lambda p, m, u: to_master(p, m) if _is_narrow(p) else u, params, master, inner_updates)
      return updates, new_state
    new_key, draw = (None, None) if state.key is None else _rounding.split_key(state.key)
    comp = state.compensation if method == "kahan" else jax.tree.map(lambda p: optax.MaskedNode(), params)
    leaves, treedef = jax.tree.flatten(params)
    seeds = {} if draw is None else _rounding.leaf_seeds(
        draw, _rounding.MASTER_WEIGHTS, [i for i, p in enumerate(leaves) if _is_narrow(p)])
    new = [
        _narrow_step(p, c, u, skipped, seeds.get(i)) if _is_narrow(p) else (u, c)
        for i, (p, c, u) in enumerate(zip(leaves, treedef.flatten_up_to(comp), treedef.flatten_up_to(inner_updates)))
    ]
    new_updates, comp = (jax.tree.unflatten(treedef, [x[j] for x in new]) for j in (0, 1))
    new_state = MasterWeightsState(None, inner_state, comp if method == "kahan" else None,
                                   None if new_key is None else _skip.keep(~skipped, state.key, new_key))
    return new_updates, new_state

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def _refuse_unsupported(params) -> None:
  """Raises for a parameter narrower than 16 bits: the rounding here needs a dtype with infinities
  and enough exponent for float32's small steps (`float8_e4m3fn` has no inf, so ``nextafter(x, inf)``
  is NaN: every parameter NaN at the first stochastically rounded step)."""
  for path, p in jax.tree_util.tree_flatten_with_path(params)[0]:
    if _is_narrow(p) and jnp.dtype(p.dtype).name not in _rounding.DTYPES:
      raise ValueError(
          f"`master_weights` got a parameter of dtype {jnp.dtype(p.dtype).name} at "
          f"{jax.tree_util.keystr(path) or 'the root of the tree'}; it supports float16 and bfloat16 parameters. "
          "Keep float8 weights in float16, bfloat16 or float32 and cast them to float8 where they are used "
          "(`jaxscale.get_policy(\"mixed_float8\")` does that for every matmul)."
      )


def _check_params_match(params, state: MasterWeightsState) -> None:
  """Raises if a parameter is no longer 16-bit where ``init`` kept a master or compensation for it
  (or the other way round): a float32 update added without casting back (``p + u``) promotes it."""
  kept = state.master if state.master is not None else state.compensation
  if kept is None:
    return
  for path, (p, k) in _leaves_with_path(params, kept):
    if _is_narrow(p) == isinstance(k, optax.MaskedNode):
      raise ValueError(
          f"`master_weights` was initialised with a {'float32' if _is_narrow(p) else '16-bit'} parameter at "
          f"{jax.tree_util.keystr(path)}, and now gets one of dtype {p.dtype}. Keep each parameter's dtype "
          "from step to step (`master_weights`' updates have it; add them with `optax.apply_updates`, "
          "`eqx.apply_updates` or `p + u`, not after a cast to float32), or call `tx.init` again."
      )


def _leaves_with_path(params, kept):
  flat, treedef = jax.tree_util.tree_flatten_with_path(params)
  return zip((path for path, _ in flat), zip((p for _, p in flat), treedef.flatten_up_to(kept)))


def _float32_params(params, state: MasterWeightsState):
  """What ``inner`` sees: float32 values of the 16-bit parameters (the master, or with the compensation)."""
  if state.master is not None:
    return jax.tree.map(lambda p, m: m if _is_narrow(p) else p, params, state.master)
  comp = state.compensation
  if comp is None:
    comp = jax.tree.map(lambda p: optax.MaskedNode(), params)
  with_comp = lambda p, c: p.astype(jnp.float32) + _comp_value(p.astype(jnp.float32), c, p.dtype)
  return jax.tree.map(lambda p, c: with_comp(p, c) if _is_narrow(p) else p, params, comp)


def _comp_value(start, c, dtype):
  """The compensation's float32 value (0 without one): it is stored in units of the spacing of
  ``dtype`` at the parameter (``start``, the parameter as float32)."""
  if isinstance(c, optax.MaskedNode):
    return jnp.float32(0)
  return c.astype(jnp.float32) * _ulp_at(start, dtype)


def _narrow_step(p, c, u, skipped, seeds):
  """One 16-bit leaf's update and new compensation (``c``, a MaskedNode without one), with Kahan
  summation or, given ``seeds``, stochastic rounding; ``-0.0`` and ``c`` on a skipped step.

  Every 16-bit value is handled as the float32 it is (`_rounding.round_to`, `_rounding.widen`) and
  cast to 16 bits once, exactly, at the end: each operation per element is compiled once per leaf,
  and the fusion pass's cost grows faster than a kernel's operations (benchmarks/NOTES.md).
  """
  dtype = p.dtype
  start = p.astype(jnp.float32)  # exact, and nothing to fold: `p` is an input of the step
  # The step and the compensation, both below the parameter's ulp or near it, are summed first.
  step = u + _comp_value(start, c, dtype)
  exact = _clip_to(dtype, start + step)
  if seeds is None:
    wanted = _rounding.round_to(exact, dtype)
  elif jnp.dtype(dtype) == jnp.bfloat16:
    wanted = _rounding.bfloat16_grid(exact, _rounding.halves(_rounding.random_bits(seeds, p.shape))[0])
  else:
    wanted = _rounding.widen(_rounding.stochastic_round(exact, dtype, _rounding.uniform(seeds, p.shape)))
  kahan = not isinstance(c, optax.MaskedNode)
  update, landed = _step_to(start, wanted, dtype, exact if kahan else None)
  if kahan:
    c = _skip.keep(~skipped, c, _remainder(start, step, landed, dtype))
  return _apart_on_tpu(_skip.mask(~skipped, update)), c


def _apart_on_tpu(x: jax.Array) -> jax.Array:
  """``x``, written to memory on a TPU before what reads it runs: a kernel boundary XLA:TPU keeps.

  XLA:TPU splits a leaf's step where a 16-bit parameter is read and its 16-bit result written in
  the kernel that also writes the leaf's state (the ``p + u`` of ``optax.apply_updates``), and the
  split-off kernel computes Adam again from the gradients and the moments: 12 bytes a parameter
  more. Written once here (the Kahan and stochastic rounding update, 2 bytes a parameter; the
  float32 master, which its state writes anyway), the rest reads it: the step moves its floor's
  HBM bytes (benchmarks/NOTES.md). XLA:GPU fuses each leaf's step into one kernel that reads
  nothing twice: no boundary there.
  """
  return jax.lax.platform_dependent(x, tpu=jax.lax.optimization_barrier, default=lambda x: x)


def _remainder(start, step, landed, dtype):
  """The new compensation: what the float32 ``step`` has beyond ``landed`` (where the parameter,
  ``start`` as float32, moved), in the spacing of ``dtype`` there.

  ``landed - start`` is exact in float32 (two nearby 16-bit values), and so, nearly, is ``step``
  minus it: no rounding at the parameter's magnitude enters the compensation.
  """
  big = _largest(dtype)
  return jnp.clip((step - (landed - start)) / _ulp_at(landed, dtype), -big, big).astype(dtype)


def _ulp_at(x: jax.Array, dtype) -> jax.Array:
  """The spacing of ``dtype`` at ``|x|`` (float32, a value of ``dtype``), from ``x``'s exponent bits."""
  fi = jnp.finfo(dtype)
  lowest = max(int(fi.minexp) - int(fi.nmant), int(jnp.finfo(jnp.float32).minexp)) + 127  # biased
  # The exponent field less the mantissa's bits, in place: the bits of the spacing (0 for zero: the lowest).
  exponent = (jax.lax.bitcast_convert_type(x, jnp.int32) & jnp.int32(0x7F800000)) - jnp.int32(int(fi.nmant) << 23)
  return jax.lax.bitcast_convert_type(jnp.maximum(exponent, jnp.int32(lowest << 23)), jnp.float32)


def _clip_to(dtype, x: jax.Array) -> jax.Array:
  """``x`` (float32) limited to ``dtype``'s finite range: a parameter at inf could never come back
  (no finite update moves it), at the largest finite value it can."""
  big = jnp.float32(jnp.finfo(dtype).max)
  return jnp.clip(x, -big, big)


def _step_to(start, wanted, dtype, compensated=None) -> tuple[jax.Array, jax.Array]:
  """An update, in ``dtype``, with which a parameter of that dtype (``start``, as float32) plus the
  update, added in that dtype, is ``wanted`` (a finite value of it, as float32) wherever their
  difference is exact in 16 bits, and where it lands, as float32.

  The difference of two 16-bit values within a factor of two of each other is exact in 16 bits
  (Sterbenz's lemma), and lands. Further apart, the rounded difference lands within half an ulp of
  the step's size (the float32 master and the compensation count from where it landed, so the next
  step corrects it), and never on an infinity. One rounding of the difference, where a search
  among its neighbours for one that lands made the 16-bit step compile several times slower than
  float32 Adam's (benchmarks/NOTES.md).

  Given the ``compensated`` float32 target of a Kahan step, a step that lands on zero with a
  remainder beyond 65504 ulps of zero (0.0039 in float16), which would saturate the compensation,
  lands one ulp of the parameter away from zero instead, where the remainder, below that ulp, fits.
  """
  difference = _rounding.round_to(_clip_to(dtype, wanted - start), dtype)
  landed = _rounding.round_to(start + difference, dtype)
  # The rounded difference can reach half an ulp beyond the largest finite value, which rounds to
  # inf; one ulp less of update cannot.
  closer = jnp.isinf(landed)
  if compensated is not None:
    closer = closer | ((landed == 0) & (jnp.abs(compensated) > _SATURATES[jnp.dtype(dtype).name]))
  difference = jnp.where(closer, _toward_zero(difference, dtype), difference)
  landed = _rounding.round_to(start + difference, dtype)
  # `x + -0.0` is x bit for bit, even for x = -0.0 (where `x + 0.0` is +0.0) and x = inf.
  difference = jnp.where(wanted == start, jnp.float32(-0.0), difference)
  return difference.astype(dtype), landed  # exact: the difference is on the dtype's grid


def _toward_zero(x: jax.Array, dtype) -> jax.Array:
  """The neighbour in ``dtype`` towards zero of a nonzero finite ``x`` (float32, a value of
  ``dtype``), as float32: its magnitude's bits less one."""
  if jnp.dtype(dtype) == jnp.bfloat16:  # float32's upper half: one less there
    return jax.lax.bitcast_convert_type(
        jax.lax.bitcast_convert_type(x, jnp.uint32) - jnp.uint32(1 << 16), jnp.float32)
  bits = jax.lax.bitcast_convert_type(x.astype(dtype), jnp.uint16) - jnp.uint16(1)
  return _rounding.widen(jax.lax.bitcast_convert_type(bits, dtype))


# The magnitude of a remainder that saturates the compensation of a parameter at zero: the largest
# 16-bit value in units of the spacing at zero, as `_ulp_at` gives it.
_SATURATES = {
    name: np.float32(float(fi.max) * 2.0 ** max(int(fi.minexp) - int(fi.nmant), -126))
    for name, fi in ((name, jnp.finfo(name)) for name in _rounding.DTYPES)
}


def _largest(dtype) -> jax.Array:
  return jnp.float32(jnp.finfo(dtype).max)


def _only_narrow(params, tree):
  return jax.tree.map(lambda p, m: m if _is_narrow(p) else optax.MaskedNode(), params, tree)


def _is_narrow(x) -> bool:
  return _policy.is_floating_array(x) and jnp.finfo(x.dtype).bits < 32
