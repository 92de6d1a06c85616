"""The dashboard's history: per-step outcome deltas in a bounded ring, oldest dropped first."""

import asyncio

from gateway.admission.fleet.backends import build_pools
from gateway.admission.ledger.reservations import LocalLedger
from gateway.admission.routing.router import Router
from gateway.clock import ManualClock
from gateway.config import parse_settings
from gateway.metrics import GatewayMetrics
from gateway.ops.dashboard import OutcomeHistory


def _history(
    clock: ManualClock, *, window_s: float = 30.0
) -> tuple[OutcomeHistory, GatewayMetrics, Router]:
    settings = parse_settings(
        {
            "tenants": [{"name": "t", "key_env": "K"}],
            "pools": [{"name": "p", "backends": [{"url": "http://127.0.0.1:1", "capacity": 100}]}],
        }
    )
    router = Router(build_pools(settings.pools, clock=clock), ledger=LocalLedger(), clock=clock)
    metrics = GatewayMetrics()
    history = OutcomeHistory(
        metrics=metrics, router=router, clock=clock, step_s=10.0, window_s=window_s
    )
    return history, metrics, router


def test_each_step_holds_only_what_happened_in_it() -> None:
    clock = ManualClock(start=1000.0)
    history, metrics, _ = _history(clock)
    requests = metrics.requests
    requests.labels("p", "t", "local").inc(3)
    requests.labels("p", "u", "local").inc(2)
    clock.advance(10)
    first = history.sample()
    assert first.outcomes == {"p": {"local": 5}}
    assert (first.t, first.step_s) == (1010.0, 10.0)
    requests.labels("p", "t", "rejected").inc()
    clock.advance(10)
    assert history.sample().outcomes == {"p": {"rejected": 1}}
    clock.advance(10)
    assert history.sample().outcomes == {}


def test_the_ring_keeps_the_window_and_the_snapshot_adds_the_step_in_progress() -> None:
    clock = ManualClock(start=0.0)
    history, metrics, router = _history(clock, window_s=30.0)
    for step in range(5):
        metrics.requests.labels("p", "t", "local").inc(step + 1)
        clock.advance(10)
        history.sample()
    metrics.queue_depth.labels("p").set(4)
    metrics.requests.labels("p", "t", "queued").inc(7)
    asyncio.run(router.ledger.reserve("p-0", 60, limit=90))
    clock.advance(4)
    snap = history.snapshot()
    points = snap["points"]
    assert isinstance(points, list)
    assert snap["window_s"] == 30.0
    assert [p["outcomes"] for p in points] == [
        {"p": {"local": 3}},
        {"p": {"local": 4}},
        {"p": {"local": 5}},
        {"p": {"queued": 7}},
    ]
    assert points[-1]["step_s"] == 4.0
    assert points[-1]["queue_depth"] == {"p": 4.0}
    assert points[-1]["tokens_in_flight"] == {"p-0": 60}
