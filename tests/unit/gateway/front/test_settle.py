"""Settling a request on a real router and ledger: whatever fails, the reservation the
request holds is given back."""

from __future__ import annotations

import asyncio

import pytest

from gateway.admission.fleet.backends import build_pools
from gateway.admission.ledger.held import HeldReservation
from gateway.admission.ledger.reservations import LocalLedger
from gateway.admission.routing.router import Router
from gateway.clock import ManualClock
from gateway.config import BackendSettings, PoolSettings
from gateway.front.auth import Tenant
from gateway.front.exchange import Exchange
from gateway.front.settle import Settlement
from gateway.metrics import GatewayMetrics
from gateway.outcome import Outcome
from gateway.ratelimit.base import StoreError, TenantLimits
from gateway.ratelimit.local import LocalRateLimiter
from gateway.slo import Latencies
from gateway.upstream.forward import Forwarder
from gateway.upstream.pool import UpstreamPool
from tests.support.upstream import Client, chat_request


class FailingLimiter(LocalRateLimiter):
    """The local limiter, but its refund fails as Redis's does when Redis is gone."""

    async def reconcile(self, limits: TenantLimits, *, charged: int, used: int) -> None:
        raise StoreError("redis is gone")


TENANT = Tenant(
    name="acme",
    key_hash=b"",
    priority="standard",
    pools=frozenset(),
    limits=TenantLimits(tenant="acme", requests_per_minute=60, tokens_per_minute=10_000),
    ttft_budget_s=None,
)


@pytest.mark.parametrize("shared", [False, True], ids=["local", "shared"])
def test_a_refund_that_raises_still_releases_the_reservation(shared: bool) -> None:
    """The tenant's refund fails (Redis gone): the error reaches the caller, but the
    reservation is given back and the outcome recorded all the same."""

    async def scenario() -> tuple[int, int, float | None]:
        clock = ManualClock()
        backend = BackendSettings(url="http://127.0.0.1:9", capacity=1000, block_size=1)
        pools = build_pools([PoolSettings(name="big", backends=[backend])], clock=clock)
        router = Router(pools, ledger=LocalLedger(), clock=clock)
        metrics = GatewayMetrics()
        upstream = UpstreamPool(max_connections=1)
        held = HeldReservation(router)
        exchange = Exchange(
            send=Client().send,
            headers=[],
            router=router,
            forwarder=Forwarder(upstream, clock=clock),
            metrics=metrics,
            clock=clock,
            held=held,
        )
        request = chat_request(max_tokens=50)
        assert await exchange.admit(request)
        name = held.backend
        assert name is not None
        holding = router.ledger.tokens_in_flight(name)
        settlement = Settlement(
            limiter=FailingLimiter(clock),
            metrics=metrics,
            latencies=Latencies(clock),
            services={},
            clock=clock,
            shared=shared,
        )
        with pytest.raises(StoreError):
            # nothing served: the whole charge is refunded, and the refund raises
            await settlement.settle(
                TENANT, request, pools["big"], exchange, None, Outcome.REJECTED,
                cut=False, arrived=0.0, began=0.0,
            )  # fmt: skip
        await upstream.aclose()
        metrics.tally.flush()
        recorded = metrics.registry.get_sample_value(
            "spillgate_requests_total", {"pool": "big", "tenant": "acme", "outcome": "rejected"}
        )
        return holding, router.ledger.tokens_in_flight(name), recorded

    holding, left, recorded = asyncio.run(scenario())
    assert holding > 0
    assert left == 0
    assert recorded == 1
