"""Dependency-free SVG line charts: several series, axes with ticks, labels, vertical markers.

chart = LineChart(title="TTFT", x_label="concurrency", y_label="ms",
                  series=[Series(name="p50", points=[(1, 80.0), (2, 95.0)])],
                  markers=[Marker(x=2, label="knee")])
svg = render_svg(chart)            # one <svg> element, embeddable in HTML
write_svg(path, [chart, other])    # charts stacked in one file
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from html import escape
from pathlib import Path

PALETTE = ("#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#17becf")
_MARGIN_LEFT, _MARGIN_RIGHT, _MARGIN_TOP, _MARGIN_BOTTOM = 64, 150, 36, 48


@dataclass(frozen=True, kw_only=True)
class Series:
    name: str
    points: Sequence[tuple[float, float]]
    color: str | None = None
    dashed: bool = False


@dataclass(frozen=True, kw_only=True)
class Marker:
    """A vertical line at x, labelled."""

    x: float
    label: str
    color: str = "#555555"


@dataclass(frozen=True, kw_only=True)
class LineChart:
    title: str
    x_label: str
    y_label: str
    series: Sequence[Series]
    markers: Sequence[Marker] = ()
    width: int = 720
    height: int = 320
    log_x: bool = False
    x_range: tuple[float, float] | None = None  # charts that share one axis; else the data's


def nice_ticks(low: float, high: float, *, count: int = 5) -> list[float]:
    """Round tick values (1, 2 or 5 x a power of ten) covering [low, high]."""
    if high <= low:
        high = low + 1
    raw = (high - low) / count
    power = 10 ** math.floor(math.log10(raw))
    step = next(m * power for m in (1, 2, 5, 10) if m * power >= raw)
    first = math.floor(low / step) * step
    ticks = []
    value = first
    while value <= high + step * 1e-9:
        ticks.append(round(value, 10))
        value += step
    if ticks[-1] < high:
        ticks.append(round(value, 10))
    return ticks


def _log2_ticks(low: float, high: float) -> list[float]:
    start, end = math.floor(math.log2(low)), math.ceil(math.log2(high))
    stride = max(1, math.ceil((end - start) / 10))
    return [2.0**e for e in range(start, end + 1, stride)]


def _fmt(value: float) -> str:
    if value != 0 and (abs(value) >= 1e5 or abs(value) < 1e-3):
        return f"{value:.3g}"
    return f"{value:.6g}"


class _Frame:
    """Maps data to pixels inside the plot area."""

    def __init__(self, chart: LineChart, x_ticks: list[float], y_ticks: list[float]) -> None:
        self.chart = chart
        self.left, self.top = _MARGIN_LEFT, _MARGIN_TOP
        self.right = chart.width - _MARGIN_RIGHT
        self.bottom = chart.height - _MARGIN_BOTTOM
        self.x_lo, self.x_hi = self._tx(x_ticks[0]), self._tx(x_ticks[-1])
        self.y_lo, self.y_hi = y_ticks[0], y_ticks[-1]

    def _tx(self, x: float) -> float:
        return math.log2(x) if self.chart.log_x else x

    def px(self, x: float) -> float:
        span = (self.x_hi - self.x_lo) or 1.0
        return self.left + (self._tx(x) - self.x_lo) / span * (self.right - self.left)

    def py(self, y: float) -> float:
        span = (self.y_hi - self.y_lo) or 1.0
        return self.bottom - (y - self.y_lo) / span * (self.bottom - self.top)


def _ticks(chart: LineChart) -> tuple[list[float], list[float]]:
    xs = [x for s in chart.series for x, _ in s.points] + [m.x for m in chart.markers]
    ys = [y for s in chart.series for _, y in s.points]
    if chart.log_x:
        xs = [x for x in xs if x > 0] or [1.0]
        x_ticks = _log2_ticks(min(xs), max(xs))
    elif chart.x_range is not None:
        x_ticks = nice_ticks(*chart.x_range)
    else:
        x_ticks = nice_ticks(min(xs, default=0.0), max(xs, default=1.0))
    y_ticks = nice_ticks(min(0.0, *ys) if ys else 0.0, max(ys, default=1.0))
    return x_ticks, y_ticks


def _axes(frame: _Frame, x_ticks: list[float], y_ticks: list[float]) -> list[str]:
    c = frame.chart
    out = [
        f'<rect x="{frame.left}" y="{frame.top}" width="{frame.right - frame.left}" '
        f'height="{frame.bottom - frame.top}" fill="none" stroke="#999"/>'
    ]
    for t in y_ticks:
        y = frame.py(t)
        out.append(
            f'<line x1="{frame.left}" y1="{y:.1f}" x2="{frame.right}" y2="{y:.1f}" stroke="#eee"/>'
        )
        out.append(f'<text x="{frame.left - 6}" y="{y + 4:.1f}" text-anchor="end">{_fmt(t)}</text>')
    for t in x_ticks:
        x = frame.px(t)
        out.append(
            f'<line x1="{x:.1f}" y1="{frame.bottom}" x2="{x:.1f}" y2="{frame.bottom + 4}" '
            'stroke="#999"/>'
        )
        out.append(
            f'<text x="{x:.1f}" y="{frame.bottom + 16}" text-anchor="middle">{_fmt(t)}</text>'
        )
    mid_x, mid_y = (frame.left + frame.right) / 2, (frame.top + frame.bottom) / 2
    out.append(
        f'<text x="{mid_x:.1f}" y="{c.height - 10}" text-anchor="middle">{escape(c.x_label)}</text>'
    )
    out.append(
        f'<text x="16" y="{mid_y:.1f}" text-anchor="middle" '
        f'transform="rotate(-90 16 {mid_y:.1f})">{escape(c.y_label)}</text>'
    )
    out.append(f'<text x="{frame.left}" y="22" font-weight="bold">{escape(c.title)}</text>')
    return out


def _lines(frame: _Frame) -> list[str]:
    out = []
    for i, s in enumerate(frame.chart.series):
        color = s.color or PALETTE[i % len(PALETTE)]
        points = [(x, y) for x, y in s.points if not frame.chart.log_x or x > 0]
        path = " ".join(f"{frame.px(x):.1f},{frame.py(y):.1f}" for x, y in points)
        dash = ' stroke-dasharray="6 4"' if s.dashed else ""
        out.append(
            f'<polyline points="{path}" fill="none" stroke="{color}" stroke-width="2"{dash}/>'
        )
        out += [
            f'<circle cx="{frame.px(x):.1f}" cy="{frame.py(y):.1f}" r="2.5" fill="{color}"/>'
            for x, y in points
        ]
        ly = frame.top + 14 + 18 * i
        out.append(
            f'<line x1="{frame.right + 12}" y1="{ly - 4}" x2="{frame.right + 32}" '
            f'y2="{ly - 4}" stroke="{color}" stroke-width="2"{dash}/>'
        )
        out.append(f'<text x="{frame.right + 38}" y="{ly}">{escape(s.name)}</text>')
    return out


def _markers(frame: _Frame) -> list[str]:
    out = []
    for i, m in enumerate(frame.chart.markers):
        x = frame.px(m.x)
        out.append(
            f'<line x1="{x:.1f}" y1="{frame.top}" x2="{x:.1f}" y2="{frame.bottom}" '
            f'stroke="{m.color}" stroke-dasharray="3 3"/>'
        )
        out.append(
            f'<text x="{x + 4:.1f}" y="{frame.top + 12 + 14 * i}" fill="{m.color}">'
            f"{escape(m.label)}</text>"
        )
    return out


def chart_body(chart: LineChart) -> str:
    """The chart's elements, without the enclosing <svg>."""
    x_ticks, y_ticks = _ticks(chart)
    frame = _Frame(chart, x_ticks, y_ticks)
    parts = _axes(frame, x_ticks, y_ticks) + _lines(frame) + _markers(frame)
    return "\n".join(parts)


def _svg(width: int, height: int, body: str) -> str:
    return (
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
        f'viewBox="0 0 {width} {height}" font-family="sans-serif" font-size="11">\n'
        f'<rect width="{width}" height="{height}" fill="white"/>\n{body}\n</svg>\n'
    )


def render_svg(chart: LineChart) -> str:
    return _svg(chart.width, chart.height, chart_body(chart))


def stack_svg(charts: Sequence[LineChart]) -> str:
    """Charts one above the other in a single SVG."""
    width = max(c.width for c in charts)
    groups, offset = [], 0
    for chart in charts:
        groups.append(f'<g transform="translate(0 {offset})">\n{chart_body(chart)}\n</g>')
        offset += chart.height
    return _svg(width, offset, "\n".join(groups))


def write_svg(path: Path, charts: Sequence[LineChart]) -> None:
    path.write_text(stack_svg(charts), "utf-8")
