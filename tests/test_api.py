"""The public surface: the fixed public names, documented, and nothing heavy imported."""

import inspect
import pathlib
import re
import subprocess
import sys

import pytest

import jaxscale

pytestmark = pytest.mark.version_independent

FIXED_NAMES = {
    "ScalerState", "init", "scale", "unscale_and_check", "update",
    "dynamic_loss_scaling", "find_scaler", "state_dict", "load_state_dict",
    "range_stats", "suggest_scale",
    "Policy", "get_policy", "autocast", "master_weights", "supports_float16", "supports_bfloat16",
    "recommended_policy", "needs_loss_scaling", "metrics", "precision_report", "find_overflow",
}


def test_fixed_names_are_public_and_documented():
  assert FIXED_NAMES <= set(jaxscale.__all__)
  for name in jaxscale.__all__:
    obj = getattr(jaxscale, name)
    if not callable(obj):  # a constant (HISTOGRAM_EXPONENTS) has no docstring of its own: the API page says it
      assert f"jaxscale.{name}`" in (pathlib.Path(__file__).parents[1] / "docs" / "api.md").read_text(), name
      continue
    doc = inspect.getdoc(obj) or ""
    # Its own docstring: not one inherited from a base class, nor the signature a NamedTuple writes
    # for itself ("ScalerState(scale, ...)"), and a first line that says what it is, as a sentence.
    assert "__doc__" in vars(obj) if isinstance(obj, type) else obj.__doc__, name
    assert not doc.startswith(f"{name}(") and doc.splitlines()[0].rstrip().endswith((".", ":")), (name, doc[:80])


def test_importing_jaxscale_pulls_in_no_optional_dependency():
  # Only what jaxscale itself imports: optax < 0.2.7 imports chex, a dependency of its own.
  code = (
      "import sys, jax, optax; before = set(sys.modules); import jaxscale; "
      "print(sorted({'flax', 'equinox', 'torch', 'orbax', 'chex', 'matplotlib'} & (set(sys.modules) - before)))"
  )
  out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
  assert out.stdout.strip() == "[]"


def public_callables():
  import jaxscale.equinox
  import jaxscale.flax

  # Constants (HISTOGRAM_EXPONENTS) are documented where they are used.
  named = {name: getattr(jaxscale, name) for name in jaxscale.__all__ if callable(getattr(jaxscale, name))}
  named["flax.value_and_grad"] = jaxscale.flax.value_and_grad
  named["flax.apply_gradients"] = jaxscale.flax.apply_gradients
  named["equinox.filter_value_and_grad"] = jaxscale.equinox.filter_value_and_grad
  return named


SECTION = re.compile(r"^(Args|Returns|Raises|Examples|Attributes):\n((?:(?: +.*)?\n)*)", re.M)


@pytest.mark.parametrize("name", public_callables())
def test_docstring_has_args_returns_and_examples(name):
  obj = public_callables()[name]
  doc = inspect.getdoc(obj) + "\n"
  sections = dict(SECTION.findall(doc))
  assert ">>>" in sections.get("Examples", ""), f"{name}: no `Examples:` section with a `>>>` example"
  if inspect.isclass(obj):
    return
  signature = inspect.signature(obj)
  if signature.parameters:
    args = sections.get("Args", "")
    for parameter in signature.parameters:
      assert re.search(rf"^ +\**{parameter}( \(.*\))?:", args, re.M), f"{name}: `Args:` does not describe `{parameter}`"
  if signature.return_annotation not in ("None", None):
    assert sections.get("Returns", "").strip(), f"{name}: no `Returns:` section"
