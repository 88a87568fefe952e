"""Test sessions on the newest and the oldest versions of jax, optax and flax that jaxscale supports.

    nox -s tests-newest   # what README's test command installs (the newest releases): every test
    nox -s tests-oldest   # the lower bounds of pyproject.toml, pinned exactly
    nox -s tests-3.13 tests-3.12   # the newest JAX the index serves there (newer than 3.11 gets)

What each session runs, and why, selected by the markers the test modules set (pyproject.toml's
`markers`). README's test command runs the fast tier (what is not marked `slow`); CI runs every
test once, on Python 3.11 (`-m "slow or not slow"`), and each session here runs the slow tests of
what it selects. The other sessions exist for the other JAX releases, so they run what depends on
JAX: the code that reads jaxprs (autocast, precision_report, float8), the scaler's and the
wrapper's compiled behaviour, low-precision state, master weights, the integrations and the
8-device and multi-process runs. They leave out what does not:

- `newest_only`: the examples, the docs pages, the peers' guides and the benchmark's peers. They test
  what users run with the newest releases (and the peers' own newest versions), not jaxscale's
  lower bounds, and they are a third of the suite's time.
- `version_independent`: pure-Python checks (the version, the changelog, the extras named when
  missing, the public names documented).
- Repetitions whose breadth tests Python logic, not JAX: the optax catalogue runs one
  transformation per state signature (JAXSCALE_CATALOGUE, tests/test_catalogue.py: what differs
  between JAX releases is how jaxscale's compiled skip and storage treat each kind of state leaf),
  and the scaler's state machine 25 examples of 50 steps instead of 100
  (JAXSCALE_STATE_MACHINE_EXAMPLES: what tests/MUTATION.md runs per mutant).

A fresh install on Python 3.12 or newer gets a newer JAX than one on 3.11 (0.12.0.1 against 0.10.2
on 2026-11-26), and the same one on 3.12 and 3.13. tests-3.13 runs the jaxpr readers and the
docstrings (`jaxpr`, `docstring`); tests-3.12 the rest of the library's tests but the
multi-process runs (`multihost`), and the jaxpr readers too unless tests-3.13 ran before it in the
same `nox` call on the same JAX (so `nox -s tests-3.12` alone runs them all).

The oldest session pins jax, jaxlib, optax and flax to the lower bounds in pyproject.toml (keep the
two in step: these pins are what proves the bounds), installs the rest of the `test` extra at
whatever versions the resolver finds compatible with them, and leaves torch out: the parity tests
then run against the committed torch fixtures. Arguments after `--` go to pytest (and replace the
selection above: with no `-m` of their own, the fast tier's `not slow` applies).

Virtual environments are made by uv where nox finds it (`pip install nox uv`; .ci/run does): it
installs the `test` extra in seconds where pip takes more than a minute, from the same index, and
resolves the same versions. Without uv, venv and pip.
"""

import pathlib
import tomllib

import nox
from packaging.version import Version

nox.options.default_venv_backend = "uv|venv"
nox.options.reuse_existing_virtualenvs = True
nox.options.sessions = ["tests-newest", "tests-oldest", "tests-3.13", "tests-3.12"]

OLDEST = ["jax==0.7.1", "jaxlib==0.7.1", "optax==0.2.5", "flax==0.12.0"]

PYPROJECT = tomllib.loads(pathlib.Path(__file__).with_name("pyproject.toml").read_text())

# What each session selects, by the markers the test modules set (pyproject.toml says what each
# marker means). An explicit `-m` replaces the default `not slow`: every session runs the slow tests
# of what it selects.
EVERY_TEST = "slow or not slow"
# What a session on another JAX release leaves out, and the environment that shortens its repetitions.
LIBRARY = "not newest_only and not version_independent"
SHORTENED = {"JAXSCALE_CATALOGUE": "one-per-signature", "JAXSCALE_STATE_MACHINE_EXAMPLES": "25"}
# The jaxpr readers (autocast, precision_report, float8) and the docstrings.
JAXPR_TESTS = "jaxpr or docstring"

# The JAX that tests-3.13 installed in this `nox` call, for tests-3.12.
INSTALLED_JAX = {}


def run_pytest(session, markers):
  args = session.posargs or ["-n", "2", "-q", "-m", markers]
  session.run("python", "-m", "pytest", *args, env=SHORTENED)


def jax_version(session):
  out = session.run("python", "-c", "import jax; print(jax.__version__)", silent=True)
  return out.strip() if out else None  # None under --install-only


def pip_check(session):
  if session.venv_backend == "uv":
    session.run("uv", "pip", "check")
  else:
    session.run("python", "-m", "pip", "check")


@nox.session(name="tests-newest")
def tests_newest(session):
  session.install("-e", ".[test]")
  session.run("python", "-m", "pytest", *(session.posargs or ["-n", "2", "-q", "-m", EVERY_TEST]))


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
  pip_check(session)
  run_pytest(session, LIBRARY)


@nox.session(name="tests-3.13", python="3.13")
def tests_313(session):
  session.install("-e", ".[test]")
  INSTALLED_JAX["3.13"] = jax_version(session)
  run_pytest(session, JAXPR_TESTS)


# Besides: the multi-process runs, which test jaxscale's collectives over gloo (tests-oldest and
# README's command run them; the 8-device suite stays: shard_map's jaxprs changed in jax 0.10).
@nox.session(name="tests-3.12", python="3.12")
def tests_312(session):
  session.install("-e", ".[test]")
  version = jax_version(session)
  jaxpr_tested = version is not None and INSTALLED_JAX.get("3.13") == version
  run_pytest(session, f"{LIBRARY} and not multihost" + (f" and not ({JAXPR_TESTS})" if jaxpr_tested else ""))


@nox.session(name="gpu-program")
def gpu_program(session):
  """The H100 programs of the headline steps against their budgets (benchmarks/test_gpu_program.py).

  Its own environment: with the CUDA plugin installed, a CPU-only JAX warns when it starts.
  """
  session.install("-e", ".[gpu-program]")
  # cuBLAS GEMMs, as benchmarks/gpu_program.py compiles by default (pytest starts JAX before it can say so).
  env = {"JAX_SKIP_CUDA_CONSTRAINTS_CHECK": "1", "CUDA_VISIBLE_DEVICES": "-1",
         "XLA_FLAGS": "--xla_gpu_enable_triton_gemm=false"}
  # Two workers: each test compiles its own programs on one core (the TPU session cannot: libtpu admits
  # one process at a time).
  tests = session.posargs or ["-n", "2", "benchmarks/test_gpu_program.py"]
  session.run("python", "-m", "pytest", "-q", *tests, env=env)


@nox.session(name="tpu-program", python="3.12")
def tpu_program(session):
  """The TPU v5e, v5p and v6e programs of the headline steps against their budgets (benchmarks/test_tpu_*.py).

  Python 3.12: the libtpu that jax's `tpu` extra pins for the newest JAX has no wheel for 3.11.
  """
  session.install("-e", ".[tpu-program]")
  tests = session.posargs or ["benchmarks/test_tpu_program.py", "benchmarks/test_tpu_sixteen.py"]
  session.run("python", "-m", "pytest", "-q", "-p", "no:xdist", *tests)


def _name(requirement):
  for separator in "<>=!~[; ":
    requirement = requirement.split(separator)[0]
  return requirement.lower()
