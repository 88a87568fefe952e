"""Smoke tests: each example runs its three runs end to end at a tiny size and writes its figures."""

import importlib
import math
import os
import sys

import numpy as np


EXAMPLES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples")
COMMON_FLAGS = ["--steps", "6", "--eval-every", "3", "--no-progress"]


def run_example(name, argv):
  sys.path.insert(0, EXAMPLES)
  try:
    return importlib.import_module(name).main(COMMON_FLAGS + argv)
  finally:
    sys.path.remove(EXAMPLES)


def check_results(results):
  assert [r.name for r in results] == ["float32", "float16", "float16 + jaxscale"]
  for r in results:
    assert len(r.loss) == 6 and r.eval_steps == [3, 6] and len(r.eval_metrics) == 2
    assert math.isfinite(r.eval_metrics[-1]["loss"])
  assert results[0].final_scale == results[1].final_scale == 1.0
  # Same model, seed and first batch: the first losses agree to float16's precision.
  np.testing.assert_allclose([r.loss[0] for r in results[1:]], results[0].loss[0], rtol=1e-2)
  # The scaler's record is consistent: a skipped step halves the next step's scale, a taken one
  # never lowers it.
  scaled = results[-1]
  for i in range(len(scaled.loss) - 1):
    if scaled.skipped[i]:
      assert scaled.scale[i + 1] == scaled.scale[i] / 2, (i, scaled.scale)
    else:
      assert scaled.scale[i + 1] >= scaled.scale[i], (i, scaled.scale)


def test_lm(tmp_path):
  tiny = ["--width", "16", "--depth", "1", "--heads", "2", "--seq-len", "16", "--batch", "4",
          "--data-mb", "0.05", "--eval-batches", "1"]
  out = ["--out", str(tmp_path / "lm.png"), "--grad-hist", str(tmp_path / "grads.png")]
  check_results(run_example("lm", tiny + out))
  assert (tmp_path / "lm.png").stat().st_size > 0 and (tmp_path / "grads.png").stat().st_size > 0


def test_digits(tmp_path):
  results = run_example("digits", ["--width", "4", "--batch", "16", "--out", str(tmp_path / "digits.png")])
  check_results(results)
  assert (tmp_path / "digits.png").stat().st_size > 0
