"""Smoke test of examples/tensorboard_logging.py: it trains, and its event file holds the scaler's
numbers at the logged steps (read back with tensorboardX's own protobuf, independently of the writer)."""

import glob
import importlib
import os
import struct
import sys

import pytest

pytestmark = pytest.mark.newest_only

EXAMPLES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples")


def read_scalars(logdir):
  """``{tag: [(step, value)]}`` from the TFRecord event files (length, crc, payload, crc)."""
  from tensorboardX.proto import event_pb2

  scalars = {}
  for path in glob.glob(os.path.join(logdir, "events.out.tfevents.*")):
    with open(path, "rb") as f:
      data = f.read()
    offset = 0
    while offset < len(data):
      (length,) = struct.unpack("<Q", data[offset : offset + 8])
      event = event_pb2.Event.FromString(data[offset + 12 : offset + 12 + length])
      offset += 12 + length + 4
      for value in event.summary.value:
        scalars.setdefault(value.tag, []).append((event.step, value.simple_value))
  return scalars


@pytest.mark.slow  # runs the example's training
def test_tensorboard_example_logs_the_scaler(tmp_path):
  sys.path.insert(0, EXAMPLES)
  try:
    example = importlib.import_module("tensorboard_logging")
  finally:
    sys.path.remove(EXAMPLES)
  logged = example.main(["--logdir", str(tmp_path), "--steps", "12", "--log-every", "5"])
  assert [step for step, _ in logged] == [5, 10, 12]
  scalars = read_scalars(str(tmp_path))
  assert {"loss", "scaler/scale", "scaler/skipped_steps", "scaler/last_skipped",
          "scaler/growth_tracker"} <= set(scalars)
  assert [s for s, _ in scalars["scaler/scale"]] == [5, 10, 12]
  assert [v for _, v in scalars["scaler/scale"]] == [values["scale"] for _, values in logged] == [1024.0] * 3
  assert [v for _, v in scalars["scaler/growth_tracker"]] == [5, 10, 12]
  assert scalars["loss"][-1][1] < scalars["loss"][0][1]
