"""What the examples share: the three runs, the training loop, the table, the figures.

Every example trains the same model three times, with the same seed and the
same data order, and changes only the precision:

- ``float32``: float32 compute, the reference;
- ``float16``: float16 compute (float32 parameters), no loss scaling;
- ``float16 + jaxscale``: float16 compute with dynamic loss scaling.

All three use one optimizer, ``jaxscale.dynamic_loss_scaling(inner,
enabled=...)``: disabled, it is exactly ``inner``, so the three runs differ in
nothing but the dtype and the scaler, and one jitted step serves them all.

``--precision SPEC`` (repeatable) replaces them with runs of the user's
choosing, through jaxscale's mixed-precision pieces: ``jaxscale.get_policy``,
the model built without ``dtype=`` arguments and run through
``jaxscale.autocast``, loss scaling where ``jaxscale.needs_loss_scaling``, and
``jaxscale.master_weights`` for 16-bit parameters.

Every training step returns ``jaxscale.metrics(opt_state)``, device arrays; the
loop reads them on the host, and with ``--tensorboard`` writes them every
``--log-every`` steps.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import math
import os
import time
from typing import Any, Callable, Iterable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import tqdm

import jaxscale
import tensorboard_logging  # a sibling in examples/ (on the path): how the examples write to TensorBoard


class RunConfig(NamedTuple):
  name: str
  dtype: Any  # the compute dtype
  scaling: bool  # whether jaxscale scales the loss
  # None: float32 parameters, and the model computes in `dtype` through Flax's `dtype=` arguments.
  # A policy (--precision): no `dtype=` arguments, `jaxscale.autocast` runs the model in its compute dtype,
  # and the parameters are stored in its param dtype (16-bit ones through `jaxscale.master_weights`).
  policy: jaxscale.Policy | None = None

  @property
  def master_weights(self) -> bool:
    """Whether the parameters are 16-bit, so that the optimizer needs a float32 master copy."""
    return self.policy is not None and jnp.finfo(self.policy.param_dtype).bits < 32


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
  scale: np.ndarray  # shape=(steps,): the loss scale after each step (jaxscale.metrics)
  skipped: np.ndarray  # shape=(steps,), bool: the steps the scaler skipped
  eval_steps: list[int]
  eval_metrics: list[dict[str, float]]  # one dict per evaluation, e.g. {"loss": ..}
  step_seconds: np.ndarray  # shape=(steps,): each training step's time, waited for; step 1 compiles
  final_scale: float  # the loss scale after the last step
  final_metrics: dict[str, float]  # jaxscale.metrics after the last step, read on the host
  scaling: bool = False  # whether jaxscale scaled the loss

  @property
  def ms_per_step(self) -> float:
    """Steady-state step time: the median over the steps after the first (which compiles)."""
    return 1e3 * float(np.median(self.step_seconds[1:] if len(self.step_seconds) > 1 else self.step_seconds))

  @property
  def compile_s(self) -> float:
    """The first step's time beyond a steady-state step: tracing and compiling the training step."""
    return float(self.step_seconds[0]) - self.ms_per_step / 1e3


class HelpFormatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
  """``--help`` keeps the module docstring's line breaks and shows every flag's default."""


def add_flags(
    parser: argparse.ArgumentParser, *, steps: int, batch: int, lr: float, loss_weight: float, out: str,
    init_scale: float | str = 2.0**16,
) -> None:
  """The flags every example takes; each example adds its model's own.

  ``init_scale="auto"``: the example can probe for its start scale, and does unless told a number.
  """
  parser.add_argument("--steps", type=int, default=steps, help="training steps per run")
  parser.add_argument("--batch", type=int, default=batch, help="batch size")
  parser.add_argument("--lr", type=float, default=lr, help="Adam's (peak) learning rate")
  parser.add_argument("--seed", type=int, default=0, help="model init and data order, the same for every run")
  parser.add_argument(
      "--loss-weight",
      type=float,
      default=loss_weight,
      help="multiply the loss by this before differentiating, and Adam's eps with it: float32 training "
      "stays the same up to rounding, but every gradient is this much smaller, which is where float16 "
      "underflows without a loss scale; 1 trains on the plain loss",
  )
  if init_scale == "auto":
    parser.add_argument(
        "--init-scale", type=scale_or_auto, default="auto",
        help="jaxscale's first loss scale: a number (65536 is torch's default), or auto: the largest power of "
        "two at which one probe step's gradients, parameters' and activations', stay 8 times below float16's "
        "largest value (jaxscale.probe_scale)",
    )
  else:
    parser.add_argument("--init-scale", type=float, default=init_scale, help="jaxscale's first loss scale")
  parser.add_argument(
      "--growth-interval",
      type=int,
      default=200,
      help="jaxscale's growth interval: shorter than torch's 2000, so that a short run shows the "
      "scale growing (and, if it overflows, backing off)",
  )
  parser.add_argument("--eval-every", type=int, default=0, help="evaluate every N steps (0: 10 times per run)")
  parser.add_argument(
      "--runs",
      default=",".join(str(i) for i in range(len(RUNS))),
      help="which runs, as indices into: " + ", ".join(f"{i}={r.name}" for i, r in enumerate(RUNS)),
  )
  parser.add_argument(
      "--precision",
      action="append",
      type=precision_spec,
      metavar="SPEC",
      help="instead of --runs, one run in this precision policy; repeat the flag to compare several in one "
      "table. A preset (float32, mixed_float16, mixed_bfloat16, mixed_float8), a jmp-style string "
      "(params=float32,compute=float16,output=float32, short p=f32,c=f16,o=f32; params=float16 stores the "
      "parameters in float16, with float32 master weights in the optimizer), or auto "
      "(jaxscale.recommended_policy() for this device). The model runs through jaxscale.autocast, and the "
      "loss is scaled where the compute dtype is float16",
  )
  parser.add_argument(
      "--tensorboard", metavar="DIR", help="write the loss and jaxscale.metrics to TensorBoard event files in "
      "DIR, one subfolder per run (needs tensorboardX: pip install 'jaxscale[tensorboard]')",
  )
  parser.add_argument("--log-every", type=positive_int, default=25, help="with --tensorboard: log every N steps")
  parser.add_argument("--out", default=out, help="where to write the figure of the runs")
  parser.add_argument("--no-plot", action="store_true", help="write no figure")
  parser.add_argument("--no-progress", action="store_true", help="hide the progress bars")


def positive_int(text: str) -> int:
  """A count of steps: an integer >= 1."""
  try:
    value = int(text)
  except ValueError:
    value = 0
  if value < 1:
    raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text!r}")
  return value


def scale_or_auto(text: str) -> float | str:
  """A value of ``--init-scale`` where "auto" is allowed: "auto", or a positive number."""
  if text == "auto":
    return text
  try:
    value = float(text)
  except ValueError:
    value = math.nan
  if not 0 < value < math.inf:
    raise argparse.ArgumentTypeError(f"expected a positive number or auto, got {text!r}")
  return value


def selected_runs(args: argparse.Namespace) -> list[RunConfig]:
  if args.precision:
    return [precision_run(spec) for spec in args.precision]
  return [RUNS[int(i)] for i in args.runs.split(",")]


def precision_spec(spec: str) -> str:
  """``spec`` if it names a policy (or is ``auto``); otherwise argparse's error, with get_policy's reason."""
  if spec != "auto":
    try:
      jaxscale.get_policy(spec)
    except ValueError as e:
      raise argparse.ArgumentTypeError(f"{e} Or auto, for jaxscale.recommended_policy().") from None
  return spec


def precision_run(spec: str) -> RunConfig:
  """The run for ``--precision SPEC``: the policy decides the dtypes, whether to scale the loss, and master weights."""
  if spec == "auto":
    policy = jaxscale.recommended_policy()
    presets = {str(jaxscale.get_policy(p)): p for p in ("float32", "mixed_float16", "mixed_bfloat16")}
    name = f"auto = {presets.get(str(policy), policy)}"
  else:
    policy = jaxscale.get_policy(spec)
    # However float32 was spelt, it is the reference of the "held-out loss vs float32" column.
    name = RUNS[0].name if policy == jaxscale.get_policy("float32") else spec
  return RunConfig(name, policy.compute_dtype, jaxscale.needs_loss_scaling(policy), policy)


def describe_run(config: RunConfig) -> str:
  """One line for a --precision run: its policy, and which of jaxscale's pieces it goes through."""
  master = ", float32 master weights (jaxscale.master_weights)" if config.master_weights else ""
  return f"{config.name}: {config.policy} through jaxscale.autocast, loss scaling {config.scaling}{master}"


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
    step: Callable[[Any], tuple[jax.Array, dict[str, jax.Array]]],
    batches: Iterable[Any],
    evaluate: Callable[[], dict[str, float]],
    args: argparse.Namespace,
) -> Result:
  """Runs ``step(batch) -> (loss, jaxscale.metrics(opt_state))`` over ``batches``.

  ``step`` updates the model itself (an NNX object, or a Linen state held by
  the caller's closure). The loop waits for each step to finish, so that its
  time is its own (the first one's includes compiling the step) and excludes
  the evaluations; the metrics stay device arrays until they are shown or
  logged, and are read all at once when the run ends.
  """
  if config.policy is not None:
    print(describe_run(config))
  history, seconds = [], []
  evals = eval_steps(args)
  eval_metrics = []
  writer = tensorboard_writer(args.tensorboard, config.name) if args.tensorboard else None
  bar = tqdm.tqdm(total=args.steps, desc=config.name, disable=args.no_progress, leave=False)
  shown = {}
  for i, batch in zip(range(1, args.steps + 1), batches):
    start = time.perf_counter()
    history.append(jax.block_until_ready(step(batch)))
    seconds.append(time.perf_counter() - start)
    if i in evals:
      eval_metrics.append(evaluate())
      shown["eval"] = f"{eval_metrics[-1]['loss']:.3f}"
      if writer:
        writer.add_scalar("heldout/loss", eval_metrics[-1]["loss"], i)
    if writer and (i % args.log_every == 0 or i == args.steps):
      loss, metrics = history[-1]
      tensorboard_logging.write_scalars(writer, {"loss": loss, **metrics}, i)
    if i % 10 == 0 or i == args.steps:
      loss, metrics = history[-1]
      shown.update(loss=f"{float(loss):.3f}", scale=f"{float(metrics['scale']):g}")
      bar.set_postfix(shown)
      bar.update(i - bar.n)
  bar.close()
  if writer:
    writer.close()
  losses, metrics = jax.device_get(list(zip(*history)))
  final_metrics = {name: float(value) for name, value in metrics[-1].items()}
  return Result(
      name=config.name,
      loss=np.asarray(losses, np.float64),
      scale=np.array([m["scale"] for m in metrics], np.float64),
      skipped=np.array([m["last_skipped"] for m in metrics], bool),
      eval_steps=evals,
      eval_metrics=eval_metrics,
      step_seconds=np.asarray(seconds),
      final_scale=final_metrics["scale"],
      final_metrics=final_metrics,
      scaling=config.scaling,
  )


def tensorboard_writer(logdir: str, run: str):
  """A tensorboardX writer for one run, in a subfolder of ``logdir`` named after it."""
  folder = "".join(c if c.isalnum() or c in "-_.=" else "_" for c in run)
  return tensorboard_logging.summary_writer(os.path.join(logdir, folder))


def results_table(results: list[Result], *, last: int = 50) -> str:
  """A Markdown table of the runs: final losses (against float32's, where it ran), skipped steps, scale, and
  step time apart from compilation."""
  metrics = list(results[0].eval_metrics[-1])
  reference = next((r.eval_metrics[-1]["loss"] for r in results if r.name == RUNS[0].name), None)
  header = [
      "run", *(f"held-out {m}" for m in metrics), *(["held-out loss vs float32"] if reference else []),
      f"train loss (mean of last {last} steps)", "skipped steps", "final loss scale",
      "ms/step (median, after step 1)", "compile s (step 1 minus median)",
  ]
  rows = []
  for r in results:
    tail = r.loss[-last:]
    train = float(np.mean(tail[np.isfinite(tail)])) if np.isfinite(tail).any() else math.nan
    versus = [f"{r.eval_metrics[-1]['loss'] / reference - 1:+.1%}"] if reference else []
    rows.append(
        [r.name, *(f"{r.eval_metrics[-1][m]:.4f}" for m in metrics), *versus, f"{train:.4f}",
         str(int(r.final_metrics["skipped_steps"])),
         f"{r.final_scale:g}", f"{r.ms_per_step:.1f}", f"{r.compile_s:.1f}"]
    )
  lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
  return "\n".join(lines + ["| " + " | ".join(row) + " |" for row in rows])


def _pyplot():
  import matplotlib

  matplotlib.use("Agg")  # files only: no display needed
  import matplotlib.pyplot as plt

  return plt


# How each run is drawn, the same in every figure: float32 wide and pale underneath, so that a
# float16 run that matches it shows on top of it instead of hiding it.
STYLES = {
    RUNS[0].name: dict(color="0.6", lw=3.5, ls="-", marker="o", zorder=1),
    RUNS[1].name: dict(color="C1", lw=1.3, ls="-", marker="s", zorder=2),
    RUNS[2].name: dict(color="C2", lw=1.3, ls="--", marker="^", zorder=3),
}
# The --precision runs other than float32, in the order given.
OTHER_STYLES = (
    dict(color="C0", lw=1.3, ls="--", marker="^", zorder=3),
    dict(color="C5", lw=1.3, ls="-.", marker="D", zorder=4),
    dict(color="C4", lw=1.3, ls=":", marker="v", zorder=5),
    dict(color="C1", lw=1.3, ls="-", marker="s", zorder=2),
)


def plot_runs(results: list[Result], path: str, *, title: str, smooth: int = 20) -> None:
  """Top: each run's training loss (smoothed) and held-out loss. Bottom: the loss scale, skips marked.

  The legends stand to the right of the axes, outside the data.
  """
  plt = _pyplot()
  import matplotlib.lines
  import matplotlib.ticker

  fig, (top, bottom) = plt.subplots(2, 1, figsize=(9, 6), sharex=True, height_ratios=(2, 1))
  handles = []
  others = iter(OTHER_STYLES * len(results))
  for r in results:
    style = dict(STYLES[r.name] if r.name in STYLES else next(others))
    marker = style.pop("marker")
    steps = np.arange(1, len(r.loss) + 1)
    window = min(smooth, len(r.loss))
    smoothed = np.convolve(r.loss, np.ones(window) / window, mode="valid")
    final = r.eval_metrics[-1]["loss"]
    top.plot(steps[window - 1 :], smoothed, **style)
    markers = dict(marker=marker, color=style["color"], ms=5, mec="k", mew=0.5)
    top.plot(r.eval_steps, [m["loss"] for m in r.eval_metrics], ls="", zorder=style["zorder"] + 3, **markers)
    ending = f"held-out {final:.3f}" if math.isfinite(final) else "diverged (NaN)"
    handles.append(matplotlib.lines.Line2D([], [], **{**style, **markers}, label=f"{r.name}: {ending}"))
    if r.scale.max() != 1.0 or r.skipped.any():  # only the scaled runs have a scale to show
      bottom.plot(steps, r.scale, **style, label=f"{r.name}: loss scale")
      bottom.plot(steps[r.skipped], r.scale[r.skipped], "x", color="C3", ms=6, zorder=5,
                  label=f"{r.name}: skipped steps: {int(r.skipped.sum())}")
  top.set_yscale("log")  # float16 without scaling can diverge by orders of magnitude
  # Plain numbers on the log axis, as many per decade as fit, so that every curve's level can be read off.
  low, high = top.get_ylim()
  decades = math.log10(high / low)
  mantissas = (1, 1.5, 2, 2.5, 3, 4, 5, 6, 8) if decades < 0.8 else (1, 2, 5) if decades < 2.5 else (1,)
  nice = [k * 10.0**e for e in range(-6, 6) for k in mantissas]
  top.set_yticks([t for t in nice if low <= t <= high], minor=False)
  top.yaxis.set_major_formatter(matplotlib.ticker.FormatStrFormatter("%g"))
  top.yaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
  top.set_ylabel("loss (log scale)")
  top.set_title(title, fontsize=10)
  legend = dict(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0.0)
  top.legend(handles=handles, title=f"lines: training loss\n(mean of {smooth} steps)\nmarkers: held-out loss",
             title_fontsize=8, alignment="left", **legend)
  top.grid(alpha=0.3, which="both")
  bottom.set_xlabel("training step")
  bottom.set_ylabel("loss scale")
  bottom.set_yscale("log", base=2)
  bottom.grid(alpha=0.3)
  if bottom.lines:
    bottom.legend(**legend)
  fig.tight_layout()
  fig.savefig(path, dpi=100)
  plt.close(fig)
  print(f"wrote {path}")
