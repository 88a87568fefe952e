"""jaxscale.plot: draws a PNG (a bare Figure: no backend, no pyplot), names the extra without matplotlib."""

import sys

import jax.numpy as jnp
import pytest

import jaxscale
import jaxscale.plot


def test_range_histogram_writes_a_png(tmp_path):
  g = {"a": jnp.array([1e-9, 1e-6, 0.0, 0.5]), "b": jnp.array([jnp.inf, 3e-5])}
  runs = {"unscaled": {"a": jaxscale.range_stats(g["a"]), "b": jaxscale.range_stats(g["b"])},
          "x 2^10": {"a": jaxscale.range_stats(g["a"], scale=1024.0)}}
  fig = jaxscale.plot.range_histogram(runs, path=tmp_path / "h.png", title="t", columns=1)
  assert (tmp_path / "h.png").stat().st_size > 10_000
  assert [ax.get_title() for ax in fig.axes if ax.get_visible() and ax.get_title()] == ["a", "b"]
  single = jaxscale.plot.range_histogram({"one": jaxscale.range_stats(g)}, dtype=jnp.bfloat16)
  assert len([ax for ax in single.axes if ax.get_visible()]) >= 1
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
