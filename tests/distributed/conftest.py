"""Tests that need 8 CPU devices; tests/test_multidevice.py runs this folder in its own process.

XLA creates the simulated devices only if told before JAX starts, which a pytest process
that has already imported JAX cannot do. Anywhere else, this folder is skipped whole.
To run it by hand:

  XLA_FLAGS=--xla_force_host_platform_device_count=8 JAX_PLATFORMS=cpu python -m pytest tests/distributed
"""

import os

# Not a test: one of the processes that tests/test_multihost.py starts.
collect_ignore = ["multihost_worker.py"]

if "--xla_force_host_platform_device_count=8" not in os.environ.get("XLA_FLAGS", ""):
  collect_ignore_glob = ["*.py"]
