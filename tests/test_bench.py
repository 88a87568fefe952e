"""The benchmark times what it says: each variant steps like its unscaled twin and skips an inf.

A peer wired up wrong (unscaling by the wrong scale, or never skipping) would make its timings
meaningless; so would jaxscale's. The variants whose library is missing here are skipped.
"""

import importlib.util
import pathlib
import sys
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

pytestmark = pytest.mark.newest_only


def _load_bench():
  path = pathlib.Path(__file__).parents[1] / "benchmarks" / "bench.py"
  spec = importlib.util.spec_from_file_location("bench", path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


bench = _load_bench()
NEEDS = {"jmp+apply_if_finite": "jmp", "flax DynamicScale": "flax", "mpx": "mpx"}
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


@pytest.mark.parametrize("variant", SCALED)
def test_a_finite_step_matches_the_unscaled_twin(variant):
  _require(variant)
  _require(_twin(variant))
  _, stepped, _, _ = _one_step(variant)
  _, reference, _, _ = _one_step(_twin(variant))
  for got, want in zip(stepped, reference, strict=True):
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("variant", SCALED)
def test_an_inf_step_is_skipped_and_the_scale_backs_off(variant):
  _require(variant)
  _, grads = bench.optimizer_problem(3000, 3)
  grads[1] = grads[1].at[7].set(jnp.inf)
  params, stepped, state, new_state = _one_step(variant, grads)
  for got, want in zip(stepped, params, strict=True):
    np.testing.assert_array_equal(got, want)
  assert float(bench._current_scale(new_state)) == float(bench._current_scale(state)) / 2


def test_the_quick_page_data_and_chart_are_written(tmp_path):
  pytest.importorskip("matplotlib")
  variants = ["plain", "jaxscale"]
  config = dict(problem="optimizer step", opt="adam", params=3000, leaves=3)
  rows = bench.measure(config, bench.optimizer_builders("adam", 3000, 3, variants), reps=2)
  info = bench.run_info(types.SimpleNamespace(quick=True, reps=2))
  bench.write_data(rows, info, tmp_path / "benchmarks.json")
  bench.write_markdown(rows, info, tmp_path / "benchmarks.md")
  page = (tmp_path / "benchmarks.md").read_text()
  assert "| optimizer step | adam | 0.0M | 3 | jaxscale |" in page
  assert [r["variant"] for r in rows] == variants
  # Each ratio is the variant's median over the plain one's, as the page prints them.
  plain, scaled = rows
  assert scaled["ratio"] == pytest.approx(scaled["ms"] / plain["ms"], rel=1e-9)
  assert f"| {scaled['ratio']:.2f} |" in page
  # The data reads back as written, and --replot rewrites the page from it alone.
  read, read_info = bench.read_data(tmp_path / "benchmarks.json")
  assert read == rows and read_info == info
  (tmp_path / "benchmarks.md").unlink()
  argv, sys.argv = sys.argv, ["bench.py", "--replot", str(tmp_path / "benchmarks.json")]
  try:
    bench.main()
  finally:
    sys.argv = argv
  assert (tmp_path / "benchmarks.md").read_text() == page
  assert (tmp_path / "benchmarks.png").stat().st_size > 0


@pytest.mark.slow  # the benchmark's language model, compiled for two libraries
def test_the_mpx_lm_step_steps_like_jaxscales():
  pytest.importorskip("mpx")
  builders = bench.lm_builders("adam", 16, 1, ["jaxscale", "mpx"], seq_len=8, batch=2, heads=2)
  stepped = {}
  for variant, build in builders.items():
    params, state, args, step = build()
    before = jax.device_get(params)
    params, state = jax.jit(step)(params, state, *args)
    assert not np.array_equal(jax.device_get(params)["embed"], before["embed"])
    stepped[variant] = (jax.device_get(params), float(bench._current_scale(state)))
  assert stepped["mpx"][1] == stepped["jaxscale"][1] == bench.SCALE
  # Both take Adam's first step on the same float16-computed gradients.
  for got, want in zip(jax.tree.leaves(stepped["mpx"][0]), jax.tree.leaves(stepped["jaxscale"][0]), strict=True):
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_the_page_names_what_a_configuration_leaves_out():
  row = lambda v, leaves: dict(problem="optimizer step", opt="adam", params=8e6, leaves=leaves, variant=v)
  rows = [row("plain", 48), row("flax DynamicScale", 48), row("plain", 1000)]
  assert bench.missing_text(rows)[0].startswith("*flax DynamicScale* is not run at optimizer step adam 8M/1000 (")
