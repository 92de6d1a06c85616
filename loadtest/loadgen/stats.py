"""Figures from a run: per outcome latencies, goodput under an SLO, schedule lag, series."""

from __future__ import annotations

import math
from collections import Counter, defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from loadtest.loadgen.client import ERROR_OUTCOME, Result
from loadtest.loadgen.run import RunData
from loadtest.percentile import percentile

OUTCOME_ORDER = (
    "local", "served", "queued", "degraded", "provider", "cached", "throttled", "rejected",
    "error",
)  # fmt: skip


@dataclass(frozen=True, kw_only=True)
class Slo:
    ttft_s: float = 2.0
    itl_s: float = 0.1

    def met(self, r: Result) -> bool:
        if not r.ok or r.ttft_s is None or r.ttft_s > self.ttft_s:
            return False
        return r.itl_s is None or r.itl_s <= self.itl_s


@dataclass(frozen=True, kw_only=True)
class LagVerdict:
    """Whether the generator sent on time: p99 lateness under `tolerance_s`."""

    tolerance_s: float = 0.02

    def check(self, lags: Sequence[float]) -> dict[str, Any]:
        p99 = percentile(lags, 99)
        late = sum(1 for lag in lags if lag > self.tolerance_s)
        kept = p99 is None or p99 <= self.tolerance_s
        return {
            "kept_schedule": kept,
            "tolerance_ms": self.tolerance_s * 1000,
            "p50_ms": _ms(percentile(lags, 50)),
            "p99_ms": _ms(p99),
            "max_ms": _ms(max(lags, default=0.0)),
            "late_requests": late,
        }


def _ms(value: float | None) -> float | None:
    return None if value is None else round(value * 1000, 2)


def ordered_outcomes(names: Iterable[str]) -> list[str]:
    known = [o for o in OUTCOME_ORDER if o in set(names)]
    return known + sorted(set(names) - set(OUTCOME_ORDER))


def _row(rs: Sequence[Result], *, window_s: float, slo: Slo) -> dict[str, Any]:
    ttft = [r.ttft_s for r in rs if r.ttft_s is not None]
    itl = [r.itl_s for r in rs if r.itl_s is not None]
    e2e = [r.e2e_s for r in rs if r.e2e_s is not None]
    tokens = sum(r.completion_tokens for r in rs)
    return {
        "count": len(rs),
        "ttft_p50_ms": _ms(percentile(ttft, 50)),
        "ttft_p99_ms": _ms(percentile(ttft, 99)),
        "itl_p50_ms": _ms(percentile(itl, 50)),
        "itl_p99_ms": _ms(percentile(itl, 99)),
        "e2e_p50_ms": _ms(percentile(e2e, 50)),
        "e2e_p99_ms": _ms(percentile(e2e, 99)),
        "completion_tokens": tokens,
        "tokens_per_s": round(tokens / window_s, 1),
        "within_slo": sum(1 for r in rs if slo.met(r)),
    }


def summarize(data: RunData, *, slo: Slo, lag: LagVerdict) -> dict[str, Any]:
    rs = data.results
    window = max(data.elapsed_s, data.duration_s, 1e-9)
    by_outcome: dict[str, list[Result]] = defaultdict(list)
    for r in rs:
        by_outcome[r.outcome].append(r)
    good = [r for r in rs if slo.met(r)]
    return {
        "label": data.label,
        "urls": list(data.urls),
        "model": data.model,
        "requests": len(rs),
        "duration_s": data.duration_s,
        "elapsed_s": round(data.elapsed_s, 3),
        "statuses": dict(sorted(Counter(str(r.status) for r in rs).items())),
        "outcomes": {o: _row(by_outcome[o], window_s=window, slo=slo) for o in
                     ordered_outcomes(by_outcome)},
        "all": _row(rs, window_s=window, slo=slo),
        "goodput": {
            "slo": {"ttft_ms": slo.ttft_s * 1000, "itl_ms": slo.itl_s * 1000},
            "requests": len(good),
            "requests_per_s": round(len(good) / window, 2),
            "tokens_per_s": round(sum(r.completion_tokens for r in good) / window, 1),
        },
        "lag": lag.check([r.lag_s for r in rs]),
        "errors": dict(Counter(r.error for r in rs if r.error).most_common(5)),
        "failed": sum(1 for r in rs if r.outcome == ERROR_OUTCOME),
        "first_error": _first_error(rs),
        "missing_retry_after": sum(
            1 for r in rs if r.status in (429, 503) and r.retry_after is None
        ),
        "preemptions": _preemption_delta(data),
        "engine": engine_load(data),
        "prefix_cache": prefix_cache(data.prefix_counters),
        "peak_fill": peak_fill(data.samples),
    }  # fmt: skip


def _first_error(rs: Sequence[Result]) -> dict[str, Any] | None:
    """The earliest scheduled request that failed: when, its status and what it said."""
    failed = [r for r in rs if r.error]
    if not failed:
        return None
    first = min(failed, key=lambda r: r.at_s)
    return {"index": first.index, "at_s": round(first.at_s, 3), "status": first.status,
            "error": first.error}  # fmt: skip


def _preemption_delta(data: RunData) -> dict[str, Any]:
    per = {}
    for url, counts in data.preemptions.items():
        before, after = counts.get("before"), counts.get("after")
        per[url] = None if before is None or after is None else after - before
    known = [v for v in per.values() if v is not None]
    return {"per_backend": per, "total": sum(known) if known else None}


def prefix_cache(
    counters: Mapping[str, Mapping[str, Mapping[str, float] | None]],
) -> dict[str, Any]:
    """The backends' prefix-cache hit rate over a run: of the prompt tokens they looked up
    in their prefix cache, the share they found there, from how far their counters moved
    (`{url: {"before": {"queries", "hits"}, "after": ...}}`, in tokens), summed over the
    backends read both times. A backend whose counters went back (it restarted) is left
    out. The rate is None when nothing was looked up: no backend reports the counters."""
    queries = hits = 0.0
    per_backend: dict[str, float | None] = {}
    for url, c in counters.items():
        before, after = c.get("before"), c.get("after")
        looked = found = -1.0
        if before is not None and after is not None:
            looked = after["queries"] - before["queries"]
            found = after["hits"] - before["hits"]
        if looked < 0 or found < 0:
            per_backend[url] = None
            continue
        queries, hits = queries + looked, hits + found
        per_backend[url] = _share(found, looked)
    return {
        "queries": queries,
        "hits": hits,
        "hit_rate": _share(hits, queries),
        "per_backend": per_backend,
    }


def _share(part: float, whole: float) -> float | None:
    return round(part / whole, 4) if whole > 0 else None


def engine_load(data: RunData) -> dict[str, Any]:
    """What the backends' engines reported during the run, from their own /metrics:
    requests running at once over the whole fleet (max, p50 of the samples in which every
    backend answered), most waiting, the hottest backend's peak KV use (0..1), the most KV
    tokens in use over the fleet, and the preemptions across the run. Through a gateway
    sampled by its /admin/status, also the most tokens it reserved at once, and the ratio of
    the two peaks: how much of what it held back the engines really used."""
    urls = list(data.preemptions)
    complete = [
        p["backends"] for p in data.engine_samples if urls and len(p["backends"]) == len(urls)
    ]
    running = [sum(b["running"] for b in point.values()) for point in complete]
    waiting = [sum(b["waiting"] for b in point.values()) for point in complete]
    per_backend = {}
    for url in urls:
        states = [p["backends"][url] for p in data.engine_samples if url in p["backends"]]
        per_backend[url] = {
            "running_max": _most([s["running"] for s in states]),
            "running_p50": percentile([s["running"] for s in states], 50),
            "kv_usage_peak": _most([s.get("kv_usage", 0.0) for s in states]),
        }
    peaks = [b["kv_usage_peak"] for b in per_backend.values() if b["kv_usage_peak"] is not None]
    kv_tokens = _most([sum(b.get("in_flight", 0.0) for b in point.values()) for point in complete])
    reserved = _most(
        [sum(float(b["in_flight"]) for b in p["backends"].values()) for p in data.samples]
        if data.sampled == "gateway"
        else []
    )
    return {
        "samples": len(complete),
        "interval_s": data.engine_interval_s,
        "running_max": _most(running),
        "running_p50": percentile(running, 50),
        "waiting_max": _most(waiting),
        "kv_usage_peak": max(peaks) if peaks else None,
        "kv_tokens_peak": kv_tokens,
        "reserved_tokens_peak": reserved,
        "kv_used_per_reserved": round(kv_tokens / reserved, 3) if kv_tokens and reserved else None,
        "preemptions": _preemption_delta(data)["total"],
        "per_backend": per_backend,
    }


def engine_series(data: RunData) -> dict[str, list[float]]:
    """Over time, from the backends' own /metrics: requests running over the fleet and the
    hottest backend's KV use (0..1), at each sample in which every backend answered."""
    n = len(data.preemptions)
    points = [p for p in data.engine_samples if n and len(p["backends"]) == n]
    return {
        "t": [p["t"] for p in points],
        "running": [sum(b["running"] for b in p["backends"].values()) for p in points],
        "kv_usage": [max(b.get("kv_usage", 0.0) for b in p["backends"].values()) for p in points],
    }


def _most(values: Sequence[float]) -> float | None:
    return max(values) if values else None


def peak_fill(samples: Sequence[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """Per backend: most tokens in flight seen, and its capacity and limit."""
    peaks: dict[str, dict[str, float]] = {}
    for point in samples:
        for name, b in point.get("backends", {}).items():
            peak = peaks.setdefault(name, {"in_flight": 0.0})
            peak["in_flight"] = max(peak["in_flight"], float(b.get("in_flight", 0)))
            peak["capacity"] = float(b.get("capacity", 0))
            if b.get("limit") is not None:
                peak["limit"] = float(b["limit"])
    return peaks


def bucket_for(duration_s: float) -> float:
    """About 30 to 60 buckets: 1 s for runs of a minute, finer for shorter ones."""
    for size in (0.1, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0):
        if duration_s / size <= 60:
            return size
    return 30.0


def series(data: RunData, *, bucket_s: float | None = None) -> dict[str, Any]:
    """Per time bucket (by scheduled arrival): arrival and outcome rates, TTFT p50/p99."""
    bucket_s = bucket_s or bucket_for(data.duration_s)
    n = max(1, math.ceil(data.duration_s / bucket_s))
    outcomes = ordered_outcomes({r.outcome for r in data.results})
    counts = {o: [0] * n for o in outcomes}
    ttfts: list[list[float]] = [[] for _ in range(n)]
    for r in data.results:
        i = min(n - 1, int(r.at_s / bucket_s))
        counts[r.outcome][i] += 1
        if r.ttft_s is not None and r.ok:
            ttfts[i].append(r.ttft_s)
    per_s = 1.0 / bucket_s
    return {
        "bucket_s": bucket_s,
        "t": [round((i + 0.5) * bucket_s, 3) for i in range(n)],
        "arrivals_per_s": [sum(counts[o][i] for o in outcomes) * per_s for i in range(n)],
        "outcomes_per_s": {o: [c * per_s for c in v] for o, v in counts.items()},
        "ttft_p50_ms": [_ms(percentile(b, 50)) for b in ttfts],
        "ttft_p99_ms": [_ms(percentile(b, 99)) for b in ttfts],
    }


def report(
    runs: Sequence[RunData], *, slo: Slo, lag: LagVerdict, config: dict[str, Any]
) -> dict[str, Any]:
    """Everything `--json` writes: config, then per run its summary, series and samples."""
    return {
        "config": config,
        "runs": [
            {
                "summary": summarize(d, slo=slo, lag=lag),
                "series": series(d),
                "samples": d.samples,
                "sampled": d.sampled,
                "sample_failures": d.sample_failures,
                "engine_series": engine_series(d),
                "requests": [r.as_dict() for r in d.results],
            }
            for d in runs
        ],
    }
