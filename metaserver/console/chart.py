"""A bar chart as inline SVG geometry, computed on the server (no JavaScript, nothing fetched).

``bar_chart`` turns (label, value) pairs into the positions of bars, axis ticks and labels; the
template ``_bar_chart.html`` draws them with plain SVG elements (autoescaped like any other
text), so the chart shows in any browser, prints, and is checked by unit tests.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

# Drawing size in SVG user units; the SVG scales to its container.
CHART_WIDTH = 960
CHART_HEIGHT = 280
# Room for the y-axis labels on the left and the x-axis labels below.
MARGIN_LEFT = 64
MARGIN_RIGHT = 12
MARGIN_TOP = 12
MARGIN_BOTTOM = 44
# Horizontal gridlines, about.
TICKS_WANTED = 5


@dataclass(frozen=True)
class Bar:
    """One bar: where it is drawn and what it says."""

    x: float
    y: float
    width: float
    height: float
    label: str
    value: int
    show_label: bool  # the x-axis label is printed (every n-th bar, so labels never overlap)
    mark: str = ""  # a second line under the axis (the day where it changes), always printed


@dataclass(frozen=True)
class Tick:
    """A horizontal gridline and its value."""

    y: float
    value: int


@dataclass
class BarChart:
    """Everything the template needs to draw the chart."""

    width: int = CHART_WIDTH
    height: int = CHART_HEIGHT
    left: int = MARGIN_LEFT
    right: int = CHART_WIDTH - MARGIN_RIGHT
    top: int = MARGIN_TOP
    bottom: int = CHART_HEIGHT - MARGIN_BOTTOM
    bars: list[Bar] = field(default_factory=list)
    ticks: list[Tick] = field(default_factory=list)
    peak: int = 0


def nice_step(peak: int, wanted: int = TICKS_WANTED) -> int:
    """A round gridline step (1, 2 or 5 times a power of ten) giving about ``wanted`` lines up
    to ``peak``."""
    if peak <= 0:
        return 1
    raw = peak / wanted
    power = 10 ** math.floor(math.log10(raw)) if raw >= 1 else 1
    for factor in (1, 2, 5, 10):
        if factor * power >= raw:
            return max(1, int(factor * power))
    raise AssertionError("unreachable")  # factor 10 always reaches raw


def bar_chart(points: list[tuple[str, int]], labels_max: int = 24,
              marks: dict[int, str] | None = None) -> BarChart:
    """The geometry of a bar chart of ``points``; at most ``labels_max`` x labels are shown;
    ``marks`` (bar index -> text) go on a second line under those bars."""
    chart = BarChart()
    if not points:
        return chart
    peak = max(value for _, value in points)
    step = nice_step(peak)
    top_value = max(step, math.ceil(peak / step) * step)
    chart.peak = peak
    plot_height = chart.bottom - chart.top
    slot = (chart.right - chart.left) / len(points)
    gap = min(4.0, slot * 0.2)
    every = max(1, math.ceil(len(points) / labels_max))
    for i, (label, value) in enumerate(points):
        height = plot_height * value / top_value
        chart.bars.append(Bar(x=round(chart.left + i * slot + gap / 2, 2),
                              y=round(chart.bottom - height, 2),
                              width=round(slot - gap, 2), height=round(height, 2),
                              label=label, value=value, show_label=i % every == 0,
                              mark=(marks or {}).get(i, "")))
    for value in range(0, top_value + 1, step):
        chart.ticks.append(Tick(y=round(chart.bottom - plot_height * value / top_value, 2),
                                value=value))
    return chart
