"""Float8 training quality: the examples over seeds in float32, mixed_bfloat16 and mixed_float8.

Runs examples/digits.py and examples/lm.py (through their `main`, with `--precision`) for each
seed, and prints one Markdown table per example: each run's held-out loss per seed, its mean, and
whether the mean lies inside float32's seed spread (min..max over the seeds). Rows:

    float32, mixed_bfloat16, mixed_float8   the examples' `--precision` runs, as they are
    flax fp8_ops (digits only)              the same Linen CNN, its Dense layers' dot_general
                                            `flax.linen.Fp8DirectDotGeneralOp` (delayed scaling,
                                            amax history 1024), bfloat16 compute, convolutions in
                                            bfloat16 (fp8_ops has no convolution)
    mixed_float8, delayed (digits only)     the same run with `autocast(..., delayed=True)` and its
                                            `Float8History`, in a loop of this script's own (the
                                            example's data, batches, Adam and held-out set)
    --ablate: mixed_float8, every matmul    the "small" rule switched off (this script patches
                                            `jaxscale._float8._SMALL` to 0): measures the rule
    --logits-wider (lm only)                mixed_float8 with the LM head (the one matmul with a
                                            256-wide dimension) kept in bfloat16 (patched the same
                                            way): measures whether the logits need it

Every mixed_float8 row runs with the speed rule off (the policy "mixed_float8,min_intensity=0"):
the examples' matmuls are far below the size at which float8 pays on a GPU, so under the preset
they would run in bfloat16; this script measures float8's numerics on them.

    python benchmarks/float8_quality.py digits --seeds 0 1 2
    python benchmarks/float8_quality.py lm --seeds 0 1 2 -- --steps 200   # flags after -- go to the example
"""

from __future__ import annotations

import argparse
import contextlib
import pathlib
import sys

import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "examples"))

FLOAT8 = "mixed_float8,min_intensity=0"  # the size rule off: these models' matmuls are all small
POLICIES = ("float32", "mixed_bfloat16", FLOAT8)


@contextlib.contextmanager
def patched(module, **values):
  """`module`'s attributes set to `values` inside the block, restored after it."""
  saved = {name: getattr(module, name) for name in values}
  for name, value in values.items():
    setattr(module, name, value)
  try:
    yield
  finally:
    for name, value in saved.items():
      setattr(module, name, value)


def every_matmul_in_float8():
  from jaxscale import _float8

  return patched(_float8, _SMALL=0)


def logits_in_bfloat16():
  from jaxscale import _float8

  from lm import VOCAB

  rule = _float8.wider_reason
  logits_small = lambda p, params, lhs, rhs, *rest: "small" if VOCAB in rhs else rule(p, params, lhs, rhs, *rest)
  return patched(_float8, wider_reason=logits_small)


@contextlib.contextmanager
def flax_fp8_cnn():
  """digits.CNN with Flax fp8_ops in its Dense layers, computing in bfloat16."""
  import flax.linen as nn
  import jax.numpy as jnp

  import digits

  class Fp8CNN(nn.Module):
    width: int = 32
    dtype: object = None  # ignored: bfloat16, as fp8_ops' own examples compute

    @nn.compact
    def __call__(self, images):
      kw = dict(dtype=jnp.bfloat16, param_dtype=jnp.float32)
      dense = dict(kw, dot_general_cls=nn.Fp8DirectDotGeneralOp)
      x = nn.relu(nn.Conv(self.width, (3, 3), **kw)(images[..., None]))
      x = nn.relu(nn.Conv(2 * self.width, (3, 3), strides=2, **kw)(x))
      x = nn.relu(nn.Dense(4 * self.width, **dense)(x.reshape(x.shape[0], -1)))
      return nn.Dense(10, **dense)(x)

  original, digits.CNN = digits.CNN, Fp8CNN
  try:
    yield
  finally:
    digits.CNN = original


def digits_delayed(seed: int, steps: int = 600, batch: int = 64, lr: float = 1e-3) -> float:
  """examples/digits.py's run under FLOAT8 with delayed scaling (`autocast(..., delayed=True)`): the same
  model, data, batches, Adam and held-out set, the `Float8History` carried by the step; held-out loss."""
  import jax
  import jax.numpy as jnp
  import optax
  from sklearn.datasets import load_digits

  import digits
  import jaxscale

  data = load_digits()
  images = (data.images / 16.0).astype(np.float32)
  order = np.random.default_rng(12345).permutation(len(images))
  test, train_idx = order[:360], order[360:]
  test_images, test_labels = jnp.asarray(images[test]), jnp.asarray(data.target[test])
  model = digits.CNN(dtype=None)
  params = model.init(jax.random.key(seed), test_images[:1])

  def loss(params, images, labels):
    logits = model.apply(params, images).astype(jnp.float32)
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()

  delayed = jaxscale.autocast(loss, FLOAT8, delayed=True)
  tx = optax.adam(lr, eps=1e-8)
  rng = np.random.default_rng(seed)
  batches = [rng.choice(train_idx, batch, replace=False) for _ in range(steps)]
  history = jaxscale.float8_history(delayed, params, jnp.asarray(images[batches[0]]),
                                    jnp.asarray(data.target[batches[0]]))

  @jax.jit
  def step(params, opt_state, history, images, labels):
    (seen, grads) = jax.grad(delayed, argnums=(0, 1))(history, params, images, labels)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, jaxscale.float8_update(history, seen)

  opt_state, saturated = tx.init(params), 0.0
  for idx in batches:
    params, opt_state, history = step(params, opt_state, history, images[idx], data.target[idx])
    saturated += float(history.saturated)
  print(f"  delayed scaling, seed {seed}: {saturated:g} tensors saturated over {steps} steps", flush=True)
  return float(jaxscale.autocast(loss, FLOAT8)(params, test_images, test_labels))  # as the example evaluates


def run(example: str, seed: int, extra: list[str], ablate: bool, logits_wider: bool) -> dict[str, float]:
  """Held-out loss of each row for one seed."""
  module = __import__(example)
  common = ["--seed", str(seed), "--no-plot", "--no-progress", *extra]
  losses = {}
  results = module.main([*common, *(f"--precision={p}" for p in POLICIES)])
  for result in results:
    losses[result.name] = result.eval_metrics[-1]["loss"]
  if example == "digits":
    with flax_fp8_cnn():
      (result,) = module.main([*common, "--runs", "0"])
    losses["flax fp8_ops (Dense), bfloat16 convs"] = result.eval_metrics[-1]["loss"]
    losses["mixed_float8, delayed scaling"] = digits_delayed(seed)
  if ablate:
    with every_matmul_in_float8():
      (result,) = module.main([*common, f"--precision={FLOAT8}"])
    losses["mixed_float8, every matmul (ablation)"] = result.eval_metrics[-1]["loss"]
  if logits_wider:
    with logits_in_bfloat16():
      (result,) = module.main([*common, f"--precision={FLOAT8}"])
    losses["mixed_float8, logits in bfloat16 (ablation)"] = result.eval_metrics[-1]["loss"]
  return losses


def table(per_seed: dict[int, dict[str, float]]) -> str:
  seeds = sorted(per_seed)
  names = list(per_seed[seeds[0]])
  reference = [per_seed[s]["float32"] for s in seeds]
  low, high = min(reference), max(reference)
  lines = [
      "| run | " + " | ".join(f"seed {s}" for s in seeds) + " | mean | inside float32's spread |",
      "|---|" + "---|" * (len(seeds) + 2),
  ]
  for name in names:
    values = [per_seed[s][name] for s in seeds]
    mean = float(np.mean(values))
    inside = "yes" if low <= mean <= high else ("below (better)" if mean < low else "no (worse)")
    lines.append(f"| {name} | " + " | ".join(f"{v:.4f}" for v in values) + f" | {mean:.4f} | {inside} |")
  return "\n".join(lines) + f"\n\nfloat32's spread over seeds {seeds}: {low:.4f}..{high:.4f}"


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("example", choices=("digits", "lm"))
  parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
  parser.add_argument("--ablate", action="store_true", help="add mixed_float8 with every matmul in float8")
  parser.add_argument("--logits-wider", action="store_true", help="lm: add mixed_float8 with the head in bfloat16")
  argv = sys.argv[1:] if argv is None else list(argv)
  extra = argv[argv.index("--") + 1 :] if "--" in argv else []
  args = parser.parse_args(argv[: len(argv) - len(extra) - bool(extra)])
  args.extra = extra
  per_seed = {}
  for seed in args.seeds:
    per_seed[seed] = run(args.example, seed, args.extra, args.ablate, args.logits_wider)
    print(f"seed {seed}: " + ", ".join(f"{k} {v:.4f}" for k, v in per_seed[seed].items()), flush=True)
  print(f"\n{args.example} {' '.join(args.extra)}: held-out loss at the end of each run\n")
  print(table(per_seed))


if __name__ == "__main__":
  main()
