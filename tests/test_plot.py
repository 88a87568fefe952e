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
