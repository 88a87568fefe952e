"""The H100 programs of the headline steps, held to their budgets (`nox -s gpu-program`).

Each test compiles steps for an H100 without a GPU (benchmarks/gpu_program.py) and checks what the
program does: kernels launched, HBM bytes, peak memory, copies and FP8 GEMMs, each against the plain
step's program of the same table. A change that adds a kernel per leaf, a pass over the gradients or
a copy of the optimizer state fails here on any machine, with the numbers in the message.
"""

import pytest

gpu_program = pytest.importorskip("gpu_program", reason="run from benchmarks/ (nox -s gpu-program)")

try:
  gpu_program.h100()
except RuntimeError as e:
  pytest.skip(str(e), allow_module_level=True)


def measured(table, title, rows):
  """The programs of `rows` of the table's configuration `title`, the baseline (first row) first."""
  builders = gpu_program.TABLES[table]()[title]
  base = next(iter(builders))
  return gpu_program.measure_table({name: builders[name] for name in (base, *rows)})


def check(program, base, **budget):
  """Each budget: `kernels` (at most base + n), `hbm`, `peak` (ratios at most), `copies`, `fp8_gemms` (exact)."""
  ratios = program.ratios(base)
  failures = []
  if "kernels" in budget and program.kernels > base.kernels + budget["kernels"]:
    failures.append(f"{program.kernels} kernels > {base.kernels} + {budget['kernels']}")
  for key in ("hbm", "peak", "estimate"):
    if key in budget and ratios[key] > budget[key]:
      failures.append(f"{key} {ratios[key]:.3f}x > {budget[key]}x")
  if "copies" in budget and program.copies > budget["copies"]:
    failures.append(f"{program.copies} copies > {budget['copies']}")
  if "fp8_gemms" in budget and program.fp8_gemms != budget["fp8_gemms"]:
    failures.append(f"{program.fp8_gemms} FP8 GEMMs != {budget['fp8_gemms']}")
  assert not failures, f"{'; '.join(failures)} (program {program}, baseline {base})"


# The scaler's fixed cost on top of the plain step: its own update (a few scalar kernels), the
# unscale's reciprocal and the copies of its three packed arrays (3), and the finite check: one
# or two reduction kernels per 48 leaves of one size. A kernel per leaf (48 more) is far over.
# Bytes: one more read of the gradients, 8 passes for Adam's 7 (1.143x), and nothing else.
SCALER_KERNELS = 12


@pytest.mark.parametrize("title", ["Adam step, 32M params / 48 leaves", "float32 MLP step (6 x 1024, batch 128), Adam"])
def test_the_scaler_step_adds_a_fixed_few_kernels_and_one_read_of_the_gradients(title):
  programs = measured("scaler", title, ["jaxscale"])
  plain, ours = programs.values()
  check(ours, plain, kernels=SCALER_KERNELS, hbm=1.15, peak=1.18, copies=plain.copies + 3)


def test_a_thousand_leaves_cost_a_reduction_per_48_leaves_not_per_leaf():
  programs = measured("scaler", "Adam step, 1M params / 1000 leaves", ["jaxscale"])
  plain, ours = programs.values()
  check(ours, plain, kernels=2 * 1000 // 48 + 2 + SCALER_KERNELS, hbm=1.16, peak=1.01)


def test_the_scaler_step_has_fewer_kernels_than_every_peer():
  programs = measured("scaler", "Adam step, 32M params / 48 leaves", ["jaxscale", "jmp+apply_if_finite",
                                                                      "flax DynamicScale"])
  ours = programs.pop("jaxscale")
  peers = {name: p.kernels for name, p in programs.items() if name != "plain"}
  assert ours.kernels < min(peers.values()), f"jaxscale {ours.kernels} kernels, peers {peers}"


# A transformer block's forward and backward. At d 4096 every projection is an FP8 GEMM: four
# forward, and seven backward (the first projection's input gradient is never needed: the step
# differentiates the parameters). Current scaling costs an amax pass per operand, so float8 moves
# a few percent more bytes than bfloat16; the GEMMs at twice the rate bring the estimate to ~0.71x.
# At d 1024 the rule keeps the matmuls too small to gain in bfloat16: never slower than bfloat16.
@pytest.mark.parametrize("title, budget", [
    ("transformer block fwd+bwd, d 4096, seq 2048, batch 4", dict(fp8_gemms=11, hbm=1.10, peak=1.0, estimate=0.72)),
    ("transformer block fwd+bwd, d 1024, seq 1024, batch 4", dict(hbm=1.06, peak=1.0, estimate=1.0)),
])
def test_float8_is_faster_than_bfloat16_where_its_matmuls_are_large(title, budget):
  programs = measured("float8", title, ["mixed_float8"])
  bf16, f8 = programs.values()
  check(f8, bf16, **budget)


# The 16-bit steps: one kernel per leaf that reads parameter, compensation, moments and gradient once
# and writes them once, at any number of leaves. Bytes per parameter, read and written, against float32
# Adam's 28 (parameter 8, moments 16, gradient 4): Kahan + bfloat16 state 20 (0.714x), stochastic
# rounding 16 (0.571x); the scaler adds one read of the float32 gradients (+4: 0.857x, 0.714x); the
# float32 master 32 (bfloat16 parameter 4, master 8, moments 16, gradient 4) and 36 with the scaler
# (1.286x: the parameter is read, as `apply_updates` must). Peaks are the arguments alone (donated
# state, float32 gradients): 12, 10 and 18 bytes against 16. Kernels: at most 1.2x the plain step's
# plus 10 (and the scaler's own): per PRNG key its split, the copy of the donated 8-byte key, and
# two or three scalar kernels of seeds per 64 leaves (one key for Kahan, two for stochastic
# rounding). Before the seeds reached each leaf's kernel as scalars, 48 leaves moved 1.14x float32's
# bytes; before they were hashed 64 leaves at a time, 150 leaves launched 755 kernels.
SIXTEEN = {
    "kahan + bf16 state": {"hbm": 0.72, "peak": 0.76},
    "SR + bf16 state": {"hbm": 0.58, "peak": 0.63},
    "kahan + bf16 state + scaler": {"hbm": 0.86, "peak": 0.76},
    "SR + bf16 state + scaler": {"hbm": 0.72, "peak": 0.63},
    "float32 master + scaler, bf16 params": {"hbm": 1.29, "peak": 1.13},
    "hand-written Kahan, bf16 state (plain JAX)": {"kernels": 0, "hbm": 0.72, "peak": 0.76, "copies": 0},
}


@pytest.mark.parametrize("leaves", [8, 48, 150])
def test_sixteen_bit_steps_move_the_bytes_their_dtypes_imply_at_any_number_of_leaves(leaves):
  title = f"Adam step, 32M params / {leaves} leaves"
  programs = measured("sixteen", title, ["optax.adam(mu_dtype=bfloat16)", *SIXTEEN])
  plain, optax_bf16 = programs.pop("float32 Adam"), programs.pop("optax.adam(mu_dtype=bfloat16)")
  for name, budget in SIXTEEN.items():
    kernels = int(0.2 * plain.kernels) + 10 + (SCALER_KERNELS if "scaler" in name else 0)
    check(programs[name], plain, **{"kernels": kernels, **budget})
  # Like for like (optax's row has no scaler): fewer bytes and a lower peak than its bfloat16 moment.
  for name in ("kahan + bf16 state", "SR + bf16 state"):
    assert programs[name].hbm_bytes < optax_bf16.hbm_bytes and programs[name].peak_bytes < optax_bf16.peak_bytes, name
