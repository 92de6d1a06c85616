"""`--html FILE`: one self-contained page (inline CSS and SVG, no script, no fetches).

It is rendered from the same dict `--json` writes, so a saved JSON can be re-rendered.
"""

from __future__ import annotations

from html import escape
from pathlib import Path
from typing import Any

from loadtest.charts import PALETTE, LineChart, Series, render_svg
from loadtest.loadgen_svg import StackedChart, render_stacked
from loadtest.loadgen_text import COLUMNS, COMPARED, compared_figures

CSS = """
body { font-family: sans-serif; margin: 24px; color: #222; max-width: 1520px; }
h1 { font-size: 22px; margin-bottom: 4px; } h2 { font-size: 18px; margin-top: 28px; }
.meta { color: #666; font-size: 13px; }
.cards { display: flex; flex-wrap: wrap; gap: 12px; margin: 12px 0; }
.card { border: 1px solid #ddd; border-radius: 6px; padding: 8px 14px; min-width: 120px; }
.card .v { font-size: 22px; font-weight: bold; } .card .k { color: #666; font-size: 12px; }
.bad { color: #c62828; } .good { color: #2e7d32; }
table { border-collapse: collapse; font-size: 13px; margin: 8px 0; }
th, td { border-bottom: 1px solid #eee; padding: 4px 10px; text-align: right; }
th:first-child, td:first-child { text-align: left; }
.runs { display: flex; flex-wrap: wrap; gap: 24px; } .run { flex: 1 1 720px; }
"""


def _fmt(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:,.1f}"
    return f"{value:,}" if isinstance(value, int) else escape(str(value))


def _card(run: int, key: str, label: str, value: Any, cls: str = "") -> str:
    return (
        f'<div class="card"><div class="v {cls}" id="run{run}-{key}">{_fmt(value)}</div>'
        f'<div class="k">{escape(label)}</div></div>'
    )


def _cards(i: int, s: dict[str, Any]) -> str:
    lag, pre = s["lag"], s["preemptions"]["total"]
    local = s["outcomes"].get("local") or s["outcomes"].get("served") or {}
    return '<div class="cards">' + "".join([
        _card(i, "requests", "requests", s["requests"]),
        _card(i, "ttft-p99", "TTFT p99 ms (all answered)", s["all"]["ttft_p99_ms"]),
        _card(i, "local-ttft-p99", "TTFT p99 ms (served locally)", local.get("ttft_p99_ms")),
        _card(i, "goodput", "goodput req/s in SLO", s["goodput"]["requests_per_s"]),
        _card(i, "preemptions", "backend preemptions", pre, "bad" if pre else "good"),
        _card(i, "lag-p99", "send lag p99 ms" + ("" if lag["kept_schedule"] else " (BEHIND)"),
              lag["p99_ms"], "" if lag["kept_schedule"] else "bad"),
    ]) + "</div>"  # fmt: skip


def _table(i: int, s: dict[str, Any]) -> str:
    head = "".join(f"<th>{escape(title)}</th>" for _, title, _ in COLUMNS)
    rows = []
    for name, row in [*s["outcomes"].items(), ("all", s["all"])]:
        cells = "".join(f"<td>{_fmt(row[key])}</td>" for key, _, _ in COLUMNS[1:])
        rows.append(f'<tr id="run{i}-row-{escape(name)}"><td>{escape(name)}</td>{cells}</tr>')
    return f"<table><tr>{head}</tr>{''.join(rows)}</table>"


def _outcomes_chart(series: dict[str, Any]) -> str:
    chart = StackedChart(
        title="arrivals vs outcomes (by arrival second)", x_label="s", y_label="requests / s",
        x=series["t"], layers=list(series["outcomes_per_s"].items()),
        line=("arrivals", series["arrivals_per_s"]),
    )  # fmt: skip
    return render_stacked(chart)


def _points(xs: list[float], ys: list[Any]) -> list[tuple[float, float]]:
    return [(x, float(y)) for x, y in zip(xs, ys, strict=True) if y is not None]


def _ttft_chart(series: dict[str, Any]) -> str:
    t = series["t"]
    return render_svg(LineChart(
        title="TTFT of answered requests (by arrival second)", x_label="s", y_label="ms",
        series=[Series(name="p50", points=_points(t, series["ttft_p50_ms"])),
                Series(name="p99", points=_points(t, series["ttft_p99_ms"]))],
    ))  # fmt: skip


def _fill_chart(samples: list[dict[str, Any]]) -> str:
    names = sorted({n for p in samples for n in p["backends"]})
    lines = []
    for k, name in enumerate(names):
        color = PALETTE[k % len(PALETTE)]
        pts = [(p["t"], p["backends"][name]) for p in samples if name in p["backends"]]
        short = short_name(name)
        lines.append(Series(name=short, color=color,
                            points=[(t, float(b["in_flight"])) for t, b in pts]))  # fmt: skip
        bound = "limit" if any(b.get("limit") is not None for _, b in pts) else "capacity"
        lines.append(Series(name=f"  its {bound}", color=color, dashed=True,
                            points=[(t, float(b.get(bound) or 0)) for t, b in pts]))  # fmt: skip
    return render_svg(LineChart(
        title="tokens in flight per backend (dashed: its limit)", x_label="s", y_label="tokens",
        series=lines,
    ))  # fmt: skip


def short_name(name: str) -> str:
    """Legend-sized: a backend URL becomes its port, a long name keeps its tail."""
    if "://" in name:
        return ":" + name.rstrip("/").rsplit(":", 1)[-1]
    return name if len(name) <= 16 else "…" + name[-15:]


def _queue_chart(samples: list[dict[str, Any]], *, direct: bool) -> str:
    names = sorted({n for p in samples for n in p["queue_depth"]})
    lines = [
        Series(name=short_name(name), points=[
            (p["t"], float(p["queue_depth"][name])) for p in samples if name in p["queue_depth"]
        ]) for name in names
    ]  # fmt: skip
    title = "requests waiting inside the backend" if direct else "gateway queue depth per pool"
    if not lines:
        return f'<p class="meta">{title}: nothing reported (no queue in the overflow chain)</p>'
    return render_svg(LineChart(title=title, x_label="s", y_label="requests", series=lines))


def _run_section(i: int, run: dict[str, Any]) -> str:
    s = run["summary"]
    parts = [
        f'<div class="run" id="run{i}"><h2>{escape(s["label"])}: {escape(", ".join(s["urls"]))}'
        "</h2>",
        _cards(i, s),
        _table(i, s),
        f'<p class="meta">statuses: {_fmt(s["statuses"])}; errors: {_fmt(s["errors"] or "none")}'
        f"; samples: {len(run['samples'])} (failed scrapes: {run['sample_failures']})</p>",
        _outcomes_chart(run["series"]),
        _ttft_chart(run["series"]),
    ]
    if run["samples"]:
        direct = run.get("sampled") == "backends"
        parts += [_fill_chart(run["samples"]), _queue_chart(run["samples"], direct=direct)]
    else:
        parts.append('<p class="meta">No fleet samples: give --admin-token to scrape the '
                     "gateway's /admin/status.</p>")  # fmt: skip
    return "\n".join(parts) + "</div>"


def _comparison(runs: list[dict[str, Any]]) -> str:
    if len(runs) != 2:
        return ""
    gateway, direct = (compared_figures(r["summary"]) for r in runs)
    rows = "".join(
        f'<tr id="compare-{i}"><td>{escape(name)}</td><td>{g}</td><td>{d}</td></tr>'
        for i, (name, g, d) in enumerate(zip(COMPARED, gateway, direct, strict=True))
    )
    return (
        "<h2>Same schedule: through the gateway vs straight at the backends</h2>"
        f'<table id="comparison"><tr><th></th><th>gateway</th><th>direct</th></tr>{rows}</table>'
    )


def render_html(data: dict[str, Any]) -> str:
    cfg = data["config"]
    runs = data["runs"]
    sections = [_run_section(i, r) for i, r in enumerate(runs)]
    meta = ", ".join(f"{escape(k)}: {_fmt(v)}" for k, v in cfg.items() if k != "tenants")
    return (
        '<!doctype html><html lang="en"><head><meta charset="utf-8">'
        f"<title>Spillgate load test: {escape(str(cfg.get('model', '')))}</title>"
        f"<style>{CSS}</style></head><body>"
        f'<h1>Spillgate load test</h1><p class="meta">{meta}</p>{_comparison(runs)}'
        f'<div class="runs">{"".join(sections)}</div></body></html>\n'
    )


def write_html(path: Path, data: dict[str, Any]) -> None:
    path.write_text(render_html(data), "utf-8")
