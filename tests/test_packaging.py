"""What a user installs: the version in one place, a changelog, and optional extras named when missing.

The built sdist and wheel themselves are checked by `.ci/run` (build, twine check, contents,
a clean install of the wheel alone).
"""

import pathlib
import re
import subprocess
import sys

import pytest

import jaxscale

pytestmark = pytest.mark.version_independent

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_version_lives_only_in_jaxscale():
  tomllib = pytest.importorskip("tomllib")
  pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
  assert "version" not in pyproject["project"] and "version" in pyproject["project"]["dynamic"]
  assert pyproject["tool"]["setuptools"]["dynamic"]["version"] == {"attr": "jaxscale.__version__"}
  assert re.fullmatch(r"\d+\.\d+\.\d+((a|b|rc)\d+)?(\.dev\d+)?", jaxscale.__version__)


def test_changelog_has_an_unreleased_section():
  changelog = (ROOT / "CHANGELOG.md").read_text()
  assert "keepachangelog.com" in changelog
  assert re.search(r"^## \[Unreleased\]$", changelog, re.M)


def test_missing_flax_is_an_import_error_that_names_the_extra():
  # `sys.modules["flax"] = None` makes `import flax` fail as if Flax were not installed.
  code = "import sys; sys.modules['flax'] = None; import jaxscale.flax"
  out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
  assert out.returncode != 0
  last_line = out.stderr.strip().splitlines()[-1]
  assert last_line.startswith("ImportError: ") and "pip install 'jaxscale[flax]'" in last_line
  # The core package never needs Flax.
  code = "import sys; sys.modules['flax'] = None; import jaxscale; print(jaxscale.__version__)"
  out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True)
  assert out.stdout.strip() == jaxscale.__version__


def test_missing_equinox_is_an_import_error_that_names_the_extra():
  code = "import sys; sys.modules['equinox'] = None; import jaxscale.equinox"
  out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
  assert out.returncode != 0
  last_line = out.stderr.strip().splitlines()[-1]
  assert last_line.startswith("ImportError: ") and "pip install 'jaxscale[equinox]'" in last_line
  code = "import sys; sys.modules['equinox'] = None; import jaxscale; print(jaxscale.__version__)"
  out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True)
  assert out.stdout.strip() == jaxscale.__version__
