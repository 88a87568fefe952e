"""The precision report: what a function computes in which dtype, read from its jaxpr without running it.

``precision_report(fun, *args)`` traces ``fun`` (``jax.make_jaxpr``: nothing is computed) and
counts, at every depth of its jaxpr::

    matmul_flops       dtype name -> floating-point operations of its dot_generals and
                       convolutions in that dtype (2 * M * N * K for a matmul; a scan body
                       times its length; a while loop's body once, as `while_loops` says;
                       the costliest branch of a cond)
                       (float8: "float8_e4m3fn" forward, "float8_e5m2" for the products
                       that take an e5m2 gradient, whatever the other operand)
    kept_wider         under a float8 policy, the FLOPs of the matmuls kept wider, by the
                       reason (`_float8.REASONS`) that the jit around them is named after
    float32_ops_in_16_bits   the operations of autocast's float32 list (exp, log, sums, ...)
                       whose operands are 16-bit, by primitive name

Given ``jax.grad`` of a loss, the backward pass is in the jaxpr and is counted too.
"""

from __future__ import annotations

import dataclasses
import math
import collections
from collections import Counter
from collections.abc import Callable
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
    kept_wider: under a float8 policy, reason -> FLOPs of the matmuls kept in a wider
      dtype for it (``"small"``, ``"conv_backward"``: ``str()`` says each in full).

  Examples:
    >>> import jax.numpy as jnp, jaxscale
    >>> report = jaxscale.precision_report(lambda x: x @ x, jnp.ones((2, 2), jnp.float16))
    >>> report.matmul_flops, report.share("float16")
    ({'float16': 16.0}, 1.0)
  """

  matmul_flops: dict[str, float]
  float32_ops_in_16_bits: dict[str, int]
  while_loops: int = 0
  kept_wider: dict[str, float] = dataclasses.field(default_factory=dict)

  def share(self, dtype: Any) -> float:
    """The fraction (0 to 1) of the matmul FLOPs that run in ``dtype`` (a dtype or its name)."""
    total = sum(self.matmul_flops.values())
    return self.matmul_flops.get(np.dtype(dtype).name, 0.0) / total if total else 0.0

  def __str__(self) -> str:
    total = sum(self.matmul_flops.values())
    width = max([10, *map(len, self.matmul_flops)])
    lines = [f"{'dtype':<{width}} {'matmul FLOPs':>13} {'share':>7}"]
    for name, flops in sorted(self.matmul_flops.items(), key=lambda item: -item[1]):
      lines.append(f"{name:<{width}} {flops:>13.4g} {flops / total if total else 0.0:>7.1%}")
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


def precision_report(fun: Callable, *args: Any, **kwargs: Any) -> PrecisionReport:
  """What ``fun(*args, **kwargs)`` computes in which dtype, without running it.

  Args:
    fun: any function: a plain one, an :func:`autocast` one, a model's apply, or
      ``jax.grad`` of a loss (then the backward pass is counted too).
    *args: its positional arguments (arrays, or pytrees of them; other leaves are
      passed as they are).
    **kwargs: its keyword arguments.

  Returns:
    A :class:`PrecisionReport`.

  Examples:
    >>> import jax, jax.numpy as jnp, jaxscale
    >>> def loss(w, x):
    ...   return jnp.sum(jnp.exp(x @ w))
    >>> w, x = jnp.ones((3, 4)), jnp.ones((2, 3))
    >>> print(jaxscale.precision_report(loss, w, x))
    dtype       matmul FLOPs   share
    float32               48  100.0%
    16-bit: 0.0% of 48 matmul FLOPs
    float32-list operations in 16 bits: none
    >>> report = jaxscale.precision_report(jax.grad(jaxscale.autocast(loss, "mixed_float16")), w, x)
    >>> report.matmul_flops  # forward and backward (the gradient with respect to w)
    {'float16': 96.0}
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

  closed = jax.make_jaxpr(traced)(*(leaves[i] for i in dynamic))
  flops, ops, loops, wider = _count(closed.jaxpr)
  return PrecisionReport(dict(flops), dict(ops), loops, dict(wider))


def _count(jaxpr) -> tuple[dict[str, float], Counter, int, Counter]:
  flops: dict[str, float] = collections.defaultdict(float)
  ops: Counter = Counter()
  wider: Counter = Counter()
  loops = 0
  for eqn in jaxpr.eqns:
    name = eqn.primitive.name
    avals = [v.aval for v in eqn.invars]
    if name in _autocast.COMPUTE_PRIMITIVES:
      lhs, rhs = avals[0].dtype.name, avals[1].dtype.name
      key = _float8.BACKWARD.name if _float8.BACKWARD.name in (lhs, rhs) else lhs if lhs == rhs else f"{lhs}*{rhs}"
      flops[key] += _flops(eqn)
    elif name in _autocast.FLOAT32_PRIMITIVES and any(
        _interpret.floating(a) and np.dtype(a.dtype).itemsize < 4 for a in avals
    ):
      ops[name] += 1
    subs = [_count(j) for j in _interpret.subjaxprs(eqn.params)]
    if not subs:
      continue
    if name == "cond":  # one branch runs: the costliest
      subs = [max(subs, key=lambda sub: sum(sub[0].values()))]
    times = eqn.params.get("length", 1) if name == "scan" else 1
    loops += name == "while"
    # A float8 policy's matmul kept wider sits in a jit named after the reason (under `jax.grad`
    # too, inside "jvp(...)" / "transpose(...)").
    reason = str(eqn.params.get("name", "")).partition(_float8.WIDER)[2].partition(")")[0]
    for sub_flops, sub_ops, sub_loops, sub_wider in subs:
      for key, value in sub_flops.items():
        flops[key] += value * times
      for key, value in sub_ops.items():
        ops[key] += value * times
      for key, value in (sub_wider if not reason else {reason: sum(sub_flops.values())}).items():
        wider[key] += value * times
      loops += sub_loops
  return flops, ops, loops, wider


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

