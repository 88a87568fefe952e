"""The compiled program's GEMMs (`compiled_report`), read from real optimized HLO.

The fixtures (tests/fixtures/hlo, written by record_hlo.py there) are one step compiled for an H100
(cuBLASLt and Triton GEMMs) and by XLA:CPU: the gradient of ``tanh(tanh(x @ w1) @ w2)`` with respect
to ``w1`` and ``w2`` under a float8 policy with the size rule off. By hand, from the model: two forward
products (float8_e4m3fn operands) and three backward ones, each taking the e5m2 gradient (dW2, the
gradient of the hidden activation, dW1; the input's is not asked for): five asked for in float8. The
independent count of what XLA emitted is the text's own: its `$f8` calls, its Triton GEMM fusions.
The live H100 programs are read in benchmarks/test_gpu_program.py (it needs the CUDA plugin).
"""

import pathlib
import re

import jax
import jax.numpy as jnp
import pytest

import jaxscale

FIXTURES = pathlib.Path(__file__).parent / "fixtures" / "hlo"
FORWARD, BACKWARD = 2, 3  # the model's float8 products, counted by hand (module docstring)
EVERY_MATMUL = "p=f32,c=bf16,o=f32,m=f8,min_intensity=0"


def fixture(name):
  return (FIXTURES / f"{name}_float8.hlo").read_text()


def test_the_h100_programs_cublas_gemms_are_all_float8_as_asked():
  text = fixture("h100")
  report = jaxscale.compiled_report(text)
  assert report.gemms == {"float8_e4m3fn": FORWARD, "float8_e5m2": BACKWARD}
  assert report.float8_gemms == report.asked_float8 == FORWARD + BACKWARD == text.count("__cublas$lt$matmul$f8")
  assert report.not_float8 == ()
  assert "float8: 5 GEMMs; 5 of the 5 asked for in float8" in str(report)


def test_the_h100_programs_triton_gemms_are_read_from_the_dot_they_fuse():
  text = fixture("h100_triton")
  report = jaxscale.compiled_report(text)
  triton = len(re.findall(r"= \S+ fusion\(.*\"kind\":\"__triton\w*gemm", text))
  assert "$f8" not in text and triton == FORWARD + BACKWARD
  assert report.gemms == {"float8_e4m3fn": FORWARD, "float8_e5m2": BACKWARD}
  assert report.float8_gemms == report.asked_float8 == triton and report.not_float8 == ()


def test_xla_cpu_runs_the_float8_products_in_float32_and_the_report_names_each():
  report = jaxscale.compiled_report(fixture("cpu"))
  assert report.gemms == {"float32": FORWARD + BACKWARD}
  assert report.float8_gemms == 0 and report.asked_float8 == FORWARD + BACKWARD
  assert len(report.not_float8) == FORWARD + BACKWARD
  assert all(n.endswith("(float32)") and "dot_general" in n for n in report.not_float8)
  assert "0 of the 5 asked for in float8" in str(report) and "not float8: jit(loss)/" in str(report)


def test_a_compiled_step_of_this_machine_is_read_as_its_text_is():
  """Live: what is asked for is what the jaxpr holds in float8, less the products XLA drops."""

  def loss(w1, w2, x):
    return jnp.sum(jnp.tanh(jnp.tanh(x @ w1) @ w2))

  args = jnp.ones((64, 64)), jnp.ones((64, 32)), jnp.ones((16, 64))
  step = jax.jit(jax.grad(jaxscale.autocast(loss, EVERY_MATMUL), argnums=(0, 1)))
  compiled = step.lower(*args).compile()
  report = jaxscale.compiled_report(compiled)
  assert report == jaxscale.compiled_report(compiled.as_text())
  assert report.asked_float8 == FORWARD + BACKWARD
  assert report.float8_gemms + len(report.not_float8) == report.asked_float8


def test_a_bfloat16_step_asks_for_no_float8():
  compiled = jax.jit(lambda w, x: jaxscale.autocast(lambda w, x: x @ w, "mixed_bfloat16")(w, x)).lower(
      jnp.ones((64, 64)), jnp.ones((16, 64))).compile()
  report = jaxscale.compiled_report(compiled)
  assert report.asked_float8 == report.float8_gemms == 0 and sum(report.gemms.values()) == 1


def test_a_lowered_program_is_refused_with_what_to_do():
  lowered = jax.jit(lambda x: x @ x).lower(jnp.ones((4, 4)))
  with pytest.raises(TypeError, match=r"call `\.compile\(\)` on it"):
    jaxscale.compiled_report(lowered)
