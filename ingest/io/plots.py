"""Line charts a command writes beside its numbers (matplotlib, no pyplot state): panels of
curves over steps, each panel with its title, axis labels and legend."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator


@dataclass(frozen=True)
class Curve:
    label: str
    x: Sequence[float]
    y: Sequence[float]
    linestyle: str = "-"
    marker: str | None = None
    color: str | None = None  # None: the next colour of the panel's cycle


@dataclass(frozen=True)
class Panel:
    title: str
    ylabel: str
    curves: Sequence[Curve]
    xlabel: str = "step"
    integer_x: bool = True  # steps: no 0.5 ticks
    ylim: tuple[float, float] | None = None
    legend_loc: str = "best"


def panels_figure(panels: Sequence[Panel], *, columns: int = 1, title: str | None = None,
                  panel_size: tuple[float, float] = (7, 4)) -> Figure:
    """One axes per panel, left to right then top to bottom in `columns` columns."""
    rows = -(-len(panels) // columns)
    figure = Figure(figsize=(panel_size[0] * columns, panel_size[1] * rows),
                    layout="constrained")
    grid = figure.subplots(rows, columns, squeeze=False)
    for axes in grid.flat[len(panels):]:
        axes.set_visible(False)
    for axes, panel in zip(grid.flat, panels, strict=False):
        for curve in panel.curves:
            axes.plot(curve.x, curve.y, label=curve.label, linestyle=curve.linestyle,
                      marker=curve.marker, color=curve.color)
        axes.set_title(panel.title)
        axes.set_xlabel(panel.xlabel)
        axes.set_ylabel(panel.ylabel)
        if panel.integer_x:
            axes.xaxis.set_major_locator(MaxNLocator(integer=True))
        if panel.ylim is not None:
            axes.set_ylim(*panel.ylim)
        axes.grid(alpha=0.3)
        if panel.curves:
            axes.legend(loc=panel.legend_loc, fontsize="small")
    if title is not None:
        figure.suptitle(title)
    return figure


def save_panels(path: Path, panels: Sequence[Panel], **layout) -> Path:
    """`panels_figure(panels, **layout)` as a PNG at `path` (OSError if it cannot be written)."""
    panels_figure(panels, **layout).savefig(path, dpi=100, format="png")
    return path
