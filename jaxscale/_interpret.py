"""Walking a jaxpr: the one room where jaxscale reads JAX's program representation.

``autocast`` re-runs a traced program operation by operation, and ``precision_report`` counts
it; both walk the same jaxprs, and a higher-order primitive (``scan``, ``while``, ``cond``,
``checkpoint``, ``shard_map``, ``custom_linear_solve``, ...) is met the same way by both:

    sub-programs    every (closed) jaxpr among the primitive's parameters, at any nesting
                    of tuples, lists and named tuples: `subjaxprs(params)`
    rebuilt         each sub-program traced again through a given evaluator with its
                    signature kept (input and output types), and the primitive bound again
                    with every other parameter untouched: `rebind(eqn, ins, evaluate)`

No primitive-specific key (``num_consts``, ``cond_nconsts``, ...) is read, so a release that
renames them changes nothing here. What cannot be rebuilt this way (a sub-program over
references, a rebuilt open jaxpr that needs constants) is an error naming the primitive and
the JAX version.

JAX promises no compatibility for ``jax.extend``; the few places that depend on a release
are gated on ``JAX_VERSION`` below, with the release that changed them.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np
from jax.extend import core, source_info_util

JAX_VERSION = tuple(int(part) for part in jax.__version__.split(".")[:3])


def version_error(name: str, why: str) -> NotImplementedError:
  return NotImplementedError(
      f"`jaxscale` cannot rebuild the higher-order primitive `{name}` on jax {jax.__version__}: "
      f"{why}. Apply `autocast` inside it instead (to the function you give it), or open an "
      "issue naming the primitive and this JAX version."
  )


def is_closed(value) -> bool:
  """A closed jaxpr: a jaxpr with its constants (``ClosedJaxpr``, however a release names it)."""
  return hasattr(value, "jaxpr") and hasattr(value, "consts") and hasattr(value, "in_avals")


def is_open(value) -> bool:
  """An open jaxpr: equations, inputs and outputs, no constants held."""
  return hasattr(value, "eqns") and hasattr(value, "invars") and hasattr(value, "outvars")


# `jax.extend.core.Literal` is there from jax 0.7.1 (the oldest supported) to 0.12; should a
# release drop the name, a literal is still the one jaxpr atom that carries its value.
_LITERAL = getattr(core, "Literal", None)


def is_literal(var) -> bool:
  if _LITERAL is not None:
    return isinstance(var, _LITERAL)
  return type(var).__name__ == "Literal" and hasattr(var, "val")


def _items(value):
  return value if isinstance(value, (tuple, list)) else (value,)


def subprograms(params) -> list:
  """``(jaxpr, consts)`` for each jaxpr among a primitive's parameters (an open one has none)."""
  found = []
  for value in params.values():
    for item in _items(value):
      if is_closed(item):
        found.append((item.jaxpr, item.consts))
      elif is_open(item):
        found.append((item, ()))
  return found


def subjaxprs(params) -> list:
  """The open jaxprs among a primitive's parameters (those of closed ones included)."""
  return [jaxpr for jaxpr, _ in subprograms(params)]


def bind(eqn, ins: Sequence[Any], params=None) -> list:
  """``eqn``'s primitive bound on ``ins`` with ``params`` (its own by default); always a list."""
  bound = eqn.primitive.get_bind_params(eqn.params if params is None else params)
  # `(subfuns, params)` before jax 0.8, the parameters alone since.
  subfuns, bind_params = bound if isinstance(bound, tuple) else ((), bound)
  out = eqn.primitive.bind(*subfuns, *ins, **bind_params)
  return list(out) if eqn.primitive.multiple_results else [out]


def source_of(eqn):
  """A context in which the operations bound keep ``eqn``'s source.

  Its user traceback, and its module path (name stack) under the current one, as JAX's own
  transformations keep them: what an interpreter emits for ``eqn`` (the operation itself, the
  casts around it) still names the user's line and layer, for ``find_overflow`` and JAX's
  error messages alike.
  """
  info = getattr(eqn, "source_info", None)
  if info is None:
    return contextlib.nullcontext()
  name_stack = source_info_util.current_name_stack() + info.name_stack
  return source_info_util.user_context(info.traceback, name_stack=name_stack)


def rebind(eqn, ins: Sequence[Any], evaluate: Callable, *, in_dtypes=None) -> list:
  """``eqn`` bound again with each sub-program replaced by ``evaluate``'s version of it.

  ``evaluate(jaxpr, consts, args)`` returns the outputs of an open jaxpr. Each sub-program is
  traced again through it at its own input types (or, given ``in_dtypes``, at those dtypes for
  a primitive whose one sub-program takes ``ins`` one to one: ``checkpoint``), so its output
  types are whatever ``evaluate`` makes of them.
  """
  name = eqn.primitive.name
  # A primitive that holds a device mesh (`shard_map`) runs its sub-programs with the mesh's
  # axis names bound; they are bound again while they are traced again.
  meshes = [v for v in eqn.params.values() if hasattr(v, "axis_names") and hasattr(v, "shape")]
  axes = [item for mesh in meshes for item in dict(mesh.shape).items()]

  def retrace(program):
    closed = program if is_closed(program) else None
    jaxpr, consts = (closed.jaxpr, closed.consts) if closed is not None else (program, ())
    avals = [v.aval for v in jaxpr.invars]
    if any(not hasattr(a, "shape") or not hasattr(a, "dtype") or hasattr(a, "inner_aval") for a in avals):
      raise version_error(name, "its sub-program takes values that are not arrays (references or tokens)")
    dtypes = in_dtypes if in_dtypes is not None else [a.dtype for a in avals]
    shapes = [shape_of(a, d) for a, d in zip(avals, dtypes)]
    try:
      new = jax.make_jaxpr(lambda *args: evaluate(jaxpr, consts, args), axis_env=axes)(*shapes)
    except NotImplementedError:
      raise
    except Exception as error:  # JAX's, when a sub-program cannot be traced alone
      raise version_error(name, f"tracing its sub-program again raised {type(error).__name__}: {error}") from error
    if closed is not None:
      return new
    if new.consts:
      raise version_error(name, "its rebuilt sub-program holds constants, which an open jaxpr cannot")
    return new.jaxpr

  def rebuild(value):
    if is_closed(value) or is_open(value):
      return retrace(value)
    if isinstance(value, (tuple, list)) and any(is_closed(v) or is_open(v) for v in value):
      items = [rebuild(v) for v in value]
      return type(value)(*items) if hasattr(value, "_fields") else type(value)(items)
    return value

  params = {key: rebuild(value) for key, value in eqn.params.items()}
  try:
    return bind(eqn, ins, params)
  except Exception as error:  # whatever the primitive raises, named with it
    raise version_error(
        name, f"binding it again with its rebuilt sub-programs raised {type(error).__name__}: {error}"
    ) from error


# Inside `shard_map`, a value's type says along which mesh axes it varies: `vma` until jax 0.8,
# `manual_axis_type` since. Kept when a sub-program is traced again, or `shard_map` refuses it.
_MANUAL_AXES = next(
    (k for k in ("manual_axis_type", "vma") if k in inspect.signature(jax.ShapeDtypeStruct).parameters), None
)


def shape_of(aval, dtype=None) -> jax.ShapeDtypeStruct:
  """``aval`` (with ``dtype`` instead of its own, if given) as what ``jax.make_jaxpr`` traces."""
  kwargs = {"weak_type": getattr(aval, "weak_type", False)}
  if _MANUAL_AXES is not None and getattr(aval, _MANUAL_AXES, None):
    kwargs[_MANUAL_AXES] = getattr(aval, _MANUAL_AXES)
  return jax.ShapeDtypeStruct(aval.shape, aval.dtype if dtype is None else dtype, **kwargs)


def floating(aval) -> bool:
  dtype = getattr(aval, "dtype", None)
  return (
      dtype is not None
      and not jax.numpy.issubdtype(dtype, jax.dtypes.extended)
      and jax.numpy.issubdtype(dtype, np.floating)
  )
