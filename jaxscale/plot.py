"""Plots of :func:`jaxscale.range_stats`: log2 histograms against a dtype's limits.

Needs matplotlib: ``pip install 'jaxscale[plot]'``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxscale import _range

_STYLES = ("-", "--", ":", "-.")


def _look(run: int) -> tuple[str, str]:
  """The colour and line style of the ``run``-th run: 20 runs before a pair repeats."""
  return f"C{run % 10}", _STYLES[run % len(_STYLES)]


def _line_width(run: int, runs: int) -> float:
  """Earlier runs are drawn wider (and beneath), so a run hidden under a later one still shows."""
  return 1.6 + 1.6 * (runs - 1 - run) / runs


def _figure_class() -> Any:
  # A bare Figure, not pyplot: no backend to choose, no global registry of open figures.
  try:
    from matplotlib.figure import Figure
  except ImportError:
    raise ImportError("jaxscale.plot needs matplotlib: pip install 'jaxscale[plot]'.") from None
  return Figure


def range_histogram(
    stats_by_run: Mapping[str, _range.RangeStats | Mapping[str, _range.RangeStats]],
    *,
    dtype: jax.typing.DTypeLike = jnp.float16,
    path: str | None = None,
    title: str | None = None,
    columns: int = 3,
) -> Any:
  """Small multiples of log2 |x| histograms, one panel per tapped layer, runs overlaid.

  Each run is a step outline of its own colour and line style, the earlier
  runs wider and underneath, so that two runs that coincide both show;
  exact zeros and non-finite inputs get bars of their own at the two ends,
  side by side per run. The dtype's smallest subnormal, smallest
  normal and largest finite value are drawn as vertical lines, labelled on
  the top axis, with the regions that flush to zero, turn subnormal and
  overflow shaded. The legend sits below the panels, in as many rows as it
  takes to fit the figure's width.

  Args:
    stats_by_run: ``{run label: RangeStats}`` for one panel, or
      ``{run label: {panel name: RangeStats}}`` (e.g. the tap statistics of
      one step per run: unscaled, and at the loss scale).
    dtype: whose limits to draw (float16 unless told).
    path: where to save the figure (PNG, SVG, ...), if anywhere.
    title: the figure's title.
    columns: panels per row.

  Returns:
    The ``matplotlib.figure.Figure``.

  Raises:
    ImportError: without matplotlib.
    TypeError: if ``stats_by_run`` is not a mapping (a bare ``RangeStats``).
    ValueError: if ``stats_by_run`` holds no panel, or ``columns`` is not a
      positive int.

  Examples:
    >>> import jax.numpy as jnp, jaxscale, jaxscale.plot
    >>> g = jnp.array([1e-9, 1e-6, 0.0, 0.5])
    >>> runs = {"unscaled": jaxscale.range_stats(g), "x 2^10": jaxscale.range_stats(g, scale=1024.0)}
    >>> fig = jaxscale.plot.range_histogram(runs, title="gradients")
    >>> fig.axes[0].get_xlabel()
    'log2 |x|;  inputs exactly zero, and inf or NaN, at the ends'
  """
  figure_class = _figure_class()
  if isinstance(stats_by_run, _range.RangeStats) or not isinstance(stats_by_run, Mapping):
    raise TypeError(
        "`stats_by_run` must map run labels to statistics, such as {'label': stats}, got "
        f"{type(stats_by_run).__name__}."
    )
  if not stats_by_run:
    raise ValueError("`stats_by_run` must hold at least one run, got an empty mapping.")
  if not isinstance(columns, int) or columns < 1:
    raise ValueError(f"`columns` must be a positive int, got {columns!r}.")
  runs = {run: ({"": s} if isinstance(s, _range.RangeStats) else dict(s)) for run, s in stats_by_run.items()}
  runs = {run: {name: jax.device_get(s) for name, s in panels.items()} for run, panels in runs.items()}
  names = list(dict.fromkeys(name for panels in runs.values() for name in panels))
  if not names:
    raise ValueError("`stats_by_run` must hold at least one panel; every run's mapping is empty.")
  finfo = jnp.finfo(dtype)
  limits = [math.log2(float(finfo.smallest_subnormal)), math.log2(float(finfo.smallest_normal)),
            math.log2(float(finfo.max))]
  used = [_range.HISTOGRAM_EXPONENTS[np.asarray(s.histogram) > 0] for p in runs.values() for s in p.values()]
  used = np.concatenate([*used, np.array(limits).round().astype(int)])
  lo, hi = max(int(used.min()) - 3, -149), min(int(used.max()) + 4, 128)
  zero_at, nonfinite_at = lo - 5, hi + 5

  rows = math.ceil(len(names) / columns)
  ncols = min(columns, len(names))
  width = 4.6 * ncols
  # The legend (the runs, three limits, two regions) wraps to the figure's width, in rows below the panels.
  entries = len(runs) + 5
  legend_columns = max(1, min(entries, int(width // 2.2)))
  legend_height = 0.1 + 0.2 * math.ceil(entries / legend_columns)
  height = 3.2 * rows + 0.3 + legend_height
  fig = figure_class(figsize=(width, height))
  axes = fig.subplots(rows, ncols, squeeze=False)
  for ax in axes.flat[len(names):]:
    ax.set_visible(False)
  width = 1.6 / len(runs)
  for ax, name in zip(axes.flat, names):
    ax.axvspan(lo, limits[0] - 1, color="tab:red", alpha=0.08, lw=0)
    ax.axvspan(limits[0] - 1, limits[1], color="tab:orange", alpha=0.10, lw=0)
    ax.axvspan(limits[2] + 0.0005, hi, color="tab:red", alpha=0.08, lw=0)
    for i, (run, panels) in enumerate(runs.items()):
      if name not in panels:
        continue
      s = panels[name]
      count = max(float(s.size), 1.0)
      inside = (_range.HISTOGRAM_EXPONENTS >= lo) & (_range.HISTOGRAM_EXPONENTS < hi)
      values = np.asarray(s.histogram)[inside] / count
      edges = np.arange(lo, hi + 1)
      color, style = _look(i)
      # Earlier runs wider and underneath: where two runs coincide, both show.
      ax.stairs(values, edges, color=color, ls=style, lw=_line_width(i, len(runs)), zorder=2 + i)
      offset = (i - (len(runs) - 1) / 2) * width
      ax.bar([zero_at + offset, nonfinite_at + offset], [float(s.zeros) / count, float(s.nonfinite) / count],
             width=width, color=color, alpha=0.8)
    for x, style in zip(limits, (":", "--", "-")):
      ax.axvline(x, color="k", ls=style, lw=0.8)
    top = ax.secondary_xaxis("top")
    top.set_xticks(limits, [f"2^{limits[0]:.0f}", f"2^{limits[1]:.0f}", f"{float(finfo.max):g}"], fontsize=7)
    ticks = [t for t in range(10 * math.ceil(lo / 10), hi + 1, 10) if lo + 2 <= t <= hi - 2]
    ax.set_xticks([zero_at, *ticks, nonfinite_at], ["zero", *map(str, ticks), "inf,\nNaN"], fontsize=8)
    for edge in (lo, hi):  # the histogram's ends, apart from the two count slots
      ax.axvline(edge, color="0.6", lw=0.6)
    ax.set_xlim(zero_at - 2, nonfinite_at + 2)
    ax.set_ylim(bottom=0)
    ax.set_xlabel("log2 |x|;  inputs exactly zero, and inf or NaN, at the ends", fontsize=8)
    ax.set_ylabel("fraction of elements", fontsize=8)
    ax.tick_params(axis="y", labelsize=7)
    if name:
      ax.set_title(name, fontsize=9, pad=22)
  from matplotlib.lines import Line2D
  from matplotlib.patches import Patch

  # Every run, whichever panels it is drawn in.
  handles = [Line2D([], [], color=_look(i)[0], ls=_look(i)[1], lw=_line_width(i, len(runs))) for i in range(len(runs))]
  labels = list(runs)
  dtype_name = np.dtype(dtype).name
  handles += [Line2D([], [], color="k", ls=style, lw=0.8) for style in (":", "--", "-")]
  labels += [f"{dtype_name}: smallest subnormal", "smallest normal", "largest finite"]
  handles += [Patch(color="tab:red", alpha=0.25), Patch(color="tab:orange", alpha=0.3)]
  labels += ["becomes 0 / overflows", "becomes subnormal"]
  fig.legend(handles, labels, loc="lower center", ncol=legend_columns, fontsize=8, frameon=False,
             columnspacing=1.2, handlelength=1.8)
  if title:
    fig.suptitle(title, fontsize=10)
  fig.tight_layout(rect=(0, legend_height / height, 1, 1))
  if path is not None:
    fig.savefig(path, dpi=100)
  return fig
