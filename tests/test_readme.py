"""README's quick start runs as printed and does what it says."""

import pathlib
import re


def test_quick_start_trains_and_backs_off(capsys):
  readme = (pathlib.Path(__file__).parents[1] / "README.md").read_text()
  (code,) = re.findall(r"```python\n(.*?)```", readme, re.S)[:1]
  exec(compile(code, "README.md", "exec"), {})
  loss, scale, skipped = re.fullmatch(r"loss (\S+), scale (\S+), skipped (\d+)\n", capsys.readouterr().out).groups()
  assert float(loss) < 1e-3
  assert float(scale) < 2.0**16 and int(skipped) >= 1
