"""The 16-bit steps' TPU v5e programs, held to their targets where they meet them, and to what
they measure where they do not.

Compiled without a TPU by libtpu at jax's version (`benchmarks/gpu_program.py --target tpu-v5e
sixteen --leaves 48`); skipped where libtpu is not installed. Bytes are HBM bytes, read from where
XLA:TPU places each buffer (`gpu_program.tpu_hbm_bytes`), not XLA's "bytes accessed", which counts
the traffic in VMEM too (float32 Adam: 39 bytes a parameter accessed, 28 in HBM). 48 leaves, a real
model's count: at 8, the seeds' scalar kernels add a quarter of a byte a parameter.

Met: every 16-bit row's bytes (the scaler adds one read of the gradients), Kahan's peak, every
16-bit row's allocation (every buffer XLA's buffer assignment allocates, arguments included:
`total_allocation_bytes`), and no copy beyond float32 Adam's. Not met (benchmarks/NOTES.md):
stochastic rounding's peak (0.671x against 0.66) and the float32 master's bytes and peak (its
master is written, then read again for the parameters: 1.429x against 1.22).
"""

import os

import pytest

os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
gpu_program = pytest.importorskip("gpu_program", reason="run from benchmarks/ (nox -s gpu-program)")

try:
  gpu_program.sharding("tpu-v5e")
except RuntimeError as e:
  pytest.skip(str(e), allow_module_level=True)

LEAVES = 48
# The issue's targets, the H100's: bytes and peak (the scaler: one more read of the gradients).
TARGETS = {
    "kahan + bf16 state": {"hbm": 0.72, "peak": 0.80},
    "SR + bf16 state": {"hbm": 0.60},
    "kahan + bf16 state + scaler": {"hbm": 0.87, "peak": 0.80},
    "SR + bf16 state + scaler": {"hbm": 0.75},
    "hand-written Kahan, bf16 state (plain JAX)": {"hbm": 0.72, "peak": 0.76},
}
# Not met: as measured at 48 leaves (jax 0.12.0.1, libtpu 0.0.50.1), plus about 2%.
MEASURED = {
    "SR + bf16 state": {"peak": 0.685},
    "SR + bf16 state + scaler": {"peak": 0.687},
    "float32 master + scaler, bf16 params": {"hbm": 1.46, "peak": 1.18},
}
# The memory the step's buffers take, as XLA's buffer assignment allocates it, against the same
# targets. "peak" above adds XLA:TPU's temporaries figure, about twice that assignment's temporary
# allocation, which grows with the leaves (1000 leaves: Kahan 1.367x, allocated 1.001x): the
# contexts of the copies that stage each leaf's operands in VMEM, 16 KB each (benchmarks/NOTES.md).
ALLOCATED = {
    "kahan + bf16 state": {"allocated": 0.80},
    "SR + bf16 state": {"allocated": 0.66},
    "kahan + bf16 state + scaler": {"allocated": 0.80},
    "SR + bf16 state + scaler": {"allocated": 0.66},
}
ROWS = sorted(TARGETS.keys() | MEASURED.keys())


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


def test_sixteen_bit_steps_on_the_tpu_meet_their_targets(programs):
  base, measured = programs
  found = failures(base, measured, TARGETS, copies=True)
  assert not found, f"{'; '.join(found)} (programs {measured}, float32 Adam {base})"


def test_sixteen_bit_steps_on_the_tpu_allocate_within_their_targets(programs):
  base, measured = programs
  if not base.allocated_bytes:
    pytest.skip("this jax release's memory analysis has no total_allocation_bytes")
  found = failures(base, measured, ALLOCATED)
  assert not found, f"{'; '.join(found)} (programs {measured}, float32 Adam {base})"


def test_what_misses_its_target_on_the_tpu_stays_where_it_measures(programs):
  base, measured = programs
  found = failures(base, measured, MEASURED, copies=True)
  assert not found, f"{'; '.join(found)} (programs {measured}, float32 Adam {base})"
