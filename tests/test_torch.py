"""Step-for-step parity with torch.amp.GradScaler (CPU), and its state_dict both ways.

Without torch, jaxscale is compared with torch's recorded behaviour (tests/fixtures, written by
tests/fixtures/record_torch.py). With torch installed (`pip install -e ".[parity]"`), the tests
marked `live` also check that torch still does what was recorded, and load jaxscale's state dict
into a live GradScaler.
"""

import numpy as np
import optax
import _sgd_loop
import pytest
from fixtures import record_torch
from fixtures.record_torch import LR, decode

import jaxscale

RECORDED = record_torch.load()


def live_torch():
  return pytest.importorskip("torch")


def run_jaxscale(options, grads):
  return _sgd_loop.run(grads, optax.sgd(LR), **options)


def grads_of(scenario):
  return np.stack([decode(g) for g in scenario["grads"]])


def assert_matches_recording(trajectory, scenario):
  for step, (scale, tracker, w) in enumerate(trajectory):
    assert (scale, tracker) == (scenario["scale"][step], scenario["growth_tracker"][step]), f"step {step}"
    np.testing.assert_array_equal(w, decode(scenario["weights"][step]), err_msg=f"step {step}")


@pytest.mark.parametrize("name", sorted(RECORDED["trajectories"]))
def test_trajectories_match_torch_step_for_step(name):
  scenario = RECORDED["trajectories"][name]
  grads = grads_of(scenario)
  assert (~np.isfinite(grads)).any(axis=1).sum() >= 3  # the scenario does exercise skipping
  ours, _ = run_jaxscale(scenario["options"], grads)
  assert_matches_recording(ours, scenario)


def test_recordings_cover_the_scenarios_of_the_recording_script():
  # The fixture was written by this version of the script (scenarios, seeds, gradients).
  want = {f"{name}-{seed}" for name in record_torch.OPTION_SETS for seed in record_torch.SEEDS}
  assert set(RECORDED["trajectories"]) == want
  for name, options in record_torch.OPTION_SETS.items():
    for seed in record_torch.SEEDS:
      scenario = RECORDED["trajectories"][f"{name}-{seed}"]
      assert scenario["options"] == options
      grads = record_torch.gradient_sequence(seed, record_torch.STEPS, record_torch.P_BAD)
      np.testing.assert_array_equal(grads_of(scenario), grads)


def test_state_dict_has_torchs_keys_and_values():
  scenario = RECORDED["state_dict"]
  _, opt_state = run_jaxscale(scenario["options"], grads_of(scenario))
  assert jaxscale.state_dict(jaxscale.find_scaler(opt_state)) == scenario["state_dict"]


def test_torch_checkpoint_continues_in_jaxscale():
  recorded = RECORDED["checkpoint"]
  full, save_at = recorded["full"], recorded["save_at"]
  scaler = jaxscale.load_state_dict(jaxscale.init(), recorded["saved"])
  # Continue the scaler alone from the checkpoint with the flags torch saw.
  grads = grads_of(full)
  for step in range(save_at, len(grads)):
    scaler = jaxscale.update(scaler, bool(np.isfinite(grads[step]).all()))
    assert (float(scaler.scale), int(scaler.growth_tracker)) == (full["scale"][step], full["growth_tracker"][step])


def test_load_state_dict_accepts_numpy_scalars_and_keeps_other_options():
  state = jaxscale.init(min_scale=2.0, hysteresis=3)
  d = {"scale": np.float32(512.0), "growth_factor": 3.0, "backoff_factor": 0.25,
       "growth_interval": np.int64(7), "_growth_tracker": 5}
  state = jaxscale.load_state_dict(state, d)
  assert jaxscale.state_dict(state) == {k: float(v) if k == "scale" else int(v) if k == "growth_interval" else v
                                       for k, v in d.items()}
  assert float(state.min_scale) == 2.0 and int(state.hysteresis) == 3


def test_disabled_scalers_agree_with_torch():
  assert jaxscale.state_dict(jaxscale.init(enabled=False)) == RECORDED["disabled_state_dict"] == {}
  disabled = jaxscale.init(enabled=False)
  assert jaxscale.load_state_dict(disabled, {"scale": 8.0}) is disabled
  with pytest.raises(ValueError, match="disabled"):
    jaxscale.load_state_dict(jaxscale.init(), RECORDED["disabled_state_dict"])


@pytest.mark.parametrize(
    "d, match",
    [
        ({"scale": 1.0}, "missing keys"),
        ({**jaxscale.state_dict(jaxscale.init()), "step": 3}, "unexpected keys"),
        ({**jaxscale.state_dict(jaxscale.init()), "backoff_factor": 1.5}, "backoff_factor"),
    ],
    ids=["missing", "unknown", "out_of_range"],
)
def test_load_state_dict_rejects_bad_dicts(d, match):
  with pytest.raises(ValueError, match=match):
    jaxscale.load_state_dict(jaxscale.init(), d)


def test_growth_after_lowering_the_interval_below_the_tracker_differs_from_torch():
  # A documented difference: with the tracker at 5 and the interval lowered to 3, jaxscale grows
  # at the next finite step (the tracker is past the interval); torch compares with `==` and
  # would never grow again until an overflow resets its tracker.
  state = jaxscale.init(init_scale=2.0**10, growth_interval=100)
  for _ in range(5):
    state = jaxscale.update(state, True)
  state = jaxscale.update(jaxscale.configure(state, growth_interval=3), True)
  assert float(state.scale) == 2.0**11 and int(state.growth_tracker) == 0


# --- live torch ------------------------------------------------------------------------------------


def test_live_torch_does_what_was_recorded():
  torch = live_torch()
  again = record_torch.record(torch)
  assert {k: v for k, v in again.items() if k != "torch"} == {k: v for k, v in RECORDED.items() if k != "torch"}


def test_live_torch_never_grows_after_the_interval_is_lowered_below_its_tracker():
  torch = live_torch()
  scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=100)
  w = torch.nn.Parameter(torch.ones(2))
  opt = torch.optim.SGD([w], lr=LR)
  for step in range(12):
    if step == 5:
      scaler.set_growth_interval(3)
    opt.zero_grad()
    scaler.scale(w.sum()).backward()
    scaler.step(opt)
    scaler.update()
  assert scaler.get_scale() == 2.0**10 and scaler._get_growth_tracker() == 12


def test_jaxscale_checkpoint_continues_in_torch():
  torch = live_torch()
  grads = record_torch.gradient_sequence(5, steps=20, p_bad=0.2)
  options = dict(init_scale=2.0**10, growth_interval=2)
  _, opt_state = run_jaxscale(options, grads[:10])
  torch_scaler = torch.amp.GradScaler("cpu")
  torch_scaler.load_state_dict(jaxscale.state_dict(jaxscale.find_scaler(opt_state)))
  full, _ = run_jaxscale(options, grads)
  w = torch.nn.Parameter(torch.from_numpy(full[9][2].copy()))
  opt = torch.optim.SGD([w], lr=LR)
  for g, (o_scale, o_tracker, o_w) in zip(grads[10:], full[10:]):
    opt.zero_grad()
    torch_scaler.scale((w * torch.from_numpy(g)).sum()).backward()
    torch_scaler.step(opt)
    torch_scaler.update()
    assert (torch_scaler.get_scale(), torch_scaler._get_growth_tracker()) == (o_scale, o_tracker)
    np.testing.assert_array_equal(w.detach().numpy(), o_w)


def test_load_state_dict_accepts_tensors():
  torch = live_torch()
  d = {"scale": torch.tensor(512.0), "growth_factor": 3.0, "backoff_factor": 0.25,
       "growth_interval": 7, "_growth_tracker": 5}
  state = jaxscale.load_state_dict(jaxscale.init(), d)
  assert jaxscale.state_dict(state) == {**d, "scale": 512.0}


def test_live_torch_backs_off_below_float32_normal_range_where_jaxscale_stops():
  # A documented difference: after 143 overflows in a row from 2**16 torch's scale is 2**-127
  # (a subnormal, 0 where it is flushed); jaxscale's stops at 2**-126 and agrees until then.
  torch = live_torch()
  scale = torch.full((1,), 2.0**16)
  tracker = torch.zeros((1,), dtype=torch.int32)
  state = jaxscale.init()
  for step in range(143):
    torch._amp_update_scale_(scale, tracker, torch.ones((1,)), 2.0, 0.5, 2000)
    state = jaxscale.update(state, False)
    if step < 142:
      assert float(state.scale) == scale.item()
  assert scale.item() == 2.0**-127 and float(state.scale) == 2.0**-126
