"""Scaled float8 matmuls: each operand in float8 times its own power-of-two scale.

float8 has float16's problem twice over: ``float8_e4m3fn`` holds 2**-9..448 with 3 mantissa bits,
``float8_e5m2`` 2**-16..57344 with 2. A tensor fits when it is first multiplied by a power of two
chosen from its own absolute maximum (Transformer Engine's "current scaling")::

    k     = the largest integer with amax(x) * 2**k <= finfo(float8).max     # 0 for amax 0, inf, NaN;
                                                                             # within [-126, 126]
    q     = float8(x * 2**k)                  # exact product, one rounding (`_round`)
    y     = dot(qa, qb, accumulate=float32) / 2**(ka + kb)   # products exact in float32 (`_unscaled`)
    dA    = dot(float8_e5m2(g * 2**kg), qb) / 2**(kg + kb)    # the backward's gradient in e5m2

Forward operands are ``float8_e4m3fn`` (precision), cotangents ``float8_e5m2`` (range): TE's
HYBRID format. A product of an e4m3 and an e5m2 value has at most 4 + 3 significant bits, so every
product is exact in float32, and the float32 sum rounds as any float32 matmul does. The result is
rounded once, to the compute dtype; the gradient of an input of the autocast function (a float32
parameter) once, to its own dtype, and an activation's once, to the compute dtype (as a 16-bit
policy's are), then cast to its own.

Why each piece:

- Powers of two: scaling and unscaling are exact, so the only roundings are the casts to float8
  and the float32 sum; a tensor multiplied by 2**j quantizes to the same float8 codes.
- Current scaling (this tensor's amax, this step): no history to keep in the optimizer state, and
  no overflow when a tensor grows between steps. (Delayed scaling, TE's amax history, saves the
  reduction on a GPU; it is not here.)
- On a GPU, the cast alone (XLA:GPU rounds float32 to float8 once; `nearest` only on a CPU), and
  the unscaling each operand's ``2**-k``, which XLA folds into the float8 GEMM (cuBLASLt's A and B
  scales) so that the GEMM writes its result once, in the dtype it is returned in. One scalar
  ``2**-k`` a tensor, which its cast divides by and its GEMMs read: one small kernel a tensor, none
  a GEMM (`_dequantized_product`).
- Each tensor quantized once: the forward keeps its float8 operands as the backward's residuals
  (the backward's products read the very float8 weight the forward read, never a re-quantized
  one), and XLA merges the quantizations of one array read by several matmuls (one program).
- A non-finite amax leaves the scale at 1: a NaN or inf goes through the cast (inf becomes NaN in
  e4m3fn, which has no inf) and reaches the result, where `dynamic_loss_scaling` or the user sees it.
- Convolutions: ``conv_general_dilated`` takes one dtype for both operands, so the backward's
  products of an e5m2 gradient and an e4m3 operand run on those exact values in bfloat16 (the
  same numbers as a float8 product; the report names it).
- Matmuls too small for float8 to pay (`wider_reason`) run in the compute dtype.
- Reverse mode, first order: a second derivative would differentiate the roundings (zero almost
  everywhere), so it is an error that says so.
"""

from __future__ import annotations

import collections
import functools
import math
import typing
import warnings
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import custom_derivatives, lax
from jax.extend.core import Primitive
from jax.interpreters import ad, batching, mlir

from jaxscale import _tree, _where
from jaxscale._numerics import power_of_two

FORWARD = np.dtype(jnp.float8_e4m3fn)  # the operands of the forward product
BACKWARD = np.dtype(jnp.float8_e5m2)  # the gradient flowing back into it
FLOAT8 = (FORWARD, BACKWARD)

#: Matmuls kept in the compute dtype under a float8 policy, by the suffix of the `jit` that marks
#: them in the program (see `wider_reason`), and why.
WIDER = "jaxscale_float8_wider_"
#: The name scope of a scaled float8 product (`_unscaled`): in the compiled program, each GEMM asked for
#: in float8, forward and backward, carries it in its `op_name` metadata.
SCALED = "jaxscale_float8_matmul"
REASONS = {
    "small": (
        "a contracted size or an output dimension below 16: float8 tensor cores work in tiles of "
        "16, so float8 would cost this matmul its precision and gain it no speed"
    ),
    "intensity": (
        "fewer multiply-adds per element it reads or writes (M*K*N / (M*K + K*N + M*N) for an "
        "[M,K] x [K,N] product) than the policy's `min_intensity` (512 by default; three times it for "
        "a convolution, whose backward products run in bfloat16): on an H100, below 512, its float8 "
        "GEMM saves less time than quantizing its operands (an absolute-maximum pass and a cast pass "
        "each) costs"
    ),
    "conv_backward": (
        "a convolution's backward product: `lax.conv_general_dilated` takes one dtype for both "
        "operands, and no float8 format holds both the e5m2 gradient and the e4m3 operand, so they "
        "multiply, exactly, in bfloat16 (which holds every float8 value)"
    ),
    "tpu": (
        "on a TPU: its matrix units take bfloat16 (float8 runs at bfloat16's rate, v5p's datasheet "
        "says; v5e and v6e list no float8 at all), so a float8 matmul there gains no speed and its "
        "quantization costs passes and relayout copies (the TPU v5e program); decided where the "
        "program is lowered, so the same function runs in float8 on a GPU"
    ),
}
_SMALL = 16
# The default of `Policy.min_intensity`, the arithmetic intensity below which float8 does not pay on an
# H100: one [M,K] x [K,N] matmul forward and backward, float32 weights, bfloat16 activations, in the
# compiled H100 program's roofline, breaks even near 450 (4096 x 1024 x 1024: 0.99 of bfloat16's time;
# 683: 0.76; 341: 1.31; benchmarks/NOTES.md). Another GPU's break-even is its own (docs/float8.md).
MIN_INTENSITY = 512
# A convolution gains in its forward product only (cuDNN has no float8 backward), a third of what a
# matmul gains for the same quantization: it needs three times the intensity. (The instrument counts
# no FLOPs for cuDNN calls; a 3x3 convolution of 256 channels, intensity about 1150, measured 1.76x
# bfloat16's estimate there, bytes alone.)
_CONV_FACTOR = 3

#: Matmul primitives that a float8 policy does not reach: they run as the program gave them.
OTHER_MATMULS = frozenset({"ragged_dot_general", "scaled_matmul_wrapper", "scaled_dot_general"})


def scale_exponent(amax: jax.Array, dtype: Any) -> jax.Array:
  """The ``k`` (int32) with ``amax * 2**k <= finfo(dtype).max < amax * 2**(k + 1)``.

  Read from the bits of ``amax`` and of the largest ``dtype`` value (their exponent fields, and
  whether ``amax``'s significand passes the largest value's), not from a ``log2`` that could round
  across a power of two: a dozen integer operations on a scalar, which XLA computes where the scale
  is used rather than in a kernel of its own. ``k`` is 0 where ``amax`` is 0 (or subnormal), inf, NaN or negative,
  and kept within [-126, 126], so that ``2**k`` and ``2**-k`` are normal float32s (only an amax
  below about 1e-35 meets the upper bound).
  """
  bits = lax.bitcast_convert_type(jnp.asarray(amax, jnp.float32), jnp.int32)
  top = int(np.asarray(jnp.finfo(dtype).max, np.float32).view(np.int32))
  exponent, significand = bits >> 23, bits & 0x7FFFFF
  k = (top >> 23) - exponent - (significand > (top & 0x7FFFFF)).astype(jnp.int32)
  # Positive, normal and finite: a subnormal amax is 0 to XLA (it flushes them), and so is its k.
  k = jnp.where((bits >= 0x800000) & (bits < 0x7F800000), k, 0)
  return jnp.clip(k, -126, 126).astype(jnp.int32)


def quantize(x: jax.Array, dtype: Any) -> tuple[jax.Array, jax.Array]:
  """``(q, k)``: ``x * 2**k`` rounded to the float8 ``dtype``, ``k`` from ``x``'s absolute maximum.

  ``x / 2**k`` is ``q``'s value; the scaling is exact (a power of two, in float32 or wider), so
  the cast is the one rounding: to nearest, ties to even, as ``ml_dtypes`` rounds. Written as a
  division by ``2**-k``, the factor the GEMMs read (`_dequantized_product`): XLA computes that one
  scalar once for the cast and the GEMMs, where ``2**k`` and ``2**-k`` took a kernel each.
  """
  wide = jnp.promote_types(x.dtype, jnp.float32)
  x = x.astype(wide)
  k = scale_exponent(jnp.max(jnp.abs(x)) if x.size else jnp.zeros((), wide), dtype)
  return _round(x / power_of_two(-k).astype(wide), dtype), k


def quantize_at(x: jax.Array, dtype: Any, k: jax.Array) -> tuple[jax.Array, jax.Array]:
  """``(q, seen)``: ``x * 2**k`` rounded to the float8 ``dtype`` with a ``k`` chosen before (delayed
  scaling), and what the next step's ``k`` is to be chosen from.

  A finite value beyond the format's range saturates to its largest value (clipped, as Transformer
  Engine's casts clip), so a tensor grown past its stale scale loses its outliers' size, not its
  finiteness; inf and NaN pass as they would through `quantize`. The cast needs no pass over ``x``
  first, so XLA writes it in the producer's kernel; ``seen`` is read from the float8 values (one
  byte an element, not a second pass over ``x``): ``x``'s absolute maximum rounded to the format,
  or, where the largest value was reached (the tensor at least doubled, `delayed_exponents`' margin),
  `SATURATED_JUMP` times it, so that the next scale is lower by more than a doubling.
  """
  wide = jnp.promote_types(x.dtype, jnp.float32)
  x = x.astype(wide)
  largest = float(jnp.finfo(dtype).max)
  y = x / power_of_two(-k).astype(wide)
  # Decided on `x`: a finite value whose scaled copy overflows float32 saturates too.
  q = _round(jnp.where(jnp.isinf(x), y, jnp.clip(y, -largest, largest)), dtype)
  # The barrier keeps XLA from fusing the cast again into the reduction, which would read `x` again.
  top = jnp.max(jnp.abs(lax.optimization_barrier(q).astype(jnp.float32))) if x.size else jnp.zeros((), jnp.float32)
  top = jnp.where(top >= largest, SATURATED_JUMP * top, top)
  return q, top * power_of_two(-k)


#: Delayed scaling's headroom, in powers of two: a tensor's scale leaves its window's largest maximum
#: at most half the format's largest value, so that reaching the largest value says the tensor grew,
#: rather than that its maximum rounded up to it.
MARGIN = 1
#: A saturated tensor's maximum is unknown (its largest values were clipped): it is recorded as this
#: many times the format's largest value, so that the next scale is 16 times lower, and lower again
#: at each step it saturates.
SATURATED_JUMP = 16.0


def delayed_exponents(amax: jax.Array) -> jax.Array:
  """Each tensor's ``k`` (int32 ``[n, 3]``) from its amax history ``[n, 3, length]``: the largest amax
  of the window times ``2**MARGIN``, for the forward operands (columns 0, 1: ``float8_e4m3fn``) and
  the gradient (2: ``float8_e5m2``). A row of zeros (a tensor never seen nonzero) gives ``k = 0``."""
  largest = jnp.max(amax, axis=-1) * 2.0**MARGIN
  return jnp.stack([scale_exponent(largest[:, 0], FORWARD), scale_exponent(largest[:, 1], FORWARD),
                    scale_exponent(largest[:, 2], BACKWARD)], axis=1)


def _round(y: jax.Array, dtype: Any) -> jax.Array:
  """``y`` cast to the float8 ``dtype``, rounded once; `nearest` first on a CPU only, where XLA rounds twice.

  XLA:GPU converts float32 to float8 in one rounding, so its programs carry the cast alone (one
  operation per element, fused into the producer) rather than `nearest`'s thirty.
  """
  return lax.platform_dependent(
      y, cpu=lambda y: nearest(y, dtype).astype(dtype), default=lambda y: y.astype(dtype)
  )


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


def wider_reason(
    primitive: Any, params: dict, lhs_shape: tuple, rhs_shape: tuple, min_intensity: float | None = None
) -> str | None:
  """The key in `REASONS` of why this matmul stays in the compute dtype, or None: it runs in float8.

  ``min_intensity``: the policy's (None: `MIN_INTENSITY`).
  """
  if primitive.name == "dot_general":
    (lhs_contract, rhs_contract), (lhs_batch, rhs_batch) = params["dimension_numbers"]
    contracted = _prod(lhs_shape[d] for d in lhs_contract)
    kept = [
        _prod(s for d, s in enumerate(lhs_shape) if d not in lhs_contract and d not in lhs_batch),
        _prod(s for d, s in enumerate(rhs_shape) if d not in rhs_contract and d not in rhs_batch),
    ]
  else:  # conv_general_dilated: contracted over the input features and the window
    spec = params["dimension_numbers"].rhs_spec  # (out features, in features, *window)
    contracted, kept = _prod(rhs_shape[d] for d in spec[1:]), [rhs_shape[spec[0]]]
  if min(contracted, *kept) < _SMALL:
    return "small"
  rule = (MIN_INTENSITY if min_intensity is None else min_intensity) * (
      1 if primitive.name == "dot_general" else _CONV_FACTOR)
  if intensity(primitive, params, lhs_shape, rhs_shape)[1] < rule:
    return "intensity"
  return None


def intensity(primitive: Any, params: dict, lhs_shape: tuple, rhs_shape: tuple) -> tuple[int, float]:
  """``(multiply-adds, arithmetic intensity)`` of a matmul: the intensity is its multiply-adds per element
  read or written, ``M*K*N / (M*K + K*N + M*N)`` for an [M,K] x [K,N] product."""
  operands = [jax.ShapeDtypeStruct(shape, jnp.float32) for shape in (lhs_shape, rhs_shape)]
  out_shape = jax.eval_shape(functools.partial(_bind, primitive, params), *operands).shape
  if primitive.name == "dot_general":
    contracted = _prod(lhs_shape[d] for d in params["dimension_numbers"][0][0])
  else:
    spec = params["dimension_numbers"].rhs_spec
    contracted = _prod(rhs_shape[d] for d in spec[1:])
  out = _prod(out_shape)
  return out * contracted, out * contracted / (_prod(lhs_shape) + _prod(rhs_shape) + out)


def _prod(sizes) -> int:
  return int(np.prod(list(sizes), dtype=np.int64))


def matmul(
    primitive: Any, params: dict, lhs: jax.Array, rhs: jax.Array, compute_dtype: Any, inputs=(True, True),
    min_intensity: float | None = None,
    reduce_dtype: Any = None,
    given=(None, None),
    delayed=None,
) -> jax.Array:
  """``primitive`` (``dot_general`` or ``conv_general_dilated``) of ``lhs`` and ``rhs``, as a scaled float8 matmul.

  The result is in ``compute_dtype``; differentiable (reverse mode), with the gradient quantized
  to ``float8_e5m2``. ``inputs`` says which operands are inputs of the function being autocast
  (parameters, data): their gradients are written in ``reduce_dtype`` (the policy's: the dtype a
  sharded step adds the devices' partial sums in), or their own dtype where it is None or the
  input is already in ``compute_dtype``; an activation's, in ``compute_dtype`` (as under a
  16-bit policy), then cast to its dtype where its consumer reads it. A matmul that
  `wider_reason` keeps wider runs in ``compute_dtype`` inside a ``jit`` named after the reason,
  so that `precision_report` can say why.
  ``min_intensity``: the policy's (see `wider_reason`). ``given``: for each operand, its `quantize`
  ``(q, k)`` computed before (`autocast`'s ``weights``), or None: quantized here. ``delayed``: None
  (current scaling), or ``(k, seen)`` (delayed scaling): the three tensors' scale exponents
  (int32 ``[3]``: lhs, rhs, the incoming gradient) and a float32 ``[3]`` whose cotangent is the
  three tensors' absolute maxima this call saw.
  """
  reason = wider_reason(primitive, params, lhs.shape, rhs.shape, min_intensity)
  wide = lambda reason: lambda lhs, rhs: _marked(
      functools.partial(_bind, primitive, dict(params, preferred_element_type=np.dtype(compute_dtype))), reason
  )(lhs.astype(compute_dtype), rhs.astype(compute_dtype))
  if reason is not None:
    return wide(reason)(lhs, rhs)
  scaled = _scaled(primitive, params, compute_dtype, lhs.dtype, rhs.dtype, inputs, reduce_dtype)
  # Chosen where the program is lowered (the machine that traces may not be the one that runs it).
  return lax.platform_dependent(
      lhs, rhs, tuple(given), delayed, tpu=lambda lhs, rhs, *_: wide("tpu")(lhs, rhs), default=scaled)


def warn_float8_arguments(arrays) -> None:
  """The trace-time warning for float8 arrays among an autocast function's arguments."""
  is_float8 = lambda x: _tree.is_floating(x, real=True) and x.dtype.itemsize == 1
  float8 = [f"{x.dtype.name}{list(x.shape)}" for x in arrays if is_float8(x)]
  if float8:
    warnings.warn(
        f"`jaxscale.autocast` got float8 arrays among its arguments ({', '.join(float8[:3])}"
        f"{', ...' if len(float8) > 3 else ''}). Parameters stored in float8 get float8 gradients, with 2 "
        "or 3 mantissa bits and no scale: too coarse to train on. Store them in float32 (the policy's "
        "`param_dtype`) and use the policy 'mixed_float8', which quantizes each matmul's operands with a "
        "scale of their own. Float8 data that is not trained on is fine: cast it to bfloat16 before the "
        "call to silence this warning.",
        stacklevel=_where.user_stacklevel(),
    )


def warn_not_float8(name: str) -> None:
  """The trace-time warning for a matmul primitive that a float8 policy leaves in its own dtype."""
  warnings.warn(
      f"`jaxscale.autocast` with a float8 policy met `{name}`, a matmul it does not run in float8: it "
      "runs in the dtypes the program gives it, and `precision_report` counts it there. Write it as "
      "`jax.lax.dot_general` to have it in float8, or wrap it in `jaxscale.autocast(g, 'mixed_bfloat16')` "
      "to keep it in bfloat16 and silence this warning.",
      stacklevel=_where.user_stacklevel(),
  )


def warn_no_float8(matmuls, policy: Any, name: str) -> None:
  """The trace-time warning for a function under a float8 policy none of whose matmuls runs in float8.

  ``matmuls``: ``(primitive, params, lhs_shape, rhs_shape)`` of each matmul the policy met (their
  reasons are found here, and only until one runs in float8: the common case costs one).
  """
  reasons = []
  for primitive, params, lhs_shape, rhs_shape in matmuls:
    reason = wider_reason(primitive, params, lhs_shape, rhs_shape, policy.min_intensity)
    if reason is None:
      return
    reasons.append(reason)
  if not matmuls:
    return
  sizes = [intensity(*m) for m in matmuls]
  i = max(range(len(matmuls)), key=lambda i: sizes[i][0])
  (macs, largest_intensity), (primitive, _, lhs_shape, rhs_shape) = sizes[i], matmuls[i]
  why = {
      "intensity": f"below the policy's min_intensity of {policy.min_intensity:g}" + (
          "" if primitive.name == "dot_general" else f" times {_CONV_FACTOR} for a convolution"),
      "small": f"and a dimension below {_SMALL}, a float8 tensor core's tile",
  }[reasons[i]]
  counts = ", ".join(f"{n} for {r!r}" for r, n in sorted(collections.Counter(reasons).items()))
  warnings.warn(
      f"`jaxscale.autocast` of {name} with the float8 policy '{policy}' runs none of its "
      f"{len(matmuls)} matmuls in float8 ({counts}): its program is 'mixed_bfloat16''s. The largest, "
      f"`{primitive.name}` of {list(lhs_shape)} and {list(rhs_shape)} ({2 * macs:.3g} FLOPs), has an "
      f"arithmetic intensity of {largest_intensity:.0f} multiply-adds per element read or written, {why} "
      f"(`precision_report` lists every reason). On a GPU whose float8 pays at a lower intensity than an "
      "H100's 512, or to study float8's numerics, lower the policy's `min_intensity` (e.g. "
      "'mixed_float8,min_intensity=0'); otherwise use 'mixed_bfloat16' to say so.",
      stacklevel=_where.user_stacklevel(),
  )


def _dot(operands, dims, precision, dtype):
  lhs, rhs = operands
  return lax.dot_general(lhs, rhs, dims, precision=precision, preferred_element_type=dtype)


def _bind(primitive, params, *operands):
  return primitive.bind(*operands, **params)


def _marked(fun, reason: str):
  """``fun`` in a ``jit`` named ``WIDER + reason``: the name stays on its backward pass too."""

  def marked(*args):
    return fun(*args)

  marked.__name__ = marked.__qualname__ = WIDER + reason
  return jax.jit(marked)


def _scaled(primitive, params, compute_dtype, lhs_dtype, rhs_dtype, inputs=(True, True), reduce_dtype=None):
  """The scaled float8 product of two operands, with its reverse-mode rule (``inputs``, ``reduce_dtype``: `matmul`);
  it takes ``given`` too, each operand's ``(q, k)`` or None (`matmul`)."""
  return lambda lhs, rhs, given=(None, None), delayed=None: _scaled_for(
      primitive, params, compute_dtype, lhs_dtype, rhs_dtype, inputs, reduce_dtype, (lhs.shape, rhs.shape)
  )(lhs, rhs, tuple(given), delayed)


def _scaled_for(primitive, params, compute_dtype, lhs_dtype, rhs_dtype, inputs, reduce_dtype, shapes):
  """`_scaled` for operands of ``shapes``: its backward pass pads the gradient as the forward padded the product."""
  lhs_shape, rhs_shape = shapes
  own = lambda dtype: dtype if reduce_dtype is None or dtype == compute_dtype else reduce_dtype
  written = [own(dtype) if given else compute_dtype for dtype, given in zip((lhs_dtype, rhs_dtype), inputs)]

  def product(a, b, dtype):
    return _bind(primitive, dict(params, preferred_element_type=np.dtype(dtype)), a, b)

  def conv_cotangents(qg, qa, qb):
    # Exact: float8 values are bfloat16 values. Transposed one operand at a time: no forward pass.
    g, a, b = (x.astype(jnp.bfloat16) for x in (qg, qa, qb))
    (da,) = jax.linear_transpose(lambda a: product(a, b, jnp.bfloat16), a)(g)
    (db,) = jax.linear_transpose(lambda b: product(a, b, jnp.bfloat16), b)(g)
    return da, db

  def operand(x, pads, given, k, report):
    """The operand's float8 values, scale and absolute maximum, padded: quantized here (with the
    delayed ``k`` where one is given), or as `quantize` gave them before (the same values: the zeros
    of the padding change no absolute maximum; the maximum is then not taken again, 0)."""
    if given is not None:
      q, k = given
      return _pad(q, pads), k, jnp.zeros((), jnp.float32)
    return quantized(x, pads, FORWARD, k, report)

  def quantized(x, pads, dtype, k, report=True):
    x = _pad(x, pads)
    if k is not None:
      q, amax = quantize_at(x, dtype, k)
      return q, k, amax
    q, k = quantize(x, dtype)  # current scaling; while calibrating, the absolute maximum it took
    wide = x.astype(jnp.promote_types(x.dtype, jnp.float32))
    return q, k, (jnp.max(jnp.abs(wide)).astype(jnp.float32) if x.size else jnp.zeros(())) if report else None

  def forward(lhs, rhs, given, delayed):
    pads = _gemm_padding(params, lhs.shape, rhs.shape) if primitive.name == "dot_general" else ((0,) * lhs.ndim,) * 3
    # `delayed`'s exponents are None while a history is calibrated: current scaling, maxima reported.
    ks = (None, None) if delayed is None or delayed[0] is None else (delayed[0][0], delayed[0][1])
    report = delayed is not None
    (qa, ka, amax_a), (qb, kb, amax_b) = (operand(lhs, pads[0], given[0], ks[0], report),
                                          operand(rhs, pads[1], given[1], ks[1], report))
    if primitive.name == "dot_general":
      y = _unpad(_unscaled_product(product, (qa, qb), (ka, kb), compute_dtype), pads[2])
    else:
      y = _unscaled(lambda dtype: product(qa, qb, dtype), ka + kb, compute_dtype)
    return y, (qa, ka, qb, kb, given, delayed, (amax_a, amax_b))

  def backward(residuals, g):
    qa, ka, qb, kb, given, delayed, forward_amax = residuals

    def incoming(g, pads):  # the incoming gradient's float8 values, scale and absolute maximum
      return quantized(g, pads, BACKWARD, None if delayed is None or delayed[0] is None else delayed[0][2],
                       report=delayed is not None)

    if primitive.name == "dot_general":
      lhs_pads, rhs_pads, out_pads = _gemm_padding(params, lhs_shape, rhs_shape)
      qg, kg, amax_g = incoming(g, out_pads)
      da = _unpad(_dot_cotangent(qg, qb, params, qa.ndim, (kg, kb), written[0], lhs=True), lhs_pads)
      db = _unpad(_dot_cotangent(qg, qa, params, qb.ndim, (ka, kg), written[1], lhs=False), rhs_pads)
    else:
      qg, kg, amax_g = incoming(g, (0,) * g.ndim)
      da, db = _marked(conv_cotangents, "conv_backward")(qg, qa, qb)
      da, db = _unscaled(da.astype, kg + kb, written[0]), _unscaled(db.astype, kg + ka, written[1])
    # Delayed scaling: the absolute maxima seen leave as the cotangent of the slot `delayed` gave.
    seen = None if delayed is None else (jax.tree.map(_no_cotangent, delayed[0]),
                                         jnp.stack(typing.cast(list, [*forward_amax, amax_g])))
    return da.astype(lhs_dtype), db.astype(rhs_dtype), jax.tree.map(_no_cotangent, given), seen

  scaled = jax.custom_vjp(lambda lhs, rhs, given, delayed: forward(lhs, rhs, given, delayed)[0])
  scaled.defvjp(forward, _first_order_only(backward))
  # Under delayed scaling, the forward pass is told which inputs are differentiated: a history that is
  # not loses the maxima this step sees, which is said at once.
  tracked = jax.custom_vjp(lambda lhs, rhs, given, delayed: forward(lhs, rhs, given, delayed)[0])

  def tracked_forward(*primals):
    lhs, rhs, given, delayed = jax.tree.map(
        lambda p: p.value, primals, is_leaf=lambda p: isinstance(p, custom_derivatives.CustomVJPPrimal))
    if not primals[3][1].perturbed:
      warn_history_not_differentiated()
    return forward(lhs, rhs, given, delayed)

  def tracked_backward(residuals, g):
    if isinstance(g, custom_derivatives.SymbolicZero):
      aval: Any = g.aval
      g = jnp.zeros(aval.shape, aval.dtype)
    return backward(residuals, g)

  tracked.defvjp(tracked_forward, _first_order_only(tracked_backward), symbolic_zeros=True)
  return lambda lhs, rhs, given, delayed: (scaled if delayed is None else tracked)(lhs, rhs, given, delayed)


def warn_history_not_differentiated() -> None:
  """The trace-time warning for a delayed-scaling function differentiated without its history."""
  warnings.warn(
      "A function made with `jaxscale.autocast(..., delayed=True)` is differentiated, but not with respect "
      "to its `Float8History`: the maxima this step sees are lost, and the scales go stale as the tensors "
      "change. Differentiate both, `jax.value_and_grad(f, argnums=(0, 1))(history, params, ...)`, and pass "
      "the history's gradient to `jaxscale.float8_update`.",
      stacklevel=_where.user_stacklevel(),
  )


def _no_cotangent(x: jax.Array):
  """The zero cotangent of a precomputed float8 operand or its scale: they are not differentiated (the
  weight they were computed from is, through the product)."""
  return jnp.zeros_like(x) if jnp.issubdtype(x.dtype, jnp.inexact) else np.zeros(x.shape, jax.dtypes.float0)


def _gemm_padding(params, lhs_shape, rhs_shape) -> tuple[tuple, tuple, tuple]:
  """The zeros to append to each dimension of the lhs, the rhs and the product: GEMM sizes multiples of 16.

  The GEMM's M, N and K (the products of the kept and of the contracted dimensions) become multiples of 16.

  cuBLASLt's float8 GEMMs take only such sizes; XLA pads a float8 operand that is not, after its
  cast, and pads a transposed copy again: a vocabulary of 50257 had its gradient read and written
  three times. Padded here, before the cast, the one fusion that writes an operand's float8 layouts
  writes them padded. The last dimension of each group (kept, contracted) grows; zeros add nothing
  to a sum of products, and the padded rows and columns of the product are sliced off.
  """
  (lhs_contract, rhs_contract), (lhs_batch, rhs_batch) = params["dimension_numbers"]
  lhs_pads, rhs_pads = [0] * len(lhs_shape), [0] * len(rhs_shape)

  def grow(shape, dims):  # the zeros to add to dims[-1] for a product of dims that is a multiple of 16
    rest = _prod(shape[d] for d in dims[:-1])
    return -shape[dims[-1]] % (_SMALL // math.gcd(rest, _SMALL))

  kept = []
  for shape, pads, contract, batch in ((lhs_shape, lhs_pads, lhs_contract, lhs_batch),
                                       (rhs_shape, rhs_pads, rhs_contract, rhs_batch)):
    kept.append([d for d in range(len(shape)) if d not in contract and d not in batch])
    if kept[-1]:
      pads[kept[-1][-1]] = grow(shape, kept[-1])
  if lhs_contract:
    lhs_pads[lhs_contract[-1]] = rhs_pads[rhs_contract[-1]] = grow(lhs_shape, list(lhs_contract))
  out_pads = [0] * len(lhs_batch) + [lhs_pads[d] for d in kept[0]] + [rhs_pads[d] for d in kept[1]]
  return tuple(lhs_pads), tuple(rhs_pads), tuple(out_pads)


def _pad(x: jax.Array, pads: tuple) -> jax.Array:
  return jnp.pad(x, [(0, p) for p in pads]) if any(pads) else x


def _unpad(x: jax.Array, pads: tuple) -> jax.Array:
  return x[tuple(slice(0, n - p) for n, p in zip(x.shape, pads))] if any(pads) else x


def _first_order_only(backward):
  """``backward`` whose own derivative is an error that names float8, never a silent zero.

  Differentiating the backward pass (``jax.hessian``, a Hessian-vector product, a gradient penalty)
  would differentiate its roundings to float8, whose derivative is zero almost everywhere. The
  refusal waits until that derivative is used: JAX also linearizes a first-order gradient that is
  then dropped (first-order SAM's ``stop_gradient(jax.grad(...))`` inside the loss), and that runs.
  """
  refused = jax.custom_jvp(backward)

  @refused.defjvp
  def refuse(primals, tangents):
    outs = backward(*primals)
    # A tangent that depends linearly on every incoming one, through `_SECOND_ORDER`: transposed
    # (reverse over reverse) or evaluated (forward over reverse), it raises; unused, XLA drops it.
    floating = [t for t in jax.tree.leaves(tangents) if jnp.issubdtype(t.dtype, jnp.inexact)]
    if not floating:  # only integer inputs vary (float0 tangents): nothing is differentiated
      return outs, jax.tree.map(jnp.zeros_like, outs)
    total = sum(jnp.sum(t.astype(jnp.float32)) for t in floating) * 0.0
    return outs, jax.tree.map(lambda y: _SECOND_ORDER.bind(jnp.broadcast_to(total, y.shape).astype(y.dtype)), outs)

  return refused


SECOND_ORDER_MESSAGE = (
    "A second-order derivative (`jax.hessian`, a Hessian-vector product, a gradient penalty) "
    "reached a float8 matmul of `jaxscale.autocast` under a float8 policy ('mixed_float8'): its "
    "backward pass rounds to float8, whose derivative is zero almost everywhere, so the result "
    "would be silently 0. Differentiate twice under 'mixed_bfloat16' instead, or wrap the part you "
    "differentiate twice in `jaxscale.autocast(f, 'mixed_bfloat16')` inside the float8 function."
)


def _refuse(*args, **params):
  raise TypeError(SECOND_ORDER_MESSAGE)


def _refuse_used_transpose(ct, x):
  if type(ct) is ad.Zero:  # the derivative is dropped (a `stop_gradient` after it): nothing to refuse
    return [ad.Zero(x.aval) if ad.is_undefined_primal(x) else None]
  raise TypeError(SECOND_ORDER_MESSAGE)


# The tangent of a float8 backward pass: linear in form, an error wherever it is evaluated
# (`impl`, lowering), transposed with a nonzero cotangent, or differentiated again.
_SECOND_ORDER = Primitive("jaxscale_float8_second_order")
_SECOND_ORDER.def_abstract_eval(lambda x: x)
_SECOND_ORDER.def_impl(_refuse)
mlir.register_lowering(_SECOND_ORDER, _refuse)
ad.primitive_jvps[_SECOND_ORDER] = _refuse
ad.primitive_transposes[_SECOND_ORDER] = _refuse_used_transpose
batching.defvectorized(_SECOND_ORDER)


def _unscaled(product, k: jax.Array, dtype: Any) -> jax.Array:
  """``product / 2**k`` in ``dtype``, where ``product(result_dtype)`` computes the scaled product in that dtype.

  On a GPU, one multiplication by a power of two, a scalar: XLA folds it into the float8 GEMM
  (cuBLASLt's alpha), which writes its result once, in ``dtype``. ``2**-k`` is a normal float32
  for ``|k| <= 126``, wherever the two operands' absolute maxima multiply to between about 1e-33
  and 1e43; beyond, the factor is 0 (``k > 126``: every result is below 2**-101 times the number of
  terms) or inf (``k < -126``: every nonzero result is above 2**101). On a CPU, `unscale` of the
  float32 product, exact over the whole range.
  """
  factor = jnp.where(k > 126, 0.0, jnp.where(k < -126, jnp.inf, power_of_two(-jnp.clip(k, -126, 126))))
  # The scope names the product in the compiled program (its GEMM's `op_name`), forward and backward.
  with jax.named_scope(SCALED):
    return lax.platform_dependent(
        cpu=lambda: unscale(product(np.dtype(np.float32)), k).astype(dtype),
        default=lambda: product(np.dtype(dtype)) * factor.astype(dtype),
    )


def _unscaled_product(product, operands, ks, dtype: Any) -> jax.Array:
  """``product(a, b, result_dtype)`` of the float8 ``operands``, ``/ 2**(ka + kb)``, in ``dtype``.

  On a GPU, `_dequantized_product`; on a CPU, `unscale` of the float32 product, as in `_unscaled`.
  """
  (qa, qb), (ka, kb) = operands, ks
  # The scope names the product in the compiled program (its GEMM's `op_name`), forward and backward.
  with jax.named_scope(SCALED):
    return lax.platform_dependent(
        cpu=lambda: unscale(product(qa, qb, np.dtype(np.float32)), ka + kb).astype(dtype),
        default=lambda: _dequantized_product(product, operands, ks, dtype),
    )


def _dequantized_product(product, operands, ks, dtype: Any) -> jax.Array:
  """The product of each float8 operand times its own ``2**-k``, in ``dtype``.

  The pattern XLA:GPU rewrites into one float8 GEMM that takes the two factors as its scale
  operands (cuBLASLt's A and B scales): no kernel combines the two scales, and the scale a tensor's
  cast used is the one its GEMMs read (``2**-k``, a normal float32 for ``k`` within [-126, 126]).
  The GEMM multiplies the float32 sum of the exact products by the two factors and rounds once to
  ``dtype``: the value of `_unscaled`'s one factor ``2**-(ka + kb)`` wherever that is a normal float32.
  """
  a, b = (q.astype(dtype) * power_of_two(-k).astype(dtype) for q, k in zip(operands, ks))
  return product(a, b, np.dtype(dtype))


def _dot_cotangent(g, other, params, ndim: int, ks: tuple, dtype: Any, *, lhs: bool) -> jax.Array:
  """The cotangent of one operand of ``dot_general(lhs, rhs)``: ``g`` contracted with the other operand, unscaled.

  ``ks``: the scale exponents of the product's two operands, in the order the product takes them.

  ``g``'s dimensions are the batch dimensions, then the lhs's kept ones, then the rhs's. The
  product takes ``g`` on the side of this operand, so that it keeps the batch, then this
  operand's dimensions in their own order wherever the forward's were in the usual order (the
  other's contracted ones, ascending, pair with this operand's contracted ones): the GEMM then
  writes this operand's layout, and the transpose that follows is the identity.
  """
  (lhs_contract, rhs_contract), (lhs_batch, rhs_batch) = params["dimension_numbers"]
  own_contract, other_contract = (lhs_contract, rhs_contract) if lhs else (rhs_contract, lhs_contract)
  own_batch, other_batch = (lhs_batch, rhs_batch) if lhs else (rhs_batch, lhs_batch)
  own_kept = [d for d in range(ndim) if d not in own_contract and d not in own_batch]
  other_kept = tuple(d for d in range(other.ndim) if d not in other_contract and d not in other_batch)
  batch = len(own_batch)
  lhs_kept_end = batch + (len(own_kept) if lhs else len(other_kept))
  g_contract = tuple(range(lhs_kept_end, g.ndim) if lhs else range(batch, lhs_kept_end))
  paired = [own_contract[i] for i in np.argsort(other_contract)]
  g_batch = tuple(range(batch))
  if lhs:
    operands, dims = (g, other), ((g_contract, other_kept), (g_batch, other_batch))
    order = [*own_batch, *own_kept, *paired]
  else:
    operands, dims = (other, g), ((other_kept, g_contract), (other_batch, g_batch))
    order = [*own_batch, *paired, *own_kept]
  precision = params.get("precision")
  out = _unscaled_product(lambda a, b, dtype: _dot((a, b), dims, precision, dtype), operands, ks, dtype)
  return jnp.transpose(out, tuple(int(i) for i in np.argsort(order)))
