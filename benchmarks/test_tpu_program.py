"""The TPU programs of the headline steps, held to their budgets (`nox -s tpu-program`).

Each test compiles steps for one chip of a TPU v5e, v5p or v6e without a TPU (benchmarks/gpu_program.py
`--target`, libtpu at jax's version) and checks what XLA:TPU makes of them: kernels, XLA:TPU's own
"bytes accessed", peak memory, and matmuls fed float8, each against the plain step of the same table.
The failure message gives the numbers. Without libtpu (Python 3.11, or no `tpu-program` extra) every
test skips, saying what to install.
"""

import pytest

gpu_program = pytest.importorskip("gpu_program", reason="run from benchmarks/ (nox -s tpu-program)")

try:
  gpu_program.sharding("tpu-v5e")
except RuntimeError as e:
  pytest.skip(str(e), allow_module_level=True)

TPUS = list(gpu_program.TPUS)


def measured(table, title, rows, target):
  """The programs of `rows` of the table's configuration `title` for `target`, the baseline (first row) first."""
  builders = gpu_program.TABLES[table]()[title]
  base = next(iter(builders))
  return gpu_program.measure_table({name: builders[name] for name in (base, *rows)}, target=target)


def check(program, base, **budget):
  failures = gpu_program.over_budget(program, base, **budget)
  assert not failures, f"{'; '.join(failures)} (program {program}, baseline {base})"


# The scaler on top of Adam: one more read of the gradients (8 passes for Adam's 7 in a floor model,
# 1.143x; XLA:TPU's own count of plain Adam's bytes is 40 to 44 a parameter, so its ratio is lower)
# and a fixed few kernels: the finite check's reduction, the scaler's update on its three packed
# arrays (their slices, selects and the copies of the three, as on the H100); 16 and 17 measured on
# v5e, v5p and v6e. A kernel per leaf (48 more) or a copy of the donated moments is far over.
SCALER_KERNELS = 18

@pytest.mark.parametrize("target", TPUS)
def test_the_scaler_step_adds_one_read_of_the_gradients(target):
  programs = measured("adam", "Adam step, 32M params / 48 leaves", ["jaxscale"], target)
  plain, ours = programs.values()
  check(ours, plain, kernels=SCALER_KERNELS, hbm=1.15, peak=1.18, copies=plain.copies + 3)


# No TPU before Ironwood has a float8 matrix unit: under "mixed_float8" the matmuls run in bfloat16,
# decided where the program is lowered, so the program is "mixed_bfloat16"'s (within 2%: none of its
# quantization left), and no matmul is fed float8. Float16 costs what bfloat16 costs: XLA:TPU feeds
# the float16 operands to the matmul as they are, with no conversion pass in HBM.
@pytest.mark.parametrize("target", TPUS)
def test_float8_and_float16_cost_what_bfloat16_costs(target):
  programs = measured("mlp", "MLP fwd+bwd, d 1024, 4096 tokens", ["mixed_float16", "mixed_float8"], target)
  bf16 = programs.pop("mixed_bfloat16")
  for name, program in programs.items():
    assert program.kernels <= 1.02 * bf16.kernels, (name, program, bf16)
    check(program, bf16, hbm=1.02, peak=1.02, fp8_gemms=0)


def test_the_recommended_policy_for_each_tpu_is_bfloat16():
  """On the device objects libtpu describes (device kinds "TPU v5 lite", "TPU v5", "TPU v6 lite")."""
  import jaxscale

  for target in TPUS:
    device = gpu_program.sharding(target).mesh.devices.flat[0]
    assert jaxscale.recommended_policy(device) == jaxscale.get_policy("mixed_bfloat16"), device.device_kind
    assert (jaxscale.supports_bfloat16(device), jaxscale.supports_float16(device)) == (True, False)
