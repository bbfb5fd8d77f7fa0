"""Chart geometry for the first paint: line charts of a metric by step, the planner's sweep over N,
and the memory panel's stacked bar. dashboard.js redraws the sweep from the /v1 JSON with the same
constants; a job's line charts are what a browser without JavaScript sees, and static/charts.js draws
the interactive ones (uPlot) in their place."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from service.dashboard.format import bar_label, byte_unit

# the viewBox of every chart and its margins (dashboard.js: CHART)
WIDTH = 640
HEIGHT = 200
LEFT = 64
RIGHT = 12
TOP = 12
BOTTOM = 26
PLOT_W = WIDTH - LEFT - RIGHT
PLOT_H = HEIGHT - TOP - BOTTOM

# the sweep chart: two legend rows under the axis label name the memory and floor lines, so
# their labels never sit on the bars; a bar's value label, at most VALUE_LABEL_H tall (15 units
# at phone width, with its halo), moves above the memory line when it would sit on it
SWEEP_HEIGHT = HEIGHT + 64
SWEEP_LEGEND_Y = (HEIGHT + 34, HEIGHT + 56)
VALUE_LABEL_H = 16

# the plan's breakdown, in the order the stacked bar draws it (dashboard.js: PARTS)
PARTS = ("params", "grads", "buckets", "optimizer", "padding", "activations", "temporaries", "overhead")


@dataclass(frozen=True, slots=True, kw_only=True)
class LineChart:
    path: str
    """SVG path data in viewBox units; 'M' starts each unbroken run of finite values."""
    num_points: int
    x_range: tuple[float, float] | None
    y_range: tuple[float, float] | None
    first: tuple[float, float] | None
    last: tuple[float, float] | None
    second_path: str = ""
    """A second series on the same axes (the loss chart's eval_loss), one unbroken line."""
    second_points: int = 0


def _span(low: float, high: float) -> tuple[float, float]:
    if high > low:
        return low, high
    pad = abs(low) * 0.05 or 1.0  # a flat series sits mid-chart
    return low - pad, high + pad


def line_chart(
    points: Sequence[tuple[float, float | None]], *, second: Sequence[tuple[float, float]] = ()
) -> LineChart:
    """(step, value) pairs -> one polyline across the plot; None values break the line. `second`:
    another series drawn on the same axes (both count for the ranges)."""
    finite = [(x, y) for x, y in points if y is not None]
    if not finite:
        return LineChart(path="", num_points=0, x_range=None, y_range=None, first=None, last=None)
    both = finite + list(second)
    x0, x1 = _span(min(x for x, _ in both), max(x for x, _ in both))
    y0, y1 = _span(min(y for _, y in both), max(y for _, y in both))
    return LineChart(
        path=_path(points, x_range=(x0, x1), y_range=(y0, y1)),
        num_points=len(finite),
        x_range=(x0, x1),
        y_range=(y0, y1),
        first=finite[0],
        last=finite[-1],
        second_path=_path(second, x_range=(x0, x1), y_range=(y0, y1)),
        second_points=len(second),
    )


def steps_of(points: Sequence[tuple[float, float | None]]) -> list[tuple[float, float]]:
    """(step, value) pairs as a step function: where the value changes, a point at the new step
    with the old value first, so a line through them is flat between changes (an elastic job's N)."""
    out: list[tuple[float, float]] = []
    for x, y in points:
        if y is None:
            continue
        if out and out[-1][1] != y:
            out.append((x, out[-1][1]))
        out.append((x, y))
    return out


def _path(
    points: Sequence[tuple[float, float | None]], *, x_range: tuple[float, float], y_range: tuple[float, float]
) -> str:
    x0, x1 = x_range
    y0, y1 = y_range
    parts = []
    pen_down = False
    for x, y in points:
        if y is None:
            pen_down = False
            continue
        px = LEFT + (x - x0) / (x1 - x0) * PLOT_W
        py = TOP + (1 - (y - y0) / (y1 - y0)) * PLOT_H
        parts.append(f"{'L' if pen_down else 'M'}{px:.1f},{py:.1f}")
        pen_down = True
    return " ".join(parts)


@dataclass(frozen=True, slots=True, kw_only=True)
class Bar:
    num_gpus: int
    total_bytes: int
    fits: bool
    x: float
    y: float
    width: float
    height: float
    label: str
    """Its bytes in the chart's unit (SweepChart.unit)."""
    label_y: float
    """The baseline of the bar's value label: 3 above the bar, or 3 above the memory line near it."""


@dataclass(frozen=True, slots=True, kw_only=True)
class SweepChart:
    bars: list[Bar]
    y_max_bytes: int
    unit: str
    """The unit of the bar labels: the y axis's, so a small model's bars read in MB, not 0.00475 GB."""
    memory_y: float | None
    """Where the GPU memory line is drawn; None when it lies above the chart."""
    floor_y: float


def sweep_chart(sweep: Sequence[dict], *, gpu_memory_bytes: int, floor_bytes: int) -> SweepChart:
    """One bar per N (1, 2, 4, ... 1024), against the GPU's memory and the floor sharding cannot go below."""
    top = max(p["total_bytes"] for p in sweep)
    # show the memory line when it is near the bars; a tiny model against 80 GB would be a flat line
    y_max = max(top, gpu_memory_bytes) if gpu_memory_bytes <= 2 * top else top
    y_max = max(1, round(y_max * 1.08))
    memory_y = round(_y(gpu_memory_bytes, y_max), 1) if gpu_memory_bytes <= y_max else None
    scale, unit = byte_unit(y_max)
    slot = PLOT_W / len(sweep)
    bars = []
    for i, p in enumerate(sweep):
        y = round(_y(p["total_bytes"], y_max), 1)
        bars.append(
            Bar(
                num_gpus=p["num_gpus"],
                total_bytes=p["total_bytes"],
                fits=p["fits"],
                x=round(LEFT + i * slot + slot * 0.15, 1),
                width=round(slot * 0.7, 1),
                y=y,
                height=round(TOP + PLOT_H - y, 1),
                label=bar_label(p["total_bytes"], scale=scale),
                label_y=value_label_y(y, memory_y=memory_y),
            )
        )
    floor_y = round(_y(floor_bytes, y_max), 1)
    return SweepChart(bars=bars, y_max_bytes=y_max, unit=unit, memory_y=memory_y, floor_y=floor_y)


def value_label_y(bar_y: float, *, memory_y: float | None) -> float:
    """A bar's label sits 3 above the bar, unless the memory line would cross it: then 3 above the line.

    The floor line never crosses a label: every bar reaches at least the floor, so the line runs at
    or below the bar's top and the label sits above that.
    """
    if memory_y is not None and bar_y - 3 - VALUE_LABEL_H - 2 < memory_y <= bar_y:
        return round(memory_y - 3, 1)
    return round(bar_y - 3, 1)


def _y(num_bytes: int, y_max: int) -> float:
    return TOP + (1 - num_bytes / y_max) * PLOT_H


def floor_bytes(per_gpu: dict, *, stage: int) -> int:
    """Per-GPU bytes as N grows without bound: what the stage replicates, plus stage 2's gradient buckets,
    the step's bytes and the overhead.

    Stage 1 at fp16 + AdamW: the 4Ψ of fp16 weights and gradients, which 12Ψ/N melts toward.
    """
    replicated = {0: ("params", "grads", "optimizer", "padding"), 1: ("params", "grads"), 2: ("params",), 3: ()}
    unsharded = ("buckets", "activations", "temporaries", "overhead")
    return sum(per_gpu[f"{part}_bytes"] for part in (*replicated[stage], *unsharded))


def stacked_shares(per_gpu: dict, *, scale_bytes: int) -> list[tuple[str, int, float]]:
    """(part, bytes, percent of scale_bytes) for each part of the breakdown, in drawing order."""
    scale = max(1, scale_bytes)
    return [(part, per_gpu[f"{part}_bytes"], 100 * per_gpu[f"{part}_bytes"] / scale) for part in PARTS]
