"""Whatever usage a backend reports, the shared buckets in a real redis-server owe at most one
bucket: the level stays at or above minus the bucket's size, a refusal's Retry-After is at
most two refills of the bucket, and the key always expires. A usage that is no count settles
as charged, without an error."""

from __future__ import annotations

import asyncio
import contextlib
import secrets
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import redis
import redis.asyncio as aioredis

from gateway.app import create_app
from gateway.clock import ManualClock
from gateway.config import parse_settings
from gateway.ratelimit import (
    LocalRateLimiter,
    RedisRateLimiter,
    ResilientRateLimiter,
    TenantLimits,
)
from loadtest.procs import RedisProcess
from tests.support.fleet import tenant
from tests.support.harness import ServerThread
from tests.support.ratelimit import connected
from tests.support.upstream import FakeUpstream

# 1,000 tokens a minute, a bucket of 1,000: from its floor (-1,000) to full is 120 s
LIMITS = TenantLimits(tenant="acme", requests_per_minute=600, tokens_per_minute=1_000)
FLOOR_TO_FULL_S = 120.0
EXPIRY_MS = FLOOR_TO_FULL_S * 1000 + 1000  # what bucket.lua gives a key at the floor


async def stored(client: aioredis.Redis, key: str) -> tuple[float, int]:
    """A bucket's stored level and the milliseconds its key has left."""
    return float(await client.hget(key, "level")), await client.pttl(key)


@pytest.mark.parametrize("used", [10**18, 10**400], ids=["1e18", "1e400"])
def test_a_huge_usage_leaves_a_bounded_level_wait_and_expiry(
    redis_proc: RedisProcess, used: int
) -> None:
    async def scenario() -> None:
        async with connected(redis_proc) as client:
            limiter = RedisRateLimiter(client)
            _, tokens_key = limiter.keys("acme")
            assert (await limiter.acquire(LIMITS, 400)).allowed
            await limiter.reconcile(LIMITS, charged=400, used=used)
            level, expiry_ms = await stored(client, tokens_key)
            assert level == -1_000.0
            assert EXPIRY_MS - 5_000 < expiry_ms <= EXPIRY_MS
            refused = await limiter.acquire(LIMITS, 1_000)  # the largest request there is
            assert (refused.allowed, refused.reason) == (False, "tokens")
            assert FLOOR_TO_FULL_S - 5 < refused.retry_after_s <= FLOOR_TO_FULL_S
            assert refused.reset_tokens_s <= FLOOR_TO_FULL_S

    asyncio.run(scenario())


def test_a_level_stored_below_the_floor_is_read_as_the_floor(redis_proc: RedisProcess) -> None:
    """A key an earlier gateway left at -2e18 without an expiry: it refuses for no longer
    than two refills, and the next settlement gives it a finite expiry."""

    async def scenario() -> None:
        async with connected(redis_proc) as client:
            limiter = RedisRateLimiter(client)
            _, tokens_key = limiter.keys("acme")
            seconds, micros = await client.time()
            await client.hset(tokens_key, mapping={"level": "-2e18", "at": seconds + micros / 1e6})
            refused = await limiter.acquire(LIMITS, 1_000)
            assert FLOOR_TO_FULL_S - 5 < refused.retry_after_s <= FLOOR_TO_FULL_S
            await limiter.charge(LIMITS, requests=0, tokens=1)
            level, expiry_ms = await stored(client, tokens_key)
            assert level == -1_000.0
            assert 0 < expiry_ms <= EXPIRY_MS

    asyncio.run(scenario())


NOT_COUNTS = [-5, 1e300, float("nan"), "lots", [5], {}, None]


def test_a_usage_that_is_no_count_settles_as_charged(redis_proc: RedisProcess) -> None:
    """Through the limiter the gateway runs: no error, no refund, and no store failure
    counted (a wrong number is not Redis being away)."""
    # a slow refill (a token a minute) keeps the level still while the test runs
    slow = TenantLimits(
        tenant="acme", requests_per_minute=600, tokens_per_minute=1, token_burst=1_000
    )
    errors: list[None] = []

    async def scenario() -> None:
        async with connected(redis_proc) as client:
            clock = ManualClock()
            limiter = ResilientRateLimiter(
                RedisRateLimiter(client),
                fallback=LocalRateLimiter(clock),
                failure_mode="local",
                replicas=1,
                timeout_s=2.0,
                failure_threshold=3,
                cooldown_s=1.0,
                clock=clock,
                on_store_error=lambda: errors.append(None),
                on_mode_change=lambda mode: None,
            )
            _, tokens_key = RedisRateLimiter(client).keys("acme")
            assert (await limiter.acquire(slow, 400)).allowed
            for used in NOT_COUNTS:
                await limiter.reconcile(slow, charged=400, used=used)  # type: ignore[arg-type]
            level, _ = await stored(client, tokens_key)
            assert 600 <= level < 601
            await limiter.reconcile(slow, charged=400, used=10**18)
            assert (await stored(client, tokens_key))[0] == -1_000.0
            assert (limiter.mode, errors) == ("shared", [])

    asyncio.run(scenario())


# --- through the gateway ------------------------------------------------------------------

KEY = "sk-acme-" + secrets.token_hex(8)


@contextlib.contextmanager
def gateway(redis_url: str, usage: dict[str, Any]) -> Iterator[str]:
    backend = ServerThread(FakeUpstream(usage=usage).app)
    with backend:
        settings = parse_settings(
            {
                "redis": {"timeout_ms": 2000},
                "ratelimit": {"slice_s": 0},
                "tenants": [tenant("acme", KEY, tokens_per_minute=1_000)],
                "pools": [{"name": "m", "backends": [{"url": backend.url, "capacity": 100_000}]}],
            }
        )
        with ServerThread(create_app(settings, redis_url=redis_url)) as server:
            yield server.url


def test_a_backend_reporting_a_huge_usage_locks_its_tenant_out_for_two_refills_at_most(
    redis_proc: RedisProcess,
) -> None:
    usage: dict[str, Any] = {"prompt_tokens": 10, "completion_tokens": 10**18}
    # no output limit named: an answer may be as long as the model's context, far more than
    # the tenant's bucket (a usage checked at its source may say as much)
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    tokens_key = "spillgate:ratelimit:{acme}:tokens"
    store = redis.Redis.from_url(redis_proc.url, socket_timeout=5)
    with gateway(redis_proc.url, usage) as url, store:
        headers = {"authorization": f"Bearer {KEY}"}
        with httpx.Client(base_url=url, headers=headers, timeout=10) as client:
            first = client.post("/v1/chat/completions", json=body)
            assert first.status_code == 200, first.text
            deadline = time.monotonic() + 5
            while float(store.hget(tokens_key, "level") or 0) > 0:  # settled after the answer
                assert time.monotonic() < deadline, "the answer was never settled"
                time.sleep(0.02)
            refused = client.post("/v1/chat/completions", json=body)
        assert refused.status_code == 429, refused.text
        assert 0 < int(refused.headers["retry-after"]) <= FLOOR_TO_FULL_S
        assert float(store.hget(tokens_key, "level")) >= -1_000.0
        assert 0 < store.pttl(tokens_key) <= EXPIRY_MS
