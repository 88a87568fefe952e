"""The 8-device tests (tests/distributed) and the data-parallel example, each in its own process.

They need 8 simulated CPU devices, which JAX creates only if told before it starts, so they run in
a child process; this module makes the full run (`python -m pytest -m "slow or not slow"`) run
them, within a time limit.
"""

import pytest

from _spawn import child_env, run_python


@pytest.mark.slow  # a child process that compiles every 8-device program
def test_8_device_suite(tmp_path):
  run_python(
      [["-m", "pytest", "-q", "-p", "no:xdist", "tests/distributed"]],
      # 56 tests: 55 s of CPU time, 300 s of wall time on the loaded 2-core machine (2026-11-28).
      env=child_env(devices=8), timeout=420, logs=tmp_path,
  )


@pytest.mark.slow
@pytest.mark.newest_only  # an example: what users run, on the newest releases
def test_data_parallel_example_on_8_simulated_devices(tmp_path):
  (out,) = run_python(
      [["examples/data_parallel.py", "--simulate-devices", "8", "--steps", "30"]],
      env=child_env(), timeout=120, logs=tmp_path,
  )
  assert "8 devices" in out and "final loss" in out, out
