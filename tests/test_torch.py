"""Step-for-step parity with torch.amp.GradScaler (CPU), and its state_dict both ways."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxscale

torch = pytest.importorskip("torch")

LR = 2.0**-4  # a power of two: lr * grad is exact, so SGD rounds identically in both


def gradient_sequence(seed, steps, p_bad, size=5):
  """Per-step gradients, some poisoned with inf or NaN, all exactly representable."""
  rng = np.random.default_rng(seed)
  grads = np.round(rng.normal(size=(steps, size)) * 64) / 1024  # multiples of 2**-10
  for step in np.flatnonzero(rng.random(steps) < p_bad):
    grads[step, rng.integers(size)] = rng.choice([np.inf, -np.inf, np.nan])
  return grads.astype(np.float32)


def run_torch(options, grads):
  w = torch.nn.Parameter(torch.ones(grads.shape[1]))
  opt = torch.optim.SGD([w], lr=LR)
  scaler = torch.amp.GradScaler("cpu", **options)
  trajectory = []
  for g in grads:
    opt.zero_grad()
    scaler.scale((w * torch.from_numpy(g)).sum()).backward()
    scaler.step(opt)
    scaler.update()
    trajectory.append((scaler.get_scale(), scaler._get_growth_tracker(), w.detach().numpy().copy()))
  return trajectory, scaler


def run_jaxscale(options, grads):
  tx = jaxscale.dynamic_loss_scaling(optax.sgd(LR), **options)
  w = jnp.ones(grads.shape[1], jnp.float32)
  opt_state = tx.init(w)

  @jax.jit
  def step(w, opt_state, g):
    scaler = jaxscale.find_scaler(opt_state)
    scaled_grads = jax.grad(lambda w: jaxscale.scale(scaler, jnp.sum(w * g)))(w)
    updates, opt_state = tx.update(scaled_grads, opt_state, w)
    return optax.apply_updates(w, updates), opt_state

  trajectory = []
  for g in grads:
    w, opt_state = step(w, opt_state, g)
    scaler = jaxscale.find_scaler(opt_state)
    trajectory.append((float(scaler.scale), int(scaler.growth_tracker), np.asarray(w)))
  assert step._cache_size() == 1
  return trajectory, opt_state


OPTION_SETS = {
    "defaults_interval_3": dict(growth_interval=3),
    "odd_factors": dict(init_scale=1024.0, growth_factor=4.0, backoff_factor=0.25, growth_interval=2),
    "growth_would_overflow_float32": dict(init_scale=2.0**125, growth_interval=1),
    "at_2_pow_127": dict(init_scale=2.0**127, growth_interval=4),
    "small_scale": dict(init_scale=2.0**-6, growth_interval=2),
}


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("options", OPTION_SETS.values(), ids=OPTION_SETS.keys())
def test_trajectories_match_torch_step_for_step(options, seed):
  grads = gradient_sequence(seed, steps=30, p_bad=0.25)
  theirs, _ = run_torch(options, grads)
  ours, _ = run_jaxscale(options, grads)
  for step, ((t_scale, t_tracker, t_w), (o_scale, o_tracker, o_w)) in enumerate(zip(theirs, ours)):
    assert (o_scale, o_tracker) == (t_scale, t_tracker), f"step {step}"
    np.testing.assert_array_equal(o_w, t_w, err_msg=f"step {step}")


def test_state_dict_has_torchs_keys_and_values():
  grads = gradient_sequence(3, steps=12, p_bad=0.3)
  _, torch_scaler = run_torch(dict(growth_interval=3), grads)
  _, opt_state = run_jaxscale(dict(growth_interval=3), grads)
  assert jaxscale.state_dict(jaxscale.find_scaler(opt_state)) == torch_scaler.state_dict()


def test_torch_checkpoint_continues_in_jaxscale():
  grads = gradient_sequence(4, steps=20, p_bad=0.2)
  options = dict(growth_interval=3)
  full, _ = run_torch(options, grads)
  _, torch_scaler = run_torch(options, grads[:10])
  scaler = jaxscale.load_state_dict(jaxscale.init(), torch_scaler.state_dict())
  # Continue the scaler alone from step 10 with the flags torch saw.
  for g, (t_scale, t_tracker, _) in zip(grads[10:], full[10:]):
    scaler = jaxscale.update(scaler, bool(np.isfinite(g).all()))
    assert (float(scaler.scale), int(scaler.growth_tracker)) == (t_scale, t_tracker)


def test_jaxscale_checkpoint_continues_in_torch():
  grads = gradient_sequence(5, steps=20, p_bad=0.2)
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


def test_load_state_dict_accepts_tensors_and_keeps_other_options():
  state = jaxscale.init(min_scale=2.0, hysteresis=3)
  d = {"scale": torch.tensor(512.0), "growth_factor": 3.0, "backoff_factor": 0.25,
       "growth_interval": 7, "_growth_tracker": 5}
  state = jaxscale.load_state_dict(state, d)
  assert jaxscale.state_dict(state) == {k: float(v) if k == "scale" else v for k, v in d.items()}
  assert float(state.min_scale) == 2.0 and int(state.hysteresis) == 3


def test_disabled_scalers_agree_with_torch():
  assert jaxscale.state_dict(jaxscale.init(enabled=False)) == torch.amp.GradScaler("cpu", enabled=False).state_dict()
  disabled = jaxscale.init(enabled=False)
  assert jaxscale.load_state_dict(disabled, {"scale": 8.0}) is disabled
  with pytest.raises(ValueError, match="disabled"):
    jaxscale.load_state_dict(jaxscale.init(), torch.amp.GradScaler("cpu", enabled=False).state_dict())


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
