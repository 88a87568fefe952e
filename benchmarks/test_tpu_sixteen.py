"""The 16-bit steps' TPU v5e programs, held to what they measure and, strictly expected to fail, to their targets.

Compiled without a TPU by libtpu at jax's version (`benchmarks/gpu_program.py --target tpu-v5e sixteen`);
skipped where libtpu is not installed. Bytes are XLA:TPU's own cost analysis ("bytes accessed"),
which counts more than the H100 reading's operands and outputs: float32 Adam "accesses" 39 bytes
per parameter where it reads and writes 28, and the Kahan step written by hand in plain JAX
(`gpu_program.hand_written_kahan`, 20 bytes read and written) 38.5, 0.99x float32 Adam's.

The 16-bit rows do not meet their targets on the TPU (benchmarks/NOTES.md): XLA:TPU moves each of
their 16-bit operands through four asynchronous slices and a `ConcatBitcast` and copies the donated
moments, where the hand-written step is one fusion per leaf. The first test holds them to what
they measure now (a regression fails it); the second states the targets and is expected to fail
until that is fixed.
"""

import os

import pytest

os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
gpu_program = pytest.importorskip("gpu_program", reason="run from benchmarks/ (nox -s gpu-program)")

try:
  gpu_program.sharding("tpu-v5e")
except RuntimeError as e:
  pytest.skip(str(e), allow_module_level=True)

LEAVES = 8
ROWS = ["kahan + bf16 state", "SR + bf16 state", "hand-written Kahan, bf16 state (plain JAX)"]
# As measured at 8 leaves (jax 0.12.0.1, libtpu 0.0.50.1), plus about 3%: ratios to float32 Adam's.
MEASURED = {
    "kahan + bf16 state": {"hbm": 2.64, "peak": 0.89},
    "SR + bf16 state": {"hbm": 1.69, "peak": 0.66},
    "hand-written Kahan, bf16 state (plain JAX)": {"hbm": 1.02, "peak": 0.76},
}
# The issue's targets, the H100's: bytes and peak, and no copy beyond float32 Adam's.
TARGETS = {"kahan + bf16 state": {"hbm": 0.72, "peak": 0.80}, "SR + bf16 state": {"hbm": 0.60, "peak": 0.66}}


@pytest.fixture(scope="module")
def programs():
  builders = gpu_program.sixteen_table(32_000_000, LEAVES)
  measured = gpu_program.measure_table({name: builders[name] for name in ("float32 Adam", *ROWS)}, "tpu-v5e")
  return measured.pop("float32 Adam"), measured


def failures(base, programs, budgets, copies=False):
  out = []
  for name, budget in budgets.items():
    ratios = programs[name].ratios(base)
    out += [f"{name}: {key} {ratios[key]:.3f}x > {limit}x" for key, limit in budget.items() if ratios[key] > limit]
    if copies and programs[name].copies > base.copies:
      out.append(f"{name}: {programs[name].copies} copies > float32 Adam's {base.copies}")
  return out


def test_sixteen_bit_steps_on_the_tpu_stay_where_they_measure(programs):
  base, measured = programs
  found = failures(base, measured, MEASURED)
  assert not found, f"{'; '.join(found)} (programs {measured}, float32 Adam {base})"


@pytest.mark.xfail(strict=True, reason="XLA:TPU slices and copies the 16-bit operands (benchmarks/NOTES.md)")
def test_sixteen_bit_steps_on_the_tpu_meet_their_targets(programs):
  base, measured = programs
  found = failures(base, measured, TARGETS, copies=True)
  assert not found, f"{'; '.join(found)} (programs {measured}, float32 Adam {base})"
