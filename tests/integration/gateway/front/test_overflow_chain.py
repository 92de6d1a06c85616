"""The full chain on real simulated backends: queue → degrade → provider → cache → reject.

Each policy engages in order with its own outcome header, and passes the request on when
it cannot serve: the queue's wait would outlast the tenant's 200 ms TTFT objective (so the
request passes it over at once, gateway/slo.py), the smaller pool is full, the provider
fails or its breaker is open, the cache misses.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import httpx
import orjson
import pytest

from loadtest.sim.config import SimConfig
from loadtest.sim.provider import ProviderConfig
from tests.support.fleet import Fleet
from tests.support.harness import ServerThread
from tests.support.overflow import (
    async_client,
    chat,
    holding,
    pool,
    provider_fleet,
    provider_stats,
    sample,
    wait_for,
)

PROVIDER_KEY = "sk-provider-only-the-gateway-knows"
PROMPT_PRICE, COMPLETION_PRICE = 1.0, 2.0  # dollars per million tokens


def pools(servers: dict[str, ServerThread]) -> list[dict[str, object]]:
    return [
        pool(
            "big",
            servers["big"],
            "big-model",
            overflow=["queue", "degrade", "provider", "cache", "reject"],
            queue={"max_wait_s": 3.0},
            degrade_to="small",
            provider="hosted",
        ),
        pool("small", servers["small"], "small-model"),
    ]


@pytest.fixture
def chain() -> Iterator[tuple[Fleet, ServerThread]]:
    with provider_fleet(
        provider=ProviderConfig(api_key=PROVIDER_KEY, models=("hosted-big",)),
        provider_options={
            "models": {"big": "hosted-big"},
            "breaker_failures": 2,
            "breaker_cooldown_s": 60,
            "prompt_price_per_m": PROMPT_PRICE,
            "completion_price_per_m": COMPLETION_PRICE,
            "timeouts": {"connect": 1, "first_token": 3, "total": 10},
        },
        pools=pools,
        # `hurried` has a 200 ms TTFT objective the queue cannot meet; `patient` may wait 3 s
        tenants={"hurried": {"ttft_budget_ms": 200}, "patient": {}},
        sims={
            "big": SimConfig(model="big-model", kv_tokens=4096, speed=2.0),
            "small": SimConfig(model="small-model", kv_tokens=4096, speed=2.0),
        },
    ) as built:
        yield built


async def queued_after_a_release(fleet: Fleet) -> httpx.Response:
    async with async_client(fleet, "patient") as client, async_client(fleet, "hurried") as hold:
        async with holding(hold, "big"):
            probe = asyncio.create_task(client.post("/v1/chat/completions", json=chat("q")))
            await wait_for(lambda: sample(fleet, "spillgate_queue_depth", pool="big") == 1)
        return await probe  # the holder's release handed its room to the waiter


def test_queue_serves_a_waiter_when_capacity_is_released(
    chain: tuple[Fleet, ServerThread],
) -> None:
    fleet, _ = chain
    response = asyncio.run(queued_after_a_release(fleet))
    assert response.status_code == 200
    assert response.headers["x-spillgate-outcome"] == "queued"
    assert response.json()["model"] == "big"
    assert sample(fleet, "spillgate_queue_wait_seconds_count", pool="big") == 1
    assert sample(fleet, "spillgate_queue_depth", pool="big") == 0


async def spill_down_the_chain(fleet: Fleet, hosted: ServerThread) -> dict[str, httpx.Response]:
    seen: dict[str, httpx.Response] = {}
    deterministic = chat("spill", temperature=0)
    async with async_client(fleet, "hurried") as client, holding(client, "big"):
        seen["degraded"] = await client.post("/v1/chat/completions", json=deterministic)
        async with holding(client, "small"):
            seen["provider"] = await client.post("/v1/chat/completions", json=deterministic)
            failing = {"status": 503, "count": 2}
            (await client.post(f"{hosted.url}/sim/fail", json=failing)).raise_for_status()
            seen["cached"] = await client.post("/v1/chat/completions", json=deterministic)
            streamed = {**deterministic, "stream": True}
            seen["cached_stream"] = await client.post("/v1/chat/completions", json=streamed)
            before = provider_stats(hosted)["requests"]
            seen["miss"] = await client.post("/v1/chat/completions", json=chat("other"))
            assert provider_stats(hosted)["requests"] == before  # breaker open: not asked
    return seen


def streamed_text(response: httpx.Response) -> str:
    chunks = [
        orjson.loads(line.removeprefix("data: "))
        for line in response.text.splitlines()
        if line.startswith("data: {")
    ]
    return "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])


def test_each_policy_engages_in_order_and_passes_on_when_it_cannot_serve(
    chain: tuple[Fleet, ServerThread],
) -> None:
    fleet, hosted = chain
    seen = asyncio.run(spill_down_the_chain(fleet, hosted))
    outcomes = {name: (r.status_code, r.headers["x-spillgate-outcome"]) for name, r in seen.items()}
    assert outcomes == {
        "degraded": (200, "degraded"),  # the queue was predicted to miss the 200 ms objective
        "provider": (200, "provider"),  # the smaller pool was full too
        "cached": (200, "cached"),  # the provider failed (503) before the first byte
        "cached_stream": (200, "cached"),  # ... and again, opening its breaker
        "miss": (503, "rejected"),  # breaker open, cache miss
    }
    assert seen["degraded"].json()["model"] == "small"  # the answer names its model
    spilled = seen["provider"]
    assert spilled.json()["model"] == "big"
    assert seen["cached"].content == spilled.content  # exactly what the provider said
    replay = seen["cached_stream"]
    assert replay.headers["content-type"].startswith("text/event-stream")
    assert streamed_text(replay) == spilled.json()["choices"][0]["message"]["content"]
    miss = seen["miss"]
    assert int(miss.headers["retry-after"]) >= 1
    # the queue could have served it, only not within its objective: the refusal says so
    assert miss.json()["error"]["code"] == "slo_unattainable"
    check_provider_accounting(fleet, hosted, spilled)


def check_provider_accounting(fleet: Fleet, hosted: ServerThread, spilled: httpx.Response) -> None:
    stats = provider_stats(hosted)
    # the provider saw only the gateway's own key, never a tenant's
    assert stats["authorizations_seen"] == [f"Bearer {PROVIDER_KEY}"]
    assert stats["by_status"] == {"200": 1, "503": 2}
    usage = spilled.json()["usage"]
    tokens = sample(fleet, "spillgate_tokens_total", target="hosted", kind="completion")
    assert tokens == usage["completion_tokens"]
    cost = sample(fleet, "spillgate_provider_cost_dollars_total", provider="hosted")
    prompt, completion = usage["prompt_tokens"], usage["completion_tokens"]
    expected = (prompt * PROMPT_PRICE + completion * COMPLETION_PRICE) / 1e6
    assert cost == pytest.approx(expected)
    assert sample(fleet, "spillgate_provider_breaker_open", provider="hosted") == 1
