"""Smoke tests: each example runs its three runs end to end at a tiny size and writes its figures;
``--precision`` runs any policy through jaxscale's mixed-precision pieces, and the metrics the
jitted step returns reach the table and TensorBoard; every flag has a help text that shows its
default, and the commands the usage texts give parse."""

import contextlib
import importlib
import math
import pathlib
import re
import shlex
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from test_tensorboard_example import read_scalars

import jaxscale

pytestmark = pytest.mark.newest_only

ROOT = pathlib.Path(__file__).parents[1]
EXAMPLES = str(ROOT / "examples")
COMMON_FLAGS = ["--steps", "6", "--eval-every", "3", "--no-progress"]


def import_example(name):
  sys.path.insert(0, EXAMPLES)
  try:
    return importlib.import_module(name)
  finally:
    sys.path.remove(EXAMPLES)


def run_example(name, argv):
  return import_example(name).main(COMMON_FLAGS + argv)


def check_results(results, out):
  assert [r.name for r in results] == ["float32", "float16", "float16 + jaxscale"]
  for r in results:
    assert len(r.loss) == 6 and r.eval_steps == [3, 6] and len(r.eval_metrics) == 2
    assert math.isfinite(r.eval_metrics[-1]["loss"])
    # Every step is timed on its own; the first one also compiles, which takes far longer than a step.
    assert r.step_seconds.shape == (6,) and (r.step_seconds > 0).all()
    assert r.ms_per_step == pytest.approx(1e3 * np.median(r.step_seconds[1:]))
    assert r.step_seconds[0] > r.ms_per_step / 1e3 and r.compile_s > 0
  assert results[0].final_scale == results[1].final_scale == 1.0
  # The table reports step time and compilation apart, run by run, and the output ends with its summary.
  lines = out.strip().splitlines()
  table = [line for line in lines if line.startswith("| ")]
  header = [c.strip() for c in table[-4].strip("|").split("|")]
  assert header[-2:] == ["ms/step (median, after step 1)", "compile s (step 1 minus median)"]
  versus = header.index("held-out loss vs float32")
  for r, row in zip(results, table[-3:]):
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells[0] == r.name and cells[-2:] == [f"{r.ms_per_step:.1f}", f"{r.compile_s:.1f}"]
    # Each run's held-out loss against float32's, computed here from the results.
    assert cells[versus] == f"{r.eval_metrics[-1]['loss'] / results[0].eval_metrics[-1]['loss'] - 1:+.1%}"
  # Same model, seed and first batch: the first losses agree to float16's precision.
  np.testing.assert_allclose([r.loss[0] for r in results[1:]], results[0].loss[0], rtol=1e-2)
  # The scaler's record (the scale after each step) is consistent: a skipped step halves the scale,
  # a taken one never lowers it.
  scaled = results[-1]
  for i in range(1, len(scaled.loss)):
    if scaled.skipped[i]:
      assert scaled.scale[i] == scaled.scale[i - 1] / 2, (i, scaled.scale)
    else:
      assert scaled.scale[i] >= scaled.scale[i - 1], (i, scaled.scale)


LM_TINY = ["--width", "16", "--depth", "1", "--heads", "2", "--seq-len", "16", "--batch", "4",
           "--data-mb", "0.05", "--eval-batches", "1"]


def markdown_tables(text):
  """The Markdown tables in ``text``, each as its rows of cells, after the line that precedes it."""
  tables = re.findall(r"([^\n|][^\n]*)\n((?:\|.*\|\n?)+)", text)
  return {caption: [[c.strip() for c in row.strip("|").split("|")] for row in rows.strip().splitlines()]
          for caption, rows in tables}


def table_rows(text):
  """The cells of every Markdown table row in ``text``."""
  return [[c.strip() for c in line.strip("|").split("|")] for line in text.splitlines() if line.startswith("|")]


@pytest.mark.slow  # runs the example's training
def test_quickstart_float16_loses_and_jaxscale_recovers_float32(capsys):
  """README's first command: float16 alone >= 3% worse than float32; float16 + jaxscale within 1% of it,
  in plain JAX, with a Linen TrainState and with an nnx.Optimizer; README shows the table it prints."""
  losses = import_example("quickstart").main()
  out = capsys.readouterr().out
  float32, float16, scaled, *flax_recipes = losses.values()
  assert float16 >= 1.03 * float32 and abs(scaled / float32 - 1) <= 0.01, losses
  # The Flax recipes run the same float16 operations from the same start on the same batches. One-ulp
  # changes to the start moved the scaled run's loss by at most 0.07% (8 starts), so 0.2% bounds any
  # other compilation of the same arithmetic.
  assert flax_recipes == pytest.approx([scaled, scaled], rel=2e-3), losses
  rows = table_rows(out)
  assert rows[0] == ["run", "held-out loss", "vs float32", "loss scale", "skipped steps"]
  assert [row[0] for row in rows[2:]] == list(losses)
  for row, loss in zip(rows[2:], losses.values()):
    assert float(row[1]) == pytest.approx(loss, rel=0.5), row  # one significant digit
  assert [row[2] for row in rows[2:]] == ["(reference)", "worse by 50% or more" if float16 >= 1.5 * float32
                                          else f"{float16 / float32 - 1:+.0%}"] + ["within 1%"] * 3
  # float16 alone never scales or skips; jaxscale keeps its start scale, 2**16: no gradient overflows.
  assert [row[3:] for row in rows[2:]] == [["1", "0"]] * 2 + [["65536", "0"]] * 3
  if jax.devices()[0].platform == "cpu":  # README shows a CPU's table (a GPU may round float16 differently)
    readme = (ROOT / "README.md").read_text()
    shown = re.search(r"<!-- quickstart output -->\n```text\n(.*?)```", readme, re.S).group(1)
    assert table_rows(shown) == rows


@pytest.mark.slow  # runs the example's training
def test_lm(tmp_path, capsys):
  out = ["--out", str(tmp_path / "lm.png"), "--grad-hist", str(tmp_path / "grads.png")]
  results = run_example("lm", LM_TINY + out)
  text = capsys.readouterr().out
  check_results(results, text)
  assert (tmp_path / "lm.png").stat().st_size > 0 and (tmp_path / "grads.png").stat().st_size > 0
  # The start scale is the probe's (the default --init-scale is auto), printed with the range at it.
  suggested = float(re.search(r"suggested start scale 2\^(-?\d+)", text).group(1))
  assert results[-1].scale[0] == 2.0**suggested
  tables = markdown_tables(text)
  # The evidence: the range of the tapped activation gradients and of the parameter gradients, three ways.
  scale = math.log2(results[-1].final_scale)
  for caption in (f"Start scale 2^{suggested:g} (auto); the first batch's gradients in float16 at it:",
                  "float32 (reference):", "float16, no scaling:", f"float16 x 2^{scale:g} (jaxscale):"):
    rows = tables[caption]
    assert rows[0][:5] == ["name", "elements", "zero %", "subnormal %", "overflow %"]
    assert [row[0] for row in rows[2:]] == ["block0", "logits", "parameter gradients"]
    # elements: batch x length x width for a block's output, x 256 bytes for the logits.
    assert [int(row[1]) for row in rows[2:4]] == [4 * 16 * 16, 4 * 16 * 256]
    assert all(0 <= float(cell) <= 100 for row in rows[2:] for cell in row[2:7])
  # At the probe's start no gradient overflows, and every activation gradient is a normal float16.
  start = tables[f"Start scale 2^{suggested:g} (auto); the first batch's gradients in float16 at it:"]
  assert all(float(row[4]) == 0 for row in start[2:])
  assert all(float(row[2]) == float(row[3]) == 0 for row in start[2:4])


@pytest.mark.slow  # runs the example's training
def test_lm_auto_init_scale_skips_no_start_up_step_where_torchs_start_skips_some(capsys):
  """A loss summed over the batch's 64 tokens (--loss-weight 64): 2**16 overflows, the probe's start does not."""
  lm = import_example("lm")
  summed = LM_TINY + ["--runs", "2", "--steps", "3", "--eval-every", "3", "--loss-weight", "64", "--no-plot"]
  # torch's start is a number: the training loop alone (main adds the probe's report and the
  # gradient tables, which test_lm checks).
  args = lm.parse_args(summed + ["--init-scale", "65536", "--no-progress"])
  (torch_start,), _, _ = lm.train_runs(args, *lm.load_data(args))
  auto = lm.main(summed + ["--init-scale", "auto", "--no-progress"])[-1]
  capsys.readouterr()
  # The scale after each step: halving from 2**16, still overflowing.
  assert torch_start.skipped.all() and np.array_equal(torch_start.scale, 2.0 ** np.arange(15, 12, -1))
  assert auto.scale[0] < 2.0**14 and not auto.skipped.any()


@pytest.mark.slow  # runs the example's training
def test_digits(tmp_path, capsys):
  results = run_example("digits", ["--width", "4", "--batch", "16", "--out", str(tmp_path / "digits.png")])
  check_results(results, capsys.readouterr().out)
  assert (tmp_path / "digits.png").stat().st_size > 0


PRECISIONS = {  # spec: (param dtype, compute dtype, loss scaling, how matmuls run beyond that)
    "float32": (jnp.float32, jnp.float32, False, ""),
    "mixed_float16": (jnp.float32, jnp.float16, True, ""),
    "mixed_bfloat16": (jnp.float32, jnp.bfloat16, False, ""),
    "mixed_float8": (jnp.float32, jnp.bfloat16, False, ",matmul=float8_e4m3fn"),
    # float16 parameters: test_lm_float16_parameters_train_through_float32_master_weights.
}


@pytest.mark.slow  # runs the example's training
@pytest.mark.parametrize("spec", list(PRECISIONS))
def test_lm_precision_runs_any_policy_and_logs_it_to_tensorboard(spec, tmp_path, capsys):
  param_dtype, compute_dtype, scaling, matmul = PRECISIONS[spec]
  tensorboard = ["--tensorboard", str(tmp_path), "--log-every", "4"]
  # The tiny LM's matmuls are far below the size at which float8 pays: autocast says they run in bfloat16.
  said = pytest.warns(UserWarning, match="runs none of its") if "float8" in matmul else contextlib.nullcontext()
  with said:
    (result,) = run_example("lm", LM_TINY + ["--no-plot", "--precision", spec, *tensorboard])
  out = capsys.readouterr().out
  policy = f"params={jnp.dtype(param_dtype).name},compute={jnp.dtype(compute_dtype).name},output=float32{matmul}"
  assert f"{spec}: {policy} through jaxscale.autocast, loss scaling {scaling}" in out
  assert ("master weights" in out) == (param_dtype == jnp.float16)
  assert result.name == spec and result.scaling == scaling and np.isfinite(result.loss).all()
  # The scale the table shows is the scaler's: the probe's start where float16 needs it (nothing skips or
  # grows in 6 steps), 1 (disabled) elsewhere.
  start = re.search(r"^Start scale 2\^(\d+)", out, re.M)
  assert (start is not None) == scaling
  assert result.final_scale == result.final_metrics["scale"] == (2.0 ** int(start.group(1)) if scaling else 1.0)
  assert set(result.final_metrics) == set(jaxscale.metrics(jaxscale.init()))
  assert result.final_metrics["skipped_steps"] == result.skipped.sum()
  header = next(line for line in out.splitlines() if line.startswith("| run |")).split("|")
  row = next(line for line in out.splitlines() if line.startswith(f"| {spec} |")).split("|")
  skipped = header.index(" skipped steps ")
  assert row[skipped:skipped + 2] == [f" {result.final_metrics['skipped_steps']:g} ", f" {result.final_scale:g} "]
  # TensorBoard, in the run's own folder: the loss and every scaler metric every 4 steps and after
  # the last, and each held-out loss.
  (logdir,) = tmp_path.iterdir()
  scalars = read_scalars(str(logdir))
  assert set(scalars) == {"loss", "heldout/loss", *(f"scaler/{k}" for k in result.final_metrics)}
  assert [step for step, _ in scalars["loss"]] == [4, 6]
  assert [v for _, v in scalars["loss"]] == pytest.approx(result.loss[[3, 5]], rel=1e-6)
  assert [v for _, v in scalars["scaler/scale"]] == list(result.scale[[3, 5]])
  heldout = [(step, pytest.approx(m["loss"])) for step, m in zip(result.eval_steps, result.eval_metrics)]
  assert scalars["heldout/loss"] == heldout


@pytest.mark.slow  # runs the example's training
def test_lm_precision_float32_is_the_flax_dtype_run_bit_for_bit():
  """Through autocast, float32 is the three-run comparison's float32 model itself, step for step."""
  lm = import_example("lm")
  (flax_dtype,) = lm.main(COMMON_FLAGS + LM_TINY + ["--no-plot", "--runs", "0"])
  precisions = ["--precision", "f32", "--precision", "p=f32,c=f16,o=f32"]
  autocast, float16 = lm.main(COMMON_FLAGS + LM_TINY + ["--no-plot", *precisions])
  assert autocast.name == "float32"  # however float32 is spelt, it is the summary's reference
  np.testing.assert_array_equal(autocast.loss, flax_dtype.loss)
  # float16 really computes (it rounds differently), with float32's parameters, output and updates.
  assert not np.array_equal(float16.loss, autocast.loss)
  np.testing.assert_allclose(float16.loss, autocast.loss, rtol=1e-3)


@pytest.mark.slow  # runs the example's training
def test_lm_float16_parameters_train_through_float32_master_weights(capsys):
  lm = import_example("lm")
  # train_runs without main: no probe (main's probe, table and TensorBoard log are the same for
  # every policy: test_lm_precision_runs_any_policy_and_logs_it_to_tensorboard), so a number for
  # the start scale.
  args = lm.parse_args(
      COMMON_FLAGS + LM_TINY + ["--no-plot", "--precision", "p=f16,c=f16,o=f32", "--init-scale", "65536"]
  )
  train_data, eval_windows = lm.load_data(args)
  initial = nnx.state(lm.build(args, jnp.float16, args.seed, jaxscale.get_policy("p=f16,c=f16,o=f32")), nnx.Param)
  (result,), model, optimizer = lm.train_runs(args, train_data, eval_windows)
  assert ("p=f16,c=f16,o=f32: params=float16,compute=float16,output=float32 through jaxscale.autocast, loss "
          "scaling True, float32 master weights (jaxscale.master_weights)") in capsys.readouterr().out
  params = nnx.state(model, nnx.Param)
  assert {x.dtype for x in jax.tree.leaves(params)} == {jnp.dtype(jnp.float16)}
  state = optimizer.opt_state
  assert isinstance(state, jaxscale.MasterWeightsState)
  master = jax.tree.leaves(state.master)
  assert {x.dtype for x in master} == {jnp.dtype(jnp.float32)}
  for m, p in zip(master, jax.tree.leaves(params)):  # the parameters are the master, rounded
    m16, p = np.asarray(m).astype(np.float16), np.asarray(p)
    # ... except where the last step more than doubled, halved or flipped a parameter: float16
    # updates then land within one ulp of the step (jaxscale.master_weights' docstring).
    assert np.mean(m16 == p) > 0.95
    np.testing.assert_allclose(p.astype(np.float32), m16.astype(np.float32), rtol=0, atol=2e-6)
  moved = [not np.array_equal(a, b) for a, b in zip(jax.tree.leaves(initial), jax.tree.leaves(params))]
  assert all(moved)
  # The numbers the loop read are the optimizer's own.
  expected = {k: float(v) for k, v in jaxscale.metrics(state).items()}
  assert result.final_metrics == expected and expected["scale"] == 2.0**16


def test_tensorboard_without_tensorboardx_names_the_extra(tmp_path, monkeypatch):
  monkeypatch.setitem(sys.modules, "tensorboardX", None)  # makes `import tensorboardX` fail
  with pytest.raises(ImportError, match=re.escape("pip install 'jaxscale[tensorboard]'")):
    import_example("_common").tensorboard_writer(str(tmp_path), "run")


@pytest.mark.slow  # runs the example's training
def test_digits_precision_runs_float16_parameters_through_autocast(capsys):
  argv = ["--width", "4", "--batch", "16", "--no-plot", "--precision", "float32", "--precision", "p=f16,c=f16,o=f32"]
  results = run_example("digits", argv)
  assert [r.name for r in results] == ["float32", "p=f16,c=f16,o=f32"]
  assert "float32 master weights" in capsys.readouterr().out
  assert results[1].final_scale == 2.0**16 and all(np.isfinite(r.loss).all() for r in results)


def help_entries(name, capsys):
  """The ``--help`` text of an example, and its flags' entries (each entry's lines joined)."""
  module = import_example(name)
  with pytest.raises(SystemExit) as exit_info:
    module.parse_args(["--help"])
  assert exit_info.value.code == 0
  text = capsys.readouterr().out
  options = text.split("options:\n", 1)[1].split("\n\n", 1)[0]
  entries = re.split(r"\n(?=  -)", options.strip("\n"))
  return text, [" ".join(entry.split()) for entry in entries]


@pytest.mark.parametrize("name", ["lm", "digits", "data_parallel"])
def test_every_flag_has_help_and_shows_its_default(name, capsys):
  _, entries = help_entries(name, capsys)
  assert len(entries) > 5
  for entry in entries:
    # argparse shows a default only in a flag's help text: no help, no default.
    if not entry.startswith("-h, --help"):
      assert re.search(r"\(default: [^)]+\)$", entry), entry


@pytest.mark.parametrize("name", ["lm", "digits", "data_parallel"])
def test_commands_in_the_usage_text_parse(name, capsys):
  """Every command the docstring (and so --help) suggests names only flags the example has."""
  module = import_example(name)
  commands = re.findall(rf"^\s*(?:\S+=\S+ )*python examples/{name}\.py(.*?)(?:\s+#.*)?$", module.__doc__, re.M)
  assert commands
  for command in commands:
    module.parse_args(shlex.split(command))


def test_data_parallel_help_gives_the_two_process_commands_of_the_docs(capsys):
  text, _ = help_entries("data_parallel", capsys)
  docs = (ROOT / "docs" / "distributed.md").read_text()
  two_process = [line for line in docs.splitlines() if line.startswith("python examples/data_parallel.py")
                 and "127.0.0.1" in line]
  assert len(two_process) == 2
  for line in two_process:
    assert line in text


@pytest.mark.parametrize("value", ["0", "-3", "x"])
def test_log_every_must_be_a_positive_integer(value, capsys):
  with pytest.raises(SystemExit) as exit_info:
    import_example("lm").parse_args(["--log-every", value])
  assert exit_info.value.code == 2 and "expected an integer >= 1" in capsys.readouterr().err


def test_find_overflow_names_the_pass_and_layer_of_each_skipped_step(capsys):
  """The scale's skips overflow in the backward pass; the corrupted batch's in the first layer's input cast."""
  example = import_example("find_overflow")
  steps, corrupt = 6, 5
  skipped = example.main(["--steps", str(steps), "--corrupt-step", str(corrupt)])
  assert corrupt in skipped and all(report is not None and report.skips_step for report in skipped.values())
  # The scaler halves the scale at each skip, from torch's 2^16, and grows none in so few steps.
  assert [r.scale for r in skipped.values()] == [2.0**16 / 2**i for i in range(len(skipped))]
  assert {r.phase for step, r in skipped.items() if step != corrupt} == {"backward"}
  report = skipped.pop(corrupt)
  assert (report.primitive, report.phase, report.name_stack, report.dtype) == (
      "convert_element_type", "forward", "MLP/hidden", "float16")
  x, _ = list(example.batches(steps, corrupt))[corrupt]
  assert report.max_input_magnitude == np.abs(np.asarray(x)).max() > np.finfo(np.float16).max
  assert f"step {corrupt} skipped: convert_element_type in `MLP/hidden`" in capsys.readouterr().out
