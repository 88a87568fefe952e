"""jaxscale.plot: draws a PNG (a bare Figure: no backend, no pyplot), names the extra without matplotlib."""

import sys

import jax.numpy as jnp
import numpy as np
import pytest

import jaxscale
import jaxscale.plot


def expected_fractions(x):
  """NumPy's count of each binade of |x| (exponent -> fraction of elements), and the zero and inf/NaN fractions."""
  x = np.asarray(x, np.float64)
  finite = x[np.isfinite(x) & (x != 0)]
  exponents, counts = np.unique(np.floor(np.log2(np.abs(finite))).astype(int), return_counts=True)
  return dict(zip(exponents.tolist(), (counts / x.size).tolist())), np.mean(x == 0), np.mean(~np.isfinite(x))


def drawn(ax):
  """What a panel shows per run: its stairs as {exponent: fraction} (nonzero steps), and its two bars."""
  stairs = [p for p in ax.patches if type(p).__name__ == "StepPatch"]
  runs = []
  for stair, bars in zip(sorted(stairs, key=lambda p: p.get_zorder()), ax.containers):
    data = stair.get_data()
    histogram = {int(e): float(v) for v, e in zip(data.values, data.edges) if v}
    runs.append((histogram, *(bar.get_height() for bar in bars)))
  return runs


def test_range_histogram_draws_each_runs_binades_zeros_and_overflows(tmp_path):
  g = {"a": np.array([1e-9, 1e-6, 0.0, 0.5], np.float32), "b": np.array([np.inf, 3e-5], np.float32)}
  runs = {"unscaled": {"a": jaxscale.range_stats(jnp.asarray(g["a"])), "b": jaxscale.range_stats(jnp.asarray(g["b"]))},
          "x 2^10": {"a": jaxscale.range_stats(jnp.asarray(g["a"]), scale=1024.0)}}
  fig = jaxscale.plot.range_histogram(runs, path=tmp_path / "h.png", title="t", columns=1)
  panels = {ax.get_title(): ax for ax in fig.axes if ax.get_visible() and ax.get_title()}
  assert list(panels) == ["a", "b"] and (tmp_path / "h.png").read_bytes()[:4] == b"\x89PNG"
  # Each run's stairs and bars are NumPy's counts of the same values (times the scale), as fractions.
  for (histogram, zeros, nonfinite), x in zip(drawn(panels["a"]), (g["a"], g["a"] * 1024.0)):
    want_histogram, want_zeros, want_nonfinite = expected_fractions(x)
    assert histogram == pytest.approx(want_histogram) and zeros == want_zeros and nonfinite == want_nonfinite
  ((histogram, zeros, nonfinite),) = drawn(panels["b"])  # the scaled run has no panel "b"
  assert (histogram, zeros, nonfinite) == ({-16: 0.5}, 0.0, 0.5)
  single = jaxscale.plot.range_histogram({"one": jaxscale.range_stats({k: jnp.asarray(v) for k, v in g.items()})},
                                         dtype=jnp.bfloat16)
  (histogram, zeros, nonfinite), = drawn(single.axes[0])
  want_histogram, want_zeros, want_nonfinite = expected_fractions(np.concatenate([g["a"], g["b"]]))
  assert histogram == pytest.approx(want_histogram) and (zeros, nonfinite) == (want_zeros, want_nonfinite)
  with pytest.raises(ValueError, match="`stats_by_run`"):
    jaxscale.plot.range_histogram({})


def test_missing_matplotlib_names_the_extra(monkeypatch):
  monkeypatch.setitem(sys.modules, "matplotlib", None)
  monkeypatch.setitem(sys.modules, "matplotlib.figure", None)
  with pytest.raises(ImportError, match=r"pip install 'jaxscale\[plot\]'"):
    jaxscale.plot.range_histogram({"x": jaxscale.range_stats(jnp.ones(2))})


@pytest.mark.parametrize("panels", [1, 3])
def test_every_legend_entry_lies_inside_the_figure(panels):
  """The legend names the runs: an entry cut off by the figure's edge leaves a run unnamed."""
  from matplotlib.backends.backend_agg import FigureCanvasAgg

  g = jnp.array([1e-9, 1e-6, 0.0, 0.5])
  runs = {run: {f"layer {i}": jaxscale.range_stats(g, scale=s) for i in range(panels)}
          for run, s in (("unscaled", 1.0), ("at the probed scale", 1024.0))}
  fig = jaxscale.plot.range_histogram(runs)
  FigureCanvasAgg(fig).draw()
  width, height = fig.bbox.width, fig.bbox.height
  for text in fig.legends[0].get_texts():
    box = text.get_window_extent()
    assert 0 <= box.x0 and box.x1 <= width and 0 <= box.y0 and box.y1 <= height, text.get_text()


def test_wrong_arguments_are_explained():
  stats = jaxscale.range_stats(jnp.ones(2))
  with pytest.raises(TypeError, match=r"\{'label': stats\}"):
    jaxscale.plot.range_histogram(stats)
  with pytest.raises(ValueError, match="`columns`"):
    jaxscale.plot.range_histogram({"a": stats}, columns=0)
  with pytest.raises(ValueError, match="panel"):
    jaxscale.plot.range_histogram({"a": {}})


def test_a_run_missing_from_the_first_panel_is_still_in_the_legend():
  stats = jaxscale.range_stats(jnp.array([1e-6, 0.5]))
  fig = jaxscale.plot.range_histogram({"run a": {"x": stats}, "run b": {"y": stats}})
  assert {"run a", "run b"} <= {text.get_text() for text in fig.legends[0].get_texts()}
@pytest.mark.parametrize("columns, runs", [(1, 1), (2, 3), (3, 4)], ids=["narrow_1_run", "two_columns_3_runs",
                                                                         "three_columns_4_runs"])
def test_legend_fits_below_the_panels_and_coinciding_runs_both_show(columns, runs):
  g = jnp.array([1e-9, 1e-6, 0.0, 0.5, 3e-5])
  panels = {name: jaxscale.range_stats(g * factor) for factor, name in ((1.0, "one"), (2.0, "two"), (4.0, "three"))}
  labels = [f"a long run label number {i}, float16 x 2^{i}" for i in range(runs)]
  fig = jaxscale.plot.range_histogram({label: panels for label in labels}, columns=columns, title="t")
  fig.draw_without_rendering()
  legend, figure = fig.legends[0].get_window_extent(), fig.bbox
  # The whole legend inside the figure, and below every panel (its x-axis labels included).
  assert figure.x0 <= legend.x0 and legend.x1 <= figure.x1 and legend.y0 >= figure.y0
  for ax in fig.axes:
    if ax.get_visible():
      assert legend.y1 <= ax.get_tightbbox().y0 + 1
  # Identical histograms for every run: each outline is wider than the ones drawn on top of it.
  outlines = [p for p in fig.axes[0].patches if type(p).__name__ == "StepPatch"]
  assert len(outlines) == runs
  order = sorted(outlines, key=lambda p: p.get_zorder())
  assert all(a.get_linewidth() > b.get_linewidth() for a, b in zip(order, order[1:]))
  assert len({p.get_linestyle() for p in outlines}) == min(runs, 4)
