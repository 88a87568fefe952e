"""What the examples share: the three runs, the training loop, the table, the figures.

Every example trains the same model three times, with the same seed and the
same data order, and changes only the precision:

- ``float32``: float32 compute, the reference;
- ``float16``: float16 compute (float32 parameters), no loss scaling;
- ``float16 + jaxscale``: float16 compute with dynamic loss scaling.

All three use one optimizer, ``jaxscale.dynamic_loss_scaling(inner,
enabled=...)``: disabled, it is exactly ``inner``, so the three runs differ in
nothing but the dtype and the scaler, and one jitted step serves them all.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import math
import time
from typing import Any, Callable, Iterable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import tqdm

# float16's limits: the smallest subnormal, the smallest normal, the largest finite.
FP16_SUBNORMAL = 2.0**-24
FP16_NORMAL = 2.0**-14
FP16_MAX = float(jnp.finfo(jnp.float16).max)


class RunConfig(NamedTuple):
  name: str
  dtype: Any  # the compute dtype; parameters are always float32
  scaling: bool  # whether jaxscale scales the loss


RUNS = (
    RunConfig("float32", jnp.float32, False),
    RunConfig("float16", jnp.float16, False),
    RunConfig("float16 + jaxscale", jnp.float16, True),
)


@dataclasses.dataclass
class Result:
  """What one run leaves behind, as host numbers."""

  name: str
  loss: np.ndarray  # shape=(steps,): the training loss of each step (unweighted)
  scale: np.ndarray  # shape=(steps,): the loss scale each step used
  skipped: np.ndarray  # shape=(steps,), bool: the steps the scaler skipped
  eval_steps: list[int]
  eval_metrics: list[dict[str, float]]  # one dict per evaluation, e.g. {"loss": ..}
  wall_s: float
  final_scale: float


def add_flags(parser: argparse.ArgumentParser, *, steps: int, batch: int, lr: float, out: str) -> None:
  """The flags every example takes; each example adds its model's own."""
  parser.add_argument("--steps", type=int, default=steps, help="training steps per run")
  parser.add_argument("--batch", type=int, default=batch, help="batch size")
  parser.add_argument("--lr", type=float, default=lr, help="Adam learning rate")
  parser.add_argument("--seed", type=int, default=0, help="model init and data order, same for every run")
  parser.add_argument(
      "--loss-weight",
      type=float,
      default=1.0,
      help="multiply the loss by this before differentiating: a small weight (1e-3) makes the "
      "gradients small enough to underflow in float16. Adam's eps is multiplied by it too, which "
      "leaves float32 training unchanged up to rounding: what changes is what float16 can represent",
  )
  parser.add_argument("--init-scale", type=float, default=2.0**16, help="jaxscale's first loss scale")
  parser.add_argument(
      "--growth-interval",
      type=int,
      default=200,
      help="jaxscale's growth interval: shorter than torch's 2000, so that a short run shows the "
      "scale growing, overflowing and backing off",
  )
  parser.add_argument("--eval-every", type=int, default=0, help="evaluate every N steps (0: 10 times per run)")
  parser.add_argument(
      "--runs",
      default=",".join(str(i) for i in range(len(RUNS))),
      help="which runs, as indices into: " + ", ".join(f"{i}={r.name}" for i, r in enumerate(RUNS)),
  )
  parser.add_argument("--out", default=out, help="where to write the figure")
  parser.add_argument("--no-plot", action="store_true", help="do not write any figure")
  parser.add_argument("--no-progress", action="store_true", help="hide the progress bars")


def selected_runs(args: argparse.Namespace) -> list[RunConfig]:
  return [RUNS[int(i)] for i in args.runs.split(",")]


def eval_steps(args: argparse.Namespace) -> list[int]:
  """The steps after which a run is evaluated; the last step always is."""
  every = args.eval_every or max(1, args.steps // 10)
  return sorted({*range(every, args.steps + 1, every), args.steps})


class TraceCounter:
  """Counts how often a function is traced, so that a run can assert it compiled once.

  Decorate the Python body, inside ``jax.jit`` / ``nnx.jit``: the body runs only
  while tracing.
  """

  def __init__(self):
    self.count = 0

  def __call__(self, fn: Callable) -> Callable:
    @functools.wraps(fn)
    def counted(*args, **kwargs):
      self.count += 1
      return fn(*args, **kwargs)

    return counted

  def assert_once(self) -> None:
    if self.count != 1:
      raise AssertionError(f"the training step was traced {self.count} times; it should compile once per run.")


def train(
    config: RunConfig,
    step: Callable[[Any], tuple[jax.Array, jax.Array, jax.Array]],
    batches: Iterable[Any],
    evaluate: Callable[[], dict[str, float]],
    args: argparse.Namespace,
) -> Result:
  """Runs ``step(batch) -> (loss, scale, skipped)`` over ``batches``.

  ``step`` updates the model itself (an NNX object, or a Linen state held by
  the caller's closure). The per-step scalars stay on the device until the run
  ends, so the host only waits on them when the progress bar refreshes.
  """
  history = []
  evals = eval_steps(args)
  eval_metrics = []
  start = time.perf_counter()
  bar = tqdm.tqdm(total=args.steps, desc=config.name, disable=args.no_progress, leave=False)
  shown = {}
  for i, batch in zip(range(1, args.steps + 1), batches):
    history.append(step(batch))
    if i in evals:
      eval_metrics.append(evaluate())
      shown["eval"] = f"{eval_metrics[-1]['loss']:.3f}"
    if i % 10 == 0 or i == args.steps:
      loss, scale, _ = history[-1]
      shown.update(loss=f"{float(loss):.3f}", scale=f"{float(scale):g}")
      bar.set_postfix(shown)
      bar.update(i - bar.n)
  bar.close()
  loss, scale, skipped = (np.asarray(x) for x in zip(*jax.device_get(history)))
  return Result(
      name=config.name,
      loss=loss.astype(np.float64),
      scale=scale.astype(np.float64),
      skipped=skipped.astype(bool),
      eval_steps=evals,
      eval_metrics=eval_metrics,
      wall_s=time.perf_counter() - start,
      final_scale=float(scale[-1]),
  )


def results_table(results: list[Result], *, last: int = 50) -> str:
  """A Markdown table: final train loss (mean of the last steps), held-out metrics, skips, scale, time."""
  metrics = list(results[0].eval_metrics[-1])
  header = ["run", f"train loss (last {last})", *(f"held-out {m}" for m in metrics)]
  header += ["skipped steps", "final scale", "wall s"]
  rows = []
  for r in results:
    tail = r.loss[-last:]
    train = float(np.mean(tail[np.isfinite(tail)])) if np.isfinite(tail).any() else math.nan
    rows.append(
        [r.name, f"{train:.4f}", *(f"{r.eval_metrics[-1][m]:.4f}" for m in metrics)]
        + [str(int(r.skipped.sum())), f"{r.final_scale:g}", f"{r.wall_s:.1f}"]
    )
  lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
  return "\n".join(lines + ["| " + " | ".join(row) + " |" for row in rows])


def _pyplot():
  import matplotlib

  matplotlib.use("Agg")  # files only: no display needed
  import matplotlib.pyplot as plt

  return plt


def plot_runs(results: list[Result], path: str, *, title: str, smooth: int = 20) -> None:
  """Top: each run's training loss (smoothed) and held-out loss. Bottom: the loss scale, skips marked."""
  plt = _pyplot()
  fig, (top, bottom) = plt.subplots(2, 1, figsize=(7, 6), sharex=True, height_ratios=(2, 1))
  colors = {config.name: f"C{i}" for i, config in enumerate(RUNS)}  # a run keeps its color in every figure
  for r in results:
    color = colors[r.name]
    steps = np.arange(1, len(r.loss) + 1)
    window = min(smooth, len(r.loss))
    smoothed = np.convolve(r.loss, np.ones(window) / window, mode="valid")
    top.plot(steps[window - 1 :], smoothed, color=color, lw=1.2, label=f"{r.name} (train)")
    top.plot(r.eval_steps, [m["loss"] for m in r.eval_metrics], "o--", color=color, ms=3, lw=0.8,
             label=f"{r.name} (held-out)")
    if r.scale.max() != 1.0 or r.skipped.any():  # only the scaled runs have a scale to show
      bottom.semilogy(steps, r.scale, color=color, lw=1.2, label=f"{r.name}: loss scale", base=2)
      bottom.plot(steps[r.skipped], r.scale[r.skipped], "x", color="C3", ms=5,
                  label=f"skipped steps ({int(r.skipped.sum())})")
  top.set_yscale("log")  # float16 without scaling can diverge by orders of magnitude
  top.yaxis.set_major_formatter(plt.LogFormatter())
  top.yaxis.set_minor_formatter(plt.LogFormatter(labelOnlyBase=False, minor_thresholds=(1, 0.4)))
  top.set_ylabel("loss")
  top.set_title(title, fontsize=9)
  top.legend(fontsize=7)
  top.grid(alpha=0.3)
  bottom.set_xlabel("step")
  bottom.set_ylabel("loss scale")
  bottom.grid(alpha=0.3)
  if bottom.lines:
    bottom.legend(fontsize=7)
  fig.tight_layout()
  fig.savefig(path, dpi=90)
  plt.close(fig)
  print(f"wrote {path}")


def underflow_fractions(tree: Any) -> dict[str, float]:
  """Fractions of the elements of ``tree`` that are zero and that are float16-subnormal (nonzero)."""
  flat = np.concatenate([np.abs(np.asarray(x, np.float64)).ravel() for x in jax.tree.leaves(tree)])
  zero = float(np.mean(flat == 0))
  subnormal = float(np.mean((flat > 0) & (flat < FP16_NORMAL)))
  return {"zero": zero, "subnormal": subnormal}


def plot_grad_hist(panels: dict[str, dict[str, Any]], path: str, *, title: str) -> None:
  """One panel per group of tensors: histograms of log2|g| per variant, float16's limits drawn.

  ``panels`` maps a panel title to ``{label: pytree of gradients}``; zeros are
  counted in a bar of their own at the left.
  """
  plt = _pyplot()
  fig, axes = plt.subplots(1, len(panels), figsize=(6 * len(panels), 4), squeeze=False)
  lo, hi = -40, 24
  zero_at = lo - 4  # where the bar of exact zeros stands
  for ax, (panel, variants) in zip(axes[0], panels.items()):
    for (label, tree), color in zip(variants.items(), ("C0", "C1", "C2")):
      flat = np.concatenate([np.abs(np.asarray(x, np.float64)).ravel() for x in jax.tree.leaves(tree)])
      nonzero = flat[flat > 0]
      zero = np.mean(flat == 0)
      ax.hist(np.clip(np.log2(nonzero), lo, hi), bins=np.arange(lo, hi + 1.0), histtype="step", color=color,
              lw=1.5, weights=np.full(nonzero.shape, 1.0 / flat.size), label=f"{label}: {zero:.1%} zero")
      ax.bar(zero_at, zero, width=2, color=color, alpha=0.5)
    for limit, style, name in ((FP16_SUBNORMAL, "--", "fp16 smallest subnormal"),
                               (FP16_NORMAL, ":", "fp16 smallest normal"), (FP16_MAX, "-.", "fp16 largest")):
      ax.axvline(math.log2(limit), color="k", ls=style, lw=1)
      ax.text(math.log2(limit) + 0.5, 0.5, f"{name} 2^{round(math.log2(limit))}", transform=ax.get_xaxis_transform(),
              rotation=90, fontsize=7, va="center")
    ticks = range(lo + 10, hi + 1, 10)
    ax.set_xticks([zero_at, *ticks], ["zero", *map(str, ticks)])
    ax.set_xlabel("log2 |g|")
    ax.set_ylabel("fraction of elements")
    ax.set_title(panel, fontsize=9)
    ax.legend(fontsize=7, loc="upper right")
  fig.suptitle(title, fontsize=10)
  fig.tight_layout()
  fig.savefig(path, dpi=90)
  plt.close(fig)
  print(f"wrote {path}")
