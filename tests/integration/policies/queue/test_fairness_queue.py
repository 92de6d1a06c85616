"""Fairness within a priority class: tenant A floods at 10× its share of a pool while
tenant B sends at a steady rate; B's queue wait p99 stays within twice its value when A
only keeps the pool full.

Why that baseline: B alone would never queue, so its "unloaded" queue wait would be zero.
The pool must be saturated in both settings for B to queue at all; what changes is only
how much A piles into the queue (two waiters, or fifty). A first-come-first-served queue
would put B behind every one of A's waiters; taking turns between tenants puts B at the
next release. The wait is the one the gateway measured and reported in `server-timing`,
so the test client's own scheduling does not blur it.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Iterator

import httpx
import pytest

from loadtest.percentile import percentile_or_nan
from loadtest.sim.config import SimConfig
from tests.support.fleet import Fleet, run_fleet
from tests.support.overflow import (
    async_client,
    chat,
    flooding,
    queue_wait_s,
    steady,
)

SLOTS = 12  # requests of ~16 tokens that fit the pool at once
SHARE = SLOTS // 2  # two tenants
B_EVERY_S, WINDOW_S, ROUNDS = 0.06, 1.25, 2
# release gaps and scheduling hiccups of a shared two-core test machine; arrival order
# would cost B about as much as A's waits, close to a second here
NOISE_S = 0.3


@pytest.fixture
def fleet() -> Iterator[Fleet]:
    with run_fleet(
        pools={"big": [SimConfig(model="m", kv_tokens=8192, speed=0.25)]},
        pool_options={
            "big": {
                "target_fill": 1.0,
                "overflow": ["queue", "reject"],
                "queue": {"max_wait_s": 20, "max_depth": 1000},
            }
        },
        capacity={"big": SLOTS * 16},
        tenants={"a": {"requests_per_minute": 100_000}, "b": {"requests_per_minute": 100_000}},
    ) as f:
        yield f


async def measure(fleet: Fleet) -> dict[str, list[float]]:
    """Queue waits of B (with the pool just full, and under A's flood) and of A's flood.

    The two settings alternate, so a drift in the machine's load touches both alike.
    """
    rng = random.Random(7)
    waits: dict[str, list[float]] = {"saturated": [], "flooded": [], "a_flooded": []}
    limits = httpx.Limits(max_connections=200, max_keepalive_connections=200)
    async with async_client(fleet, "a", limits=limits) as a, async_client(fleet, "b") as b:

        async def a_sends() -> httpx.Response:
            body = chat("a", max_tokens=rng.randint(4, 16))
            return await a.post("/v1/chat/completions", json=body)

        async def b_sends() -> httpx.Response:
            response = await b.post("/v1/chat/completions", json=chat("b", max_tokens=1))
            assert response.status_code == 200
            return response

        for _ in range(ROUNDS):
            for setting, in_flight in (("saturated", SLOTS + 2), ("flooded", 10 * SHARE)):
                a_seen: list[httpx.Response] = []
                async with flooding(a_sends, in_flight=in_flight, into=a_seen):
                    await asyncio.sleep(0.3)  # the pool fills and A's queue builds
                    warm = len(a_seen)
                    senders = [steady(b_sends, every_s=B_EVERY_S, for_s=WINDOW_S) for _ in "12"]
                    b_seen = [r for sent in await asyncio.gather(*senders) for r in sent]
                waits[setting] += [queue_wait_s(r) for r in b_seen]
                if setting == "flooded":
                    waits["a_flooded"] += [queue_wait_s(r) for r in a_seen[warm:]]
    return waits


def test_a_flooding_tenant_does_not_stretch_another_tenants_queue_wait(fleet: Fleet) -> None:
    waits = asyncio.run(measure(fleet))
    unloaded, loaded = (
        percentile_or_nan(waits["saturated"], 99),
        percentile_or_nan(waits["flooded"], 99),
    )
    assert sum(w > 0 for w in waits["flooded"]) >= 0.9 * len(waits["flooded"])  # B queued
    assert loaded <= 2 * unloaded + NOISE_S, (loaded, unloaded)
    # the flood really queued ahead of B: in arrival order B would have waited like A
    a_waits = sorted(waits["a_flooded"])
    a_p90 = a_waits[int(0.9 * len(a_waits))]
    assert loaded < a_p90 / 2, (loaded, a_p90)
