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

Higher-order primitives are handled by what they are: ``jit`` is inlined (its operations are
autocast like the caller's); ``scan``, ``while``, ``cond`` and ``checkpoint`` are rebuilt with
``jax.lax.scan`` / ``while_loop`` / ``switch`` / ``jax.checkpoint`` around autocast bodies;
``custom_jvp`` / ``custom_vjp`` functions autocast their primal body while their derivative
rules run as written, in the dtypes of the program. A nested ``autocast`` region is marked by a
``jit`` named ``jaxscale_autocast`` and kept as its own policy made it. Any other primitive that
holds a sub-program with something to autocast in it is refused by name.
"""

from __future__ import annotations

import functools
import inspect
import sys
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import jax
import jax.numpy as jnp
import numpy as np
from jax.core import Tracer
from jax.extend import core

from jaxscale import _float8, _policy, _tree

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

_CALLS = frozenset({"jit", "pjit", "closed_call", "core_call"})
_CHECKPOINTS = frozenset({"checkpoint", "remat", "remat2"})
_CUSTOM = frozenset({"custom_jvp_call", "custom_vjp_call", "custom_vjp_call_jaxpr"})
MARKER = "jaxscale_autocast"  # the name of the `jit` around a nested region


def autocast(fun: F, policy: _policy.Policy | str, *, enabled: bool = True) -> F:
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

  Returns:
    The wrapped function.

  Raises:
    TypeError: if ``enabled`` is not a bool, or ``policy`` is neither a :class:`Policy` nor
      a string.
    ValueError: if the policy string is not understood.

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
  if not enabled:
    return fun

  # An NNX module called as `fun`, or whose method `fun` is, holds the parameters itself: as a
  # pytree (`Partial` for a method) its arrays are traced like the arguments'.
  callee = jax.tree_util.Partial(fun.__func__, fun.__self__) if inspect.ismethod(fun) else fun

  @functools.wraps(fun)
  def wrapped(*args, **kwargs):
    tree = (callee, args, kwargs)
    leaves, treedef = jax.tree.flatten(tree)
    dynamic = [i for i, leaf in enumerate(leaves) if isinstance(leaf, (jax.Array, np.ndarray, np.generic))]
    variables = _nnx_variables(tree)
    found = {}

    def traced(*arrays):
      run_leaves = list(leaves)
      for i, x in zip(dynamic, arrays):
        run_leaves[i] = x
      run_callee, run_args, run_kwargs = jax.tree.unflatten(treedef, run_leaves)
      out = run_callee(*run_args, **run_kwargs)
      after = jax.tree.leaves((run_callee, run_args, run_kwargs))
      if len(after) != len(leaves):
        raise ValueError(
            "`autocast`'s `fun` changed the structure of its arguments (an NNX module gained or lost "
            "a Variable); create Variables outside the autocast region."
        )
      # What `fun` assigned to an NNX Variable (batch statistics, an RNG count) goes back to it.
      found["written"] = [i for i in variables if after[i] is not run_leaves[i]]
      out_leaves, found["out_tree"] = jax.tree.flatten(out)
      return out_leaves, [jnp.asarray(after[i]) for i in found["written"]]

    arrays = [leaves[i] for i in dynamic]
    _float8.warn_float8_arguments(arrays)
    closed = jax.make_jaxpr(traced)(*arrays)
    run = functools.partial(_call, closed, policy)
    if any(isinstance(x, Tracer) for x in (*arrays, *closed.consts)):
      # Under a trace, the region goes into a `jit` named as the marker: an enclosing autocast
      # sees it and leaves it as this policy made it. (Run eagerly, no enclosing one can exist.)
      run = jax.jit(_named(run))
    outs = run(*arrays)
    out_leaves, written = outs[: len(outs) - len(found["written"])], outs[len(outs) - len(found["written"]) :]
    for i, value in zip(found["written"], written):
      variable = variables[i]
      old = _tree.unwrap_variable(variable)
      _set(variable, value.astype(old.dtype) if _policy.is_floating_array(old) else value)
    return policy.cast_to_output(jax.tree.unflatten(found["out_tree"], out_leaves))

  return wrapped  # type: ignore[return-value]


def _named(fn):
  def region(*arrays):
    return fn(*arrays)

  region.__name__ = region.__qualname__ = MARKER
  return region


def evaluate(jaxpr, consts: Sequence[Any], args: Sequence[Any], policy: _policy.Policy) -> list:
  """The outputs of ``jaxpr`` on ``args``, autocast; in the dtypes the jaxpr declares."""
  env: dict = {}
  for var, value in zip(jaxpr.constvars, consts):
    env[var] = value
  for var, value in zip(jaxpr.invars, args):
    env[var] = value
  read = lambda v: v.val if isinstance(v, core.Literal) else env[v]
  for eqn in jaxpr.eqns:
    outs = _eqn(eqn, [read(v) for v in eqn.invars], policy)
    for var, value in zip(eqn.outvars, outs):
      env[var] = value  # a DropVar too: never read
  return [_cast(read(v), v.aval) for v in jaxpr.outvars]


def _eqn(eqn, ins: list, policy: _policy.Policy) -> list:
  name = eqn.primitive.name
  avals = [v.aval for v in eqn.invars]
  if name in COMPUTE_PRIMITIVES and all(_floating(a) for a in avals):
    compute = policy.compute_dtype
    if policy.matmul_dtype is not None:
      return [_float8.matmul(eqn.primitive, eqn.params, *ins, compute)]
    ins = [_to(x, compute) for x in ins]
    return _bind(eqn, ins, dict(eqn.params, preferred_element_type=compute))
  if name in FLOAT32_PRIMITIVES:
    return _bind(eqn, [_to(x, _widen(x)) if _floating(a) else x for x, a in zip(ins, avals)])
  if name in _FOLLOW_PRIMITIVES:
    return _bind(eqn, _promote(eqn, ins))
  ins = [_cast(x, a) for x, a in zip(ins, avals)]  # as the program gave them
  if policy.matmul_dtype is not None and name in _float8.OTHER_MATMULS:
    _float8.warn_not_float8(name)
  if name in _CALLS:
    if eqn.params.get("name") == MARKER:  # a nested autocast region: as its own policy made it
      return _bind(eqn, ins)
    inner = eqn.params.get("jaxpr", eqn.params.get("call_jaxpr"))
    return evaluate(inner.jaxpr, inner.consts, ins, policy)
  sub = _subjaxprs(eqn.params)
  if not any(_has_work(j) for j in sub):
    return _bind(eqn, ins)
  if name == "scan":
    return _scan(eqn, ins, policy)
  if name == "while":
    return _while(eqn, ins, policy)
  if name == "cond":
    branches = [functools.partial(_call, b, policy) for b in eqn.params["branches"]]
    return list(jax.lax.switch(ins[0], branches, *ins[1:]))
  if name in _CHECKPOINTS:
    body = functools.partial(evaluate, eqn.params["jaxpr"], (), policy=policy)
    remat = jax.checkpoint(lambda *a: body(a), prevent_cse=eqn.params["prevent_cse"], policy=eqn.params["policy"])
    return list(remat(*ins))
  if name in _CUSTOM and "call_jaxpr" in eqn.params:
    body = eqn.params["call_jaxpr"]
    shapes = [jax.ShapeDtypeStruct(a.shape, a.dtype, weak_type=a.weak_type) for a in body.in_avals]
    new_body = jax.make_jaxpr(functools.partial(_call, body, policy))(*shapes)
    return _bind(eqn, ins, dict(eqn.params, call_jaxpr=new_body))
  raise NotImplementedError(
      f"`jaxscale.autocast` does not know the higher-order primitive `{name}`, and it holds a "
      "matmul, a convolution or an operation of the float32 list. Apply `autocast` inside it "
      "instead (to the function you give it), or open an issue naming the primitive."
  )


def _call(closed, policy, *args):
  return evaluate(closed.jaxpr, closed.consts, args, policy)


def _scan(eqn, ins, policy):
  p = eqn.params
  consts, init, xs = ins[: p["num_consts"]], ins[p["num_consts"] : p["num_consts"] + p["num_carry"]], ins[p["num_consts"] + p["num_carry"] :]

  def body(carry, x):
    outs = _call(p["jaxpr"], policy, *consts, *carry, *x)
    return outs[: p["num_carry"]], outs[p["num_carry"] :]

  extra = {"_split_transpose": True} if p.get("_split_transpose") else {}
  carry, ys = jax.lax.scan(body, init, xs, length=p["length"], reverse=p["reverse"], unroll=p["unroll"], **extra)
  return [*carry, *ys]


def _while(eqn, ins, policy):
  p = eqn.params
  cond_consts, body_consts = ins[: p["cond_nconsts"]], ins[p["cond_nconsts"] : p["cond_nconsts"] + p["body_nconsts"]]
  init = ins[p["cond_nconsts"] + p["body_nconsts"] :]
  return list(
      jax.lax.while_loop(
          lambda c: _call(p["cond_jaxpr"], policy, *cond_consts, *c)[0],
          lambda c: _call(p["body_jaxpr"], policy, *body_consts, *c),
          init,
      )
  )


def _bind(eqn, ins, params=None) -> list:
  # `get_bind_params` returns `(subfuns, params)` on jax < 0.8, `params` after.
  bound = eqn.primitive.get_bind_params(eqn.params if params is None else params)
  subfuns, bind_params = bound if isinstance(bound, tuple) else ((), bound)
  out = eqn.primitive.bind(*subfuns, *ins, **bind_params)
  return list(out) if eqn.primitive.multiple_results else [out]


def _promote(eqn, ins):
  """The floating inputs in one dtype: the widest of the strongly typed ones (torch's rule)."""
  floating = [(x, v) for x, v in zip(ins, eqn.invars) if _floating(v.aval)]
  strong = [np.dtype(jnp.result_type(x)) for x, v in floating if not (isinstance(v, core.Literal) or v.aval.weak_type)]
  dtypes = strong or [np.dtype(jnp.result_type(x)) for x, _ in floating]
  if not dtypes:
    return ins
  common = functools.reduce(jnp.promote_types, dtypes)
  return [_to(x, common) if _floating(v.aval) else x for x, v in zip(ins, eqn.invars)]


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


def _floating(aval) -> bool:
  dtype = getattr(aval, "dtype", None)
  return dtype is not None and not jnp.issubdtype(dtype, jax.dtypes.extended) and jnp.issubdtype(dtype, jnp.floating)


def _subjaxprs(params) -> list:
  """The jaxprs among a primitive's parameters (``ClosedJaxpr`` ones as they are, open ones closed)."""
  found = []
  for value in params.values():
    for item in value if isinstance(value, (tuple, list)) else (value,):
      if isinstance(item, core.ClosedJaxpr):
        found.append(item.jaxpr)
      elif isinstance(item, core.Jaxpr):
        found.append(item)
  return found


def _has_work(jaxpr) -> bool:
  """Whether ``jaxpr`` holds, at any depth, an operation whose dtype autocast chooses."""
  for eqn in jaxpr.eqns:
    name = eqn.primitive.name
    if name in COMPUTE_PRIMITIVES or name in FLOAT32_PRIMITIVES:
      return True
    if any(_has_work(j) for j in _subjaxprs(eqn.params)):
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
