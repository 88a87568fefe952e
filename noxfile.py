"""Test sessions on the newest and the oldest versions of jax, optax and flax that jaxscale supports.

    nox -s tests-newest   # what README's test command installs (the newest releases)
    nox -s tests-oldest   # the lower bounds of pyproject.toml, pinned exactly
    nox -s tests-3.12 tests-3.13   # the newest JAX the index serves there (newer than 3.11 gets)

A fresh install on Python 3.12 or newer gets a newer JAX than one on 3.11 (0.12 against 0.10 on
2026-11-25), and jaxscale reads JAX's jaxprs (autocast, precision_report), whose details change
between releases: those two sessions run the library's tests there (LIBRARY_ONLY below: not the
examples', docs' and peers', which tests-newest runs, nor the 8-device subprocess twice).

The oldest session pins jax, jaxlib, optax and flax to the lower bounds in pyproject.toml (keep the
two in step: these pins are what proves the bounds), installs the rest of the `test` extra at
whatever versions pip finds compatible with them, and leaves torch out: the parity tests then run
against the committed torch fixtures. It runs the library's tests, not the examples' and docs'
(NEWEST_ONLY below). Arguments after `--` go to pytest.
"""

import pathlib
import tomllib

import nox
from packaging.version import Version

nox.options.default_venv_backend = "venv"
nox.options.reuse_existing_virtualenvs = True
nox.options.sessions = ["tests-newest", "tests-oldest", "tests-3.12", "tests-3.13"]

OLDEST = ["jax==0.7.1", "jaxlib==0.7.1", "optax==0.2.5", "flax==0.12.0"]

PYPROJECT = tomllib.loads(pathlib.Path(__file__).with_name("pyproject.toml").read_text())


# What the oldest session leaves to the newest: the examples, the docs pages, the peers' guides and
# the benchmark's peers. They test what users run with the newest releases (and the peers' own
# newest versions), not jaxscale's lower bounds, and they are half the suite's time.
NEWEST_ONLY = ["tests/test_examples.py", "tests/test_tensorboard_example.py", "tests/test_docs.py",
               "tests/test_migration.py", "tests/test_bench.py"]


# What the newer Pythons' sessions leave out besides: the 8-device subprocess (run by tests-3.12,
# left to it by tests-3.13) and the multi-process runs, which test jaxscale's collectives, not JAX's
# jaxpr format.
LIBRARY_ONLY = [*NEWEST_ONLY, "tests/test_multihost.py"]


def pytest_args(session, *, ignore=()):
  return session.posargs or ["-n", "2", "-q", *(f"--ignore={path}" for path in ignore)]


@nox.session(name="tests-newest")
def tests_newest(session):
  session.install("-e", ".[test]")
  session.run("python", "-m", "pytest", *pytest_args(session))


@nox.session(name="tests-oldest")
def tests_oldest(session):
  project = PYPROJECT["project"]
  bounds = {
      _name(dep): dep.split(">=")[1]
      for dep in project["dependencies"] + project["optional-dependencies"]["flax"]
      if ">=" in dep
  }
  for pin in OLDEST:
    name, version = pin.split("==")
    if name in bounds and Version(bounds[name]) != Version(version):
      session.error(f"noxfile.py pins {pin} but pyproject.toml allows {name}>={bounds[name]}: keep them equal.")
  test_extra = project["optional-dependencies"]["test"]
  pinned = {pin.split("==")[0] for pin in OLDEST}
  rest = [dep for dep in test_extra if _name(dep) not in pinned | {"torch"}]
  session.install(*OLDEST, *rest)
  session.install("--no-deps", "-e", ".")
  session.run("python", "-m", "pip", "check")
  session.run("python", "-m", "pytest", *pytest_args(session, ignore=NEWEST_ONLY))


@nox.session(name="tests-3.12", python="3.12")
def tests_312(session):
  session.install("-e", ".[test]")
  session.run("python", "-m", "pytest", *pytest_args(session, ignore=LIBRARY_ONLY))


@nox.session(name="tests-3.13", python="3.13")
def tests_313(session):
  session.install("-e", ".[test]")
  session.run("python", "-m", "pytest", *pytest_args(session, ignore=[*LIBRARY_ONLY, "tests/test_multidevice.py"]))


def _name(requirement):
  for separator in "<>=!~[; ":
    requirement = requirement.split(separator)[0]
  return requirement.lower()
