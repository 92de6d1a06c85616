"""Reading a server's /metrics in tests, through the gateway's one parser
(gateway/admission/fleet/metrics_text.py)."""

from __future__ import annotations

import time

import httpx

from gateway.admission.fleet.metrics_text import families, samples, total


def metrics_text(url: str) -> str:
    # the simulators may serve TLS with a certificate of their own
    return httpx.get(f"{url}/metrics", timeout=5, verify=False).text


def text_sum(text: str, name: str, **labels: str) -> float:
    """The sum of the samples called `name` with these label values (0 when there are none)."""
    return total(samples(text), name, **labels) or 0.0


def metric_sum(url: str, name: str, **labels: str) -> float:
    """The same, read off `url`'s /metrics."""
    return text_sum(metrics_text(url), name, **labels)


def settled_sum(url: str, name: str, *, requests: int, **labels: str) -> float:
    """`metric_sum` once the gateway has recorded the outcomes of `requests` requests in all:
    a stream's client has its last byte before the gateway settles and counts it."""
    deadline = time.monotonic() + 10
    while True:
        text = metrics_text(url)
        if text_sum(text, "spillgate_requests_total") >= requests or time.monotonic() > deadline:
            return text_sum(text, name, **labels)
        time.sleep(0.02)


def types(text: str) -> dict[str, str]:
    """Each family's name → its type."""
    return {f.name: f.type for f in families(text)}
