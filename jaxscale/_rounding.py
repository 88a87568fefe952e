"""Stochastic rounding to 16 bits, and the random numbers it draws: what `master_weights` and
`low_precision_state` share.

A float32 ``x`` between two neighbours ``down < x < up`` of a 16-bit dtype is
rounded up with probability ``(x - down) / (up - down)``, so its expected
value is ``x`` exactly::

    seeds = leaf_key(key, stream, leaf)              # two uint32 scalars (`leaf_seeds`: all leaves')
    u = uniform(seeds, shape)                        # one number per element
    rounded = up if u < (x - down) / (up - down) else down

bfloat16 (every stored state leaf, and bfloat16 parameters) is rounded on its
bits by `bfloat16_grid`, the same rule with integer arithmetic, from 16
random bits: one hash per element gives two leaves their bits (`halves`).

The numbers come from a key held in each wrapper's state, advanced once per
step, and from a *stream*: each wrapper hashes its own constant and each
leaf's index into the key, so that `master_weights` and `low_precision_state`
given the same seed (both default to 0) still draw independent numbers, where
parameter leaf i and state leaf i once drew the same ones.

A low module: it imports nothing else of jaxscale.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

# The streams: any distinct constants, hashed with the key and the leaf's index, so no leaf of one
# wrapper shares numbers with a leaf of the other.
MASTER_WEIGHTS = 0x6D617374  # "mast"
LOW_PRECISION_STATE = 0x6C6F7770  # "lowp"

DTYPES = ("float16", "bfloat16")


def raw_key(key, who: str) -> jax.Array:
  """A raw ``uint32[2]`` PRNG key (what Orbax and ``jax.tree.map`` handle) from an int or a key."""
  if isinstance(key, (int, np.integer)):
    return jax.random.PRNGKey(int(key))
  key = jnp.asarray(key) if not isinstance(key, jax.Array) else key
  if jnp.issubdtype(key.dtype, jax.dtypes.prng_key):
    key = jax.random.key_data(key)
  if key.dtype != jnp.uint32 or key.shape != (2,):
    raise ValueError(
        f"`{who}` got key of dtype {key.dtype} and shape {key.shape}; pass an int seed, "
        "`jax.random.key(seed)` or `jax.random.PRNGKey(seed)`."
    )
  return key


def split_key(key: jax.Array) -> tuple[jax.Array, jax.Array]:
  """A wrapper's raw key split into the next step's key and this step's draw, in counter mode.

  The draw hashes both words of the key, and is computed whole before anything reads it (an
  optimization barrier); the next key is the key with one added to its first word. Elementwise,
  that one XLA writes over the donated old key in place, where `jax.random.split`'s next key was
  copied into it (benchmarks/NOTES.md). The draws of successive steps are hashes of successive
  counters, as a counter-based generator's are.
  """
  key = key.astype(jnp.uint32)
  draw = jnp.stack([_lowbias32(key[0] ^ _lowbias32(key[1])),
                    _lowbias32(key[1] ^ _lowbias32(key[0] + jnp.uint32(0x9E3779B9)))])
  return key + jnp.array([1, 0], jnp.uint32), jax.lax.optimization_barrier(draw)


def leaf_key(key: jax.Array, stream: int, index: int | jax.Array) -> tuple[jax.Array, jax.Array]:
  """The seeds (two ``uint32`` scalars) of leaf ``index`` of ``stream``, from a wrapper's per-step raw key.

  Hashed with `_lowbias32` rather than `jax.random.fold_in`: each threefry call compiles to a
  loop of its own, three per leaf once, and they made the compile time of a 16-bit Adam step
  several times float32's (benchmarks/NOTES.md). Rounding noise needs well-mixed bits, not a
  cryptographic stream.
  """
  first, second = _leaf_key_mixed(key, stream, index)
  return _lowbias32(first), _lowbias32(second)


def _leaf_key_mixed(key, stream, index):
  """`leaf_key` before the last hash of each seed (``index`` may be an array of leaf indices)."""
  key = key.astype(jnp.uint32)
  a = _lowbias32(key[0] ^ jnp.uint32(stream))
  # In uint32, so that the index may be traced; the products wrap as `& 0xFFFFFFFF` would.
  b = _lowbias32(key[1] ^ (jnp.asarray(index, jnp.uint32) * jnp.uint32(0x9E3779B9) + jnp.uint32(0x7F4A7C15)))
  return a + b, a ^ _lowbias32(b + jnp.uint32(1))


SEED_GROUP = 64  # leaves whose seeds one scalar kernel computes


def leaf_seeds(key: jax.Array, stream: int, indices) -> dict[int, tuple[jax.Array, jax.Array]]:
  """`leaf_key` of each leaf index in ``indices`` (a dict from index to seeds), each seed a scalar
  computed once, before the kernels of the leaves that read it.

  The hashes are computed for all leaves at once, and each leaf's last hash apart behind an
  optimization barrier: XLA then hands each leaf's kernel its own two scalars. Fused into each
  leaf's kernel (what XLA does with the per-leaf hashes beyond a few dozen leaves), they make every
  kernel read the same small array, and XLA's sibling fusion then merges the stochastic rounding of
  many leaves into one kernel apart from the rest of their update: gradients and state are read
  twice, and each leaf's kernel differs by its index, so none is compiled once for all
  (benchmarks/NOTES.md).
  """
  indices, seeds = list(indices), {}
  # In groups: over a few hundred scalars at once, XLA gave each its own kernel.
  for group in (indices[g:g + SEED_GROUP] for g in range(0, len(indices), SEED_GROUP)):
    mixed = jax.lax.optimization_barrier(_leaf_key_mixed(key, stream, jnp.asarray(group, jnp.uint32)))
    seeds.update(jax.lax.optimization_barrier(
        {i: (_lowbias32(mixed[0][k]), _lowbias32(mixed[1][k])) for k, i in enumerate(group)}))
  return seeds


def random_bits(seeds: tuple[jax.Array, jax.Array], shape) -> jax.Array:
  """Random uint32 numbers, one per element, from ``seeds`` (`leaf_key`) and each element's index.

  One ``lowbias32`` hash (Wellons') of the index mixed with the first seed, offset by the second,
  rather than ``jax.random.bits``: it is elementwise, so it fuses into the rounding that reads it,
  where threefry's intermediate arrays made ``low_precision_state``'s compiled Adam step carry 42
  bytes per parameter of temporaries (benchmarks/NOTES.md). One hash, not two: every operation per
  element is compiled once per leaf, and XLA's fusion pass grows faster than the operations it
  fuses, so the hashes were most of a 16-bit step's compile time; the seeds, hashed per leaf and
  step, carry the mixing between steps. Computed from the global index, so a sharded or
  replicated array draws the same numbers on every device.
  """
  index = jax.lax.iota(jnp.uint32, int(np.prod(shape, dtype=np.int64))).reshape(shape)
  return _lowbias32(index ^ seeds[0]) + seeds[1]


def halves(bits: jax.Array) -> tuple[jax.Array, jax.Array]:
  """Two independent 16-bit random numbers (as uint32 below 2**16) from each of ``bits``' elements:
  what one hash gives two leaves rounded to bfloat16 in the same kernel."""
  return bits >> 16, bits & jnp.uint32(0xFFFF)


def uniform(seeds: tuple[jax.Array, jax.Array], shape) -> jax.Array:
  """Uniform float32 numbers in [0, 1), multiples of 2**-24, one per element (`random_bits`)."""
  return (random_bits(seeds, shape) >> 8).astype(jnp.float32) * jnp.float32(2.0**-24)


def _lowbias32(x: jax.Array) -> jax.Array:
  x = x ^ (x >> 16)
  x = x * jnp.uint32(0x7FEB352D)
  x = x ^ (x >> 15)
  x = x * jnp.uint32(0x846CA68B)
  return x ^ (x >> 16)


def stochastic_round(x: jax.Array, dtype, u: jax.Array) -> jax.Array:
  """``x`` (finite float32, within ``dtype``'s finite range) to ``dtype`` (float16 or bfloat16):
  up with probability (x - down) / (up - down), so unbiased.

  Only 16-bit dtypes with infinities: ``nextafter(largest, inf)`` must be inf for the
  comparison to hold at the top of the range, and the float8 formats without one
  (``float8_e4m3fn``) make it NaN.
  """
  near = x.astype(dtype)
  down = jnp.where(widen(near) > x, jnp.nextafter(near, jnp.asarray(-jnp.inf, dtype)), near)
  up = jnp.nextafter(down, jnp.asarray(jnp.inf, dtype))
  # Both differences are exact: `x` lies between two neighbours, whose gap is a power of two.
  fraction = (x - widen(down)) / (widen(up) - widen(down))
  return jnp.where(u < fraction, up, down)


def to_bfloat16(x: jax.Array, bits: jax.Array) -> jax.Array:
  """``x`` (float32) rounded stochastically to bfloat16 with 16 random bits per element (``bits``,
  uint32 below 2**16, `halves`): unbiased for every finite value. `bfloat16_grid` says how."""
  return bfloat16_grid(x, bits).astype(jnp.bfloat16)  # exact: the value is on bfloat16's grid


def bfloat16_grid(x: jax.Array, bits: jax.Array) -> jax.Array:
  """``x`` (float32) rounded stochastically to bfloat16's grid, as float32, on its bits.

  bfloat16 is float32's upper 16 bits. Adding 16 random bits to the lower 16 and clearing them
  carries into the upper with probability (x - down) / (up - down), since the lower bits are that
  fraction of the gap in units of 2**-16, in every binade and in the subnormals, and a carry out
  of the mantissa is the next binade's first value. Integer arithmetic only: no float32 difference
  of two neighbours, which flushes to zero below 2**-119 on XLA:CPU (the `stochastic_round` way
  then rounded every such element down), and nothing that keeps XLA from fusing the rounding into
  the computation of ``x``. Clipped to bfloat16's largest finite value first, so no finite value
  becomes inf; inf stays inf, NaN stays NaN.
  """
  big = jnp.float32(jnp.finfo(jnp.bfloat16).max)
  x = x.astype(jnp.float32)
  carried = jax.lax.bitcast_convert_type(jnp.clip(x, -big, big), jnp.uint32) + bits
  rounded = jax.lax.bitcast_convert_type(carried & jnp.uint32(0xFFFF0000), jnp.float32)
  # inf was clipped, and a NaN's payload could carry into the sign bit: both as they were.
  return jnp.where(jnp.isfinite(x), rounded, x)


def round_to(x: jax.Array, dtype) -> jax.Array:
  """``x`` (float32, within ``dtype``'s finite range or beyond it) rounded to nearest in ``dtype``
  (float16 or bfloat16), as the float32 it then is: what a cast there and back would give, with
  nothing XLA can fold (`widen`).

  bfloat16 has float32's exponent: ``reduce_precision`` is the rounding, one operation. It flushes
  float16's subnormals to zero (measured on XLA:CPU), so float16 goes through the cast and `widen`.
  """
  if jnp.dtype(dtype) == jnp.bfloat16:
    return jax.lax.reduce_precision(x, exponent_bits=8, mantissa_bits=7)
  return widen(x.astype(dtype))


def widen(x: jax.Array) -> jax.Array:
  """``x`` (float16 or bfloat16) as the float32 it is, exactly, decoded from its bits.

  Not ``x.astype(float32)``: XLA folds a float32 -> 16-bit -> float32 round trip of casts away
  (`xla_allow_excess_precision`), and reads a computed 16-bit value as the float32 it was rounded
  from. The integer decoding below is nothing it can fold, and unlike an optimization barrier
  it fuses with what computes ``x`` and with what reads it: one kernel per leaf on the GPU.
  """
  bits = jax.lax.bitcast_convert_type(x, jnp.uint16).astype(jnp.uint32)
  if jnp.dtype(x.dtype) == jnp.bfloat16:  # float32's upper half
    return jax.lax.bitcast_convert_type(bits << 16, jnp.float32)
  if jnp.dtype(x.dtype) != jnp.float16:
    raise ValueError(f"`widen` takes float16 or bfloat16, not {x.dtype}.")
  sign, magnitude = bits >> 15, bits & 0x7FFF
  # Normal: the exponent rebiased from 15 to 127 (inf and NaN to 255 as well); subnormal: m * 2**-24.
  wide = (magnitude << 13) + jnp.where(magnitude >= 0x7C00, jnp.uint32(0xFF - 0x1F), jnp.uint32(127 - 15)) * (1 << 23)
  normal = jax.lax.bitcast_convert_type(wide | (sign << 31), jnp.float32)
  subnormal = magnitude.astype(jnp.float32) * jnp.float32(2.0**-24)
  return jnp.where(magnitude >= 0x400, normal, jnp.where(sign == 1, -subnormal, subnormal))
