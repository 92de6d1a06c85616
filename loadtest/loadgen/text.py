"""The summary table printed at the end of a run (and side by side with `--compare-direct`)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

COLUMNS = (
    ("outcome", "outcome", "<"),
    ("count", "count", ">"),
    ("ttft_p50_ms", "TTFT p50 ms", ">"),
    ("ttft_p99_ms", "TTFT p99 ms", ">"),
    ("itl_p50_ms", "ITL p50 ms", ">"),
    ("itl_p99_ms", "ITL p99 ms", ">"),
    ("tokens_per_s", "tok/s", ">"),
    ("within_slo", "in SLO", ">"),
)


def _cell(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:,.1f}"
    return f"{value:,}" if isinstance(value, int) else str(value)


def table(rows: Sequence[Sequence[str]], aligns: Sequence[str]) -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(len(aligns))]
    lines = []
    for n, row in enumerate(rows):
        cells = [f"{c:{a}{w}}" for c, a, w in zip(row, aligns, widths, strict=True)]
        lines.append("  ".join(cells).rstrip())
        if n == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)


def outcome_table(summary: dict[str, Any]) -> str:
    rows = [[title for _, title, _ in COLUMNS]]
    for name, row in [*summary["outcomes"].items(), ("all", summary["all"])]:
        rows.append([name] + [_cell(row[key]) for key, _, _ in COLUMNS[1:]])
    return table(rows, [a for _, _, a in COLUMNS])


def _lag_line(lag: dict[str, Any]) -> str:
    verdict = "kept its schedule" if lag["kept_schedule"] else "FELL BEHIND its schedule"
    return (
        f"generator {verdict}: send lag p50 {_cell(lag['p50_ms'])} ms, p99 {_cell(lag['p99_ms'])}"
        f" ms, max {_cell(lag['max_ms'])} ms ({lag['late_requests']} requests later than "
        f"{lag['tolerance_ms']:g} ms)"
    )


def summary_text(summary: dict[str, Any]) -> str:
    good = summary["goodput"]
    slo = good["slo"]
    pre = summary["preemptions"]["total"]
    lines = [
        f"{summary['label']}: {summary['requests']} requests to {', '.join(summary['urls'])} "
        f"over {summary['duration_s']:g}s (last answer at {summary['elapsed_s']:.1f}s)",
        outcome_table(summary),
        f"goodput (TTFT <= {slo['ttft_ms']:g} ms, ITL <= {slo['itl_ms']:g} ms): "
        f"{good['requests']} requests, {good['requests_per_s']:g} req/s, "
        f"{good['tokens_per_s']:,.1f} tok/s",
        "statuses: " + ", ".join(f"{k}: {v}" for k, v in summary["statuses"].items()),
        f"backend preemptions during the run: {'-' if pre is None else f'{pre:g}'}",
        engine_line(summary),
        prefix_line(summary),
        _lag_line(summary["lag"]),
    ]
    if summary["missing_retry_after"]:
        lines.append(f"429/503 without Retry-After: {summary['missing_retry_after']}")
    if summary["errors"]:
        lines.append("errors: " + "; ".join(f"{k} (x{v})" for k, v in summary["errors"].items()))
    if summary["first_error"]:
        lines.append(first_error_line(summary))
    return "\n".join(lines)


def first_error_line(summary: dict[str, Any]) -> str:
    first = summary["first_error"]
    return (
        f"{summary['failed']} of {summary['requests']} requests failed; the first, at "
        f"{first['at_s']:g} s: {first['error']}"
    )


COMPARED = ("requests", "answered", "TTFT p50 ms", "TTFT p99 ms", "ITL p99 ms", "in SLO",
            "preemptions", "running max", "running p50", "KV use peak %",
            "KV used / reserved", "prefix-cache hit %")  # fmt: skip
_REFUSED = ("throttled", "rejected", "error")


def compared_figures(s: dict[str, Any]) -> list[str]:
    """The figures that show what admission control buys, in the order of COMPARED."""
    ok = sum(r["count"] for name, r in s["outcomes"].items() if name not in _REFUSED)
    pre = s["preemptions"]["total"]
    return [
        _cell(s["requests"]),
        _cell(ok),
        _cell(s["all"]["ttft_p50_ms"]),
        _cell(s["all"]["ttft_p99_ms"]),
        _cell(s["all"]["itl_p99_ms"]),
        _cell(s["goodput"]["requests"]),
        "-" if pre is None else f"{pre:g}",
        *engine_figures(s),
        prefix_hit_percent(s),
    ]


def prefix_hit_percent(s: dict[str, Any]) -> str:
    """The backends' prefix-cache hit rate over the run, in %, or "-" when none reported it."""
    rate = (s.get("prefix_cache") or {}).get("hit_rate")
    return "-" if rate is None else f"{rate * 100:.1f}"


def prefix_line(s: dict[str, Any]) -> str:
    cache = s.get("prefix_cache") or {}
    if cache.get("hit_rate") is None:
        return "backend prefix cache during the run: - (no backend reported its counters)"
    return (
        f"backend prefix cache during the run: hit rate {prefix_hit_percent(s)} % "
        f"({cache['hits']:,.0f} of {cache['queries']:,.0f} prompt tokens found cached)"
    )


def engine_figures(s: dict[str, Any]) -> list[str]:
    """Running at once (max, p50) and the peak KV use, as the backends reported them."""
    engine = s.get("engine") or {}
    kv, ratio = engine.get("kv_usage_peak"), engine.get("kv_used_per_reserved")
    return [
        _count(engine.get("running_max")),
        _count(engine.get("running_p50")),
        "-" if kv is None else f"{kv * 100:.1f}",
        "-" if ratio is None else f"{ratio:.2f}",
    ]


def _count(value: float | None) -> str:
    return "-" if value is None else f"{value:g}"


def engine_line(s: dict[str, Any]) -> str:
    running_max, running_p50, kv, ratio = engine_figures(s)
    engine = s.get("engine") or {}
    used = "" if ratio == "-" else f"; KV used / reserved by the gateway (peaks) {ratio}"
    return (
        f"backend engines during the run: running max {running_max}, p50 {running_p50}; "
        f"waiting max {_count(engine.get('waiting_max'))}; KV use peak {kv} %{used} "
        f"({engine.get('samples', 0)} samples of vLLM /metrics)"
    )


def comparison_text(gateway: dict[str, Any], direct: dict[str, Any]) -> str:
    rows = [["", "gateway", "direct"]]
    pairs = zip(COMPARED, compared_figures(gateway), compared_figures(direct), strict=True)
    rows += [[n, g, d] for n, g, d in pairs]
    return table(rows, "<>>")
