"""The H100 programs of the headline steps, held to their budgets (`nox -s gpu-program`).

Each test compiles steps for an H100 without a GPU (benchmarks/gpu_program.py) and checks what the
program does: kernels launched, HBM bytes, peak memory, copies and FP8 GEMMs, each against the plain
step's program of the same table. A change that adds a kernel per leaf, a pass over the gradients or
a copy of the optimizer state fails here on any machine, with the numbers in the message.
"""

import os

import pytest

import jaxscale

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
  """Each budget as `gpu_program.over_budget` reads it, but `fp8_gemms`, which must be exact here."""
  fp8 = budget.pop("fp8_gemms", None)
  failures = gpu_program.over_budget(program, base, **budget)
  if fp8 is not None and program.fp8_gemms != fp8:
    failures.append(f"{program.fp8_gemms} FP8 GEMMs != {fp8}")
  assert not failures, f"{'; '.join(failures)} (program {program}, baseline {base})"


# The scaler's fixed cost on top of the plain step: its own update (a few scalar kernels), the
# unscale's reciprocal, and the finite check: one or two reduction kernels per 48 leaves of one
# size. A kernel per leaf (48 more) is far over. No copy: its three packed arrays are written in
# their donated buffers (before 2026-11-28 XLA copied each of them first).
# Bytes: one more read of the gradients, 8 passes for Adam's 7 (1.143x), and nothing else.
SCALER_KERNELS = 12


@pytest.mark.parametrize("title", ["Adam step, 32M params / 48 leaves", "float32 MLP step (6 x 1024, batch 128), Adam"])
def test_the_scaler_step_adds_a_fixed_few_kernels_and_one_read_of_the_gradients(title):
  programs = measured("scaler", title, ["jaxscale"])
  plain, ours = programs.values()
  check(ours, plain, kernels=SCALER_KERNELS, hbm=1.15, peak=1.18, copies=plain.copies)


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


# Delayed scaling (`autocast(..., delayed=True)`): each tensor's scale from its history, so the cast
# needs no pass of its own and fuses into the tensor's producer; the next step's maximum is read from
# the float8 values (one byte an element) behind an optimization barrier: without it XLA fused the
# cast again into that reduction, which then read the float32 or bfloat16 tensor (the block's
# estimate 0.706x, not 0.679x). Measured 2026-11-28: block 78 kernels (current scaling 83), HBM
# 0.987x, peak 0.972x, 0.679x; GPT-2 small 1188 kernels (1258), 0.968x (0.989x). Neither reaches the
# issue's 0.65x and 0.93x: each tensor still has its maximum's reduction, two kernels. Held in the block's
# and the real models' tests, which compile the delayed rows beside the others.
DELAYED = {
    "transformer block fwd+bwd, d 4096, seq 2048, batch 4": dict(fp8_gemms=11, kernels=31, hbm=1.0, peak=0.98,
                                                                 estimate=0.685),
    "GPT-2-small-shaped step (12 x d 768, seq 1024, batch 8), AdamW": dict(fp8_gemms=75, peak=1.0, estimate=0.97),
}


# A transformer block's forward and backward. At d 4096 every projection is an FP8 GEMM: four
# forward, and seven backward (the first projection's input gradient is never needed: the step
# differentiates the parameters). Current scaling costs an amax pass per operand, so float8 moves
# a few percent more bytes than bfloat16; the GEMMs at twice the rate bring the estimate to ~0.71x.
# Kernels: per quantized tensor (twelve) a partial and a final amax, one scale 2**-k and one cast
# (35 over bfloat16's, measured 2026-11-28); a GEMM adds none (its scales are its operands').
# At d 1024 the rule keeps the matmuls too small to gain in bfloat16: never slower than bfloat16.
@pytest.mark.parametrize("title, budget", [
    ("transformer block fwd+bwd, d 4096, seq 2048, batch 4",
     dict(fp8_gemms=11, kernels=36, hbm=1.10, peak=1.0, estimate=0.71)),
    ("transformer block fwd+bwd, d 1024, seq 1024, batch 4", dict(hbm=1.06, peak=1.0, estimate=1.0)),
])
def test_float8_is_faster_than_bfloat16_where_its_matmuls_are_large(title, budget):
  delayed = "mixed_float8, delayed" in gpu_program.TABLES["float8"]()[title]
  programs = measured("float8", title, ["mixed_float8", *(["mixed_float8, delayed"] if delayed else [])])
  bf16, f8 = programs.pop("mixed_bfloat16"), programs.pop("mixed_float8")
  check(f8, bf16, **budget)
  if delayed:  # at d 4096, delayed scaling too (DELAYED above)
    check(programs["mixed_float8, delayed"], bf16, **DELAYED[title])
    assert programs["mixed_float8, delayed"].kernels < f8.kernels and programs["mixed_float8, delayed"].hbm_bytes < \
        f8.hbm_bytes, (programs, f8)


# The 16-bit steps: one kernel per leaf that reads parameter, compensation, moments and gradient once
# and writes them once, at any number of leaves. Bytes per parameter, read and written, against
# float32 Adam's 28 (parameter 8, moments 16, gradient 4): Kahan + bfloat16 state 20 (0.714x),
# stochastic rounding 16 (0.571x); the scaler adds one read of the float32 gradients (+4: 0.857x,
# 0.714x); the float32 master 32 (bfloat16 parameter 4, master 8, moments 16, gradient 4) and 36 with
# the scaler (1.286x: the parameter is read, as `apply_updates` must). Peaks are the arguments alone
# (donated state, float32 gradients): 12, 10 and 18 bytes against 16. Kernels: at most 1.2x the plain
# step's plus 10 (and the scaler's own): per PRNG key its advance and draw, and two or three scalar
# kernels of seeds per 64 leaves (one key for Kahan, two for stochastic rounding). No copy: the key
# advances in counter mode, elementwise, in place (`jax.random.split`'s new key was copied into the
# donated one). Before the seeds reached each leaf's kernel as scalars, 48 leaves moved 1.14x
# float32's bytes; before they were hashed 64 leaves at a time, 150 leaves launched 755 kernels.
SIXTEEN = {
    "kahan + bf16 state": {"hbm": 0.72, "peak": 0.76, "copies": 0},
    "SR + bf16 state": {"hbm": 0.58, "peak": 0.63, "copies": 0},
    "kahan + bf16 state + scaler": {"hbm": 0.86, "peak": 0.76, "copies": 0},
    "SR + bf16 state + scaler": {"hbm": 0.72, "peak": 0.63, "copies": 0},
    "float32 master + scaler, bf16 params": {"hbm": 1.29, "peak": 1.13, "copies": 0},
    "hand-written Kahan, bf16 state (plain JAX)": {"kernels": 0, "hbm": 0.72, "peak": 0.76, "copies": 0},
}


# 150 leaves compiles for two and a half minutes on a 2-core machine: CI holds 8 and 48, and
# JAXSCALE_SIXTEEN_LEAVES=150 (or `gpu_program.py sixteen --leaves 150 1000`) measures more.
MORE_LEAVES = [int(n) for n in os.environ.get("JAXSCALE_SIXTEEN_LEAVES", "").split(",") if n]


@pytest.mark.parametrize("leaves", [8, 48, *MORE_LEAVES])
def test_sixteen_bit_steps_move_the_bytes_their_dtypes_imply_at_any_number_of_leaves(leaves):
  builders = gpu_program.sixteen_table(n_leaves=leaves)
  rows = ("float32 Adam", "optax.adam(mu_dtype=bfloat16)", *SIXTEEN)
  programs = gpu_program.measure_table({name: builders[name] for name in rows})
  plain, optax_bf16 = programs.pop("float32 Adam"), programs.pop("optax.adam(mu_dtype=bfloat16)")
  for name, budget in SIXTEEN.items():
    kernels = int(0.2 * plain.kernels) + 10 + (SCALER_KERNELS if "scaler" in name else 0)
    check(programs[name], plain, **{"kernels": kernels, **budget})
  # Like for like (optax's row has no scaler): fewer bytes and a lower peak than its bfloat16 moment.
  for name in ("kahan + bf16 state", "SR + bf16 state"):
    assert programs[name].hbm_bytes < optax_bf16.hbm_bytes and programs[name].peak_bytes < optax_bf16.peak_bytes, name


# The real models' full training steps (benchmarks/models.py: Flax layers, AdamW) against bfloat16's.
# Full shapes: on the 2-core machine each step compiled in under 40 s (GPT-2 small 10 s and 27 s, d 4096
# 5 s and 6 s, ResNet50 17 s and 35 s, bfloat16 and float8), about 100 s for the three.
# Counted from the model: GPT-2 small keeps its attention (intensity 367 for a 768 x 768 projection of
# 8192 tokens, 57 for its heads' products) in bfloat16; its MLP (571) and the tied logits (692) run in
# float8: 25 forward GEMMs and 50 backward (both gradients of each: every MLP input is an activation).
# At d 4096 every projection and the logits do, 13 forward and 26 backward. Quantizing costs an amax and
# a cast pass per operand: GPT-2 small's estimate is 0.989x bfloat16's since the rule pads the 50257-wide
# logits' operands before their cast (1.0105x before: XLA padded the float8 gradient after, twice), and
# "mixed_float8" is never slower than "mixed_bfloat16" (1.0 the budget); d 4096's 0.745x (0.759x before).
MODELS = {
    "GPT-2-small-shaped step (12 x d 768, seq 1024, batch 8), AdamW": dict(fp8_gemms=75, peak=1.0, estimate=1.0),
    "Transformer step, 2 x d 4096, mlp 16384, seq 2048, batch 4, AdamW": dict(fp8_gemms=39, peak=1.0, estimate=0.76),
}


def compiled_rows(table, title):
  """Each row's compiled H100 executable, the baseline first."""
  out = {}
  for name, build in gpu_program.TABLES[table]()[title].items():
    step, args, donate = build()
    out[name] = gpu_program.compile_for_h100(step, *args, donate=donate)
  return out


@pytest.mark.parametrize("title", list(MODELS))
def test_real_models_run_their_large_matmuls_as_fp8_gemms_and_the_compiled_report_finds_each(title):
  rows = compiled_rows("models", title)
  bf16, f8 = rows.pop("mixed_bfloat16"), rows.pop("mixed_float8")
  check(gpu_program.read_program(f8), gpu_program.read_program(bf16), **MODELS[title])
  if "mixed_float8, delayed" in rows:  # GPT-2 small with delayed scaling too (DELAYED above)
    delayed = gpu_program.read_program(rows["mixed_float8, delayed"])
    check(delayed, gpu_program.read_program(bf16), **DELAYED[title])
    assert delayed.estimate_s < gpu_program.read_program(f8).estimate_s, (delayed, f8)
  # jaxscale's reading of the program against the instrument's: every GEMM asked for in float8 is one.
  report = jaxscale.compiled_report(f8)
  assert report.float8_gemms == report.asked_float8 == MODELS[title]["fp8_gemms"] and report.not_float8 == ()
  assert jaxscale.compiled_report(bf16).float8_gemms == jaxscale.compiled_report(bf16).asked_float8 == 0


def test_resnet50_under_float8_is_bfloat16s_program_and_says_so_at_trace_time():
  """Every convolution is below three times 512 (its forward product alone gains): the stem's 7x7 has
  intensity 124, the largest, a 3x3 of 512 channels at 7x7, 1328, and the classifier (2048 x 1000, 64 images) 58."""
  with pytest.warns(UserWarning, match=r"runs none of its 54 matmuls in float8 \(54 for 'intensity'\)"):
    bf16, f8 = compiled_rows("models", "ResNet50 step (224x224, batch 64), AdamW").values()
  assert gpu_program.read_program(f8) == gpu_program.read_program(bf16)
  assert jaxscale.compiled_report(f8).asked_float8 == 0 and jaxscale.compiled_report(f8).float8_gemms == 0


# The d 4096 step over 4 microbatches of one sequence (gradients summed by a `lax.scan`): XLA:GPU hoists
# nothing out of the loop, so each microbatch quantizes every weight again (an amax and a cast pass, 10
# bytes a float32 parameter): 0.812x bfloat16's estimate. With `autocast(..., weights=params)` built in
# the step, each weight's float8 copy is made once, before the loop: 0.764x, fewer kernels and bytes, the
# same 132 FP8 GEMMs (33 a microbatch), the peak within bfloat16's (the copies live through the loop).
# `"mixed_bfloat16"` casts each float32 weight once a microbatch the same way: with `weights=`, 0.965x its
# own estimate, 36 kernels fewer, its peak 1.3% higher (the bfloat16 copies).
def test_a_step_over_microbatches_quantizes_each_weight_once_given_the_weights():
  title = "Transformer step, 2 x d 4096, 4 microbatches of 1 x 2048, AdamW"
  bf16, each, once, bf16_once = (gpu_program.read_program(c) for c in compiled_rows("accumulation", title).values())
  check(each, bf16, fp8_gemms=132, estimate=0.82, peak=1.0)
  check(once, bf16, fp8_gemms=132, estimate=0.77, peak=1.0)
  assert once.kernels < each.kernels and once.hbm_bytes < each.hbm_bytes, (once, each)
  check(bf16_once, bf16, fp8_gemms=0, estimate=0.97, peak=1.02, kernels=-1)


# An MLP's gradient (d 4096, 1024 tokens a GPU) on 8 H100s, float32 parameters. Its weight gradients
# are 2 x 4096 x 16384 values: 536.9 MB in float32, 268.4 MB in bfloat16, added across devices by
# an all-reduce (data parallel) or a reduce-scatter (FSDP) in the policy's `reduce_dtype` (float32
# by default, as the float32 step does), never in a dtype the policy did not name. FSDP gathers each
# parameter in the dtype its matmul reads (bfloat16; float8_e4m3fn under "mixed_float8", with the
# e5m2 gradients the partitioner gathers beside it), never in float32.
REDUCED = {"float32": "f32", "mixed_bfloat16": "f32", "mixed_bfloat16, reduce=bfloat16": "bf16",
           "mixed_float8": "f32", "mixed_float8, reduce=bfloat16": "bf16"}
GATHERED = {"float32": {"f32"}, "mixed_bfloat16": {"bf16"}, "mixed_bfloat16, reduce=bfloat16": {"bf16"},
            "mixed_float8": {"f8e4m3fn", "f8e5m2"}, "mixed_float8, reduce=bfloat16": {"f8e4m3fn", "f8e5m2"}}
WEIGHT_GRADIENT_BYTES = {"f32": 2 * 4096 * 16384 * 4, "bf16": 2 * 4096 * 16384 * 2}


@pytest.mark.parametrize("layout", ["data parallel", "fsdp"])
def test_gradients_cross_eight_gpus_in_the_reduce_dtype_and_parameters_in_the_matmuls(layout):
  title = f"MLP gradient on 8 H100s, {layout}, d 4096, 1024 tokens a GPU"
  programs = measured("reduce", title, [name for name in REDUCED if name != "float32"])
  for name, program in programs.items():
    reduced = {dtype: n for op, dtype, n in program.collectives if op != "all-gather"}
    # float8's scales add a few scalar all-reduces of float32 absolute maxima: 4 bytes each.
    assert {dtype for dtype, n in reduced.items() if n >= 1024} == {REDUCED[name]}, (name, program.collectives)
    # FSDP reduce-scatters one weight's gradient, and computes the other's where it is stored, from
    # activations it gathers (the partitioner's choice).
    expected = WEIGHT_GRADIENT_BYTES[REDUCED[name]] // (2 if layout == "fsdp" else 1)
    assert 0 <= reduced[REDUCED[name]] - expected < 1024, (name, program.collectives)
    gathered = {dtype for op, dtype, n in program.collectives if op == "all-gather"}
    assert gathered == (GATHERED[name] if layout == "fsdp" else set()), (name, program.collectives)

