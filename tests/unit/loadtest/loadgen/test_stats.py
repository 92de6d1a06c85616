"""Run figures: percentiles, per outcome rows, goodput, lag verdict, series, the text table."""

from typing import Any

from loadtest.loadgen.client import Result
from loadtest.loadgen.html import render_html
from loadtest.loadgen.run import RunData
from loadtest.loadgen.stats import (
    LagVerdict,
    Slo,
    prefix_cache,
    report,
    series,
    summarize,
)
from loadtest.loadgen.text import comparison_text, summary_text


def result(i: int, outcome: str = "local", **kw: Any) -> Result:
    base: dict[str, Any] = {
        "index": i, "tenant": "t0", "at_s": i * 0.1, "sent_s": i * 0.1 + 0.001, "stream": True,
        "repeated": False, "prompt_tokens": 10, "max_tokens": 20, "status": 200,
        "outcome": outcome, "ttft_s": 0.05, "itl_s": 0.01, "e2e_s": 0.3, "completion_tokens": 20,
    }  # fmt: skip
    return Result(**(base | kw))


def run(results: list[Result], **kw: Any) -> RunData:
    return RunData(label="gateway", urls=["http://gw"], model="m", duration_s=2.0,
                   elapsed_s=2.5, results=results, **kw)  # fmt: skip


def test_summary_rows_per_outcome_and_goodput_under_the_slo() -> None:
    rs = [result(i) for i in range(10)]
    rs += [result(10 + i, "queued", ttft_s=3.0) for i in range(5)]
    rs += [result(15 + i, "rejected", status=503, ttft_s=None, itl_s=None,
                  completion_tokens=0, retry_after="2") for i in range(3)]  # fmt: skip
    rs.append(result(18, "rejected", status=503, ttft_s=None, completion_tokens=0))
    s = summarize(run(rs), slo=Slo(ttft_s=1.0, itl_s=0.1), lag=LagVerdict())
    assert list(s["outcomes"]) == ["local", "queued", "rejected"]
    assert s["outcomes"]["local"]["count"] == 10
    assert s["outcomes"]["local"]["ttft_p99_ms"] == 50.0
    assert s["outcomes"]["queued"]["within_slo"] == 0
    assert s["goodput"]["requests"] == 10
    assert s["goodput"]["tokens_per_s"] == 10 * 20 / 2.5
    assert s["missing_retry_after"] == 1
    assert s["statuses"] == {"200": 15, "503": 4}
    assert s["lag"]["kept_schedule"] is True


def test_a_late_generator_is_reported_as_behind() -> None:
    rs = [result(i, sent_s=i * 0.1 + (0.2 if i % 2 else 0.0)) for i in range(20)]
    lag = summarize(run(rs), slo=Slo(), lag=LagVerdict(tolerance_s=0.02))["lag"]
    assert lag["kept_schedule"] is False
    assert lag["late_requests"] == 10
    assert lag["p99_ms"] == 200.0
    text = summary_text(summarize(run(rs), slo=Slo(), lag=LagVerdict()))
    assert "FELL BEHIND" in text


def test_series_buckets_by_arrival_and_stacks_to_the_arrival_rate() -> None:
    rs = [result(i, "local" if i % 3 else "rejected", status=200 if i % 3 else 503)
          for i in range(20)]  # fmt: skip
    s = series(run(rs), bucket_s=0.5)
    assert s["t"] == [0.25, 0.75, 1.25, 1.75]
    for i, total in enumerate(s["arrivals_per_s"]):
        assert total == sum(v[i] for v in s["outcomes_per_s"].values())
    assert sum(s["arrivals_per_s"]) * 0.5 == 20


def test_preemptions_are_the_difference_across_the_run() -> None:
    data = run(
        [result(0)],
        preemptions={
            "http://b0": {"before": 3.0, "after": 10.0},
            "http://b1": {"before": None, "after": 1.0},
        },
    )
    s = summarize(data, slo=Slo(), lag=LagVerdict())
    assert s["preemptions"] == {"per_backend": {"http://b0": 7.0, "http://b1": None}, "total": 7.0}


def test_report_holds_every_request_and_the_comparison_reads_side_by_side() -> None:
    gateway = run([result(i) for i in range(4)])
    direct = run(
        [result(i, "served", ttft_s=2.0) for i in range(4)],
        preemptions={"http://b0": {"before": 0.0, "after": 5.0}},
    )
    data = report([gateway, direct], slo=Slo(), lag=LagVerdict(), config={"model": "m"})
    assert len(data["runs"][1]["requests"]) == 4
    text = comparison_text(data["runs"][0]["summary"], data["runs"][1]["summary"])
    lines = {line.split()[0] + (" " + line.split()[1] if "p99" in line else ""): line.split()
             for line in text.splitlines()[2:]}  # fmt: skip
    assert lines["TTFT p99"][-2:] == ["50.0", "2,000.0"]
    assert lines["preemptions"][-2:] == ["-", "5"]


def engine_point(t: float, **backends: tuple[float, float, float]) -> dict[str, Any]:
    """Backends of 1,000 usable KV tokens each: (running, waiting, KV usage)."""
    return {
        "t": t,
        "backends": {
            f"http://{name}": {"running": r, "waiting": w, "kv_usage": kv,
                               "in_flight": kv * 1000, "preemptions": 0.0}
            for name, (r, w, kv) in backends.items()
        },
    }  # fmt: skip


def reserved_point(t: float, **reserved: float) -> dict[str, Any]:
    """A gateway's /admin/status sample: tokens it reserved per backend."""
    return {"t": t, "backends": {name: {"in_flight": n} for name, n in reserved.items()}}


def test_engine_load_sums_running_over_the_fleet_and_keeps_the_hottest_kv_peak() -> None:
    data = run(
        [result(0)],
        preemptions={
            "http://b0": {"before": 1.0, "after": 3.0},
            "http://b1": {"before": 0.0, "after": 0.0},
        },
        engine_samples=[
            engine_point(0.0, b0=(0, 0, 0.0), b1=(0, 0, 0.0)),
            engine_point(0.5, b0=(6, 1, 0.5), b1=(4, 0, 0.25)),
            engine_point(1.0, b0=(9, 3, 0.75)),  # b1 did not answer: not a fleet point
            engine_point(1.5, b0=(2, 0, 0.125), b1=(5, 0, 0.5)),
        ],
        engine_interval_s=0.5,
        samples=[reserved_point(0.2, g0=3000, g1=2000), reserved_point(0.7, g0=4000, g1=6000)],
        sampled="gateway",
    )
    engine = summarize(data, slo=Slo(), lag=LagVerdict())["engine"]
    assert engine == {
        "samples": 3,
        "interval_s": 0.5,
        "running_max": 10,
        "running_p50": 7,
        "waiting_max": 1,
        "kv_usage_peak": 0.75,
        "kv_tokens_peak": 750,  # 500 + 250 at 0.5 s; 1.0 s lacks b1
        "reserved_tokens_peak": 10_000,
        "kv_used_per_reserved": 0.075,
        "preemptions": 2.0,
        "per_backend": {
            "http://b0": {"running_max": 9, "running_p50": 2, "kv_usage_peak": 0.75},
            "http://b1": {"running_max": 5, "running_p50": 4, "kv_usage_peak": 0.5},
        },
    }


def test_engine_figures_read_side_by_side_and_unknown_is_a_dash() -> None:
    direct = run(
        [result(0, "served")],
        preemptions={"http://b0": {"before": 0.0, "after": 0.0}},
        engine_samples=[engine_point(0.0, b0=(19, 0, 0.36)), engine_point(0.5, b0=(7, 0, 0.1))],
    )
    # a run that knew no backends sampled nothing of theirs
    unknown = run([result(0)], samples=[{"t": 0.0, "backends": {}, "queue_depth": {}}])
    unknown.engine_samples = unknown.samples
    data = report([unknown, direct], slo=Slo(), lag=LagVerdict(), config={})
    gateway_s, direct_s = (r["summary"] for r in data["runs"])
    rows = comparison_text(gateway_s, direct_s).splitlines()
    assert rows[-5].split() == ["running", "max", "-", "19"]
    assert rows[-4].split() == ["running", "p50", "-", "7"]
    assert rows[-3].split() == ["KV", "use", "peak", "%", "-", "36.0"]
    assert rows[-2].split() == ["KV", "used", "/", "reserved", "-", "-"]
    assert rows[-1].split() == ["prefix-cache", "hit", "%", "-", "-"]
    assert (
        "backend engines during the run: running max 19, p50 7; waiting max 0; KV use peak "
        "36.0 % (2 samples of vLLM /metrics)"
    ) in summary_text(direct_s)


def _counters(queries: float, hits: float) -> dict[str, float]:
    return {"queries": queries, "hits": hits}


def test_prefix_hit_rate_is_the_summed_change_of_the_backends_counters() -> None:
    counters = {
        "http://a": {"before": _counters(1000, 200), "after": _counters(5000, 3200)},
        "http://b": {"before": _counters(0, 0), "after": _counters(4000, 1000)},
        "http://c": {"before": None, "after": _counters(9000, 9000)},  # unread before: left out
        "http://d": {"before": _counters(800, 400), "after": _counters(10, 0)},  # restarted
    }
    cache = prefix_cache(counters)
    assert cache == {
        "queries": 8000.0,
        "hits": 4000.0,
        "hit_rate": 0.5,
        "per_backend": {"http://a": 0.75, "http://b": 0.25, "http://c": None, "http://d": None},
    }


def test_no_prefix_hit_rate_when_no_backend_looked_anything_up() -> None:
    assert prefix_cache({})["hit_rate"] is None
    idle = prefix_cache({"http://a": {"before": _counters(0, 0), "after": _counters(0, 0)}})
    assert idle == {
        "queries": 0.0,
        "hits": 0.0,
        "hit_rate": None,
        "per_backend": {"http://a": None},
    }


def test_the_report_shows_the_prefix_hit_rate_or_a_dash() -> None:
    counters = {"http://a": {"before": _counters(0, 0), "after": _counters(3000, 1000)}}
    s = summarize(run([result(0)], prefix_counters=counters), slo=Slo(), lag=LagVerdict())
    assert s["prefix_cache"]["hit_rate"] == 0.3333
    text = summary_text(s)
    assert (
        "backend prefix cache during the run: hit rate 33.3 % (1,000 of 3,000 prompt tokens "
        "found cached)" in text
    )
    bare = summarize(run([result(0)]), slo=Slo(), lag=LagVerdict())
    assert bare["prefix_cache"]["hit_rate"] is None
    assert "backend prefix cache during the run: - (no backend reported its counters)" in (
        summary_text(bare)
    )
    table = comparison_text(s, bare).splitlines()
    assert table[-1].split() == ["prefix-cache", "hit", "%", "33.3", "-"]
    page = render_html({"config": {"model": "m"}, "runs": [
        {"summary": s, "series": series(run([result(0)])), "samples": [], "sampled": "none",
         "sample_failures": 0, "engine_series": {}, "requests": []},
    ]})  # fmt: skip
    assert '<div class="v " id="run0-prefix-hit">33.3</div>' in page
