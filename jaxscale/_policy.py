"""The precision policy: which dtype parameters are stored in, computed in, returned in and reduced in.

A ``Policy`` is three dtypes (jmp's names), how autocast runs matmuls, and how gradients cross devices::

    param_dtype    the parameters as stored and updated (float32 for mixed precision)
    compute_dtype  the forward and backward pass (float16 or bfloat16 for mixed precision)
    output_dtype   what the computation hands back (float32: the loss, logits for metrics)
    matmul_dtype   None: matmuls in compute_dtype; float8_e4m3fn: scaled float8 matmuls
                   (``"mixed_float8"``: operands in e4m3, gradients in e5m2, docs/float8.md)
    min_intensity  under float8 matmuls, the arithmetic intensity below which a matmul stays in
                   compute_dtype (512, an H100's break-even, by default; 0: every matmul of 16
                   or more in each dimension in float8)
    reduce_dtype   the weight gradients as they cross devices (all-reduce, reduce-scatter): the
                   dtype of autocast's weight-gradient products (default: param_dtype, so the
                   mixed-precision step reduces as the float32 step does; docs/distributed.md)

Its casts touch only the floating leaves of a pytree: integers, bools, PRNG keys and
``float0`` tangents keep their dtype. Loss scaling is needed for float16 compute only:
bfloat16 has float32's exponent range, so its gradients do not underflow.
"""

from __future__ import annotations

import dataclasses
import difflib
from typing import Any, TypeVar, Union

import jax
import jax.numpy as jnp
import numpy as np

from jaxscale import _float8, _tree

T = TypeVar("T")

_NAMES = {
    "float32": jnp.float32, "f32": jnp.float32, "full": jnp.float32,
    "float16": jnp.float16, "f16": jnp.float16,
    "bfloat16": jnp.bfloat16, "bf16": jnp.bfloat16,
    "float64": jnp.float64, "f64": jnp.float64,
    "half": None,  # float16, or bfloat16 on a TPU, as in jmp
}  # fmt: skip
_KEYS = {
    "p": "param", "params": "param", "c": "compute", "compute": "compute", "o": "output", "output": "output",
    "m": "matmul", "matmul": "matmul", "min_intensity": "min_intensity", "r": "reduce", "reduce": "reduce",
}  # fmt: skip
_PRESETS = {
    "mixed_float16": ("float32", "float16", "float32"),
    "mixed_bfloat16": ("float32", "bfloat16", "float32"),
    "mixed_float8": ("float32", "bfloat16", "float32", "float8_e4m3fn"),
}
# The one float8 format a policy's matmuls take (their gradients take float8_e5m2), by its names.
_FLOAT8 = np.dtype(jnp.float8_e4m3fn)
_FLOAT8_NAMES = ("float8_e4m3fn", "float8", "f8", "e4m3")


@dataclasses.dataclass(frozen=True)
class Policy:
  """Parameter, compute and output dtypes, with casts for any pytree.

  Immutable and hashable, so it can be a static argument of ``jax.jit``. The
  names are jmp's: code written against ``jmp.Policy`` works unchanged.

  Attributes:
    param_dtype: the dtype parameters are stored in.
    compute_dtype: the dtype the computation runs in.
    output_dtype: the dtype the computation returns.
    matmul_dtype: None (matmuls run in ``compute_dtype``), or ``float8_e4m3fn``:
      :func:`autocast` runs every matmul and convolution as a scaled float8 one
      (the ``"mixed_float8"`` preset; docs/float8.md).
    min_intensity: with float8 matmuls, the arithmetic intensity (multiply-adds per
      element read or written) below which a matmul stays in ``compute_dtype``, because
      quantizing its operands would cost more than its float8 GEMM saves; three times it for a
      convolution. Default 512, where float8 starts to pay on an H100; 0 runs every matmul
      whose dimensions are all 16 or more in float8 (a quality study). None without float8
      matmuls. Keyword only; ``min_intensity=`` in a policy string.
    reduce_dtype: the dtype in which gradients cross devices in a sharded step:
      :func:`autocast` writes the gradient of each parameter a matmul reads in it,
      so that the all-reduce or reduce-scatter the partitioner inserts adds the
      devices' partial sums in it. Default (None): ``param_dtype``, so that a
      mixed-precision step reduces its gradients as the float32 step would;
      ``bfloat16`` halves the bytes those collectives move (docs/distributed.md).

  Examples:
    >>> import jax.numpy as jnp, jaxscale
    >>> policy = jaxscale.get_policy("mixed_float16")
    >>> policy.compute_dtype
    dtype('float16')
    >>> policy.cast_to_compute({"x": jnp.ones(2), "step": jnp.arange(2)})
    {'step': Array([0, 1], dtype=int32), 'x': Array([1., 1.], dtype=float16)}
  """

  param_dtype: Any
  compute_dtype: Any
  output_dtype: Any
  matmul_dtype: Any = None
  reduce_dtype: Any = None
  min_intensity: Any = dataclasses.field(default=None, kw_only=True)

  def __post_init__(self):
    if self.reduce_dtype is None:
      object.__setattr__(self, "reduce_dtype", self.param_dtype)
    if self.matmul_dtype is not None:
      name = self.matmul_dtype.strip().lower() if isinstance(self.matmul_dtype, str) else None
      if (_FLOAT8 if name in _FLOAT8_NAMES else _as_dtype(self.matmul_dtype)) != _FLOAT8:
        raise ValueError(
            f"`Policy.matmul_dtype` must be None (matmuls in the compute dtype) or float8_e4m3fn (scaled "
            f"float8 matmuls, whose gradients run in float8_e5m2), got {self.matmul_dtype!r}."
        )
      object.__setattr__(self, "matmul_dtype", _FLOAT8)
    object.__setattr__(self, "min_intensity", _min_intensity(self.min_intensity, self.matmul_dtype))
    for field in (f for f in dataclasses.fields(self) if f.name not in ("matmul_dtype", "min_intensity")):
      value = getattr(self, field.name)
      if isinstance(value, str):  # read as `get_policy` reads it: "f16" is float16, not NumPy's float128
        name = value.strip().lower()
        if name not in _NAMES:
          raise ValueError(
              f"`Policy.{field.name}` got the unknown dtype name {value!r}; use one of "
              f"{', '.join(_NAMES)} (as in `get_policy`), or a dtype such as jnp.float16."
          )
        value = _dtype(name, value)
      dtype = _as_dtype(value)
      if dtype is None or not jnp.issubdtype(dtype, jnp.floating) or dtype.itemsize > 8:
        raise ValueError(
            f"`Policy.{field.name}` must be a floating dtype JAX computes in (float16, bfloat16, "
            f"float32, ...), got {value!r}."
        )
      if dtype.itemsize == 1:
        raise ValueError(
            f"`Policy.{field.name}` cannot be the float8 dtype {dtype.name}: float8 values hold 2 or 3 "
            "mantissa bits and no scale, too few to store parameters, add activations or return a loss. "
            "Use the preset 'mixed_float8' (or `matmul_dtype=jnp.float8_e4m3fn`): float32 parameters, "
            "bfloat16 compute, and every matmul in scaled float8."
        )
      object.__setattr__(self, field.name, dtype)  # normalised: jnp.float16 == dtype('float16')

  def cast_to_param(self, tree: T) -> T:
    """``tree`` with its floating leaves cast to ``param_dtype``."""
    return cast_floating(tree, self.param_dtype)

  def cast_to_compute(self, tree: T) -> T:
    """``tree`` with its floating leaves cast to ``compute_dtype``."""
    return cast_floating(tree, self.compute_dtype)

  def cast_to_output(self, tree: T) -> T:
    """``tree`` with its floating leaves cast to ``output_dtype``."""
    return cast_floating(tree, self.output_dtype)

  def with_output_dtype(self, output_dtype: Any) -> "Policy":
    """This policy with another ``output_dtype`` (jmp's helper, e.g. float32 logits)."""
    return dataclasses.replace(self, output_dtype=output_dtype)

  def __str__(self) -> str:
    matmul = f",matmul={self.matmul_dtype.name}" if self.matmul_dtype is not None else ""
    if self.min_intensity is not None and self.min_intensity != _float8.MIN_INTENSITY:
      matmul += f",min_intensity={self.min_intensity:g}"
    reduce = f",reduce={self.reduce_dtype.name}" if self.reduce_dtype != self.param_dtype else ""
    dtypes = f"params={self.param_dtype.name},compute={self.compute_dtype.name},output={self.output_dtype.name}"
    return dtypes + matmul + reduce


def _min_intensity(value: Any, matmul_dtype: Any) -> float | None:
  """``Policy.min_intensity`` checked: a float >= 0 under float8 matmuls (None: the H100's default), else None."""
  if matmul_dtype is None:
    if value is not None:
      raise ValueError(
          f"`Policy.min_intensity` ({value!r}) chooses which matmuls a float8 policy keeps in the compute "
          "dtype, and this policy has no float8 matmuls: add `matmul_dtype=jnp.float8_e4m3fn` ('matmul=f8' "
          "in a policy string, or start from 'mixed_float8'), or leave `min_intensity` out."
      )
    return None
  if value is None:
    return float(_float8.MIN_INTENSITY)
  try:
    number = None if isinstance(value, (bool, np.bool_)) else float(value)
  except (TypeError, ValueError):
    number = None
  if number is None or not (0 <= number < float("inf")):
    raise ValueError(
        f"`Policy.min_intensity` must be a finite number of multiply-adds per element, 0 or more, got "
        f"{value!r}: 512 (the default) keeps in bfloat16 the matmuls too small for float8 to pay on an "
        "H100, 0 runs every matmul whose dimensions are all 16 or more in float8 (docs/float8.md)."
    )
  return number


def cast_floating(tree: T, dtype: Any) -> T:
  """``tree`` with every floating array leaf cast to ``dtype``; other leaves as they are.

  Python scalars stay as they are: they are weakly typed and already follow the
  arrays they meet.
  """

  return jax.tree.map(lambda x: jnp.asarray(x).astype(dtype) if is_floating_array(x) else x, tree)


def _as_dtype(value: Any) -> Any:
  """``np.dtype(value)``, or None if ``value`` is no dtype (None too: NumPy reads it as float64)."""
  try:
    return None if value is None else np.dtype(value)
  except TypeError:
    return None


def is_floating_array(x) -> bool:
  """Whether ``x`` is an array (or array scalar) of a real floating dtype; keys and float0 are not.

  Arrays only: a Flax Linen module configured with ``dtype=`` has a ``dtype`` too.
  """
  return isinstance(x, (jax.Array, np.ndarray, np.generic)) and _tree.is_floating(x, real=True)


def get_policy(spec: Union[str, Policy]) -> Policy:
  """A :class:`Policy` from a string (jmp's format, or a preset).

  Accepted forms:

  * a preset: ``"float32"`` (everything float32), ``"mixed_float16"`` and
    ``"mixed_bfloat16"`` (Keras's: float32 parameters and output, 16-bit
    compute), ``"mixed_float8"`` (``"mixed_bfloat16"`` with every matmul and
    convolution as a scaled float8 one: docs/float8.md);
  * one dtype for all three: ``"float16"``, ``"bf16"``, ``"full"``, ``"half"``;
  * jmp's ``key=dtype`` list: ``"params=float32,compute=float16,output=float32"``,
    short ``"p=f32,c=f16,o=f32"``. As in jmp, parameters default to float32,
    compute follows parameters and output follows compute (``"c=f16"`` is
    ``p=f32,c=f16,o=f16``). ``matmul=float8`` (``m=f8``) adds float8 matmuls:
    ``min_intensity=0`` with it changes the arithmetic intensity below which a matmul
    stays in the compute dtype (512 by default: :class:`Policy`). ``str(policy)`` is read
    back as the same policy;
  * a preset (or one dtype) followed by keys that change it: ``"mixed_float8,min_intensity=0"``.
    ``str(get_policy("mixed_float8"))`` is read back as the same policy.
    ``reduce=bfloat16`` (``r=bf16``) sets the dtype gradients cross devices in
    (default: the parameters' dtype).

  Dtype names: ``float32``/``f32``/``full``, ``float16``/``f16``,
  ``bfloat16``/``bf16``, ``float64``/``f64``, and ``half`` (float16, or
  bfloat16 on a TPU, as in jmp). A :class:`Policy` is returned as it is.

  Args:
    spec: the string, or a :class:`Policy`.

  Returns:
    The :class:`Policy`.

  Raises:
    ValueError: naming the part of ``spec`` that is not understood and what
      would be.
    TypeError: if ``spec`` is neither a string nor a :class:`Policy`.

  Examples:
    >>> import jaxscale
    >>> print(jaxscale.get_policy("p=f32,c=bf16,o=f32"))
    params=float32,compute=bfloat16,output=float32
    >>> print(jaxscale.get_policy("c=f16"))
    params=float32,compute=float16,output=float16
    >>> jaxscale.get_policy("p=f32,c=bf16,o=f32,reduce=bf16").reduce_dtype
    dtype(bfloat16)
    >>> jaxscale.get_policy("compute=f8")
    Traceback (most recent call last):
    ...
    ValueError: Unknown dtype 'f8' in policy 'compute=f8'; ...
  """
  if isinstance(spec, Policy):
    return spec
  if not isinstance(spec, str):
    raise TypeError(f"`get_policy` takes a string or a `jaxscale.Policy`, got {type(spec).__name__}: {spec!r}.")
  text = spec.strip().lower()
  head, _, keys = text.partition(",")
  if keys and (head.strip() in _PRESETS or head.strip() in _NAMES):  # keys over a preset: "mixed_float8,m...=0"
    base = get_policy(head)
    matmul = ",m=f8" if base.matmul_dtype is not None else ""
    text = f"p={base.param_dtype.name},c={base.compute_dtype.name},o={base.output_dtype.name}{matmul},{keys}"
  if text in _PRESETS:
    param, compute, output, *matmul = _PRESETS[text]
    return Policy(*(_dtype(name, spec) for name in (param, compute, output)), *matmul)
  if "=" not in text:
    if text not in _NAMES:
      raise ValueError(
          f"Unknown policy {spec!r}: neither a preset ({', '.join(repr(p) for p in ('float32', *_PRESETS))}) "
          f"nor a dtype ({', '.join(_NAMES)}), nor a 'key=dtype' list such as "
          f"'params=float32,compute=float16,output=float32'.{_nearest(text, [*_PRESETS, *_NAMES])}"
      )
    dtype = _dtype(text, spec)
    return Policy(dtype, dtype, dtype)
  chosen: dict[str, Any] = {}
  for part in text.split(","):
    key, _, value = (s.strip() for s in part.partition("="))
    if key not in _KEYS:
      raise ValueError(
          f"Unknown key {key!r} in policy {spec!r}; the keys are 'params' ('p'), 'compute' ('c'), "
          "'output' ('o'), 'reduce' ('r'), as in 'params=float32,compute=bfloat16,output=float32,reduce=float32', "
          "and, for float8 matmuls, 'matmul' ('m') and 'min_intensity'."
      )
    if _KEYS[key] == "matmul" and value not in _FLOAT8_NAMES:
      raise ValueError(
          f"Unknown matmul dtype {value!r} in policy {spec!r}; the one there is 'float8' ('f8', "
          "'float8_e4m3fn'): scaled float8 matmuls, as in the preset 'mixed_float8'."
      )
    if _KEYS[key] == "min_intensity":
      chosen["min_intensity"] = value  # checked by `Policy`, whose error says what works
      continue
    chosen[_KEYS[key]] = _FLOAT8 if _KEYS[key] == "matmul" else _dtype(value, spec)
  param = chosen.get("param", np.dtype(jnp.float32))
  compute = chosen.get("compute", param)
  matmul = chosen.get("matmul")
  try:
    return Policy(param, compute, chosen.get("output", compute), matmul, chosen.get("reduce"),
                  min_intensity=chosen.get("min_intensity"))
  except ValueError as e:
    raise ValueError(f"In policy {spec!r}: {e}") from None


def _nearest(text: str, names: list[str]) -> str:
  """" Did you mean 'x'?" for the closest of ``names``, or "" if none is close."""
  close = difflib.get_close_matches(text, names, n=1, cutoff=0.6)
  return f" Did you mean {close[0]!r}?" if close else ""


def _dtype(name: str, spec: str) -> Any:
  if name not in _NAMES:
    raise ValueError(
        f"Unknown dtype {name!r} in policy {spec!r}; use one of {', '.join(_NAMES)}, "
        "or a preset: 'float32', 'mixed_float16', 'mixed_bfloat16', 'mixed_float8' (float8 matmuls)."
        + _nearest(name, list(_NAMES))
    )
  dtype = _NAMES[name]
  if dtype is None:  # "half"
    dtype = jnp.bfloat16 if jax.default_backend() == "tpu" else jnp.float16
  return np.dtype(dtype)


def needs_loss_scaling(policy_or_dtype: Union[Policy, str, jax.typing.DTypeLike]) -> bool:
  """True iff the compute dtype is float16, the one whose gradients underflow.

  bfloat16 shares float32's exponent range and needs no loss scaling; float32
  needs none either, and neither does ``"mixed_float8"``: its bfloat16
  compute has float32's range, and each float8 matmul scales its gradient
  itself. Pass the answer as ``enabled=``, so that one script runs unchanged
  in any precision.

  Args:
    policy_or_dtype: a :class:`Policy` (its ``compute_dtype`` decides), a
      policy string for :func:`get_policy`, or a dtype.

  Returns:
    A Python bool.

  Examples:
    >>> import jax.numpy as jnp, optax, jaxscale
    >>> jaxscale.needs_loss_scaling("mixed_float16"), jaxscale.needs_loss_scaling(jnp.bfloat16)
    (True, False)
    >>> policy = jaxscale.get_policy("mixed_bfloat16")
    >>> tx = jaxscale.dynamic_loss_scaling(optax.adam(1e-3), enabled=jaxscale.needs_loss_scaling(policy))
  """
  if isinstance(policy_or_dtype, (Policy, str)):
    dtype = get_policy(policy_or_dtype).compute_dtype
  else:
    dtype = _as_dtype(policy_or_dtype)
    if dtype is None:
      raise TypeError(
          "`needs_loss_scaling` takes a `jaxscale.Policy`, a policy string or a dtype, "
          f"got {policy_or_dtype!r}."
      )
  return dtype == np.dtype(jnp.float16)
