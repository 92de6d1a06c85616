"""A stacked-area SVG chart (outcomes per second, stacked) with an optional line on top.

Line charts come from `gateway.capacity.charts`; this adds the one shape it lacks, drawn to the
same look: white ground, grey frame, ticks from `charts.nice_ticks`, legend on the right.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from html import escape

from gateway.capacity.charts import PALETTE, nice_ticks

OUTCOME_COLORS = {
    "local": "#2ca02c",
    "served": "#2ca02c",
    "queued": "#98df8a",
    "degraded": "#17becf",
    "provider": "#1f77b4",
    "cached": "#9467bd",
    "throttled": "#ff7f0e",
    "rejected": "#d62728",
    "error": "#444444",
}
LEFT, RIGHT, TOP, BOTTOM = 64, 150, 36, 48


@dataclass(frozen=True, kw_only=True)
class StackedChart:
    title: str
    x_label: str
    y_label: str
    x: Sequence[float]
    layers: Sequence[tuple[str, Sequence[float]]]  # bottom first
    line: tuple[str, Sequence[float]] | None = None  # drawn over the stack, e.g. arrivals
    width: int = 720
    height: int = 320
    x_range: tuple[float, float] | None = None  # charts that share one axis; else the data's


def _color(name: str, i: int) -> str:
    return OUTCOME_COLORS.get(name, PALETTE[i % len(PALETTE)])


def render_stacked(chart: StackedChart) -> str:
    xs = list(chart.x) or [0.0]
    tops = [sum(layer[1][i] for layer in chart.layers) for i in range(len(xs))]
    line_max = max(chart.line[1], default=0.0) if chart.line else 0.0
    x_ticks = nice_ticks(*(chart.x_range or (min(xs), max(xs))))
    y_ticks = nice_ticks(0.0, max([*tops, line_max, 1.0]))
    right, bottom = chart.width - RIGHT, chart.height - BOTTOM

    def px(x: float) -> float:
        span = (x_ticks[-1] - x_ticks[0]) or 1.0
        return LEFT + (x - x_ticks[0]) / span * (right - LEFT)

    def py(y: float) -> float:
        return bottom - (y - y_ticks[0]) / ((y_ticks[-1] - y_ticks[0]) or 1.0) * (bottom - TOP)

    out = [f'<rect x="{LEFT}" y="{TOP}" width="{right - LEFT}" height="{bottom - TOP}" '
           'fill="none" stroke="#999"/>']  # fmt: skip
    for t in y_ticks:
        out.append(f'<line x1="{LEFT}" y1="{py(t):.1f}" x2="{right}" y2="{py(t):.1f}" '
                   f'stroke="#eee"/><text x="{LEFT - 6}" y="{py(t) + 4:.1f}" '
                   f'text-anchor="end">{t:g}</text>')  # fmt: skip
    for t in x_ticks:
        out.append(f'<text x="{px(t):.1f}" y="{bottom + 16}" text-anchor="middle">{t:g}</text>')
    base = [0.0] * len(xs)
    for i, (name, values) in enumerate(chart.layers):
        top = [b + v for b, v in zip(base, values, strict=True)]
        upper = " ".join(f"{px(x):.1f},{py(y):.1f}" for x, y in zip(xs, top, strict=True))
        lower = " ".join(
            f"{px(x):.1f},{py(y):.1f}" for x, y in reversed(list(zip(xs, base, strict=True)))
        )
        color = _color(name, i)
        out.append(f'<polygon points="{upper} {lower}" fill="{color}" fill-opacity="0.85" '
                   f'stroke="{color}"><title>{escape(name)}</title></polygon>')  # fmt: skip
        out += _legend(right, i, name, color, area=True)
        base = top
    if chart.line is not None:
        name, values = chart.line
        path = " ".join(f"{px(x):.1f},{py(y):.1f}" for x, y in zip(xs, values, strict=True))
        out.append(f'<polyline points="{path}" fill="none" stroke="#000" stroke-width="1.5" '
                   'stroke-dasharray="4 3"/>')  # fmt: skip
        out += _legend(right, len(chart.layers), name, "#000", area=False)
    mid_y = (TOP + bottom) / 2
    out += [
        f'<text x="{(LEFT + right) / 2:.1f}" y="{chart.height - 10}" text-anchor="middle">'
        f"{escape(chart.x_label)}</text>",
        f'<text x="16" y="{mid_y:.1f}" text-anchor="middle" transform="rotate(-90 16 '
        f'{mid_y:.1f})">{escape(chart.y_label)}</text>',
        f'<text x="{LEFT}" y="22" font-weight="bold">{escape(chart.title)}</text>',
    ]
    w, h = chart.width, chart.height
    return (
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" viewBox="0 0 {w} {h}" '
        f'font-family="sans-serif" font-size="11"><rect width="{w}" height="{h}" fill="white"/>'
        + "\n".join(out)
        + "</svg>"
    )


def _legend(right: int, i: int, name: str, color: str, *, area: bool) -> list[str]:
    y = TOP + 14 + 18 * i
    mark = (
        f'<rect x="{right + 12}" y="{y - 9}" width="20" height="10" fill="{color}"/>'
        if area
        else f'<line x1="{right + 12}" y1="{y - 4}" x2="{right + 32}" y2="{y - 4}" '
        f'stroke="{color}" stroke-dasharray="4 3"/>'
    )
    return [mark, f'<text x="{right + 38}" y="{y}">{escape(name)}</text>']
