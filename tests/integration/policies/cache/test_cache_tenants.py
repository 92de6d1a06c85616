"""The response cache on real backends, locally and in a real redis-server: filled from a
successful answer, served when the pool is full, and never across tenants unless the pool
names a shared scope."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterator

import httpx
import redis

from loadtest.procs import RedisProcess
from loadtest.sim.config import SimConfig
from tests.support.fleet import Fleet, run_fleet
from tests.support.overflow import (
    STATIC_RESERVATION,
    async_client,
    chat,
    holding,
)

QUESTION = chat("What is the capital of France?", temperature=0)


@contextlib.contextmanager
def cache_fleet(*, scope: str | None = None, redis_url: str | None = None) -> Iterator[Fleet]:
    cache = {"ttl_s": 60} if scope is None else {"ttl_s": 60, "scope": scope}
    with run_fleet(
        pools={"big": [SimConfig(model="m", kv_tokens=4096, speed=2.0)]},
        pool_options={
            "big": {
                "target_fill": 1.0,
                "overflow": ["cache", "reject"],
                "cache": cache,
                "reservation": STATIC_RESERVATION,
            }
        },
        capacity={"big": 1000},
        tenants={"acme": {}, "beta": {}},
        redis_url=redis_url,
    ) as fleet:
        yield fleet


async def ask_while_full(fleet: Fleet) -> dict[str, httpx.Response]:
    """acme's answer fills the cache; then, with the pool full, both tenants ask again."""
    async with async_client(fleet, "acme") as acme, async_client(fleet, "beta") as beta:
        seen = {"first": await acme.post("/v1/chat/completions", json=QUESTION)}
        async with holding(acme, "big"):
            seen["acme"] = await acme.post("/v1/chat/completions", json=QUESTION)
            streamed = {**QUESTION, "stream": True}
            seen["acme_stream"] = await acme.post("/v1/chat/completions", json=streamed)
            seen["beta"] = await beta.post("/v1/chat/completions", json=QUESTION)
    return seen


def outcomes(seen: dict[str, httpx.Response]) -> dict[str, str]:
    return {name: r.headers["x-spillgate-outcome"] for name, r in seen.items()}


def check_isolated(seen: dict[str, httpx.Response]) -> None:
    assert outcomes(seen) == {
        "first": "local",
        "acme": "cached",
        "acme_stream": "cached",
        "beta": "rejected",  # beta never receives acme's answer
    }
    assert seen["acme"].content == seen["first"].content
    assert seen["acme_stream"].text.rstrip().endswith("data: [DONE]")
    assert seen["beta"].status_code == 503


def test_a_tenant_never_receives_another_tenants_cached_answer() -> None:
    with cache_fleet() as fleet:
        check_isolated(asyncio.run(ask_while_full(fleet)))


def test_a_named_scope_shares_answers_between_its_tenants() -> None:
    with cache_fleet(scope="public-faq") as fleet:
        seen = asyncio.run(ask_while_full(fleet))
    assert outcomes(seen)["beta"] == "cached"
    assert seen["beta"].content == seen["first"].content


def test_redis_holds_the_entries_under_opaque_keys(redis_proc: RedisProcess) -> None:
    with cache_fleet(redis_url=redis_proc.url) as fleet:
        check_isolated(asyncio.run(ask_while_full(fleet)))
    client = redis.Redis.from_url(redis_proc.url, socket_timeout=5)
    try:
        keys = sorted(k.decode() for k in client.keys("spillgate:cache:*"))
        entries = [k for k in keys if not k.endswith(":index")]
        assert len(entries) == 1 and keys == sorted([*entries, "spillgate:cache:{big}:index"])
        assert "acme" not in entries[0] and 0 < client.pttl(entries[0]) <= 60_000
    finally:
        client.close()
