"""The shared limiter when Redis dies, stalls and comes back: bounded waits, configured modes."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import TypeVar

import pytest
import redis.asyncio as aioredis

from gateway.clock import ManualClock
from gateway.ratelimit import (
    Decision,
    FailureMode,
    LocalRateLimiter,
    RedisRateLimiter,
    ResilientRateLimiter,
    TenantLimits,
)
from loadtest.procs import RedisProcess, free_port

TIMEOUT_S = 0.05
COOLDOWN_S = 0.2
# Slack for a loaded two-core machine on top of the time budget.
MARGIN_S = 0.25
LIMITS = TenantLimits(tenant="acme", requests_per_minute=12, tokens_per_minute=12_000)

T = TypeVar("T")


@dataclass
class Gateway:
    """One gateway's limiter stack plus what it reported through its callbacks."""

    client: aioredis.Redis
    clock: ManualClock
    limiter: ResilientRateLimiter
    modes: list[str] = field(default_factory=list)
    store_errors: int = 0

    async def timed(self, call: Callable[[], Awaitable[T]]) -> T:
        """Run one call and check it came back within the time budget."""
        started = time.monotonic()
        result = await call()
        assert time.monotonic() - started < TIMEOUT_S + MARGIN_S
        return result

    async def acquire(self, tokens: int = 100) -> Decision:
        return await self.timed(lambda: self.limiter.acquire(LIMITS, tokens))


async def gateway(redis_proc: RedisProcess, failure_mode: FailureMode) -> Gateway:
    """A gateway that has been running a while: connected, script loaded."""
    client = aioredis.Redis.from_url(redis_proc.url, socket_timeout=1, socket_connect_timeout=1)
    await RedisRateLimiter(client).peek(LIMITS)
    clock = ManualClock()
    modes: list[str] = []
    gw: Gateway

    def store_error() -> None:
        gw.store_errors += 1

    limiter = ResilientRateLimiter(
        RedisRateLimiter(client),
        fallback=LocalRateLimiter(clock),
        failure_mode=failure_mode,
        replicas=3,
        timeout_s=TIMEOUT_S,
        failure_threshold=3,
        cooldown_s=COOLDOWN_S,
        clock=clock,
        on_store_error=store_error,
        on_mode_change=modes.append,
    )
    gw = Gateway(client=client, clock=clock, limiter=limiter, modes=modes)
    return gw


async def until_shared(gw: Gateway) -> tuple[Decision, int]:
    """Let the cooldown pass and probe until the limiter is back on Redis (a few tries).

    Returns the decision that found Redis again and how many probes it took.
    """
    for probes in range(1, 11):
        gw.clock.advance(COOLDOWN_S)
        decision = await gw.acquire()
        if gw.limiter.mode == "shared":
            return decision, probes
    raise AssertionError(f"still {gw.limiter.mode} after Redis came back")


def test_local_mode_limits_at_the_replica_share_while_redis_is_down(
    redis_proc: RedisProcess,
) -> None:
    async def scenario() -> None:
        gw = await gateway(redis_proc, "local")
        assert (await gw.acquire()).allowed
        redis_proc.stop()
        decisions = [await gw.acquire() for _ in range(10)]
        # the share is 4 requests, held at a third of the 11 Redis last said were left
        assert [d.allowed for d in decisions] == [True] * 3 + [False] * 7
        assert decisions[-1].reason == "requests"
        assert decisions[0].limit_requests == 4
        assert gw.modes == ["shared", "local"]
        assert gw.store_errors == 3
        assert gw.limiter.circuit_open
        await gw.client.aclose()

    asyncio.run(scenario())


def test_the_share_starts_from_the_level_heard_plus_the_refill_since(
    redis_proc: RedisProcess,
) -> None:
    """Drained, then idle ten minutes: the bucket is full again, and so is the share (4 of
    12), not the 0 last heard; half drained, then idle 15 s: a third of the 6 heard (2)
    plus the share's refill since (1), neither the level heard nor a full share."""

    async def admitted_after(acquired: int, *, idle_s: float) -> tuple[int, list[str]]:
        """What the share admits of 10, Redis stopped after `acquired` and `idle_s`."""
        gw = await gateway(redis_proc, "local")
        heard = [await gw.acquire() for _ in range(acquired)]
        assert heard[-1].remaining_requests == 12 - acquired
        gw.clock.advance(idle_s)
        redis_proc.stop()
        decisions = [await gw.acquire() for _ in range(10)]
        await gw.client.aclose()
        return sum(d.allowed for d in decisions), [d.tenant for d in gw.limiter.degraded()]

    assert asyncio.run(admitted_after(12, idle_s=600)) == (4, ["acme"])
    redis_proc.start()
    assert asyncio.run(admitted_after(6, idle_s=15)) == (3, ["acme"])


def test_shared_limiting_resumes_after_redis_restarts(redis_proc: RedisProcess) -> None:
    async def scenario() -> None:
        gw = await gateway(redis_proc, "local")
        assert (await gw.acquire(1_000)).remaining_tokens == 11_000
        redis_proc.stop()
        for _ in range(5):
            await gw.acquire()
        errors_while_open = gw.store_errors
        gw.clock.advance(COOLDOWN_S / 2)
        await gw.acquire()
        assert gw.store_errors == errors_while_open
        gw.clock.advance(COOLDOWN_S)
        await gw.acquire()
        await gw.acquire()
        assert gw.store_errors == errors_while_open + 1
        assert gw.limiter.circuit_open
        redis_proc.start()
        resumed, probes = await until_shared(gw)
        assert resumed.allowed
        assert resumed.limit_requests == 12
        assert gw.modes == ["shared", "local", "shared"]
        assert gw.limiter.degraded() == []
        assert not gw.limiter.circuit_open
        observed = await RedisRateLimiter(gw.client).peek(LIMITS)
        # Each probe that reached the restarted Redis was debited there, and only there.
        assert 12 - probes <= observed.remaining_requests <= 11
        await gw.client.aclose()

    asyncio.run(scenario())


def test_deny_mode_refuses_as_store_unavailable(redis_proc: RedisProcess) -> None:
    """Refused only once the circuit is open (three failures in a row); before that each
    failed call is answered from the replica's share, as one slow call may be. The
    refusal's Retry-After is what is left of the cooldown."""

    async def scenario() -> None:
        gw = await gateway(redis_proc, "deny")
        redis_proc.stop()
        decisions = [await gw.acquire() for _ in range(5)]
        assert [d.allowed for d in decisions] == [True, True, False, False, False]
        assert all(d.reason == "store_unavailable" for d in decisions[2:])
        assert decisions[-1].retry_after_s == pytest.approx(COOLDOWN_S)
        gw.clock.advance(COOLDOWN_S / 4)
        later = await gw.acquire()
        assert later.retry_after_s == pytest.approx(COOLDOWN_S * 3 / 4)
        peeked = await gw.timed(lambda: gw.limiter.peek(LIMITS))
        assert peeked.reason == "store_unavailable"
        assert gw.modes == ["shared", "local", "deny"]
        await gw.client.aclose()

    asyncio.run(scenario())


def test_allow_mode_admits_but_still_refuses_oversized_requests(
    redis_proc: RedisProcess,
) -> None:
    async def scenario() -> None:
        gw = await gateway(redis_proc, "allow")
        redis_proc.stop()
        admitted = [await gw.acquire() for _ in range(20)]
        assert all(d.allowed for d in admitted)
        oversized = await gw.acquire(12_001)
        assert (oversized.allowed, oversized.reason) == (False, "too_large")
        await gw.timed(lambda: gw.limiter.reconcile(LIMITS, charged=100, used=10))
        assert gw.modes == ["shared", "allow"]
        await gw.client.aclose()

    asyncio.run(scenario())


def test_stalled_redis_costs_at_most_the_time_budget(redis_proc: RedisProcess) -> None:
    """CLIENT PAUSE stalls every client of a live Redis: the slow-store case, for real."""

    async def scenario() -> None:
        gw = await gateway(redis_proc, "local")
        assert (await gw.acquire()).allowed
        admin = aioredis.Redis.from_url(redis_proc.url, socket_timeout=5)
        await admin.execute_command("CLIENT", "PAUSE", 1_000)
        decisions = await gw.timed(
            lambda: asyncio.gather(*(gw.limiter.acquire(LIMITS, 100) for _ in range(8)))
        )
        assert sum(d.allowed for d in decisions) == 3  # a third of the 11 left, at most 4
        assert gw.store_errors == 8
        assert gw.limiter.mode == "local"
        await gw.client.aclose()
        await admin.aclose()

    asyncio.run(scenario())


def test_the_local_share_starts_from_what_redis_last_said(redis_proc: RedisProcess) -> None:
    """A tenant that spent its whole shared bucket gets nothing more from a replica's share
    when Redis goes away: no second admission on top of the shared ones; and what the share
    admits later is charged to the shared bucket once Redis answers again."""

    async def scenario() -> None:
        gw = await gateway(redis_proc, "local")
        spent = [await gw.acquire() for _ in range(12)]
        assert all(d.allowed for d in spent) and spent[-1].remaining_requests == 0
        admin = aioredis.Redis.from_url(redis_proc.url, socket_timeout=5)
        await admin.execute_command("CLIENT", "PAUSE", 400)
        during = [await gw.acquire() for _ in range(3)]
        assert [d.allowed for d in during] == [False] * 3
        assert gw.limiter.mode == "local"
        gw.clock.advance(60.0)  # a minute's refill: 12 requests, a share of 4 of them
        later = [await gw.acquire() for _ in range(5)]
        assert [d.allowed for d in later] == [True] * 4 + [False]
        await asyncio.sleep(0.5)  # Redis answers again
        gw.clock.advance(COOLDOWN_S)
        resumed, _ = await until_shared(gw)
        await asyncio.sleep(0.1)  # the owed charge goes out after the first answer
        assert resumed.allowed is False  # Redis's own clock refilled under one request
        requests_key = RedisRateLimiter(gw.client).keys("acme")[0]
        level = float(await admin.hget(requests_key, "level"))
        assert -4 < level < -3  # the 4 the share admitted, less Redis's refill (0.2 a second)
        await admin.aclose()
        await gw.client.aclose()

    asyncio.run(scenario())


def test_local_share_admits_a_request_the_whole_bucket_holds(redis_proc: RedisProcess) -> None:
    """The share is 4,000 tokens; 6,000 fits the tenant's bucket, so it waits, then is debt."""

    async def scenario() -> None:
        gw = await gateway(redis_proc, "local")
        redis_proc.stop()
        first = await gw.acquire(6_000)
        assert (first.allowed, first.limit_tokens, first.remaining_tokens) == (True, 4_000, 0)
        refused = await gw.acquire(1)
        assert (refused.allowed, refused.reason) == (False, "tokens")
        assert refused.retry_after_s == pytest.approx(2_001 * 60 / 4_000)
        too_large = await gw.acquire(12_001)
        assert (too_large.allowed, too_large.reason) == (False, "too_large")
        await gw.client.aclose()

    asyncio.run(scenario())


def test_a_probe_resumes_shared_limiting_and_charges_what_the_share_admitted(
    redis_proc: RedisProcess,
) -> None:
    """The background probe: while Redis is away it changes nothing (no store error, the
    circuit as it was); a Redis that answers but refuses writes is still away; once Redis
    takes writes the limiter is shared again, as if a decision had found it back."""

    async def scenario() -> None:
        gw = await gateway(redis_proc, "local")
        redis_proc.stop()
        decisions = [await gw.acquire() for _ in range(3)]
        assert [d.allowed for d in decisions] == [True] * 3
        assert (gw.limiter.mode, gw.limiter.circuit_open, gw.store_errors) == ("local", True, 3)
        await gw.timed(gw.limiter.probe)
        assert (gw.limiter.mode, gw.limiter.circuit_open, gw.store_errors) == ("local", True, 3)

        redis_proc.start()  # empty: the buckets are full again
        admin = aioredis.Redis.from_url(redis_proc.url, socket_timeout=5)
        await admin.replicaof("127.0.0.1", free_port())  # read-only; PING still answers
        await gw.timed(gw.limiter.probe)
        assert (gw.limiter.mode, gw.limiter.circuit_open) == ("local", True)

        await admin.replicaof("NO", "ONE")
        await gw.timed(gw.limiter.probe)
        assert (gw.limiter.mode, gw.limiter.circuit_open, gw.store_errors) == ("shared", False, 3)
        assert gw.modes == ["shared", "local", "shared"]
        await asyncio.sleep(0.1)  # the owed charge goes out after the probe's answer
        requests_key, tokens_key = RedisRateLimiter(gw.client).keys("acme")
        assert float(await admin.hget(requests_key, "level")) == 12 - 3
        assert float(await admin.hget(tokens_key, "level")) == 12_000 - 300
        await admin.aclose()
        await gw.limiter.close()
        await gw.client.aclose()

    asyncio.run(scenario())
