"""One plotting convention for load curves, used by ``shoal-load --plot`` and ``shoal config tune``.

Throughput (inferences/s) on x, latency (ms) on y: the latency-throughput curve, whose knee
is where more load buys latency and no throughput. A curve's points are joined in order of
throughput, so a step whose throughput fell at a higher load does not draw a zig-zag (its
label still names it). Labels stay inside the picture: the axes leave margins, a label in the
right half of the plot sits to the left of its point, one near the top sits below it, and
the layout engine makes room for titles and the legend.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

XLABEL = "throughput (inferences/s)"
YLABEL = "latency (ms)"


@dataclass(frozen=True)
class Point:
    throughput: float  # inferences/s
    latency_ms: float
    label: str = ""  # drawn beside the point when its curve is annotated


@dataclass(frozen=True)
class Curve:
    name: str  # the legend entry
    points: tuple[Point, ...]
    style: str = "o-"
    annotate: bool = False


def pyplot() -> Any:
    """matplotlib's pyplot on a headless backend, or None without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return plt


def figure(curves: Sequence[Curve], title: str, budget_ms: float | None = None, ylabel: str = YLABEL) -> Any:
    """The figure (a matplotlib Figure); ``budget_ms`` draws a horizontal latency budget."""
    plt = pyplot()
    if plt is None:
        raise RuntimeError("plots need matplotlib: pip install 'shoal-client[plot]'")
    fig, axes = plt.subplots(figsize=(8, 5), layout="constrained")
    for curve in curves:
        points = sorted(curve.points, key=lambda p: p.throughput)
        axes.plot([p.throughput for p in points], [p.latency_ms for p in points], curve.style, label=curve.name)
    if budget_ms is not None:
        axes.axhline(budget_ms, color="grey", linestyle="--", label=f"latency budget {budget_ms:g} ms")
    axes.set(xlabel=XLABEL, ylabel=ylabel, title=title)
    axes.margins(x=0.15, y=0.2)
    axes.grid(alpha=0.3)
    axes.legend(fontsize=8, loc="upper left")
    x_low, x_high = axes.get_xlim()
    y_low, y_high = axes.get_ylim()
    x_low, y_low = max(0.0, x_low), max(0.0, y_low)  # neither throughput nor latency is negative
    axes.set_xlim(x_low, x_high)
    axes.set_ylim(y_low, y_high)
    for curve in curves:
        if not curve.annotate:
            continue
        for point in curve.points:
            right = point.throughput > (x_low + x_high) / 2
            top = point.latency_ms > y_low + 0.85 * (y_high - y_low)
            axes.annotate(
                point.label,
                (point.throughput, point.latency_ms),
                textcoords="offset points",
                xytext=(-5 if right else 5, -10 if top else 6),
                ha="right" if right else "left",
                fontsize=8,
            )
    return fig


def save(curves: Sequence[Curve], path: Path, title: str, budget_ms: float | None = None, ylabel: str = YLABEL) -> None:
    fig = figure(curves, title, budget_ms, ylabel)
    fig.savefig(path, dpi=110)
    pyplot().close(fig)
