"""The shared limiter against a real redis-server: gateway processes bursting at once admit
no more than the buckets hold, whether they ask Redis each time or spend grants of a
tenant's refill. Its accounting is test_ratelimit_redis_buckets.py's."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
import redis.asyncio as aioredis

from gateway.ratelimit import RedisRateLimiter, TenantLimits
from loadtest.procs import RedisProcess
from tests.support.ratelimit import connected

ROOT = Path(__file__).resolve().parents[4]

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


def test_three_processes_spending_grants_admit_no_more_than_the_buckets_hold(
    redis_proc: RedisProcess,
) -> None:
    """Grants of 3 requests (6 a second, half a second's worth) taken by three processes at
    once: every grant was debited in Redis first, so the fleet admits at most the burst
    and its refill while the burst ran; and no process strands a grant, since its
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


def test_a_grant_answers_alone_and_goes_back_when_it_lapses(redis_proc: RedisProcess) -> None:
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
            # the decision took a grant, 0.3 s of refill: 30 requests and 3,000 tokens
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
            await limiter.reconcile(limits, charged=1, used=0)  # refunded into the grant
            assert limiter._batch.calls == calls
            await asyncio.sleep(0.5)  # lapsed: the 20 requests left went back
            assert not limiter._grants
            back, later = await stored(client, requests_key)
            assert back == pytest.approx(level + (later - at) * 100 + 20)

    asyncio.run(scenario())


def test_a_tight_bucket_yields_no_grant(redis_proc: RedisProcess) -> None:
    """Under one request per slice_s, or a bucket nearly empty: each request asks Redis."""
    limits = TenantLimits(tenant="acme", requests_per_minute=60, tokens_per_minute=600_000)

    async def scenario() -> None:
        async with connected(redis_proc) as client:
            limiter = RedisRateLimiter(client, slice_s=0.5)
            decisions = [await limiter.acquire(limits, 1) for _ in range(61)]
            assert sum(d.allowed for d in decisions) == 60
            assert limiter._batch.calls == 61

    asyncio.run(scenario())
