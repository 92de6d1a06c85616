"""A pool's routing profile, named in its configuration, decides where requests go.

Two simulated vLLMs behind pool `m`, routed by a profile that weighs the requests waiting
inside an engine ten times the fill. Traffic that bypasses the gateway fills `m-1`'s KV
cache with running streams, and keeps `m-0`'s one sequence slot busy with requests queued
behind it: by fill alone `m-0` is the emptier, by what waits inside it the busier.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager

import httpx
import pytest

from loadtest.sim.config import SimConfig
from tests.support.fleet import Fleet, run_fleet, until_ready
from tests.support.metrics import metric_sum
from tests.support.overflow import eventually
from tests.support.shared_prompt import SLOW_STEPS

PROFILE = {
    "name": "busy-aware",
    "scorers": [{"plugin": "waiting", "weight": 10}, {"plugin": "fill", "weight": 1}],
}


@pytest.fixture(scope="module")
def fleet() -> Iterator[Fleet]:
    one_at_a_time = SimConfig(model="m", kv_tokens=32_768, max_num_seqs=1, step_cost=SLOW_STEPS)
    roomy = SimConfig(model="m", kv_tokens=32_768, step_cost=SLOW_STEPS)
    with run_fleet(
        pools={"m": [one_at_a_time, roomy]},
        pool_options={"m": {"routing": "busy-aware", "overflow": ["reject"]}},
        extra={"routing_profiles": [PROFILE]},
    ) as f:
        until_ready(f)
        yield f


@asynccontextmanager
async def bypassing(url: str, *, streams: int, prompt_words: int) -> AsyncIterator[None]:
    """`streams` long streams sent straight to a backend, held open until the block ends."""
    body = {
        "model": "m",
        "messages": [{"role": "user", "content": "word " * prompt_words}],
        "max_tokens": 2000,
        "stream": True,
    }

    async def hold(http: httpx.AsyncClient) -> None:
        async with http.stream("POST", "/v1/chat/completions", json=body) as response:
            async for _ in response.aiter_bytes():
                pass

    async with httpx.AsyncClient(base_url=url, timeout=60) as http:
        tasks = [asyncio.create_task(hold(http)) for _ in range(streams)]
        try:
            yield
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)


def served_by(fleet: Fleet, backend: str) -> float:
    return metric_sum(fleet.url, "spillgate_tokens_total", target=backend, kind="completion")


def test_the_profile_weighs_the_engines_queue_over_the_fill(fleet: Fleet) -> None:
    busy, roomy = (s.url for s in fleet.backends["m"])

    async def scenario() -> None:
        async with (
            bypassing(busy, streams=3, prompt_words=10),
            bypassing(roomy, streams=3, prompt_words=3000),
        ):

            def scraped() -> bool:
                backends = {b["name"]: b for b in fleet.status()["pools"][0]["backends"]}
                busy_kv, roomy_kv = (backends[n]["reported_kv_usage"] or 0 for n in ("m-0", "m-1"))
                return (backends["m-0"]["requests_waiting"] or 0) >= 2 and roomy_kv > busy_kv

            await asyncio.to_thread(eventually, scraped, within_s=20)
            before = served_by(fleet, "m-1")
            async with httpx.AsyncClient(base_url=fleet.url, timeout=30) as http:
                answer = await http.post(
                    "/v1/chat/completions",
                    headers={"authorization": f"Bearer {fleet.keys['acme']}"},
                    json={
                        "model": "m",
                        "messages": [{"role": "user", "content": "hello"}],
                        "max_tokens": 4,
                    },
                )
            assert answer.status_code == 200, answer.text
            assert served_by(fleet, "m-1") - before == 4  # the fuller, not the queued one

    asyncio.run(scenario())
