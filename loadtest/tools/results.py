"""The figures of one run, read from each tool's own result file, and the table they make.

What each column is, per tool:

- TTFT p50/p99: per request, start to first streamed token (guidellm
  `time_to_first_token_ms`, inference-perf `time_to_first_token`).
- ITL p50/p99: per request, (latency - TTFT) / (output tokens - 1), the mean gap between
  its tokens (guidellm `inter_token_latency_ms`, inference-perf `time_per_output_token`
  with `use_server_output_tokens`). guidellm weights each request by its tokens; with the
  fixed output lengths of these workloads that is the same as per request.
  inference-perf's own `inter_token_latency` is the gap between streamed chunks spread
  over the tokens its local tokenizer finds in each, which is not comparable and unused.
- req/s, out tok/s: successful requests and their output tokens over the run's window.
- goodput: the requests meeting every objective of the config's SLO, per second and as a
  share (guidellm `request_goodput` / `slo_attainment`, inference-perf
  `goodput_metrics.request_goodput` / `goodput_percentage`); errors count against it.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from loadtest.loadgen.text import table


@dataclass(frozen=True, kw_only=True)
class Figures:
    tool: str
    ok: int
    errors: int
    ttft_p50_ms: float | None
    ttft_p99_ms: float | None
    itl_p50_ms: float | None
    itl_p99_ms: float | None
    requests_per_s: float | None
    output_tokens_per_s: float | None
    goodput_per_s: float | None
    goodput_share: float | None  # 0..1

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def _mean(summary: dict[str, Any] | None) -> float | None:
    if not summary or not summary.get("successful"):
        return None
    value = summary["successful"].get("mean")
    return None if value is None else float(value)


def _pct(summary: dict[str, Any], name: str) -> float | None:
    successful = summary.get("successful") or {}
    value = (successful.get("percentiles") or {}).get(name)
    return None if value is None else float(value)


def guidellm(path: Path) -> Figures:
    """guidellm's `--output kind=json` file: its one benchmark."""
    data = json.loads(path.read_text())
    benchmarks = data.get("benchmarks") or []
    if len(benchmarks) != 1:
        raise ValueError(f"{path}: expected one benchmark, found {len(benchmarks)}")
    m = benchmarks[0]["metrics"]
    totals = m["request_totals"]
    attainment = m.get("slo_attainment")
    return Figures(
        tool="guidellm",
        ok=int(totals["successful"]),
        errors=int(totals["errored"]),
        ttft_p50_ms=_pct(m["time_to_first_token_ms"], "p50"),
        ttft_p99_ms=_pct(m["time_to_first_token_ms"], "p99"),
        itl_p50_ms=_pct(m["inter_token_latency_ms"], "p50"),
        itl_p99_ms=_pct(m["inter_token_latency_ms"], "p99"),
        requests_per_s=_mean(m["requests_per_second"]),
        output_tokens_per_s=_mean(m["output_tokens_per_second"]),
        goodput_per_s=_mean(m.get("request_goodput")),
        goodput_share=None if attainment is None else float(attainment),
    )


def inference_perf(directory: Path) -> Figures:
    """inference-perf's `summary_lifecycle_metrics.json` in its storage directory."""
    path = directory / "summary_lifecycle_metrics.json"
    data = json.loads(path.read_text())
    ok = data["successes"]
    failures = int((data.get("failures") or {}).get("count") or 0)
    latency = ok.get("latency") or {}
    throughput = ok.get("throughput") or {}
    goodput = ok.get("goodput_metrics") or {}

    def ms(metric: str, key: str) -> float | None:
        value = (latency.get(metric) or {}).get(key)
        return None if value is None else float(value) * 1000.0

    share = goodput.get("goodput_percentage")
    rate = goodput.get("request_goodput")
    return Figures(
        tool="inference-perf",
        ok=int(ok["count"]),
        errors=failures,
        ttft_p50_ms=ms("time_to_first_token", "median"),
        ttft_p99_ms=ms("time_to_first_token", "p99"),
        itl_p50_ms=ms("time_per_output_token", "median"),
        itl_p99_ms=ms("time_per_output_token", "p99"),
        requests_per_s=throughput.get("requests_per_sec"),
        output_tokens_per_s=throughput.get("output_tokens_per_sec"),
        goodput_per_s=None if rate is None else float(rate),
        goodput_share=None if share is None else float(share) / 100.0,
    )


def read(tool: str, out: Path) -> Figures:
    """The figures of the arm whose results `configs.write` sent to `out`."""
    if tool == "guidellm":
        return guidellm(out / "guidellm.json")
    if tool == "inference-perf":
        return inference_perf(out / "inference-perf")
    raise ValueError(f"unknown tool {tool!r}")


def _cell(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def _percent(share: float | None) -> float | None:
    return None if share is None else 100 * share


def report(
    title: str,
    arms: dict[str, Figures],
    *,
    slo: str,
    hit_rates: dict[str, float | None] | None = None,
) -> str:
    """One run's table: an arm a row, then the ratio of the last arm to the first."""
    head = ["arm", "ok", "err", "TTFT p50", "TTFT p99", "ITL p50", "ITL p99", "req/s",
            "out tok/s", "goodput req/s", "goodput %"]  # fmt: skip
    if hit_rates is not None:
        head.append("prefix hit rate")
    rows = [head]
    for name, f in arms.items():
        row = [name, str(f.ok), str(f.errors), _cell(f.ttft_p50_ms, ".1f"),
               _cell(f.ttft_p99_ms, ".1f"), _cell(f.itl_p50_ms, ".2f"), _cell(f.itl_p99_ms, ".2f"),
               _cell(f.requests_per_s, ".2f"), _cell(f.output_tokens_per_s, ".1f"),
               _cell(f.goodput_per_s, ".2f"), _cell(_percent(f.goodput_share), ".1f")]  # fmt: skip
        if hit_rates is not None:
            row.append(_cell(hit_rates.get(name), ".3f"))
        rows.append(row)
    names = list(arms)
    lines = [f"{title} (times in ms; goodput: {slo})", table(rows, ["<"] + [">"] * (len(head) - 1))]
    if len(names) == 2:
        first, last = arms[names[0]], arms[names[1]]
        ratios = []
        for label, a, b in (
            ("TTFT p50", first.ttft_p50_ms, last.ttft_p50_ms),
            ("TTFT p99", first.ttft_p99_ms, last.ttft_p99_ms),
            ("ITL p50", first.itl_p50_ms, last.itl_p50_ms),
            ("out tok/s", first.output_tokens_per_s, last.output_tokens_per_s),
        ):
            if a and b is not None:
                ratios.append(f"{label} {b / a:.2f}x")
        lines.append(f"{names[1]} / {names[0]}: " + ", ".join(ratios))
    return "\n".join(lines)
