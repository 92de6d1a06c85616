"""`--html FILE`: one self-contained page (inline CSS and SVG, no script, no fetches).

It is rendered from the same dict `--json` writes, so a saved JSON can be re-rendered.
Every chart of a report runs on one time axis, from the first arrival to the last
answer or sample of any run, so a moment lines up from chart to chart.
"""

from __future__ import annotations

from html import escape
from pathlib import Path
from typing import Any

from gateway.capacity.charts import PALETTE, LineChart, Series, render_svg
from loadtest.loadgen.svg import StackedChart, render_stacked
from loadtest.loadgen.text import (
    COLUMNS,
    COMPARED,
    compared_figures,
    engine_figures,
    first_error_line,
    prefix_hit_percent,
)

Span = tuple[float, float]
SHARED_LIMIT_COLOR = "#555555"
CONFIG_LABELS = {
    "url": "URL", "rate": "rate (req/s)", "duration_s": "duration (s)",
    "compare_direct": "compared straight at", "requests": "requests per run",
}  # fmt: skip

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
    running_max, running_p50, kv_peak, _ = engine_figures(s)
    return '<div class="cards">' + "".join([
        _card(i, "requests", "requests", s["requests"]),
        _card(i, "ttft-p99", "TTFT p99 ms (all answered)", s["all"]["ttft_p99_ms"]),
        _card(i, "local-ttft-p99", "TTFT p99 ms (served locally)", local.get("ttft_p99_ms")),
        _card(i, "goodput", "goodput req/s in SLO", s["goodput"]["requests_per_s"]),
        _card(i, "preemptions", "backend preemptions", pre, "bad" if pre else "good"),
        _card(i, "running-max", "running at once, max (p50 " + running_p50 + ")", running_max),
        _card(i, "kv-peak", "backend KV use peak %", kv_peak),
        _card(i, "prefix-hit", "backend prefix-cache hit %", prefix_hit_percent(s)),
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


def _words(value: Any) -> str:
    """A value as a reader writes it: lists joined, nothing as "none", never a repr."""
    if isinstance(value, dict):
        return ", ".join(f"{_words(k)}: {_words(v)}" for k, v in value.items()) or "none"
    if isinstance(value, list | tuple):
        return ", ".join(_words(v) for v in value) or "none"
    return _fmt(value)


def _config_table(cfg: dict[str, Any]) -> str:
    rows = "".join(
        f"<tr><td>{escape(CONFIG_LABELS.get(k, k.replace('_', ' ')))}</td><td>{_words(v)}</td></tr>"
        for k, v in cfg.items()
    )
    return f'<table id="config" class="meta">{rows}</table>'


def _answers(run: dict[str, Any]) -> str:
    s = run["summary"]
    statuses = ", ".join(f"{n} × HTTP {code}" for code, n in s["statuses"].items())
    errors = "; ".join(f"{n} × {message}" for message, n in s["errors"].items()) or "none"
    first = f" {first_error_line(s)}." if s["first_error"] else ""
    return (
        f'<p class="meta">Answers: {escape(statuses)}. Errors: {escape(errors)}.{escape(first)} '
        f"Fleet samples: {len(run['samples'])} ({run['sample_failures']} scrapes failed).</p>"
    )


def time_span(runs: list[dict[str, Any]]) -> Span:
    """The time axis every chart of the report shares: 0 to the last thing any run saw."""
    end = 0.0
    for run in runs:
        s, series = run["summary"], run["series"]
        ends = [s["duration_s"], s["elapsed_s"], *(p["t"] for p in run["samples"])]
        ends += [t + series["bucket_s"] / 2 for t in series["t"]]
        end = max(end, *ends)
    return 0.0, end


def _outcomes_chart(series: dict[str, Any], span: Span) -> str:
    chart = StackedChart(
        title="arrivals vs outcomes (by arrival second)", x_label="s", y_label="requests / s",
        x=series["t"], layers=list(series["outcomes_per_s"].items()),
        line=("arrivals", series["arrivals_per_s"]), x_range=span,
    )  # fmt: skip
    return render_stacked(chart)


def _points(xs: list[float], ys: list[Any]) -> list[tuple[float, float]]:
    return [(x, float(y)) for x, y in zip(xs, ys, strict=True) if y is not None]


def _ttft_chart(series: dict[str, Any], span: Span) -> str:
    t = series["t"]
    return render_svg(LineChart(
        title="TTFT of answered requests (by arrival second)", x_label="s", y_label="ms",
        series=[Series(name="p50", points=_points(t, series["ttft_p50_ms"])),
                Series(name="p99", points=_points(t, series["ttft_p99_ms"]))],
        x_range=span,
    ))  # fmt: skip


def _bound_lines(bounds: dict[str, tuple[str, list[tuple[float, float]]]]) -> list[Series]:
    """One dashed line per distinct limit: backends whose limits coincide share one line,
    labelled with all of them, where one line each would hide all but the last."""
    groups: dict[tuple[str, tuple[tuple[float, float], ...]], list[str]] = {}
    for name, (kind, points) in bounds.items():
        groups.setdefault((kind, tuple(points)), []).append(name)
    lines = []
    for (kind, points), names in groups.items():
        if len(names) == 1:
            color, label = PALETTE[sorted(bounds).index(names[0]) % len(PALETTE)], f"  its {kind}"
        else:
            color, label = SHARED_LIMIT_COLOR, f"{kind} of {_which(names, among=len(bounds))}"
        lines.append(Series(name=label, color=color, dashed=True, points=points))
    return lines


def _which(names: list[str], *, among: int) -> str:
    """Legend-sized: `both`, `all 3`, or the names when only some of the backends."""
    if len(names) == among:
        return "both" if among == 2 else f"all {among}"
    return ", ".join(map(short_name, names))


def _fill_chart(samples: list[dict[str, Any]], span: Span) -> str:
    names = sorted({n for p in samples for n in p["backends"]})
    lines, bounds = [], {}
    for k, name in enumerate(names):
        pts = [(p["t"], p["backends"][name]) for p in samples if name in p["backends"]]
        lines.append(Series(name=short_name(name), color=PALETTE[k % len(PALETTE)],
                            points=[(t, float(b["in_flight"])) for t, b in pts]))  # fmt: skip
        kind = "limit" if any(b.get("limit") is not None for _, b in pts) else "capacity"
        bounds[name] = (kind, [(t, float(b.get(kind) or 0)) for t, b in pts])
    return render_svg(LineChart(
        title="tokens in flight per backend (dashed: limits)", x_label="s", y_label="tokens",
        series=[*lines, *_bound_lines(bounds)], x_range=span,
    ))  # fmt: skip


def short_name(name: str) -> str:
    """Legend-sized: a backend URL becomes its port, a long name keeps its tail."""
    if "://" in name:
        return ":" + name.rstrip("/").rsplit(":", 1)[-1]
    return name if len(name) <= 16 else "…" + name[-15:]


def _queue_chart(samples: list[dict[str, Any]], span: Span, *, direct: bool) -> str:
    names = sorted({n for p in samples for n in p["queue_depth"]})
    lines = [
        Series(name=short_name(name), points=[
            (p["t"], float(p["queue_depth"][name])) for p in samples if name in p["queue_depth"]
        ]) for name in names
    ]  # fmt: skip
    title = "requests waiting inside the backend" if direct else "gateway queue depth per pool"
    if not lines:
        return f'<p class="meta">{title}: nothing reported (no queue in the overflow chain)</p>'
    return render_svg(
        LineChart(title=title, x_label="s", y_label="requests", series=lines, x_range=span)
    )


def _run_section(i: int, run: dict[str, Any], span: Span) -> str:
    s = run["summary"]
    parts = [
        f'<div class="run" id="run{i}"><h2>{escape(s["label"])}: {escape(", ".join(s["urls"]))}'
        "</h2>",
        _cards(i, s),
        _table(i, s),
        _answers(run),
        _outcomes_chart(run["series"], span),
        _ttft_chart(run["series"], span),
    ]
    if run["samples"]:
        direct = run.get("sampled") == "backends"
        samples = run["samples"]
        parts += [_fill_chart(samples, span), _queue_chart(samples, span, direct=direct)]
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
    span = time_span(runs)
    sections = [_run_section(i, r, span) for i, r in enumerate(runs)]
    return (
        '<!doctype html><html lang="en"><head><meta charset="utf-8">'
        f"<title>Spillgate load test: {escape(str(cfg.get('model', '')))}</title>"
        f"<style>{CSS}</style></head><body>"
        f"<h1>Spillgate load test</h1>{_config_table(cfg)}{_comparison(runs)}"
        f'<div class="runs">{"".join(sections)}</div></body></html>\n'
    )


def write_html(path: Path, data: dict[str, Any]) -> None:
    path.write_text(render_html(data), "utf-8")
