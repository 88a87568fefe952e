"""Two JAX processes on 127.0.0.1 train one sharded model: one skip decision, one scale.

The processes run tests/distributed/multihost_worker.py: 4 simulated CPU devices each, gloo
collectives, an FSDP-sharded model trained with the Optax wrapper, and an inf added to a gradient
shard that only process 1 holds. Here the two reports are compared.
"""

import json

import pytest

from _spawn import child_env, free_port, run_python

pytestmark = pytest.mark.multihost

WORKER = "tests/distributed/multihost_worker.py"
POISONED_STEP = 3
SCALE = 2.0**10


@pytest.fixture(scope="module")
def reports(tmp_path_factory):
  tmp = tmp_path_factory.mktemp("multihost")
  port = free_port()
  results = [tmp / f"process{i}.json" for i in range(2)]
  run_python(
      [[WORKER, str(port), str(i), str(results[i])] for i in range(2)],
      env=child_env(devices=4), timeout=120, logs=tmp,
  )
  return [json.loads(path.read_text()) for path in results]


def test_inf_lives_on_one_process_only(reports):
  held = [[step["inf_on_this_process"] for step in report] for report in reports]
  assert not any(held[0])
  assert [i for i, h in enumerate(held[1]) if h] == [POISONED_STEP]


def test_both_processes_skip_the_poisoned_step_only(reports):
  for report in reports:
    for i, step in enumerate(report):
      # Every local shard of every parameter: frozen on the poisoned step, moved on the others.
      assert set(step["local_params_moved"]) == {i != POISONED_STEP}, (i, step)
    assert [step["count"] for step in report] == [1, 2, 3, 3, 4, 5]


def test_scaler_state_is_replicated_and_identical(reports):
  for report in reports:
    for step in report:
      assert step["scaler_replicated"]
      # One value per leaf across the 4 local devices.
      assert all(len(values) == 1 for values in step["scaler"].values()), step["scaler"]
  assert reports[0] == [{**s, "inf_on_this_process": False} for s in reports[1]]
  # growth_interval=2: grows after steps 1, then backs off on step 3, then grows after step 5.
  scales = [step["scaler"]["scale"][0] for step in reports[0]]
  assert scales == [SCALE, 2 * SCALE, 2 * SCALE, SCALE, SCALE, 2 * SCALE]
  assert [step["scaler"]["skipped_steps"][0] for step in reports[0]] == [0, 0, 0, 1, 1, 1]


@pytest.mark.slow
@pytest.mark.newest_only  # an example: what users run, on the newest releases
def test_data_parallel_example_on_two_processes(tmp_path):
  """The two-process command of docs/distributed.md; both processes end with the same numbers."""
  address = f"127.0.0.1:{free_port()}"
  outputs = run_python(
      [
          ["examples/data_parallel.py", "--simulate-devices", "4", "--steps", "20",
           "--coordinator-address", address, "--num-processes", "2", "--process-id", str(i)]
          for i in range(2)
      ],
      env=child_env(), timeout=120, logs=tmp_path,
  )
  finals = [line.split(":", 1)[1].rsplit(",", 1)[0]
            for out in outputs for line in out.splitlines() if "final loss" in line]
  assert len(finals) == 2 and finals[0] == finals[1], outputs
