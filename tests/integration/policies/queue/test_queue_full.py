"""A full queue keeps no light tenant out: a heavy tenant keeps more requests outstanding
than the pool runs and its queue holds (by waiters, `max_depth`, or by the tokens they
would reserve, `max_tokens`) while a light tenant of the same class sends a small request
now and then. Each of the light tenant's arrivals pushes the heavy tenant's newest waiter
out of the full queue (policies/queue/fair_queue.py); the heavy tenant's surplus is refused
with 503 `queue_full` and a Retry-After, not `capacity_exhausted`."""

from __future__ import annotations

import asyncio
import random
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from loadtest.sim.config import SimConfig
from tests.support.fleet import Fleet, run_fleet
from tests.support.overflow import async_client, chat, flooding, sample

SLOTS = 8  # requests of the heavy tenant's size the pool runs at once: two blocks each
DEPTH = 8
LIGHT_REQUESTS = 12
BOUNDS: dict[str, dict[str, Any]] = {
    "max_depth": {"max_depth": DEPTH},
    # the same bound in tokens: each heavy waiter would reserve two blocks of 16
    "max_tokens": {"max_depth": 1000, "max_tokens": DEPTH * 32},
}


@pytest.fixture(params=sorted(BOUNDS))
def fleet(request: pytest.FixtureRequest) -> Iterator[Fleet]:
    with run_fleet(
        pools={"big": [SimConfig(model="m", kv_tokens=8192, speed=0.5)]},
        pool_options={
            "big": {
                "target_fill": 1.0,
                "overflow": ["queue", "reject"],
                "queue": {"max_wait_s": 10, **BOUNDS[request.param]},
                "reservation": {"mode": "max_tokens"},
            }
        },
        capacity={"big": SLOTS * 32},
        tenants={
            "heavy": {"requests_per_minute": 100_000},
            "light": {"requests_per_minute": 100_000},
        },
    ) as f:
        yield f


async def flood(fleet: Fleet) -> tuple[list[httpx.Response], list[httpx.Response]]:
    """The heavy tenant's answers and the light tenant's, while the heavy one floods."""
    rng = random.Random(3)
    heavy_seen: list[httpx.Response] = []
    limits = httpx.Limits(max_connections=100, max_keepalive_connections=100)
    async with (
        async_client(fleet, "heavy", limits=limits) as heavy,
        async_client(fleet, "light") as light,
    ):

        async def heavy_sends() -> httpx.Response:
            body = chat("heavy", max_tokens=rng.randint(18, 30))
            return await heavy.post("/v1/chat/completions", json=body)

        async def light_sends() -> httpx.Response:
            return await light.post("/v1/chat/completions", json=chat("light", max_tokens=2))

        async with flooding(heavy_sends, in_flight=SLOTS + DEPTH + 24, into=heavy_seen):
            await asyncio.sleep(1.0)  # the pool fills and the queue with it
            light_seen = []
            for _ in range(LIGHT_REQUESTS):  # one at a time, however long each takes
                light_seen.append(await light_sends())
                await asyncio.sleep(0.15)
    return heavy_seen, light_seen


def test_a_light_tenant_is_never_refused_by_a_queue_a_heavy_one_fills(fleet: Fleet) -> None:
    heavy, light = asyncio.run(flood(fleet))
    assert [r.status_code for r in light] == [200] * LIGHT_REQUESTS, [r.text for r in light]
    refused = [r for r in heavy if r.status_code == 503]
    assert refused, "the heavy tenant's flood never filled the queue"
    for response in refused:
        assert response.json()["error"]["code"] == "queue_full", response.text
        assert response.headers["x-spillgate-outcome"] == "rejected"
        assert int(response.headers["retry-after"]) >= 1
    # each light arrival that found the queue full pushed out one of the heavy tenant's
    pushed_out = sample(fleet, "spillgate_queue_displaced_total", pool="big", tenant="heavy")
    assert pushed_out is not None and 1 <= pushed_out <= len(light)
    assert sample(fleet, "spillgate_queue_displaced_total", pool="big", tenant="light") is None
    assert sample(fleet, "spillgate_queue_depth", pool="big") == 0
