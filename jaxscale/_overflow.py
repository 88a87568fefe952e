"""Finding the overflow: the operation that made the inf or NaN of a scaled step.

A skipped step says only that some gradient held an inf or a NaN; ``find_overflow`` names the
operation that made it. It traces what the gradient site computes (``fun``'s loss times the
scale, the VJP of that product seeded with 1, and the unscaling of the gradients, as
``jaxscale.value_and_grad`` does) into one jaxpr, then runs that jaxpr one operation at a time
on the real values, as ``jax_debug_nans`` does, and follows each inf and NaN back to where it
came from::

    made        an operation made an inf or a NaN where its result holds one that its finite
                inputs alone make: each non-finite input element is replaced by 0, then by
                1, and the operation run again; what stays non-finite in both runs (and in
                the real one) is its own. So a -inf mask in an input hides no overflow of
                the operation's, and inf - inf = NaN only passes an inf on. A NaN made from
                the inf of a constant (a mask's -inf) is the operation's too
    given       a non-finite argument is where its inf or NaN comes from, whatever the
                operations after it make of it (inf * 0 = NaN in a backward matmul included)
    reported    each non-finite value carries the place it came from: the earliest operation
                that made one of its inputs' or its own, else an argument, else a constant
                (an operation's own overflow comes before a mask's -inf it read); the report
                is on the one that reaches the unscaled gradients (the step is skipped for
                it), else the loss, else the earliest operation of all
    phase       "backward" for the operations that read the cotangent (the seed and all that
                is computed from it) and for the derivative factors the forward pass computes
                for them (the ``y**-2`` of a division: what the loss does not need but the
                gradients do), with the forward operation they differentiate; "forward" else
    where       the innermost frame of the operation's traceback outside JAX, jaxscale, Flax,
                Equinox and Python's own library (the user's line), else that of the call
                around it (a jitted library function); the module path in its name stack
                (Flax linen names its modules there; an NNX module's path in the model is
                pushed there while ``find_overflow`` traces), transformations like
                ``jvp(...)`` stripped; and the iteration of each scan or while loop around it
    compiled    when every value is finite run op by op but the compiled program's gradients
                are not (XLA folds ``h * 300 * 300`` into one float16 multiply by inf), the
                compiled program is run again with every intermediate value returned, and the
                first operation that made an inf or a NaN there is reported, marked compiled

Calls (``jit``, ``checkpoint``, a ``custom_jvp`` / ``custom_vjp`` function: a sub-program taking
the operation's inputs and returning its outputs one to one) run inline; a ``cond`` runs the
branch its index picks; ``scan`` and ``while`` run their bodies one iteration at a time. Any
other higher-order primitive is refused by name.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib.util
import math
import os
import re
import sys
import sysconfig
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.core import Tracer

from jaxscale import _interpret, _scaler

# The name scope of the loss's own scaling and of the gradients' unscaling, so that an overflow
# there reads as what it is.
LOSS_SCALING = "loss_scaling"

# The `primitive` of a report on a non-finite argument: no operation made it.
ARGUMENT = "argument"

# Primitives whose jaxpr parameter is an elementwise combiner, not a sub-program to run: they
# are bound as they are, like any first-order primitive.
_COMBINERS = ("scatter", "reduce", "select_and_scatter", "select_and_gather")

# The origin of a value that the program itself holds non-finite (a literal, a closed-over
# constant: a mask's -inf): later than every argument and operation, so any other wins.
_CONSTANT = sys.maxsize


@dataclasses.dataclass(frozen=True)
class OverflowReport:
  """The operation that made a scaled step's inf or NaN; ``str()`` says it in a sentence.

  Attributes:
    primitive: the JAX primitive's name (``"dot_general"``, ``"exp"``, ``"log"``, ...);
      ``"argument"`` for a non-finite argument of ``fun`` (named in ``name_stack``); ``""``
      for a compiled step that no single operation explains (see ``compiled``).
    phase: ``"forward"`` (computing the scaled loss) or ``"backward"`` (its gradient: the
      operations that read the cotangent, and the derivative factors computed beside the
      forward pass for them, see ``derivative_of``).
    source: the user's ``path:line`` that made the operation (the innermost frame outside
      JAX, jaxscale, Flax and Equinox, else that of the call around it, for an operation
      inside a jitted library function such as ``jax.nn.standardize``); ``""`` if none.
    name_stack: the module path around it (``"MLP/Dense_1"``: Flax linen names its modules;
      an NNX module by its path in the model, ``"Net/blocks[1]/linear"``; a
      ``jax.named_scope`` in any code); ``"loss_scaling"`` for the loss's own scaling and the
      gradients' unscaling; ``""`` when there is none. For ``"argument"``: which argument.
    dtype: the result's dtype name (``"float16"``).
    max_input_magnitude: the largest finite magnitude among its floating inputs.
    iteration: for an operation in the body of a ``scan`` or ``while`` loop, which iteration
      of each, outermost first (for a scan, the index of the slice it reads, so a scan over
      layers names the layer in the forward and the backward pass alike); ``()`` outside loops.
    made: what its result holds that its finite inputs made: ``"inf"``, ``"-inf"``, ``"NaN"``
      or a list.
    scale: the loss scale it ran at.
    reaches: where its inf or NaN goes: ``"gradients"`` (the gradient site's check fails and
      the step is skipped: :attr:`skips_step`), ``"loss"`` (the loss only: the step is taken),
      or ``""`` (neither: the program drops or masks it). The operation reported is the
      earliest that reaches the gradients, else the loss, else the earliest of all.
    derivative_of: for a derivative factor (the ``y**-2`` of ``x / y``, the ``0.5 / sqrt(x)``
      of ``sqrt``, computed beside the forward pass for the backward one), the forward
      primitive it differentiates; ``""`` otherwise.
    division_by_zero: its inf is a division by an exact zero (``x / 0``, ``rsqrt(0)``,
      ``0 ** -2``), not a finite result too large for ``dtype``.
    compiled: run operation by operation every value is finite, but the compiled program's
      gradients are not: the compiled program made this inf (XLA rewrote the operation, for
      instance folded constants in float16). Cross-check with ``value_and_grad``'s flag.

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
  derivative_of: str = ""
  division_by_zero: bool = False
  compiled: bool = False

  @property
  def skips_step(self) -> bool:
    """Whether its inf or NaN reaches the gradients, so that the gradient site skips the step."""
    return self.reaches == "gradients"

  def __str__(self) -> str:
    reached = ""
    if not self.skips_step:
      reached = "the loss but no gradient" if self.reaches == "loss" else "neither the loss nor the gradients"
      reached = f"; it reaches {reached}, so the step is not skipped for it"
    if self.primitive == ARGUMENT:
      held = f"holds {self.made} before any operation runs"
      return f"`fun`'s argument `{self.name_stack}` ({self.dtype}) {held}{reached}."
    if not self.primitive:
      return (
          f"The compiled step's gradients hold {self.made} at loss scale {_power_of_two(self.scale)}, but run "
          "operation by operation every value is finite, and no single operation of the compiled program shows "
          "where: XLA rewrote the program (it folds constants and reassociates in the narrow dtype)."
      )
    where = f" in `{self.name_stack}`" if self.name_stack else ""
    line = f" ({os.path.basename(self.source)})" if self.source else ""
    of = f", in the derivative of `{self.derivative_of}`," if self.derivative_of else ""
    if self.division_by_zero:
      what = "divided by zero"
    else:
      what = f"overflowed {self.dtype}" if "inf" in self.made else f"made NaN in {self.dtype}"
    loop = f" at iteration {', '.join(map(str, self.iteration))}" if self.iteration else ""
    limit = ""
    if jnp.issubdtype(self.dtype, jnp.floating) and not self.division_by_zero:
      limit = f" ({self.dtype} holds up to {float(jnp.finfo(self.dtype).max):.3g})"
    hint = ""
    if self.name_stack == LOSS_SCALING and self.phase == "backward" and self.scale < 1:
      hint = (f"; the scale is below 1, and the true (unscaled) gradient does not fit {self.dtype}: floor the scale "
              "with `min_scale=1` or make the loss smaller")
    elif self.name_stack == LOSS_SCALING and self.dtype in ("float16", "bfloat16"):
      hint = "; the scaled loss does not fit its dtype: return the loss in float32"
    compiled = ""
    if self.compiled:
      compiled = ("In the compiled step only (run operation by operation, every value is finite: XLA rewrote "
                  "this operation, for instance folded its constants in the narrow dtype): ")
    return (
        f"{compiled}{self.primitive}{where}{line}{of} {what} in the {self.phase} pass{loop} at loss scale "
        f"{_power_of_two(self.scale)}: its inputs reach {self.max_input_magnitude:.3g} and its result holds "
        f"{self.made}{limit}{hint}{reached}."
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

  Runs ``fun(*args, **kwargs)`` with its loss multiplied by ``scaler``'s scale, the gradient of
  that product with respect to ``args[argnums]`` and its unscaling, as :func:`value_and_grad`
  does, one operation at a time on the real values (eagerly: slow, for diagnosis). An
  operation made an inf or a NaN when its result holds one that its finite inputs alone make
  (an inf that only passes on, or becomes a NaN, is its maker's; a non-finite argument is
  named as such). The report is on the earliest whose inf or NaN reaches the gradients (the
  one the step was skipped for), else the loss, else the earliest of all
  (``OverflowReport.reaches`` says which). For a skipped step, hand it the loss function,
  batch and scaler of that step (the scaler before the step's update).

  What is differentiated is what the gradient sites differentiate: the ``nnx.Param`` s of an
  NNX module (as ``jaxscale.flax.value_and_grad``: not a ``BatchNorm``'s statistics), the
  floating arrays of an argument holding an Equinox module (as
  ``jaxscale.equinox.filter_value_and_grad``: not a plain float field), else every floating
  leaf (as ``jaxscale.value_and_grad``).

  Each value is rounded to its dtype, as the program states. Where every value is finite
  that way but the compiled program's gradients are not (XLA rewrote an operation), the
  compiled program is run and its operation reported with ``compiled=True``: never None for
  a step the compiled gradient site would skip. The reverse, a report on a step the compiled
  program keeps finite (XLA keeps a fused float16 intermediate in float32), can happen: the
  step's own ``finite`` flag is the arbiter.

  Calls (``jit``, ``checkpoint``, ``custom_jvp``, ``custom_vjp``) are looked into; a ``scan``
  or ``while_loop`` body is run iteration by iteration and the report says which; a ``cond``
  runs the branch taken. Functions made by :func:`autocast`, Flax and Equinox models work as
  they are; Flax linen's module names and NNX modules' paths reach ``name_stack``, and
  ``jax.named_scope`` names any other block.

  Args:
    fun: the loss function; returns a scalar floating loss, or ``(loss, aux)`` with
      ``has_aux``.
    scaler: the :class:`ScalerState` the step used (``jaxscale.find_scaler(opt_state)``).
    *args: ``fun``'s positional arguments: concrete values, not traced ones.
    argnums: which positional argument(s) to differentiate with respect to, as in ``jax.grad``.
    has_aux: as in ``jax.grad``: ``fun`` returns ``(loss, aux)`` and only ``loss`` is scaled.
    **kwargs: ``fun``'s keyword arguments.

  Returns:
    An :class:`OverflowReport`, or None if no operation made an inf or a NaN and the loss and
    the gradients are finite, op by op and compiled (a ``-inf`` mask given as an argument that
    reaches neither is no report).

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
  with_paths, treedef = jax.tree_util.tree_flatten_with_path((args, kwargs))
  leaves = [leaf for _, leaf in with_paths]
  if any(isinstance(x, Tracer) for x in [*leaves, *jax.tree.leaves(scaler)]):
    raise TypeError(
        "`find_overflow` runs eagerly, one operation at a time on real values: call it outside "
        "`jit` (and `grad`, `vmap`), with the batch and the scaler that the skipped step used."
    )
  ends = np.cumsum([len(jax.tree.leaves(a)) for a in args])
  differentiated = set()
  for i in nums:
    start = ends[i] - len(jax.tree.leaves(args[i]))
    differentiated.update(start + j for j, d in enumerate(_differentiable(args[i])) if d)
  dynamic = [k for k, leaf in enumerate(leaves) if isinstance(leaf, (jax.Array, np.ndarray, np.generic))
             or k in differentiated]
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
      with _module_scopes((run_args, run_kwargs)):
        out = fun(*run_args, **run_kwargs)
      loss = _loss(out, has_aux)
      with jax.named_scope(LOSS_SCALING):
        return _scaler.scale_unchecked(scaler, loss), out[1] if has_aux else None

    loss, pullback, _ = jax.vjp(scaled_loss, *(given[k] for k in diff_at), has_aux=True)
    grads = pullback(seed.astype(loss.dtype))
    with jax.named_scope(LOSS_SCALING):
      return loss, _scaler.unscale_unchecked(scaler, grads)

  inputs = [*(leaves[k] for k in dynamic), np.float32(1.0)]  # the seed last
  closed = jax.make_jaxpr(step)(*inputs)
  run = _Run(scale=float(np.asarray(scaler.scale)))
  run.find_factors(closed.jaxpr)
  origins = run.arguments(inputs, [_name(with_paths[k][0]) for k in dynamic])
  outs, origins = run.program(closed.jaxpr, closed.consts, inputs, origins, _Where(), seed=closed.jaxpr.invars[-1])
  # The outputs are the scaled loss, then the unscaled gradients.
  if (origin := _earliest(origins[1:])) is not None:
    return dataclasses.replace(run.report(origin), reaches="gradients")
  # Op by op the gradients are finite: the compiled program may still skip the step.
  if _compiled_skips(closed, inputs):
    return _compiled_report(run, closed, inputs)
  if origins[0] is not None:
    return dataclasses.replace(run.report(origins[0]), reaches="loss")
  operations = [r for r in run.made if r.primitive != ARGUMENT]
  return dataclasses.replace(operations[0], reaches="") if operations else None


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


def _differentiable(tree) -> list[bool]:
  """Which leaves of ``tree`` the gradient site for it differentiates, as its gradient function would.

  An NNX module: the values of its ``nnx.Param`` s (``nnx.grad``'s default, which
  ``jaxscale.flax.value_and_grad`` uses), not its other variables (a ``BatchNorm``'s running
  statistics). An Equinox module: its floating arrays (``eqx.filter_grad``, which
  ``jaxscale.equinox.filter_value_and_grad`` uses), not a plain float field. Else, as
  ``jax.grad``: arrays and Python floats. Neither library is imported here: a model of theirs
  can only be given if it is.
  """
  leaves = jax.tree.leaves(tree)
  nnx = sys.modules.get("flax.nnx")
  if nnx is not None and _holds(tree, (nnx.Module, nnx.Variable)):
    mask = []
    for item in jax.tree.leaves(tree, is_leaf=lambda x: isinstance(x, nnx.Variable)):
      count = len(jax.tree.leaves(item))
      mask += [isinstance(item, nnx.Param)] * count if isinstance(item, nnx.Variable) else [_array_like(item)]
    if len(mask) == len(leaves):
      return mask
  eqx = sys.modules.get("equinox")
  if eqx is not None and _holds(tree, (eqx.Module,)):
    return [bool(eqx.is_inexact_array(x)) for x in leaves]
  return [_array_like(x) for x in leaves]


def _holds(tree, classes) -> bool:
  return any(isinstance(x, classes) for x in jax.tree.leaves(tree, is_leaf=lambda x: isinstance(x, classes)))


def _array_like(x) -> bool:
  return isinstance(x, (jax.Array, np.ndarray, np.generic, float, complex)) and not isinstance(x, bool)


def _name(path) -> str:
  """An argument's name from its path in ``(args, kwargs)``: ``args[1]['image']``, ``mask``."""
  where, *rest = path
  keys = jax.tree_util.keystr
  return f"args{keys(tuple(rest))}" if where.idx == 0 else f"{rest[0].key}{keys(tuple(rest[1:]))}"


@contextlib.contextmanager
def _module_scopes(tree):
  """While ``fun`` is traced, each NNX module's ``__call__`` runs in a name scope of its path in
  the model (``Net/blocks[1]/linear``): Linen modules push their names, NNX modules do not.

  The module classes found in ``tree`` have their ``__call__`` wrapped for that time (and only
  the modules found answer to it); a module reached by another method, or copied by an NNX
  transformation inside ``fun``, keeps its enclosing scope's name.
  """
  nnx = sys.modules.get("flax.nnx")
  if nnx is None:
    yield
    return
  paths: dict[int, tuple] = {}
  classes: set[type] = set()
  for root in jax.tree.leaves(tree, is_leaf=lambda x: isinstance(x, nnx.Module)):
    if isinstance(root, nnx.Module):
      for path, node in nnx.iter_graph(root):
        if isinstance(node, nnx.Module) and callable(getattr(type(node), "__call__", None)):
          paths.setdefault(id(node), (type(root).__name__, *path))
          classes.add(type(node))
  stack: list[tuple] = []

  def scoped(call):
    @functools.wraps(call)
    def wrapper(self, *args, **kwargs):
      path = paths.get(id(self))
      if path is None or (stack and stack[-1] == path):  # not ours, or `super().__call__`
        return call(self, *args, **kwargs)
      parent = stack[-1] if stack else ()
      relative = path[len(parent):] if stack and path[:len(parent)] == parent else path
      stack.append(path)
      try:
        with jax.named_scope(_module_name(relative)):
          return call(self, *args, **kwargs)
      finally:
        stack.pop()

    return wrapper

  missing = object()
  patched = []
  try:
    for cls in sorted(classes, key=lambda c: len(c.__mro__)):
      patched.append((cls, cls.__dict__.get("__call__", missing)))
      cls.__call__ = scoped(cls.__call__)
    yield
  finally:
    for cls, call in reversed(patched):
      if call is missing:
        delattr(cls, "__call__")
      else:
        cls.__call__ = call


def _module_name(path: tuple) -> str:
  """``("Net", "blocks", 0, "linear")`` -> ``"Net/blocks[0]/linear"``."""
  name = ""
  for part in path:
    name += f"[{part}]" if isinstance(part, int) else f"/{part}"
  return name.lstrip("/")


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
  derivative_of: str = ""
  callers: tuple = ()  # the call operations around it, outermost first

  def inside(self, eqn, phase: str, derivative_of: str = "") -> _Where:
    names = "/".join(filter(None, (self.names, _module_path(str(eqn.source_info.name_stack)))))
    return dataclasses.replace(self, phase=phase, names=names, derivative_of=derivative_of or self.derivative_of)

  def at(self, i: int) -> _Where:
    return dataclasses.replace(self, iteration=(*self.iteration, i))

  def calling(self, eqn) -> _Where:
    return dataclasses.replace(self, callers=(*self.callers, eqn))

  def source(self, eqn) -> str:
    """The user's line of ``eqn``, else of the innermost call around it that has one."""
    for each in (eqn, *reversed(self.callers)):
      if found := _source(each):
        return found
    return ""


@dataclasses.dataclass
class _Run:
  """One run of the program, value by value, with each non-finite value's origin.

  A value's origin is the index in ``made`` of the argument or operation its inf or NaN came
  from (the earliest, where it inherits from several inputs), ``_CONSTANT`` for one the
  program holds, or None for a finite value.
  """

  scale: float
  made: list[OverflowReport] = dataclasses.field(default_factory=list)  # arguments first, then in the order run
  primal: set = dataclasses.field(default_factory=set)  # the operations the loss needs (by id)
  needed: set = dataclasses.field(default_factory=set)  # the operations any output needs
  differentiates: dict = dataclasses.field(default_factory=dict)  # var -> (position, forward primitive)
  position: int = 0
  given: int = 0  # how many of `made` are arguments
  constants: dict = dataclasses.field(default_factory=dict)  # id(array) -> origin

  def find_factors(self, jaxpr) -> None:
    """Marks which operations the loss needs and which any output does: an operation that only
    the gradients need, and that reads no cotangent, is a derivative factor."""
    _needs(jaxpr, [True] + [False] * (len(jaxpr.outvars) - 1), self.primal)
    _needs(jaxpr, [True] * len(jaxpr.outvars), self.needed)

  def arguments(self, inputs, names) -> list:
    """The origins of the program's inputs: a report for each non-finite argument."""
    origins = []
    dtypes = [np.dtype(jnp.result_type(x)) for x in inputs]
    censuses = _Census.each([x if jnp.issubdtype(d, jnp.floating) else np.float32(0) for x, d in zip(inputs, dtypes)])
    for census, dtype, name in zip(censuses, dtypes, [*names, "seed"]):
      if census.finite:
        origins.append(None)
        continue
      origins.append(len(self.made))
      self.made.append(OverflowReport(ARGUMENT, "forward", "", name, dtype.name, census.largest,
                                      made=census.holds(), scale=self.scale))
    self.given = len(self.made)
    return origins

  def report(self, origin: int) -> OverflowReport:
    if origin == _CONSTANT:
      constant = "a constant that `fun` closes over"
      return OverflowReport(ARGUMENT, "forward", "", constant, "float32", 0.0, made="inf or NaN", scale=self.scale)
    return self.made[origin]

  def constant(self, value):
    key = id(value)
    if key not in self.constants:
      floating = _interpret.floating(np.asarray(value) if not hasattr(value, "dtype") else value)
      self.constants[key] = None if not floating or _Census.of([value]).finite else _CONSTANT
    return self.constants[key]

  def program(self, jaxpr, consts, args, origins, where: _Where, *, seed=None) -> tuple[list, list]:
    """The outputs of ``jaxpr`` on ``args``, and their origins.

    At the top level, ``seed`` is the cotangent's input: an operation that reads it, or a
    value computed from it, is in the backward pass. A sub-program is in its caller's phase.
    """
    env: dict = dict(zip(jaxpr.constvars, consts))
    env.update(zip(jaxpr.invars, args))
    came: dict = {v: self.constant(c) for v, c in zip(jaxpr.constvars, consts)}
    came.update(zip(jaxpr.invars, origins))
    read = lambda v: v.val if _interpret.is_literal(v) else env[v]
    origin = lambda v: _literal_origin(v.val) if _interpret.is_literal(v) else came.get(v)
    backward = {seed} if seed is not None else set()
    for eqn in jaxpr.eqns:
      phase, derivative_of = where.phase, ""
      inputs = [v for v in eqn.invars if not _interpret.is_literal(v)]
      if any(v in backward for v in inputs):
        backward.update(eqn.outvars)
        phase = "backward"
      elif phase == "forward":
        self.position += 1
        if id(eqn) not in self.primal and id(eqn) in self.needed:  # a derivative factor
          phase = "backward"
          found = [self.differentiates[v] for v in inputs if v in self.differentiates]
          derivative_of = max(found)[1] if found else ""
          self.differentiates.update((v, (self.position, derivative_of)) for v in eqn.outvars)
        elif not _interpret.subprograms(eqn.params):  # a forward operation: what a factor reads comes from it
          self.differentiates.update((v, (self.position, eqn.primitive.name)) for v in (*inputs, *eqn.outvars))
      outs, out_origins = self.equation(eqn, [read(v) for v in eqn.invars], [origin(v) for v in eqn.invars],
                                        where.inside(eqn, phase, derivative_of))
      env.update(zip(eqn.outvars, outs))
      came.update(zip(eqn.outvars, out_origins))
    return [read(v) for v in jaxpr.outvars], [origin(v) for v in jaxpr.outvars]

  def equation(self, eqn, ins: list, origins: list, where: _Where) -> tuple[list, list]:
    name = eqn.primitive.name
    programs = _interpret.subprograms(eqn.params)
    if not programs or name.startswith(_COMBINERS):
      outs = _interpret.bind(eqn, ins)
      return outs, self.check(eqn, ins, origins, outs, where)
    where = where.calling(eqn)
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
    given = [o for o in origins if o is not None]  # the non-finite inputs' origins
    made_before = [o for o in given if self.given <= o < _CONSTANT]
    if made_before:
      # An earlier operation's inf comes first, whatever this one adds: nothing to run again.
      origin = min(made_before)
      return [None if c is None or c.finite else origin for c in censuses]
    own = None
    if not given:
      made = _Census.combine([c for c in censuses if c is not None]).holds()
    else:
      own = self.own(eqn, ins, origins, outs, floating)
      made = _Census.of([jnp.where(m, x, 0) for m, x in zip(own, (x for x, f in zip(outs, floating) if f))]).holds()
      if not made and all(o == _CONSTANT for o in given) and any(c is not None and c.nan for c in censuses):
        # A NaN that no input holds, made from a constant's inf: a mask that leaves a row empty.
        inputs = [x for x, v in zip(ins, eqn.invars) if _interpret.floating(v.aval)]
        made = "" if _Census.of(inputs).nan else "NaN"
    origin = _earliest(origins)
    if made:
      inputs = [x for x, v in zip(ins, eqn.invars) if _interpret.floating(v.aval)]
      self.made.append(OverflowReport(
          primitive=eqn.primitive.name, phase=where.phase, source=where.source(eqn), name_stack=where.names,
          dtype=np.dtype(next(v.aval.dtype for v, f in zip(eqn.outvars, floating) if f)).name,
          max_input_magnitude=_Census.of(inputs).largest, iteration=where.iteration, made=made, scale=self.scale,
          derivative_of=where.derivative_of, division_by_zero=_by_zero(eqn, ins, outs, own),
      ))
      # What it made is what it passes on, before a non-finite argument or constant it read (a
      # mask's -inf, given on purpose).
      origin = len(self.made) - 1
    return [None if c is None or c.finite else origin for c in censuses]

  def own(self, eqn, ins, origins, outs, floating) -> list:
    """For each floating output, where it is non-finite by the operation's own doing: non-finite
    also when each non-finite input element is replaced by 0, and again by 1."""
    def rerun(fill):
      filled = [
          _filled(jnp.asarray(x, v.aval.dtype), fill) if o is not None and _interpret.floating(v.aval) else x
          for x, v, o in zip(ins, eqn.invars, origins)
      ]
      return [x for x, f in zip(_interpret.bind(eqn, filled), floating) if f]

    real = [x for x, f in zip(outs, floating) if f]
    return _own_mask(real, rerun(0), rerun(1))


def _literal_origin(value):
  return None if np.all(np.isfinite(np.asarray(value))) else _CONSTANT


@functools.partial(jax.jit, static_argnums=1)
def _filled(x, fill):
  return jnp.where(jnp.isfinite(x), x, jnp.asarray(fill, x.dtype))


@jax.jit
def _own_mask(real, zeros, ones):
  finite = jnp.isfinite
  return [~finite(a) & ~finite(b) & ~finite(c) for a, b, c in zip(real, zeros, ones)]


def _by_zero(eqn, ins, outs, own) -> bool:
  """Whether each inf the operation made is a division by an exact zero (``1 / 0``, ``rsqrt(0)``)."""
  name = eqn.primitive.name
  if name == "div":
    divisor = ins[1]
  elif name == "rsqrt" or (name == "integer_pow" and eqn.params.get("y", 0) < 0) or name == "pow":
    divisor = ins[0]
  else:
    return False
  out = np.asarray(outs[0])
  infinite = np.isinf(out) & (np.asarray(own[0]) if own is not None else True)
  if name == "pow":
    infinite &= np.broadcast_to(np.asarray(ins[1]) < 0, out.shape)
  divisor = np.broadcast_to(np.asarray(divisor), out.shape)
  return bool(infinite.any() and (divisor[infinite] == 0).all())


def _earliest(origins):
  return min((o for o in origins if o is not None), default=None)


def _needs(jaxpr, wanted: Sequence[bool], into: set) -> list[bool]:
  """Adds to ``into`` the operations of ``jaxpr`` (and of its sub-programs) that its ``wanted``
  outputs need; returns which of its inputs they need."""
  live = {v for v, w in zip(jaxpr.outvars, wanted) if w and not _interpret.is_literal(v)}
  for eqn in reversed(jaxpr.eqns):
    outs = [v in live for v in eqn.outvars]
    if not any(outs):
      continue
    into.add(id(eqn))
    ins = _needs_inside(eqn, outs, into)
    live.update(v for v, n in zip(eqn.invars, ins) if n and not _interpret.is_literal(v))
  return [v in live for v in jaxpr.invars]


def _needs_inside(eqn, outs: list[bool], into: set) -> list[bool]:
  """:func:`_needs` of an operation's sub-programs; a loop other than ``scan`` needs all it reads."""
  name = eqn.primitive.name
  programs = _interpret.subprograms(eqn.params)
  if not programs or name.startswith(_COMBINERS):
    return [True] * len(eqn.invars)
  if name == "cond":
    ins = [True] + [False] * (len(eqn.invars) - 1)
    for jaxpr, _ in programs:
      ins[1:] = [a or b for a, b in zip(ins[1:], _needs(jaxpr, outs, into))]
    return ins
  if name == "scan":
    (jaxpr, _), = programs
    consts_count, carry_count = _scan_split(eqn, jaxpr)
    wanted = list(outs)
    while True:  # a carry the next iteration reads is wanted from each iteration
      ins = _needs(jaxpr, wanted, into)
      carries = ins[consts_count:consts_count + carry_count]
      more = [w or c for w, c in zip(wanted[:carry_count], carries)] + wanted[carry_count:]
      if more == wanted:
        return ins
      wanted = more
  if len(programs) == 1 and _is_call(eqn, programs[0][0]):
    return _needs(programs[0][0], outs, into)
  for jaxpr, _ in programs:
    _needs(jaxpr, [True] * len(jaxpr.outvars), into)
  return [True] * len(eqn.invars)


def _evaluate(jaxpr, consts, args, record=None, where=_Where(), seed=None):
  """``jaxpr`` on ``args`` (traced, under ``jit``); with ``record``, calls inlined and each other
  operation appended as ``(eqn, where, inputs, outputs)``."""
  env: dict = dict(zip(jaxpr.constvars, consts))
  env.update(zip(jaxpr.invars, args))
  read = lambda v: v.val if _interpret.is_literal(v) else env[v]
  backward = {seed} if seed is not None else set()
  for eqn in jaxpr.eqns:
    phase = where.phase
    if any(not _interpret.is_literal(v) and v in backward for v in eqn.invars):
      backward.update(eqn.outvars)
      phase = "backward"
    ins, here = [read(v) for v in eqn.invars], where.inside(eqn, phase)
    programs = _interpret.subprograms(eqn.params)
    call = len(programs) == 1 and not eqn.primitive.name.startswith(_COMBINERS) and _is_call(eqn, programs[0][0])
    if record is not None and call:
      (sub, consts), = programs
      outs = _evaluate(sub, consts, ins, record, here.calling(eqn))
    else:
      outs = _interpret.bind(eqn, ins)
      if record is not None:
        record.append((eqn, here, ins, outs))
    env.update(zip(eqn.outvars, outs))
  return [read(v) for v in jaxpr.outvars]


def _compiled_skips(closed, inputs) -> bool:
  """Whether the compiled program's unscaled gradients (its outputs after the loss) hold an inf or a NaN."""
  outs = _compiled(closed.jaxpr)(closed.consts, inputs)
  return not _Census.of([x for x in outs[1:] if _interpret.floating(x)]).finite


_COMPILED: dict = {}  # a program's text -> the jitted function that runs it


def _compiled(jaxpr):
  """``jaxpr`` jitted, its constants an argument: kept by its text (which shows every operation,
  shape, dtype and literal, and no constant's value), so that the same step diagnosed again, on
  another batch or at another scale, is not compiled again."""
  key = str(jaxpr)
  if key not in _COMPILED:
    if len(_COMPILED) >= 8:  # a few programs: each holds its compiled executable
      _COMPILED.pop(next(iter(_COMPILED)))
    _COMPILED[key] = jax.jit(lambda consts, args: _evaluate(jaxpr, consts, args))
  return _COMPILED[key]


def _compiled_report(run: _Run, closed, inputs) -> OverflowReport:
  """The first operation of the compiled program that made an inf or a NaN from finite inputs,
  found by compiling the program with every intermediate value returned (the rewrite XLA makes
  of an operation, a constant folded in float16, shows in that operation's value)."""
  record: list = []

  def everything(*args):
    _evaluate(closed.jaxpr, closed.consts, args, record, _Where(), seed=closed.jaxpr.invars[-1])
    return [([jnp.asarray(x) for x in ins], outs) for _, _, ins, outs in record]

  values = jax.jit(everything)(*inputs)
  for (eqn, where, *_), (ins, outs) in zip(record, values):
    outs = [x for x, v in zip(outs, eqn.outvars) if _interpret.floating(v.aval)]
    ins = [x for x, v in zip(ins, eqn.invars) if _interpret.floating(v.aval)]
    result, given = _Census.of(outs), _Census.of(ins)
    if result.finite or not given.finite:
      continue
    phase = where.phase
    if phase == "forward" and id(eqn) not in run.primal and id(eqn) in run.needed:
      phase = "backward"
    return OverflowReport(
        eqn.primitive.name, phase, where.source(eqn), where.names, np.dtype(outs[0].dtype).name, given.largest,
        iteration=(), made=result.holds(), scale=run.scale, compiled=True,
    )
  return OverflowReport("", "backward", "", "", "", 0.0, made="inf or NaN", scale=run.scale, compiled=True)


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

  def holds(self) -> str:
    """What these arrays hold: ``"inf"``, ``"-inf"``, ``"NaN"``, joined by "and"."""
    found = (("inf", self.positive_inf), ("-inf", self.negative_inf), ("NaN", self.nan))
    return " and ".join(name for name, held in found if held)

  @classmethod
  def combine(cls, censuses) -> _Census:
    censuses = list(censuses)
    return cls(
        any(c.nan for c in censuses), any(c.positive_inf for c in censuses),
        any(c.negative_inf for c in censuses), max((c.largest for c in censuses), default=0.0),
    )

  @classmethod
  def of(cls, arrays) -> _Census:
    return cls.combine(cls.each(arrays))

  @classmethod
  def each(cls, arrays) -> list[_Census]:
    if not arrays:
      return []
    # Reduced where the arrays are (a GPU's activations are not copied to the host), four
    # numbers each back.
    flags, largest = _summary([jnp.asarray(a) for a in arrays])
    return [_Census(bool(f[0]), bool(f[1]), bool(f[2]), float(m)) for f, m in zip(np.asarray(flags), largest)]


@jax.jit
def _summary(arrays):
  """Whether each of ``arrays`` holds a NaN, an inf and a -inf, and its largest finite magnitude."""
  flags, largest = [], []
  for a in arrays:
    a = jnp.abs(a) if jnp.iscomplexobj(a) else a  # a complex value by its magnitude
    # float32 holds every narrower format's values exactly.
    a = a.astype(jnp.float32) if jnp.finfo(a.dtype).bits < 32 else a
    flags.append(jnp.stack([jnp.isnan(a).any(), jnp.isposinf(a).any(), jnp.isneginf(a).any()]))
    largest.append(jnp.max(jnp.where(jnp.isfinite(a), jnp.abs(a), 0), initial=0))
  return jnp.stack(flags), largest


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
  """``"transpose(jvp(MLP/Dense_1))"`` -> ``"MLP/Dense_1"``: the scopes, without transformations."""
  scopes = re.sub(r"[\w.-]+\(", "", name_stack).replace(")", "")
  return "/".join(filter(None, scopes.split("/")))


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
  for name in ("jax", "jaxlib", "jaxscale", "flax", "equinox", "optax"):
    spec = importlib.util.find_spec(name)
    dirs.extend((spec.submodule_search_locations or ()) if spec is not None else ())
  folder = lambda d: os.path.join(os.path.realpath(d), "")
  return tuple(map(folder, dirs)), folder(sysconfig.get_paths()["stdlib"])


def _power_of_two(scale: float) -> str:
  exponent = math.log2(scale) if scale > 0 and math.isfinite(scale) else 0.5
  return f"2^{exponent:.0f}" if exponent.is_integer() and exponent not in (0, 1) else f"{scale:g}"
