"""Device capability on fake device descriptions (several GPUs, a TPU, broken objects) and on this CPU."""

import types

import jax
import pytest

import jaxscale


def gpu(capability, kind="NVIDIA GPU"):
  return types.SimpleNamespace(platform="gpu", device_kind=kind, compute_capability=capability)


@pytest.mark.parametrize(
    "device, float16, bfloat16, policy",
    [
        (gpu("9.0", "NVIDIA H100"), True, True, "mixed_bfloat16"),
        (gpu("8.0", "NVIDIA A100"), True, True, "mixed_bfloat16"),
        (gpu("8.6", "NVIDIA RTX 3090"), True, True, "mixed_bfloat16"),
        (gpu("7.5", "Tesla T4"), True, False, "mixed_float16"),
        (gpu("7.0", "Tesla V100"), True, False, "mixed_float16"),
        (gpu("6.0", "Tesla P100"), True, False, "mixed_float16"),  # packed half2 at 2x float32
        (gpu("6.1", "GTX 1080"), False, False, "float32"),  # float16 at 1/64 of float32
        (gpu("5.2", "GTX 980"), False, False, "float32"),
        (gpu("12.0", "RTX 5090"), True, True, "mixed_bfloat16"),
        (types.SimpleNamespace(platform="cuda", compute_capability="8.9"), True, True, "mixed_bfloat16"),
        (gpu("gfx90a", "AMD Instinct MI250X"), True, True, "mixed_bfloat16"),
        (gpu("gfx942", "AMD Instinct MI300X"), True, True, "mixed_bfloat16"),
        (gpu("gfx906", "AMD Instinct MI50"), True, False, "mixed_float16"),
        (gpu("gfx1100", "Radeon RX 7900"), True, True, "mixed_bfloat16"),
        # Every TPU generation, by the device kind each reports (v5e is "v5 lite", v6e "v6 lite", Ironwood
        # "TPU7x"): matrix units that take bfloat16 (Google's datasheets); float16 no faster, and needs scaling.
        *[(types.SimpleNamespace(platform="tpu", device_kind=kind), False, True, "mixed_bfloat16")
          for kind in ("TPU v2", "TPU v3", "TPU v4", "TPU v5 lite", "TPU v5", "TPU v6 lite", "TPU7x")],
        (types.SimpleNamespace(platform="cpu", device_kind="cpu"), False, False, "float32"),
        (types.SimpleNamespace(platform="METAL"), False, False, "float32"),  # unknown: conservative
    ],
    ids=lambda v: (getattr(v, "device_kind", getattr(v, "platform", None))
                   if isinstance(v, types.SimpleNamespace) else None),
)
def test_fake_devices(device, float16, bfloat16, policy):
  assert jaxscale.supports_float16(device) is float16
  assert jaxscale.supports_bfloat16(device) is bfloat16
  assert jaxscale.recommended_policy(device) == jaxscale.get_policy(policy)
  # The automatic switch: loss scaling exactly where the recommendation computes in float16.
  assert jaxscale.needs_loss_scaling(jaxscale.recommended_policy(device)) is (policy == "mixed_float16")


class Raising:
  def __getattr__(self, name):
    raise RuntimeError(f"cannot read {name}")


class RaisingCapability:
  platform = "gpu"

  @property
  def compute_capability(self):
    raise RuntimeError("driver gone")


@pytest.mark.parametrize(
    "device",
    [object(), Raising(), RaisingCapability(), gpu(None), gpu("garbage"), gpu((8, 0)),
     types.SimpleNamespace(platform=None), 42],
    ids=["no attributes", "raising", "raising capability", "no capability", "garbage", "tuple", "platform None", "int"],
)
def test_never_raises_and_is_conservative(device):
  assert jaxscale.supports_float16(device) is False
  assert jaxscale.supports_bfloat16(device) is False
  assert jaxscale.recommended_policy(device) == jaxscale.get_policy("float32")


def test_this_machine():
  device = jax.devices()[0]
  if device.platform != "cpu":
    pytest.skip("runs on the CPU-only CI machine")
  for d in (None, device):
    assert jaxscale.supports_float16(d) is False and jaxscale.supports_bfloat16(d) is False
    assert jaxscale.recommended_policy(d) == jaxscale.get_policy("float32")
  assert jaxscale.needs_loss_scaling(jaxscale.recommended_policy()) is False
