"""A request with a TTFT objective on real simulated backends and a simulated provider: the
overflow chain becomes a ladder, each step weighed by its predicted time to first token.

The pool's one backend is held full by a long stream. Its queue would make a request wait
for that stream's end; a request whose objective that wait misses goes on to the provider,
or, with no provider, is refused at once; a request whose objective allows the wait, waits.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator

import httpx
import pytest

from loadtest.sim.config import SimConfig
from loadtest.sim.provider import ProviderConfig
from tests.support.fleet import Fleet
from tests.support.harness import ServerThread
from tests.support.overflow import async_client, chat, holding, pool, provider_fleet, sample

SLO_MS = 400  # far below the held stream's remaining time, far above the provider's TTFT


def pools(servers: dict[str, ServerThread]) -> list[dict[str, object]]:
    return [
        pool(
            "big",
            servers["big"],
            "big-model",
            overflow=["queue", "provider", "reject"],
            queue={"max_wait_s": 20.0},
            provider="hosted",
        ),
        pool(
            "lone",
            servers["lone"],
            "lone-model",
            overflow=["queue", "reject"],
            queue={"max_wait_s": 20.0},
        ),
    ]


@pytest.fixture(scope="module")
def ladder() -> Iterator[tuple[Fleet, ServerThread]]:
    with provider_fleet(
        provider=ProviderConfig(api_key="sk-hosted", models=("hosted-big",)),
        provider_options={"models": {"big": "hosted-big"}},
        pools=pools,
        tenants={"acme": {}},
        sims={
            # 1,000 tokens at ~4 ms a step: the held stream runs about 4 s
            "big": SimConfig(model="big-model", kv_tokens=4096, speed=2.0),
            "lone": SimConfig(model="lone-model", kv_tokens=4096, speed=2.0),
        },
    ) as built:
        yield built


async def while_held(
    fleet: Fleet, model: str, headers: dict[str, str]
) -> tuple[httpx.Response, float]:
    async with async_client(fleet, "acme") as client, holding(client, model):
        await asyncio.sleep(0.3)  # the hold is some way into its answer
        started = time.monotonic()
        response = await client.post(
            "/v1/chat/completions", json=chat("q", model=model), headers=headers
        )
        return response, time.monotonic() - started


def test_a_request_whose_objective_the_queue_misses_goes_to_the_provider(
    ladder: tuple[Fleet, ServerThread],
) -> None:
    fleet, _ = ladder
    response, took = asyncio.run(while_held(fleet, "big", {"x-spillgate-ttft-ms": str(SLO_MS)}))
    assert response.status_code == 200, response.text
    assert response.headers["x-spillgate-outcome"] == "provider"
    assert took < SLO_MS / 1000  # the queue's wait was never begun
    assert sample(fleet, "spillgate_slo_passed_over_total", pool="big", tier="queue") >= 1
    assert sample(fleet, "spillgate_slo_requests_total", pool="big", result="met") >= 1
    # the provider's answer is measured: the next weighing of it has a figure
    status = fleet.status()
    assert status["latencies"]["provider"]["hosted"]["answers"] >= 1


def test_a_request_no_tier_can_serve_in_time_is_refused_at_once(
    ladder: tuple[Fleet, ServerThread],
) -> None:
    fleet, _ = ladder
    response, took = asyncio.run(while_held(fleet, "lone", {"x-spillgate-ttft-ms": str(SLO_MS)}))
    assert response.status_code == 503, response.text
    error = response.json()["error"]
    assert error["code"] == "slo_unattainable"
    assert "x-spillgate-ttft-ms" in error["message"] and "queue ~" in error["message"]
    assert float(response.headers["retry-after"]) >= 1
    assert response.headers["x-spillgate-outcome"] == "rejected"
    assert took < SLO_MS / 1000  # told at once, not at its deadline
    assert sample(fleet, "spillgate_slo_requests_total", pool="lone", result="refused") >= 1


def test_a_request_whose_objective_allows_the_wait_waits_in_the_queue(
    ladder: tuple[Fleet, ServerThread],
) -> None:
    fleet, _ = ladder
    response, _ = asyncio.run(while_held(fleet, "lone", {"x-spillgate-ttft-ms": "60000"}))
    assert response.status_code == 200, response.text
    assert response.headers["x-spillgate-outcome"] == "queued"


def test_a_malformed_objective_is_a_400_naming_its_header(
    ladder: tuple[Fleet, ServerThread],
) -> None:
    fleet, _ = ladder
    with httpx.Client(base_url=fleet.url, timeout=10) as client:
        response = client.post(
            "/v1/chat/completions",
            json=chat("q", model="big"),
            headers={
                "authorization": f"Bearer {fleet.keys['acme']}",
                "x-spillgate-ttft-ms": "soon",
            },
        )
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "x-spillgate-ttft-ms"
