"""Child Python processes for the tests that need their own JAX: a device count, or a process group.

JAX fixes the number of CPU devices when its backend starts, so tests that need 8 devices, or
several cooperating processes, run in children. Every child gets its own session so that a hung
one (say, waiting forever for a peer) is killed with everything it started, and a deadline so
that the test suite never hangs.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def child_env(devices: int | None = None, **extra: str) -> dict[str, str]:
  """The environment of a CPU-only child, with `devices` simulated devices."""
  # Children talk to each other over loopback only; gRPC would route through a proxy.
  env = {k: v for k, v in os.environ.items() if not k.lower().endswith("_proxy")}
  env["JAX_PLATFORMS"] = "cpu"
  if devices is not None:
    flag = f"--xla_force_host_platform_device_count={devices}"
    env["XLA_FLAGS"] = f"{env.get('XLA_FLAGS', '')} {flag}".strip()
  env.update(extra)
  return env


def free_port() -> int:
  """A TCP port on 127.0.0.1 that is free now (another process may still take it first)."""
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def run_python(commands: list[list[str]], *, env: dict[str, str], timeout: float, logs: Path) -> list[str]:
  """Runs `python <args>` for each entry of `commands` at once, and returns their outputs.

  Raises AssertionError, showing every child's output, if one fails or the deadline passes;
  every child is killed (with its process group) before this returns either way.
  """
  logs.mkdir(parents=True, exist_ok=True)
  procs, paths = [], []
  try:
    for i, args in enumerate(commands):
      # A file, not a pipe: a child blocked on a full pipe could stall its peers.
      path = logs / f"child{i}.log"
      with open(path, "w") as out:
        procs.append(
            subprocess.Popen(
                [sys.executable, *args], cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        )
      paths.append(path)
    deadline = time.monotonic() + timeout
    timed_out = False
    for p in procs:
      try:
        p.wait(timeout=max(deadline - time.monotonic(), 0.1))
      except subprocess.TimeoutExpired:
        timed_out = True
        break
  finally:
    for p in procs:
      if p.poll() is None:
        os.killpg(p.pid, signal.SIGKILL)
        p.wait()
  outputs = [path.read_text() for path in paths]
  if timed_out or any(p.returncode != 0 for p in procs):
    shown = "\n".join(
        f"--- child {i}: python {' '.join(args)} (exit {p.returncode}) ---\n{out}"
        for i, (args, p, out) in enumerate(zip(commands, procs, outputs))
    )
    reason = f"timed out after {timeout} s" if timed_out else "failed"
    raise AssertionError(f"child processes {reason}:\n{shown}")
  return outputs
