"""The shared limiter's buckets in a real redis-server: timed by Redis, refilled, refunded,
charged as debt, keyed and reloaded, and a decision debited once however often it is sent
or however late its caller gave up."""

from __future__ import annotations

import asyncio

import pytest
import redis.asyncio as aioredis

from gateway.clock import ManualClock
from gateway.config import parse_settings
from gateway.ratelimit import (
    LocalRateLimiter,
    RedisRateLimiter,
    ResilientRateLimiter,
    TenantLimits,
)
from gateway.ratelimit.redis_limiter import bucket_script
from gateway.shared_mode import redis_client
from loadtest.procs import RedisProcess
from tests.support.ratelimit import connected


def test_gateway_clocks_do_not_move_the_buckets(redis_proc: RedisProcess) -> None:
    """Two gateways whose clocks are an hour apart share one bucket timed by Redis."""
    limits = TenantLimits(tenant="acme", requests_per_minute=6, tokens_per_minute=10_000)

    async def scenario() -> None:
        async with connected(redis_proc) as client:
            ahead, behind = ManualClock(start=10_000.0), ManualClock(start=6_400.0)
            gateways = [shared_limiter(client, clock) for clock in (ahead, behind)]
            admitted = [await gateways[i % 2].acquire(limits, 1) for i in range(12)]
            assert sum(d.allowed for d in admitted) == 6
            ahead.advance(3_600)
            behind.advance(-3_600)
            assert not (await gateways[0].acquire(limits, 1)).allowed
            assert not (await gateways[1].acquire(limits, 1)).allowed
            assert all(g.mode == "shared" for g in gateways)
            seconds, micros = await client.time()
            stored = await client.hget(RedisRateLimiter(client).keys("acme")[0], "at")
            assert abs(float(stored) - (seconds + micros / 1e6)) < 5

    asyncio.run(scenario())


def shared_limiter(client: aioredis.Redis, clock: ManualClock) -> ResilientRateLimiter:
    return ResilientRateLimiter(
        RedisRateLimiter(client),
        fallback=LocalRateLimiter(clock),
        failure_mode="deny",
        replicas=2,
        timeout_s=2.0,
        failure_threshold=3,
        cooldown_s=1.0,
        clock=clock,
        on_store_error=lambda: None,
        on_mode_change=lambda mode: None,
    )


def test_buckets_refill_as_redis_time_passes(redis_proc: RedisProcess) -> None:
    limits = TenantLimits(
        tenant="acme", requests_per_minute=600, tokens_per_minute=10_000, request_burst=3
    )

    async def scenario() -> None:
        async with connected(redis_proc) as client:
            limiter = RedisRateLimiter(client)
            decisions = [await limiter.acquire(limits, 0) for _ in range(4)]
            while decisions[-1].allowed and len(decisions) < 50:
                decisions.append(await limiter.acquire(limits, 0))
            refused = decisions[-1]
            assert (refused.allowed, refused.reason) == (False, "requests")
            assert 0 < refused.retry_after_s <= 0.1
            await asyncio.sleep(refused.retry_after_s + 0.05)
            assert (await limiter.acquire(limits, 0)).allowed

    asyncio.run(scenario())


def test_an_unused_charge_is_refunded(redis_proc: RedisProcess) -> None:
    # A slow refill (10 tokens/s) so the figures do not drift while the test runs.
    limits = TenantLimits(
        tenant="acme", requests_per_minute=60, tokens_per_minute=600, token_burst=10_000
    )

    async def scenario() -> None:
        async with connected(redis_proc) as client:
            limiter = RedisRateLimiter(client)
            assert (await limiter.acquire(limits, 4_000)).remaining_tokens == 6_000
            await limiter.reconcile(limits, charged=4_000, used=50)
            assert 9_950 <= (await limiter.peek(limits)).remaining_tokens <= 9_952
            headers = dict((await limiter.acquire(limits, 0)).headers())
            assert 9_950 <= int(headers[b"x-ratelimit-remaining-tokens"]) <= 9_952

    asyncio.run(scenario())


def test_usage_beyond_the_charge_is_charged_as_debt(redis_proc: RedisProcess) -> None:
    limits = TenantLimits(tenant="acme", requests_per_minute=60, tokens_per_minute=1_000)

    async def scenario() -> None:
        async with connected(redis_proc) as client:
            limiter = RedisRateLimiter(client)
            assert (await limiter.acquire(limits, 1_000)).allowed
            await limiter.reconcile(limits, charged=1_000, used=1_500)
            refused = await limiter.acquire(limits, 0)
            assert (refused.allowed, refused.reason, refused.remaining_tokens) == (
                False,
                "tokens",
                0,
            )
            assert 29 < refused.retry_after_s <= 30

    asyncio.run(scenario())


def test_too_large_request_is_refused_without_debit(redis_proc: RedisProcess) -> None:
    limits = TenantLimits(
        tenant="acme", requests_per_minute=60, tokens_per_minute=8_000, token_burst=4_000
    )

    async def scenario() -> None:
        async with connected(redis_proc) as client:
            limiter = RedisRateLimiter(client)
            refused = await limiter.acquire(limits, 4_001)
            assert (refused.allowed, refused.reason, refused.retry_after_s) == (
                False,
                "too_large",
                0.0,
            )
            assert (refused.remaining_requests, refused.remaining_tokens) == (60, 4_000)
            assert await client.keys("*") == []

    asyncio.run(scenario())


def test_script_is_reloaded_after_script_flush(redis_proc: RedisProcess) -> None:
    limits = TenantLimits(tenant="acme", requests_per_minute=60, tokens_per_minute=10_000)

    async def scenario() -> None:
        async with connected(redis_proc) as client:
            limiter = RedisRateLimiter(client)
            assert (await limiter.acquire(limits, 100)).allowed
            await client.script_flush()
            second = await limiter.acquire(limits, 100)
            assert second.allowed
            assert second.remaining_requests == 58
            assert 9_800 <= second.remaining_tokens < 9_900

    asyncio.run(scenario())


def test_keys_share_a_hash_tag_and_expire_when_full(redis_proc: RedisProcess) -> None:
    limits = TenantLimits(tenant="acme", requests_per_minute=60, tokens_per_minute=6_000)

    async def scenario() -> None:
        async with connected(redis_proc) as client:
            limiter = RedisRateLimiter(client, key_prefix="sg")
            await limiter.acquire(limits, 300)
            requests_key, tokens_key = limiter.keys("acme")
            assert (requests_key, tokens_key) == (
                "sg:ratelimit:{acme}:requests",
                "sg:ratelimit:{acme}:tokens",
            )
            assert 1_000 < await client.pttl(requests_key) <= 2_000
            assert 3_000 < await client.pttl(tokens_key) <= 4_000

    asyncio.run(scenario())


def test_a_restarted_redis_fails_no_call_on_a_stale_pooled_connection() -> None:
    """After a restart every idle pooled connection is dead. The gateway's client reconnects
    one on first use instead of failing that call, which would have sent the limiter into
    its failure mode (and the request to the local share) once per pooled connection."""
    settings = parse_settings({
        "tenants": [{"name": "acme", "key_sha256": "0" * 64}],
        "pools": [{"name": "p", "backends": [{"url": "http://127.0.0.1:9", "capacity": 1}]}],
        "redis": {"timeout_ms": 2000},
    })  # fmt: skip
    limits = TenantLimits(tenant="acme", requests_per_minute=600, tokens_per_minute=100_000)

    async def scenario(server: RedisProcess) -> None:
        client = redis_client(settings, server.url)
        limiter = RedisRateLimiter(client)
        try:
            # at once, so the pool opens a connection for each
            first = await asyncio.gather(*(limiter.acquire(limits, 10) for _ in range(8)))
            assert all(d.allowed for d in first)
            server.restart()  # same port, empty
            again = await asyncio.gather(*(limiter.acquire(limits, 10) for _ in range(8)))
            assert all(d.allowed for d in again)
            assert {d.remaining_requests for d in again} == set(range(592, 600))  # buckets new
        finally:
            await client.aclose()

    with RedisProcess() as server:
        asyncio.run(scenario(server))


def test_a_decision_sent_twice_debits_once(redis_proc: RedisProcess) -> None:
    """A retry after a lost connection sends the same decision again: its id makes the
    second one a no-op, and a refund gives back that one admission, once."""

    async def scenario() -> None:
        client = aioredis.Redis.from_url(redis_proc.url, socket_timeout=5)
        limiter = RedisRateLimiter(client, key_prefix="twice")
        limits = TenantLimits(tenant="t", requests_per_minute=1, tokens_per_minute=1_000)
        script = client.register_script(bucket_script())
        requests, tokens = limiter.keys("t")
        keys = [requests, tokens, "twice:ratelimit:{t}:decided:x:1"]
        args = ["acquire", 1, 1, 1, 1_000, 300]
        first, second = [await script(keys=keys, args=args) for _ in range(2)]
        assert (first[0], second[0]) == (0, 0)
        assert [float(await client.hget(k, "level")) for k in (requests, tokens)] == [0, 700]
        refund = ["refund", *args[1:]]
        await script(keys=keys, args=refund)
        await script(keys=keys, args=refund)
        assert (await limiter.peek(limits)).remaining_tokens == 1_000
        assert (await limiter.peek(limits)).remaining_requests == 1
        await client.aclose()

    asyncio.run(scenario())


SLOW = TenantLimits(
    tenant="t", requests_per_minute=1, request_burst=2, tokens_per_minute=1, token_burst=1_000
)
SLICED = TenantLimits(tenant="t", requests_per_minute=600, tokens_per_minute=60_000)


@pytest.mark.parametrize(
    ("slice_s", "limits", "first", "left"),
    [(0.0, SLOW, 100, (1, 900)), (0.5, SLICED, 0, (600, 60_000))],
    ids=["decision", "decision and its grant"],
)
def test_a_decision_made_after_its_caller_gave_up_is_refunded(
    redis_proc: RedisProcess,
    slice_s: float,
    limits: TenantLimits,
    first: int,
    left: tuple[int, int],
) -> None:
    """Cut by its time budget while Redis was paused, the decision still ran in Redis once
    the pause ended: nobody used that admission, so it is given back, with any grant it took."""

    async def scenario() -> None:
        client = aioredis.Redis.from_url(redis_proc.url, socket_timeout=5)
        admin = aioredis.Redis.from_url(redis_proc.url, socket_timeout=5)
        limiter = RedisRateLimiter(client, key_prefix="late", slice_s=slice_s)
        if first:
            assert (await limiter.acquire(limits, first)).remaining_tokens == 1_000 - first
        await admin.execute_command("CLIENT", "PAUSE", 300)
        try:
            async with asyncio.timeout(0.05):
                await limiter.acquire(limits, 200)
            raise AssertionError("the paused Redis answered")
        except TimeoutError:
            pass
        await asyncio.sleep(0.6)  # the pause ends, the decision runs, its refund follows
        assert limiter.late_refunds == 1
        assert not limiter._grants
        peeked = await limiter.peek(limits)
        assert (peeked.remaining_requests, peeked.remaining_tokens) == left
        await client.aclose()
        await admin.aclose()

    asyncio.run(scenario())
