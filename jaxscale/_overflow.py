"""Finding the overflow: the operation that made the inf or NaN of a scaled step.

A skipped step says only that some gradient held an inf or a NaN; ``find_overflow`` names the
operation that made it. It traces what the gradient site computes (``fun``'s loss times the
scale, and the VJP of that product seeded with 1, as ``jaxscale.value_and_grad`` does) into one
jaxpr, then runs that jaxpr one operation at a time on the real values, as ``jax_debug_nans``
does, and follows each inf and NaN back to the operation that *made* it::

    made        its result holds a NaN that none of its inputs held, or an inf that none of
                them held, and no input holds one that an earlier operation made (that one is
                the cause: inf - inf = NaN only passes it on); a value given non-finite, an
                attention mask's -inf, is no operation's: one that makes a NaN of it is reported
    reported    each non-finite value carries the operation that made it (the earliest, of
                several); the report is on the earliest whose inf or NaN reaches the gradients
                (the step is skipped for it), else the loss, else the earliest of all
    phase       "backward" for the operations that read the cotangent (the seed and all that
                is computed from it), "forward" for the others: the VJP's forward operations
                come first and none of them reads the seed
    where       the first frame of the operation's traceback outside JAX, jaxscale, Flax,
                Equinox and Python's own library (the user's line); the module path in its
                name stack (Flax names its modules there), transformations like ``jvp(...)``
                stripped; and the iteration of each scan or while loop around it

Calls (``jit``, ``checkpoint``, a ``custom_jvp`` / ``custom_vjp`` function: a sub-program taking
the operation's inputs and returning its outputs one to one) run inline; a ``cond`` runs the
branch its index picks; ``scan`` and ``while`` run their bodies one iteration at a time. Any
other higher-order primitive is refused by name.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import math
import os
import re
import sysconfig
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.core import Tracer

from jaxscale import _interpret, _scaler

# The name scope of the loss's own scaling, so that an overflow there reads as what it is.
LOSS_SCALING = "loss_scaling"

# The `primitive` of a report on a non-finite argument: no operation made it.
ARGUMENT = "argument"

# Primitives whose jaxpr parameter is an elementwise combiner, not a sub-program to run: they
# are bound as they are, like any first-order primitive.
_COMBINERS = ("scatter", "reduce", "select_and_scatter", "select_and_gather")


@dataclasses.dataclass(frozen=True)
class OverflowReport:
  """The operation that made a scaled step's inf or NaN; ``str()`` says it in a sentence.

  Attributes:
    primitive: the JAX primitive's name (``"dot_general"``, ``"exp"``, ``"log"``, ...).
    phase: ``"forward"`` (computing the scaled loss) or ``"backward"`` (its gradient).
    source: the user's ``path:line`` that made the operation (the first frame outside JAX,
      jaxscale, Flax and Equinox); ``""`` if there is none.
    name_stack: the module path around it (``"MLP/Dense_1"``: Flax linen names its modules;
      a ``jax.named_scope`` does in any code); ``"loss_scaling"`` for the loss's own scaling;
      ``""`` when there is none.
    dtype: the result's dtype name (``"float16"``).
    max_input_magnitude: the largest finite magnitude among its floating inputs.
    iteration: for an operation in the body of a ``scan`` or ``while`` loop, which iteration
      of each, outermost first (for a scan, the index of the slice it reads, so a scan over
      layers names the layer in the forward and the backward pass alike); ``()`` outside loops.
    made: what its result holds that no input held: ``"inf"``, ``"-inf"``, ``"NaN"`` or a list.
    scale: the loss scale it ran at.
    reaches: where its inf or NaN goes: ``"gradients"`` (the gradient site's check fails and
      the step is skipped: :attr:`skips_step`), ``"loss"`` (the loss only: the step is taken),
      or ``""`` (neither: the program drops or masks it). The operation reported is the
      earliest that reaches the gradients, else the loss, else the earliest of all.

  Examples:
    >>> import jax.numpy as jnp, jaxscale
    >>> x = jnp.array([300.0, 1.0], jnp.float16)
    >>> report = jaxscale.find_overflow(lambda x: jnp.sum(x * x), jaxscale.init(init_scale=1.0), x)
    >>> report.primitive, report.phase, report.dtype, report.max_input_magnitude, report.made
    ('mul', 'forward', 'float16', 300.0, 'inf')
  """

  primitive: str
  phase: str
  source: str
  name_stack: str
  dtype: str
  max_input_magnitude: float
  iteration: tuple[int, ...] = ()
  made: str = "inf"
  scale: float = 1.0
  reaches: str = "gradients"

  @property
  def skips_step(self) -> bool:
    """Whether its inf or NaN reaches the gradients, so that the gradient site skips the step."""
    return self.reaches == "gradients"

  def __str__(self) -> str:
    if self.primitive == ARGUMENT:
      return f"`fun`'s argument `{self.name_stack}` ({self.dtype}) holds {self.made} before any operation runs."
    where = f" in `{self.name_stack}`" if self.name_stack else ""
    line = f" ({os.path.basename(self.source)})" if self.source else ""
    what = f"overflowed {self.dtype}" if "inf" in self.made else f"made NaN in {self.dtype}"
    loop = f" at iteration {', '.join(map(str, self.iteration))}" if self.iteration else ""
    limit = ""
    if jnp.issubdtype(self.dtype, jnp.floating):
      limit = f" ({self.dtype} holds up to {float(jnp.finfo(self.dtype).max):.3g})"
    hint = ""
    if self.name_stack == LOSS_SCALING and self.dtype in ("float16", "bfloat16"):
      hint = "; the scaled loss does not fit its dtype: return the loss in float32"
    if not self.skips_step:
      reached = "the loss but no gradient" if self.reaches == "loss" else "neither the loss nor the gradients"
      hint += f"; it reaches {reached}, so the step is not skipped for it"
    return (
        f"{self.primitive}{where}{line} {what} in the {self.phase} pass{loop} at loss scale "
        f"{_power_of_two(self.scale)}: its inputs reach {self.max_input_magnitude:.3g} and its result holds "
        f"{self.made}{limit}{hint}."
    )


def find_overflow(
    fun: Callable[..., Any],
    scaler: _scaler.ScalerState,
    *args: Any,
    argnums: int | Sequence[int] = 0,
    has_aux: bool = False,
    **kwargs: Any,
) -> OverflowReport | None:
  """The operation that made a scaled step's first inf or NaN, or None if every value is finite.

  Runs ``fun(*args, **kwargs)`` with its loss multiplied by ``scaler``'s scale and the
  gradient of that product with respect to ``args[argnums]``, as :func:`value_and_grad` does,
  one operation at a time on the real values (eagerly: slow, for diagnosis). An operation
  made an inf or a NaN when its result holds one that none of its inputs held (an inf that
  only passes on, or becomes a NaN, is its maker's). The report is on the earliest operation
  whose inf or NaN reaches the gradients (the one the step was skipped for), else the loss,
  else the earliest of all (``OverflowReport.reaches`` says which). For a skipped step, hand
  it the loss function, batch and scaler of that step (the scaler before the step's update).

  Each value is rounded to its dtype, as the program states: a compiled step may keep a fused
  float16 intermediate in float32 (XLA's excess precision) and overflow less.

  Calls (``jit``, ``checkpoint``, ``custom_jvp``, ``custom_vjp``) are looked into; a ``scan``
  or ``while_loop`` body is run iteration by iteration and the report says which; a ``cond``
  runs the branch taken. Functions made by :func:`autocast`, Flax and Equinox models work as
  they are; Flax linen's module names reach ``name_stack``, and ``jax.named_scope`` names any
  other block.

  Args:
    fun: the loss function; returns a scalar floating loss, or ``(loss, aux)`` with
      ``has_aux``.
    scaler: the :class:`ScalerState` the step used (``jaxscale.find_scaler(opt_state)``).
    *args: ``fun``'s positional arguments: concrete values, not traced ones.
    argnums: which positional argument(s) to differentiate with respect to, as in ``jax.grad``.
    has_aux: as in ``jax.grad``: ``fun`` returns ``(loss, aux)`` and only ``loss`` is scaled.
    **kwargs: ``fun``'s keyword arguments.

  Returns:
    An :class:`OverflowReport`, or None if no operation made an inf or a NaN.

  Raises:
    TypeError: if ``scaler`` is not a :class:`ScalerState`, ``fun`` is not callable, an
      argument is traced (inside ``jit``), or the loss is not a floating scalar.
    ValueError: if ``argnums`` names no positional argument.
    NotImplementedError: for a higher-order primitive it cannot run operation by operation.

  Examples:
    >>> import jax.numpy as jnp, jaxscale
    >>> def loss(w, x):
    ...   return jnp.mean((x @ w).astype(jnp.float32) ** 2)
    >>> w, x = jnp.full((4, 2), 2e4, jnp.float16), jnp.ones((3, 4), jnp.float16)
    >>> print(jaxscale.find_overflow(loss, jaxscale.init(init_scale=1.0), w, x))  # x @ w = 8e4
    dot_general (<doctest ...>:2) overflowed float16 in the forward pass at loss scale 1: its inputs
    reach 2e+04 and its result holds inf (float16 holds up to 6.55e+04).
    >>> print(jaxscale.find_overflow(loss, jaxscale.init(init_scale=1.0), w / 2, x))
    None
  """
  if not callable(fun):
    raise TypeError(
        "`find_overflow` takes the loss function first, then the scaler and its arguments: "
        f"`find_overflow(fun, scaler, *args)`; got {fun!r} of type {type(fun).__name__} as `fun`."
    )
  _scaler.require_state(scaler, "find_overflow", " It comes second: `find_overflow(fun, scaler, *args)`.")
  nums = _argnums(argnums, len(args))
  leaves, treedef = jax.tree.flatten((args, kwargs))
  if any(isinstance(x, Tracer) for x in [*leaves, *jax.tree.leaves(scaler)]):
    raise TypeError(
        "`find_overflow` runs eagerly, one operation at a time on real values: call it outside "
        "`jit` (and `grad`, `vmap`), with the batch and the scaler that the skipped step used."
    )
  # The leaves of `args[argnums]` are differentiated where they are arrays (or Python floats, as
  # `jax.grad` would), like `eqx.filter_grad`'s: an Equinox model's functions stay as they are.
  ends = np.cumsum([len(jax.tree.leaves(a)) for a in args])
  differentiated = {k for i in nums for k in range(ends[i] - len(jax.tree.leaves(args[i])), ends[i])}
  dynamic = [
      k for k, leaf in enumerate(leaves)
      if isinstance(leaf, (jax.Array, np.ndarray, np.generic))
      or (k in differentiated and isinstance(leaf, (float, complex)) and not isinstance(leaf, bool))
  ]
  diff_at = [k for k in dynamic if k in differentiated]

  def step(*arrays):
    *arrays, seed = arrays
    given = list(leaves)
    for k, x in zip(dynamic, arrays):
      given[k] = x

    def scaled_loss(*diff):
      run_leaves = list(given)
      for k, x in zip(diff_at, diff):
        run_leaves[k] = x
      run_args, run_kwargs = jax.tree.unflatten(treedef, run_leaves)
      out = fun(*run_args, **run_kwargs)
      loss = _loss(out, has_aux)
      with jax.named_scope(LOSS_SCALING):
        return _scaler.scale_unchecked(scaler, loss), out[1] if has_aux else None

    loss, pullback, _ = jax.vjp(scaled_loss, *(given[k] for k in diff_at), has_aux=True)
    return loss, pullback(seed.astype(loss.dtype))

  inputs = [*(leaves[k] for k in dynamic), np.float32(1.0)]  # the seed last
  closed = jax.make_jaxpr(step)(*inputs)
  run = _Run(scale=float(np.asarray(scaler.scale)))
  outs, origins = run.program(
      closed.jaxpr, closed.consts, inputs, [None] * len(inputs), _Where(), seed=closed.jaxpr.invars[-1]
  )
  # The outputs are the scaled loss, then the gradients.
  for reaches, origin in (("gradients", _earliest(origins[1:])), ("loss", origins[0])):
    if origin is not None:
      return dataclasses.replace(run.made[origin], reaches=reaches)
  gradients = _Census.of([x for x in outs[1:] if _interpret.floating(x)])
  if not (gradients.finite and _Census.of(outs[:1]).finite):  # no operation made it: it was given
    reaches = "gradients" if not gradients.finite else "loss"
    return dataclasses.replace(_argument(args, kwargs, run.scale), reaches=reaches)
  return dataclasses.replace(run.made[0], reaches="") if run.made else None


def _argnums(argnums, count: int) -> tuple[int, ...]:
  nums = (argnums,) if isinstance(argnums, int) else tuple(argnums)
  if not nums or not all(isinstance(i, int) and not isinstance(i, bool) for i in nums):
    raise ValueError(
        f"`find_overflow`'s `argnums` must be an int or a sequence of ints, as for `jax.grad`; got {argnums!r}."
    )
  if not all(-count <= i < count for i in nums):
    raise ValueError(
        f"`find_overflow`'s `argnums={argnums!r}` names no positional argument of `fun`: it was given {count} "
        "(after `fun` and the scaler). Pass the parameters positionally: "
        "`find_overflow(fun, scaler, params, batch)`."
    )
  return tuple(i % count for i in nums)


def _argument(args, kwargs, scale: float) -> OverflowReport:
  """The report on the first floating argument that holds an inf or a NaN (or a constant of ``fun``'s)."""
  for (where, *rest), leaf in jax.tree_util.tree_flatten_with_path((args, kwargs))[0]:
    census = _Census.of([leaf]) if _interpret.floating(leaf) else None
    if census is None or census.finite:
      continue
    keys = jax.tree_util.keystr
    name = f"args{keys(tuple(rest))}" if where.idx == 0 else f"{rest[0].key}{keys(tuple(rest[1:]))}"
    dtype = np.dtype(leaf.dtype).name
    return OverflowReport(ARGUMENT, "forward", "", name, dtype, census.largest, made=census.holds(), scale=scale)
  constant = "a constant that `fun` closes over"
  return OverflowReport(ARGUMENT, "forward", "", constant, "float32", 0.0, made="inf or NaN", scale=scale)


def _loss(out, has_aux: bool):
  """``fun``'s loss, checked as ``jax.grad`` would: a floating scalar."""
  if has_aux and not (isinstance(out, (tuple, list)) and len(out) == 2):
    shape = getattr(out, "shape", None)
    what = f"an array of shape {shape}" if shape is not None else f"a {type(out).__name__}"
    raise TypeError(
        f"With `has_aux=True`, `fun` must return a pair `(loss, aux)`, as for `jax.grad`; it returned {what}."
    )
  loss = out[0] if has_aux else out
  if isinstance(loss, (tuple, list, dict)):
    raise TypeError(
        f"`find_overflow`'s `fun` must return a scalar loss, as for `jax.grad`; it returned a {type(loss).__name__}"
        f"{'' if has_aux else ' (pass `has_aux=True` if it returns `(loss, aux)`)'}."
    )
  if jnp.shape(loss) != ():
    raise TypeError(
        f"`find_overflow`'s `fun` must return a scalar loss, as for `jax.grad`; it returned shape {jnp.shape(loss)}: "
        "reduce it (`jnp.mean`)."
    )
  if not jnp.issubdtype(jnp.result_type(loss), jnp.floating):
    raise TypeError(
        f"`find_overflow`'s `fun` must return a floating loss, as for `jax.grad`; it returned {jnp.result_type(loss)}."
    )
  return loss


@dataclasses.dataclass(frozen=True)
class _Where:
  """Where in the program an operation runs."""

  phase: str = "forward"
  names: str = ""  # the module path of the enclosing operations
  iteration: tuple[int, ...] = ()

  def inside(self, eqn, phase: str) -> _Where:
    names = "/".join(filter(None, (self.names, _module_path(str(eqn.source_info.name_stack)))))
    return dataclasses.replace(self, phase=phase, names=names)

  def at(self, i: int) -> _Where:
    return dataclasses.replace(self, iteration=(*self.iteration, i))


@dataclasses.dataclass
class _Run:
  """One run of the program, value by value, with each non-finite value's origin.

  A value's origin is the index in ``made`` of the operation that made its inf or NaN (the
  earliest, where it inherits from several inputs), or None for a finite value or one that
  arrived non-finite (an argument, a constant).
  """

  scale: float
  made: list[OverflowReport] = dataclasses.field(default_factory=list)  # in the order they ran

  def program(self, jaxpr, consts, args, origins, where: _Where, *, seed=None) -> tuple[list, list]:
    """The outputs of ``jaxpr`` on ``args``, and their origins.

    At the top level, ``seed`` is the cotangent's input: an operation that reads it, or a
    value computed from it, is in the backward pass. A sub-program is in its caller's phase.
    """
    env: dict = dict(zip(jaxpr.constvars, consts))
    env.update(zip(jaxpr.invars, args))
    came: dict = dict(zip(jaxpr.invars, origins))
    read = lambda v: v.val if _interpret.is_literal(v) else env[v]
    origin = lambda v: None if _interpret.is_literal(v) else came.get(v)
    backward = {seed} if seed is not None else set()
    for eqn in jaxpr.eqns:
      phase = where.phase
      if any(not _interpret.is_literal(v) and v in backward for v in eqn.invars):
        backward.update(eqn.outvars)
        phase = "backward"
      outs, out_origins = self.equation(eqn, [read(v) for v in eqn.invars], [origin(v) for v in eqn.invars],
                                        where.inside(eqn, phase))
      env.update(zip(eqn.outvars, outs))
      came.update(zip(eqn.outvars, out_origins))
    return [read(v) for v in jaxpr.outvars], [origin(v) for v in jaxpr.outvars]

  def equation(self, eqn, ins: list, origins: list, where: _Where) -> tuple[list, list]:
    name = eqn.primitive.name
    programs = _interpret.subprograms(eqn.params)
    if not programs or name.startswith(_COMBINERS):
      outs = _interpret.bind(eqn, ins)
      return outs, self.check(eqn, ins, origins, outs, where)
    if name == "cond":
      index = min(max(int(ins[0]), 0), len(programs) - 1)  # as `lax.switch` clamps it
      jaxpr, consts = programs[index]
      return self.program(jaxpr, consts, ins[1:], origins[1:], where)
    if name == "while":
      return self.while_loop(eqn, ins, origins, programs, where)
    if name == "scan":
      return self.scan(eqn, ins, origins, programs, where)
    if len(programs) == 1 and _is_call(eqn, programs[0][0]):
      jaxpr, consts = programs[0]
      return self.program(jaxpr, consts, ins, origins, where)
    raise NotImplementedError(
        f"`find_overflow` cannot run the higher-order primitive `{name}` operation by operation (on jax "
        f"{jax.__version__}). Call `find_overflow` on the function inside it, or open an issue naming the primitive."
    )

  def scan(self, eqn, ins, origins, programs, where) -> tuple[list, list]:
    """A scan's body, one iteration at a time; each iteration is named by the slice it reads."""
    try:
      length, reverse = eqn.params["length"], eqn.params["reverse"]
    except KeyError as error:
      raise _interpret.version_error("scan", f"its parameter {error} is not where `find_overflow` reads it") from error
    (jaxpr, consts), = programs
    consts_count, carry_count = _scan_split(eqn, jaxpr)
    split = consts_count + carry_count
    carry, carry_origins = ins[consts_count:split], origins[consts_count:split]
    ys, y_origins = [None] * length, [[None] * (len(eqn.outvars) - carry_count)]
    for step in range(length):
      i = length - 1 - step if reverse else step
      outs, out_origins = self.program(
          jaxpr, consts, [*ins[:consts_count], *carry, *(x[i] for x in ins[split:])],
          [*origins[:consts_count], *carry_origins, *origins[split:]], where.at(i),
      )
      carry, carry_origins, ys[i] = outs[:carry_count], out_origins[:carry_count], outs[carry_count:]
      y_origins.append(out_origins[carry_count:])
    stacked = [
        jnp.stack([y[k] for y in ys]) if length else jnp.zeros(v.aval.shape, v.aval.dtype)
        for k, v in enumerate(eqn.outvars[carry_count:])
    ]
    return [*carry, *stacked], [*carry_origins, *map(_earliest, zip(*y_origins))]

  def while_loop(self, eqn, ins, origins, programs, where) -> tuple[list, list]:
    """A while loop's condition and body, one iteration at a time, counted from 0.

    Its sub-programs are the condition and the body, in that order (``while_loop``'s); the
    constants of each are told apart by their counts: the body returns the carry alone.
    """
    if len(programs) != 2:
      raise _interpret.version_error("while", "its condition and body are not where `find_overflow` reads them")
    (cond, cond_consts), (body, body_consts) = programs
    carried = len(body.outvars)
    cond_count, body_count = len(cond.invars) - carried, len(body.invars) - carried
    if len(cond.outvars) != 1 or cond_count + body_count + carried != len(ins):
      raise _interpret.version_error("while", "its condition and body are not where `find_overflow` reads them")
    split = cond_count + body_count
    carry, carry_origins, i = ins[split:], origins[split:], 0
    while True:
      (go,), _ = self.program(cond, cond_consts, [*ins[:cond_count], *carry],
                              [*origins[:cond_count], *carry_origins], where.at(i))
      if not bool(go):
        return carry, carry_origins
      carry, carry_origins = self.program(body, body_consts, [*ins[cond_count:split], *carry],
                                          [*origins[cond_count:split], *carry_origins], where.at(i))
      i += 1

  def check(self, eqn, ins, origins, outs, where: _Where) -> list:
    """The origins of ``outs``: this operation if it made their inf or NaN, else its inputs'."""
    floating = [_interpret.floating(v.aval) for v in eqn.outvars]
    censuses = [_Census.of([x]) if f else None for x, f in zip(outs, floating)]
    if all(c is None or c.finite for c in censuses):
      return [None] * len(outs)
    given = _Census.of([x for x, v in zip(ins, eqn.invars) if _interpret.floating(v.aval)])
    new = _Census.of([x for x, f in zip(outs, floating) if f]).holds(given)
    origin = _earliest(origins)
    if new and origin is None:  # not an inf that an earlier operation made, turned into a NaN here
      self.made.append(OverflowReport(
          primitive=eqn.primitive.name, phase=where.phase, source=_source(eqn), name_stack=where.names,
          dtype=np.dtype(next(v.aval.dtype for v, f in zip(eqn.outvars, floating) if f)).name,
          max_input_magnitude=given.largest, iteration=where.iteration, made=new, scale=self.scale,
      ))
      origin = len(self.made) - 1
    return [None if c is None or c.finite else origin for c in censuses]


def _earliest(origins):
  return min((o for o in origins if o is not None), default=None)


@dataclasses.dataclass(frozen=True)
class _Census:
  """What a set of floating arrays holds: NaNs, infinities, and the largest finite magnitude."""

  nan: bool
  positive_inf: bool
  negative_inf: bool
  largest: float

  @property
  def inf(self) -> bool:
    return self.positive_inf or self.negative_inf

  @property
  def finite(self) -> bool:
    return not (self.nan or self.inf)

  def holds(self, before: _Census | None = None) -> str:
    """What these arrays hold that ``before`` did not: ``"inf"``, ``"-inf"``, ``"NaN"``, joined by "and"."""
    before = before or _Census(False, False, False, 0.0)
    found = (
        ("inf", self.positive_inf and not (before.inf or before.nan)),
        ("-inf", self.negative_inf and not (before.inf or before.nan)),
        ("NaN", self.nan and not before.nan),
    )
    return " and ".join(name for name, new in found if new)

  @classmethod
  def of(cls, arrays) -> _Census:
    if not arrays:
      return cls(False, False, False, 0.0)
    # Reduced where the arrays are (a GPU's activations are not copied to the host), four
    # numbers back.
    flags, largest = _summary([jnp.asarray(a) for a in arrays])
    nan, positive_inf, negative_inf = map(bool, flags)
    return cls(nan, positive_inf, negative_inf, max(map(float, largest)))


@jax.jit
def _summary(arrays):
  """Whether ``arrays`` hold a NaN, an inf and a -inf, and their largest finite magnitude."""
  flags, largest = [], []
  for a in arrays:
    a = jnp.abs(a) if jnp.iscomplexobj(a) else a  # a complex value by its magnitude
    # float32 holds every narrower format's values exactly.
    a = a.astype(jnp.float32) if jnp.finfo(a.dtype).bits < 32 else a
    flags.append(jnp.stack([jnp.isnan(a).any(), jnp.isposinf(a).any(), jnp.isneginf(a).any()]))
    largest.append(jnp.max(jnp.where(jnp.isfinite(a), jnp.abs(a), 0), initial=0))
  return jnp.stack(flags).any(axis=0), largest


def _scan_split(eqn, body) -> tuple[int, int]:
  """How many of a scan's operands are constants and how many carries, from the shapes alone.

  JAX renames the parameters that count them between releases (`num_consts` and `num_carry`
  became a tree of the operands in 0.12); the shapes say the same on every release: the body
  returns the carry first, at its own shape, then each iteration's slice of the outputs, and the
  scanned inputs come last, each one rank above the body's slice of it.
  """
  rank = lambda v: len(v.aval.shape)
  carry_count = 0
  for outer, inner in zip(eqn.outvars, body.outvars):
    if rank(outer) != rank(inner):
      break
    carry_count += 1
  scanned = sum(rank(outer) == rank(inner) + 1 for outer, inner in zip(eqn.invars, body.invars))
  return len(eqn.invars) - carry_count - scanned, carry_count


def _is_call(eqn, jaxpr) -> bool:
  """A sub-program that takes the operation's inputs and returns its outputs, one to one."""
  shapes = lambda vs: [getattr(v.aval, "shape", None) for v in vs]
  return shapes(jaxpr.invars) == shapes(eqn.invars) and shapes(jaxpr.outvars) == shapes(eqn.outvars)


def _module_path(name_stack: str) -> str:
  """``"transpose(jvp(MLP))/Dense_1"`` -> ``"MLP/Dense_1"``: the scopes, without transformations."""
  parts = []
  for part in name_stack.split("/"):
    while match := re.fullmatch(r"[\w.-]+\((.*)\)", part):
      part = match.group(1)
    parts.append(part)
  return "/".join(filter(None, parts))


def _source(eqn) -> str:
  """``path:line`` of the innermost frame of ``eqn``'s traceback outside the libraries."""
  traceback = getattr(eqn.source_info, "traceback", None)
  packages, stdlib = _library_dirs()
  for frame in getattr(traceback, "frames", ()):
    path = os.path.realpath(frame.file_name) if os.path.isabs(frame.file_name) else frame.file_name
    installed = any(part in ("site-packages", "dist-packages") for part in path.split(os.sep))
    if not (path.startswith(packages) or (path.startswith(stdlib) and not installed)):
      return f"{frame.file_name}:{frame.line_num}"
  return ""


@functools.cache
def _library_dirs() -> tuple[tuple[str, ...], str]:
  """The folders of the libraries whose frames are not the user's (found, not imported), and
  Python's own library (whose folder holds the installed packages in some environments)."""
  dirs = []
  for name in ("jax", "jaxlib", "jaxscale", "flax", "equinox"):
    spec = importlib.util.find_spec(name)
    dirs.extend((spec.submodule_search_locations or ()) if spec is not None else ())
  folder = lambda d: os.path.join(os.path.realpath(d), "")
  return tuple(map(folder, dirs)), folder(sysconfig.get_paths()["stdlib"])


def _power_of_two(scale: float) -> str:
  exponent = math.log2(scale) if scale > 0 and math.isfinite(scale) else 0.5
  return f"2^{exponent:.0f}" if exponent.is_integer() and exponent not in (0, 1) else f"{scale:g}"
