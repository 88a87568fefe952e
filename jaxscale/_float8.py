"""Scaled float8 matmuls: each operand in float8 times its own power-of-two scale.

float8 has float16's problem twice over: ``float8_e4m3fn`` holds 2**-9..448 with 3 mantissa bits,
``float8_e5m2`` 2**-16..57344 with 2. A tensor fits when it is first multiplied by a power of two
chosen from its own absolute maximum (Transformer Engine's "current scaling")::

    k     = the largest integer with amax(x) * 2**k <= finfo(float8).max     # 0 for amax 0, inf, NaN
    q     = float8(x * 2**k)                  # exact product, one rounding (`nearest`)
    y     = dot(qa, qb, accumulate=float32) / 2**(ka + kb)   # products exact in float32, `unscale` exact
    dA    = dot(float8_e5m2(g * 2**kg), qb) / 2**(kg + kb)    # the backward's gradient in e5m2

Forward operands are ``float8_e4m3fn`` (precision), cotangents ``float8_e5m2`` (range): TE's
HYBRID format. A product of an e4m3 and an e5m2 value has at most 4 + 3 significant bits, so every
product is exact in float32, and the float32 sum rounds as any float32 matmul does. The result is
cast once, to the compute dtype; the gradients of the operands once, to their own dtypes (float32
parameters get float32 gradients, without a 16-bit rounding on the way).

Why each piece:

- Powers of two: scaling and unscaling are exact, so the only roundings are the casts to float8
  and the float32 sum; a tensor multiplied by 2**j quantizes to the same float8 codes.
- Current scaling (this tensor's amax, this step): no history to keep in the optimizer state, and
  no overflow when a tensor grows between steps. (Delayed scaling, TE's amax history, saves the
  reduction on a GPU; it is not here.)
- A non-finite amax leaves the scale at 1: a NaN or inf goes through the cast (inf becomes NaN in
  e4m3fn, which has no inf) and reaches the result, where `dynamic_loss_scaling` or the user sees it.
- Convolutions: ``conv_general_dilated`` takes one dtype for both operands, so the backward's
  products of an e5m2 gradient and an e4m3 operand run on those exact values in float32 (the
  same numbers as a float8 product with float32 accumulation; the report names it).
"""

from __future__ import annotations

import functools
import warnings
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxscale import _tree

FORWARD = np.dtype(jnp.float8_e4m3fn)  # the operands of the forward product
BACKWARD = np.dtype(jnp.float8_e5m2)  # the gradient flowing back into it
FLOAT8 = (FORWARD, BACKWARD)

#: Matmuls kept in the compute dtype under a float8 policy, by the suffix of the `jit` that marks
#: them in the program (see `wider_reason`), and why.
WIDER = "jaxscale_float8_wider_"
REASONS = {
    "small": (
        "a contracted size or an output dimension below 16: float8 tensor cores work in tiles of "
        "16, so float8 would cost this matmul its precision and gain it no speed"
    ),
    "conv_backward": (
        "a convolution's backward product: `lax.conv_general_dilated` takes one dtype for both "
        "operands, so the e5m2 gradient and the e4m3 operand multiply, exactly, in float32"
    ),
}
_SMALL = 16

#: Matmul primitives that a float8 policy does not reach: they run as the program gave them.
OTHER_MATMULS = frozenset({"ragged_dot_general", "scaled_matmul_wrapper", "scaled_dot_general"})


def scale_exponent(amax: jax.Array, dtype: Any) -> jax.Array:
  """The ``k`` (int32) with ``amax * 2**k <= finfo(dtype).max < amax * 2**(k + 1)``.

  Found from the exponents of ``amax`` and of the largest ``dtype`` value (``frexp``),
  not from a ``log2`` that could round across a power of two. ``k`` is 0 where ``amax`` is
  0, inf or NaN, and kept within [-126, 127], so that ``2**k`` is a normal float32 (only an
  amax below about 1e-35 meets the upper bound).
  """
  amax = jnp.asarray(amax, jnp.float32)
  top_mantissa, top_exponent = np.frexp(float(jnp.finfo(dtype).max))
  mantissa, exponent = jnp.frexp(amax)
  k = top_exponent - exponent - (mantissa > top_mantissa).astype(jnp.int32)
  k = jnp.where((amax > 0) & jnp.isfinite(amax), k, 0)
  return jnp.clip(k, -126, 127).astype(jnp.int32)


def power_of_two(k: jax.Array) -> jax.Array:
  """``2.0**k`` as float32, exactly, for integer ``k`` in [-126, 127] (from the bits: ``exp2`` may round)."""
  return lax.bitcast_convert_type((jnp.asarray(k, jnp.int32) + 127) << 23, jnp.float32)


def quantize(x: jax.Array, dtype: Any) -> tuple[jax.Array, jax.Array]:
  """``(q, k)``: ``x * 2**k`` rounded to the float8 ``dtype``, ``k`` from ``x``'s absolute maximum.

  ``x / 2**k`` is ``q``'s value; the multiplication is exact (a power of two, in float32 or
  wider), so the cast is the one rounding: to nearest, ties to even, as ``ml_dtypes`` rounds.
  """
  wide = jnp.promote_types(x.dtype, jnp.float32)
  x = x.astype(wide)
  k = scale_exponent(jnp.max(jnp.abs(x)) if x.size else jnp.zeros((), wide), dtype)
  return nearest(x * power_of_two(k).astype(wide), dtype).astype(dtype), k


def nearest(y: jax.Array, dtype: Any) -> jax.Array:
  """``y`` rounded to the nearest value of the float8 ``dtype`` (ties to even), in ``y``'s own dtype.

  The cast that follows is then exact, whichever way the backend casts. Cast alone, XLA:CPU (jax
  0.7.1) goes from float32 to float8 through float16 and rounds twice: 75.99976 becomes 76, a tie,
  then 80, where the nearest e4m3 value is 72. Here each value is divided by the spacing of the
  format at its magnitude (a power of two: exact), rounded to an integer, and multiplied back.
  """
  info = jnp.finfo(dtype)
  _, exponent = jnp.frexp(y)  # |y| in [2**(exponent - 1), 2**exponent)
  spacing = jnp.maximum(exponent - 1, info.minexp) - info.nmant  # subnormals share the smallest
  return jnp.round(y / power_of_two(spacing).astype(y.dtype)) * power_of_two(spacing).astype(y.dtype)


def unscale(acc: jax.Array, k: jax.Array) -> jax.Array:
  """``acc / 2**k``, exactly wherever the result is a normal float32, for ``k`` up to twice one scale's range.

  Built on ``acc``'s own exponent (``frexp``): ``acc = m * 2**e`` with ``1 <= m < 2``, and the
  result is ``m * 2**(e - k)``, one multiplication by a normal power of two. A result above
  float32's range is inf, one below its normal range 0 (as XLA flushes subnormals); zeros, inf
  and NaN pass through. Not ``acc / 2**ka / 2**kb``: XLA rewrites that as ``acc / (2**ka * 2**kb)``, whose
  divisor overflows to inf (and the result to 0) once ``ka + kb`` passes 127, and not ``2**-k`` as
  one factor, which can be a subnormal that XLA flushes to zero.
  """
  mantissa, exponent = jnp.frexp(acc)  # acc = (2 * mantissa) * 2**(exponent - 1)
  e = exponent - 1 - k
  y = (2 * mantissa) * power_of_two(jnp.clip(e, -126, 127))
  y = jnp.where(e > 127, acc * jnp.inf, jnp.where(e < -126, acc * 0, y))
  return jnp.where(jnp.isfinite(acc) & (acc != 0), y, acc)


def wider_reason(primitive: Any, params: dict, lhs_shape: tuple, rhs_shape: tuple) -> str | None:
  """The key in `REASONS` of why this matmul stays in the compute dtype, or None: it runs in float8."""
  if primitive.name == "dot_general":
    (lhs_contract, rhs_contract), (lhs_batch, rhs_batch) = params["dimension_numbers"]
    sizes = [
        _prod(lhs_shape[d] for d in lhs_contract),
        _prod(s for d, s in enumerate(lhs_shape) if d not in lhs_contract and d not in lhs_batch),
        _prod(s for d, s in enumerate(rhs_shape) if d not in rhs_contract and d not in rhs_batch),
    ]
  else:  # conv_general_dilated: contracted over the input features and the window
    spec = params["dimension_numbers"].rhs_spec  # (out features, in features, *window)
    sizes = [_prod(rhs_shape[d] for d in spec[1:]), rhs_shape[spec[0]]]
  return "small" if min(sizes) < _SMALL else None


def _prod(sizes) -> int:
  return int(np.prod(list(sizes), dtype=np.int64))


def matmul(primitive: Any, params: dict, lhs: jax.Array, rhs: jax.Array, compute_dtype: Any) -> jax.Array:
  """``primitive`` (``dot_general`` or ``conv_general_dilated``) of ``lhs`` and ``rhs``, as a scaled float8 matmul.

  The result is in ``compute_dtype``; differentiable (reverse mode), with the gradient quantized
  to ``float8_e5m2`` and the operands' gradients in the operands' own dtypes. A matmul that
  `wider_reason` keeps wider runs in ``compute_dtype`` inside a ``jit`` named after the reason,
  so that `precision_report` can say why.
  """
  reason = wider_reason(primitive, params, lhs.shape, rhs.shape)
  if reason is not None:
    wide = functools.partial(_bind, primitive, dict(params, preferred_element_type=np.dtype(compute_dtype)))
    return _marked(wide, reason)(lhs.astype(compute_dtype), rhs.astype(compute_dtype))
  return _scaled(primitive, params, compute_dtype, lhs.dtype, rhs.dtype)(lhs, rhs)


def warn_float8_arguments(arrays) -> None:
  """The trace-time warning for float8 arrays among an autocast function's arguments."""
  is_float8 = lambda x: _tree.is_floating(x, real=True) and x.dtype.itemsize == 1  # noqa: E731
  float8 = [f"{x.dtype.name}{list(x.shape)}" for x in arrays if is_float8(x)]
  if float8:
    warnings.warn(
        f"`jaxscale.autocast` got float8 arrays among its arguments ({', '.join(float8[:3])}"
        f"{', ...' if len(float8) > 3 else ''}). Parameters stored in float8 get float8 gradients, with 2 "
        "or 3 mantissa bits and no scale: too coarse to train on. Store them in float32 (the policy's "
        "`param_dtype`) and use the policy 'mixed_float8', which quantizes each matmul's operands with a "
        "scale of their own. Float8 data that is not trained on is fine: cast it to bfloat16 before the "
        "call to silence this warning.",
        stacklevel=3,
    )


def warn_not_float8(name: str) -> None:
  """The trace-time warning for a matmul primitive that a float8 policy leaves in its own dtype."""
  warnings.warn(
      f"`jaxscale.autocast` with a float8 policy met `{name}`, a matmul it does not run in float8: it "
      "runs in the dtypes the program gives it, and `precision_report` counts it there. Write it as "
      "`jax.lax.dot_general` to have it in float8, or wrap it in `jaxscale.autocast(g, 'mixed_bfloat16')` "
      "to keep it in bfloat16 and silence this warning.",
      stacklevel=2,
  )


def _bind(primitive, params, *operands):
  return primitive.bind(*operands, **params)


def _marked(fun, reason: str):
  """``fun`` in a ``jit`` named ``WIDER + reason``: the name stays on its backward pass too."""

  def marked(*args):
    return fun(*args)

  marked.__name__ = marked.__qualname__ = WIDER + reason
  return jax.jit(marked)


def _scaled(primitive, params, compute_dtype, lhs_dtype, rhs_dtype):
  """The scaled float8 product of two operands, with its reverse-mode rule."""
  params = dict(params, preferred_element_type=np.dtype(np.float32))
  product = functools.partial(_bind, primitive, params)

  def conv_cotangents(qg, qa, qb):
    # Exact: float8 values are float32 values. Transposed one operand at a time: no forward pass.
    g, a, b = (x.astype(jnp.float32) for x in (qg, qa, qb))
    (da,) = jax.linear_transpose(lambda a: product(a, b), a)(g)
    (db,) = jax.linear_transpose(lambda b: product(a, b), b)(g)
    return da, db

  def forward(lhs, rhs):
    (qa, ka), (qb, kb) = quantize(lhs, FORWARD), quantize(rhs, FORWARD)
    return unscale(product(qa, qb), ka + kb).astype(compute_dtype), (qa, ka, qb, kb)

  def backward(residuals, g):
    qa, ka, qb, kb = residuals
    qg, kg = quantize(g, BACKWARD)
    if primitive.name == "dot_general":
      da = _dot_cotangent(qg, qb, params, qa.ndim, lhs=True)
      db = _dot_cotangent(qg, qa, params, qb.ndim, lhs=False)
    else:
      da, db = _marked(conv_cotangents, "conv_backward")(qg, qa, qb)
    return unscale(da, kg + kb).astype(lhs_dtype), unscale(db, kg + ka).astype(rhs_dtype)

  scaled = jax.custom_vjp(lambda lhs, rhs: forward(lhs, rhs)[0])
  scaled.defvjp(forward, backward)
  return scaled


def _dot_cotangent(g, other, params, ndim: int, *, lhs: bool) -> jax.Array:
  """The cotangent of one operand of ``dot_general(lhs, rhs)``: ``g`` contracted with the other operand.

  ``g``'s dimensions are the batch dimensions, then the lhs's kept ones, then the rhs's. The
  product keeps the batch, this operand's kept dimensions, then the other's contracted ones in
  ascending order, which pair with this operand's contracted ones; a transpose puts them back.
  The float32 result is unscaled by the caller.
  """
  (lhs_contract, rhs_contract), (lhs_batch, rhs_batch) = params["dimension_numbers"]
  own_contract, other_contract = (lhs_contract, rhs_contract) if lhs else (rhs_contract, lhs_contract)
  own_batch, other_batch = (lhs_batch, rhs_batch) if lhs else (rhs_batch, lhs_batch)
  own_kept = [d for d in range(ndim) if d not in own_contract and d not in own_batch]
  other_kept = [d for d in range(other.ndim) if d not in other_contract and d not in other_batch]
  batch = len(own_batch)
  lhs_kept_end = batch + (len(own_kept) if lhs else len(other_kept))
  g_other = range(lhs_kept_end, g.ndim) if lhs else range(batch, lhs_kept_end)
  dims = ((tuple(g_other), tuple(other_kept)), (tuple(range(batch)), tuple(other_batch)))
  out = lax.dot_general(g, other, dims, precision=params.get("precision"), preferred_element_type=jnp.float32)
  order = [*own_batch, *own_kept, *(own_contract[i] for i in np.argsort(other_contract))]
  return jnp.transpose(out, tuple(int(i) for i in np.argsort(order)))
