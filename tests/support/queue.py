"""A queue on a real router and ledger, on a manual clock, for the queue's unit tests."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any, Literal

from gateway.admission.fleet.backends import build_pools
from gateway.admission.ledger.held import HeldReservation
from gateway.admission.ledger.reservations import LocalLedger
from gateway.admission.routing.router import Router
from gateway.clock import ManualClock
from gateway.config import BackendSettings, PoolSettings, Priority, QueueSettings
from gateway.front.exchange import Exchange
from gateway.metrics import GatewayMetrics
from gateway.request import Endpoint, InferenceRequest
from gateway.upstream.forward import Forwarder
from gateway.upstream.pool import UpstreamPool
from policies.queue.policy import QueuePolicy
from tests.support.clock import run_on

CAPACITY = 1000
BACKEND = "p-0"


class Setup:
    def __init__(
        self,
        *,
        clock: ManualClock,
        max_depth: int = 8,
        max_wait_s: float | Literal["auto"] = 5.0,
        sheddable_max_fill: float = 1.0,
        max_tokens: int | None = None,
        backends: int = 1,
    ) -> None:
        self.clock = clock
        self.settings = PoolSettings(
            name="p",
            backends=[
                BackendSettings(url="http://127.0.0.1:9", capacity=CAPACITY, block_size=1)
                for _ in range(backends)
            ],
            target_fill=1.0,
            sheddable_max_fill=sheddable_max_fill,
            queue=QueueSettings(max_depth=max_depth, max_wait_s=max_wait_s, max_tokens=max_tokens),
        )
        pools = build_pools([self.settings], clock=self.clock)
        self.router = Router(pools, ledger=LocalLedger(), clock=self.clock)
        self.metrics = GatewayMetrics()
        self.upstream = UpstreamPool(max_connections=4)
        self.budgets: dict[str, float] = {}
        self.queue = QueuePolicy(
            self.settings,
            room=self.router,
            metrics=self.metrics,
            clock=self.clock,
            ttft_budgets_s=self.budgets,
        )

    def exchange(self) -> Exchange:
        async def no_send(message: Any) -> None:
            raise AssertionError("the queue never answers by itself")

        return Exchange(
            send=no_send,
            headers={},
            router=self.router,
            forwarder=Forwarder(self.upstream, clock=self.clock),
            metrics=self.metrics,
            clock=self.clock,
            held=HeldReservation(self.router),
        )

    def in_flight(self) -> int:
        return self.router.ledger.tokens_in_flight(BACKEND)


def request(
    tenant: str = "t",
    priority: Priority = "standard",
    tokens: int = 100,
    ttft_slo_s: float | None = None,
) -> Any:
    return InferenceRequest(
        endpoint=Endpoint.CHAT,
        tenant=tenant,
        pool="p",
        priority=priority,
        stream=False,
        client_wants_usage=False,
        prompt_chars=4,
        prompt_tokens=1,
        max_output_tokens=tokens - 1,
        body={},
        ttft_slo_s=ttft_slo_s,
    )


def run(scenario: Callable[[Setup], Awaitable[None]], **options: Any) -> None:
    clock = ManualClock()

    async def main() -> None:
        setup = Setup(clock=clock, **options)
        try:
            await scenario(setup)
        finally:
            await setup.upstream.aclose()

    run_on(clock, main)  # the loop's time is the queue's clock: no real waiting


async def settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)
