"""Smoke tests: each example runs its three runs end to end at a tiny size and writes its figures;
every flag has a help text that shows its default, and the commands the usage texts give parse."""

import importlib
import math
import pathlib
import re
import shlex
import sys

import numpy as np
import pytest

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
  assert "ms/step (median, after step 1)" in table[-4] and "compile s (step 1 minus median)" in table[-4]
  for r, row in zip(results, table[-3:]):
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells[0] == r.name and cells[-2:] == [f"{r.ms_per_step:.1f}", f"{r.compile_s:.1f}"]
  assert " ".join(lines[-3:]).endswith(".") and "Against float32's held-out loss" in "".join(out.split("\n\n")[-1])


LM_TINY = ["--width", "16", "--depth", "1", "--heads", "2", "--seq-len", "16", "--batch", "4", "--data-mb", "0.05",
           "--eval-batches", "1"]


def markdown_tables(text):
  """The Markdown tables in ``text``, each as its rows of cells, after the line that precedes it."""
  tables = re.findall(r"([^\n|][^\n]*)\n((?:\|.*\|\n?)+)", text)
  return {caption: [[c.strip() for c in row.strip("|").split("|")] for row in rows.strip().splitlines()]
          for caption, rows in tables}


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


def test_lm_auto_init_scale_skips_no_start_up_step_where_torchs_start_skips_some(capsys):
  """A loss summed over the batch's 64 tokens (--loss-weight 64): 2**16 overflows, the probe's start does not."""
  summed = LM_TINY + ["--runs", "2", "--steps", "3", "--eval-every", "3", "--loss-weight", "64", "--no-plot"]
  torch_start = import_example("lm").main(summed + ["--init-scale", "65536", "--no-progress"])[-1]
  auto = import_example("lm").main(summed + ["--init-scale", "auto", "--no-progress"])[-1]
  capsys.readouterr()
  assert torch_start.scale[0] == 2.0**16 and torch_start.skipped.all()  # halving, still overflowing
  assert np.array_equal(torch_start.scale, 2.0 ** np.arange(16, 13, -1))
  assert auto.scale[0] < 2.0**14 and not auto.skipped.any()


def test_digits(tmp_path, capsys):
  results = run_example("digits", ["--width", "4", "--batch", "16", "--out", str(tmp_path / "digits.png")])
  check_results(results, capsys.readouterr().out)
  assert 0 <= results[-1].eval_metrics[-1]["accuracy"] <= 1
  assert (tmp_path / "digits.png").stat().st_size > 0


def fake_run(name, held_out, skipped=0):
  common = import_example("_common")
  return common.Result(name=name, loss=np.full(3, held_out), scale=np.ones(3), skipped=np.arange(3) < skipped,
                       eval_steps=[3], eval_metrics=[{"loss": held_out}], step_seconds=np.ones(3), final_scale=1.0)


@pytest.mark.parametrize(
    "losses, expected",
    [
        ((2.0, 5.0, 2.01), "Against float32's held-out loss of 2.000, float16 loses to float32 (5.000, +150.0%) and "
         "float16 + jaxscale matches float32 (2.010, +0.5%) with 1 skipped step: loss scaling recovers what "
         "float16 alone loses."),
        ((2.0, math.nan, 2.01), "Against float32's held-out loss of 2.000, float16 diverged (held-out loss nan) and "
         "float16 + jaxscale matches float32 (2.010, +0.5%) with 1 skipped step: loss scaling recovers what "
         "float16 alone loses."),
        ((2.0, 2.02, 1.9), "Against float32's held-out loss of 2.000, float16 matches float32 (2.020, +1.0%) and "
         "float16 + jaxscale beats float32 (1.900, -5.0%) with 1 skipped step."),
    ],
    ids=["float16_loses", "float16_diverges", "all_train"],
)
def test_summary_says_what_the_table_shows(losses, expected):
  names = ["float32", "float16", "float16 + jaxscale"]
  results = [fake_run(name, loss, skipped=int(name.endswith("jaxscale"))) for name, loss in zip(names, losses)]
  assert import_example("_common").summary(results) == expected


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
