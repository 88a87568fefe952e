"""`Policy.reduce_dtype` on 8 devices: the dtype each collective carries in the partitioned program.

The SPMD partitioner adds the devices' partial sums of a weight gradient (a contraction over the
sharded batch) in the dtype of the product that computes them, and gathers a sharded parameter
in the dtype it has where the matmul reads it. These tests read the program as the partitioner
leaves it (XLA's `spmd-partitioning` pass, dumped): XLA:CPU's later passes widen every bfloat16
and float8 collective (all-reduce-promotion, float-normalization), since the CPU computes in
float32, where XLA:GPU keeps the partitioner's dtypes (benchmarks/gpu_program.py's `reduce`
table reads the H100 program).
"""

import glob
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import jaxscale

D, HIDDEN, BATCH = 2048, 8192, 1024  # float8's matmuls here are large enough to run in float8
LAYOUTS = {"data_parallel": P(), "fsdp_axis_0": P("d", None), "fsdp_axis_1": P(None, "d")}
# (policy, the dtype the weight gradients cross devices in, the dtype the parameters are gathered in)
POLICIES = {
    "float32": ("float32", "f32", "f32"),
    "mixed_float16": ("mixed_float16", "f32", "f16"),
    "mixed_bfloat16": ("mixed_bfloat16", "f32", "bf16"),
    "reduce=bfloat16": ("params=float32,compute=bfloat16,output=float32,reduce=bfloat16", "bf16", "bf16"),
    "mixed_float8": ("mixed_float8", "f32", "f8e4m3fn"),
    # XLA:CPU's float8 matmul unscales a float32 product (`_float8._unscaled`), so the CPU program
    # reduces it in float32 whatever the policy; the H100 program reduces it in bfloat16.
    "float8,reduce=bfloat16": ("p=f32,c=bf16,o=f32,matmul=float8,reduce=bf16", "f32", "f8e4m3fn"),
}
COLLECTIVE = re.compile(r"= (\([^)]*\)|\S+) (all-gather|all-reduce|reduce-scatter)(?:-start)?\(")


def mesh():
  return jax.make_mesh((8,), ("d",), axis_types=(AxisType.Auto,))


def mlp(params, x):
  return jax.nn.gelu(x @ params["w1"]) @ params["w2"]


def partitioned(lowered, tmp_path):
  """The module's text right after SPMD partitioning: each collective in the dtype the partitioner chose."""
  lowered.compile({"xla_dump_to": str(tmp_path), "xla_dump_hlo_pass_re": "spmd-partitioning"})
  found = glob.glob(str(tmp_path / "*after_spmd-partitioning*"))
  assert len(found) == 1, f"expected one dump of the partitioned module in {tmp_path}, found {found}"
  with open(found[0]) as f:
    return f.read()


def collectives(text):
  """(op, dtype, shape) of every all-gather, all-reduce and reduce-scatter result in ``text``."""
  return [
      (op, dtype, tuple(int(d) for d in dims.split(",") if d))
      for shapes, op in COLLECTIVE.findall(text)
      for dtype, dims in re.findall(r"(\w+)\[([\d,]*)\]", shapes)
  ]


def gradient_program(policy, layout, tmp_path):
  sharding = NamedSharding(mesh(), LAYOUTS[layout])
  params = {"w1": jax.ShapeDtypeStruct((D, HIDDEN), jnp.float32, sharding=sharding),
            "w2": jax.ShapeDtypeStruct((HIDDEN, D), jnp.float32, sharding=sharding)}
  x = jax.ShapeDtypeStruct((BATCH, D), jnp.float32, sharding=NamedSharding(mesh(), P("d", None)))
  f = jaxscale.autocast(mlp, policy)
  grad = jax.grad(lambda p, x: jnp.mean(jnp.square(f(p, x).astype(jnp.float32))))
  step = jax.jit(grad, out_shardings={"w1": sharding, "w2": sharding})
  return collectives(partitioned(step.trace(params, x).lower(), tmp_path))


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("name", POLICIES)
def test_weight_gradients_cross_devices_in_the_reduce_dtype_and_parameters_in_the_matmuls(name, layout, tmp_path):
  policy, reduced, gathered = POLICIES[name]
  weights = {(D, HIDDEN), (HIDDEN, D)}
  found = gradient_program(policy, layout, tmp_path)
  # An all-reduce of a weight-shaped result is a weight gradient's (the CPU partitioner then slices
  # its shard out); XLA:GPU turns it into a reduce-scatter.
  reductions = {dtype for op, dtype, shape in found if op != "all-gather" and shape in weights}
  gathers = {dtype for op, dtype, shape in found if op == "all-gather" and shape in weights}
  if layout == "data_parallel":  # each device's partial sums of both gradients, added across devices
    assert reductions == {reduced}, found
    assert not gathers, found
  else:  # the partitioner gathers a parameter, or the activations to compute its gradient where it is stored
    assert reductions <= {reduced}, found
    assert gathers <= {gathered}, found
    if layout == "fsdp_axis_0":  # w1's gradient: partial sums over the batch, reduced
      assert reductions, found


def test_the_default_reduce_dtype_is_the_parameter_dtype():
  for name in ("mixed_float16", "mixed_bfloat16", "mixed_float8"):
    policy = jaxscale.get_policy(name)
    assert policy.reduce_dtype == policy.param_dtype == np.dtype(np.float32)


# ---------------------------------------------------------------- numerics


def test_a_float32_reduction_of_bfloat16_partial_products_rounds_as_float32_does():
  """Data parallel: each device's weight gradient is x_i^T g_i of bfloat16 values, written by the GEMM.

  Reference: the same products summed exactly (float64: each product of two bfloat16 values is
  exact, and 512 of them lose nothing at these magnitudes). Reduced in float32, each device's
  GEMM accumulates its 64 products and the all-reduce adds 8 partial sums: at most 64 + 7
  roundings to float32 on the way to any sum, so (Higham's bound for a sum of n terms)
  |error| <= (n - 1) * 2**-24 * sum |x g| with n = 72, a factor ~1.0000043 within it ignored by
  taking n = 72 for 71. Reduced in bfloat16, each partial sum is first rounded to 8 bits
  (2**-9 relative): of order 2**15 / 72 = 455 times that bound where a partial sum is as large
  as its terms' magnitudes, less where they cancel; at least ten times it, shown beside it.
  """
  rng = np.random.default_rng(0)
  batch, width, out = 512, 64, 64
  bf16 = lambda a: np.asarray(jnp.asarray(a, jnp.bfloat16).astype(jnp.float32))
  x = bf16(rng.normal(size=(batch, width)))
  cotangent = bf16(rng.normal(size=(batch, out)))
  w = rng.normal(size=(width, out)).astype(np.float32)
  exact = x.astype(np.float64).T @ cotangent.astype(np.float64)
  magnitude = np.abs(x.astype(np.float64)).T @ np.abs(cotangent.astype(np.float64))
  bound = (batch // 8 + 8) * 2.0**-24 * magnitude

  replicated, by_batch = NamedSharding(mesh(), P()), NamedSharding(mesh(), P("d", None))
  errors = {}
  for reduce in ("float32", "bfloat16"):
    f = jaxscale.autocast(lambda w, x: x @ w, f"params=float32,compute=bfloat16,output=float32,reduce={reduce}")
    # The loss's cotangent of the bfloat16 product is bfloat16(cotangent): exact, as it is already.
    grad = jax.jit(jax.grad(lambda w, x, c: jnp.sum(f(w, x) * c)))
    dw = grad(jax.device_put(w, replicated), jax.device_put(x, by_batch), jax.device_put(cotangent, by_batch))
    assert dw.dtype == np.float32
    errors[reduce] = np.abs(np.asarray(dw, np.float64) - exact)
  print(f"largest error / float32 bound: reduced in float32 {np.max(errors['float32'] / bound):.3g}, "
        f"in bfloat16 {np.max(errors['bfloat16'] / bound):.3g}")
  assert np.all(errors["float32"] <= bound)
  assert np.max(errors["bfloat16"] / bound) > 10


# ---------------------------------------------------------------- the scaler's skip decision


# jax 0.7's XLA leaves one scalar all-reduce per group of same-shape gradients (three here, beside the
# loss's): its all-reduce combiner does not merge them, as jax 0.10's does.
@pytest.mark.skipif(jax.__version_info__ < (0, 8), reason="jax 0.7's XLA does not combine the scalar all-reduces")
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("policy", ["mixed_float16", "p=f32,c=f16,o=f32,reduce=f16"])
def test_the_skip_decision_is_one_all_reduce_of_scalars_whatever_the_sharding(policy, layout):
  """No gradient is gathered to be checked: each device sums its shards' flags, one all-reduce adds them.

  Replicated gradients (data parallel) are checked where they are, with no collective at all.
  """
  sharding = NamedSharding(mesh(), LAYOUTS[layout])
  params = jax.device_put({"w1": jnp.zeros((256, 1024)), "w2": jnp.zeros((1024, 256))}, sharding)
  tx = jaxscale.dynamic_loss_scaling(optax.adam(1e-3))
  state = tx.init(params)
  x = jax.device_put(jnp.zeros((64, 256)), NamedSharding(mesh(), P("d", None)))
  f = jaxscale.autocast(mlp, policy)

  def step(params, state, x):
    loss = lambda p: jnp.mean(jnp.square(f(p, x).astype(jnp.float32)))
    _, grads, finite = jaxscale.value_and_grad(loss)(jaxscale.find_scaler(state), params)
    updates, state = tx.update(grads, state, params, finite=finite)
    return optax.apply_updates(params, updates), state

  text = jax.jit(step, donate_argnums=(0, 1)).lower(params, state, x).compile().as_text()
  found = collectives(text)
  # FSDP gathers the parameters in float16 for its matmuls; a float32 gather of one would be a gradient.
  assert not [c for c in found if c[:2] == ("all-gather", "f32") and c[2] in {(256, 1024), (1024, 256)}], found
  instructions = [shapes for shapes, op in COLLECTIVE.findall(text) if op == "all-reduce"]
  scalar_only = [shapes for shapes in instructions if re.fullmatch(r"\(?(\w+\[\](\{\})?(, )?)+\)?", shapes)]
  assert len(scalar_only) == (0 if layout == "data_parallel" else 1), instructions


# ---------------------------------------------------------------- shard_map and pmap


def psum_dtypes(jaxpr):
  """The operand dtypes of every cross-device sum in ``jaxpr``, nested programs included."""
  found = []
  for eqn in jaxpr.eqns:
    if eqn.primitive.name in ("psum", "psum_invariant", "psum2"):
      found += [str(v.aval.dtype) for v in eqn.invars if v.aval.ndim]
    for value in eqn.params.values():
      for item in value if isinstance(value, (tuple, list)) else (value,):
        inner = getattr(item, "jaxpr", item)
        if hasattr(inner, "eqns"):
          found += psum_dtypes(inner)
  return found


@pytest.mark.parametrize("mapping", ["shard_map", "pmap"])
@pytest.mark.parametrize("policy", ["mixed_bfloat16", "mixed_float16", "mixed_float8", "reduce=bfloat16"])
def test_mapped_steps_reduce_gradients_in_the_reduce_dtype_where_jax_sums_them(policy, mapping):
  """Under `shard_map`, JAX sums a replicated parameter's gradient (the transpose of its `pvary`):
  autocast makes that sum run in `reduce_dtype`. Under `pmap` the sum is the user's `pmean` of what
  leaves autocast, the gradients in the parameters' dtype, whatever the policy."""
  spec = POLICIES.get(policy, (policy,))[0]
  if policy == "mixed_float8":  # products too small for float8 to pay on an H100: in float8 all the same
    spec += ",min_intensity=0"
  loss = jaxscale.autocast(lambda p, x: jnp.mean(jnp.square(mlp(p, x).astype(jnp.float32))), spec)

  def step(scaler, params, x):
    _, grads, finite = jaxscale.value_and_grad(loss, axis_name="d")(scaler, params, x)
    return (jax.lax.pmean(grads, "d") if mapping == "pmap" else grads), finite

  params = {"w1": jnp.ones((64, 256)) / 16, "w2": jnp.ones((256, 64)) / 16}
  x = jnp.linspace(-1, 1, 8 * 16 * 64).reshape(8 * 16, 64)  # 16 rows a device: a float8 tile
  if mapping == "pmap":
    mapped = jax.pmap(step, axis_name="d", in_axes=(None, None, 0))
    x = x.reshape(8, 16, 64)
  else:
    mapped = jax.shard_map(step, mesh=mesh(), in_specs=(P(), P(), P("d")), out_specs=(P(), P()))
  dtypes = psum_dtypes(jax.make_jaxpr(mapped)(jaxscale.init(), params, x).jaxpr)
  expected = "bfloat16" if policy == "reduce=bfloat16" and mapping == "shard_map" else "float32"
  assert dtypes and set(dtypes) == {expected}, dtypes
  grads, finite = mapped(jaxscale.init(init_scale=1.0), params, x)  # float16 holds these unscaled
  assert bool(np.all(finite)) and all(g.dtype == np.float32 for g in jax.tree.leaves(grads))


@pytest.mark.parametrize("policy, reduced", [("mixed_bfloat16", "f32"), ("p=f32,c=bf16,o=f32,reduce=bf16", "bf16")])
def test_a_convolutions_weight_gradient_crosses_devices_in_the_reduce_dtype(policy, reduced, tmp_path):
  def net(w, x):
    return jax.lax.conv_general_dilated(x, w, (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC"))

  w = jax.ShapeDtypeStruct((3, 3, 64, 64), jnp.float32, sharding=NamedSharding(mesh(), P()))
  x = jax.ShapeDtypeStruct((64, 16, 16, 64), jnp.float32, sharding=NamedSharding(mesh(), P("d")))
  f = jaxscale.autocast(net, policy)
  grad = jax.jit(jax.grad(lambda w, x: jnp.mean(jnp.square(f(w, x).astype(jnp.float32)))))
  found = collectives(partitioned(grad.trace(w, x).lower(), tmp_path))
  assert {dtype for op, dtype, shape in found if shape == (3, 3, 64, 64)} == {reduced}, found
