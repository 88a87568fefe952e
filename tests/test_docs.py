"""Every code example in README.md and docs/ runs, so the docs cannot rot.

One test per page. The page's ```python blocks run in order in one shared
namespace; ```pycon blocks (``>>>`` sessions) run as doctests in that same
namespace. Two HTML comments, invisible on GitHub and on the site, mark the
exceptions and the checks:

- ``<!-- not run: <reason> -->`` on the line before a block skips it; the
  reason must be given, and the test lists it.
- ``<!-- expected output -->`` on the line before a ```text block makes it the
  expected stdout of the python block just above it (doctest's matching:
  whitespace is normalised and ``...`` matches anything).
"""

from __future__ import annotations

import contextlib
import dataclasses
import doctest
import io
import pathlib
import re

import jax
import pytest

pytestmark = pytest.mark.newest_only

ROOT = pathlib.Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]

FENCE = re.compile(r"^(?P<indent> *)(?P<ticks>`{3,})(?P<info>[^`]*)$")
NOT_RUN = re.compile(r"^\s*<!--\s*not run:(?P<reason>.*?)-->\s*$")
EXPECTED_OUTPUT = re.compile(r"^\s*<!--\s*expected output\s*-->\s*$")


@dataclasses.dataclass
class Block:
  language: str
  code: str
  line: int  # 1-based line of the opening fence
  not_run: str | None  # the reason, if marked `not run`
  expected_output: bool


def blocks(text: str) -> list[Block]:
  """The fenced code blocks of a markdown page, with the marks just above each."""
  lines = text.splitlines()
  found, i = [], 0
  while i < len(lines):
    opening = FENCE.match(lines[i])
    if not opening:
      i += 1
      continue
    indent, ticks = opening["indent"], opening["ticks"]
    end = next(
        (j for j in range(i + 1, len(lines)) if lines[j].strip() == ticks),
        None,
    )
    if end is None:
      raise ValueError(f"line {i + 1}: the code block opened here is never closed.")
    body = [line[len(indent):] if line.startswith(indent) else line for line in lines[i + 1:end]]
    above = lines[i - 1] if i > 0 else ""
    not_run = NOT_RUN.match(above)
    found.append(Block(
        language=opening["info"].strip().split(" ")[0].lower(),
        code="\n".join(body) + "\n",
        line=i + 1,
        not_run=not_run["reason"].strip() if not_run else None,
        expected_output=bool(EXPECTED_OUTPUT.match(above)),
    ))
    i = end + 1
  return found


def run_page(path: pathlib.Path, name: str) -> list[str]:
  """Runs a page's examples; returns the reasons given for the blocks not run."""
  namespace: dict = {"__name__": f"docs:{name}"}
  skipped, last_output = [], None
  for block in blocks(path.read_text()):
    where = f"{name}:{block.line}"
    if block.not_run is not None:
      assert block.not_run, f"{where}: `<!-- not run: -->` needs a reason after the colon."
      skipped.append(f"{where}: {block.not_run}")
      continue
    if block.expected_output:
      assert block.language == "text", f"{where}: an expected output must be a ```text block."
      assert last_output is not None, f"{where}: an expected output must follow a python block."
      if jax.default_backend() != "cpu":
        # The pages show the CPU's output: a GPU keeps some float16 intermediates of these tiny
        # models in float32 and overflows less (docs/troubleshooting.md, "Fewer overflows on a GPU").
        last_output = None
        continue
      checker = doctest.OutputChecker()
      flags = doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE
      assert checker.check_output(block.code, last_output, flags), (
          f"{where}: the block above printed\n{last_output}\nbut the page shows\n{block.code}"
      )
      last_output = None
      continue
    if block.language == "python":
      stdout = io.StringIO()
      with contextlib.redirect_stdout(stdout):
        exec(compile("\n" * block.line + block.code, name, "exec"), namespace)
      last_output = stdout.getvalue()
    elif block.language == "pycon":
      test = doctest.DocTestParser().get_doctest(block.code, namespace, where, name, block.line)
      runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
      report = io.StringIO()
      runner.run(test, out=report.write, clear_globs=False)
      assert not runner.failures, report.getvalue()
      last_output = None
  return skipped


# README's examples run in the fast tier, the docs pages' (about a minute of CPU time) in the full run.
TIERED = [p if p.name == "README.md" else pytest.param(p, marks=pytest.mark.slow) for p in PAGES]


@pytest.mark.parametrize("path", TIERED, ids=[p.relative_to(ROOT).as_posix() for p in PAGES])
def test_page_examples_run(path, tmp_path, monkeypatch, record_property):
  monkeypatch.chdir(tmp_path)  # whatever a page writes lands in a scratch directory
  skipped = run_page(path, path.relative_to(ROOT).as_posix())
  record_property("not_run", skipped)
  for reason in skipped:
    print(f"not run: {reason}")  # shown by `pytest -rP`


def test_marks_are_read_and_checked(tmp_path):
  page = tmp_path / "page.md"
  page.write_text(
      "text\n\n```python\nx = 1\nprint(x + 1)\n```\n\n<!-- expected output -->\n```text\n2\n```\n\n"
      "<!-- not run: needs a GPU -->\n```python\nraise RuntimeError\n```\n\n"
      "```pycon\n>>> x * 3\n4\n```\n"
  )
  parsed = blocks(page.read_text())
  assert [(b.language, b.not_run, b.expected_output) for b in parsed] == [
      ("python", None, False), ("text", None, True), ("python", "needs a GPU", False), ("pycon", None, False)
  ]
  with pytest.raises(AssertionError, match=r"x \* 3"):  # x = 1 from the python block: 3, not 4
    run_page(page, "page.md")
  page.write_text("```pycon\n>>> x = 2\n>>> x * 3\n6\n```\n")
  assert run_page(page, "page.md") == []
  page.write_text("<!-- not run: -->\n```python\nraise RuntimeError\n```\n")
  with pytest.raises(AssertionError, match="needs a reason"):
    run_page(page, "page.md")
  page.write_text("<!-- not run: a GPU -->\n```python\nraise RuntimeError\n```\n")
  assert run_page(page, "page.md") == ["page.md:2: a GPU"]
  page.write_text("```python\nprint(1)\n```\n<!-- expected output -->\n```text\n2\n```\n")
  with pytest.raises(AssertionError, match="printed"):
    run_page(page, "page.md")
  page.write_text("```python\nprint(1, 2.25)\n```\n<!-- expected output -->\n```text\n1   2...\n```\n")
  assert run_page(page, "page.md") == []


@pytest.mark.parametrize("spec", ["mixed_float16", "mixed_bfloat16", "float32", "mixed_float8,min_intensity=0"])
def test_the_any_precision_script_scales_the_loss_exactly_when_its_policy_needs_it(spec):
  # docs/float8.md's "one script that runs in any precision", run under each policy it offers. A
  # scale of 2**120 makes any scaled float16 backward overflow: the step must then be skipped when
  # the policy computes in float16 (its loss is scaled) and taken otherwise (nothing to scale).
  import jaxscale

  page = ROOT / "docs" / "float8.md"
  setup, script = [b for b in blocks(page.read_text()) if b.language == "python"][:2]
  namespace: dict = {}
  with contextlib.redirect_stdout(io.StringIO()):
    exec(setup.code, namespace)
    namespace["policy"] = jaxscale.get_policy(spec)
    namespace["cast_loss"] = jaxscale.autocast(namespace["loss"], namespace["policy"])
    exec(script.code, namespace)
  opt_state, step = namespace["opt_state"], namespace["step"]
  scaler = jaxscale.find_scaler(opt_state)
  huge = opt_state._replace(scaler=jaxscale.configure(scaler, scale=2.0**120))
  _, after, _ = step(namespace["params"], huge)
  skipped = int(jaxscale.find_scaler(after).skipped_steps) - int(scaler.skipped_steps)
  assert skipped == int(jaxscale.needs_loss_scaling(spec))
