"""The compiled program's matmuls: what XLA emitted, read from the optimized HLO of a compiled step.

`precision_report` reads the jaxpr: what autocast asked for. XLA decides the rest, and may run a
matmul asked for in float8 as a wider one (a backend with no float8 GEMM converts the operands
first). ``compiled_report(compiled)`` reads the program XLA compiled (a ``jax.stages.Compiled``,
or its ``as_text()``) and counts, in every computation of the module::

    GEMM      a matmul or convolution library call (cuBLAS, cuBLASLt, cuDNN custom calls), a
              Triton GEMM fusion, or a `dot` / `convolution` instruction left to the backend
    dtype     the dtype of its operands as the GEMM takes them ("float8_e5m2" if either is, as
              in `precision_report`); a Triton GEMM's are those of the `dot` it fuses
    float8    a GEMM that takes float8 operands: cuBLASLt's `$f8` calls, Triton GEMMs fed float8
    asked     a GEMM of a scaled float8 product of `autocast` (its ``op_name`` metadata holds
              the name scope `_float8.SCALED`, forward and backward), or a float8 GEMM with no
              ``op_name`` at all (XLA drops the metadata of some GEMMs it rewrites)

An instruction in a loop body counts once: the counts are of the program's text, not of its runs.
"""

from __future__ import annotations

import dataclasses
import re
from collections import Counter
from typing import Any

from jaxscale import _float8

# HLO's element type names, as NumPy (ml_dtypes) names them.
_DTYPES = {
    "f8e4m3fn": "float8_e4m3fn", "f8e5m2": "float8_e5m2", "f8e4m3": "float8_e4m3", "f8e5m2fnuz": "float8_e5m2fnuz",
    "f8e4m3fnuz": "float8_e4m3fnuz", "f8e4m3b11fnuz": "float8_e4m3b11fnuz", "f8e3m4": "float8_e3m4",
    "bf16": "bfloat16", "f16": "float16", "f32": "float32", "f64": "float64", "s8": "int8", "u8": "uint8",
    "s32": "int32", "c64": "complex64", "c128": "complex128",
}  # fmt: skip
# The library calls that are a GEMM or a convolution: cuBLAS(Lt) and hipBLAS(Lt) matmuls, cuDNN and
# MIOpen convolutions.
_LIBRARY_GEMM = re.compile(r"^__(cublas|hipblas|cudnn\$conv|miopen)")
_INSTRUCTION = re.compile(
    r"^\s*(?:ROOT\s+)?%?(?P<name>[\w.\-]+) = (?P<shape>\(.*?\)|\S+) (?P<op>[\w\-]+)\((?P<operands>[^)]*)\)"
    r"(?P<attributes>.*)$"
)
_HEADER = re.compile(r"^(?:ENTRY )?%?(?P<name>[\w.\-]+) .*\{$")


@dataclasses.dataclass(frozen=True)
class CompiledReport:
  """The GEMMs of a compiled program, by dtype, and how many of those asked for in float8 run in it.

  Attributes:
    gemms: operand dtype name -> how many GEMMs (matmul and convolution library calls, Triton GEMM
      fusions, `dot` and `convolution` instructions) take operands of that dtype.
    float8_gemms: how many GEMMs take float8 operands (cuBLASLt's ``$f8`` calls on an H100).
    asked_float8: how many GEMMs belong to a scaled float8 product of :func:`autocast` (a float8
      policy's matmuls that its size rule let through), forward and backward.
    not_float8: the ``op_name`` (the model's layer path) of each GEMM asked for in float8 that
      XLA emitted in a wider dtype, with that dtype.

  Examples:
    >>> import jax, jax.numpy as jnp, jaxscale
    >>> compiled = jax.jit(lambda x: x @ x).lower(jnp.ones((64, 64))).compile()
    >>> jaxscale.compiled_report(compiled).gemms
    {'float32': 1}
  """

  gemms: dict[str, int]
  float8_gemms: int
  asked_float8: int
  not_float8: tuple[str, ...] = ()

  def __str__(self) -> str:
    total = sum(self.gemms.values())
    kinds = ", ".join(f"{name} {n}" for name, n in sorted(self.gemms.items(), key=lambda item: -item[1]))
    lines = [f"GEMMs in the compiled program: {total} ({kinds or 'none'})"]
    emitted = self.asked_float8 - len(self.not_float8)
    lines.append(f"float8: {self.float8_gemms} GEMMs; {emitted} of the {self.asked_float8} asked for in float8")
    for op_name in self.not_float8[:5]:
      lines.append(f"  not float8: {op_name}")
    if len(self.not_float8) > 5:
      lines.append(f"  ... and {len(self.not_float8) - 5} more")
    return "\n".join(lines)


def compiled_report(compiled: Any) -> CompiledReport:
  """The GEMMs that XLA emitted in a compiled program, and which of them run in float8.

  Proof that float8 runs: under ``"mixed_float8"``, every matmul the size rule lets through asks
  for float8 (``precision_report`` counts them in the jaxpr), and this reads whether XLA kept it
  so (on an H100, a cuBLASLt ``$f8`` GEMM) or ran it wider (a backend with no float8 GEMM, such as
  XLA:CPU, converts the operands first).

  Args:
    compiled: a ``jax.stages.Compiled`` (``jax.jit(f).lower(*args).compile()``, or compiled ahead
      of time for a device this machine lacks), or the text of its optimized HLO
      (``compiled.as_text()``).

  Returns:
    A :class:`CompiledReport`.

  Raises:
    TypeError: for anything else (a ``Lowered`` program: XLA has not chosen its GEMMs yet).

  Examples:
    >>> import jax, jax.numpy as jnp, jaxscale
    >>> policy = jaxscale.get_policy("p=f32,c=bf16,o=f32,m=f8,min_intensity=0")
    >>> loss = jaxscale.autocast(lambda w, x: jnp.sum(jnp.tanh(x @ w)), policy)
    >>> step = jax.jit(jax.grad(loss)).lower(jnp.ones((64, 64)), jnp.ones((32, 64))).compile()
    >>> report = jaxscale.compiled_report(step)  # XLA:CPU: no float8 GEMM, float32 ones instead
    >>> report.asked_float8, report.float8_gemms, report.gemms
    (2, 0, {'float32': 2})
  """
  if isinstance(compiled, str):
    text = compiled
  elif hasattr(compiled, "as_text") and hasattr(compiled, "memory_analysis"):  # a jax.stages.Compiled
    text = compiled.as_text()
  else:
    raise TypeError(
        "`compiled_report` reads a compiled program: `jax.jit(f).lower(*args).compile()` or its "
        f"`.as_text()`; got {type(compiled).__name__}. (A `Lowered` program has not been through "
        "XLA yet: call `.compile()` on it.)"
    )
  gemms: Counter = Counter()
  float8, asked, not_float8 = 0, 0, []
  computations = _computations(text)
  inside_triton = {called for body in computations.values() for m in body if _is_triton_gemm(m)
                   for called in _called(m)}  # fmt: skip
  for name, body in computations.items():
    if name in inside_triton:  # counted once, as its fusion
      continue
    shapes = {m["name"]: m["shape"] for m in body}
    for m in body:
      if not _is_gemm(m):
        continue
      dtype = _gemm_dtype(m, shapes, computations)
      gemms[dtype] += 1
      is_float8 = dtype.startswith("float8")
      float8 += is_float8
      op_name = re.search(r'op_name="([^"]*)"', m["attributes"])
      # A float8 GEMM whose metadata XLA dropped (seen where it rewrote the weight gradient of a tied
      # embedding) can only have come from a scaled float8 product: it counts as asked.
      if (op_name and _float8.SCALED in op_name[1]) or (is_float8 and not op_name):
        asked += 1
        if not is_float8 and op_name:
          not_float8.append(f"{op_name[1]} ({dtype})")
  return CompiledReport(dict(gemms), float8, asked, tuple(not_float8))


def _computations(text: str) -> dict[str, list[re.Match]]:
  """Each computation of the HLO module's text, by name, as its parsed instructions."""
  out: dict[str, list[re.Match]] = {}
  body: list[re.Match] | None = None
  for line in text.splitlines():
    header = _HEADER.match(line)
    if header and "=" not in line.split("{")[0].split("(")[0]:
      body = out.setdefault(header["name"], [])
    elif body is not None and (m := _INSTRUCTION.match(re.sub(r"/\*.*?\*/", "", line))):
      body.append(m)
  return out


def _is_triton_gemm(m: re.Match) -> bool:
  return m["op"] == "fusion" and re.search(r'"kind":"__triton\w*gemm', m["attributes"]) is not None


def _called(m: re.Match) -> list[str]:
  return re.findall(r"calls=%?([\w.\-]+)", m["attributes"])


def _is_gemm(m: re.Match) -> bool:
  if m["op"] == "custom-call":
    target = re.search(r'custom_call_target="([^"]*)"', m["attributes"])
    return target is not None and _LIBRARY_GEMM.match(target[1]) is not None
  return m["op"] in ("dot", "convolution") or _is_triton_gemm(m)


def _gemm_dtype(m: re.Match, shapes: dict[str, str], computations: dict[str, list[re.Match]]) -> str:
  """The dtype name of the GEMM's first two operands (float8_e5m2 if either is e5m2); a Triton GEMM's
  are those of the `dot` it fuses, which may read a constant or a broadcast in place of an operand."""
  if _is_triton_gemm(m):
    body = [i for called in _called(m) for i in computations.get(called, [])]
    dot = next((i for i in body if i["op"] == "dot"), None)
    if dot is not None:
      return _gemm_dtype(dot, {i["name"]: i["shape"] for i in body}, computations)
  operands = _operand_names(m["operands"])
  names = [_DTYPES.get(shapes.get(o, "").lstrip("(").split("[")[0], "") for o in operands[:2]]
  names = [n for n in names if n]
  if not names:
    return "unknown"
  return _float8.BACKWARD.name if _float8.BACKWARD.name in names else names[0]


def _operand_names(operands: str) -> list[str]:
  """The names in an instruction's operand list: ``%a, %b``, or with shapes, ``f32[2,3]{1,0} %a, ...``."""
  if "%" in operands:
    return re.findall(r"%([\w.\-]+)", operands)
  parts = re.split(r",\s*(?![^\[\{]*[\]\}])", operands)  # commas outside a shape's brackets
  return [part.split()[-1] for part in parts if part.strip()]
