"""The HTML report's charts: limits that coincide stay visible, one time axis for all."""

from __future__ import annotations

import re

from gateway.capacity.charts import LineChart, Series, render_svg
from loadtest.loadgen.html import _fill_chart
from loadtest.loadgen.svg import StackedChart, render_stacked

LEGEND = re.compile(r'<text x="608" y="\d+">([^<]*)</text>')
X_TICKS = re.compile(r'<text x="[\d.]+" y="288" text-anchor="middle">([^<]*)</text>')


def sample(t: float, limits: dict[str, int]) -> dict[str, object]:
    backends = {url: {"in_flight": 10, "capacity": 2000, "limit": n} for url, n in limits.items()}
    return {"t": t, "backends": backends, "queue_depth": {}}


def test_limits_that_coincide_share_one_line_and_a_different_one_keeps_its_own() -> None:
    a, b, c = "http://h:1", "http://h:2", "http://h:3"
    samples = [sample(t, {a: 1000, b: 1000, c: 500}) for t in (0.0, 0.5, 1.0)]
    svg = _fill_chart(samples, (0.0, 1.0))
    assert LEGEND.findall(svg) == [":1", ":2", ":3", "limit of :1, :2", "  its limit"]
    everyone = _fill_chart([sample(0.0, {a: 1000, b: 1000, c: 1000})], (0.0, 1.0))
    assert LEGEND.findall(everyone)[-1] == "limit of all 3"


def test_charts_given_one_range_draw_one_axis_whatever_their_data() -> None:
    early = LineChart(title="a", x_label="s", y_label="", series=[Series(name="x", points=[
        (0.1, 1.0), (0.4, 2.0)])], x_range=(0.0, 2.2))  # fmt: skip
    late = StackedChart(title="b", x_label="s", y_label="", x=[1.5, 2.1],
                        layers=[("local", [1.0, 2.0])], x_range=(0.0, 2.2))  # fmt: skip
    axis = ["0", "0.5", "1", "1.5", "2", "2.5"]
    assert X_TICKS.findall(render_svg(early)) == X_TICKS.findall(render_stacked(late)) == axis
