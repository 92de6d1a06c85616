"""The SVG line-chart writer."""

from __future__ import annotations

import xml.etree.ElementTree as ET
from pathlib import Path

from gateway.capacity.charts import LineChart, Marker, Series, nice_ticks, render_svg, write_svg

SVG = "{http://www.w3.org/2000/svg}"


def chart(**kw: object) -> LineChart:
    base: dict[str, object] = {
        "title": "TTFT <p50> & p99",
        "x_label": "concurrency",
        "y_label": "ms",
        "series": [
            Series(name="p50", points=[(1, 10.0), (2, 12.0), (4, 30.0)]),
            Series(name="p99", points=[(1, 15.0), (2, 20.0), (4, 80.0)], dashed=True),
        ],
        "markers": [Marker(x=2, label="knee")],
    }
    base.update(kw)
    return LineChart(**base)  # type: ignore[arg-type]


def test_nice_ticks_cover_the_range_with_round_steps() -> None:
    assert nice_ticks(0, 80) == [0, 20, 40, 60, 80]
    ticks = nice_ticks(3, 997)
    assert ticks[0] <= 3 and ticks[-1] >= 997 and ticks[1] - ticks[0] == 200


def test_render_is_valid_svg_with_series_legend_and_markers() -> None:
    root = ET.fromstring(render_svg(chart()))
    assert root.tag == f"{SVG}svg"
    lines = list(root.iter(f"{SVG}polyline"))
    assert len(lines) == 2 and lines[1].get("stroke-dasharray")
    texts = [t.text for t in root.iter(f"{SVG}text")]
    assert {"p50", "p99", "knee", "concurrency", "ms", "TTFT <p50> & p99"} <= set(texts)


def test_points_map_inside_the_plot_area_and_y_grows_upwards() -> None:
    root = ET.fromstring(render_svg(chart(markers=[])))
    first = next(iter(root.iter(f"{SVG}polyline"))).get("points", "").split()
    coords = [tuple(map(float, p.split(","))) for p in first]
    xs, ys = [c[0] for c in coords], [c[1] for c in coords]
    assert xs == sorted(xs) and ys[2] < ys[0]  # 30 ms is drawn above 10 ms
    assert all(0 < x < 720 and 0 < y < 320 for x, y in coords)


def test_log_x_spaces_doublings_evenly() -> None:
    root = ET.fromstring(render_svg(chart(log_x=True, markers=[])))
    first = next(iter(root.iter(f"{SVG}polyline"))).get("points", "").split()
    xs = [float(p.split(",")[0]) for p in first]
    assert abs((xs[1] - xs[0]) - (xs[2] - xs[1])) < 0.2


def test_write_stacks_charts_in_one_file(tmp_path: Path) -> None:
    path = tmp_path / "two.svg"
    write_svg(path, [chart(), chart(height=200)])
    root = ET.fromstring(path.read_text())
    assert root.get("height") == "520"
    assert len(list(root.iter(f"{SVG}polyline"))) == 4
