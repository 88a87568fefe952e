"""Autocast: the precision of each operation chosen by what it is, as ``torch.autocast`` does.

``autocast(fun, policy)`` traces ``fun`` with its arguments' own dtypes into a jaxpr, then runs
that jaxpr operation by operation, choosing each one's dtype::

    dot_general, conv_general_dilated    operands cast to policy.compute_dtype (float16),
                                         result in it: whatever dtype the model asked for
    the float32 list (FLOAT32_PRIMITIVES) 16-bit operands cast to float32, result in float32
    everything else                      follows its inputs; mixed floating inputs are promoted
                                         to the widest (float16 + float32 -> float32)

A jaxpr's outputs come back in the dtypes the program gave them (so a function, a loop body, a
branch, a ``custom_jvp`` function keeps its signature), and ``fun``'s floating outputs are then
cast to ``policy.output_dtype``. Nothing is cast on the way in: parameters are read where they
are stored, each operation casts what it needs, and since a cast's transpose casts back,
gradients arrive in the parameters' dtypes. JAX differentiates, vmaps and jits the operations
the interpreter emits like any others; the interpreter itself runs at trace time only.

Higher-order primitives: a call (``jit``, ``closed_call``) is inlined, its operations autocast
like the caller's, its float16 values flowing on; a ``checkpoint`` is rebuilt around its body
autocast at the dtypes that arrive; a ``custom_jvp`` / ``custom_vjp`` function is made again
with its primal body and its derivative rules autocast (``_custom_jvp``, ``_custom_vjp``). Any
other (``scan``, ``while``, ``cond``, ``shard_map``, ``custom_linear_solve``, one JAX adds
tomorrow) is rebuilt by one generic rule (``_interpret.rebind``): each sub-program autocast
with its signature kept, every other parameter untouched. A nested ``autocast`` region is a
``jit`` named ``jaxscale_autocast`` and kept as its own policy made it.
"""

from __future__ import annotations

import contextvars
import functools
import inspect
import os
import sys
import typing
import warnings
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import jax
import jax.numpy as jnp
import numpy as np
from jax.core import Tracer

from jaxscale import _float8, _history, _interpret, _policy, _tree, _where

F = TypeVar("F", bound=Callable)

#: Run in the compute dtype: torch's float16 list (mm, matmul, linear, convolutions, bmm,
#: baddbmm, addmm, ...) is, at the level of JAX's primitives, these two.
COMPUTE_PRIMITIVES = frozenset({"dot_general", "conv_general_dilated"})

#: Run in float32: the primitives that torch's autocast float32 list is made of
#: (exp, expm1, log, log10, log2, log1p, pow, reciprocal, rsqrt, acos, asin, cosh, sinh, tan,
#: erfinv, sum, prod, cumsum, cumprod, and softmax, log_softmax, logsumexp, layer/group norm,
#: norm, softplus and the losses, which JAX builds from the same primitives).
FLOAT32_PRIMITIVES = frozenset({
    "exp", "exp2", "expm1", "log", "log1p", "pow", "integer_pow", "square", "rsqrt",
    "acos", "asin", "cosh", "sinh", "tan", "erf_inv",
    "reduce_sum", "reduce_prod", "cumsum", "cumprod", "cumlogsumexp",
})  # fmt: skip

# Dtype-generic primitives that may run in whatever their inputs have become (a float16 matmul's
# output, a float32 reduction's). Any other primitive gets its inputs in the dtypes the program
# gave them, so that dtype-bearing parameters (`bitcast_convert_type`, a scatter's combiner
# jaxpr, ...) stay consistent.
_FOLLOW_PRIMITIVES = frozenset({
    "add", "add_any", "sub", "mul", "div", "rem", "neg", "max", "min", "abs", "sign", "floor",
    "ceil", "round", "tanh", "logistic", "sin", "cos", "atan", "atan2", "sqrt", "cbrt", "erf",
    "erfc", "select_n", "clamp", "reshape", "transpose", "broadcast_in_dim", "squeeze",
    "expand_dims", "slice", "dynamic_slice", "dynamic_update_slice", "concatenate", "pad",
    "gather", "rev", "reduce_max", "reduce_min", "argmax", "argmin", "copy", "copy_p", "eq", "ne",
    "lt", "le", "gt", "ge", "is_finite", "sharding_constraint", "reduce_precision",
})  # fmt: skip

# Primitives whose every output is its input, each operand in its own dtype.
_PASS_PRIMITIVES = frozenset({"stop_gradient", "name", "optimization_barrier", "device_put", "pvary"})

# Higher-order primitives treated by what they are (any other is rebuilt by the generic rule of
# `_interpret.rebind`): calls are inlined, checkpoints and custom derivatives let dtypes flow.
_CALLS = frozenset({"jit", "pjit", "closed_call", "core_call", "eval_jaxpr"})
_CHECKPOINTS = frozenset({"checkpoint", "remat", "remat2"})
_CUSTOM_JVP = frozenset({"custom_jvp_call"})
_CUSTOM_VJP = frozenset({"custom_vjp_call", "custom_vjp_call_jaxpr"})
MARKER = "jaxscale_autocast"  # the name of the `jit` around a nested region


def autocast(
    fun: F, policy: _policy.Policy | str, *, enabled: bool = True, weights: Any = None, delayed: bool = False
) -> F:
  """``fun`` with each operation's precision chosen per operation, as under ``torch.autocast``.

  Every ``dot_general`` and ``conv_general_dilated`` in ``fun`` (inside ``jit``, ``scan``,
  ``cond``, ``while_loop``, ``checkpoint``, a Flax or Equinox layer that asks for float32)
  runs in ``policy.compute_dtype``; the operations of torch's float32 list (exp, log, sums,
  ...: the table in docs/mixed_precision.md) run in float32; everything else follows its
  inputs, in the widest of their dtypes. Parameters are not cast
  where they are stored, so gradients reach float32 parameters in float32. Floating outputs
  are cast to ``policy.output_dtype``; integers, bools and PRNG keys pass through.

  ``fun`` is traced with its arguments' own dtypes (what it prints or inspects at trace time
  is float32 for float32 inputs): :func:`precision_report` shows what runs in which dtype.
  A region wrapped in ``autocast(g, "float32")`` inside ``fun`` stays float32. An NNX
  module, or its bound method, may be ``fun``: what it assigns to its Variables (batch
  statistics, RNG counts) is written back in each Variable's own dtype.

  Args:
    fun: any function of pytrees, an NNX module, or a bound method of one.
    policy: a :class:`Policy`, or a string for :func:`get_policy`.
    enabled: False returns ``fun`` itself (one script, any precision). To keep a region
      out of an enclosing autocast, wrap it in ``autocast(g, "float32")``.
    weights: ``fun``'s first argument (the parameters) as the jitted step has them, before
      its loop over microbatches: each matrix among them is copied here, once, into what its
      matmuls read (under a float8 policy its float8 values and scale: one absolute maximum
      and one cast; under another, its cast to the compute dtype), and every matmul of ``fun``
      that reads that leaf of its first argument reads the copy, forward and backward, however
      many times the returned function is called. The values are those of casting at each
      call, bit for bit. Copied from what is passed here: build the function in each step,
      from the step's parameters (docs/float8.md).
    delayed: under a float8 policy, delayed scaling: the returned function takes a
      :class:`Float8History` first, ``f(history, *args, **kwargs)``, and quantizes each tensor of
      its float8 matmuls with a scale from the history (one pass: the cast, its absolute maximum
      beside it) rather than from its own maximum (two); the gradient with respect to ``history``
      holds the maxima seen, for :func:`float8_update`. Start with :func:`float8_history`
      (docs/float8.md).

  Returns:
    The wrapped function.

  Raises:
    TypeError: if ``enabled`` is not a bool, ``policy`` is neither a :class:`Policy` nor
      a string, or ``weights`` holds no floating array.
    ValueError: if the policy string is not understood; if ``weights`` is given outside a
      traced step (concrete arrays, which would be copied once and read as the parameters
      change); when called, if ``weights``' structure, shapes or dtypes are not those of the
      first argument.

  Examples:
    >>> import jax, jax.numpy as jnp, jaxscale
    >>> def loss(w, x):
    ...   return jnp.sum(jnp.dot(x, w, preferred_element_type=jnp.float32))
    >>> cast_loss = jaxscale.autocast(loss, "mixed_float16")
    >>> w, x = jnp.ones(3), jnp.ones((2, 3))
    >>> print(jaxscale.precision_report(cast_loss, w, x).matmul_flops)
    {'float16': 12.0}
    >>> jax.grad(cast_loss)(w, x).dtype
    dtype('float32')
  """
  if not isinstance(enabled, (bool, np.bool_)):  # the rule of `jaxscale.init`'s `enabled`
    raise TypeError(f"`autocast`'s `enabled` must be a Python bool, got {enabled!r}.")
  if not callable(fun):
    raise TypeError(
        f"`autocast` takes the function first, then the policy: `autocast(fun, policy)`; got {fun!r} "
        f"of type {type(fun).__name__} as `fun`."
    )
  policy = _policy.get_policy(policy)
  if not isinstance(delayed, (bool, np.bool_)):
    raise TypeError(f"`autocast`'s `delayed` must be a Python bool, got {delayed!r}.")
  if delayed and policy.matmul_dtype is None:
    raise ValueError(
        f"`autocast`'s `delayed=True` is delayed scaling of float8 matmuls, and the policy '{policy}' has "
        "none: use 'mixed_float8', or leave `delayed` out."
    )
  if delayed and weights is not None:
    raise ValueError(
        "`autocast` takes `delayed=True` or `weights=`, not both: under delayed scaling a weight's cast "
        "already reads it once (its absolute maximum taken in the same pass), so leave `weights` out."
    )
  if not enabled:
    return fun
  given = _weight_copies(weights, policy) if weights is not None else None

  # An NNX module called as `fun`, or whose method `fun` is, holds the parameters itself: as a
  # pytree (`Partial` for a method) its arrays are traced like the arguments'.
  callee = jax.tree_util.Partial(fun.__func__, fun.__self__) if inspect.ismethod(fun) else fun

  def region(static, arrays, given_values, history: Any = None):
    (treedef, statics, given_at), mode = static[:3], (static[3] if len(static) > 3 else None)
    dynamic_at = [i for i, leaf in enumerate(statics) if leaf is _DYNAMIC]
    leaves = [None if leaf is _DYNAMIC else leaf.value for leaf in statics]
    for i, x in zip(dynamic_at, arrays):
      leaves[i] = x
    variables = _nnx_variables(jax.tree.unflatten(treedef, leaves))
    found = {}

    def traced(*arrays):
      run_leaves = list(leaves)
      for i, x in zip(dynamic_at, arrays):
        run_leaves[i] = x
      run_callee, run_args, run_kwargs = jax.tree.unflatten(treedef, run_leaves)
      out = run_callee(*run_args, **run_kwargs)
      written = {}
      if variables:  # what `fun` assigned to an NNX Variable (batch statistics, an RNG count)
        after = jax.tree.leaves((run_callee, run_args, run_kwargs))
        if len(after) != len(leaves):
          raise ValueError(
              "`autocast`'s `fun` changed the structure of its arguments (an NNX module gained or lost "
              "a Variable); create Variables outside the autocast region."
          )
        written = {i: jnp.asarray(after[i]) for i in variables if after[i] is not run_leaves[i]}
      out_leaves, found["out_tree"] = jax.tree.flatten(out)
      found["written"] = sorted(written)
      return out_leaves, [written[i] for i in found["written"]]

    closed = jax.make_jaxpr(traced)(*arrays)
    token, met = _INPUTS.set(arrays), _FLOAT8_MATMULS.set([])
    delayed_state = _delayed_state(mode, history)
    delayed_token = _DELAYED.set(delayed_state)
    # The copies `weights` made, by the argument each stands for (its value in this program), and which were read.
    read_given = _GIVEN.set(([arrays[i] for i in given_at], list(given_values), set()))
    try:
      outs = evaluate(closed.jaxpr, closed.consts, arrays, policy)
      if policy.matmul_dtype is not None:  # once per trace of this function, not per call
        _float8.warn_no_float8(_FLOAT8_MATMULS.get(), policy, _describe(fun))
      if given_at and not _GIVEN.get()[2]:
        _warn_weights_unread(_describe(fun))
      if delayed_state is not None and isinstance(history, _history.Float8History) and (
          delayed_state["count"] != history.matmuls):
        raise ValueError(
            f"The float8 history passed to {_describe(fun)} holds {history.matmuls} float8 matmuls; called "
            f"with these arguments, it runs {delayed_state['count']}. Build the history with "
            "`jaxscale.float8_history` for the shapes and structure it is called with."
        )
    finally:
      _DELAYED.reset(delayed_token)
      _INPUTS.reset(token)
      _FLOAT8_MATMULS.reset(met)
      _GIVEN.reset(read_given)
    split = len(outs) - len(found["written"])
    out = jax.tree.unflatten(found["out_tree"], outs[:split])
    if mode == "count" and delayed_state is not None:
      typing.cast(dict, history)["matmuls"] = delayed_state["count"]  # `count`'s sink
    return policy.cast_to_output(out), dict(zip(found["written"], outs[split:]))

  # One `jit` per autocast function, named as the marker: an enclosing autocast sees it and
  # leaves it as this policy made it, and its trace (and, eagerly, its compilation) is cached
  # by jit for every call with the same types, under `grad` and `vmap` too.
  region.__name__ = region.__qualname__ = MARKER
  jitted = jax.jit(region, static_argnums=0)

  def arguments(args, kwargs):
    tree = (callee, args, kwargs)
    leaves, treedef = jax.tree.flatten(tree)
    is_array = lambda leaf: isinstance(leaf, (jax.Array, np.ndarray, np.generic))
    statics = tuple(_DYNAMIC if is_array(leaf) else _Static(leaf) for leaf in leaves)
    arrays = [leaf for leaf in leaves if is_array(leaf)]
    _float8.warn_float8_arguments(arrays)
    given_at, given_values = _given_at(given, args, callee, statics) if given is not None else ((), [])
    return tree, (treedef, statics, given_at), arrays, given_values

  def write_back(tree, written):
    variables = _nnx_variables(tree)
    for i, value in written.items():
      variable = variables[i]
      old = _tree.unwrap_variable(variable)
      _set(variable, value.astype(old.dtype) if _policy.is_floating_array(old) else value)

  @functools.wraps(fun)
  def wrapped(*args, **kwargs):
    tree, static, arrays, given_values = arguments(args, kwargs)
    out, written = jitted(static, arrays, given_values)
    write_back(tree, written)
    return out

  @functools.wraps(fun)
  def wrapped_delayed(history, *args, **kwargs):
    if not isinstance(history, _history.Float8History):
      raise TypeError(
          f"{_describe(fun)} was made with `autocast(..., delayed=True)`: it takes a `jaxscale.Float8History` "
          f"first, `f(history, *args)`, got {type(history).__name__}. Make one with "
          f"`jaxscale.float8_history(f, *args)` ({_history.RESTORE_HINT})."
      )
    tree, static, arrays, given_values = arguments(args, kwargs)
    mode = "calibrate" if _CALIBRATING.get() else "delayed"
    out, written = jitted((*static, mode), arrays, given_values, history)
    write_back(tree, written)
    return out

  def count(*args, **kwargs):  # how many float8 matmuls the function runs, traced without a cache
    _, static, arrays, given_values = arguments(args, kwargs)
    sink: dict = {}
    jax.eval_shape(lambda arrays: region((*static, "count"), arrays, given_values, sink), arrays)
    return sink["matmuls"]

  if not delayed:
    return wrapped  # type: ignore[return-value]
  wrapped_delayed.__dict__[_COUNT] = count
  # Its signature is `fun`'s with the history in front (not `fun`'s alone, which `functools.wraps`
  # would have `inspect` report), so that `jax.jit`'s argument names and NNX's transforms read it right.
  wrapped_delayed.__dict__["__signature__"] = _with_history(fun)
  return wrapped_delayed  # type: ignore[return-value]


def _with_history(fun) -> inspect.Signature | None:
  """``fun``'s signature with a ``history`` parameter in front (None where it has none to read)."""
  try:
    signature = inspect.signature(fun)
  except (TypeError, ValueError):
    return None
  parameters = list(signature.parameters.values())
  kind = (inspect.Parameter.POSITIONAL_ONLY if parameters and parameters[0].kind is inspect.Parameter.POSITIONAL_ONLY
          else inspect.Parameter.POSITIONAL_OR_KEYWORD)
  return signature.replace(parameters=[inspect.Parameter("history", kind), *parameters])


def _describe(fun) -> str:
  """``fun``'s name and where it is defined, for a warning raised while JAX traces it."""
  code = getattr(inspect.unwrap(fun), "__code__", None)
  where = f" ({os.path.basename(code.co_filename)}:{code.co_firstlineno})" if code else ""
  return f"`{getattr(fun, '__qualname__', type(fun).__name__)}`{where}"


_DYNAMIC = None  # in `wrapped`'s static description of its arguments: an array, passed to the jit


class _Static:
  """A leaf that is not an array, as part of the jit's static argument: equal by type and value
  (1 and 1.0 trace differently), or by identity when it cannot be hashed."""

  __slots__ = ("value", "_key")

  def __init__(self, value):
    self.value = value  # held, so that an identity in a key is never reused while it is cached
    try:
      hash(value)
      self._key = (type(value), "value", value)
    except TypeError:
      self._key = (type(value), "identity", id(value))

  def __hash__(self):
    return hash(self._key)

  def __eq__(self, other):
    return isinstance(other, _Static) and self._key == other._key


# The arrays the autocast function was called with, while its program is evaluated: a float8
# matmul writes the gradient of one of them (a parameter) in its own dtype, an activation's in the
# compute dtype.
_INPUTS: contextvars.ContextVar[tuple] = contextvars.ContextVar("jaxscale_autocast_inputs", default=())
# The copies `autocast`'s `weights` made, while the function is evaluated: the arguments they stand
# for, the copies (a float8 `(q, k)`, or a cast), and the indices of those a matmul read.
_GIVEN: contextvars.ContextVar[tuple] = contextvars.ContextVar("jaxscale_autocast_given", default=((), [], set()))
# The matmuls a float8 policy meets while the autocast function is traced, for the warning that none
# of them runs in float8.
_FLOAT8_MATMULS: contextvars.ContextVar[list | None] = contextvars.ContextVar("jaxscale_float8_matmuls", default=None)


# Delayed scaling while the function is evaluated: None, or the exponents (None while calibrating) and
# the slot of each float8 matmul, in the order they run, and how many have run.
_DELAYED: contextvars.ContextVar[dict | None] = contextvars.ContextVar("jaxscale_float8_delayed", default=None)
# Set by `float8_history` while it calibrates: the delayed function quantizes with current scaling.
_CALIBRATING: contextvars.ContextVar[bool] = contextvars.ContextVar("jaxscale_float8_calibrating", default=False)
_COUNT = "_jaxscale_float8_count"  # the attribute of a delayed function that counts its float8 matmuls


def _delayed_state(mode, history) -> dict | None:
  if mode is None:
    return None
  if mode == "count":
    return {"k": None, "seen": None, "count": 0}
  k = None if mode == "calibrate" else _history.exponents(history)
  return {"k": k, "seen": history.seen, "count": 0}


def _delayed_slot(eqn, lhs, rhs, policy):
  """``(k, seen)`` for this float8 matmul under delayed scaling (`_float8.matmul`'s ``delayed``), or None."""
  state = _DELAYED.get()
  if state is None or _float8.wider_reason(eqn.primitive, eqn.params, lhs.shape, rhs.shape, policy.min_intensity):
    return None
  i = state["count"]
  state["count"] += 1
  if state["seen"] is None or i >= state["seen"].shape[0]:
    return None  # counted only; a count that differs from the history's is an error after the trace
  return (None if state["k"] is None else state["k"][i], state["seen"][i])


def float8_history(fun: Callable, *args, length: int = 16, has_aux: bool = False, **kwargs) -> _history.Float8History:
  """A `Float8History` for ``fun`` (made with ``autocast(..., delayed=True)``), calibrated on ``args``.

  Runs ``fun(history, *args, **kwargs)`` and its backward pass once with current scaling (each
  tensor's scale from its own maximum), and records every float8 tensor's absolute maximum, so that
  the first delayed step's scales are those current scaling would choose. The backward pass is that
  of the sum of ``fun``'s floating outputs (with ``has_aux``, of the first alone): for a loss, its
  gradient.

  Args:
    fun: a function from ``autocast(f, "mixed_float8", delayed=True)``.
    *args: its arguments after the history: the parameters and a representative batch.
    length: how many steps the history holds; each tensor's scale comes from the largest maximum
      among them (a tensor that grows past it saturates, which `Float8History.saturated` counts).
    has_aux: whether ``fun`` returns ``(loss, aux)``, as in ``jax.grad``: the gradients are then
      those of the loss alone.
    **kwargs: its keyword arguments.

  Returns:
    The `Float8History`, one row for each float8 matmul that ``fun`` runs outside a loop body,
    a ``checkpoint`` or a custom derivative (those keep current scaling), each tensor's maximum in
    its newest slot.

  Raises:
    TypeError: if ``fun`` was not made with ``delayed=True``.
    ValueError: if ``length`` is not a positive int.

  Examples:
    >>> import jax, jax.numpy as jnp, jaxscale
    >>> def loss(w, x):
    ...   return jnp.sum(jnp.dot(x, w).astype(jnp.float32))
    >>> f = jaxscale.autocast(loss, "mixed_float8,min_intensity=0", delayed=True)
    >>> w, x = jnp.ones((32, 16)), jnp.full((64, 32), 2.0)
    >>> history = jaxscale.float8_history(f, w, x)
    >>> history.amax.shape  # one float8 matmul; its x, w and incoming gradient; 16 steps
    (1, 3, 16)
    >>> history.amax[0, :, 0].tolist()
    [2.0, 1.0, 1.0]
  """
  count = getattr(fun, _COUNT, None)
  if count is None:
    raise TypeError(
        f"`float8_history` takes a function made with `jaxscale.autocast(f, 'mixed_float8', delayed=True)`, "
        f"got {_describe(fun)}."
    )
  empty = _history.new(jnp.zeros((count(*args, **kwargs), len(_history.TENSORS))), length)

  def seen(history):
    loss = lambda h: fun(h, *args, **kwargs)[0] if has_aux else fun(h, *args, **kwargs)
    out, pullback = jax.vjp(loss, history)
    ones = jax.tree.map(
        lambda y: jnp.ones_like(y) if _policy.is_floating_array(y) else np.zeros(np.shape(y), jax.dtypes.float0), out)
    return pullback(ones)[0].seen

  token = _CALIBRATING.set(True)
  try:
    return _history.new(jax.jit(seen)(empty), length)
  finally:
    _CALIBRATING.reset(token)


def evaluate(
    jaxpr, consts: Sequence[Any], args: Sequence[Any], policy: _policy.Policy, *, keep_signature: bool = True
) -> list:
  """The outputs of ``jaxpr`` on ``args``, autocast.

  With ``keep_signature``, floating outputs come back in the dtypes the jaxpr declares (what a
  loop body, a branch or ``fun`` itself must return); without, in whatever dtypes they were
  computed in (an inlined ``jit``'s float16 activations stay float16).
  """
  env: dict = {}
  for var, value in zip(jaxpr.constvars, consts):
    env[var] = value
  for var, value in zip(jaxpr.invars, args):
    env[var] = value
  read = lambda v: v.val if _interpret.is_literal(v) else env[v]
  for eqn in jaxpr.eqns:
    with _interpret.source_of(eqn):  # the user's line and layer, on the operation and its casts
      outs = _eqn(eqn, [read(v) for v in eqn.invars], policy)
    for var, value in zip(eqn.outvars, outs):
      env[var] = value  # a DropVar too: never read
  outs = [read(v) for v in jaxpr.outvars]
  return [_cast(x, v.aval) for x, v in zip(outs, jaxpr.outvars)] if keep_signature else outs


def matmul(eqn, ins: Sequence[Any], policy: _policy.Policy) -> list:
  """The rule of a ``dot_general`` / ``conv_general_dilated`` with floating operands.

  Operands in the compute dtype, products accumulated as the backend does for it and returned
  in it. The one place that decides how a matmul runs (a float8 policy replaces this). In a
  program partitioned over several devices, the gradient of an operand that is an input of the
  autocast function (a parameter) is the product of two compute-dtype operands written in
  ``policy.reduce_dtype`` (`_weight_gradient`); elsewhere JAX's own derivative, which forward-mode
  differentiation (``jax.jvp``, ``jax.hessian``) needs.
  """
  compute = policy.compute_dtype
  inputs = [any(x is arg for arg in _INPUTS.get()) for x in ins]
  partitioned = any(map(_partitioned, ins))
  if policy.matmul_dtype is not None:
    lhs, rhs = ins
    if (met := _FLOAT8_MATMULS.get()) is not None:
      met.append((eqn.primitive, eqn.params, lhs.shape, rhs.shape))
    reduce = policy.reduce_dtype if partitioned else None  # None: each gradient in its operand's dtype
    given = [_given(x) for x in ins]
    delayed = _delayed_slot(eqn, lhs, rhs, policy)
    return [_float8.matmul(eqn.primitive, eqn.params, lhs, rhs, compute, inputs, policy.min_intensity, reduce, given,
                           delayed)]
  params = dict(eqn.params, preferred_element_type=compute)
  written = [policy.reduce_dtype if given and _dtype(x) != compute else compute for x, given in zip(ins, inputs)]
  if all(dtype == compute for dtype in written) or not partitioned:
    return _interpret.bind(eqn, [_read_copy(x, copy) if (copy := _given(x)) is not None else _to(x, compute)
                                 for x in ins], params)
  return [_weight_gradient(eqn, params, compute, written, [_dtype(x) for x in ins])(*ins)]


@jax.custom_jvp
def _read_copy(x, copy):
  """``copy``, the cast of ``x`` to the compute dtype that `autocast`'s ``weights`` made before; its
  derivative is the cast's (so the gradient reaches ``x`` as a cast there would bring it, bit for bit)."""
  del x
  return copy


@_read_copy.defjvp
def _read_copy_jvp(primals, tangents):
  (x, copy), (x_dot, _) = primals, tangents
  del x
  return copy, _to(x_dot, copy.dtype)


def _given(x):
  """What `autocast`'s ``weights`` made for the argument ``x`` is: a float8 policy's ``(q, k)``, another
  policy's cast to its compute dtype; or None."""
  stands_for, values, read = _GIVEN.get()
  for i, argument in enumerate(stands_for):
    if x is argument:
      read.add(i)
      return values[i]
  return None


def _weight_copies(weights, policy: _policy.Policy):
  """`autocast`'s ``weights``: ``(treedef, [(shape, dtype, copy or None) for each leaf])``, each matrix's
  copy made once: its float8 ``(q, k)`` under a float8 policy, else its cast to the compute dtype (None
  where it already is in it)."""
  leaves, treedef = jax.tree.flatten(weights)
  floating = [x for x in leaves if _policy.is_floating_array(x)]
  if not floating:
    raise TypeError(
        f"`autocast`'s `weights=` takes the parameters the function is called with (a pytree of floating "
        f"arrays), got {type(weights).__name__} with no floating array in it."
    )
  if not any(isinstance(x, Tracer) for x in floating):
    raise ValueError(
        "`autocast`'s `weights=` got concrete arrays: they would be copied once, here, into what the "
        "matmuls read, and those copies read at every later call as the parameters change. Build the "
        "function inside the jitted step, from the step's parameters: `jaxscale.autocast(loss, policy, "
        "weights=params)`, then call it in the loop over microbatches."
    )
  matrix = lambda x: _policy.is_floating_array(x) and x.ndim >= 2 and jnp.dtype(x.dtype).itemsize > 1
  if policy.matmul_dtype is not None:
    copy = lambda x: _float8.quantize(x, _float8.FORWARD) if matrix(x) else None
  else:
    copy = lambda x: _to(x, policy.compute_dtype) if matrix(x) and x.dtype != policy.compute_dtype else None
  return treedef, [(x.shape, x.dtype, copy(x)) for x in leaves]


def _given_at(given, args, callee, statics) -> tuple[tuple, list]:
  """The indices, among the autocast function's array arguments, of the matrices of its first argument
  that ``given`` (`_weight_copies`) made a copy of, and the copies."""
  treedef, copies = given
  first = args[0] if args else None
  leaves, first_treedef = jax.tree.flatten(first)
  if not args or first_treedef != treedef:
    raise ValueError(
        "`autocast`'s `weights=` must have the structure of the function's first argument (the parameters "
        f"it is called with); the weights are {treedef}, the first argument "
        f"{first_treedef if args else 'missing'}."
    )
  for (path, leaf), (shape, dtype, copy) in zip(jax.tree_util.tree_leaves_with_path(first), copies):
    if copy is not None and (jnp.shape(leaf) != shape or jnp.result_type(leaf) != dtype):
      raise ValueError(
          f"`autocast`'s `weights=` has {jnp.dtype(dtype).name}{list(shape)} where the first argument has "
          f"{jnp.result_type(leaf).name}{list(jnp.shape(leaf))} at {jax.tree_util.keystr(path)}: pass the "
          "parameters the function is called with."
      )
  offset = len(jax.tree.leaves(callee))  # the callee's arrays come first in the flattened arguments
  array_index = {leaf: n for n, leaf in enumerate(i for i, s in enumerate(statics) if s is _DYNAMIC)}
  at, values = [], []
  for i, (_, _, copy) in enumerate(copies):
    if copy is not None and offset + i in array_index:
      at.append(array_index[offset + i])
      values.append(copy)
  return tuple(at), values


def _warn_weights_unread(name: str) -> None:
  warnings.warn(
      f"`jaxscale.autocast` of {name} was given `weights=`, and none of its matmuls read one of them "
      "as it was passed in the first argument: each copy was made for nothing. Pass the parameters the "
      "function is called with, unchanged (not a copy cast or reshaped before the call), or leave "
      "`weights` out.",
      stacklevel=_where.user_stacklevel(),
  )


def _partitioned(x) -> bool:
  """Whether ``x`` is a value of a program that ``jit`` partitions over several devices.

  Read from its type's mesh (jax >= 0.7 types a value sharded under ``jit`` with it); a
  ``shard_map`` body's manual axes do not count: there the collectives are the user's own.
  """
  mesh = getattr(getattr(jax.typeof(x), "sharding", None), "mesh", None)
  sizes, types = getattr(mesh, "axis_sizes", ()), getattr(mesh, "axis_types", ())
  manual = getattr(jax.sharding.AxisType, "Manual", None)
  return any(size > 1 and kind != manual for size, kind in zip(sizes, types))


def _weight_gradient(eqn, params, compute, written, dtypes):
  """The matmul ``eqn`` in ``compute``, whose backward writes operand ``i``'s gradient in ``written[i]``
  (then casts it to ``dtypes[i]``, the dtype the operand arrives in).

  The weight gradient of a batch-sharded step is a contraction over the batch: each device's
  product is a partial sum, and the SPMD partitioner adds them across devices in the dtype that
  product is written in, before the cast to the parameter's dtype that follows (JAX's own
  transpose writes it in the compute dtype: a bfloat16 all-reduce or reduce-scatter). Written in
  ``reduce_dtype`` by the GEMM itself (its accumulator is float32 anyway), the partial sums
  cross devices in that dtype. A ``custom_vjp``: reverse mode only, hence kept to partitioned
  programs (`_partitioned`).
  """

  def product(lhs, rhs):
    return _interpret.bind(eqn, [lhs, rhs], params)[0]

  perturbed = [True, True]  # which operands are differentiated: only their gradients are computed

  def forward(lhs, rhs):
    perturbed[:] = [lhs.perturbed, rhs.perturbed]
    operands = (_to(lhs.value, compute), _to(rhs.value, compute))
    return product(*operands), operands

  def backward(operands, g):
    lhs, rhs = operands
    linear = [lambda x: product(x, rhs), lambda x: product(lhs, x)]
    return tuple(
        _to(_transpose_written(f, x, g, dtype), own) if needed else None
        for f, x, dtype, own, needed in zip(linear, operands, written, dtypes, perturbed)
    )

  def primal(lhs, rhs):
    return product(_to(lhs, compute), _to(rhs, compute))

  fn = jax.custom_vjp(primal)
  fn.defvjp(forward, backward, symbolic_zeros=True)
  return fn


def _transpose_written(linear, x, g, dtype):
  """The transpose of ``linear`` (one matmul) at ``g``, its product written in ``dtype``.

  JAX's transpose of a matmul writes in the forward's result dtype; this traces that transpose
  and binds it again with each product's ``preferred_element_type`` set to ``dtype``, so that
  the dimension numbers of every matmul primitive's transpose are JAX's own.
  """
  closed = jax.make_jaxpr(jax.linear_transpose(linear, x))(g)
  env = dict(zip(closed.jaxpr.constvars, closed.consts))
  env.update(zip(closed.jaxpr.invars, [g]))
  read = lambda v: v.val if _interpret.is_literal(v) else env[v]
  for eqn in closed.jaxpr.eqns:
    wider = eqn.primitive.name in COMPUTE_PRIMITIVES and _floating(eqn.outvars[0].aval)
    outs = _interpret.bind(eqn, [read(v) for v in eqn.invars], dict(eqn.params, preferred_element_type=dtype)
                           if wider else None)
    env.update(zip(eqn.outvars, outs))
  (out,) = [read(v) for v in closed.jaxpr.outvars]
  return out


def _eqn(eqn, ins: list, policy: _policy.Policy) -> list:
  name = eqn.primitive.name
  avals = [v.aval for v in eqn.invars]
  if name in COMPUTE_PRIMITIVES and all(_floating(a) for a in avals):
    return matmul(eqn, ins, policy)
  if name in FLOAT32_PRIMITIVES:
    return _interpret.bind(eqn, [_to(x, _widen(x)) if _floating(a) else x for x, a in zip(ins, avals)])
  if name in _FOLLOW_PRIMITIVES:
    return _interpret.bind(eqn, _promote(eqn, ins))
  if name == "pvary" and _summed_elsewhere(eqn, ins, policy):
    return [_summed_in(eqn, policy.reduce_dtype)(ins[0])]
  if name in _PASS_PRIMITIVES:
    return _interpret.bind(eqn, ins)
  programs = _interpret.subprograms(eqn.params)
  flowing = lambda jaxpr, consts, args: evaluate(jaxpr, consts, args, policy, keep_signature=False)
  if name in _CALLS and len(programs) == 1 and eqn.params.get("name") != MARKER:
    (jaxpr, consts), = programs
    return flowing(jaxpr, consts, ins)  # inlined: its operations are the caller's
  # A sub-program traced on its own cannot read the history's slots (values of the enclosing trace):
  # its float8 matmuls keep current scaling.
  token = _DELAYED.set(None)
  try:
    return _subprogram(eqn, ins, policy, programs, flowing)
  finally:
    _DELAYED.reset(token)


def _subprogram(eqn, ins: list, policy: _policy.Policy, programs, flowing) -> list:
  name = eqn.primitive.name
  avals = [v.aval for v in eqn.invars]
  if name in _CUSTOM_JVP and len(programs) == 1 and any(map(_floating, avals)):
    return _custom_jvp(eqn, ins, programs[0], policy)
  if name in _CUSTOM_VJP and len(programs) == 1 and any(map(_floating, avals)):
    return _custom_vjp(eqn, ins, programs[0], policy)
  if name in _CHECKPOINTS and len(programs) == 1:
    return _interpret.rebind(eqn, ins, flowing, in_dtypes=[_dtype(x) for x in ins])
  ins = [_cast(x, a) for x, a in zip(ins, avals)]  # as the program gave them
  if policy.matmul_dtype is not None and name in _float8.OTHER_MATMULS:
    _float8.warn_not_float8(name)
  if name in _CALLS or not any(_has_work(j) for j, _ in programs):
    return _interpret.bind(eqn, ins)  # a nested autocast region stays as its own policy made it
  return _interpret.rebind(eqn, ins, lambda jaxpr, consts, args: evaluate(jaxpr, consts, args, policy))


def _summed_elsewhere(eqn, ins, policy) -> bool:
  """Whether ``eqn`` is ``shard_map``'s ``pvary`` of a parameter whose gradient is to be summed in
  another dtype than its own: JAX transposes ``pvary`` to a sum over the axes, in the parameter's dtype.
  Only a ``reduce_dtype`` chosen apart from ``param_dtype`` asks for it."""
  (x,) = ins if len(ins) == 1 else (None,)
  return (
      x is not None and _floating(eqn.invars[0].aval) and "axes" in eqn.params
      and policy.reduce_dtype != policy.param_dtype and _dtype(x) != policy.reduce_dtype
      and any(x is arg for arg in _INPUTS.get())
  )


def _summed_in(eqn, dtype):
  """``eqn`` (a ``pvary``) whose transpose, the sum of the devices' gradients, adds them in ``dtype``.

  A ``custom_vjp``, so reverse mode only: used where the policy asks for a ``reduce_dtype`` other
  than the parameter's own, whose default never needs it.
  """
  axes = eqn.params["axes"]

  @jax.custom_vjp
  def varying(x):
    return _interpret.bind(eqn, [x])[0]

  def forward(x):
    return varying(x), jnp.zeros((), _dtype(x))  # the residual carries the parameter's dtype

  def backward(like, g):
    return (jax.lax.psum(_to(g, dtype), axes).astype(like.dtype),)

  varying.defvjp(forward, backward)
  return varying


def _custom_jvp(eqn, ins, program, policy):
  """A ``custom_jvp`` function again, its primal body and its JVP rule both autocast.

  The rule is JAX's own derivative of the original primitive (which runs the user's rule),
  traced into a jaxpr and autocast like the body; both take their inputs in the dtypes they
  arrive in, so a float16 activation stays float16 through ``relu``.
  """
  jaxpr, consts = program
  avals = [v.aval for v in eqn.invars]
  primal = lambda *args: evaluate(jaxpr, consts, args, policy, keep_signature=False)
  out_types = jax.eval_shape(primal, *ins)
  original = lambda *args: _interpret.bind(eqn, [_cast(x, a) for x, a in zip(args, avals)])

  def rule(primals, tangents):
    float_at = [i for i, a in enumerate(avals) if _floating(a)]

    def jvp(primals, float_tangents):
      tangents = [np.zeros(a.shape, jax.dtypes.float0) for a in avals]
      for i, t in zip(float_at, float_tangents):
        tangents[i] = t
      return jax.jvp(original, list(primals), tangents)

    closed = jax.make_jaxpr(jvp)(_shapes(avals), [_shapes(avals)[i] for i in float_at])
    operands = [*primals, *(tangents[i] for i in float_at)]
    outs = evaluate(closed.jaxpr, closed.consts, operands, policy, keep_signature=False)
    y, y_dot = outs[: len(out_types)], outs[len(out_types) :]
    return _like(y, out_types), _like(y_dot, out_types)

  fn = jax.custom_jvp(primal)
  fn.defjvp(rule)
  return list(fn(*ins))


def _custom_vjp(eqn, ins, program, policy):
  """A ``custom_vjp`` function again, its primal body, forward and backward rules autocast.

  The forward rule is JAX's VJP of the original primitive (which runs the user's ``fwd``),
  traced into a jaxpr whose outputs are the primal outputs and the residuals; the backward
  rule applies that VJP's pullback (which runs the user's ``bwd``). Both are autocast, and
  the residuals are saved in the dtypes they are computed in.
  """
  jaxpr, consts = program
  avals = [v.aval for v in eqn.invars]
  primal = lambda *args: evaluate(jaxpr, consts, args, policy, keep_signature=False)
  out_types = jax.eval_shape(primal, *ins)
  original = lambda *args: _interpret.bind(eqn, [_cast(x, a) for x, a in zip(args, avals)])
  found = {}

  def forward(*args):
    y, pullback = jax.vjp(original, *args)
    residuals, found["pullback"] = jax.tree.flatten(pullback)
    return [*y, *residuals]

  fwd_jaxpr = jax.make_jaxpr(forward)(*_shapes(avals))
  res_avals = [v.aval for v in fwd_jaxpr.jaxpr.outvars[len(out_types) :]]
  float_out = [i for i, t in enumerate(out_types) if _floating(t)]

  def fwd(*args):
    outs = evaluate(fwd_jaxpr.jaxpr, fwd_jaxpr.consts, args, policy, keep_signature=False)
    return _like(outs[: len(out_types)], out_types), outs[len(out_types) :]

  def bwd(residuals, cotangents):
    def backward(residuals, float_cotangents):
      cts = [np.zeros(a.shape, jax.dtypes.float0) for a in out_avals]
      for i, ct in zip(float_out, float_cotangents):
        cts[i] = ct
      grads = jax.tree.unflatten(found["pullback"], residuals)(cts)
      return [g for g, a in zip(grads, avals) if _floating(a)]

    out_avals = [v.aval for v in eqn.outvars]
    closed = jax.make_jaxpr(backward)(_shapes(res_avals), [_shapes(out_avals)[i] for i in float_out])
    operands = [*residuals, *(cotangents[i] for i in float_out)]
    grads = iter(evaluate(closed.jaxpr, closed.consts, operands, policy, keep_signature=False))
    return tuple(_to(next(grads), _dtype(x)) if _floating(a) else None for x, a in zip(ins, avals))

  fn = jax.custom_vjp(primal)
  fn.defvjp(fwd, bwd)
  return list(fn(*ins))


def _shapes(avals):
  return [jax.ShapeDtypeStruct(a.shape, a.dtype, weak_type=getattr(a, "weak_type", False)) for a in avals]


def _like(values, types):
  return [_to(x, t.dtype) if _floating(t) else x for x, t in zip(values, types)]


def _dtype(x):
  dtype = getattr(x, "dtype", None)
  return dtype if dtype is not None and jnp.issubdtype(dtype, jax.dtypes.extended) else np.dtype(jnp.result_type(x))


def _promote(eqn, ins):
  """The floating inputs in one dtype: the widest of the strongly typed ones (torch's rule).

  A Python float (a weak-typed literal) follows the others unless that dtype cannot hold it:
  ``y / 70000.0`` with ``y`` in float16 runs in the program's dtype, since 70000.0 is inf in
  float16 (and 1e-6, below float16's normal range, would keep 4 bits of its 11).
  """
  floating = [(x, v) for x, v in zip(ins, eqn.invars) if _floating(v.aval)]
  strong = [_dtype(x) for x, v in floating if not (_interpret.is_literal(v) or v.aval.weak_type)]
  traced = [_dtype(x) for x, v in floating if not _interpret.is_literal(v)]
  dtypes = strong or traced or [_dtype(x) for x, _ in floating]
  if not dtypes:
    return ins
  common = functools.reduce(jnp.promote_types, dtypes)
  for x, v in floating:
    if _interpret.is_literal(v) and not _holds(common, x):
      common = jnp.promote_types(common, v.aval.dtype)
  return [_to(x, common) if _floating(v.aval) else x for x, v in zip(ins, eqn.invars)]


def _holds(dtype, value) -> bool:
  """Whether ``dtype`` holds the constant ``value`` in its normal range (or as 0, inf, NaN)."""
  magnitude = np.abs(np.asarray(value, np.float64))
  info = jnp.finfo(dtype)
  ok = ~np.isfinite(magnitude) | (magnitude == 0) | ((magnitude >= float(info.tiny)) & (magnitude <= float(info.max)))
  return bool(np.all(ok))


def _widen(x):
  dtype = np.dtype(jnp.result_type(x))
  return dtype if dtype.itemsize >= 4 else np.dtype(np.float32)


def _to(x, dtype):
  if isinstance(x, (jax.Array, np.ndarray, np.generic)) and x.dtype == dtype:
    return x
  return jax.lax.convert_element_type(x, dtype)  # pyright: ignore[reportArgumentType]


def _cast(x, aval):
  """``x`` in ``aval``'s dtype, if it is a floating one."""
  return _to(x, aval.dtype) if _floating(aval) else x


_floating = _interpret.floating


def _has_work(jaxpr) -> bool:
  """Whether ``jaxpr`` holds, at any depth, an operation whose dtype autocast chooses."""
  for eqn in jaxpr.eqns:
    name = eqn.primitive.name
    if name in COMPUTE_PRIMITIVES or name in FLOAT32_PRIMITIVES:
      return True
    if any(_has_work(j) for j in _interpret.subjaxprs(eqn.params)):
      return True
  return False


def _nnx_variables(tree) -> dict:
  """The NNX Variables of ``tree``, by the index of their value among ``tree``'s leaves.

  Found through sys.modules: jaxscale must not import flax.
  """
  nnx = sys.modules.get("flax.nnx")
  if nnx is None:
    return {}
  is_variable = lambda x: isinstance(x, nnx.Variable)
  found, index = {}, 0
  for item in jax.tree.leaves(tree, is_leaf=is_variable):
    count = len(jax.tree.leaves(item)) if is_variable(item) else 1
    if is_variable(item) and count == 1:
      found[index] = item
    index += count
  return found


def _set(variable, value):
  # `set_value` is flax >= 0.12.1, which deprecates `.value`.
  set_value = getattr(variable, "set_value", None)
  if callable(set_value):
    set_value(value)
  else:
    variable.value = value
