"""The precision report: what a function computes in which dtype, read from its jaxpr without running it.

``precision_report(fun, *args)`` traces ``fun`` (``jax.make_jaxpr``: nothing is computed) and
counts, at every depth of its jaxpr::

    matmul_flops       dtype name -> floating-point operations of its dot_generals and
                       convolutions in that dtype (2 * M * N * K for a matmul; a scan body
                       times its length; a while loop's body once, as `while_loops` says;
                       the costliest branch of a cond)
                       (float8: "float8_e4m3fn" forward, "float8_e5m2" for the products
                       that take an e5m2 gradient, whatever the other operand)
    matmul_counts      dtype name -> how many matmuls and convolutions run in it
    op_counts          dtype name -> how many operations (every first-order primitive with a
                       floating result, matmuls included) have their result in it
    kept_wider         under a float8 policy, the FLOPs of the matmuls kept wider, by the
                       reason (`_float8.REASONS`) that the jit around them is named after
    float32_ops_in_16_bits   the operations of autocast's float32 list (exp, log, sums, ...)
                       whose operands are 16-bit, by primitive name

Counts are of what runs on ``platform`` (default: where ``fun`` would run, the default device's):
of a ``lax.platform_dependent`` choice, the branch lowered for it (under a float8 policy, a TPU's
matmuls are bfloat16: ``kept_wider["tpu"]``). A scan body times its length, a ``shard_map`` / ``pmap`` body times
the devices it runs on (it is traced at per-device shapes). Given ``jax.grad`` of a loss, the
backward pass is in the jaxpr and is counted too. Named axes that ``fun`` uses without
binding them (a ``BatchNorm(axis_name=...)`` meant for ``pmap``) are bound by ``axis_env``.
"""

from __future__ import annotations

import dataclasses
import math
import collections
from collections import Counter
from collections.abc import Callable, Mapping
from typing import Any

import jax
import numpy as np

from jaxscale import _autocast, _float8, _interpret

_SIXTEEN_BITS = ("float16", "bfloat16")


@dataclasses.dataclass(frozen=True)
class PrecisionReport:
  """What a function computes in which dtype; ``str()`` is a short table.

  Attributes:
    matmul_flops: dtype name (of the operands) -> floating-point operations of the
      matmuls and convolutions in that dtype.
    float32_ops_in_16_bits: primitive name -> how many operations of autocast's float32
      list (exp, log, sums, ...: docs/mixed_precision.md) run on 16-bit operands.
    while_loops: how many ``while_loop`` bodies were counted once (their trip count is
      not known without running them).
    matmul_counts: dtype name -> how many matmuls and convolutions run in that dtype.
    op_counts: dtype name -> how many operations with a floating result (matmuls,
      elementwise operations, reductions, ...) have it in that dtype.
    kept_wider: under a float8 policy, reason -> FLOPs of the matmuls kept in a wider
      dtype for it (``"small"``, ``"intensity"``, ``"conv_backward"``, ``"tpu"``: ``str()`` says each in full).

  Examples:
    >>> import jax.numpy as jnp, jaxscale
    >>> report = jaxscale.precision_report(lambda x: x @ x, jnp.ones((2, 2), jnp.float16))
    >>> report.matmul_flops, report.share("float16")
    ({'float16': 16.0}, 1.0)
  """

  matmul_flops: dict[str, float]
  float32_ops_in_16_bits: dict[str, int]
  while_loops: int = 0
  matmul_counts: dict[str, int] = dataclasses.field(default_factory=dict)
  op_counts: dict[str, int] = dataclasses.field(default_factory=dict)
  kept_wider: dict[str, float] = dataclasses.field(default_factory=dict)

  def share(self, dtype: Any) -> float:
    """The fraction (0 to 1) of the matmul FLOPs that run in ``dtype`` (a dtype or its name)."""
    total = sum(self.matmul_flops.values())
    return self.matmul_flops.get(np.dtype(dtype).name, 0.0) / total if total else 0.0

  def __str__(self) -> str:
    total = sum(self.matmul_flops.values())
    width = max([10, *map(len, self.matmul_flops)])
    lines = [f"{'dtype':<{width}} {'matmul FLOPs':>13} {'share':>7} {'matmuls':>8}"]
    for name, flops in sorted(self.matmul_flops.items(), key=lambda item: -item[1]):
      share = flops / total if total else 0.0
      lines.append(f"{name:<{width}} {flops:>13.4g} {share:>7.1%} {self.matmul_counts.get(name, 0):>8}")
    sixteen = sum(self.matmul_flops.get(name, 0.0) for name in _SIXTEEN_BITS)
    lines.append(f"16-bit: {sixteen / total if total else 0.0:.1%} of {total:.4g} matmul FLOPs")
    float8 = sum(self.matmul_flops.get(dtype.name, 0.0) for dtype in _float8.FLOAT8)
    if float8 or self.kept_wider:
      lines.append(f"float8: {float8 / total if total else 0.0:.1%}; kept wider:{'' if self.kept_wider else ' none'}")
    for reason, flops in sorted(self.kept_wider.items(), key=lambda item: -item[1]):
      lines.append(f"  {flops / total if total else 0.0:.1%} ({reason}): {_float8.REASONS.get(reason, reason)}")
    ops = ", ".join(f"{name} x{count}" for name, count in sorted(self.float32_ops_in_16_bits.items()))
    lines.append(f"float32-list operations in 16 bits: {ops or 'none'}")
    if self.while_loops:
      lines.append(f"while loops counted once: {self.while_loops}")
    return "\n".join(lines)


def precision_report(
    fun: Callable, *args: Any, axis_env: Mapping[str, int] | None = None, platform: str | None = None, **kwargs: Any
) -> PrecisionReport:
  """What ``fun(*args, **kwargs)`` computes in which dtype, without running it.

  Args:
    fun: any function: a plain one, an :func:`autocast` one, a model's apply, or
      ``jax.grad`` of a loss (then the backward pass is counted too).
    *args: its positional arguments (arrays, or pytrees of them; other leaves are
      passed as they are).
    axis_env: named axes to bind, name -> size, for a ``fun`` that uses them (``psum``,
      ``BatchNorm(axis_name=...)``) and is meant to run under ``pmap`` or ``shard_map``
      (then ``fun`` is counted once: per device). A keyword of ``precision_report``, not
      passed to ``fun``.
    platform: the platform to report for, ``"cpu"``, ``"gpu"`` (or ``"cuda"``, ``"rocm"``) or
      ``"tpu"``: what is chosen per platform where the program is lowered (a float8 policy's
      matmuls are bfloat16 on a TPU) is counted as lowered there. Default: the default device's.
      A keyword of ``precision_report``, not passed to ``fun``.
    **kwargs: its keyword arguments.

  Returns:
    A :class:`PrecisionReport`.

  Examples:
    >>> import jax, jax.numpy as jnp, jaxscale
    >>> def loss(w, x):
    ...   return jnp.sum(jnp.exp(x @ w))
    >>> w, x = jnp.ones((3, 4)), jnp.ones((2, 3))
    >>> print(jaxscale.precision_report(loss, w, x))
    dtype       matmul FLOPs   share  matmuls
    float32               48  100.0%        1
    16-bit: 0.0% of 48 matmul FLOPs
    float32-list operations in 16 bits: none
    >>> report = jaxscale.precision_report(jax.grad(jaxscale.autocast(loss, "mixed_float16")), w, x)
    >>> report.matmul_flops  # forward and backward (the gradient with respect to w)
    {'float16': 96.0}
    >>> report.matmul_counts, report.op_counts["float16"] > 0
    ({'float16': 2}, True)
  """
  if not callable(fun):
    raise TypeError(
        "`precision_report` takes the function first, then its arguments: "
        f"`precision_report(fun, *args)`; got {fun!r} of type {type(fun).__name__} as `fun`."
    )
  leaves, treedef = jax.tree.flatten((args, kwargs))
  dynamic = [i for i, leaf in enumerate(leaves) if isinstance(leaf, (jax.Array, np.ndarray, np.generic))]

  def traced(*arrays):
    run_leaves = list(leaves)
    for i, x in zip(dynamic, arrays):
      run_leaves[i] = x
    run_args, run_kwargs = jax.tree.unflatten(treedef, run_leaves)
    return fun(*run_args, **run_kwargs)

  platforms = _platforms(platform)
  env = list((axis_env or {}).items())
  closed = jax.make_jaxpr(traced, axis_env=env)(*(leaves[i] for i in dynamic))
  counts = _count(closed.jaxpr, platforms)
  return PrecisionReport(
      dict(counts.flops), dict(counts.sensitive), counts.while_loops, dict(counts.matmuls), dict(counts.ops),
      dict(counts.wider),
  )


@dataclasses.dataclass
class _Counts:
  flops: collections.defaultdict = dataclasses.field(default_factory=lambda: collections.defaultdict(float))
  matmuls: Counter = dataclasses.field(default_factory=Counter)
  ops: Counter = dataclasses.field(default_factory=Counter)
  sensitive: Counter = dataclasses.field(default_factory=Counter)
  wider: collections.defaultdict = dataclasses.field(default_factory=lambda: collections.defaultdict(float))
  while_loops: int = 0

  def add(self, other: _Counts, times: int, reason: str = "") -> None:
    """Adds a sub-program's counts; all its FLOPs as kept wider for ``reason`` when it names one."""
    pairs = (
        (self.flops, other.flops), (self.matmuls, other.matmuls), (self.ops, other.ops),
        (self.sensitive, other.sensitive),
    )
    for mine, theirs in pairs:
      for key, value in theirs.items():
        mine[key] += value * times
    for key, value in ({reason: sum(other.flops.values())} if reason else other.wider).items():
      self.wider[key] += value * times
    self.while_loops += other.while_loops


def _platforms(platform: str | None) -> tuple[str, ...]:
  """The names `lax.platform_dependent` may know ``platform`` by (a GPU is "cuda" or "rocm" there)."""
  if platform is None:
    platform = jax.devices()[0].platform
  names = {"cpu": ("cpu",), "tpu": ("tpu",), "gpu": ("cuda", "rocm"), "cuda": ("cuda",), "rocm": ("rocm",)}
  if str(platform).lower() not in names:
    raise ValueError(
        f"`precision_report(..., platform=...)` takes one of {', '.join(map(repr, names))}; got {platform!r}."
    )
  return names[str(platform).lower()]


def _lowered_branch(eqn, indices: dict, platforms: tuple[str, ...]) -> int | None:
  """The branch of a `lax.platform_dependent` cond that is lowered on ``platforms``; None for any other cond."""
  choices = eqn.params.get("branches_platforms")
  if choices is None:  # a JAX that does not mark the cond: the index's own `platform_index`, when in sight
    choices = indices.get(eqn.invars[0])
  if choices is None:
    return None
  return next((i for i, names in enumerate(choices) if names is None or set(names) & set(platforms)), None)


def _count(jaxpr, platforms: tuple[str, ...]) -> _Counts:
  counts = _Counts()
  indices = {}  # platform_index's result -> its platforms
  # A float8 value widened and multiplied by its scale (`_float8`'s GPU form, which XLA:GPU makes one
  # FP8 GEMM of) -> its float8 dtype: the product runs in that dtype.
  widened: dict = {}
  for eqn in jaxpr.eqns:
    name = eqn.primitive.name
    avals = [v.aval for v in eqn.invars]
    sources = [None if hasattr(v, "val") else widened.get(v) for v in eqn.invars]  # a Literal has a `val`
    if name == "convert_element_type" and np.dtype(avals[0].dtype) in _float8.FLOAT8:
      widened[eqn.outvars[0]] = np.dtype(avals[0].dtype).name
    elif name == "mul" and any(sources):
      widened[eqn.outvars[0]] = next(s for s in sources if s)
    if name == "platform_index":
      indices[eqn.outvars[0]] = eqn.params["platforms"]
    subs = [_count(j, platforms) for j in _interpret.subjaxprs(eqn.params)]
    if not subs:
      out = [v.aval for v in eqn.outvars if _interpret.floating(v.aval)]
      if out:
        counts.ops[np.dtype(out[0].dtype).name] += 1
    if name in _autocast.COMPUTE_PRIMITIVES:
      # Only a dot reads its float8 operands through the widening (a convolution's backward, which
      # takes one dtype for both, runs in bfloat16 on the float8 values: "conv_backward").
      lhs, rhs = (source if name == "dot_general" and source else a.dtype.name for source, a in zip(sources, avals[:2]))
      key = _float8.BACKWARD.name if _float8.BACKWARD.name in (lhs, rhs) else lhs if lhs == rhs else f"{lhs}*{rhs}"
      counts.flops[key] += _flops(eqn)
      counts.matmuls[key] += 1
    elif name in _autocast.FLOAT32_PRIMITIVES and any(
        _interpret.floating(a) and np.dtype(a.dtype).itemsize < 4 for a in avals
    ):
      counts.sensitive[name] += 1
    if not subs:
      continue
    if name == "cond":  # one branch runs: the one lowered for the platform, else the costliest
      lowered = _lowered_branch(eqn, indices, platforms)
      subs = [subs[lowered] if lowered is not None else max(subs, key=lambda sub: sum(sub.flops.values()))]
    counts.while_loops += name == "while"
    # A float8 policy's matmul kept wider sits in a jit named after the reason (under `jax.grad`
    # too, inside "jvp(...)" / "transpose(...)").
    reason = str(eqn.params.get("name", "")).partition(_float8.WIDER)[2].partition(")")[0]
    for sub in subs:
      counts.add(sub, _times(eqn), reason)
  return counts


def _times(eqn) -> int:
  """How many times a higher-order primitive runs its sub-programs.

  A scan its length; ``shard_map`` (traced at per-device shapes) once per device along its
  manual mesh axes, ``pmap`` once per device. These keys differ between releases (jax 0.10
  renamed ``manual_axes`` to ``newly_manual_axes``; ``xla_pmap`` has ``axis_size``), and a
  missing one counts once.
  """
  params = eqn.params
  if eqn.primitive.name == "scan":
    return params.get("length", 1)
  if "axis_size" in params and eqn.primitive.name == "xla_pmap":
    return params["axis_size"]
  mesh = params.get("mesh")
  if eqn.primitive.name == "shard_map" and mesh is not None:
    sizes = dict(mesh.shape)
    manual = next((params[key] for key in ("newly_manual_axes", "manual_axes") if key in params), None)
    if manual is None:
      manual = set(sizes) - set(params.get("auto", ()))
    return math.prod(sizes[name] for name in manual)
  return 1


def _flops(eqn) -> float:
  """Multiply-adds times two: each output element sums over the contracted size."""
  lhs, rhs = (v.aval.shape for v in eqn.invars[:2])
  if eqn.primitive.name == "dot_general":
    (_, rhs_contract), (_, rhs_batch) = eqn.params["dimension_numbers"]
    kept = [size for d, size in enumerate(rhs) if d not in rhs_contract and d not in rhs_batch]
    return 2.0 * math.prod(lhs) * math.prod(kept)
  out = eqn.outvars[0].aval.shape
  out_features = rhs[eqn.params["dimension_numbers"].rhs_spec[0]]
  return 2.0 * math.prod(out) * math.prod(rhs) / out_features

