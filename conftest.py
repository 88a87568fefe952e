"""Test configuration for every test, the docstrings' examples and the docs' pages included."""

import doctest
import os
import shutil
import subprocess
import sys
import tempfile

import jax
import pytest


# One compilation cache for the whole run: its xdist workers and the child processes they start
# (the examples, the 8-device suite, the multi-process runs) share it. Many tests compile the same
# program (the same model, step or catalogue entry, built from fresh closures), and a program
# found in the cache is loaded instead of compiled again: a sixth of the suite's CPU time (24 ->
# 20 min). The directory is new for each run and removed at its end, so nothing carries over
# between runs; a cache the caller set up (JAX_COMPILATION_CACHE_DIR) is used as it is.
_CACHE_OWNER = "JAXSCALE_TEST_CACHE_OWNER"


def pytest_configure(config):
  _refuse_a_run_that_would_abort(config)
  if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    os.environ["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(prefix="jaxscale-tests-jax-cache-")
    os.environ[_CACHE_OWNER] = str(os.getpid())
    # Every program, not only those that took a second to compile (JAX's default).
    os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
    os.environ["JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES"] = "0"
  # jax was imported above, before the environment said where: tell this process too.
  jax.config.update("jax_compilation_cache_dir", os.environ["JAX_COMPILATION_CACHE_DIR"])
  jax.config.update("jax_persistent_cache_min_compile_time_secs",
                    float(os.environ.get("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", 1.0)))
  jax.config.update("jax_persistent_cache_min_entry_size_bytes",
                    int(os.environ.get("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", 0)))


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects by marker
def pytest_collection_modifyitems(items):
  # The docstrings' examples get a marker too, so that nox's sessions select them as they do the tests.
  for item in items:
    if isinstance(item, pytest.DoctestItem):
      item.add_marker(pytest.mark.docstring)


def pytest_unconfigure(config):
  if os.environ.get(_CACHE_OWNER) == str(os.getpid()):
    shutil.rmtree(os.environ.pop("JAX_COMPILATION_CACHE_DIR"), ignore_errors=True)
    del os.environ[_CACHE_OWNER]


# XLA:CPU built for an x86 CPU without F16C (`XLA_FLAGS=--xla_cpu_max_isa=SSE4_2`, a pre-2013 CPU,
# VirtualBox) cannot link any float16 arithmetic: LLVM lowers it to `__truncsfhf2` /
# `__extendhfsf2`, which XLA's JIT does not provide on Linux (openxla/xla#6787; the symbols were
# added for macOS and s390x only). jax 0.10.2 raises "Failed to materialize symbols": float16 is
# then unavailable to any JAX program on that machine, and a test that needs it is skipped, naming
# why; every other test runs. jax 0.7.1 aborts the process instead ("LLVM ERROR: Program used
# external function '__truncsfhf2'"), which no hook can turn into a skip: the run then stops
# before its first test and says so.
_NO_FLOAT16 = "Failed to materialize symbols"


def _float16_probe() -> int:
  """The exit status of a child process of this Python and JAX that compiles float16 arithmetic:
  0 where it compiles, negative where XLA aborted the child."""
  if jax.default_backend() != "cpu" or "max_isa" not in os.environ.get("XLA_FLAGS", ""):
    return 0
  probe = "import jax, jax.numpy as jnp; jax.jit(lambda x: x.astype(jnp.float16) * 2)(jnp.ones(2)).block_until_ready()"
  return subprocess.run([sys.executable, "-c", probe], capture_output=True, timeout=300).returncode


_PROBED = _float16_probe()
FLOAT16_COMPILES = _PROBED == 0


def _refuse_a_run_that_would_abort(config):
  if _PROBED < 0 and not hasattr(config, "workerinput"):  # the controller, or a run without xdist
    pytest.exit(
        f"jax {jax.__version__}'s XLA:CPU aborts the process on float16 arithmetic with "
        f"XLA_FLAGS={os.environ['XLA_FLAGS']!r} (no F16C: `__truncsfhf2` is missing, "
        "openxla/xla#6787), so most tests would kill the run. jax 0.10.2 raises an error "
        "instead, and the suite then skips the tests that need float16: run it there, or on a CPU "
        "with F16C.",
        returncode=pytest.ExitCode.USAGE_ERROR,
    )


def _needs_float16(error: BaseException | None) -> bool:
  if isinstance(error, doctest.UnexpectedException):  # a docstring's example: the error it raised
    error = error.exc_info[1]
  # A test's own failure, or that of a child process whose output the message shows.
  return error is not None and _NO_FLOAT16 in str(error)


def _skip_without_float16(outcome):
  error = outcome.excinfo[1] if outcome.excinfo else None
  if not FLOAT16_COMPILES and _needs_float16(error):
    outcome.force_exception(pytest.skip.Exception(
        "XLA:CPU cannot compile float16 arithmetic for this instruction set (no F16C: "
        "`__truncsfhf2` is missing, openxla/xla#6787)", _use_item_location=True))


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_setup(item):
  _skip_without_float16((yield))


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item):
  _skip_without_float16((yield))
