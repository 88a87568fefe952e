"""What a training step costs on an H100, read from the program XLA:GPU compiles for it, without a GPU.

jaxscale's performance instrument. Each configuration is traced on shapes only, compiled ahead of
time for an H100 (sm_90) by the real XLA:GPU pipeline (deviceless, through
`jax.experimental.topologies`), and its optimized HLO read. Nothing runs. Per program:

    kernels   launches in the ENTRY computation (fusions, library calls, copies, unfused ops)
    HBM       bytes each kernel reads and writes (its operands and outputs), summed
    copies    `copy` instructions (a copy of a donated buffer is a pass and a buffer more)
    fp8       FP8 GEMMs: cuBLASLt `$f8` calls, and Triton GEMM fusions fed float8 operands
    peak      XLA's memory analysis: arguments + outputs not aliased to them + temporaries
    est       a roofline: per kernel max(bytes / HBM bandwidth, GEMM FLOPs / tensor-core peak) plus
              a launch, summed. HBM 3.35 TB/s and the dense peaks (FP8 1979, BF16 989, TF32 495
              TFLOPS) at 80% and 70% of the datasheet, 0.5 us a launch.

The model's limits: L2 reuse between kernels is ignored (bytes are an upper bound for small
tensors), autotuning is skipped (XLA picks its default GEMM configurations), the launch cost is a
constant, a kernel's bytes count whole operands even where it reads a slice, and cuDNN convolutions
are charged their bytes only (no FLOPs), so a convolution's estimate is a lower bound.

    python benchmarks/gpu_program.py                  # the scaler, sixteen-bit and float8 tables
    python benchmarks/gpu_program.py scaler mlp       # some of them (see --help)
    python benchmarks/gpu_program.py --write-docs     # and regenerate docs/performance.md's tables

Needs the CUDA plugin at jax's version, which compiles for the GPU without one:
`pip install -e ".[gpu-program]"`, in an environment of its own (with it, a CPU-only JAX warns
when it starts).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import math
import os
import re
import sys

os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")  # no driver here: nothing runs
os.environ.setdefault("CUDA_VISIBLE_DEVICES", "-1")  # nor any device to find
if "triton_gemm" not in os.environ.get("XLA_FLAGS", ""):
  # cuBLAS GEMMs by default; XLA_FLAGS=--xla_gpu_enable_triton_gemm=true compiles Triton ones instead.
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_gpu_enable_triton_gemm=false").strip()

import jax
import jax.numpy as jnp
import numpy as np
import optax

import jaxscale

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench  # the CPU benchmark's problems and peers: one definition of each

# A deviceless executable cannot be loaded back from JAX's persistent cache (that needs a device).
jax.config.update("jax_enable_compilation_cache", False)

# An H100 SXM as XLA:GPU's cost model sees it (the fields a real device reports).
H100 = """
gpu_device_info { threads_per_block_limit: 1024 threads_per_warp: 32 shared_memory_per_block: 49152
  shared_memory_per_core: 233472 threads_per_core_limit: 2048 core_count: 132 fpus_per_core: 128
  block_dim_limit_x: 2147483647 block_dim_limit_y: 65535 block_dim_limit_z: 65535
  memory_bandwidth: 3352320000000 l2_cache_size: 52428800 clock_rate_ghz: 1.98
  device_memory_size: 84929347584 shared_memory_per_block_optin: 232448
  cuda_compute_capability { major: 9 } registers_per_core_limit: 65536 registers_per_block_limit: 65536 }
platform_name: "CUDA" dnn_version_info { major: 9 minor: 7 } runtime_version { major: 12 minor: 8 patch: 0 }
device_description_str: "NVIDIA H100 80GB HBM3"
"""
HBM_BYTES_PER_S = 0.8 * 3.35e12
TENSOR_FLOPS = {"f8e4m3fn": 0.7 * 1979e12, "f8e5m2": 0.7 * 1979e12, "bf16": 0.7 * 989e12, "f16": 0.7 * 989e12,
                "f32": 0.7 * 495e12}
LAUNCH_S = 0.5e-6
BYTES = {"pred": 1, "s8": 1, "u8": 1, "f8e4m3fn": 1, "f8e5m2": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2,
         "s32": 4, "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16}
# What does not launch a kernel: views, bookkeeping and values folded into their users.
NO_KERNEL = {"parameter", "constant", "get-tuple-element", "tuple", "bitcast", "after-all", "partition-id",
             "replica-id", "opt-barrier", "add-dependency"}


# ---------------------------------------------------------------- compiling for the H100


@functools.cache
def h100():
  """A sharding on one deviceless H100, or an error that says what to install."""
  try:
    from jax.experimental import topologies

    topology = topologies.get_topology_desc(platform="cuda", target_config=H100, topology="1x1x1")
  except Exception as e:  # the plugin's absence shows as several error types across jax releases
    raise RuntimeError(
        f"compiling for an H100 needs the CUDA plugin at jax's version ({jax.__version__}): "
        "`pip install -e \".[gpu-program]\"` in an environment of its own") from e
  return jax.sharding.NamedSharding(topologies.make_mesh(topology, (1,), ("x",)), jax.sharding.PartitionSpec())


def compile_for_h100(step, *args, donate=(0, 1)):
  """The compiled H100 executable of `jax.jit(step)` on the shapes of `args`."""
  target = h100()
  # Python scalars in a state (a peer's options) are traced as JAX would: weakly typed 32-bit arrays.
  dtype = lambda x: x.dtype if hasattr(x, "dtype") else jnp.asarray(x).dtype
  shapes = jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), dtype(x), sharding=target), args)
  return jax.jit(step, donate_argnums=donate).trace(*shapes).lower().compile()


# ---------------------------------------------------------------- reading the program


@dataclasses.dataclass(frozen=True)
class Program:
  """What one compiled step does on the GPU (see the module docstring for each field)."""

  kernels: int
  hbm_bytes: int
  copies: int
  fp8_gemms: int
  gemms: int
  peak_bytes: int
  estimate_s: float

  def ratios(self, base: Program) -> dict:
    return {"kernels": self.kernels / base.kernels, "hbm": self.hbm_bytes / base.hbm_bytes,
            "peak": self.peak_bytes / base.peak_bytes, "estimate": self.estimate_s / base.estimate_s}


_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%?(?P<name>[\w.\-]+) = (?P<shape>\(.*?\)|\S+) (?P<op>[\w\-]+)\("
                          r"(?P<operands>[^)]*)\)(?P<attributes>.*)$")
_ARRAY = re.compile(r"(\w+)\[([\d,]*)\]")


def array_bytes(shape: str) -> int:
  """Bytes of an HLO shape (`f32[8,128]{1,0}` or a tuple of them); cuBLAS's int8 workspaces left out."""
  total = 0
  for dtype, dims in _ARRAY.findall(shape):
    n = math.prod(int(d) for d in dims.split(",") if d)
    if not (dtype == "s8" and n >= 1 << 20):
      total += n * BYTES.get(dtype, 4)
  return total


def computations(text: str) -> dict[str, list[re.Match]]:
  """Each computation of an HLO module's text, by name, as its parsed instructions ("ENTRY" for the entry)."""
  out, name = {}, None
  for line in text.splitlines():
    header = re.match(r"^(ENTRY )?%?([\w.\-]+) .*\{$", line)
    if header:
      name = "ENTRY" if header.group(1) else header.group(2)
      out[name] = []
    elif name and (m := _INSTRUCTION.match(re.sub(r"/\*.*?\*/", "", line))):
      out[name].append(m)
  return out


def gemm_flops(instruction: re.Match, shapes: dict[str, str]) -> tuple[float, str]:
  """(FLOPs, operand dtype) of a GEMM library call; (0, "") for anything else."""
  contracting = re.search(r'"lhs_contracting_dimensions":\[([^\]]*)\]', instruction["attributes"])
  operands = operand_names(instruction)
  if not contracting or not operands or not (lhs := _ARRAY.match(shapes.get(operands[0], ""))):
    return 0.0, ""
  lhs_dims = [int(d) for d in lhs.group(2).split(",") if d]
  out = _ARRAY.search(instruction["shape"])
  k = math.prod(lhs_dims[int(d.strip('"'))] for d in contracting.group(1).split(",") if d)
  return 2.0 * math.prod(int(d) for d in out.group(2).split(",") if d) * k, lhs.group(1)


def read_program(compiled) -> Program:
  """The kernels, bytes, copies, GEMMs and peak of a compiled GPU executable."""
  comps = computations(compiled.as_text())
  shapes, kernels, moved, copies, fp8, gemms, estimate = {}, 0, 0, 0, 0, 0, 0.0
  for m in comps["ENTRY"]:
    shapes[m["name"]] = m["shape"]
    if m["op"] in NO_KERNEL:
      continue
    kernels += 1
    nbytes = array_bytes(m["shape"]) + sum(array_bytes(shapes.get(o, "")) for o in operand_names(m))
    moved += nbytes
    copies += m["op"] == "copy"
    flops, dtype = gemm_flops(m, shapes) if m["op"] == "custom-call" else (0.0, "")
    called = re.search(r"calls=%([\w.\-]+)", m["attributes"])
    if m["op"] == "fusion" and re.search(r'"kind":"__triton\w*gemm', m["attributes"]) and called:
      # A Triton GEMM (XLA's choice with --xla_gpu_enable_triton_gemm): float8 if fed float8.
      operand_dtypes = [shapes.get(o, "").split("[")[0] for o in operand_names(m)]
      flops, dtype = dot_flops(comps.get(called[1], [])), next((d for d in operand_dtypes if d in BYTES), "f32")
      fp8 += dtype.startswith("f8")
    elif "$f8" in m["attributes"]:
      fp8, dtype = fp8 + 1, "f8e4m3fn"
    gemms += flops > 0
    estimate += max(nbytes / HBM_BYTES_PER_S, flops / TENSOR_FLOPS.get(dtype, TENSOR_FLOPS["f32"])) + LAUNCH_S
  memory = compiled.memory_analysis()
  peak = (memory.argument_size_in_bytes + memory.output_size_in_bytes - memory.alias_size_in_bytes
          + memory.temp_size_in_bytes)
  return Program(kernels, moved, copies, fp8, gemms, int(peak), estimate)


def operand_names(instruction: re.Match) -> list[str]:
  return re.findall(r"%([\w.\-]+)", instruction["operands"])


def dot_flops(body: list[re.Match]) -> float:
  """FLOPs of the `dot` in a GEMM fusion's computation (0 if it holds none)."""
  shapes = {m["name"]: m["shape"] for m in body}
  for m in body:
    contracting = re.search(r"lhs_contracting_dims=\{([\d,]*)\}", m["attributes"])
    if m["op"] == "dot" and contracting and (lhs := _ARRAY.match(shapes.get(operand_names(m)[0], ""))):
      lhs_dims = [int(d) for d in lhs.group(2).split(",") if d]
      out = _ARRAY.search(m["shape"])
      k = math.prod(lhs_dims[int(d)] for d in contracting.group(1).split(",") if d)
      return 2.0 * math.prod(int(d) for d in out.group(2).split(",") if d) * k
  return 0.0


def measure(step, *args, donate=(0, 1)) -> Program:
  return read_program(compile_for_h100(step, *args, donate=donate))


# ---------------------------------------------------------------- the configurations
# Each table maps a row's name to a builder of (step, args, donate); its first row is the baseline.

SCALER_PEERS = ("plain", "jaxscale", "jmp+apply_if_finite", "flax DynamicScale", "mpx", "keras LossScaleOptimizer")


def _bench_rows(builders):
  def row(build):
    params, state, args, step = build()
    return step, (params, state, *args), (0, 1)

  return {name: functools.partial(row, build) for name, build in builders.items()}


def scaler_tables():
  """The optimizer step alone and two full steps: plain optax, jaxscale and its peers (bench.py's)."""
  available = {"mpx": _importable("mpx"), "keras LossScaleOptimizer": bench.import_keras() is not None}
  peers = [v for v in SCALER_PEERS if available.get(v, True)]
  return {
      "Adam step, 8M params / 48 leaves": _bench_rows(bench.optimizer_builders("adam", 8_000_000, 48, peers)),
      "Adam step, 32M params / 48 leaves": _bench_rows(bench.optimizer_builders("adam", 32_000_000, 48, peers)),
      "Adam step, 1M params / 1000 leaves": _bench_rows(bench.optimizer_builders("adam", 1_000_000, 1000, peers)),
      "float16 LM step (width 256, depth 4), Adam": _bench_rows(bench.lm_builders("adam", 256, 4, peers)),
      "float32 MLP step (6 x 1024, batch 128), Adam": _bench_rows(bench.mlp_builders("adam", 1024, 6, peers)),
  }


def sixteen_table(n_params=32_000_000, n_leaves=8):
  """Adam's step with 16-bit parameters or state against float32 Adam's (float32 gradients, donated),
  over `n_leaves` leaves of one size; the last row is the floor: a Kahan step written by hand."""
  shape = (n_params // n_leaves,)
  params32 = [jnp.zeros(shape, jnp.float32)] * n_leaves
  params16 = [jnp.zeros(shape, jnp.bfloat16)] * n_leaves
  adam = lambda: optax.adam(1e-3)
  scaled = lambda inner: jaxscale.dynamic_loss_scaling(inner, init_scale=2.0**15)
  lowp = jaxscale.low_precision_state

  def row(tx, params, with_flag):
    def step(params, state, grads):
      flag = {"finite": jnp.asarray(True)} if with_flag else {}
      updates, state = tx.update(grads, state, params, **flag)
      return optax.apply_updates(params, updates), state

    return lambda: (step, (params, tx.init(params), params32), (0, 1))

  return {
      "float32 Adam": row(adam(), params32, False),
      "optax.adam(mu_dtype=bfloat16)": row(optax.adam(1e-3, mu_dtype=jnp.bfloat16), params32, False),
      "kahan + bf16 state": row(jaxscale.master_weights(lowp(adam()), method="kahan"), params16, False),
      "SR + bf16 state": row(jaxscale.master_weights(lowp(adam()), method="stochastic_rounding"), params16, False),
      "kahan + bf16 state + scaler": row(jaxscale.master_weights(scaled(lowp(adam())), method="kahan"), params16, True),
      "SR + bf16 state + scaler": row(
          jaxscale.master_weights(scaled(lowp(adam())), method="stochastic_rounding"), params16, True),
      "float32 master + scaler, bf16 params": row(jaxscale.master_weights(scaled(adam())), params16, True),
      "hand-written Kahan, bf16 state (plain JAX)": lambda: (hand_written_kahan, (params16, (
          jnp.zeros((), jnp.int32), params16, params16, params16), params32), (0, 1)),
  }


def hand_written_kahan(params, state, grads, lr=1e-3, b1=0.9, b2=0.999, eps=1e-8):
  """The floor of a 16-bit Adam step: bfloat16 parameters, compensation and moments, each read and
  written once, float32 gradients read once; Adam in float32, each new value rounded once to nearest
  (the compensation raw, not in units of the parameter's ulp; the moments to nearest)."""
  count, comp, mu, nu = state
  count = count + 1
  c1, c2 = 1 - b1 ** count.astype(jnp.float32), 1 - b2 ** count.astype(jnp.float32)
  out = []
  for p, c, m, v, g in zip(params, comp, mu, nu, grads):
    m = b1 * m.astype(jnp.float32) + (1 - b1) * g
    v = b2 * v.astype(jnp.float32) + (1 - b2) * g * g
    x = p.astype(jnp.float32) + c.astype(jnp.float32) - lr * (m / c1) / (jnp.sqrt(v / c2) + eps)
    new = x.astype(p.dtype)
    out.append((new, (x - new.astype(jnp.float32)).astype(c.dtype), m.astype(jnp.bfloat16), v.astype(jnp.bfloat16)))
  new_params, comp, mu, nu = ([o[i] for o in out] for i in range(4))
  return new_params, (count, comp, mu, nu)


# The leaf counts of the sixteen tables: the benchmark's 8, and the leaf counts of real models (a
# ResNet50 has 161 parameter leaves, GPT-2 small 148). 1000 leaves is its own, slower table.
SIXTEEN_LEAVES = (8, 48, 150)


def sixteen_tables(leaves=SIXTEEN_LEAVES, n_params=32_000_000):
  return {f"Adam step, {n_params // 1_000_000}M params / {n} leaves": sixteen_table(n_params, n) for n in leaves}


def transformer_block(params, x, *, heads):
  """A pre-norm block: RMS norms, causal self-attention, a 4x GELU MLP."""

  def rms_norm(h):
    return h * jax.lax.rsqrt(jnp.mean(jnp.square(h), axis=-1, keepdims=True) + 1e-6)

  batch, seq, width = x.shape
  q, k, v = jnp.split(rms_norm(x) @ params["qkv"], 3, axis=-1)
  heads_of = lambda t: t.reshape(batch, seq, heads, width // heads)
  attended = jax.nn.dot_product_attention(heads_of(q), heads_of(k), heads_of(v), is_causal=True)
  x = x + attended.reshape(batch, seq, width) @ params["out"]
  return x + jax.nn.gelu(rms_norm(x) @ params["up"]) @ params["down"]


def float8_table(width=4096, seq=2048, batch=4, heads=16):
  """One transformer block's forward and backward under each policy (no optimizer)."""
  shape = lambda *s: jax.ShapeDtypeStruct(s, jnp.float32)
  params = {"qkv": shape(width, 3 * width), "out": shape(width, width), "up": shape(width, 4 * width),
            "down": shape(4 * width, width)}
  x = jax.ShapeDtypeStruct((batch, seq, width), jnp.float32)

  def row(policy):
    block = jaxscale.autocast(functools.partial(transformer_block, heads=heads), policy)
    grad = jax.grad(lambda p, x: jnp.mean(jnp.square(block(p, x).astype(jnp.float32))))
    return lambda: (grad, (params, x), ())

  return {"mixed_bfloat16": row("mixed_bfloat16"), "mixed_float8": row("mixed_float8")}


def conv_table(batch=64, size=32, channels=128, depth=4):
  """A convolution net's gradient (3x3 convolutions, NHWC) under each policy."""
  params = [jax.ShapeDtypeStruct((3, 3, channels, channels), jnp.float32)] * depth
  x = jax.ShapeDtypeStruct((batch, size, size, channels), jnp.float32)

  def net(params, x):
    for w in params:
      x = jax.nn.relu(jax.lax.conv_general_dilated(x, w, (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC")))
    return x

  def row(policy):
    f = jaxscale.autocast(net, policy)
    return lambda: (jax.grad(lambda p, x: jnp.mean(jnp.square(f(p, x).astype(jnp.float32)))), (params, x), ())

  return {"mixed_bfloat16": row("mixed_bfloat16"), "mixed_float8": row("mixed_float8")}


TABLES = {
    "scaler": scaler_tables,
    "sixteen": sixteen_tables,
    # Not in the default run: each of its steps compiles for tens of seconds.
    "sixteen-1000": lambda: sixteen_tables((1000,)),
    "float8": lambda: {"transformer block fwd+bwd, d 4096, seq 2048, batch 4": float8_table(),
                       "transformer block fwd+bwd, d 1024, seq 1024, batch 4": float8_table(1024, 1024),
                       "conv net fwd+bwd, 4 x 3x3x128, 32x32, batch 64": conv_table()},
}


DEFAULT_TABLES = ["scaler", "sixteen", "float8"]


def _importable(module):
  try:
    __import__(module)
  except ImportError:
    return False
  return True


def measure_table(rows) -> dict[str, Program]:
  out = {}
  for name, build in rows.items():
    step, args, donate = build()
    out[name] = measure(step, *args, donate=donate)
  return out


# ---------------------------------------------------------------- reporting


def markdown(title, programs: dict[str, Program]) -> list[str]:
  base = next(iter(programs.values()))
  lines = [f"**{title}**", "",
           "| program | kernels | HBM MB | x | copies | FP8 GEMMs | peak MB | x | estimate ms | x |",
           "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
  for name, p in programs.items():
    r = p.ratios(base)
    lines.append(f"| {name} | {p.kernels} | {p.hbm_bytes / 1e6:.1f} | {r['hbm']:.3f} | {p.copies} | {p.fp8_gemms} | "
                 f"{p.peak_bytes / 1e6:.1f} | {r['peak']:.3f} | {p.estimate_s * 1e3:.3f} | {r['estimate']:.3f} |")
  return lines + [""]


def write_docs(text, path):
  """Replaces what stands between the markers in `path` (docs/performance.md) with `text`."""
  begin, end = "<!-- gpu-program tables -->", "<!-- end gpu-program tables -->"
  with open(path) as f:
    page = f.read()
  if begin not in page or end not in page:
    raise SystemExit(f"{path} has no `{begin}` ... `{end}` markers to write between")
  head, rest = page.split(begin, 1)
  with open(path, "w") as f:
    f.write(head + begin + "\n" + text + "\n" + end + rest.split(end, 1)[1])


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("tables", nargs="*", metavar="TABLE",
                      help=f"which tables: {', '.join(TABLES)} (default: {', '.join(DEFAULT_TABLES)})")
  parser.add_argument("--json", action="store_true", help="print the measurements as JSON")
  parser.add_argument("--write-docs", action="store_true", help="write the tables into docs/performance.md")
  args = parser.parse_args(argv)
  chosen = args.tables or DEFAULT_TABLES
  if unknown := [t for t in chosen if t not in TABLES]:
    parser.error(f"unknown table {', '.join(unknown)}: choose among {', '.join(TABLES)}")
  try:
    h100()  # before any work: say what is missing at once
  except RuntimeError as e:
    parser.exit(1, f"{parser.prog}: {e}\n")
  results = {}
  for table in chosen:
    for title, rows in TABLES[table]().items():
      print(f"compiling: {title}", file=sys.stderr, flush=True)
      results[title] = measure_table(rows)
  if args.json:
    print(json.dumps({t: {n: dataclasses.asdict(p) for n, p in ps.items()} for t, ps in results.items()}, indent=1))
    return
  header = (f"H100 (sm_90) programs, compiled without a GPU by jax {jax.__version__}'s XLA:GPU "
            f"(`python benchmarks/gpu_program.py {' '.join(chosen)}`); x: ratio to the table's first row.")
  text = "\n".join([header, "", *(line for t, ps in results.items() for line in markdown(t, ps))])
  print(text)
  if args.write_docs:
    write_docs(text, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "docs", "performance.md"))


if __name__ == "__main__":
  main()
