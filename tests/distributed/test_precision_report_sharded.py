"""`precision_report` of `shard_map` and `pmap` over 8 devices: the body, traced at per-device shapes,
counts once per device (it was counted once); `autocast` of a `pmap` runs its matmuls in float16."""

import contextlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

import jaxscale
from jaxscale._interpret import JAX_VERSION

N, B, D, H = 8, 2, 3, 5
W = jnp.ones((D, H))
TOTAL = N * 2 * B * D * H  # every device's B x D times D x H
matmul = lambda x, w: jnp.tanh(x @ w)


def test_a_shard_map_body_counts_once_per_device_of_its_manual_axes():
  mesh = Mesh(np.array(jax.devices()[:N]).reshape(2, 4), ("a", "b"))
  fun = jax.shard_map(matmul, mesh=mesh, in_specs=(P(("a", "b")), P()), out_specs=P(("a", "b")))
  x = jnp.ones((N * B, D))
  assert jaxscale.precision_report(fun, x, W).matmul_flops == {"float32": TOTAL}
  cast = jaxscale.autocast(fun, "mixed_float16")
  if JAX_VERSION >= (0, 8, 0):
    # Its body's values carry the mesh axes they vary along, and tracing it again needs the
    # manual-mesh context only shard_map itself sets up: refused by name instead.
    with pytest.raises(NotImplementedError, match=f"`shard_map` on jax {jax.__version__}"):
      cast(x, W)
    return
  assert jaxscale.precision_report(cast, x, W).matmul_flops == {"float16": TOTAL}
  np.testing.assert_allclose(cast(x, W), fun(x, W), rtol=2**-10)  # tanh(3) in float16: one rounding


def test_autocast_of_a_pmap_runs_every_device_in_float16():
  fun, x = jax.pmap(matmul, in_axes=(0, None)), jnp.ones((N, B, D))
  assert jaxscale.precision_report(fun, x, W).matmul_flops == {"float32": TOTAL}
  cast = jaxscale.autocast(fun, "mixed_float16")
  report = jaxscale.precision_report(cast, x, W)
  assert report.matmul_flops == {"float16": TOTAL} and report.matmul_counts == {"float16": N}
  # Before jax 0.8, pmap is its own primitive, and autocast's jit around it makes JAX warn.
  warns = pytest.warns(UserWarning, match="includes a pmap") if JAX_VERSION < (0, 8, 0) else contextlib.nullcontext()
  with warns:
    np.testing.assert_allclose(cast(x, W), fun(x, W), rtol=2**-10)  # tanh(3) in float16: one rounding
