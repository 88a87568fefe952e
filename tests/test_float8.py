"""Scaled float8 matmuls against an independent reference: the quantization and its power-of-two scale
bit for bit against ml_dtypes' rounding of exact float64 products; the matmul's and its gradients'
errors against float64 within a bound derived from the formats; scale invariance; zeros, inf, NaN."""

import contextlib
import math
import re
import warnings

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import optax
import pytest
from jax import lax

import jaxscale
from _jit import compilations
from jaxscale import _float8, _numerics

pytestmark = pytest.mark.jaxpr

E4M3, E5M2 = np.dtype(ml_dtypes.float8_e4m3fn), np.dtype(ml_dtypes.float8_e5m2)
F32 = np.dtype(np.float32)
# Unit roundoff (half an ulp at 1, relative) and half the smallest subnormal, of each format's
# scaled values: e4m3 keeps 3 mantissa bits and its subnormals are multiples of 2**-9; e5m2 keeps 2,
# multiples of 2**-16.
UNIT = {E4M3: 2.0**-4, E5M2: 2.0**-3}
# The unit roundoff of the products' sum. XLA:CPU sums float8 products in float32: 2**-24. A
# Hopper GPU's float8 tensor cores keep fewer bits in their accumulator, about 14 (DeepSeek-V3's
# technical report, section 3.3.2, measured on an H800; an H100 here gave max |err| / sum |a b| of
# 2**-16 at 1024 and 8192 terms, docs/performance.md), whatever the dot's `precision`: 2**-14 there.
ACCUMULATION_UNIT = 2.0**-24 if jax.default_backend() == "cpu" else 2.0**-14
HALF_SUBNORMAL = {E4M3: 2.0**-10, E5M2: 2.0**-17}
MATMUL = (((1,), (0,)), ((), ()))
RULE = _float8.MIN_INTENSITY  # the arithmetic intensity below which float8 does not pay on an H100
NONE_FLOAT8 = r"runs none of its \d+ matmuls in float8"  # the trace-time warning of a float8 function without any


@pytest.fixture(autouse=True)
def every_matmul_float8_can_take(monkeypatch):
  """The models here are far below the arithmetic intensity at which float8 pays on an H100: with that
  rule off, their matmuls run in float8, whose routing and numerics these tests check. The rule's own
  tests switch it back on."""
  monkeypatch.setattr(_float8, "MIN_INTENSITY", 0)


# --- the reference: NumPy in float64, ml_dtypes' casts ---------------------------------------------


def reference_exponent(amax: float, dtype) -> int:
  """The largest k with amax * 2**k <= the format's largest value, by search in exact float64."""
  top = float(ml_dtypes.finfo(dtype).max)
  if not (np.isfinite(amax) and amax > 0):
    return 0
  k = int(np.floor(np.log2(top / amax)))
  while np.ldexp(amax, k) > top:  # log2 may round across a power of two: correct it
    k -= 1
  while np.ldexp(amax, k + 1) <= top:
    k += 1
  # Within [-126, 126]: 2**k scales the cast and 2**-k the product, both normal float32s.
  return int(np.clip(k, -126, 126))


def reference_quantize(x, dtype):
  """(codes, k): x * 2**k, exact in float64, rounded once by ml_dtypes (to nearest, ties to even)."""
  x = np.asarray(x, np.float64)
  k = reference_exponent(float(np.max(np.abs(x))) if x.size else 0.0, dtype)
  return np.ldexp(x, k).astype(dtype), k


def dot64(a, b, dims=MATMUL):
  """dot_general in float64, by NumPy: each operand's dimensions named, then einsum."""
  (lc, rc), (lb, rb) = dims
  letters = iter("abcdefghijklmnopqrstuvwxyz")
  lhs = [next(letters) for _ in range(np.ndim(a))]
  rhs = [next(letters) for _ in range(np.ndim(b))]
  for i, j in (*zip(lc, rc), *zip(lb, rb)):
    rhs[j] = lhs[i]
  out = [lhs[d] for d in lb] + [s for d, s in enumerate(lhs) if d not in lc and d not in lb]
  out += [s for d, s in enumerate(rhs) if d not in rc and d not in rb]
  subscripts = f"{''.join(lhs)},{''.join(rhs)}->{''.join(out)}"
  return np.einsum(subscripts, np.asarray(a, np.float64), np.asarray(b, np.float64))


def error_bound(product, a, b, ka, kb, fmt_a, fmt_b, terms):
  """What quantizing two operands and summing in float32 may cost each element of ``product(a, b)``.

  Each quantized operand is |q - x| <= u |x| + e (u the unit roundoff of its format; e half its
  smallest subnormal, unscaled: 2**-10 / 2**k for e4m3), so |q| <= (1 + u) |x| + e and
      |qa qb - a b| <= |qa - a| |qb| + |a| |qb - b| <= (ua |a| + ea)((1 + ub) |b| + eb) + |a| (ub |b| + eb).
  Each product of two float8 values (at most 4 + 4 significant bits) is exact in float32; a sum of
  `terms` of them in float32, in any order, is off by at most gamma = terms * u / (1 - terms * u)
  times the sum of their magnitudes (Higham, Numerical Stability, 3.1), u the accumulator's unit
  roundoff (`ACCUMULATION_UNIT`: float32's 2**-24 on a CPU). Unscaling by powers
  of two is exact. ``product`` of non-negative operands sums magnitudes.
  """
  ua, ub = UNIT[fmt_a], UNIT[fmt_b]
  ea, eb = np.ldexp(HALF_SUBNORMAL[fmt_a], -ka), np.ldexp(HALF_SUBNORMAL[fmt_b], -kb)
  a, b = np.abs(np.asarray(a, np.float64)), np.abs(np.asarray(b, np.float64))
  gamma = terms * ACCUMULATION_UNIT / (1 - terms * ACCUMULATION_UNIT)
  rounding = product(ua * a + ea, (1 + ub) * b + eb) + product(a, ub * b + eb)
  return rounding + gamma * product((1 + ua) * a + ea, (1 + ub) * b + eb)


def operation(fun, *args):
  """The primitive and parameters of the one equation of ``fun``'s jaxpr (as this JAX spells them)."""
  (eqn,) = jax.make_jaxpr(fun)(*args).jaxpr.eqns
  return eqn.primitive, eqn.params


def float8_matmul(a, b, compute=jnp.float32, dims=MATMUL):
  """The scaled float8 ``dot_general(a, b, dims)``, ``_float8``'s rule with no matmul kept wider."""
  primitive, params = operation(lambda a, b: lax.dot_general(a, b, dims), a, b)
  return _float8._scaled(primitive, params, compute, a.dtype, b.dtype)(a, b)


def normal(shape, seed=0, scale=1.0, dtype=np.float32):
  return (np.random.default_rng(seed).standard_normal(shape) * scale).astype(dtype)


# --- quantization, bit for bit -------------------------------------------------------------------

# Values whose absolute maximum sits on and beside the powers of two where k changes, subnormal
# elements beside a large one, and dtypes that arrive from autocast.
QUANTIZE_CASES = {
    "normal": normal((64, 48)),
    "at the top": np.array([448.0, -1.0, 0.5], np.float32),
    "just above the top": np.array([np.nextafter(np.float32(448), np.float32(1e9)), 3.0], np.float32),
    "just below a power of two": np.array([np.nextafter(np.float32(1), np.float32(0)), 1e-3], np.float32),
    "the top's mantissa": np.array([0.875, 0.4375], np.float32),
    "beside it": np.array([np.nextafter(np.float32(0.875), np.float32(1)), -0.25], np.float32),
    "subnormal elements": np.array([1.0, 2.0**-12, 3 * 2.0**-13, 2.0**-14, -(2.0**-13)], np.float32),
    "tiny": normal((32,), scale=1e-30),
    "huge": normal((32,), scale=1e30),
    "bfloat16": normal((64,), scale=300.0, dtype=ml_dtypes.bfloat16),
    "float16": normal((64,), scale=1e-3, dtype=np.float16),
    "zeros": np.zeros((4, 4), np.float32),
    "below the clip": np.array([2.0**-120, -(2.0**-121)], np.float32),
}


@pytest.mark.parametrize("fmt", [E4M3, E5M2], ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("name", list(QUANTIZE_CASES))
def test_quantize_is_ml_dtypes_rounding_of_the_exact_scaled_value(name, fmt):
  x = QUANTIZE_CASES[name]
  q, k = jax.jit(_float8.quantize, static_argnums=1)(jnp.asarray(x), fmt)
  ref_q, ref_k = reference_quantize(x, fmt)
  assert q.dtype == fmt and k.dtype == np.int32
  assert int(k) == ref_k
  np.testing.assert_array_equal(np.asarray(q).view(np.uint8), ref_q.view(np.uint8))
  # The scale keeps the largest value finite: no float8 NaN, and none is produced by overflow.
  assert np.isfinite(np.asarray(q, np.float64)).all()


def test_scale_exponent_is_the_largest_that_fits():
  top = float(ml_dtypes.finfo(E4M3).max)  # 448
  amax = [top, top * (1 + 2.0**-23), top / 2, 1.0, 3.0, 1e-20, 2.0**-125, 0.0, np.inf, np.nan, 2.0**-130, -1.0]
  amax = np.array(amax, np.float32)
  k = np.asarray(jax.vmap(lambda m: _float8.scale_exponent(m, E4M3))(amax))
  # 2**-125 would take 133: kept at 126 (2**-k a normal float32); a subnormal amax is 0 to XLA, and a
  # negative one is not an absolute maximum: both leave the scale at 1.
  np.testing.assert_array_equal(k, [0, -1, 1, 8, 7, 75, 126, 0, 0, 0, 0, 0])
  for value, exponent in zip(amax[:6], k[:6]):  # the definition, checked in float64
    assert np.ldexp(np.float64(value), int(exponent)) <= top < np.ldexp(np.float64(value), int(exponent) + 1)


def test_power_of_two_is_exact_over_float32s_normal_range():
  k = np.arange(-126, 128)
  np.testing.assert_array_equal(np.asarray(_numerics.power_of_two(k), np.float64), np.ldexp(1.0, k))


def test_unscale_is_exact_wherever_the_result_is_normal():
  """Against NumPy's ldexp in float64, over the whole range of two scales' exponents, jitted (where XLA
  would turn two divisions into one by an overflowing product); below float32's normal range 0, above
  it inf; zeros, infs and NaNs kept."""
  rng = np.random.default_rng(0)
  acc = (rng.standard_normal(20000) * np.exp2(rng.integers(-20, 40, 20000))).astype(np.float32)
  k = rng.integers(-252, 255, 20000).astype(np.int32)
  out = np.asarray(jax.jit(_float8.unscale)(acc, k), np.float64)
  ref = np.ldexp(acc.astype(np.float64), -k)
  normal = (np.abs(ref) >= 2.0**-126) & (np.abs(ref) < 2.0**128)
  assert normal.mean() > 0.4 and (np.abs(ref) < 2.0**-126).any() and (np.abs(ref) >= 2.0**128).any()
  np.testing.assert_array_equal(out[normal], ref[normal])
  np.testing.assert_array_equal(out[np.abs(ref) < 2.0**-126], 0.0)
  np.testing.assert_array_equal(out[np.abs(ref) >= 2.0**128], np.sign(ref[np.abs(ref) >= 2.0**128]) * np.inf)
  special = np.array([0.0, -0.0, np.inf, -np.inf, np.nan], np.float32)
  for shift in (-200, 200):
    np.testing.assert_array_equal(jax.jit(_float8.unscale)(special, np.int32(shift)), special)


def test_scaling_by_a_power_of_two_gives_the_same_codes():
  x = normal((128,))
  q, k = _float8.quantize(jnp.asarray(x), E4M3)
  for j in (-40, -20, 13, 60):
    qj, kj = _float8.quantize(jnp.asarray(np.ldexp(x, j)), E4M3)
    np.testing.assert_array_equal(np.asarray(qj).view(np.uint8), np.asarray(q).view(np.uint8))
    assert int(kj) == int(k) - j


# --- the product ----------------------------------------------------------------------------------


def check_forward(a, b, compute=jnp.float32, dims=MATMUL):
  """The float8 product against float64: within the format's bound; against the float64 product of
  the reference's float8 values, within float32's summation bound alone (the quantization is the
  reference's, bit for bit, so only the order of the sum may differ). Returns the bound's share used."""
  y = jax.jit(lambda a, b: float8_matmul(a, b, compute, dims))(a, b)
  assert y.dtype == np.dtype(compute)
  y = np.asarray(y, np.float64)
  (qa, ka), (qb, kb) = reference_quantize(a, E4M3), reference_quantize(b, E4M3)
  terms = int(np.prod([np.shape(a)[d] for d in dims[0][0]]))
  exact = np.ldexp(dot64(qa.astype(np.float64), qb.astype(np.float64), dims), -(ka + kb))
  product = lambda x, z: dot64(x, z, dims)
  # Cast to the compute dtype: half an ulp of the result (2**-24 for float32, 2**-8 for bfloat16).
  cast = 2.0 ** -(jnp.finfo(compute).nmant + 1)
  magnitudes = np.ldexp(product(np.abs(qa.astype(float)), np.abs(qb.astype(float))), -(ka + kb))
  summed = (terms * ACCUMULATION_UNIT / (1 - terms * ACCUMULATION_UNIT)) * magnitudes
  assert (np.abs(y - exact) <= summed * (1 + cast) + cast * np.abs(exact)).all()
  bound = error_bound(product, a, b, ka, kb, E4M3, E4M3, terms) * (1 + cast) + cast * np.abs(exact)
  error = np.abs(y - dot64(a, b, dims))
  assert (error <= bound).all(), np.max(error / bound)
  return float(np.max(error / bound))


def test_product_within_the_formats_bound():
  share = check_forward(normal((64, 96)), normal((96, 80), seed=1))
  if ACCUMULATION_UNIT == 2.0**-24:  # float32's sum: the bound is not vacuous, the errors reach a fair part of it
    assert share > 0.05


def test_product_in_bfloat16():
  check_forward(normal((32, 64)), normal((64, 48), seed=1), compute=jnp.bfloat16)


@pytest.mark.parametrize(
    "shapes,dims",
    [
        (((2, 5, 3, 4), (4, 2, 3, 6)), (((3, 2), (0, 2)), ((0,), (1,)))),  # two contracted, permuted, a batch
        (((7, 3, 16), (3, 16, 7)), (((2,), (1,)), ((1,), (0,)))),  # the batch last on the left
        (((16,), (16, 5)), (((0,), (0,)), ((), ()))),  # a vector
    ],
    ids=["permuted", "batch_inside", "vector"],
)
def test_product_with_any_dimension_numbers(shapes, dims):
  check_forward(normal(shapes[0]), normal(shapes[1], seed=1), dims=dims)


@pytest.mark.parametrize("factor", [1e-6, 1.0, 1e4])
def test_scale_invariance(factor):
  """At 1e-6 and 1e4 the product keeps the bound it keeps at 1: the bound is relative (u) plus a
  subnormal term relative to each operand's amax, so it scales with the inputs."""
  a, b = normal((64, 96)) * np.float32(factor), normal((96, 80), seed=1) * np.float32(factor)
  check_forward(a, b)
  if factor != 1.0:  # float8 without the scale: 1e-6 flushes to zero, 1e4 overflows to NaN
    plain = dot64(a.astype(E4M3).astype(np.float64), b.astype(E4M3).astype(np.float64))
    (_, ka), (_, kb) = reference_quantize(a, E4M3), reference_quantize(b, E4M3)
    bound = error_bound(dot64, a, b, ka, kb, E4M3, E4M3, 96)
    assert not (np.abs(plain - dot64(a, b)) <= bound).all()


def test_convolution_within_the_formats_bound(x64):
  x, w = normal((2, 8, 9, 9)), normal((16, 8, 3, 3), seed=1)
  conv = lambda a, b: lax.conv(a, b, (1, 1), "SAME")
  primitive, params = operation(conv, x, w)
  y = np.asarray(_float8._scaled(primitive, params, jnp.float32, F32, F32)(x, w), np.float64)
  conv64 = lambda a, b: np.asarray(conv(np.asarray(a, np.float64), np.asarray(b, np.float64)))
  (_, ka), (_, kb) = reference_quantize(x, E4M3), reference_quantize(w, E4M3)
  bound = error_bound(conv64, x, w, ka, kb, E4M3, E4M3, 8 * 9)
  assert (np.abs(y - conv64(x, w)) <= bound).all()


# --- the gradients, in e5m2 ----------------------------------------------------------------------


def dot_vjp64(a, b, g, dims):
  """The cotangents of dot_general's operands in float64, by JAX's own rule (x64 on)."""
  a, b, g = (jnp.asarray(x, jnp.float64) for x in (a, b, g))
  _, pullback = jax.vjp(lambda a, b: lax.dot_general(a, b, dims), a, b)
  return [np.asarray(x) for x in pullback(g)]


GRADIENT_CASES = {
    "matrix": ((48, 64), (64, 32), MATMUL),
    "permuted": ((2, 5, 3, 16), (16, 2, 3, 6), (((3, 2), (0, 2)), ((0,), (1,)))),
    # No GEMM size a multiple of 16 (M 3 * 17, K 50, N 35): every operand and the gradient padded with zeros.
    "unaligned": ((3, 17, 50), (50, 35), (((2,), (0,)), ((), ()))),
}


@pytest.mark.parametrize("lhs, rhs, dims", [
    ((8, 1024, 768), (50257, 768), (((2,), (1,)), ((), ()))),  # GPT-2's tied logits
    ((3, 17, 50), (50, 35), (((2,), (0,)), ((), ()))),
    ((2, 5, 3, 16), (16, 2, 3, 6), (((3, 2), (0, 2)), ((0,), (1,)))),
    ((4, 6, 10), (4, 10, 12), (((2,), (1,)), ((0,), (0,)))),
])
def test_gemm_padding_makes_each_gemm_size_a_multiple_of_16(lhs, rhs, dims):
  """M (the lhs's kept sizes' product), N (the rhs's) and K (the contracted sizes') become multiples of 16,
  each by growing one dimension by less than 16, the two operands' contracted dimensions alike."""
  lhs_pads, rhs_pads, out_pads = _float8._gemm_padding({"dimension_numbers": dims}, lhs, rhs)
  (lc, rc), (lb, rb) = dims
  padded_l = [n + p for n, p in zip(lhs, lhs_pads)]
  padded_r = [n + p for n, p in zip(rhs, rhs_pads)]
  kept_l = [d for d in range(len(lhs)) if d not in lc and d not in lb]
  kept_r = [d for d in range(len(rhs)) if d not in rc and d not in rb]
  for shape, group in ((padded_l, kept_l), (padded_r, kept_r), (padded_l, lc)):
    assert math.prod(shape[d] for d in group) % 16 == 0
  assert [padded_l[d] for d in lc] == [padded_r[d] for d in rc]
  assert all(0 <= p < 16 for p in (*lhs_pads, *rhs_pads)) and sum(p > 0 for p in lhs_pads) <= 2
  assert all(lhs_pads[d] == 0 for d in lb) and all(rhs_pads[d] == 0 for d in rb)
  out = jax.eval_shape(lambda a, b: lax.dot_general(a, b, dims), jnp.zeros(padded_l), jnp.zeros(padded_r))
  assert list(out_pads) == [n - m for n, m in zip(out.shape, lax.dot_general(
      jnp.zeros(lhs), jnp.zeros(rhs), dims).shape)]
  if lhs == (8, 1024, 768):
    assert rhs_pads == (15, 0) and lhs_pads == (0, 0, 0)


@pytest.mark.parametrize("g_scale", [1e-8, 1.0, 1e6])
@pytest.mark.parametrize("case", list(GRADIENT_CASES))
def test_gradients_in_e5m2_within_the_formats_bound(case, g_scale, x64):
  """Gradients of 1e-8 are below e5m2's smallest subnormal (2**-16) and 1e6 above its largest
  (57344): scaled, they neither flush nor overflow, and keep the bound they keep at 1."""
  a_shape, b_shape, dims = GRADIENT_CASES[case]
  a, b = normal(a_shape), normal(b_shape, seed=1)
  y, pullback = jax.vjp(lambda a, b: float8_matmul(a, b, dims=dims), jnp.asarray(a), jnp.asarray(b))
  g = normal(y.shape, seed=2, scale=g_scale)
  da, db = pullback(jnp.asarray(g))
  assert da.dtype == db.dtype == F32
  (_, ka), (_, kb), (_, kg) = (reference_quantize(x, f) for x, f in ((a, E4M3), (b, E4M3), (g, E5M2)))
  ref_da, ref_db = dot_vjp64(a, b, g, dims)
  lhs_product = lambda x, z: dot_vjp64(np.zeros(a_shape), z, x, dims)[0]  # (g, b) -> the lhs's cotangent
  rhs_product = lambda x, z: dot_vjp64(z, np.zeros(b_shape), x, dims)[1]  # (g, a) -> the rhs's
  # Each element of a cotangent sums over g's elements that share its non-contracted coordinates.
  terms_a = int(g.size // np.prod([a_shape[d] for d in range(a.ndim) if d not in dims[0][0]]))
  terms_b = int(g.size // np.prod([b_shape[d] for d in range(b.ndim) if d not in dims[0][1]]))
  bound_a = error_bound(lhs_product, g, b, kg, kb, E5M2, E4M3, terms_a)
  bound_b = error_bound(rhs_product, g, a, kg, ka, E5M2, E4M3, terms_b)
  assert (np.abs(np.asarray(da, np.float64) - ref_da) <= bound_a).all()
  assert (np.abs(np.asarray(db, np.float64) - ref_db) <= bound_b).all()
  # The bounds say something: gradients flushed to zero (or overflowed) would break them.
  assert (np.abs(ref_da) > bound_a).mean() > 0.2 and (np.abs(ref_db) > bound_b).mean() > 0.2
  if g_scale != 1.0:  # and would be, without the scale
    assert not np.isfinite(g.astype(E5M2).astype(float)).all() or not g.astype(E5M2).astype(float).any()


def test_convolution_gradients_within_the_formats_bound(x64):
  x, w = normal((2, 8, 9, 9)), normal((16, 8, 3, 3), seed=1)
  conv = lambda a, b: lax.conv(a, b, (1, 1), "SAME")
  primitive, params = operation(conv, x, w)
  y, pullback = jax.vjp(_float8._scaled(primitive, params, jnp.float32, F32, F32), jnp.asarray(x), jnp.asarray(w))
  g = normal(y.shape, seed=2, scale=1e-7)
  dx, dw = pullback(jnp.asarray(g))
  (_, kx), (_, kw), (_, kg) = (reference_quantize(v, f) for v, f in ((x, E4M3), (w, E4M3), (g, E5M2)))
  def vjp64(a, b, c):
    a, b, c = (jnp.asarray(v, jnp.float64) for v in (a, b, c))
    return jax.vjp(conv, a, b)[1](c)

  ref_dx, ref_dw = (np.asarray(r) for r in vjp64(x, w, g))
  bound_x = error_bound(lambda c, b: np.asarray(vjp64(np.zeros(x.shape), b, c)[0]), g, w, kg, kw, E5M2, E4M3, 16 * 9)
  bound_w = error_bound(lambda c, a: np.asarray(vjp64(a, np.zeros(w.shape), c)[1]), g, x, kg, kx, E5M2, E4M3, 2 * 81)
  assert (np.abs(np.asarray(dx, np.float64) - ref_dx) <= bound_x).all()
  assert (np.abs(np.asarray(dw, np.float64) - ref_dw) <= bound_w).all()


def test_gradients_reach_each_operand_in_its_own_dtype():
  a, b = jnp.asarray(normal((32, 16)), jnp.bfloat16), jnp.asarray(normal((16, 32)))
  y, pullback = jax.vjp(lambda a, b: float8_matmul(a, b, compute=jnp.bfloat16), a, b)
  da, db = pullback(jnp.ones_like(y))
  assert (y.dtype, da.dtype, db.dtype) == (jnp.bfloat16, jnp.bfloat16, F32)


def summation_bound(exact_magnitudes, terms, out_dtype):
  """Float32's summation of ``terms`` exact float8 products (``exact_magnitudes``: the sum of their
  magnitudes, unscaled) in any order (Higham 3.1), then one rounding to ``out_dtype``: the whole error
  of a product whose operands are the reference's float8 values (a power-of-two unscaling is exact)."""
  gamma = terms * ACCUMULATION_UNIT / (1 - terms * ACCUMULATION_UNIT)
  cast = 2.0 ** -(jnp.finfo(out_dtype).nmant + 1)
  return lambda exact: gamma * exact_magnitudes * (1 + cast) + cast * np.abs(exact)


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_the_backward_reads_the_float8_weight_the_forward_read(jit):
  """A weight read by two matmuls, through autocast: each input's gradient is the e5m2 gradient times
  the forward's e4m3 weight (ml_dtypes' rounding of the weight times its scale) to float32's summation
  error alone. A backward that read another rounding of the weight (e5m2, another scale, the float32
  weight) would be off by up to 2**-4 of a term: the check below shows the bound tells them apart."""
  w, x, z = normal((96, 80), scale=0.3), normal((64, 96), seed=1), normal((32, 96), seed=2, scale=50.0)
  g1, g2 = normal((64, 80), seed=3), normal((32, 80), seed=4, scale=1e-5)
  cast = jaxscale.autocast(lambda w, x, z: (x @ w, z @ w), "mixed_float8")
  vjp = jax.jit(lambda *args: jax.vjp(cast, *args)[1]) if jit else (lambda *args: jax.vjp(cast, *args)[1])
  _, dx, dz = vjp(*(jnp.asarray(v) for v in (w, x, z)))((jnp.asarray(g1), jnp.asarray(g2)))
  assert dx.dtype == dz.dtype == F32
  qw, kw = reference_quantize(w, E4M3)
  qw = qw.astype(np.float64)
  # The outputs were bfloat16 (the compute dtype), cast to float32: their cotangents come back through
  # that cast, as bfloat16, before the e5m2 quantization.
  for grad, g in ((dx, g1), (dz, g2)):
    qg, kg = reference_quantize(np.asarray(g, ml_dtypes.bfloat16).astype(np.float64), E5M2)
    qg = qg.astype(np.float64)
    exact = np.ldexp(qg @ qw.T, -(kg + kw))
    bound = summation_bound(np.ldexp(np.abs(qg) @ np.abs(qw).T, -(kg + kw)), 80, np.float32)(exact)
    assert (np.abs(np.asarray(grad, np.float64) - exact) <= bound).all()
    other = np.ldexp(qg, -kg) @ w.astype(np.float64).T  # the same gradient with the unquantized weight
    assert (np.abs(other - exact) > bound).mean() > 0.5


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("shift", [0, 60, -60], ids=lambda j: f"scales{j:+d}")
def test_the_gpus_form_of_the_product_is_the_single_factors_value(dtype, shift):
  """A GPU multiplies the float32 sum of the exact float8 products by each operand's 2**-k (cuBLASLt's
  A and B scales; `_dequantized_product`), where the rule used to multiply it by one factor
  2**-(ka + kb) (cuBLASLt's alpha): one exact power-of-two scaling then one rounding either way, so the
  two are the same value wherever the result is a normal float32, bit for bit, and equal to the CPU's
  form (`unscale`). Run here on the CPU (where XLA scales the operands before the sum, the same exact
  scalings), at scales that move ka + kb to -78, 12 and 102, the products staying in float32's range."""
  a, b = normal((48, 64), scale=2.0**shift), normal((64, 40), seed=1, scale=2.0 ** (shift // 2))
  (qa, ka), (qb, kb) = _float8.quantize(jnp.asarray(a), E4M3), _float8.quantize(jnp.asarray(b), E4M3)
  product = lambda a, b, out: lax.dot_general(a, b, MATMUL, preferred_element_type=out)
  gpu = jax.jit(lambda *args: _float8._dequantized_product(product, args[:2], args[2:], dtype))(qa, qb, ka, kb)
  cpu = _float8.unscale(product(qa, qb, F32), ka + kb).astype(dtype)
  assert gpu.dtype == np.dtype(dtype)
  single = (product(qa, qb, F32) * _numerics.power_of_two(-(ka + kb))).astype(dtype)
  np.testing.assert_array_equal(np.asarray(gpu, np.float64), np.asarray(single, np.float64))
  np.testing.assert_array_equal(np.asarray(gpu, np.float64), np.asarray(cpu, np.float64))


# --- zeros, inf, NaN -----------------------------------------------------------------------------


def test_zero_operand_gives_zeros_and_finite_gradients():
  a, b = jnp.zeros((16, 32)), jnp.asarray(normal((32, 16)))
  y, pullback = jax.vjp(float8_matmul, a, b)
  da, db = pullback(jnp.asarray(normal((16, 16), seed=2)))
  np.testing.assert_array_equal(y, 0.0)
  np.testing.assert_array_equal(db, 0.0)
  assert np.isfinite(da).all() and (da != 0).any()
  _, zero_pullback = jax.vjp(float8_matmul, jnp.asarray(normal((16, 32))), b)
  np.testing.assert_array_equal(zero_pullback(jnp.zeros((16, 16)))[0], 0.0)


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_a_non_finite_input_stays_visible(bad):
  """A NaN or inf is not scaled or quantized away: its row of the result is not finite (inf becomes
  NaN in e4m3fn, which has no inf), and a non-finite gradient reaches both operands' gradients."""
  a, b = normal((16, 32)), jnp.asarray(normal((32, 16), seed=1))
  a[3, 5] = bad
  y, pullback = jax.vjp(float8_matmul, jnp.asarray(a), b)
  assert not np.isfinite(y[3]).any()
  g = normal((16, 16), seed=2)
  g[7, 2] = bad
  da, db = pullback(jnp.asarray(g))
  assert not np.isfinite(da[7]).any() and not np.isfinite(db[:, 2]).all()


# --- the policy ----------------------------------------------------------------------------------


def test_the_preset_is_mixed_bfloat16_with_float8_matmuls():
  policy = jaxscale.get_policy("mixed_float8")
  assert (policy.param_dtype, policy.compute_dtype, policy.output_dtype) == (F32, np.dtype(jnp.bfloat16), F32)
  assert policy.matmul_dtype == E4M3 and jaxscale.get_policy("mixed_bfloat16").matmul_dtype is None
  assert str(policy) == "params=float32,compute=bfloat16,output=float32,matmul=float8_e4m3fn"
  assert jaxscale.get_policy(str(policy)) == policy == jaxscale.get_policy("p=f32,c=bf16,o=f32,m=f8")
  assert jaxscale.needs_loss_scaling(policy) is False and jaxscale.needs_loss_scaling("mixed_float8") is False
  assert jaxscale.needs_loss_scaling("p=f32,c=f16,o=f32,m=f8") is True  # float16 elementwise work still underflows


@pytest.mark.parametrize("field", ["param_dtype", "compute_dtype", "output_dtype"])
def test_a_float8_policy_dtype_says_to_use_the_preset(field):
  dtypes = {"param_dtype": F32, "compute_dtype": F32, "output_dtype": F32, field: jnp.float8_e4m3fn}
  message = f"`Policy.{field}` cannot be the float8 dtype float8_e4m3fn: .* Use the preset 'mixed_float8'"
  with pytest.raises(ValueError, match=message):
    jaxscale.Policy(**dtypes)


def test_a_matmul_dtype_other_than_e4m3_is_refused():
  with pytest.raises(ValueError, match="`Policy.matmul_dtype` must be None .* or float8_e4m3fn"):
    jaxscale.Policy(F32, jnp.bfloat16, F32, jnp.float8_e5m2)
  with pytest.raises(ValueError, match="Unknown matmul dtype 'f16' in policy 'm=f16'; the one there is 'float8'"):
    jaxscale.get_policy("m=f16")


# --- autocast: any model, every matmul in float8 ---------------------------------------------------

WIDER = "jaxscale_float8_wider_"  # the name of the jit around a matmul kept wider, and why


def matmuls(jaxpr, reason=None):
  """(dtypes of the operands, reason) of every matmul at any depth; reason: the wider jit it sits in.
  Of a `lax.platform_dependent`, the branch this backend runs."""
  # The platforms of each branch, by the variable a `platform_index` writes (for releases whose
  # cond carries no `branches_platforms`).
  platform_of = {}
  for eqn in jaxpr.eqns:
    if eqn.primitive.name == "platform_index":
      platform_of[id(eqn.outvars[0])] = eqn.params["platforms"]
    if eqn.primitive.name in ("dot_general", "conv_general_dilated"):
      yield tuple(np.dtype(v.aval.dtype) for v in eqn.invars), reason
    name = str(eqn.params.get("name", ""))
    inner_reason = name.split(WIDER)[1].rstrip(")") if WIDER in name else reason
    params = eqn.params
    platforms = params.get("branches_platforms") or (eqn.invars and platform_of.get(id(eqn.invars[0])))
    if eqn.primitive.name == "cond" and platforms:
      here = [i for i, names in enumerate(platforms) if names is not None and jax.default_backend() in names]
      params = {"branches": [params["branches"][(here or [platforms.index(None)])[0]]]}
    for value in params.values():
      for item in value if isinstance(value, (tuple, list)) else (value,):
        inner = getattr(item, "jaxpr", item)
        if hasattr(inner, "eqns"):
          yield from matmuls(inner, inner_reason)


def assert_float8(fun, *args, wider=()):
  """In the jaxpr of `jax.grad(fun)`, each matmul is float8 (forward e4m3 x e4m3, backward the e5m2
  gradient times an e4m3 operand) or sits in a jit marked with one of the reasons in `wider`."""
  found = list(matmuls(jax.make_jaxpr(jax.grad(fun))(*args).jaxpr))
  kinds = set()
  for dtypes, reason in found:
    if reason == "tpu":  # each float8 matmul's bfloat16 alternative, lowered on a TPU only
      continue
    if reason is not None:
      assert reason in wider, (dtypes, reason)
      kinds.add(reason)
    else:
      # The right operand's gradient takes the e5m2 gradient on the right: its GEMM writes that layout.
      dtypes = dtypes[::-1] if dtypes == (E4M3, E5M2) else dtypes
      assert dtypes in ((E4M3, E4M3), (E5M2, E4M3)), dtypes
      kinds.add(dtypes)
  assert {(E4M3, E4M3), (E5M2, E4M3)} <= kinds and set(wider) <= kinds
  return found


def assert_close_to_float32(cast_loss, loss, params, *args):
  """Loss and gradients near float32's, gradients in float32.

  Each float8 matmul's operands round by up to 2**-4 (e4m3) and the gradient by 2**-3 (e5m2)
  relative, so an element of a product is off by up to about 2**-3 of the sum of its terms'
  magnitudes (the bound of the tests above), and so is the loss of near-uniform logits; a gradient
  as a whole (norm) by a few times that, through the two or three matmuls of these models.
  """
  value, grads = jax.jit(jax.value_and_grad(cast_loss))(params, *args)
  ref_value, ref_grads = jax.jit(jax.value_and_grad(loss))(params, *args)
  assert value.dtype == F32 and abs(float(value) - float(ref_value)) <= 2.0**-3 * abs(float(ref_value))
  for g, r in zip(jax.tree.leaves(grads), jax.tree.leaves(ref_grads)):
    assert g.dtype == r.dtype == F32
    assert np.linalg.norm(np.asarray(g) - np.asarray(r)) <= 0.5 * np.linalg.norm(np.asarray(r))
  step = jax.jit(jax.value_and_grad(cast_loss))
  for _ in range(3):
    jax.block_until_ready(step(params, *args))
  assert compilations(step) == 1


def cross_entropy(logits, labels):
  return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()


def data(n=32, d=32, classes=5):
  return jax.random.normal(jax.random.key(1), (n, d)), jax.random.randint(jax.random.key(2), (n,), 0, classes)


def check_model(loss, params, *args, wider=("small",)):
  """The model under "mixed_float8": float8 matmuls; the 5-class logits (5 < 16) kept wider."""
  cast_loss = jaxscale.autocast(loss, "mixed_float8")
  assert_float8(cast_loss, params, *args, wider=wider)
  assert_close_to_float32(cast_loss, loss, params, *args)


def test_linen_model_whose_every_layer_says_float32():
  import flax.linen as nn

  class Net(nn.Module):
    @nn.compact
    def __call__(self, x):
      x = nn.Dense(64, dtype=jnp.float32, param_dtype=jnp.float32)(x)
      x = nn.LayerNorm(dtype=jnp.float32)(nn.gelu(x))
      x = nn.Conv(16, (3,), dtype=jnp.float32)(x.reshape(x.shape[0], 4, 16)).reshape(x.shape[0], -1)
      return nn.Dense(5, dtype=jnp.float32)(nn.relu(x))

  x, y = data()
  model = Net()
  params = model.init(jax.random.key(0), x)
  check_model(lambda p, x, y: cross_entropy(model.apply(p, x), y), params, x, y, wider=("small", "conv_backward"))


def test_nnx_model_with_float32_param_dtype_and_dtype():
  from flax import nnx

  class Net(nnx.Module):
    def __init__(self, rngs):
      kw = {"dtype": jnp.float32, "param_dtype": jnp.float32, "rngs": rngs}
      self.hidden, self.norm, self.out = nnx.Linear(32, 64, **kw), nnx.LayerNorm(64, **kw), nnx.Linear(64, 5, **kw)

    def __call__(self, x):
      return self.out(nnx.relu(self.norm(self.hidden(x))))

  x, y = data()
  graphdef, state = nnx.split(Net(nnx.Rngs(0)))
  check_model(lambda s, x, y: cross_entropy(nnx.merge(graphdef, s)(x), y), state, x, y)


def test_equinox_mlp():
  import warnings

  with warnings.catch_warnings():  # equinox 0.13.0 touches a name that jax 0.7.1 deprecates, at import
    warnings.simplefilter("ignore", DeprecationWarning)
    import equinox as eqx

  mlp = eqx.nn.MLP(32, 5, 64, depth=2, key=jax.random.key(0))
  params, static = eqx.partition(mlp, eqx.is_array)
  check_model(lambda p, x, y: cross_entropy(jax.vmap(eqx.combine(p, static))(x), y), params, *data())


def test_plain_jax_scan_over_layers_with_remat_and_a_custom_vjp_activation():
  @jax.custom_vjp
  def soft_clip(x):
    return 4 * jnp.tanh(x / 4)

  soft_clip.defvjp(lambda x: (soft_clip(x), x), lambda x, g: (g * (1 - jnp.tanh(x / 4) ** 2),))

  def loss(params, x, y):
    @jax.checkpoint
    def layer(h, w):
      return soft_clip(h @ w), None

    h, _ = jax.lax.scan(layer, x, params["stack"])
    return cross_entropy(h @ params["out"], y)

  keys = jax.random.split(jax.random.key(0), 2)
  params = {"stack": jax.random.normal(keys[0], (3, 32, 32)) / 6, "out": jax.random.normal(keys[1], (32, 5)) / 6}
  check_model(loss, params, *data())


# --- the report ----------------------------------------------------------------------------------


def test_report_counts_float8_forward_and_backward_and_says_what_stayed_wider():
  """Two layers by hand: x[32,32] @ w1[32,64] in float8, the 5-wide logits h @ w2[64,5] kept in
  bfloat16 (5 < 16). A matmul of [m,k] by [k,n] is 2*m*k*n FLOPs; the backward has two per layer
  (both operands' cotangents; `make_jaxpr` drops neither)."""

  def loss(params, x):
    h = jnp.tanh(x @ params["w1"])
    return jnp.mean(jax.nn.logsumexp(h @ params["w2"], axis=-1))

  params = {"w1": jnp.ones((32, 64)) / 32, "w2": jnp.ones((64, 5)) / 64}
  x = jnp.asarray(normal((32, 32)))
  cast = jaxscale.autocast(loss, "mixed_float8")
  first, second = 2.0 * 32 * 32 * 64, 2.0 * 32 * 64 * 5
  forward = jaxscale.precision_report(cast, params, x)
  assert forward.matmul_flops == {"float8_e4m3fn": first, "bfloat16": second}
  assert forward.kept_wider == {"small": second}
  report = jaxscale.precision_report(jax.grad(cast), params, x)
  assert report.matmul_flops == {"float8_e4m3fn": first, "float8_e5m2": 2 * first, "bfloat16": 3 * second}
  assert report.kept_wider == {"small": 3 * second}
  assert report.share("float8_e4m3fn") + report.share("float8_e5m2") == 3 * first / (3 * first + 3 * second)
  text = str(report)
  assert "float8_e5m2" in text and "float8: " in text
  assert "(small): a contracted size or an output dimension below 16" in text


def test_on_a_tpu_the_matmuls_are_bfloat16_chosen_where_the_program_is_lowered():
  """No TPU before Ironwood has a float8 matrix unit: the program lowered for a TPU holds no float8 and
  is counted as "mixed_bfloat16"'s (the peer: the same function under that policy); the program lowered
  for a GPU, on the same trace, keeps its float8 matmuls. Lowering for a platform needs none of its devices."""

  def loss(w, x):
    return jnp.mean(jnp.square(x @ w))

  w, x = jnp.ones((2048, 2048)) / 2048, jnp.ones((2048, 2048))  # intensity 683: float8 on a GPU
  grad = jax.grad(jaxscale.autocast(loss, "mixed_float8"))
  # The operand types of each matmul in the StableHLO lowered for each platform (forward, and w's
  # gradient: x's is not used, and not lowered). The float8 residuals
  # that both branches carry are dead on a TPU, and XLA drops them (the TPU program's budgets).
  from jax import export  # a submodule jax 0.7 does not import with jax

  modules = {p: export.export(jax.jit(grad), platforms=[p])(w, x).mlir_module() for p in ("tpu", "cuda")}
  operands = {
      p: [line.split(" : (")[1].split(") -> ")[0] for line in module.splitlines() if "stablehlo.dot_general" in line]
      for p, module in modules.items()
  }
  assert operands["tpu"] and not any("f8E" in types for types in operands["tpu"]), operands["tpu"]
  # On a GPU each product reads its float8 operands widened and times their scales, the form XLA:GPU
  # rewrites into one FP8 GEMM: the forward's e4m3 and the backward's e5m2 values are in the program.
  assert len(operands["cuda"]) == 2, operands["cuda"]
  assert "f8E4M3FN" in modules["cuda"] and "f8E5M2" in modules["cuda"]
  tpu = jaxscale.precision_report(grad, w, x, platform="tpu")
  bf16 = jaxscale.precision_report(jax.grad(jaxscale.autocast(loss, "mixed_bfloat16")), w, x, platform="tpu")
  assert tpu.matmul_flops == bf16.matmul_flops == {"bfloat16": 2 * 2.0 * 2048**3}  # forward, and w's gradient
  assert tpu.kept_wider == {"tpu": 2 * 2.0 * 2048**3} and "on a TPU: its matrix units take bfloat16" in str(tpu)
  gpu = jaxscale.precision_report(grad, w, x, platform="gpu")
  assert gpu.matmul_flops == {"float8_e4m3fn": 2.0 * 2048**3, "float8_e5m2": 2 * 2.0 * 2048**3} and not gpu.kept_wider
  with pytest.raises(ValueError, match="takes one of 'cpu', 'tpu', 'gpu', 'cuda', 'rocm'; got 'metal'"):
    jaxscale.precision_report(grad, w, x, platform="metal")


def test_report_names_the_convolution_backward():
  def loss(w, x):
    return jnp.sum(jax.lax.conv(x, w, (1, 1), "SAME") ** 2)

  w, x = jnp.asarray(normal((16, 16, 3, 3))), jnp.asarray(normal((2, 16, 8, 8), seed=1))
  report = jaxscale.precision_report(jax.grad(jaxscale.autocast(loss, "mixed_float8")), w, x)
  flops = 2.0 * 2 * 8 * 8 * 16 * 16 * 9  # output elements times 2 * (in features * window)
  assert report.matmul_flops == {"float8_e4m3fn": flops, "bfloat16": 2 * flops}  # never float32
  assert report.kept_wider == {"conv_backward": 2 * flops}
  assert "`lax.conv_general_dilated` takes one dtype for both operands" in str(report)


def test_integer_matmuls_are_left_as_they_are():
  def f(a, b, w, x):
    return (a @ b).astype(jnp.float32).sum() + (x @ w).sum()

  a, b = jnp.ones((32, 32), jnp.int32), jnp.ones((32, 32), jnp.int32)
  report = jaxscale.precision_report(jaxscale.autocast(f, "mixed_float8"), a, b, jnp.ones((32, 32)), jnp.ones((32, 32)))
  assert report.matmul_flops == {"int32": 2.0 * 32**3, "float8_e4m3fn": 2.0 * 32**3}


def intensity(m, k, n):
  """Multiply-adds per element read or written by an [m,k] x [k,n] product, in exact integers."""
  return m * k * n / (m * k + k * n + m * n)


@pytest.mark.parametrize(
    "m,k,n",
    [
        (8192, 4096, 4096), (4096, 1024, 1024), (1536, 1536, 1536), (1533, 1533, 1533), (2048, 256, 2048),
        (32, 32, 64),
    ],
    ids=["projection", "small_projection", "at_the_rule", "just_below", "attention_scores", "tiny"],
)
def test_a_matmul_too_small_for_float8_to_pay_stays_bfloat16_forward_and_backward(m, k, n, monkeypatch):
  """Traced only (nothing runs): each of the three products, forward and backward, is float8 exactly
  when the forward's intensity reaches the rule, else bfloat16 with the reason in the report."""
  monkeypatch.setattr(_float8, "MIN_INTENSITY", RULE)
  cast = jaxscale.autocast(lambda w, x: jnp.sum(jnp.tanh(x @ w)), "mixed_float8")
  w, x = jax.ShapeDtypeStruct((k, n), jnp.float32), jax.ShapeDtypeStruct((m, k), jnp.float32)
  said = contextlib.nullcontext() if intensity(m, k, n) >= RULE else pytest.warns(UserWarning, match=NONE_FLOAT8)
  with said:  # the one matmul stays bfloat16: the warning says so
    report = jaxscale.precision_report(jax.grad(cast, argnums=(0, 1)), w, x)
  flops = 2.0 * m * k * n
  if intensity(m, k, n) >= RULE:
    assert report.matmul_flops == {"float8_e4m3fn": flops, "float8_e5m2": 2 * flops} and not report.kept_wider
  else:
    assert report.matmul_flops == {"bfloat16": 3 * flops} and report.kept_wider == {"intensity": 3 * flops}
    assert "(intensity): fewer multiply-adds per element it reads or writes" in str(report)


def test_the_rule_keeps_a_batched_attention_product_wider_and_the_projections_float8(monkeypatch):
  """Attention's scores (head size 64, 1024 positions: intensity 57) stay bfloat16; its projection
  (4096 x 1024 x 3072: 648) runs in float8."""
  monkeypatch.setattr(_float8, "MIN_INTENSITY", RULE)

  def f(w, x):
    q, k, _ = jnp.split((x @ w).reshape(4, 1024, 3, 16, 64), 3, axis=2)
    return jnp.sum(jnp.einsum("bqhd,bkhd->bhqk", q[:, :, 0], k[:, :, 0]))

  w, x = jnp.zeros((1024, 3072)), jnp.zeros((4096, 1024))
  report = jaxscale.precision_report(jaxscale.autocast(f, "mixed_float8"), w, x)
  scores = 2.0 * 4 * 16 * 1024 * 1024 * 64
  assert report.matmul_flops == {"float8_e4m3fn": 2.0 * 4096 * 1024 * 3072, "bfloat16": scores}
  assert set(report.kept_wider) == {"intensity"}


@pytest.mark.parametrize("channels,float8", [(256, False), (1024, True)], ids=["256_channels", "1024_channels"])
def test_a_convolution_needs_three_times_the_intensity(channels, float8, monkeypatch):
  """A 3x3 convolution of C channels at 28x28 has intensity about 9 C / 2 (its input and output are the
  same size): 1150 for 256, below 3 * 512 (only its forward product gains); 4600 for 1024, above."""
  monkeypatch.setattr(_float8, "MIN_INTENSITY", RULE)

  def f(w, x):
    return jnp.sum(lax.conv_general_dilated(x, w, (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC")))

  w = jax.ShapeDtypeStruct((3, 3, channels, channels), jnp.float32)
  x = jax.ShapeDtypeStruct((32, 28, 28, channels), jnp.float32)
  with contextlib.nullcontext() if float8 else pytest.warns(UserWarning, match=NONE_FLOAT8):
    report = jaxscale.precision_report(jax.grad(jaxscale.autocast(f, "mixed_float8"), argnums=(0, 1)), w, x)
  flops = 2.0 * 32 * 28 * 28 * channels * 9 * channels
  if float8:  # the backward's two products in bfloat16, on the float8 values
    assert report.matmul_flops == {"float8_e4m3fn": flops, "bfloat16": 2 * flops}
    assert report.kept_wider == {"conv_backward": 2 * flops}
  else:
    assert report.matmul_flops == {"bfloat16": 3 * flops} and report.kept_wider == {"intensity": 3 * flops}


# --- the size rule's threshold, a setting; a float8 function with no float8 matmul says so ------------


def test_min_intensity_is_the_h100s_512_by_default_and_a_key_of_the_policy_string(monkeypatch):
  monkeypatch.setattr(_float8, "MIN_INTENSITY", RULE)
  preset = jaxscale.get_policy("mixed_float8")
  assert preset.min_intensity == 512.0 and "min_intensity" not in str(preset)
  policy = jaxscale.get_policy("p=f32,c=bf16,o=f32,m=f8,min_intensity=64")
  assert policy.min_intensity == 64.0 and str(policy).endswith(",matmul=float8_e4m3fn,min_intensity=64")
  assert jaxscale.get_policy(str(policy)) == policy
  built = jaxscale.Policy(jnp.float32, jnp.bfloat16, jnp.float32, jnp.float8_e4m3fn, min_intensity=64)
  assert built == policy and hash(built) == hash(policy)
  assert jaxscale.get_policy("mixed_bfloat16").min_intensity is None


@pytest.mark.parametrize("value", [-1, "abc", float("inf"), float("nan"), True, None.__class__], ids=str)
def test_a_bad_min_intensity_is_an_error_that_says_what_works(value):
  with pytest.raises(ValueError, match=r"0 or more, got .*512 \(the default\).* 0 runs every matmul"):
    jaxscale.Policy(jnp.float32, jnp.bfloat16, jnp.float32, jnp.float8_e4m3fn, min_intensity=value)


@pytest.mark.parametrize("spec, said", [
    ("p=f32,c=bf16,o=f32,m=f8,min_intensity=-1", r"In policy .*min_intensity=-1.*0 or more"),
    ("p=f32,c=bf16,o=f32,m=f8,min_intensity=fast", r"In policy .*0 or more, got 'fast'"),
    ("p=f32,c=bf16,o=f32,min_intensity=0", r"no float8 matmuls: add .*'matmul=f8'"),
])
def test_a_bad_min_intensity_in_a_policy_string_names_the_string(spec, said):
  with pytest.raises(ValueError, match=said):
    jaxscale.get_policy(spec)


def test_a_threshold_without_float8_matmuls_is_an_error():
  with pytest.raises(ValueError, match="this policy has no float8 matmuls"):
    jaxscale.Policy(jnp.float32, jnp.bfloat16, jnp.float32, min_intensity=0)


def float8_at(min_intensity):
  return f"p=f32,c=bf16,o=f32,m=f8,min_intensity={min_intensity}"


@pytest.mark.parametrize("threshold, float8", [(0, True), (455, True), (456, False), (512, False)])
def test_the_policys_threshold_decides_each_matmul(threshold, float8):
  """4096 x 1024 x 1024 has intensity 455.1 (`intensity`, exact): float8 at a threshold up to 455, not above."""
  m, k, n = 4096, 1024, 1024
  assert 455 < intensity(m, k, n) < 456
  cast = jaxscale.autocast(lambda w, x: jnp.sum(jnp.tanh(x @ w)), float8_at(threshold))
  w, x = jax.ShapeDtypeStruct((k, n), jnp.float32), jax.ShapeDtypeStruct((m, k), jnp.float32)
  with contextlib.nullcontext() if float8 else pytest.warns(UserWarning, match=NONE_FLOAT8):
    report = jaxscale.precision_report(jax.grad(cast, argnums=(0, 1)), w, x)
  flops = 2.0 * m * k * n
  expected = {"float8_e4m3fn": flops, "float8_e5m2": 2 * flops} if float8 else {"bfloat16": 3 * flops}
  assert report.matmul_flops == expected


@pytest.mark.parametrize("threshold, float8", [(367, True), (368, False)])
def test_a_convolution_needs_three_times_the_policys_threshold(threshold, float8):
  """A SAME, stride-1 3x3 convolution of 256 channels at 28x28, batch 32: input and output the same size,
  so its intensity is out * 9C / (2 out + 9 C**2) = 1101.4, between 3 x 367 and 3 x 368."""
  c, out = 256, 32 * 28 * 28 * 256
  conv_intensity = out * 9 * c / (2 * out + 9 * c * c)
  assert 3 * 367 < conv_intensity < 3 * 368

  def f(w, x):
    return jnp.sum(lax.conv_general_dilated(x, w, (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC")))

  w, x = jax.ShapeDtypeStruct((3, 3, c, c), jnp.float32), jax.ShapeDtypeStruct((32, 28, 28, c), jnp.float32)
  with contextlib.nullcontext() if float8 else pytest.warns(UserWarning, match=NONE_FLOAT8):
    report = jaxscale.precision_report(jax.grad(jaxscale.autocast(f, float8_at(threshold)), argnums=(0, 1)), w, x)
  assert set(report.kept_wider) == ({"conv_backward"} if float8 else {"intensity"})


def two_small_matmuls(w1, w2, x):
  return jnp.sum(jnp.tanh(x @ w1) @ w2)


SMALL = {"w1": (128, 32), "w2": (32, 16), "x": (64, 128)}


def test_a_float8_function_with_no_float8_matmul_names_the_largest_product_and_its_intensity():
  w1, w2, x = (jnp.ones(SMALL[k]) for k in ("w1", "w2", "x"))
  with pytest.warns(UserWarning, match=NONE_FLOAT8) as said:
    jax.grad(jaxscale.autocast(two_small_matmuls, float8_at(512)))(w1, w2, x)
  (warning,) = said
  assert warning.filename == __file__  # the line that called it, not JAX's tracing machinery
  message = str(warning.message)
  assert "`two_small_matmuls` (test_float8.py:" in message and "runs none of its 2 matmuls in float8" in message
  # The largest product is x @ w1, [64,128] x [128,32]: intensity 64*128*32 / (64*128 + 128*32 + 64*32).
  assert "`dot_general` of [64, 128] and [128, 32]" in message
  assert f"intensity of {intensity(64, 128, 32):.0f} multiply-adds" in message and "min_intensity of 512" in message
  assert "'mixed_bfloat16'" in message and "min_intensity=0" in message


def test_the_warning_comes_once_per_trace_not_per_call():
  step = jax.jit(jax.grad(jaxscale.autocast(two_small_matmuls, float8_at(512))))
  with warnings.catch_warnings(record=True) as said:
    warnings.simplefilter("always")  # not Python's once-per-line: every warning JAX's tracing raises
    for _ in range(3):
      step(*(jnp.ones(SMALL[k]) for k in ("w1", "w2", "x")))
    assert len(said) == 1
    step(jnp.ones((128, 32)), jnp.ones((32, 16)), jnp.ones((32, 128)))  # a new shape: traced again
    assert len(said) == 2


@pytest.mark.parametrize("policy", [float8_at(0), "mixed_bfloat16"])
def test_no_warning_where_a_matmul_runs_in_float8_or_none_was_asked_for(policy):
  """pytest turns any warning into an error here (pyproject.toml)."""
  w1, w2, x = (jnp.ones(SMALL[k]) for k in ("w1", "w2", "x"))
  jax.jit(jax.grad(jaxscale.autocast(two_small_matmuls, policy)))(w1, w2, x)


# --- second order: refused by name, never zero ----------------------------------------------------

SECOND_ORDER = {
    "hessian_vector_product": lambda f, w, x: jax.jvp(jax.grad(f), (w, x), (w, jnp.zeros_like(x)))[1],
    "gradient_penalty": lambda f, w, x: jax.grad(lambda w: jnp.sum(jax.grad(f, argnums=1)(w, x) ** 2))(w),
    "hessian": lambda f, w, x: jax.hessian(f)(w, x),
    "reverse_over_reverse": lambda f, w, x: jax.grad(lambda w: jnp.vdot(jax.grad(f)(w, x), w))(w),
}


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
@pytest.mark.parametrize("name", list(SECOND_ORDER))
def test_a_second_order_derivative_is_an_error_that_names_float8(name, jit):
  """Its backward pass rounds to float8 (derivative zero almost everywhere): without the error, all
  four gave exactly 0.0. Refused after the first-order gradient ran too (a cached trace does not skip it)."""
  w, x = jnp.asarray(normal((32, 32), scale=0.2)), jnp.asarray(normal((32, 32), seed=1))
  cast = jaxscale.autocast(lambda w, x: jnp.mean(jnp.tanh(x @ w @ w) ** 2), "mixed_float8")
  assert float(jnp.abs(jax.grad(cast)(w, x)).sum()) > 0  # first order works, and is cached
  run = jax.jit(SECOND_ORDER[name], static_argnums=0) if jit else SECOND_ORDER[name]
  with pytest.raises(TypeError, match="second-order derivative .* float8 .* under 'mixed_bfloat16'"):
    run(cast, w, x)
  bf16 = jaxscale.autocast(lambda w, x: jnp.mean(jnp.tanh(x @ w @ w) ** 2), "mixed_bfloat16")
  assert float(jnp.abs(SECOND_ORDER[name](bf16, w, x)).max()) > 0  # the alternative the error names


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_a_first_order_gradient_inside_the_loss_under_stop_gradient_runs_as_bfloat16s_does(jit):
  """First-order SAM: the ascent step is a gradient taken inside the loss and cut by `stop_gradient`.
  JAX still linearizes that inner gradient (the float8 backward pass) before dropping it, which was
  refused as a second-order derivative; 'mixed_bfloat16' ran it. The peer: the same gradient taken at
  the perturbed weights, computed apart. Same float8 operations on the same values, op by op: equal."""
  w, x = jnp.asarray(normal((32, 32), scale=0.2)), jnp.asarray(normal((32, 32), seed=1))
  cast = jaxscale.autocast(lambda w, x: jnp.mean(jnp.tanh(x @ w @ w) ** 2), "mixed_float8")

  def ascent(w):
    g = jax.grad(cast)(w, x)
    return 0.05 * g / jnp.linalg.norm(g)

  def sam(w, x):
    return cast(w + lax.stop_gradient(ascent(w)), x)

  grad = jax.jit(jax.grad(sam)) if jit else jax.grad(sam)
  got = grad(w, x)
  want = jax.grad(cast)(w + ascent(w), x)
  if not jit:
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
  # Under jit XLA may fuse the perturbation differently (a float32 ulp in w + eps can move one float8
  # rounding of an operand, 2**-4 of that element): compare with the eager peer to the float8 bound.
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=0, atol=2.0**-4 * float(np.abs(want).max()))
  assert float(np.abs(np.asarray(got)).sum()) > 0
  with pytest.raises(TypeError, match="second-order derivative"):  # without the cut, still refused
    jax.grad(lambda w: cast(w + ascent(w), x))(w)


# --- misuse --------------------------------------------------------------------------------------


@pytest.mark.parametrize("policy", ["mixed_float8", "mixed_bfloat16"])
def test_a_float8_parameter_is_a_warning_that_says_to_store_float32(policy):
  params, x = {"w": jnp.ones((32, 32), jnp.float8_e4m3fn), "b": jnp.ones(32)}, jnp.ones((32, 32))
  loss = jaxscale.autocast(lambda p, x: jnp.sum(x @ p["w"].astype(jnp.float32) + p["b"]), policy)
  with pytest.warns(UserWarning, match=r"got float8 arrays among its arguments \(float8_e4m3fn\[32, 32\]\)\. .*"
                    r"Store them in float32 .* use the policy 'mixed_float8'") as record:
    loss(params, x)
  assert record[0].filename == __file__  # the warning points at the call, not into jaxscale
  with pytest.warns(UserWarning, match="got float8 arrays") as record:
    assert jax.grad(loss)(params, x)["w"].dtype == E4M3  # what the warning is about
  assert record[0].filename == __file__  # through `jax.grad` too


def test_a_matmul_primitive_float8_does_not_reach_is_a_warning_that_says_what_to_do():
  x, w, sizes = jnp.ones((32, 32)), jnp.ones((2, 32, 32)), jnp.array([16, 16], jnp.int32)
  ragged = lambda x, w: jax.lax.ragged_dot(x, w, sizes)
  warning = "met `ragged_dot_general`, a matmul it does not run in float8.*'mixed_bfloat16'"
  with pytest.warns(UserWarning, match=warning) as said:
    out = jaxscale.autocast(ragged, "mixed_float8")(x, w)
  assert said[0].filename == __file__
  np.testing.assert_array_equal(out, ragged(x, w))  # as the program gave it: float32


def test_loss_scaling_on_changes_nothing_bit_for_bit():
  """With "mixed_float8", `needs_loss_scaling` is False; a scaler left on anyway is harmless: a
  power-of-two loss scale shifts every e5m2 scale by its exponent, so the float8 codes, and after
  exact unscaling the gradients, are the same bits as without it."""
  def loss(params, x):
    h = jax.nn.gelu(x @ params["w1"])
    return jnp.mean(jax.nn.logsumexp(h @ params["w2"], axis=-1))

  params = {"w1": jnp.asarray(normal((32, 64), scale=0.2)), "w2": jnp.asarray(normal((64, 32), seed=1, scale=0.2))}
  x = jnp.asarray(normal((32, 32), seed=2))
  grad = jax.jit(jaxscale.value_and_grad(jaxscale.autocast(loss, "mixed_float8")))
  on, off = jaxscale.init(init_scale=2.0**16), jaxscale.init(enabled=jaxscale.needs_loss_scaling("mixed_float8"))
  (_, grads_on, finite), (_, grads_off, _) = grad(on, params, x), grad(off, params, x)
  assert bool(finite)
  for a, b in zip(jax.tree.leaves(grads_on), jax.tree.leaves(grads_off)):
    np.testing.assert_array_equal(a, b)


def test_nearest_is_ml_dtypes_rounding_where_a_cast_alone_rounds_twice():
  """75.99976 (float32) is nearest to 72 in e4m3; through float16 it becomes 76, a tie, then 80 (what
  XLA:CPU of jax 0.7.1 does for a cast alone). Rounded by `nearest`, every backend's cast is exact."""
  x = np.array([np.nextafter(np.float32(76), np.float32(0)), 76.0, 75.0, -0.0, 2.0**-10, 3 * 2.0**-11], np.float32)
  ref = x.astype(E4M3)
  np.testing.assert_array_equal(np.asarray(_float8.nearest(jnp.asarray(x), E4M3), np.float32), ref.astype(np.float32))
  q, k = _float8.quantize(jnp.asarray(x), E4M3)  # eagerly: the cast runs alone
  assert int(k) == 2
  expected = np.ldexp(x.astype(np.float64), 2).astype(E4M3)
  np.testing.assert_array_equal(np.asarray(q).view(np.uint8), expected.view(np.uint8))


def test_an_activations_gradient_is_written_in_the_compute_dtype_a_parameters_in_its_own(monkeypatch):
  """autocast tells the float8 matmul which operands are the function's inputs (parameters, data):
  their gradients come back without a 16-bit rounding; an activation's is rounded to bfloat16 once (its
  GEMM writes half the bytes), as under "mixed_bfloat16"."""
  seen = []
  rule = _float8.matmul
  monkeypatch.setattr(_float8, "matmul", lambda *args: seen.append(tuple(args[5])) or rule(*args))

  def f(w1, w2, x):
    return jnp.sum(jnp.tanh(x @ w1) @ w2)

  w1, w2, x = (jnp.asarray(normal((32, 32), seed=seed)) for seed in range(3))
  jax.grad(jaxscale.autocast(f, "mixed_float8"), argnums=(0, 1))(w1, w2, x)
  assert seen == [(True, True), (False, True)]
  primitive, params = operation(lambda a, b: a @ b, x, w1)
  a = jnp.tanh(x)  # float32, as a float32-list operation leaves an activation
  _, pullback = jax.vjp(_float8._scaled(primitive, params, jnp.bfloat16, F32, F32, (False, True)), a, w1)
  da, dw = pullback(jnp.asarray(normal((32, 32), seed=3), jnp.bfloat16))
  assert da.dtype == dw.dtype == F32
  np.testing.assert_array_equal(da, np.asarray(da).astype(ml_dtypes.bfloat16).astype(F32))  # one bfloat16 rounding
  assert (np.asarray(dw) != np.asarray(dw).astype(ml_dtypes.bfloat16).astype(F32)).mean() > 0.5  # float32's


# --- each weight quantized once a step: `autocast(..., weights=params)` ----------------------------


def _mlp_loss(p, x):
  """A weight on each side of its products: ``w0 @ x.T`` (an Equinox `Linear`'s way), ``h @ w1``."""
  h = jax.nn.gelu((p["w0"] @ x.T).T + p["b"])
  return jnp.mean((h @ p["w1"]) ** 2)


def _flax_loss():
  import flax.linen as nn

  class Net(nn.Module):
    @nn.compact
    def __call__(self, x):
      return nn.Dense(48)(nn.gelu(nn.Dense(128)(x)))

  net = Net()
  params = net.init(jax.random.key(0), jnp.zeros((1, 64)))["params"]
  return (lambda p, x: jnp.mean(net.apply({"params": p}, x) ** 2)), params


def _accumulated(loss, once, policy="mixed_float8"):
  """Gradients summed over microbatches by a `lax.scan`, the autocast function built in the step."""

  @jax.jit
  def step(params, microbatches):
    cast = jaxscale.autocast(loss, policy, weights=params if once else None)

    def microbatch(total, x):
      return jax.tree.map(jnp.add, total, jax.grad(cast)(params, x)), None

    return jax.lax.scan(microbatch, jax.tree.map(jnp.zeros_like, params), microbatches)[0]

  return step


def _models():
  params = {"w0": jnp.asarray(normal((128, 64), seed=5)), "w1": jnp.asarray(normal((128, 48), seed=6, scale=0.1)),
            "b": jnp.zeros(128)}
  flax_loss, flax_params = _flax_loss()
  return {"plain": (_mlp_loss, params), "flax": (flax_loss, flax_params)}


@pytest.mark.parametrize("model", ["plain", "flax"])
def test_weights_quantized_once_a_step_give_each_microbatchs_gradients_bit_for_bit(model):
  """The float8 copies made once are the values each microbatch's quantization makes (the same amax, the
  same cast): the summed gradients are equal bit for bit to those of quantizing at every microbatch, which
  the tests above hold to float64 within the formats' bound."""
  loss, params = _models()[model]
  microbatches = jnp.asarray(normal((3, 32, 64), seed=7, scale=3.0))
  with warnings.catch_warnings():
    warnings.simplefilter("error")  # no warning that the given weights went unread
    once = _accumulated(loss, once=True)(params, microbatches)
  each = _accumulated(loss, once=False)(params, microbatches)
  for a, b in zip(jax.tree.leaves(once), jax.tree.leaves(each)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  assert any(float(jnp.abs(g).max()) > 0 for g in jax.tree.leaves(once))


def _arrays_by_place(text: str, shapes, dtype: str = "f8e4m3fn") -> tuple[int, int]:
  """How many casts (``convert``) of an HLO module write a ``dtype`` array of one of ``shapes`` inside its
  `while` loops (their bodies and what they call) and outside them."""
  bodies, current, calls = {}, None, {}
  for line in text.splitlines():
    header = re.match(r"^(?:ENTRY )?%?([\w.\-]+) .*\{$", line)
    if header:
      current = header[1]
      bodies[current], calls[current] = [], []
    elif current:
      bodies[current].append(line)
      calls[current] += re.findall(r"(?:calls|to_apply|body|condition|branch_computations)=\{?%?([\w.\-]+)", line)
  in_loops, stack = set(), [c for name in bodies for line in bodies[name] if " while(" in line
                            for c in re.findall(r"(?:body|condition)=%?([\w.\-]+)", line)]
  while stack:
    name = stack.pop()
    if name not in in_loops:
      in_loops.add(name)
      stack += calls.get(name, [])
  wanted = [f"{dtype}[{','.join(map(str, s))}]" for s in shapes]
  cast = lambda line: " convert(" in line and any(line.split("=")[1].lstrip().startswith(w) for w in wanted)
  count = lambda names: sum(cast(line) for name in names for line in bodies[name] if "=" in line)
  return count(in_loops), count(set(bodies) - in_loops)


def test_the_weights_float8_copies_are_made_outside_the_loop_over_microbatches():
  """In the program jaxscale hands XLA: with `weights=`, no float8 array of a weight's shape is made inside
  the `while` loop of the microbatches; without, it is made there, every microbatch. (The program as
  lowered: XLA:CPU hoists loop-invariant work out of a loop, XLA:GPU does not, benchmarks/NOTES.md; the
  H100's program is benchmarks/test_gpu_program.py's.)"""
  params = _models()["plain"][1]
  microbatches = jnp.zeros((3, 32, 64))
  shapes = [(128, 64), (64, 128), (128, 48), (48, 128)]
  lowered = lambda once: _accumulated(_mlp_loss, once).lower(params, microbatches).as_text(dialect="hlo")
  texts = {once: lowered(once) for once in (True, False)}
  inside, outside = _arrays_by_place(texts[True], shapes)
  assert inside == 0 and outside >= 2, (inside, outside)
  inside, outside = _arrays_by_place(texts[False], shapes)
  assert inside >= 2 and outside == 0, (inside, outside)


def test_weights_copies_are_made_of_each_matrix_and_of_nothing_else():
  """A copy made once is a matrix's: bfloat16 weights are quantized once too, and a bias (a vector, which
  no matmul reads as an operand) gets no copy, under a float8 policy and under a 16-bit one."""
  params = dict(_models()["plain"][1], w1=_models()["plain"][1]["w1"].astype(jnp.bfloat16))
  microbatches = jnp.asarray(normal((3, 32, 64), seed=8))
  text = _accumulated(_mlp_loss, True).lower(params, microbatches).as_text(dialect="hlo")
  assert _arrays_by_place(text, [(128, 64), (128, 48)]) == (0, 2)  # the float32 and the bfloat16 matrix, once
  assert _arrays_by_place(text, [(128,)]) == (0, 0)  # no float8 copy of the bias
  text = _accumulated(_mlp_loss, True, "mixed_bfloat16").lower(params, microbatches).as_text(dialect="hlo")
  assert _arrays_by_place(text, [(128, 64)], "bf16") == (0, 1)  # the float32 matrix cast once
  assert _arrays_by_place(text, [(128,)], "bf16")[1] == 0  # the bias is not cast ahead of the loop


@pytest.mark.parametrize("weights", ["params", [1, 2], jnp.arange(3)], ids=["string", "ints", "int_array"])
def test_weights_without_a_floating_array_are_an_error_that_says_what_to_pass(weights):
  got = f"got {type(weights).__name__} with no floating array"
  with pytest.raises(TypeError, match=f"takes the parameters the function is called with.*{got}"):
    jaxscale.autocast(_mlp_loss, "mixed_float8", weights=weights)


def test_weights_and_a_call_without_arguments_are_an_error_that_says_the_parameters_are_missing():
  params = _models()["plain"][1]
  step = jax.jit(lambda p: jaxscale.autocast(lambda: jnp.zeros(()), "mixed_float8", weights=p)())
  with pytest.raises(ValueError, match="structure of the function's first argument.*the first argument missing"):
    step(params)


def test_weights_outside_a_traced_step_are_an_error_that_says_where_to_build_the_function():
  params = _models()["plain"][1]
  with pytest.raises(ValueError, match="concrete arrays.*inside the jitted step"):
    jaxscale.autocast(_mlp_loss, "mixed_float8", weights=params)


@pytest.mark.parametrize("policy, dtype", [("mixed_bfloat16", "bf16"), ("mixed_float16", "f16")])
def test_weights_under_a_16_bit_policy_are_cast_once_with_the_same_gradients(policy, dtype):
  """Under a policy without float8, `weights=` makes each matrix's cast to the compute dtype once, outside the
  loop, with the gradients of casting at every microbatch bit for bit (JAX's own cast and its transpose)."""
  loss, params = _models()["plain"]
  microbatches = jnp.asarray(normal((3, 32, 64), seed=8))
  with warnings.catch_warnings():
    warnings.simplefilter("error")  # no warning that the given weights went unread
    once = _accumulated(loss, True, policy)(params, microbatches)
  each = _accumulated(loss, False, policy)(params, microbatches)
  for a, b in zip(jax.tree.leaves(once), jax.tree.leaves(each)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  texts = {o: _accumulated(loss, o, policy).lower(params, microbatches).as_text(dialect="hlo") for o in (True, False)}
  assert _arrays_by_place(texts[True], [(128, 64), (128, 48)], dtype) == (0, 2)
  assert _arrays_by_place(texts[False], [(128, 64), (128, 48)], dtype)[0] >= 2


@pytest.mark.parametrize("change, said", [
    (lambda p: {k: v for k, v in p.items() if k != "b"}, "structure of the function's first argument"),
    (lambda p: dict(p, w1=p["w1"].astype(jnp.bfloat16)), r"float32\[128, 48\] where the first argument has "
                                                         r"bfloat16\[128, 48\] at \['w1'\]"),
    (lambda p: dict(p, w1=p["w1"][:64]), r"float32\[128, 48\] where the first argument has float32\[64, 48\]"),
], ids=["structure", "dtype", "shape"])
def test_weights_unlike_the_first_argument_are_an_error_that_names_the_leaf(change, said):
  params, x = _models()["plain"][1], jnp.zeros((32, 64))

  def step(p):
    return jaxscale.autocast(lambda q, x: jnp.sum(q["w1"]), "mixed_float8", weights=p)(change(p), x)

  with pytest.raises(ValueError, match=said):
    jax.jit(step)(params)


def test_weights_no_matmul_reads_are_a_warning():
  """A function that casts its weights before its matmuls reads none of the float8 copies as given."""
  params, x = _models()["plain"][1], jnp.zeros((32, 64))
  widened = lambda p, x: _mlp_loss(jax.tree.map(lambda w: w.astype(jnp.bfloat16), p), x)
  step = jax.jit(lambda p, x: jax.grad(jaxscale.autocast(widened, "mixed_float8", weights=p))(p, x))
  with pytest.warns(UserWarning, match="none of its matmuls read one of them") as said:
    step(params, x)
  assert [w.filename for w in said if "read one of them" in str(w.message)] == [__file__]  # the jitted step's line
