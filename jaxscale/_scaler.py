"""The loss scaler: its state, the update rule, and scaling / unscaling.

The rule (torch.amp.GradScaler's, plus bounds, hysteresis and a static mode)::

    after a step whose gradients were finite:
        growth_tracker += 1
        if dynamic and growth_tracker >= growth_interval:
            if isfinite(scale * growth_factor):
                scale = min(scale * growth_factor, max_scale)
            growth_tracker = 0
            hysteresis_tracker = hysteresis
    after a step whose gradients held an inf or a NaN (the step is skipped):
        growth_tracker = 0
        hysteresis_tracker = max(hysteresis_tracker - 1, 0)
        if dynamic and hysteresis_tracker == 0:
            scale = max(scale * backoff_factor, min_scale, 2**-126)
    a static scale (dynamic False) never backs off, so its hysteresis_tracker is
    refilled at each finite step and counts on below 0 at each overflow: its
    overflows in a row, past the tolerance, are -hysteresis_tracker

With the defaults (``hysteresis=1``, ``min_scale=0``, ``max_scale=inf``) this is
exactly torch's ``_amp_update_scale_``, except that the scale never backs off
below 2**-126, float32's smallest normal number (torch's goes on to 2**-127
after 143 overflows in a row from 2**16, a subnormal that XLA flushes to 0:
every later step would then be skipped). Hysteresis follows Megatron-LM's
``DynamicGradScaler``: the tolerance is spent by non-finite steps and refilled
only when the scale grows (DeepSpeed refills it on every finite step instead).

A run stalls (see ``on_stall``) on an overflow with the scale already at its
floor; a static scale, on an overflow after as many in a row, past its
hysteresis, as halving it would take to reach that floor: where a dynamic
scale halving from it would have stalled.
"""

from __future__ import annotations

import contextvars
import inspect
import math
import warnings
from typing import Any, Literal, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.core import Tracer

from jaxscale import _numerics
from jaxscale._tree import is_floating as _is_floating

StallPolicy = Literal["skip", "raise"]


class _Slot:
  """One named scalar of a packed group: ``state.scale`` reads ``state.floats[..., 0]``."""

  def __init__(self, group: str, index: int):
    self.group, self.index = group, index

  def __get__(self, state: Any, owner: Any = None) -> jax.Array:
    if state is None:
      return self  # type: ignore[return-value]  # the class attribute, for introspection
    leaf = getattr(state, self.group)
    if isinstance(leaf, Tracer):
      return leaf[..., self.index]
    # A concrete state's fields stay concrete inside a trace, as unpacked fields would be: the
    # checks for a scaler that is a constant of a compiled step read them.
    with jax.ensure_compile_time_eval():
      return leaf[..., self.index]


# The scaler's fifteen numbers, in three groups by dtype. Each group is one array, so a jitted step
# passes three arrays in and out for the scaler instead of fifteen: on a GPU, where the host's
# dispatch of each array is most of a small step's time, fifteen cost 15% of an 8M-parameter Adam
# step on an H100 (benchmarks/NOTES.md).
_FLOATS = ("scale", "growth_factor", "backoff_factor", "min_scale", "max_scale")
_INTS = ("growth_tracker", "hysteresis_tracker", "skipped_steps", "growth_interval", "hysteresis")
_FLAGS = ("last_skipped", "stalled", "dynamic", "raise_on_stall", "enabled")
_GROUPS = {"floats": (_FLOATS, jnp.float32), "ints": (_INTS, jnp.int32), "flags": (_FLAGS, jnp.bool_)}


class ScalerState(NamedTuple):
  """Everything the loss scaler knows, as fifteen named scalars.

  ``state.scale``, ``state.growth_tracker`` and the others (``FIELDS``) are
  scalar arrays (or, for a batch of scalers after ``jax.vmap``, arrays of the
  batch's shape). They are stored packed by dtype in three leaves, ``floats``,
  ``ints`` and ``flags``, so that a compiled step passes three arrays for the
  scaler, not fifteen. Build a state with :func:`jaxscale.init`, change its
  options with :func:`jaxscale.configure`, and any field with :meth:`replace`.

  The hyperparameters live here too, as arrays: they are checkpointed with the
  state, exported by :func:`state_dict`, and can be changed between steps with
  :func:`configure` without recompiling anything.

  Examples:
    >>> import jaxscale
    >>> state = jaxscale.init(init_scale=1024.0)
    >>> state.scale, state.growth_tracker
    (Array(1024., dtype=float32), Array(0, dtype=int32))
    >>> state.growth_interval  # options are arrays in the state too
    Array(2000, dtype=int32)
    >>> int(state.replace(skipped_steps=3).skipped_steps)
    3
  """

  floats: jax.Array  # float32[..., 5]: _FLOATS
  ints: jax.Array  # int32[..., 5]: _INTS
  flags: jax.Array  # bool[..., 5]: _FLAGS

  FIELDS = _FLOATS + _INTS + _FLAGS

  scale = _Slot("floats", 0)  # 1.0 when disabled
  growth_factor = _Slot("floats", 1)
  backoff_factor = _Slot("floats", 2)
  min_scale = _Slot("floats", 3)
  max_scale = _Slot("floats", 4)
  growth_tracker = _Slot("ints", 0)  # finite steps since the last growth or backoff
  hysteresis_tracker = _Slot("ints", 1)  # non-finite steps still tolerated before a backoff (static: < 0 past it)
  skipped_steps = _Slot("ints", 2)  # total skipped steps (saturating)
  growth_interval = _Slot("ints", 3)
  hysteresis = _Slot("ints", 4)
  last_skipped = _Slot("flags", 0)  # whether the most recent step was skipped
  stalled = _Slot("flags", 1)  # sticky, see `on_stall` in `init`
  dynamic = _Slot("flags", 2)  # False keeps the scale fixed
  raise_on_stall = _Slot("flags", 3)
  enabled = _Slot("flags", 4)

  @classmethod
  def of(cls, **fields: Any) -> ScalerState:
    """The state of these fifteen fields (``FIELDS``), each a scalar or a batch of one shape."""
    missing, unknown = sorted(set(cls.FIELDS) - set(fields)), sorted(set(fields) - set(cls.FIELDS))
    if missing or unknown:
      raise TypeError(f"`ScalerState.of` takes the fields {list(cls.FIELDS)}; missing {missing}, unknown {unknown}.")
    return cls(**{group: _pack(fields, names, dtype) for group, (names, dtype) in _GROUPS.items()})

  def replace(self, **fields: Any) -> ScalerState:
    """This state with some of its fields (``FIELDS``, by name) replaced."""
    unknown = sorted(set(fields) - set(self.FIELDS))
    if unknown:
      raise TypeError(f"`ScalerState` has no field {unknown}; its fields are {list(self.FIELDS)}.")
    packed = {}
    for group, (names, dtype) in _GROUPS.items():
      if fields.keys() & set(names):
        packed[group] = _with_slots(getattr(self, group), {names.index(n): fields[n] for n in names if n in fields})
    return self._replace(**packed)

  def fields(self) -> dict[str, jax.Array]:
    """The fifteen fields by name."""
    return {name: getattr(self, name) for name in self.FIELDS}

  def __repr__(self) -> str:
    shown = ", ".join(f"{name}={_shown(getattr(self, name))}" for name in self.FIELDS)
    return f"ScalerState({shown})"


def _pack(fields: dict[str, Any], names: tuple[str, ...], dtype: Any) -> jax.Array:
  values = jnp.broadcast_arrays(*(jnp.asarray(fields[n], dtype) for n in names))
  return jnp.stack(values, axis=-1)


def _with_slots(packed: jax.Array, values: dict[int, Any]) -> jax.Array:
  """``packed`` with the slots of ``values`` replaced, elementwise: a kernel that writes the new array
  over the old one's donated buffer must read the old one elementwise, or XLA copies it first."""
  slot = jnp.arange(packed.shape[-1])
  for index, value in values.items():
    packed = jnp.where(slot == index, jnp.asarray(value, packed.dtype)[..., None], packed)
  return packed


def _shown(x: Any) -> Any:
  return x if isinstance(x, Tracer) else np.asarray(x).tolist()


# The options `configure` may change, with the dtype each is stored in.
_OPTION_DTYPES = {
    "scale": jnp.float32,
    "growth_factor": jnp.float32,
    "backoff_factor": jnp.float32,
    "growth_interval": jnp.int32,
    "hysteresis": jnp.int32,
    "min_scale": jnp.float32,
    "max_scale": jnp.float32,
    "dynamic": jnp.bool_,
    "growth_tracker": jnp.int32,
}


def init(
    *,
    init_scale: float = 2.0**16,
    growth_factor: float = 2.0,
    backoff_factor: float = 0.5,
    growth_interval: int = 2000,
    enabled: bool = True,
    hysteresis: int = 1,
    min_scale: float = 0.0,
    max_scale: float = math.inf,
    dynamic: bool = True,
    on_stall: StallPolicy = "raise",
) -> ScalerState:
  """Builds a :class:`ScalerState`; the defaults are torch.amp.GradScaler's.

  Args:
    init_scale: the first loss scale. Powers of two keep unscaling exact.
    growth_factor: the scale is multiplied by this after ``growth_interval``
      consecutive finite steps. Must be > 1.
    backoff_factor: the scale is multiplied by this after a non-finite step.
      Must be in (0, 1).
    growth_interval: consecutive finite steps before the scale grows; >= 1.
    enabled: when False the scaler is the identity: the scale reads 1.0,
      nothing is checked and no step is skipped.
    hysteresis: non-finite steps tolerated before the scale backs off
      (Megatron-LM's meaning: the tolerance refills when the scale grows).
      Every non-finite step is skipped regardless. 1 backs off at once.
    min_scale: the scale never backs off below this. May be below 1. Whatever
      it is, the scale never backs off below 2**-126, float32's smallest
      normal number: below it XLA flushes the scale to 0 and no step could
      ever be taken again. (torch's does: from its default 2**16, it reaches
      2**-127 after 143 back-offs in a row.) A scale at this floor counts as
      ``min_scale`` for ``on_stall``.
    max_scale: the scale never grows above this.
    dynamic: False keeps the scale fixed at ``init_scale`` (a static loss
      scale); non-finite steps are still skipped and counted, and a run of
      them stalls as ``on_stall`` says.
    on_stall: what happens when a step overflows while the scale is already
      at ``min_scale`` (or at 2**-126), as in a run whose every step holds an
      inf or a NaN whatever the scale; for a static scale (``dynamic=False``),
      when a step overflows after as many overflows in a row as halving the
      scale would take to reach that floor (143 from 2**16), where a dynamic
      scale would have stalled. ``"raise"`` (the default) sets the sticky
      ``stalled`` flag, skips every later step (the parameters stay at their
      last good values) and makes :func:`raise_if_stalled` raise, and with it
      :func:`jaxscale.find_scaler` and :func:`jaxscale.metrics` outside
      ``jit``: the run does not go on quietly. ``"skip"`` keeps skipping such
      steps and trying again (torch's behaviour). The flag lives on the
      device: nothing in the compiled step waits for it.

  Returns:
    A :class:`ScalerState` whose leaves are all scalar arrays.

  Raises:
    ValueError: if an option is out of range.

  Examples:
    >>> import jaxscale
    >>> state = jaxscale.init(init_scale=1024.0, growth_interval=100)
    >>> state.scale
    Array(1024., dtype=float32)
    >>> jaxscale.init(enabled=False).scale
    Array(1., dtype=float32)
  """
  if _staging() and not isinstance(init_scale, Tracer):  # a traced scale is threaded through on purpose
    warnings.warn(
        "jaxscale: `jaxscale.init` was called inside a traced function (`jit`, `scan`, ...): a "
        "scaler built there starts afresh at every call, so its scale never adapts, and after one "
        "overflow every step would overflow again. Build the optimizer state once, outside "
        "(`tx.init(params)`, which is fine under `jit`), and take the scaler from it inside the "
        "step: `jaxscale.find_scaler(opt_state)`.",
        UserWarning,
        stacklevel=2,
    )
  return _build(init_scale=init_scale, growth_factor=growth_factor, backoff_factor=backoff_factor,
                growth_interval=growth_interval, enabled=enabled, hysteresis=hysteresis,
                min_scale=min_scale, max_scale=max_scale, dynamic=dynamic, on_stall=on_stall)


def build(**options: Any) -> ScalerState:
  """:func:`init` without its warning, for the Optax wrapper's ``init``, which may be jitted."""
  return _build(**{**_INIT_DEFAULTS, **options})


def _build(*, init_scale, growth_factor, backoff_factor, growth_interval, enabled, hysteresis, min_scale,
           max_scale, dynamic, on_stall) -> ScalerState:
  if on_stall not in ("skip", "raise"):
    raise ValueError(f"`on_stall` must be 'skip' or 'raise', got {on_stall!r}.")
  if not isinstance(enabled, (bool, np.bool_)):
    raise TypeError(f"`enabled` must be a Python bool, got {enabled!r}.")
  options = dict(
      scale=init_scale,
      growth_factor=growth_factor,
      backoff_factor=backoff_factor,
      growth_interval=growth_interval,
      hysteresis=hysteresis,
      min_scale=min_scale,
      max_scale=max_scale,
      dynamic=dynamic,
  )
  stored = _validate(options, {}, name_of_scale="init_scale")
  if not enabled:
    stored["scale"] = np.float32(1.0)
  arrays = {k: jnp.asarray(v, _OPTION_DTYPES[k]) for k, v in stored.items()}
  return ScalerState.of(
      growth_tracker=jnp.zeros((), jnp.int32),
      hysteresis_tracker=jnp.array(stored["hysteresis"], jnp.int32),
      skipped_steps=jnp.zeros((), jnp.int32),
      last_skipped=jnp.zeros((), jnp.bool_),
      stalled=jnp.zeros((), jnp.bool_),
      raise_on_stall=jnp.asarray(on_stall == "raise"),
      enabled=jnp.asarray(bool(enabled)),
      **arrays,
  )


_INIT_DEFAULTS = {name: p.default for name, p in inspect.signature(init).parameters.items()}


def configure(state: ScalerState, **options: Any) -> ScalerState:
  """Returns ``state`` with some options changed; nothing recompiles.

  The equivalent of torch's ``set_growth_factor``, ``set_backoff_factor``,
  ``set_growth_interval`` and ``update(new_scale)``: any of ``scale``,
  ``growth_factor``, ``backoff_factor``, ``growth_interval``, ``hysteresis``,
  ``min_scale``, ``max_scale``, ``dynamic`` and ``growth_tracker`` may be given.
  Concrete values are validated like :func:`init`'s, together with the
  options they bound (a new ``min_scale`` must not exceed the current scale);
  traced ones only by dtype. Setting ``hysteresis`` refills the tolerance of
  non-finite steps. On a disabled state the scale stays 1.0.

  Raises:
    ValueError: if an option is unknown or out of range (as stored: float32
      for scales and factors, int32 for counts).
    TypeError: if an option has the wrong type (``dynamic="no"``).

  Args:
    state: the scaler state to change.
    **options: the options to change, by name, each a number or a scalar array.

  Returns:
    ``state`` with those options replaced, every leaf still a scalar array of
    its dtype.

  Examples:
    >>> import jaxscale
    >>> state = jaxscale.configure(jaxscale.init(), scale=128.0, growth_interval=10)
    >>> int(state.growth_interval), float(state.scale)
    (10, 128.0)
  """
  require_state(state, "configure")
  unknown = sorted(set(options) - set(_OPTION_DTYPES))
  if unknown:
    raise ValueError(
        f"`configure` cannot change {unknown}; it takes any of {sorted(_OPTION_DTYPES)}."
    )
  current = {k: getattr(state, k) for k in _OPTION_DTYPES if k not in options}
  if not isinstance(state.enabled, Tracer) and not np.asarray(state.enabled).all():
    current.pop("scale", None)  # a disabled state's 1.0 bounds nothing
  stored = _validate(options, current, name_of_scale="scale")
  arrays = {k: jnp.array(v, _OPTION_DTYPES[k]) for k, v in stored.items()}
  if "scale" in arrays:
    arrays["scale"] = jnp.where(state.enabled, arrays["scale"], state.scale)
  if "hysteresis" in arrays:
    arrays["hysteresis_tracker"] = jnp.array(arrays["hysteresis"])
  return state.replace(**arrays)


_TINY = float(np.finfo(np.float32).tiny)  # 2**-126, the smallest normal float32
_INT32 = np.iinfo(np.int32)


def _validate(given: dict[str, Any], current: dict[str, Any], *, name_of_scale: str) -> dict[str, Any]:
  """Returns ``given`` as it will be stored; raises for values that cannot work.

  Each value is converted to its storage dtype first (NumPy float32, int32 or
  bool) and checked there: 1e39 is inf in float32, 0.99999999 is 1.0. Given
  values must be scalars; ``current`` ones (the state's, which ``vmap`` may
  have batched) are checked elementwise. Traced values are checked by dtype
  only, and returned as they are.
  """

  def shown(name):
    return name_of_scale if name == "scale" else name

  stored = {name: _stored(shown(name), name, v) for name, v in given.items()}
  values = {name: v for name, v in {**current, **stored}.items() if not isinstance(v, Tracer)}
  values = {name: np.asarray(v) for name, v in values.items()}

  def check(name, ok, requirement):
    if name in given and name in values and not np.all(ok(values[name])):
      received = given[name]
      note = ""
      if _OPTION_DTYPES[name] != jnp.bool_ and float(values[name]) != float(received):
        dtype = np.dtype(_OPTION_DTYPES[name]).name
        note = f", which {dtype} stores as {values[name].item()!r}"
      raise ValueError(f"`{shown(name)}` must be {requirement}, got {received!r}{note}.")

  with np.errstate(invalid="ignore"):
    check("scale", lambda s: np.isfinite(s) & (s >= _TINY),
          "a normal float32: finite and at least 2**-126 (~1.18e-38)")
    check("growth_factor", lambda g: np.isfinite(g) & (g > 1), "finite and > 1 in float32")
    check("backoff_factor", lambda b: (b > 0) & (b < 1), "in the open interval (0, 1) in float32")
    check("growth_interval", lambda n: n >= 1, "an integer >= 1")
    check("growth_tracker", lambda n: n >= 0, "an integer >= 0")
    check("hysteresis", lambda n: n >= 1, "an integer >= 1")
    check("min_scale", lambda m: (m == 0) | (np.isfinite(m) & (m >= _TINY)),
          "0 (no bound) or a normal float32: finite and at least 2**-126")
    check("max_scale", lambda m: m >= _TINY, "at least 2**-126 in float32 (inf for no bound)")

  def bound(low, high, why):
    if low in values and high in values and (low in given or high in given):
      if not np.all(values[low] <= values[high]):
        raise ValueError(
            f"`{shown(low)}` ({_show(values[low])}) must not exceed `{shown(high)}` "
            f"({_show(values[high])}): {why}."
        )

  bound("min_scale", "max_scale", "no scale could satisfy both")
  bound("min_scale", "scale", "a back-off would raise the scale; lower `min_scale` or raise the scale")
  bound("scale", "max_scale", "a growth would lower the scale; raise `max_scale` or lower the scale")
  return stored


def _show(x: np.ndarray) -> Any:
  return x.item() if x.shape == () else x


def _stored(shown: str, name: str, value: Any) -> Any:
  """``value`` converted to option ``name``'s storage dtype; TypeError/ValueError naming it."""
  dtype = np.dtype(_OPTION_DTYPES[name])
  wanted = "a bool" if dtype.kind == "b" else "a real number"
  if isinstance(value, Tracer):
    kind = value.dtype.kind
  elif isinstance(value, int) and not isinstance(value, bool):
    kind = "i"  # also a Python int too large for NumPy: out of range below
  elif isinstance(value, (str, bytes)) or value is None:
    kind = "U"
  else:
    kind = np.asarray(value).dtype.kind
  if (dtype.kind == "b") != (kind == "b") or kind not in "biuf":
    raise TypeError(f"`{shown}` must be {wanted}, got {value!r} of type {type(value).__name__}.")
  if isinstance(value, Tracer):
    return value
  if isinstance(value, int) and not _INT32.min <= value <= _INT32.max:
    array = np.asarray(math.inf if value > 0 else -math.inf)  # out of range, and may not fit NumPy
  else:
    array = np.asarray(value)
  if array.shape != ():
    raise ValueError(f"`{shown}` must be a scalar, got an array of shape {array.shape}.")
  if dtype.kind == "b":
    return array.astype(dtype)
  if dtype.kind == "f":
    with np.errstate(over="ignore", under="ignore"):
      return array.astype(np.float64).astype(dtype)
  with np.errstate(invalid="ignore"):
    fits = np.all(np.isfinite(array) & (np.mod(array, 1) == 0) & (array >= _INT32.min) & (array <= _INT32.max))
  if not fits:
    raise ValueError(
        f"`{shown}` must be an integer that fits in int32 ({_INT32.min} to {_INT32.max}), got {value!r}."
    )
  return array.astype(dtype)


def scale(state: ScalerState, tree: Any) -> Any:
  """Multiplies every floating leaf of ``tree`` by the loss scale.

  Each leaf keeps its dtype; the product is formed in at least float32, so a
  float16 loss overflows only if the scaled value itself does. Integer leaves
  are returned as they are. With a disabled state this is the identity.

  Args:
    state: the scaler state.
    tree: a loss, or any pytree of losses.

  Returns:
    ``tree`` with its floating leaves scaled.

  Raises:
    ValueError: if ``tree`` has no floating leaf.

  Examples:
    >>> import jax.numpy as jnp, jaxscale
    >>> jaxscale.scale(jaxscale.init(init_scale=8.0), jnp.float16(0.5))
    Array(4., dtype=float16)
  """
  require_state(state, "scale")
  leaves = jax.tree.leaves(tree)
  if not any(_is_floating(x) for x in leaves):
    dtypes = [jnp.result_type(x).name for x in leaves]
    raise ValueError(
        "`jaxscale.scale` needs a floating loss (or a pytree with at least one "
        f"floating leaf), but got leaves of dtypes {dtypes}."
    )

  warn_if_constant(state, tree, "scale")
  uses = uses_here.get()
  if uses is not None:  # inside `jaxscale.value_and_grad`'s loss function: it counts them
    uses["scale"] += 1
  factor = _scaled_by_jaxscale(state.scale)
  return jax.tree.map(lambda x: _times(x, factor), tree)


def scale_unchecked(state: ScalerState, tree: Any) -> Any:
  """:func:`scale` for the gradient sites' own scaling, which is not the user's."""
  return jax.tree.map(lambda x: _times(x, state.scale), tree)


# While `jaxscale.value_and_grad` calls the user's loss function, how many times that call used
# `jaxscale.scale` and `jaxscale.unscale_and_check`. A dynamic scope, set and reset around the call:
# the verdict depends on the call in progress, never on what ran before.
uses_here: contextvars.ContextVar[dict | None] = contextvars.ContextVar("jaxscale_uses_here", default=None)


# Marks in a traced program: each a jitted identity, named, that XLA removes. A loss function
# jitted on its own and traced before runs no Python when `value_and_grad` calls it (JAX reuses its
# trace), so `uses_here` counts nothing there; its jaxpr still shows these names.
SCALE_MARK, UNSCALE_MARK = "_scaled_by_jaxscale", "_unscaled_by_jaxscale"


@jax.jit
def _scaled_by_jaxscale(x):
  return x


@jax.jit
def _unscaled_by_jaxscale(x):
  return x


def refuse_scaling_inside(uses: dict) -> None:
  """Raises if the loss function scaled more than it unscaled: its loss would be scaled twice.

  A gradient site nested in the loss (a gradient penalty) either is a
  ``jaxscale.value_and_grad`` of its own, whose scaling is not counted, or
  unscales what it scaled with ``jaxscale.unscale_and_check``.
  """
  if uses["scale"] > uses["unscale"]:
    raise ValueError(
        "The loss function given to `jaxscale.value_and_grad` called `jaxscale.scale` and did not "
        "unscale what it scaled; `value_and_grad` scales the loss itself, so the loss would be "
        "scaled twice and the gradients come out `scale` times too large. Return the plain loss: "
        "`value_and_grad` scales it, differentiates and unscales. (A gradient the loss needs, for a "
        "gradient penalty, comes from a `jaxscale.value_and_grad` of its own inside it.)"
    )


def _staging() -> bool:
  """Whether the caller runs inside a staged trace (``jit``, ``scan``, ...), where even a constant
  is a tracer; ``grad`` and ``vmap`` alone, outside ``jit``, compute eagerly."""
  return isinstance(jnp.zeros((), jnp.bool_), Tracer)


def warn_if_constant(state: ScalerState, tree: Any, function: str) -> None:
  """Warns, at trace time, when a dynamic scaler is a constant of a traced computation.

  Inside a jitted step whose gradients are traced, the scaler must come from
  the optimizer state passed in (``jaxscale.find_scaler(opt_state)``, traced
  too). One taken from a state outside the step, or a fresh ``jaxscale.init()``,
  is baked into the compiled step: its scale never changes, and after an
  overflow every step overflows again.
  """
  if isinstance(state.scale, Tracer) or isinstance(state.dynamic, Tracer):
    return
  if not (_staging() and any(isinstance(x, Tracer) for x in jax.tree.leaves(tree))):
    return
  if not (np.all(np.asarray(state.dynamic)) and np.all(np.asarray(state.enabled))):
    return  # a static or disabled scale never changes anyway
  warnings.warn(
      f"jaxscale: `{function}` got a scaler whose scale is a constant of the traced computation "
      "(its arrays were not passed into the jitted function): in a compiled training step its "
      "scale would never adapt, and after one overflow every step would overflow again. Take the "
      "scaler from the optimizer state passed to the step, inside it: "
      "`jaxscale.find_scaler(opt_state)`.",
      UserWarning,
      stacklevel=3,
  )


def unscale_and_check(
    state: ScalerState, grads: Any, *, axis_name: Any = None
) -> tuple[Any, jax.Array]:
  """Divides gradients by the loss scale and checks that they are finite.

  The unscale of the gradient site, by hand: ``jaxscale.scale`` ->
  ``jax.grad`` -> ``unscale_and_check``, after which the gradients are true
  ones and go to any Optax transformation. float16 and bfloat16 leaves are
  cast to float32 *before* they are unscaled (in float16, every true gradient
  below 2**-24 would flush to zero again); other leaves keep their dtype, and
  integer and ``float0`` leaves pass through. Unscaling is exact for
  power-of-two scales across the whole float32 range (see
  :func:`_reciprocal_factors`).

  Args:
    state: the scaler state that scaled the loss.
    grads: a pytree of scaled gradients.
    axis_name: inside ``shard_map`` or ``pmap``, the mapped axis (or tuple of
      axes) over which every device must agree on the flag.

  Returns:
    ``(grads, finite)``: the unscaled gradients, and a scalar bool array that
    is True iff every element of every unscaled leaf is finite (on every
    device of ``axis_name``). Always True when the state is disabled.

  Examples:
    >>> import jax.numpy as jnp, jaxscale
    >>> state = jaxscale.init(init_scale=1024.0)
    >>> jaxscale.unscale_and_check(state, {"w": jnp.array([512.0, 2048.0])})
    ({'w': Array([0.5, 2. ], dtype=float32)}, Array(True, dtype=bool))
    >>> jaxscale.unscale_and_check(state, jnp.array([2.0**-20, jnp.inf], jnp.float16))
    (Array([9.313226e-10, inf], dtype=float32), Array(False, dtype=bool))
  """
  require_state(state, "unscale_and_check")
  warn_if_constant(state, grads, "unscale_and_check")
  uses = uses_here.get()
  if uses is not None:
    uses["unscale"] += 1
  state = state._replace(floats=_unscaled_by_jaxscale(state.floats))
  return unscale_and_check_unchecked(state, grads, axis_name=axis_name)


def unscale_and_check_unchecked(state: ScalerState, grads: Any, *, axis_name: Any = None) -> tuple[Any, jax.Array]:
  """:func:`unscale_and_check` for callers that validated ``state`` themselves."""
  unscaled = unscale_unchecked(state, grads)
  # The flag is the check of the unscaled gradients, the very expression the Optax wrapper
  # computes on the gradients it is given: when they arrive unchanged, XLA merges the two
  # reductions (common subexpressions), and the step reads the gradients once for both
  # (benchmarks/NOTES.md). inf and NaN survive exact unscaling, and a scale below 1, the only
  # one that can overflow a finite gradient, is caught here as it should be.
  return unscaled, all_finite(unscaled, axis_name=axis_name) | ~state.enabled


def unscale_unchecked(state: ScalerState, grads: Any) -> Any:
  """The gradient sites' unscaling without the check: float16 and bfloat16 leaves widened to
  float32 first, then multiplied by ``1 / scale`` (``find_overflow`` runs it operation by operation)."""
  grads = jax.tree.map(lambda g: jnp.asarray(g, jnp.float32) if _is_narrow(g) else g, grads)
  r1, r2 = _reciprocal_factors(state.scale)
  return jax.tree.map(lambda g: _times(g, r1, r2), grads)


def _is_narrow(x) -> bool:
  return _is_floating(x) and jnp.finfo(jnp.result_type(x)).bits < 32


def _times(x, *factors: jax.Array):
  """``x * factors``, formed in at least float32 and returned in ``x``'s dtype.

  Non-floating leaves are returned as they are.
  """
  if not _is_floating(x):
    return x
  x = jnp.asarray(x)
  wide = _wide(x.dtype)
  product = x.astype(wide)
  for factor in factors:
    product = product * factor.astype(wide)
  return product.astype(x.dtype)


def _reciprocal_factors(scale: jax.Array) -> tuple[jax.Array, jax.Array]:
  """Two normal float32 factors whose product is ``1 / scale``.

  ``1 / scale`` itself is subnormal for scales above 2**126, and XLA flushes
  subnormals to zero. Dividing instead is exact but costs a pass: XLA will not
  duplicate a division into each consumer of the gradients, so it writes the
  unscaled gradients out and reads them back. Two multiplications by normal
  factors fuse into every consumer, and for ``scale = m * 2**e`` they give
  ``g * fl(1/m) * 2**-e``: exactly torch's ``g * fl(1/scale)`` (exact for
  powers of two), and never an intermediate overflow the true quotient lacks.

  Each factor is itself a scalar division (of normal, power-of-two-scaled
  numbers, so ``fl(1 / (m * 2**h)) == fl(1/m) * 2**-h``): XLA computes it once,
  instead of inlining the frexp/ldexp arithmetic into every fusion that
  reads a gradient, which tripled the compile time of an optimizer step.
  """
  mantissa, exponent = jnp.frexp(scale)
  high = exponent - exponent // 2  # ceil(e / 2): r1 <= 1 whenever scale >= 1
  r1 = 1.0 / jnp.ldexp(mantissa, high)
  r2 = 1.0 / _numerics.power_of_two(exponent - high)
  return r1, r2


def all_finite(tree: Any, *, axis_name: Any = None) -> jax.Array:
  """A scalar bool array: every element of every floating leaf of ``tree`` is finite.

  The check :func:`unscale_and_check` makes, for trees that need no unscaling.

  Args:
    tree: any pytree; non-floating leaves are ignored.
    axis_name: inside ``shard_map`` or ``pmap``, the axis (or axes) over which
      every device must agree.

  Returns:
    A scalar bool array: True iff no floating leaf holds an inf or a NaN (on
    any device of ``axis_name``). True for a tree without floating leaves.

  Examples:
    >>> import jax.numpy as jnp, jaxscale
    >>> jaxscale.all_finite({"a": jnp.ones(3), "b": jnp.array([1.0, jnp.inf])})
    Array(False, dtype=bool)
  """
  # `x - x` is 0 for finite x and NaN for inf or NaN, and a sum propagates NaN
  # and cannot overflow (`isfinite(x).all()` writes a bool array of every leaf;
  # `max` drops NaNs on CPU; `x * 0` made XLA:CPU write a broadcast zero out at
  # each leaf shape). Leaves of one size are added elementwise before a single
  # reduction: XLA:GPU emits one or two reduction kernels per reduction, so a
  # sum per leaf cost two kernel launches a leaf, three times the plain Adam
  # step's kernels at 48 leaves. Up to `_LEAVES_PER_REDUCTION` leaves fuse into
  # one reduction kernel; beyond, XLA splits the sum and writes its parts out.
  # Leaves are grouped by shape and never flattened: a flattened leaf sharded on
  # any axis but its first has no sharding the partitioner can keep, and it
  # gathered every gradient to check it; in their own shape, each device sums its
  # shard and one all-reduce of the scalars decides.
  by_shape: dict[tuple, list[jax.Array]] = {}
  for g in jax.tree.leaves(tree):
    if _is_floating(g):
      by_shape.setdefault(np.shape(g), []).append(_nan_unless_finite(jnp.asarray(g)))
  total = jnp.zeros((), jnp.float32)
  for same_shape in by_shape.values():
    for i in range(0, len(same_shape), _LEAVES_PER_REDUCTION):
      chunk = same_shape[i : i + _LEAVES_PER_REDUCTION]
      total = total + jnp.sum(sum(chunk[1:], start=chunk[0]))
  # `total` is 0 or NaN. Left as is, XLA inlines this chain of per-leaf
  # partial sums into every fusion that reads the flag (each select of the
  # optimizer step): compile time then grows with the square of the number
  # of leaves. A division (by 1, in a form XLA cannot fold) is an op it will
  # not duplicate, so the sum is computed once.
  finite = jnp.isfinite(total / (total * 0 + 1))
  if axis_name is not None:
    finite = jax.lax.pmin(finite.astype(jnp.int32), axis_name).astype(jnp.bool_)
  return finite


_LEAVES_PER_REDUCTION = 48


def _nan_unless_finite(g: jax.Array) -> jax.Array:
  """``g`` in float32: 0 where an element is finite, NaN where it is not.

  ``g`` is a JAX array (a NumPy one would compute ``inf - inf`` eagerly, with a
  warning). A complex element is finite iff both parts are: ``inf - inf`` is
  NaN in either part, and both parts are added rather than cast (the cast would
  drop the imaginary part, with a warning).
  """
  flags = g - g
  if jnp.iscomplexobj(flags):
    flags = jnp.real(flags) + jnp.imag(flags)
  return flags.astype(jnp.float32)


def update(state: ScalerState, finite: jax.typing.ArrayLike) -> ScalerState:
  """Returns the next state after a step whose gradients were ``finite``.

  Branch-free, so it jits once whatever the flag, the scale and the options.
  A disabled state is returned unchanged.

  Args:
    state: the scaler state of the step.
    finite: a boolean scalar (a Python bool or a ``bool`` array of shape
      ``()``), such as the flag of :func:`unscale_and_check`. Other dtypes are
      refused rather than converted: a float flag would make NaN count as
      True.

  Returns:
    The next :class:`ScalerState`: after a finite step the growth tracker
    counts up and the scale grows every ``growth_interval`` steps; after a
    non-finite one the step counts as skipped and the scale backs off.

  Raises:
    TypeError: if ``finite`` is not boolean.
    ValueError: if ``finite`` is not a scalar (checked at trace time).

  Examples:
    >>> import jaxscale
    >>> state = jaxscale.update(jaxscale.init(init_scale=1024.0), False)
    >>> float(state.scale), int(state.skipped_steps)
    (512.0, 1)
  """
  require_state(state, "update")
  finite = as_flag(finite) & ~state.stalled
  dynamic = state.dynamic
  spent = jnp.where(dynamic, jnp.maximum(state.hysteresis_tracker - 1, 0), _decrement(state.hysteresis_tracker))
  refilled = jnp.where(dynamic, state.hysteresis_tracker, state.hysteresis)
  hysteresis_left = jnp.where(finite, refilled, spent)
  tracker = jnp.where(finite, optax.safe_increment(state.growth_tracker), 0)
  grow = dynamic & finite & (tracker >= state.growth_interval)
  back_off = dynamic & ~finite & (hysteresis_left == 0)

  grown = state.scale * state.growth_factor
  # torch keeps the scale when growing would overflow float32.
  grown = jnp.where(jnp.isfinite(grown), jnp.minimum(grown, state.max_scale), state.scale)
  # Whatever `min_scale`, the scale stays a normal float32: below 2**-126 XLA
  # flushes it to 0, and 0 * inf = NaN would skip every later step.
  floor = jnp.maximum(state.min_scale, _TINY)
  backed_off = jnp.maximum(state.scale * state.backoff_factor, floor)
  # A static scale is "at its floor" once its overflows in a row past the tolerance are as many as
  # the halvings that would bring it there: where the dynamic default would be by now.
  at_floor = jnp.where(dynamic, state.scale <= floor, jnp.maximum(-hysteresis_left, 0) >= _halvings(state.scale, floor))

  new = dict(
      scale=jnp.where(grow, grown, jnp.where(back_off, backed_off, state.scale)),
      growth_tracker=jnp.where(grow, 0, tracker),
      hysteresis_tracker=jnp.where(grow, state.hysteresis, hysteresis_left),
      skipped_steps=jnp.where(finite, state.skipped_steps, optax.safe_increment(state.skipped_steps)),
      last_skipped=~finite,
      stalled=state.stalled | (state.raise_on_stall & ~finite & at_floor),
  )
  new = {name: jnp.where(state.enabled, value, getattr(state, name)) for name, value in new.items()}
  # The new fields are computed in kernels of their own (the barrier) and written into the packed
  # arrays elementwise (`replace`): so no kernel reads an old array's other slots while it writes
  # the new one over the old one's donated buffer, which made XLA copy all three arrays first
  # (benchmarks/NOTES.md).
  return state.replace(**jax.lax.optimization_barrier(new))


def _decrement(count: jax.Array) -> jax.Array:
  """``count - 1``, saturating at int32's lowest value (a static scale counting overflows)."""
  return jnp.maximum(count, _INT32.min + 1) - 1


def _halvings(scale: jax.Array, floor: jax.Array) -> jax.Array:
  """The fewest halvings that bring ``scale`` to ``floor`` or below (0 if it is there), exactly.

  For ``scale = ms * 2**es`` and ``floor = mf * 2**ef`` (mantissas in [0.5, 1)): ``es - ef``,
  one more when ``ms > mf``. No float division, which would overflow for 2**127 / 2**-126.
  """
  ms, es = jnp.frexp(scale)
  mf, ef = jnp.frexp(floor)
  return jnp.maximum(es - ef + (ms > mf).astype(es.dtype), 0)


def as_flag(finite: Any) -> jax.Array:
  """``finite`` as a bool array of shape (); TypeError/ValueError otherwise."""
  dtype = getattr(finite, "dtype", None)
  if dtype is None and isinstance(finite, (bool, np.bool_)):
    dtype = np.dtype(bool)
  if dtype != np.dtype(bool):
    what = f"an array of dtype {dtype}" if dtype is not None else f"{finite!r} of type {type(finite).__name__}"
    raise TypeError(
        f"`finite` must be a bool scalar (such as the flag of `unscale_and_check`), got {what}; "
        "compare explicitly, e.g. `jnp.isfinite(x).all()`."
    )
  if jnp.shape(finite) != ():
    raise ValueError(
        f"`finite` must be a bool scalar of shape (), got shape {jnp.shape(finite)}; "
        "reduce it first, e.g. with `.all()`."
    )
  return jnp.asarray(finite)


def raise_if_stalled(state: ScalerState) -> None:
  """Raises FloatingPointError if the scaler stalled (see ``on_stall``).

  This reads one bool from the device, so it synchronises with it: call it
  where you already log, not on every step. A batch of scalers (after
  ``jax.vmap``) raises if any of them stalled, naming which.

  Args:
    state: a scaler state, e.g. ``jaxscale.find_scaler(opt_state)``.

  Raises:
    FloatingPointError: if a step overflowed while the scale was already at
      ``min_scale`` and the state was built with ``on_stall="raise"``.

  Examples:
    >>> import jaxscale
    >>> state = jaxscale.init(init_scale=1.0, min_scale=1.0, on_stall="raise")
    >>> jaxscale.raise_if_stalled(state)  # fine so far
    >>> state = jaxscale.update(state, False)  # an overflow at the floor
    >>> jaxscale.raise_if_stalled(state)
    Traceback (most recent call last):
    ...
    FloatingPointError: jaxscale: a step overflowed while the loss scale was already at `min_scale` (1.0); ...
  """
  require_state(state, "raise_if_stalled")
  stalled = np.asarray(jax.device_get(state.stalled))
  if not stalled.any():
    return
  floor = np.maximum(np.asarray(jax.device_get(state.min_scale)), np.float32(_TINY))
  which = ""
  if stalled.shape != ():
    indices = np.flatnonzero(stalled) if stalled.ndim == 1 else np.argwhere(stalled)
    which = f" (scalers {indices.tolist()} of a batch of shape {stalled.shape})"
    floor = np.unique(np.broadcast_to(floor, stalled.shape)[stalled])
  static = ~np.broadcast_to(np.asarray(jax.device_get(state.dynamic)), stalled.shape)
  if static[stalled].all():
    raise FloatingPointError(
        f"jaxscale: the static loss scale (`dynamic=False`){which} overflowed on every step for as "
        "many steps in a row as halving it would take to reach its floor; every step since has been "
        "skipped and the parameters hold their last finite values. Look for the source of the "
        "inf/NaN in the model, or let the scale adapt: `dynamic=True` (the default), or a lower "
        "`init_scale`."
    )
  raise FloatingPointError(
      f"jaxscale: a step overflowed while the loss scale was already at `min_scale` "
      f"({_floor_text(floor)}){which}; every step since has been skipped and the parameters hold "
      "their last finite values. Look for the source of the inf/NaN in the model, or lower "
      "`min_scale`; or, if the loss is scaled by another scaler than this optimizer's (one found "
      "once and reused, or a fresh `jaxscale.init()`), take `jaxscale.find_scaler(opt_state)` "
      "inside each step."
  )


def require_state(state: Any, function: str, hint: str = "") -> None:
  """Raises a TypeError that says what to pass if ``state`` is not a :class:`ScalerState`."""
  if isinstance(state, ScalerState):
    return
  raise TypeError(
      f"`jaxscale.{function}` takes a `ScalerState` (from `jaxscale.init()`), got an object of "
      f"type {type(state).__name__}.{hint} For the scaler inside an optimizer state (of "
      "`dynamic_loss_scaling`, a `TrainState`, an `nnx.Optimizer`), pass "
      "`jaxscale.find_scaler(opt_state)`."
  )


def _floor_text(floor: np.ndarray) -> str:
  """The floor as a number, with "2**-126" named where float32's own floor applies."""
  text = str(_show(floor))
  return f"{text} = 2**-126, the smallest the scale can be" if np.all(floor == np.float32(_TINY)) else text


def _wide(dtype) -> Any:
  """float16 and bfloat16 compute in float32; wider dtypes in themselves."""
  return jnp.float32 if jnp.finfo(dtype).bits < 32 else dtype
