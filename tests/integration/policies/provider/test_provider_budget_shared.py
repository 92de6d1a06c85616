"""A provider's tokens-per-minute budget is one budget across replicas when Redis is shared."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterator

import httpx

from gateway.app import create_app
from gateway.config import parse_settings
from loadtest.procs import RedisProcess
from loadtest.sim.app import create_sim_app
from loadtest.sim.config import SimConfig
from loadtest.sim.provider import ProviderConfig, create_provider_app
from tests.support.harness import ServerThread
from tests.support.overflow import spilling

KEY = "sk-tenant-budget"
PROVIDER_KEY = "sk-provider-budget"
BUDGET = 1000  # provider tokens per minute
MAX_TOKENS = 90  # with the prompt, about a tenth of the budget per request


@contextlib.contextmanager
def two_gateways(
    redis_url: str | None, *, first_token_latency_s: float = 0.005, max_concurrency: int = 64
) -> Iterator[tuple[list[str], ServerThread]]:
    started: list[ServerThread] = []
    try:
        backend = ServerThread(create_sim_app(SimConfig(model="m", kv_tokens=4096))).start()
        answers = ProviderConfig(api_key=PROVIDER_KEY, first_token_latency_s=first_token_latency_s)
        provider = ServerThread(create_provider_app(answers))
        started += [backend, provider.start()]
        # nothing fits locally: every request is the provider's or refused
        settings = parse_settings(
            spilling(
                key=KEY,
                backend=backend.url,
                provider=provider.url,
                api_key_env="HOSTED_KEY",
                tokens_per_minute=BUDGET,
                max_concurrency=max_concurrency,
            )
        )
        env = {"HOSTED_KEY": PROVIDER_KEY}
        gateways = [
            ServerThread(create_app(settings, environ=env, redis_url=redis_url)).start()
            for _ in range(2)
        ]
        started += gateways
        yield [g.url for g in gateways], provider
    finally:
        for server in reversed(started):
            server.stop()


def spill(urls: list[str]) -> list[str]:
    async def go() -> list[str]:
        headers = {"authorization": f"Bearer {KEY}"}
        body = {"model": "big", "messages": [{"role": "user", "content": "hi"}],
                "max_tokens": MAX_TOKENS}  # fmt: skip
        async with httpx.AsyncClient(headers=headers, timeout=20) as client:
            replies = []
            for i in range(30):  # one after another, alternating replicas
                reply = await client.post(f"{urls[i % 2]}/v1/chat/completions", json=body)
                replies.append(reply.headers["x-spillgate-outcome"])
            return replies

    return asyncio.run(go())


def test_replicas_on_one_redis_spend_one_provider_budget(redis_proc: RedisProcess) -> None:
    with two_gateways(redis_proc.url) as (urls, provider):
        outcomes = spill(urls)
        seen = httpx.get(f"{provider.url}/sim/stats").json()
    spilled = outcomes.count("provider")
    # about ten requests of ~100 tokens fit one budget of 1000; the rest are refused
    assert 8 <= spilled <= 11, outcomes
    assert outcomes.count("rejected") == 30 - spilled
    assert seen["prompt_tokens"] + seen["completion_tokens"] <= BUDGET + 100


def test_without_redis_each_replica_spends_its_own_budget() -> None:
    with two_gateways(None) as (urls, _):
        outcomes = spill(urls)
    assert outcomes.count("provider") >= 16  # twice the budget: what sharing prevents


def concurrent_spills(urls: list[str], count: int) -> list[str]:
    async def go() -> list[str]:
        headers = {"authorization": f"Bearer {KEY}"}
        body = {"model": "big", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5}
        async with httpx.AsyncClient(headers=headers, timeout=20) as client:
            posts = (
                client.post(f"{urls[i % 2]}/v1/chat/completions", json=body) for i in range(count)
            )
            replies = await asyncio.gather(*posts)
            return [r.headers["x-spillgate-outcome"] for r in replies]

    return asyncio.run(go())


def test_replicas_on_one_redis_share_one_provider_concurrency_cap(
    redis_proc: RedisProcess,
) -> None:
    """A cap of 2 at once, for the fleet: 6 requests at once over two replicas (each
    answer takes a second), 2 go to the provider; per process it would be 4."""
    with two_gateways(redis_proc.url, first_token_latency_s=1.0, max_concurrency=2) as (urls, _):
        outcomes = concurrent_spills(urls, 6)
    assert sorted(outcomes) == ["provider"] * 2 + ["rejected"] * 4
