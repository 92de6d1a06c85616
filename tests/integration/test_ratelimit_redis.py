"""The shared limiter against a real redis-server: atomic, Redis-timed, refundable."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import pytest
import redis.asyncio as aioredis

from gateway.app import redis_client
from gateway.clock import ManualClock
from gateway.config import parse_settings
from gateway.ratelimit import (
    LocalRateLimiter,
    RedisRateLimiter,
    ResilientRateLimiter,
    TenantLimits,
)
from gateway.ratelimit.redis_limiter import bucket_script
from loadtest.procs import RedisProcess

ROOT = Path(__file__).resolve().parents[2]

# One gateway process's share of a burst: connect, say ready, wait for "go", then fire
# every acquire at once and print the token counts that were admitted.
WORKER = """
import asyncio, json, sys
import redis.asyncio as aioredis
from gateway.ratelimit import RedisRateLimiter, TenantLimits

async def main(spec):
    client = aioredis.Redis.from_url(spec["url"], socket_timeout=5)
    limiter = RedisRateLimiter(client, slice_s=spec["slice_s"])
    limits = TenantLimits(**spec["limits"])
    await client.ping()
    print("ready", flush=True)
    sys.stdin.readline()
    decisions = await asyncio.gather(*(limiter.acquire(limits, n) for n in spec["sizes"]))
    print(json.dumps([n for n, d in zip(spec["sizes"], decisions) if d.allowed]), flush=True)
    await limiter.close()
    await client.aclose()

asyncio.run(main(json.loads(sys.argv[1])))
"""


def burst_from_processes(
    url: str, limits: dict[str, object], sizes: list[list[int]], *, slice_s: float = 0.0
) -> list[int]:
    """Run one worker process per entry of `sizes`, release them together, pool the results."""
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                "-c",
                WORKER,
                json.dumps({"url": url, "limits": limits, "sizes": s, "slice_s": slice_s}),
            ],
            cwd=ROOT,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        for s in sizes
    ]
    try:
        for proc in procs:
            assert proc.stdout is not None
            assert proc.stdout.readline().strip() == "ready"
        for proc in procs:
            assert proc.stdin is not None
            proc.stdin.write("go\n")
            proc.stdin.flush()
        admitted: list[int] = []
        for proc in procs:
            out, _ = proc.communicate(timeout=30)
            assert proc.returncode == 0
            admitted += json.loads(out)
        return admitted
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait(timeout=10)


@asynccontextmanager
async def connected(redis_proc: RedisProcess) -> AsyncIterator[aioredis.Redis]:
    client = aioredis.Redis.from_url(redis_proc.url, socket_timeout=5)
    try:
        yield client
    finally:
        await client.aclose()


def test_three_processes_admit_exactly_the_request_limit(redis_proc: RedisProcess) -> None:
    limits = {"tenant": "acme", "requests_per_minute": 10, "tokens_per_minute": 1_000_000}
    admitted = burst_from_processes(redis_proc.url, limits, [[1] * 67, [1] * 67, [1] * 66])
    assert len(admitted) == 10


def test_admitted_tokens_never_exceed_limit_plus_largest_request(
    redis_proc: RedisProcess,
) -> None:
    sizes = [[10 + (37 * i + 11 * p) % 190 for i in range(67)] for p in range(3)]
    limits = {"tenant": "acme", "requests_per_minute": 100_000, "tokens_per_minute": 2_000}
    admitted = burst_from_processes(redis_proc.url, limits, sizes)
    largest = max(max(s) for s in sizes)
    assert 2_000 - largest <= sum(admitted) <= 2_000 + largest
    assert len(admitted) < sum(len(s) for s in sizes)


def test_three_processes_spending_slices_admit_no_more_than_the_buckets_hold(
    redis_proc: RedisProcess,
) -> None:
    """Slices of 3 requests (6 a second, half a second's worth) taken by three processes at
    once: every slice was debited in Redis first, so the fleet admits at most the burst
    and its refill while the burst ran; and no process strands a slice, since its
    decisions that Redis refused for what was left spend it instead (without that, 57)."""
    limits = {
        "tenant": "acme",
        "requests_per_minute": 360,
        "request_burst": 60,
        "tokens_per_minute": 6_000_000,
    }
    started = time.monotonic()
    admitted = burst_from_processes(
        redis_proc.url, limits, [[1] * 100, [1] * 100, [1] * 100], slice_s=0.5
    )
    refill = 6 * (time.monotonic() - started)
    assert 60 <= len(admitted) <= 60 + refill


def test_a_slice_answers_alone_and_goes_back_when_it_lapses(redis_proc: RedisProcess) -> None:
    limits = TenantLimits(
        tenant="acme",
        requests_per_minute=6_000,
        request_burst=1_000_000,
        tokens_per_minute=600_000,
        token_burst=10_000_000,
    )

    async def stored(client: aioredis.Redis, key: str) -> tuple[float, float]:
        level, at = await client.hmget(key, ["level", "at"])
        return float(level), float(at)

    async def scenario() -> None:
        async with connected(redis_proc) as client:
            limiter = RedisRateLimiter(client, slice_s=0.3)
            requests_key, _ = limiter.keys("acme")
            # far below the bucket's size: the refill while the test runs does not fill it
            await limiter.charge(limits, requests=500_000, tokens=0)
            first = await limiter.acquire(limits, 1)
            # the decision took a slice, 0.3 s of refill: 30 requests and 3,000 tokens
            level, at = await stored(client, requests_key)
            assert 500_000 - 1 - 30 <= level < 500_000 - 1 - 30 + 10
            assert first.remaining_requests == int(level) + 30
            assert first.remaining_tokens == 9_999_999
            calls = limiter._batch.calls
            for _ in range(10):
                decision = await limiter.acquire(limits, 1)
            assert limiter._batch.calls == calls  # ten decisions, no round trip
            assert decision.remaining_requests == first.remaining_requests - 10
            assert decision.remaining_tokens == 9_999_989
            await limiter.reconcile(limits, reserved=1, used=0)  # refunded into the slice
            assert limiter._batch.calls == calls
            await asyncio.sleep(0.5)  # lapsed: the 20 requests left went back
            assert not limiter._slices
            back, later = await stored(client, requests_key)
            assert back == pytest.approx(level + (later - at) * 100 + 20)

    asyncio.run(scenario())


def test_a_tight_bucket_yields_no_slice(redis_proc: RedisProcess) -> None:
    """Under one request per slice_s, or a bucket nearly empty: each request asks Redis."""
    limits = TenantLimits(tenant="acme", requests_per_minute=60, tokens_per_minute=600_000)

    async def scenario() -> None:
        async with connected(redis_proc) as client:
            limiter = RedisRateLimiter(client, slice_s=0.5)
            decisions = [await limiter.acquire(limits, 1) for _ in range(61)]
            assert sum(d.allowed for d in decisions) == 60
            assert limiter._batch.calls == 61

    asyncio.run(scenario())


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


def test_unused_reservation_is_refunded(redis_proc: RedisProcess) -> None:
    # A slow refill (10 tokens/s) so the figures do not drift while the test runs.
    limits = TenantLimits(
        tenant="acme", requests_per_minute=60, tokens_per_minute=600, token_burst=10_000
    )

    async def scenario() -> None:
        async with connected(redis_proc) as client:
            limiter = RedisRateLimiter(client)
            assert (await limiter.acquire(limits, 4_000)).remaining_tokens == 6_000
            await limiter.reconcile(limits, reserved=4_000, used=50)
            assert 9_950 <= (await limiter.peek(limits)).remaining_tokens <= 9_952
            headers = dict((await limiter.acquire(limits, 0)).headers())
            assert 9_950 <= int(headers[b"x-ratelimit-remaining-tokens"]) <= 9_952

    asyncio.run(scenario())


def test_usage_beyond_the_reservation_is_charged_as_debt(redis_proc: RedisProcess) -> None:
    limits = TenantLimits(tenant="acme", requests_per_minute=60, tokens_per_minute=1_000)

    async def scenario() -> None:
        async with connected(redis_proc) as client:
            limiter = RedisRateLimiter(client)
            assert (await limiter.acquire(limits, 1_000)).allowed
            await limiter.reconcile(limits, reserved=1_000, used=1_500)
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
    ids=["decision", "decision and its slice"],
)
def test_a_decision_made_after_its_caller_gave_up_is_refunded(
    redis_proc: RedisProcess,
    slice_s: float,
    limits: TenantLimits,
    first: int,
    left: tuple[int, int],
) -> None:
    """Cut by its time budget while Redis was paused, the decision still ran in Redis once
    the pause ended: nobody used that admission, so it is given back, with any slice it took."""

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
        assert not limiter._slices
        peeked = await limiter.peek(limits)
        assert (peeked.remaining_requests, peeked.remaining_tokens) == left
        await client.aclose()
        await admin.aclose()

    asyncio.run(scenario())
