"""The request path's tallied counts reach Prometheus exactly as direct inc()/observe() would."""

import pytest

from gateway.admission.fleet.metrics_text import samples
from gateway.metrics import TTFT_BUCKETS, TTFT_HELD, GatewayMetrics
from gateway.outcome import Outcome


def series(metrics: GatewayMetrics, prefix: str) -> dict[tuple[str, ...], float]:
    """name and label values (ordered by label name) → value, for samples named `prefix`..."""
    return {
        (s.name, *(v for _, v in sorted(s.labels.items()))): s.value
        for s in samples(metrics.render().decode())
        if s.name.startswith(prefix) and not s.name.endswith("_created")
    }


# on, below and above bucket bounds, the first and last bounds, and past the last one
TTFTS = [0.0, 0.01, 0.0100001, 0.3, 0.5, 0.75, 2.99, 30.0, 31.0, 120.0]


def test_tallied_ttft_buckets_and_sum_match_observe() -> None:
    tallied, direct = GatewayMetrics(), GatewayMetrics()
    for seconds in TTFTS:
        tallied.tally.ttft("big", Outcome.LOCAL, seconds)
        direct.ttft.labels("big", "local").observe(seconds)
    tallied.tally.ttft("big", Outcome.QUEUED, 0.2)
    direct.ttft.labels("big", "queued").observe(0.2)
    got = series(tallied, "spillgate_ttft_seconds")
    assert got == pytest.approx(series(direct, "spillgate_ttft_seconds"))
    assert got[("spillgate_ttft_seconds_count", "local", "big")] == 10
    assert len(got) == 2 * (len(TTFT_BUCKETS) + 3)  # buckets, +Inf, count and sum per series


def test_tallied_requests_and_tokens_add_up_across_flushes() -> None:
    metrics = GatewayMetrics()
    metrics.tally.request("big", "acme", Outcome.LOCAL)
    metrics.tally.request("big", "acme", Outcome.LOCAL)
    metrics.tally.tokens("b1", 12, 30)
    assert series(metrics, "spillgate_requests_total") == {
        ("spillgate_requests_total", "local", "big", "acme"): 2
    }
    metrics.tally.request("big", "acme", Outcome.LOCAL)  # after a scrape: added, not replaced
    metrics.requests.labels("big", "beta", "rejected").inc()
    metrics.tally.tokens("b1", 0, 5)
    assert series(metrics, "spillgate_requests_total") == {
        ("spillgate_requests_total", "local", "big", "acme"): 3,
        ("spillgate_requests_total", "rejected", "big", "beta"): 1,
    }
    assert series(metrics, "spillgate_tokens_total") == {
        ("spillgate_tokens_total", "completion", "b1"): 35,
        ("spillgate_tokens_total", "prompt", "b1"): 12,
    }


def test_a_series_unscraped_observes_its_held_ttfts_once_it_has_enough() -> None:
    metrics = GatewayMetrics()
    for _ in range(TTFT_HELD):
        metrics.tally.ttft("big", Outcome.LOCAL, 0.2)
    child = metrics.ttft.labels("big", "local")
    counts = {s.name: s.value for s in child.collect()[0].samples if s.name.endswith("_count")}
    assert counts == {"spillgate_ttft_seconds_count": TTFT_HELD}
