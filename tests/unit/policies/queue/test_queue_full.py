"""A full queue: who gives way to whom, and how a request it turns away is answered."""

from __future__ import annotations

import asyncio

import pytest

from gateway.admission.fleet.metrics_text import samples, values
from gateway.admission.routing.route import Route
from gateway.errors import QueueFull
from policies.queue.fair_queue import QueueResult
from policies.queue.policy import QueuePolicy
from tests.support.queue import CAPACITY, Setup, request, run, settle


def displaced(s: Setup, tenant: str) -> float:
    found = values(
        samples(s.metrics.render().decode()),
        "spillgate_queue_displaced_total",
        pool="p",
        tenant=tenant,
    )
    return found[0] if found else 0.0


def test_a_light_tenant_displaces_the_heavy_tenants_newest_waiter() -> None:
    async def scenario(s: Setup) -> None:
        for _ in range(3):
            s.queue.admitted(request(tenant="heavy"))
        full = await s.router.reserve(Route("p", CAPACITY))
        assert full is not None
        heavy = [
            asyncio.create_task(s.queue.wait(request(tenant="heavy"), s.exchange()))
            for _ in range(2)
        ]
        await settle()
        # the heaviest tenant itself finds nobody to push out
        assert (
            await s.queue.wait(request(tenant="heavy"), s.exchange()) is QueueResult.REJECTED_FULL
        )
        light = asyncio.create_task(s.queue.wait(request(tenant="light"), s.exchange()))
        assert await heavy[1] is QueueResult.EVICTED_DISPLACED
        assert displaced(s, "heavy") == 1 and displaced(s, "light") == 0
        await s.router.release(full)
        assert await light is QueueResult.ADMITTED
        assert await heavy[0] is QueueResult.ADMITTED

    run(scenario, max_depth=2)


@pytest.mark.parametrize(
    ("overflow", "refused"), [(["queue", "reject"], True), (["queue", "cache", "reject"], False)]
)
def test_a_full_queue_refuses_with_its_own_code_when_only_a_refusal_follows(
    overflow: list[str], refused: bool
) -> None:
    async def scenario(s: Setup) -> None:
        settings = s.settings.model_copy(update={"overflow": overflow})
        queue = QueuePolicy(
            settings, room=s.router, metrics=s.metrics, clock=s.clock, ttft_budgets_s={}
        )
        full = await s.router.reserve(Route("p", CAPACITY))
        assert full is not None
        waiting = asyncio.create_task(queue.decide(request(tenant="heavy"), s.exchange()))
        await settle()
        if refused:
            with pytest.raises(QueueFull) as caught:
                await queue.decide(request(tenant="heavy"), s.exchange())
            assert caught.value.status == 503 and caught.value.code == "queue_full"
            assert caught.value.retry_after is not None and caught.value.retry_after > 0
        else:  # the next step may serve it
            assert await queue.decide(request(tenant="heavy"), s.exchange()) is None
        waiting.cancel()
        await asyncio.gather(waiting, return_exceptions=True)
        await s.router.release(full)
        assert len(queue) == 0 and s.in_flight() == 0

    run(scenario, max_depth=1)
