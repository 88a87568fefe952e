"""The public surface: DESIGN.md's fixed names, documented, and nothing heavy imported."""

import subprocess
import sys

import jaxscale

DESIGN_NAMES = {
    "ScalerState", "init", "scale", "unscale_and_check", "update",
    "dynamic_loss_scaling", "find_scaler", "state_dict", "load_state_dict",
    "range_stats", "suggest_scale",
}


def test_design_names_are_public_and_documented():
  assert DESIGN_NAMES <= set(jaxscale.__all__)
  for name in jaxscale.__all__:
    assert getattr(jaxscale, name).__doc__, name


def test_importing_jaxscale_pulls_in_no_optional_dependency():
  # Only what jaxscale itself imports: optax < 0.2.7 imports chex, a dependency of its own.
  code = (
      "import sys, jax, optax; before = set(sys.modules); import jaxscale; "
      "print(sorted({'flax', 'torch', 'orbax', 'chex', 'matplotlib'} & (set(sys.modules) - before)))"
  )
  out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
  assert out.stdout.strip() == "[]"
