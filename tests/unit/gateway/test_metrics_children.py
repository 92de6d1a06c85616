"""The request path's cached metric children count into the same series as `labels()`."""

from prometheus_client.parser import text_string_to_metric_families

from gateway.metrics import GatewayMetrics
from gateway.outcome import Outcome


def samples(metrics: GatewayMetrics, name: str) -> dict[tuple[str, ...], float]:
    return {
        tuple(sorted(s.labels.values())): s.value
        for family in text_string_to_metric_families(metrics.render().decode())
        for s in family.samples
        if s.name == name
    }


def test_cached_children_and_labels_share_one_series() -> None:
    metrics = GatewayMetrics()
    metrics.requests_of("big", "acme", Outcome.LOCAL).inc()
    metrics.requests_of("big", "acme", Outcome.LOCAL).inc()
    metrics.requests.labels("big", "acme", "local").inc()
    metrics.requests_of("big", "beta", Outcome.REJECTED).inc()
    assert metrics.requests_of("big", "acme", Outcome.LOCAL) is metrics.requests.labels(
        "big", "acme", "local"
    )
    assert samples(metrics, "spillgate_requests_total") == {
        ("acme", "big", "local"): 3.0,
        ("beta", "big", "rejected"): 1.0,
    }
