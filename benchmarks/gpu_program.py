"""What a training step costs on an H100 or a TPU, read from the program XLA compiles for it, without one.

jaxscale's performance instrument. Each configuration is traced on shapes only, compiled ahead of
time for the target (`--target`: an H100, sm_90, by the real XLA:GPU pipeline; or one chip of a TPU
v5e, v5p or v6e by XLA:TPU, libtpu's compiler), deviceless through `jax.experimental.topologies`,
and its optimized HLO read. Nothing runs. Per H100 program:

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

Per TPU program (`--target tpu-v5e`, `tpu-v5p`, `tpu-v6e`):

    kernels   the ENTRY computation's fusions, convolutions, copies in HBM (`copy`, `copy-start`),
              custom calls but ConcatBitcast (it joins slices already in VMEM) and unfused ops on
              arrays; not the unfused scalar ops between them (the scalar unit's) nor the DMAs
              between HBM and VMEM (`slice-start`, a `copy-start` into VMEM or out of it)
    copies    the HBM copies among them
    HBM       bytes read from and written to HBM: each kernel's operands and outputs that live in
              HBM (no memory space in their layout; `S(1)` is VMEM), and each DMA between HBM and
              VMEM once, for the side in HBM
    accessed  XLA:TPU's own figure: its cost analysis' "bytes accessed", summed over the program;
              it counts every operation's operands and outputs wherever they live, VMEM included,
              so a program whose operands XLA prefetches into VMEM shows more than it moves
              (float32 Adam: 39 bytes a parameter accessed, 28 in HBM)
    peak      as above, from XLA:TPU's memory analysis
    est       a roofline for the whole program: max(HBM / HBM bandwidth, FLOPs / bfloat16 peak),
              with XLA's FLOPs, at the datasheet figures (no derating, no launch cost)
    compile   wall seconds of trace + lower + compile (every target; the H100 tables leave it out)

The sixteen tables (`sixteen`, `sixteen-gpt`) add, on every target, the compile time in CPU seconds of
this process (all of XLA's threads: a shared machine's load changes it less than wall time) and its
ratio to the table's first row, compiled in the same run: float32 Adam's, or the `"mixed_bfloat16"`
step's for the GPT-2-small-shaped training step with bfloat16 parameters.

The per-chip figures (bfloat16 / int8 peaks, HBM bandwidth) are Google's Cloud TPU pages'
(docs.cloud.google.com/tpu/docs/v5e, /v5p-training, /v6e; read 2026-11-28): v5e 197 / 393 TOPS and
819 GB/s, v5p 459 and 2765 GB/s (its page gives float8 at bfloat16's 459 and no int8; 918 is the
figure quoted elsewhere), v6e 918 / 1836 and 1640 GB/s. The TPU model's limits: the HBM bytes are
read from XLA's placement of each buffer, not measured, and "accessed" is XLA's cost model's traffic;
the program-wide roofline assumes that compute and memory overlap perfectly, so it is a lower
bound; int8 peaks are listed, never used (no table has int8 matmuls); the 1x1 topologies are one
chip (v5p's two TensorCores as one device).

    python benchmarks/gpu_program.py                  # the scaler, sixteen-bit and float8 tables
    python benchmarks/gpu_program.py scaler mlp       # some of them (see --help)
    python benchmarks/gpu_program.py models           # real models' training steps (benchmarks/models.py)
    python benchmarks/gpu_program.py sixteen --leaves 8 48 150 1000   # the 16-bit steps at these leaf counts
    python benchmarks/gpu_program.py sixteen-gpt      # the 16-bit GPT-2-small-shaped training step
    python benchmarks/gpu_program.py --write-docs     # and regenerate docs/performance.md's tables
    python benchmarks/gpu_program.py --target tpu-v5e adam mlp float8   # TPU v5e programs
    python benchmarks/gpu_program.py reduce           # 8 H100s: what crosses devices, in which dtype

On 8 H100s (the `reduce` table) each program also counts its collectives: the bytes of each
all-reduce's operands, all-gather's result and reduce-scatter's operand (the array each one
moves, summed; a ring moves 7/8 of it per device, twice for an all-reduce), by op and dtype.

The H100 needs the CUDA plugin at jax's version, which compiles for the GPU without one:
`pip install -e ".[gpu-program]"`, in an environment of its own (with it, a CPU-only JAX warns
when it starts); a TPU needs libtpu at jax's version: `pip install -e ".[tpu-program]"` (Python
3.12 or newer: libtpu's wheels for jax 0.12 are built for them). libtpu prints warnings about the
TPU's accelerator type and worker hostnames when it starts, with no TPU: harmless.
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
import time

os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")  # no driver here: nothing runs
os.environ.setdefault("CUDA_VISIBLE_DEVICES", "-1")  # nor any device to find
if "triton_gemm" not in os.environ.get("XLA_FLAGS", ""):
  # cuBLAS GEMMs by default; XLA_FLAGS=--xla_gpu_enable_triton_gemm=true compiles Triton ones instead.
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_gpu_enable_triton_gemm=false").strip()

import jax
import jax.numpy as jnp
from jax import lax
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


@functools.cache
def h100_mesh(n=8):
  """A mesh of `n` deviceless H100s on one host, its axis named "d"."""
  from jax.experimental import topologies

  h100()  # the CUDA plugin's absence, said as for one GPU
  topology = topologies.get_topology_desc(platform="cuda", target_config=H100, topology=f"1x{n}x1")
  return topologies.make_mesh(topology, (n,), ("d",))


def compile_for_h100(step, *args, donate=(0, 1)):
  """The compiled H100 executable of `jax.jit(step)` on the shapes of `args`."""
  return compile_for("h100", step, *args, donate=donate)


# ---------------------------------------------------------------- compiling for a TPU


@dataclasses.dataclass(frozen=True)
class Tpu:
  """One chip of a TPU generation: libtpu's name for its topology and its datasheet figures (module docstring)."""

  topology: str
  bf16_flops: float
  int8_ops: float
  hbm_bytes_per_s: float


TPUS = {
    "tpu-v5e": Tpu("v5e:1x1", 197e12, 393e12, 819e9),
    "tpu-v5p": Tpu("v5p:1x1x1", 459e12, 918e12, 2765e9),
    "tpu-v6e": Tpu("v6e:1x1", 918e12, 1836e12, 1640e9),
}
TARGETS = ("h100", *TPUS)


@functools.cache
def sharding(target: str = "h100"):
  """A sharding on one deviceless chip of `target`, or an error that says what to install."""
  if target == "h100":
    return h100()
  if target not in TPUS:
    raise ValueError(f"unknown target {target!r}: choose among {', '.join(TARGETS)}")
  try:
    from jax.experimental import topologies

    topology = topologies.get_topology_desc(topology_name=TPUS[target].topology, platform="tpu")
  except Exception as e:  # libtpu's absence shows as several error types across jax releases
    # libtpu also refuses while another process holds it (its lock file, /tmp/libtpu_lockfile).
    cause = str(e).strip().splitlines()[0][:200] if str(e).strip() else type(e).__name__
    raise RuntimeError(
        f"compiling for a TPU needs libtpu at jax's version ({jax.__version__}), free of other processes: "
        f"`pip install -e \".[tpu-program]\"` (Python 3.12 or newer); it said: {cause}") from e
  return jax.sharding.NamedSharding(topologies.make_mesh(topology, (1,), ("x",)), jax.sharding.PartitionSpec())


def compile_for(target: str, step, *args, donate=(0, 1)):
  """The compiled executable of `jax.jit(step)` for `target` (`TARGETS`) on the shapes of `args`."""
  place = sharding(target)
  # Python scalars in a state (a peer's options) are traced as JAX would: weakly typed 32-bit arrays.
  dtype = lambda x: x.dtype if hasattr(x, "dtype") else jnp.asarray(x).dtype
  # A shape that names its own sharding (the 8-GPU table's) keeps it.
  placed = lambda x: getattr(x, "sharding", None) if isinstance(x, jax.ShapeDtypeStruct) else None
  shapes = jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), dtype(x), sharding=placed(x) or place), args)
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
  compile_s: float = 0.0  # trace + lower + compile, wall seconds
  compile_cpu_s: float = 0.0  # the same, CPU seconds of this process
  collectives: tuple = ()  # ((op, dtype, bytes), ...): the bytes each op moves in each dtype, summed
  accessed_bytes: int = 0  # a TPU's: XLA:TPU's cost analysis' "bytes accessed" (VMEM traffic included)
  # XLA's own figures where the release reports them (0 where not): its peak (`peak_memory_in_bytes`;
  # on the H100 the sum below, on a TPU a figure of XLA:TPU's own, not documented), and every buffer
  # the step's buffer assignment allocates, arguments included (`total_allocation_bytes`, a TPU's). On
  # a TPU `peak_bytes` sums a temporaries' figure about twice that assignment's temporary allocation
  # (benchmarks/NOTES.md).
  xla_peak_bytes: int = 0
  allocated_bytes: int = 0

  @property
  def collective_bytes(self) -> int:
    return sum(b for _, _, b in self.collectives)

  def ratios(self, base: Program) -> dict:
    return {"kernels": self.kernels / base.kernels, "hbm": self.hbm_bytes / base.hbm_bytes,
            "peak": self.peak_bytes / base.peak_bytes, "estimate": self.estimate_s / base.estimate_s,
            "xla_peak": self.xla_peak_bytes / base.xla_peak_bytes if base.xla_peak_bytes else math.nan,
            "allocated": self.allocated_bytes / base.allocated_bytes if base.allocated_bytes else math.nan,
            "compile": self.compile_cpu_s / base.compile_cpu_s if base.compile_cpu_s else math.nan}


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


_COLLECTIVE = re.compile(r"^(all-reduce|all-gather|reduce-scatter)(-start)?$")


def collective_bytes(instruction: re.Match, shapes: dict[str, str]) -> dict[str, int]:
  """Bytes by dtype that a collective moves: an all-reduce's operands, an all-gather's result, a
  reduce-scatter's operands (read from its operands' shapes, so an async pair counts once)."""
  op = _COLLECTIVE.match(instruction["op"])[1]
  if op == "all-gather":  # a synchronous one's shape is its result; an async start's, (operands, results)
    shape = instruction["shape"]
    arrays = _ARRAY.findall(shape)
    arrays = arrays[len(arrays) // 2:] if shape.startswith("(") else arrays
  else:
    arrays = [a for o in operand_names(instruction) for a in _ARRAY.findall(shapes.get(o, ""))]
  out: dict[str, int] = {}
  for dtype, dims in arrays:
    out[dtype] = out.get(dtype, 0) + math.prod(int(d) for d in dims.split(",") if d) * BYTES.get(dtype, 4)
  return out


def launched(comps: dict[str, list[re.Match]], name: str = "ENTRY", times: int = 1):
  """`(instruction, times)` for each instruction a computation runs, a `while` loop's body and condition
  as many times as XLA knows the loop runs (its `known_trip_count`; once where it does not know)."""
  for m in comps[name]:
    if m["op"] != "while":
      yield m, times
      continue
    trips = re.search(r'"known_trip_count":\{"n":"(\d+)"', m["attributes"])
    n = times * (int(trips[1]) if trips else 1)
    for part in ("condition", "body"):
      yield from launched(comps, re.search(part + r"=%?([\w.\-]+)", m["attributes"])[1], n)


def read_program(compiled) -> Program:
  """The kernels, bytes, copies, GEMMs and peak of a compiled GPU executable (a loop's kernels as often as
  they run: `launched`)."""
  comps = computations(compiled.as_text())
  shapes, kernels, moved, copies, fp8, gemms, estimate = {}, 0, 0, 0, 0, 0, 0.0
  wire: dict[tuple[str, str], int] = {}
  for m, times in launched(comps):
    shapes[m["name"]] = m["shape"]
    if _COLLECTIVE.match(m["op"]):
      for dtype, nbytes in collective_bytes(m, shapes).items():
        key = (_COLLECTIVE.match(m["op"])[1], dtype)
        wire[key] = wire.get(key, 0) + nbytes * times
    if m["op"] in NO_KERNEL:
      continue
    kernels += times
    nbytes = array_bytes(m["shape"]) + sum(array_bytes(shapes.get(o, "")) for o in operand_names(m))
    moved += nbytes * times
    copies += (m["op"] == "copy") * times
    flops, dtype = gemm_flops(m, shapes) if m["op"] == "custom-call" else (0.0, "")
    called = re.search(r"calls=%([\w.\-]+)", m["attributes"])
    if m["op"] == "fusion" and re.search(r'"kind":"__triton\w*gemm', m["attributes"]) and called:
      # A Triton GEMM (XLA's choice with --xla_gpu_enable_triton_gemm): float8 if fed float8.
      operand_dtypes = [shapes.get(o, "").split("[")[0] for o in operand_names(m)]
      flops, dtype = dot_flops(comps.get(called[1], [])), next((d for d in operand_dtypes if d in BYTES), "f32")
      fp8 += dtype.startswith("f8") * times
    elif "$f8" in m["attributes"]:
      fp8, dtype = fp8 + times, "f8e4m3fn"
    gemms += (flops > 0) * times
    estimate += (max(nbytes / HBM_BYTES_PER_S, flops / TENSOR_FLOPS.get(dtype, TENSOR_FLOPS["f32"])) + LAUNCH_S) * times
  collectives = tuple((op, dtype, n) for (op, dtype), n in sorted(wire.items()))
  return Program(kernels, moved, copies, fp8, gemms, peak_bytes(compiled), estimate, collectives=collectives,
                 **xla_memory(compiled))


def peak_bytes(compiled) -> int:
  memory = compiled.memory_analysis()
  return int(memory.argument_size_in_bytes + memory.output_size_in_bytes - memory.alias_size_in_bytes
             + memory.temp_size_in_bytes)


def xla_memory(compiled) -> dict:
  """`Program.xla_peak_bytes` and `allocated_bytes`: XLA's own figures, 0 where the release has none."""
  memory = compiled.memory_analysis()
  return {"xla_peak_bytes": int(getattr(memory, "peak_memory_in_bytes", 0) or 0),
          "allocated_bytes": int(getattr(memory, "total_allocation_bytes", 0) or 0)}


# Not a kernel on a TPU: the DMAs that bring an operand into VMEM, and the second halves of async pairs.
TPU_NO_KERNEL = NO_KERNEL | {"slice-start", "slice-done", "copy-done"}


def read_tpu_program(compiled, chip: Tpu) -> Program:
  """The kernels, copies, matmuls and peak of a compiled TPU executable, and XLA:TPU's bytes accessed.

  `fp8_gemms` counts the matmuls (convolutions, as XLA:TPU writes every dot) fed a float8 operand.
  """
  comps = computations(compiled.as_text())
  kernels, copies, gemms, fp8 = 0, 0, 0, 0
  shapes = {}
  for m in comps["ENTRY"]:
    shapes[m["name"]] = m["shape"]
    # An unfused op on a scalar is the scalar unit's work, between kernels (a reduction to one is a fusion).
    scalar = m["op"] != "fusion" and re.match(r"\w+\[\]", m["shape"]) is not None
    # A DMA between HBM and VMEM (a prefetch, or an output evicted to HBM), not a copy in HBM.
    dma = m["op"] == "copy-start" and not all(in_hbm for _, in_hbm in _placed_arrays(m["shape"])[:2])
    if m["op"] in TPU_NO_KERNEL or scalar or dma or 'custom_call_target="ConcatBitcast"' in m["attributes"]:
      continue
    kernels += 1
    copies += m["op"] in ("copy", "copy-start")
    called = re.search(r"calls=%([\w.\-]+)", m["attributes"])
    body = comps.get(called[1], []) if called else [m]
    for conv in (i for i in body if i["op"] in ("convolution", "dot")):
      gemms += 1
      body_shapes = {i["name"]: i["shape"] for i in body}
      fp8 += any(body_shapes.get(o, shapes.get(o, "")).startswith("f8") for o in operand_names(conv))
  cost = compiled.cost_analysis() or {}
  cost = cost[0] if isinstance(cost, list) else cost  # a list of one dict before jax 0.4.36
  accessed, flops = float(cost.get("bytes accessed", 0.0)), float(cost.get("flops", 0.0))
  moved = tpu_hbm_bytes(comps["ENTRY"])
  estimate = max(moved / chip.hbm_bytes_per_s, flops / chip.bf16_flops)
  return Program(kernels, moved, copies, fp8, gemms, peak_bytes(compiled), estimate, accessed_bytes=int(accessed),
                 **xla_memory(compiled))


def tpu_hbm_bytes(entry: list[re.Match]) -> int:
  """The bytes a TPU program's ENTRY computation reads from and writes to HBM.

  Each operation's operands and outputs that live in HBM (a layout without a memory space; `S(1)`
  is VMEM); a DMA into or out of VMEM (`copy-start`, `slice-start`) once, for its side in HBM. Not
  counted: what stays in VMEM, the scalar unit's operations on scalars, ConcatBitcast (it joins
  pieces already in VMEM) and the second halves of asynchronous pairs.
  """
  shapes, moved = {}, 0
  for m in entry:
    shapes[m["name"]] = m["shape"]
    op = m["op"]
    if op in TPU_NO_KERNEL - {"slice-start"} or 'custom_call_target="ConcatBitcast"' in m["attributes"]:
      continue
    if op in ("copy-start", "slice-start"):
      # Its output is (destination, source, context) or ((source), destination, context).
      destination = _placed_arrays(m["shape"])[0 if op == "copy-start" else 1]
      source_in_hbm = all(in_hbm for _, in_hbm in _placed_arrays(shapes.get(operand_names(m)[0], "")))
      moved += destination[0] * (source_in_hbm + destination[1])
      continue
    if op != "fusion" and re.match(r"\w+\[\]", m["shape"]):  # the scalar unit's, between kernels
      continue
    arrays = _placed_arrays(m["shape"]) + [a for o in operand_names(m) for a in _placed_arrays(shapes.get(o, ""))]
    moved += sum(n for n, in_hbm in arrays if in_hbm)
  return moved


def _placed_arrays(shape: str) -> list[tuple[int, bool]]:
  """(bytes, in HBM) of each array in an HLO shape with layouts, ``bf16[8]{0:T(1024)S(1)}``."""
  return [(math.prod(int(d) for d in dims.split(",") if d) * BYTES.get(dtype, 4), "S(" not in layout)
          for dtype, dims, layout in re.findall(r"(\w+)\[([\d,]*)\](\{[^}]*\})?", shape) if dtype != "token"]


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


def measure(step, *args, donate=(0, 1), target="h100") -> Program:
  """The program of `step` compiled for `target`, with the wall and CPU time of its trace, lowering and compilation."""
  wall, cpu = time.perf_counter(), time.process_time()
  compiled = compile_for(target, step, *args, donate=donate)
  wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
  program = read_program(compiled) if target == "h100" else read_tpu_program(compiled, TPUS[target])
  return dataclasses.replace(program, compile_s=wall, compile_cpu_s=cpu)


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
      "hand-written, jaxscale's numerics (plain JAX)": lambda: (hand_written_numerics, (params16, (
          jnp.zeros((), jnp.int32), jnp.zeros(2, jnp.uint32), params16, params16, params16), params32), (0, 1)),
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


def hand_written_numerics(params, state, grads, lr=1e-3, b1=0.9, b2=0.999, eps=1e-8,
                          stochastic_moments=True, exact_landing=True, spacing_units=True):
  """`hand_written_kahan` with the numerics of jaxscale's Kahan + bfloat16 state step, in plain JAX: the
  floor of its compile time. Each moment rounded stochastically (one hash per element, its two 16-bit
  halves, carried into bfloat16's bits), the compensation stored in units of the parameter's spacing,
  and the update landing exactly: the difference rounded once, moved one spacing towards zero where it
  would land on inf or on a zero whose remainder saturates the compensation, -0.0 where nothing moves.
  No optimizer plumbing: no skip, no tree of wrappers, one key split per step. Each of the three can be
  turned off (moments to nearest; the parameter rounded to nearest; the compensation raw), to measure
  what each costs in compile time (the `sixteen-floor` table)."""
  count, key, comp, mu, nu = state
  count = count + 1
  c1, c2 = 1 - b1 ** count.astype(jnp.float32), 1 - b2 ** count.astype(jnp.float32)
  key, draw = jax.random.split(key)
  big = jnp.float32(jnp.finfo(jnp.bfloat16).max)
  saturates = jnp.float32(float(jnp.finfo(jnp.bfloat16).max) * 2.0**-126)

  def hash32(x):  # Wellons' lowbias32, as jaxscale's rounding draws its bits
    x = (x ^ (x >> 16)) * jnp.uint32(0x7FEB352D)
    x = (x ^ (x >> 15)) * jnp.uint32(0x846CA68B)
    return x ^ (x >> 16)

  def as_bits(x, dtype=jnp.uint32):
    return lax.bitcast_convert_type(x, dtype)

  def ulp_at(x):  # bfloat16's spacing at |x|, from the exponent bits, at least float32's smallest normal
    if not spacing_units:
      return jnp.float32(1)
    exponent = (as_bits(x, jnp.int32) & 0x7F800000) - (7 << 23)
    return as_bits(jnp.maximum(exponent, 1 << 23), jnp.float32)

  def nearest(x):
    return lax.reduce_precision(x, exponent_bits=8, mantissa_bits=7)

  def stochastic(x, bits):  # 16 random bits added below bfloat16's and cleared: unbiased
    carried = as_bits(jnp.clip(x, -big, big)) + bits
    return jnp.where(jnp.isfinite(x), as_bits(carried & jnp.uint32(0xFFFF0000), jnp.float32), x)

  # Each leaf's two seeds computed before its kernel, as scalars: fused into the kernels instead, they
  # make XLA merge many leaves' rounding into one kernel that reads the state twice (1.13x the bytes).
  index = jnp.arange(len(params), dtype=jnp.uint32)
  mixed = lax.optimization_barrier((hash32(draw[0] ^ index), draw[1] + index))
  seeds = lax.optimization_barrier([(hash32(mixed[0][i]), hash32(mixed[1][i])) for i in range(len(params))])
  out = []
  for i, (p, c, m, v, g) in enumerate(zip(params, comp, mu, nu, grads)):
    m = b1 * m.astype(jnp.float32) + (1 - b1) * g
    v = b2 * v.astype(jnp.float32) + (1 - b2) * g * g
    u = -lr * (m / c1) / (jnp.sqrt(v / c2) + eps)
    start = p.astype(jnp.float32)
    step = u + c.astype(jnp.float32) * ulp_at(start)
    exact = jnp.clip(start + step, -big, big)
    wanted = nearest(exact)
    if exact_landing:
      difference = nearest(jnp.clip(wanted - start, -big, big))
      landed = nearest(start + difference)
      closer = jnp.isinf(landed) | ((landed == 0) & (jnp.abs(exact) > saturates))
      toward_zero = as_bits(as_bits(difference) - jnp.uint32(1 << 16), jnp.float32)
      difference = jnp.where(closer, toward_zero, difference)
      landed = nearest(start + difference)
      new = p + jnp.where(wanted == start, jnp.float32(-0.0), difference).astype(p.dtype)
    else:
      landed, new = wanted, wanted.astype(p.dtype)
    remainder = jnp.clip((step - (landed - start)) / ulp_at(landed), -big, big)
    if stochastic_moments:
      bits = hash32(lax.iota(jnp.uint32, p.size).reshape(p.shape) ^ seeds[i][0]) + seeds[i][1]
      m, v = stochastic(m, bits >> 16), stochastic(v, bits & 0xFFFF)
    out.append((new, remainder.astype(c.dtype), m.astype(jnp.bfloat16), v.astype(jnp.bfloat16)))
  new_params, comp, mu, nu = ([o[i] for o in out] for i in range(4))
  return new_params, (count, key, comp, mu, nu)


# The leaf counts of the sixteen tables: the benchmark's 8, and the leaf counts of real models (a
# ResNet50 has 161 parameter leaves, GPT-2 small 148). 1000 leaves (`--leaves 1000`) compiles for minutes.
SIXTEEN_LEAVES = (8, 48, 150)


def sixteen_floor_table(n_leaves=48):
  """`hand_written_numerics` with each of its three numerics taken out, and all three: what each costs in
  compile time, against float32 Adam's."""
  rows = sixteen_table(n_leaves=n_leaves)
  _, args, donate = rows["hand-written, jaxscale's numerics (plain JAX)"]()
  variant = lambda **off: lambda: (functools.partial(hand_written_numerics, **off), args, donate)
  return {f"Adam step, 32M params / {n_leaves} leaves, the numerics' compile time": {
      "float32 Adam": rows["float32 Adam"],
      "jaxscale's numerics by hand": variant(),
      "moments to nearest": variant(stochastic_moments=False),
      "parameter to nearest": variant(exact_landing=False),
      "compensation raw": variant(spacing_units=False),
      "none of the three": variant(stochastic_moments=False, exact_landing=False, spacing_units=False),
  }}


def sixteen_tables(leaves=SIXTEEN_LEAVES, n_params=32_000_000):
  return {f"Adam step, {n_params // 1_000_000}M params / {n} leaves": sixteen_table(n_params, n) for n in leaves}


def sixteen_gpt_table():
  """The GPT-2-small-shaped training step (benchmarks/models.py) with bfloat16 parameters, Kahan,
  bfloat16 state and the scaler, against the `"mixed_bfloat16"` step with AdamW, float32 and bfloat16
  first moment: the 16-bit step's peak must stay 4 bytes a parameter below the latter's."""
  import models

  def row(build):
    return lambda: (*build(), (0, 1))

  bf16_mu = optax.adamw(3e-4, weight_decay=0.1, mu_dtype=jnp.bfloat16)
  return {"GPT-2-small-shaped step (12 x d 768, seq 1024, batch 8), 16-bit": {
      "mixed_bfloat16, AdamW": row(functools.partial(models.gpt_step, "mixed_bfloat16")),
      "mixed_bfloat16, AdamW(mu_dtype=bfloat16)": row(functools.partial(models.gpt_step, "mixed_bfloat16", tx=bf16_mu)),
      "bfloat16 params, kahan + bf16 state + scaler": row(models.gpt_sixteen_step),
      "bfloat16 params, hand-written Kahan (plain JAX)": row(
          functools.partial(gpt_hand_written_step, hand_written_kahan)),
      "bfloat16 params, jaxscale's numerics by hand (plain JAX)": row(
          functools.partial(gpt_hand_written_step, hand_written_numerics)),
  }}


def gpt_hand_written_step(update):
  """The 16-bit GPT step's floor: `models.gpt_sixteen_step`'s model and forward (bfloat16 parameters and
  compute, no scaler), its gradients in float32 handed to `update` (`hand_written_kahan` or
  `hand_written_numerics`: Adam by hand over the list of leaves, no weight decay, no optimizer tree)."""
  import models

  config = models.GPTConfig()
  model = models.GPT(config)
  tokens = jax.ShapeDtypeStruct((config.batch, config.seq), jnp.int32)
  loss = jaxscale.autocast(models.next_token_loss(model), "params=bfloat16,compute=bfloat16,output=float32")

  def step(params, state, tokens):
    value, grads = jax.value_and_grad(loss)(params, tokens)
    leaves, treedef = jax.tree.flatten(params)
    new, state = update(leaves, state, [g.astype(jnp.float32) for g in jax.tree.leaves(grads)])
    return jax.tree.unflatten(treedef, new), state, value

  params = jax.eval_shape(lambda t: model.init(jax.random.key(0), t)["params"], tokens)
  leaves = [jax.ShapeDtypeStruct(p.shape, jnp.bfloat16) for p in jax.tree.leaves(params)]
  params = jax.tree.unflatten(jax.tree.structure(params), leaves)
  key = (jnp.zeros(2, jnp.uint32),) if update is hand_written_numerics else ()
  return step, (params, (jnp.zeros((), jnp.int32), *key, leaves, leaves, leaves), tokens)


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


def float8_table(width=4096, seq=2048, batch=4, heads=16, policies=("mixed_bfloat16", "mixed_float8")):
  """One transformer block's forward and backward under each policy (no optimizer)."""
  shape = lambda *s: jax.ShapeDtypeStruct(s, jnp.float32)
  params = {"qkv": shape(width, 3 * width), "out": shape(width, width), "up": shape(width, 4 * width),
            "down": shape(4 * width, width)}
  x = jax.ShapeDtypeStruct((batch, seq, width), jnp.float32)

  def row(policy):
    block = jaxscale.autocast(functools.partial(transformer_block, heads=heads), policy)
    grad = jax.grad(lambda p, x: jnp.mean(jnp.square(block(p, x).astype(jnp.float32))))
    return lambda: (grad, (params, x), ())

  return {policy: row(policy) for policy in policies}


def delayed_block_row(width=4096, seq=2048, batch=4, heads=16):
  """The transformer block's forward and backward under `"mixed_float8"` with delayed scaling
  (`autocast(..., delayed=True)`), its `Float8History` updated: a row builder of `float8_table`'s."""
  shape = lambda *s: jax.ShapeDtypeStruct(s, jnp.float32)
  params = {"qkv": shape(width, 3 * width), "out": shape(width, width), "up": shape(width, 4 * width),
            "down": shape(4 * width, width)}
  x = jax.ShapeDtypeStruct((batch, seq, width), jnp.float32)

  def row():
    block = jaxscale.autocast(functools.partial(transformer_block, heads=heads), "mixed_float8", delayed=True)
    loss = lambda h, p, x: jnp.mean(jnp.square(block(h, p, x).astype(jnp.float32)))
    history = jax.eval_shape(lambda p, x: jaxscale.float8_history(block, p, x), params, x)

    def block_step(history, params, x):
      seen, grads = jax.grad(loss, argnums=(0, 1))(history, params, x)
      return jaxscale.float8_update(history, seen), grads

    return block_step, (history, params, x), ()

  return row


def delayed_model_row(config):
  """A real model's step (benchmarks/models.py) under `"mixed_float8"` with delayed scaling."""
  import models

  return lambda: (*models.gpt_delayed_step(config), (0, 1))


def delayed_table():
  """Float8's delayed scaling (`autocast(..., delayed=True)`) against current scaling and bfloat16: the d 4096
  block's forward and backward, and the real models' full steps (benchmarks/models.py)."""
  import models

  blocks = float8_table()
  blocks["mixed_float8, delayed"] = delayed_block_row()
  wide = models.GPTConfig(layers=2, width=4096, mlp=16384, heads=32, seq=2048, batch=4)
  out = {"transformer block fwd+bwd, d 4096, seq 2048, batch 4": blocks}
  for title, config in (("GPT-2-small-shaped step (12 x d 768, seq 1024, batch 8), AdamW", models.GPTConfig()),
                        ("Transformer step, 2 x d 4096, mlp 16384, seq 2048, batch 4, AdamW", wide)):
    rows = model_table(functools.partial(models.gpt_step, config=config))
    rows["mixed_float8, delayed"] = delayed_model_row(config)
    out[title] = rows
  return out


def mlp_table(width=1024, tokens=4096, policies=("mixed_bfloat16", "mixed_float16", "mixed_float8")):
  """A 4x GELU MLP's forward and backward under each policy: two matmuls that float8 takes, and little else."""
  params = {"up": jax.ShapeDtypeStruct((width, 4 * width), jnp.float32),
            "down": jax.ShapeDtypeStruct((4 * width, width), jnp.float32)}
  x = jax.ShapeDtypeStruct((tokens, width), jnp.float32)

  def row(policy):
    mlp = jaxscale.autocast(lambda p, x: jax.nn.gelu(x @ p["up"]) @ p["down"], policy)
    return lambda: (jax.grad(lambda p, x: jnp.mean(jnp.square(mlp(p, x).astype(jnp.float32)))), (params, x), ())

  return {policy: row(policy) for policy in policies}


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


def model_table(build, donate=(0, 1)):
  """A real model's full training step (benchmarks/models.py: loss, gradients, AdamW) under each policy."""

  def row(policy):
    def built():
      step, args = build(policy)
      return step, args, donate

    return built

  return {"mixed_bfloat16": row("mixed_bfloat16"), "mixed_float8": row("mixed_float8")}


def model_tables():
  """GPT-2 small's shape, the same Transformer at d 4096, and a ResNet50: Flax models, unchanged."""
  import models

  wide = models.GPTConfig(layers=2, width=4096, mlp=16384, heads=32, seq=2048, batch=4)
  return {
      "GPT-2-small-shaped step (12 x d 768, seq 1024, batch 8), AdamW": {
          **model_table(models.gpt_step), "mixed_float8, delayed": delayed_model_row(models.GPTConfig())},
      "Transformer step, 2 x d 4096, mlp 16384, seq 2048, batch 4, AdamW": model_table(
          functools.partial(models.gpt_step, config=wide)),
      "ResNet50 step (224x224, batch 64), AdamW": model_table(models.resnet_step, donate=(0, 1, 2)),
  }


def accumulation_table(microbatches=4):
  """The d 4096 Transformer's step over microbatches (a `lax.scan` of gradients, then AdamW): each weight
  quantized (float8) or cast (bfloat16) once a microbatch, and once a step (`autocast(..., weights=params)`)."""
  import models

  wide = models.GPTConfig(layers=2, width=4096, mlp=16384, heads=32, seq=2048, batch=4)
  step = functools.partial(models.gpt_accumulation_step, config=wide, microbatches=microbatches)
  row = lambda policy, once=False: lambda: (*step(policy, once=once), (0, 1))
  return {f"Transformer step, 2 x d 4096, {microbatches} microbatches of 1 x 2048, AdamW": {
      "mixed_bfloat16": row("mixed_bfloat16"),
      "mixed_float8": row("mixed_float8"),
      "mixed_float8, weights quantized once a step": row("mixed_float8", once=True),
      "mixed_bfloat16, weights cast once a step": row("mixed_bfloat16", once=True),
  }}
def reduce_table(layout, width=4096, tokens_per_gpu=1024, n=8):
  """An MLP's gradient (d `width`, 4x hidden, GELU) on `n` H100s under each policy's `reduce_dtype`.

  float32 parameters, the batch split over the devices; `layout`: "data parallel" (parameters
  replicated) or "fsdp" (each parameter split on its first axis). The gradient comes out sharded
  as its parameter, so the partitioner chooses each collective and its dtype.
  """
  mesh = h100_mesh(n)
  spec = jax.sharding.PartitionSpec() if layout == "data parallel" else jax.sharding.PartitionSpec("d", None)
  sharding = jax.sharding.NamedSharding(mesh, spec)
  shape = lambda *s, sharding=sharding: jax.ShapeDtypeStruct(s, jnp.float32, sharding=sharding)
  params = {"up": shape(width, 4 * width), "down": shape(4 * width, width)}
  x = shape(n * tokens_per_gpu, width, sharding=jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("d")))

  def mlp(params, x):
    return jax.nn.gelu(x @ params["up"]) @ params["down"]

  def row(policy):
    f = jaxscale.autocast(mlp, policy)
    grad = jax.grad(lambda p, x: jnp.mean(jnp.square(f(p, x).astype(jnp.float32))))
    return lambda: (jax.jit(grad, out_shardings={"up": sharding, "down": sharding}), (params, x), ())

  policies = {"float32": "float32", "mixed_bfloat16": "mixed_bfloat16",
              "mixed_bfloat16, reduce=bfloat16": "p=float32,c=bfloat16,o=float32,reduce=bfloat16",
              "mixed_float8": "mixed_float8",
              "mixed_float8, reduce=bfloat16": "p=float32,c=bfloat16,o=float32,matmul=float8,reduce=bfloat16"}
  return {name: row(policy) for name, policy in policies.items()}


TABLES = {
    "scaler": scaler_tables,
    "sixteen": sixteen_tables,  # its leaf counts: `--leaves`
    # Not in the default run: its 16-bit step compiles for about a minute.
    "sixteen-gpt": sixteen_gpt_table,
    # Not in the default run: the 16-bit numerics' compile time, each part taken out (48 leaves).
    "sixteen-floor": sixteen_floor_table,
    # Not in the default run: three steps of the d 4096 Transformer over microbatches, about a minute.
    "accumulation": accumulation_table,
    "float8": lambda: {"transformer block fwd+bwd, d 4096, seq 2048, batch 4": {
                           **float8_table(), "mixed_float8, delayed": delayed_block_row()},
                       "transformer block fwd+bwd, d 1024, seq 1024, batch 4": float8_table(1024, 1024),
                       "conv net fwd+bwd, 4 x 3x3x128, 32x32, batch 64": conv_table()},
    # Not in the default run: the three steps compile in about 100 s (benchmarks/NOTES.md).
    "models": model_tables,
    # Not in the default run: delayed scaling's block and steps, about two minutes.
    "delayed": delayed_table,
    # Not in the default run: the TPU program's budgets (benchmarks/test_tpu_program.py), compiled in seconds.
    "adam": lambda: {"Adam step, 32M params / 48 leaves": _bench_rows(
        bench.optimizer_builders("adam", 32_000_000, 48, ["plain", "jaxscale"]))},
    "mlp": lambda: {"MLP fwd+bwd, d 1024, 4096 tokens": mlp_table()},
    # What the compiler does with a float16 matmul, against bfloat16 (a TPU's question more than a GPU's).
    "float16": lambda: {"transformer block fwd+bwd, d 1024, seq 1024, batch 4, float16": float8_table(
        1024, 1024, policies=("mixed_bfloat16", "mixed_float16"))},
    "reduce": lambda: {f"MLP gradient on 8 H100s, {layout}, d 4096, 1024 tokens a GPU": reduce_table(layout)
                       for layout in ("data parallel", "fsdp")},
}


DEFAULT_TABLES = ["scaler", "sixteen", "float8"]
# The tables whose compile time is part of the result: a CPU-seconds column and its ratio.
TIMED_TABLES = ("sixteen", "sixteen-gpt", "sixteen-floor")


def _importable(module):
  try:
    __import__(module)
  except ImportError:
    return False
  return True


def measure_table(rows, target="h100") -> dict[str, Program]:
  out = {}
  for name, build in rows.items():
    step, args, donate = build()
    out[name] = measure(step, *args, donate=donate, target=target)
  return out


def over_budget(program: Program, base: Program, **budget) -> list[str]:
  """What exceeds each budget: `kernels` (at most base + n), `hbm`, `peak`, `estimate` (ratios at most),
  `copies`, `fp8_gemms` (at most)."""
  ratios = program.ratios(base)
  failures = []
  if "kernels" in budget and program.kernels > base.kernels + budget["kernels"]:
    failures.append(f"{program.kernels} kernels > {base.kernels} + {budget['kernels']}")
  for key in ("hbm", "peak", "estimate"):
    if key in budget and ratios[key] > budget[key]:
      failures.append(f"{key} {ratios[key]:.3f}x > {budget[key]}x")
  for key in ("copies", "fp8_gemms"):
    if key in budget and getattr(program, key) > budget[key]:
      failures.append(f"{getattr(program, key)} {key} > {budget[key]}")
  return failures


# ---------------------------------------------------------------- reporting


def markdown(title, programs: dict[str, Program], timed=False) -> list[str]:
  """An H100 table; `timed`: with the compile time in CPU seconds and its ratio to the first row's."""
  base = next(iter(programs.values()))
  if any(p.collectives for p in programs.values()):
    return collectives_markdown(title, programs)
  lines = [f"**{title}**", "",
           "| program | kernels | HBM MB | x | copies | FP8 GEMMs | peak MB | x | estimate ms | x |"
           + (" compile s (CPU) | x |" if timed else ""),
           "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"
           + (" ---: | ---: |" if timed else "")]
  for name, p in programs.items():
    r = p.ratios(base)
    lines.append(f"| {name} | {p.kernels} | {p.hbm_bytes / 1e6:.1f} | {r['hbm']:.3f} | {p.copies} | {p.fp8_gemms} | "
                 f"{p.peak_bytes / 1e6:.1f} | {r['peak']:.3f} | {p.estimate_s * 1e3:.3f} | {r['estimate']:.3f} |"
                 + (f" {p.compile_cpu_s:.2f} | {r['compile']:.2f} |" if timed else ""))
  return lines + [""]


def tpu_markdown(title, programs: dict[str, Program], timed=False) -> list[str]:
  """A TPU table (wall seconds of compilation always); `timed`: CPU seconds too, and their ratio.

  Three readings of the memory: "peak" as the H100's tables read it (arguments, outputs and the
  temporaries' figure), XLA's own peak figure, and what its buffer assignment allocates.
  """
  base = next(iter(programs.values()))
  lines = [f"**{title}**", "",
           "| program | kernels | HBM MB | x | accessed MB | x | copies | float8 matmuls | peak MB | x "
           "| XLA peak MB | x | allocated MB | x | roofline ms | x | compile s |"
           + (" compile s (CPU) | x |" if timed else ""),
           "| --- |" + " ---: |" * 16 + (" ---: | ---: |" if timed else "")]
  for name, p in programs.items():
    r = p.ratios(base)
    lines.append(f"| {name} | {p.kernels} | {p.hbm_bytes / 1e6:.1f} | {r['hbm']:.3f} | {p.accessed_bytes / 1e6:.1f} | "
                 f"{p.accessed_bytes / base.accessed_bytes:.3f} | {p.copies} | {p.fp8_gemms} | "
                 f"{p.peak_bytes / 1e6:.1f} | {r['peak']:.3f} | {p.xla_peak_bytes / 1e6:.1f} | {r['xla_peak']:.3f} | "
                 f"{p.allocated_bytes / 1e6:.1f} | {r['allocated']:.3f} | "
                 f"{p.estimate_s * 1e3:.3f} | {r['estimate']:.3f} | "
                 f"{p.compile_s:.1f} |" + (f" {p.compile_cpu_s:.2f} | {r['compile']:.2f} |" if timed else ""))
  return lines + [""]


def collectives_markdown(title, programs: dict[str, Program]) -> list[str]:
  """A multi-GPU table: the bytes each program's collectives move, by op and dtype."""
  lines = [f"**{title}**", "",
           "| program | collective MB | collectives (MB by op and dtype) | HBM MB a GPU | estimate ms |",
           "| --- | ---: | --- | ---: | ---: |"]
  for name, p in programs.items():
    each = "; ".join(f"{op} {dtype} {n / 1e6:.1f}" for op, dtype, n in p.collectives if n >= 1e4)
    lines.append(f"| {name} | {p.collective_bytes / 1e6:.1f} | {each} | {p.hbm_bytes / 1e6:.1f} | "
                 f"{p.estimate_s * 1e3:.3f} |")
  return lines + [""]


def write_docs(text, path, target="h100"):
  """Replaces what stands between the target's markers in `path` (docs/performance.md) with `text`."""
  begin, end = "<!-- gpu-program tables -->", "<!-- end gpu-program tables -->"
  if target != "h100":
    begin, end = f"<!-- {target} program tables -->", f"<!-- end {target} program tables -->"
  with open(path) as f:
    page = f.read()
  if begin not in page or end not in page:
    raise SystemExit(f"{path} has no `{begin}` ... `{end}` markers to write between")
  head, rest = page.split(begin, 1)
  with open(path, "w") as f:
    f.write(head + begin + "\n" + text + "\n" + end + rest.split(end, 1)[1])


def _leaf_count(text: str) -> int:
  """A leaf count from the command line: a whole number from 1 to the table's 32M parameters."""
  n = int(text)
  if not 1 <= n <= 32_000_000:
    raise argparse.ArgumentTypeError(f"a leaf count is a whole number from 1 to 32000000, not {n}")
  return n


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("tables", nargs="*", metavar="TABLE",
                      help=f"which tables: {', '.join(TABLES)} (default: {', '.join(DEFAULT_TABLES)})")
  parser.add_argument("--json", action="store_true", help="print the measurements as JSON")
  parser.add_argument("--write-docs", action="store_true", help="write the tables into docs/performance.md")
  parser.add_argument("--target", choices=TARGETS, default="h100", help="the chip to compile for (default: h100)")
  parser.add_argument("--leaves", type=_leaf_count, nargs="+", default=None, metavar="N",
                      help="the sixteen table's leaf counts, of 32M parameters in all (default: "
                           f"{' '.join(map(str, SIXTEEN_LEAVES))}; 1000 compiles for minutes)")
  args = parser.parse_args(argv)
  chosen = args.tables or DEFAULT_TABLES
  if unknown := [t for t in chosen if t not in TABLES]:
    parser.error(f"unknown table {', '.join(unknown)}: choose among {', '.join(TABLES)}")
  if args.leaves is not None and "sixteen" not in chosen:
    parser.error("--leaves sets the sixteen table's leaf counts: name it (`gpu_program.py sixteen --leaves N`)")
  args.leaves = args.leaves or list(SIXTEEN_LEAVES)
  try:
    sharding(args.target)  # before any work: say what is missing at once
  except RuntimeError as e:
    parser.exit(1, f"{parser.prog}: {e}\n")
  results, timed = {}, set()
  for table in chosen:
    configurations = sixteen_tables(args.leaves) if table == "sixteen" else TABLES[table]()
    for title, rows in configurations.items():
      print(f"compiling: {title}", file=sys.stderr, flush=True)
      results[title] = measure_table(rows, target=args.target)
      if table in TIMED_TABLES:
        timed.add(title)
  if args.json:
    print(json.dumps({t: {n: dataclasses.asdict(p) for n, p in ps.items()} for t, ps in results.items()}, indent=1))
    return
  argv_shown = sys.argv[1:] if argv is None else argv
  if args.target == "h100":
    header = (f"H100 (sm_90) programs, compiled without a GPU by jax {jax.__version__}'s XLA:GPU "
              f"(`python benchmarks/gpu_program.py {' '.join(argv_shown)}`); x: ratio to the table's first row.")
    table_lines = markdown
  else:
    header = (f"TPU {args.target[4:]} programs (one chip, `{TPUS[args.target].topology}`), compiled without a TPU by "
              f"jax {jax.__version__}'s XLA:TPU (libtpu {_version('libtpu')}; `python benchmarks/gpu_program.py "
              f"{' '.join(argv_shown)}`); bytes: XLA:TPU's cost analysis; x: ratio to the "
              "table's first row; compile: this run's wall seconds.")
    table_lines = tpu_markdown
  text = "\n".join([header, "", *(line for t, ps in results.items() for line in table_lines(t, ps, t in timed))])
  print(text)
  if args.write_docs:
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "docs", "performance.md")
    write_docs(text, path, args.target)


def _version(distribution):
  from importlib import metadata

  try:
    return metadata.version(distribution)
  except metadata.PackageNotFoundError:
    return "?"


if __name__ == "__main__":
  main()
