"""The benchmark times what it says: each variant steps like its unscaled twin and skips an inf.

A peer wired up wrong (unscaling by the wrong scale, or never skipping) would make its timings
meaningless; so would jaxscale's. The variants whose library is missing here are skipped.
"""

import importlib.util
import pathlib
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest


def _load_bench():
  path = pathlib.Path(__file__).parents[1] / "benchmarks" / "bench.py"
  spec = importlib.util.spec_from_file_location("bench", path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


bench = _load_bench()
NEEDS = {"jmp+apply_if_finite": "jmp", "flax DynamicScale": "flax"}
SCALED = [v for v in bench.VARIANTS if v not in bench.UNSCALED]


def _require(variant):
  if variant in bench.KERAS_VARIANTS:
    if bench.import_keras() is None:
      pytest.skip("keras 3 with the JAX backend is not installed")
  elif variant in NEEDS:
    pytest.importorskip(NEEDS[variant])


def _twin(variant):
  return "plain keras" if variant in bench.KERAS_VARIANTS else "plain"


def _one_step(variant, grads=None):
  """(params before, params after, state before, state after) of one jitted step."""
  params, state, (problem_grads,), step = bench.optimizer_builders("adam", 3000, 3, [variant])[variant]()
  before = (jax.device_get(params), jax.device_get(state))
  params, state = jax.jit(step)(params, state, problem_grads if grads is None else grads)
  return before[0], jax.device_get(params), before[1], jax.device_get(state)


@pytest.mark.hand_made_gradients  # the benchmark times the update on given scaled gradients
@pytest.mark.parametrize("variant", SCALED)
def test_a_finite_step_matches_the_unscaled_twin(variant):
  _require(variant)
  _require(_twin(variant))
  _, stepped, _, _ = _one_step(variant)
  _, reference, _, _ = _one_step(_twin(variant))
  for got, want in zip(stepped, reference, strict=True):
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-7)


@pytest.mark.hand_made_gradients  # the benchmark times the update on given scaled gradients
@pytest.mark.parametrize("variant", SCALED)
def test_an_inf_step_is_skipped_and_the_scale_backs_off(variant):
  _require(variant)
  _, grads = bench.optimizer_problem(3000, 3)
  grads[1] = grads[1].at[7].set(jnp.inf)
  params, stepped, state, new_state = _one_step(variant, grads)
  for got, want in zip(stepped, params, strict=True):
    np.testing.assert_array_equal(got, want)
  assert float(bench._current_scale(new_state)) == float(bench._current_scale(state)) / 2


@pytest.mark.hand_made_gradients  # the benchmark times the update on given scaled gradients
def test_the_quick_page_and_chart_are_written(tmp_path):
  pytest.importorskip("matplotlib")
  variants = ["plain", "jaxscale"]
  config = dict(problem="optimizer step", opt="adam", params=3000, leaves=3)
  rows = bench.measure(config, bench.optimizer_builders("adam", 3000, 3, variants), reps=2)
  args = types.SimpleNamespace(quick=True, reps=2)
  bench.write_markdown(rows, tmp_path / "benchmarks.md", args)
  bench.write_chart(rows, tmp_path / "benchmarks.png")
  page = (tmp_path / "benchmarks.md").read_text()
  assert "| optimizer step | adam | 0.0M | 3 | jaxscale |" in page
  assert (tmp_path / "benchmarks.png").stat().st_size > 0
  assert [r["variant"] for r in rows] == variants
  # Each ratio is the variant's median over the plain one's, as the page prints them.
  plain, scaled = rows
  assert scaled["ratio"] == pytest.approx(scaled["ms"] / plain["ms"], rel=1e-9)
  assert f"| {scaled['ratio']:.2f} |" in page


def test_a_written_page_reads_back_for_replotting(tmp_path):
  rows = [dict(problem="optimizer step", opt="adam", params=8e6, leaves=48, variant=v, ms=ms, ratio=ms / 2.0,
               ratio_q1=ms / 2.0 - 0.01, ratio_q3=ms / 2.0 + 0.02, compile_s=0.5, compile_ratio=1.0,
               memory_ratio=1.0, copies=0) for v, ms in [("plain", 2.0), ("jaxscale", 2.5)]]
  bench.write_markdown(rows, tmp_path / "benchmarks.md", types.SimpleNamespace(quick=True, reps=2))
  read, device = bench.rows_from_markdown(tmp_path / "benchmarks.md")
  assert device == bench.device_name()
  assert [(r["variant"], r["params"], r["leaves"], r["ratio"], r["ratio_q1"], r["ratio_q3"]) for r in read] == [
      ("plain", 8e6, 48, 1.0, 0.99, 1.02), ("jaxscale", 8e6, 48, 1.25, 1.24, 1.27)]
