"""The shared in-flight ledger on a real redis-server: one budget, leases, drift, failover."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any

import redis.asyncio as aioredis

from gateway.admission.ledger.calls import ledger_script
from gateway.admission.ledger.reservations import Reservation
from gateway.admission.ledger.shared import RedisLedger
from gateway.clock import ManualClock, SystemClock
from loadtest.procs import RedisProcess

TIMEOUT_S = 0.05
MARGIN_S = 0.25  # slack for a loaded two-core machine on top of the time budget


def client(redis_proc: RedisProcess, timeout_s: float = TIMEOUT_S) -> aioredis.Redis:
    return aioredis.Redis.from_url(
        redis_proc.url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s
    )


@asynccontextmanager
async def replicas(
    redis_proc: RedisProcess, count: int, **options: Any
) -> AsyncIterator[list[RedisLedger]]:
    """`count` ledgers, each with its own connection pool, as separate replicas have."""
    opts: dict[str, Any] = {"clock": SystemClock(), "timeout_s": TIMEOUT_S, **options}
    clients = [client(redis_proc, opts["timeout_s"]) for _ in range(count)]
    ledgers = [RedisLedger(c, backends=["b0", "b1"], **opts) for c in clients]
    try:
        yield ledgers
    finally:
        for ledger in ledgers:
            await ledger.close()
        for c in clients:
            await c.aclose()


async def eventually(check: Callable[[], Awaitable[bool]], *, within: float) -> float:
    """Seconds until `check()` held; fails after `within`."""
    started = time.monotonic()
    while not await check():
        assert time.monotonic() - started < within, "condition never held"
        await asyncio.sleep(0.02)
    return time.monotonic() - started


def test_replicas_share_one_budget_and_never_go_past_it(redis_proc: RedisProcess) -> None:
    async def scenario() -> None:
        async with replicas(redis_proc, 3, timeout_s=2.0) as ledgers:
            attempts = [
                ledger.reserve("b0", 100, limit=1000) for ledger in ledgers for _ in range(20)
            ]
            granted = [r for r in await asyncio.gather(*attempts) if r is not None]
            assert len(granted) == 10
            for ledger in ledgers:
                await ledger.refresh()
                assert ledger.snapshot()["b0"] == (1000, 10)
            owner = {
                r.id: ledger
                for ledger in ledgers
                for r in granted
                if r.id.startswith(ledger.replica_id)
            }
            for r in granted:
                await owner[r.id].release(r)
                await owner[r.id].release(r)  # twice: a no-op
            stranger = Reservation("b0", 100, granted[0].id)
            await ledgers[0].release(stranger)  # not held here: a no-op as well
            await ledgers[0].refresh()
            assert ledgers[0].snapshot() == {"b0": (0, 0), "b1": (0, 0)}

    asyncio.run(scenario())


def test_a_dead_replicas_leases_expire_within_the_ttl(redis_proc: RedisProcess) -> None:
    """A replica that stops renewing (kill -9) frees its tokens when its leases run out."""

    async def scenario() -> None:
        async with replicas(redis_proc, 2, lease_ttl_s=0.3, refresh_s=0.05) as (dead, alive):
            held = await dead.reserve("b0", 700, limit=1000)
            assert held is not None
            await alive.start()
            assert alive.tokens_in_flight("b0") == 700
            assert await alive.reserve("b0", 400, limit=1000) is None

            async def freed() -> bool:
                return alive.tokens_in_flight("b0") == 0

            await eventually(freed, within=0.3 + MARGIN_S)
            assert await alive.reserve("b0", 400, limit=1000) is not None

    asyncio.run(scenario())


def test_the_holder_renews_its_leases_while_they_stream(redis_proc: RedisProcess) -> None:
    async def scenario() -> None:
        async with replicas(redis_proc, 2, lease_ttl_s=0.3, refresh_s=0.05) as (holder, other):
            await holder.start()
            held = await holder.reserve("b1", 250, limit=1000)
            assert held is not None
            await asyncio.sleep(1.0)  # three TTLs
            await other.refresh()
            assert other.snapshot()["b1"] == (250, 1)
            await holder.release(held)
            await other.refresh()
            assert other.snapshot()["b1"] == (0, 0)

    asyncio.run(scenario())


def test_totals_are_counted_from_the_live_leases(redis_proc: RedisProcess) -> None:
    """Orphans, strays and a lost meta key never skew the totals: every call counts them
    from the live leases, and drops what has no lease."""

    async def scenario() -> None:
        async with replicas(redis_proc, 1) as (ledger,):
            leases, tokens, usage, meta = ledger.keys("b0")
            first = await ledger.reserve("b0", 300, limit=1000)
            second = await ledger.reserve("b0", 200, limit=1000)
            assert first is not None and second is not None
            admin = client(redis_proc)
            for damage in (
                admin.zadd(leases, {"orphan": time.time() * 1000 + 60_000}),  # no tokens
                admin.hset(tokens, "stray", 4000),  # tokens without a lease
                admin.hset(usage, "stray", "4000 9"),
                admin.delete(meta),
            ):
                await damage
                await ledger.refresh()
                assert ledger.snapshot()["b0"] == (500, 2)
            await admin.hset(tokens, "stray", 4000)
            third = await ledger.reserve("b0", 500, limit=1000)  # the stray never counts
            assert third is not None
            assert ledger.snapshot()["b0"] == (1000, 3)
            for reservation in (first, second, third):
                await ledger.release(reservation)
            await ledger.refresh()
            assert ledger.snapshot()["b0"] == (0, 0)
            assert await admin.exists(leases, tokens, usage) == 0
            await admin.aclose()

    asyncio.run(scenario())


def test_dead_redis_fails_over_to_the_replica_share_and_recovers(
    redis_proc: RedisProcess,
) -> None:
    async def scenario() -> None:
        modes: list[str] = []
        errors: list[None] = []
        clock = ManualClock()
        async with replicas(
            redis_proc,
            1,
            clock=clock,
            fallback_share=2,
            on_mode_change=modes.append,
            on_store_error=lambda: errors.append(None),
        ) as (ledger,):
            before = await ledger.reserve("b0", 300, limit=1000)
            assert before is not None
            redis_proc.stop()
            started = time.monotonic()
            refused = await ledger.reserve("b0", 300, limit=1000)  # 600 > 1000 / 2
            assert time.monotonic() - started < TIMEOUT_S + MARGIN_S
            assert refused is None
            assert ledger.mode == "local"
            during = await ledger.reserve("b0", 200, limit=1000)
            assert during is not None
            assert ledger.snapshot()["b0"] == (1000, 4)  # own 500 tokens × the share of 2
            await ledger.release(before)  # Redis cannot hear it now: retried later
            assert await ledger.refresh() is False
            assert len(errors) == 2  # the failed reserve and the failed refresh only
            redis_proc.start()  # empty: the restart lost every lease
            assert await ledger.refresh() is True
            assert modes == ["shared", "local", "shared"]
            assert ledger.snapshot()["b0"] == (200, 1)  # restored from what is still held
            admin = client(redis_proc)
            assert await admin.zrange(ledger.keys("b0")[0], 0, -1) == [ledger.replica_id.encode()]
            # just after recovery the share still caps admission, until all have restored
            assert await ledger.reserve("b0", 400, limit=1000) is None
            clock.advance(1.0)
            assert await ledger.reserve("b0", 400, limit=1000) is not None
            await admin.aclose()

    asyncio.run(scenario())


def test_a_stalled_redis_costs_at_most_the_time_budget(redis_proc: RedisProcess) -> None:
    """CLIENT PAUSE stalls every client of a live Redis: calls give up, nothing leaks."""

    async def scenario() -> None:
        async with replicas(redis_proc, 1, fallback_share=1) as (ledger,):
            admin = aioredis.Redis.from_url(redis_proc.url, socket_timeout=5)
            await admin.execute_command("CLIENT", "PAUSE", 600)
            started = time.monotonic()
            held = await asyncio.gather(*(ledger.reserve("b1", 100, limit=500) for _ in range(8)))
            assert time.monotonic() - started < TIMEOUT_S + MARGIN_S
            assert sum(r is not None for r in held) == 5
            assert ledger.mode == "local"
            for r in held:
                if r is not None:
                    await ledger.release(r)
            await asyncio.sleep(0.7)
            assert await ledger.refresh() is True
            assert ledger.snapshot()["b1"] == (0, 0)
            await admin.aclose()

    asyncio.run(scenario())


def test_an_extension_is_shared_passes_the_limit_and_is_released_whole(
    redis_proc: RedisProcess,
) -> None:
    async def scenario() -> None:
        async with replicas(redis_proc, 2, timeout_s=2.0) as (holder, other):
            held = await holder.reserve("b0", 600, limit=1000)
            assert held is not None
            grown = await holder.extend(held, 300)
            assert grown == Reservation("b0", 900, held.id)
            grown = await holder.extend(held, 200)  # running already: past the limit
            assert grown.tokens == 1100
            assert holder.snapshot()["b0"] == (1100, 1)  # counted here at once
            await holder.refresh()  # in Redis with the next refresh
            await other.refresh()
            assert other.snapshot()["b0"] == (1100, 1)
            assert await other.reserve("b0", 16, limit=1000) is None  # new ones see it
            _, tokens, usage, _ = holder.keys("b0")
            admin = client(redis_proc)
            assert await admin.hget(usage, holder.replica_id) == b"1100 1"
            assert int(await admin.hget(tokens, holder.replica_id)) == 1100  # no spare: full
            await holder.release(held)  # as admitted: the lease gives back all it grew to
            await other.refresh()
            assert other.snapshot()["b0"] == (0, 0)
            assert holder.snapshot()["b0"] == (0, 0)
            assert await holder.extend(held, 100) == held  # released: nothing to grow
            await other.refresh()
            assert other.snapshot()["b0"] == (0, 0)
            await admin.aclose()

    asyncio.run(scenario())


def test_a_grown_lease_the_store_lost_is_restored_grown(redis_proc: RedisProcess) -> None:
    """Every refresh carries what the block's requests hold: a restarted Redis, or one
    that missed a growth, gets the grown figure back."""

    async def scenario() -> None:
        options = {"timeout_s": 2.0, "lease_ttl_s": 0.3, "refresh_s": 0.1}
        async with replicas(redis_proc, 1, **options) as (ledger,):
            held = await ledger.reserve("b1", 100, limit=1000)
            assert held is not None
            await ledger.extend(held, 50)
            admin = client(redis_proc)
            _, _, usage, _ = ledger.keys("b1")
            mine = ledger.replica_id
            await ledger.refresh()
            assert await admin.hget(usage, mine) == b"150 1"
            await admin.hset(usage, mine, "100 1")  # as if that refresh never arrived
            await ledger.refresh()
            assert await admin.hget(usage, mine) == b"150 1"
            for key in ledger.keys("b1"):
                await admin.delete(key)  # as if Redis restarted empty
            await ledger.refresh()
            assert await admin.hget(usage, mine) == b"150 1"
            assert ledger.snapshot()["b1"] == (150, 1)
            await ledger.release(held)
            assert ledger.snapshot()["b1"] == (0, 0)
            await admin.aclose()

    asyncio.run(scenario())


async def script_calls(admin: aioredis.Redis) -> int:
    """Script calls Redis has run so far (every ledger call is one EVALSHA)."""
    stats = await admin.info("commandstats")
    return int(stats.get("cmdstat_evalsha", {}).get("calls", 0))


def test_a_block_admits_its_replicas_requests_without_a_call(redis_proc: RedisProcess) -> None:
    """The first reservation asks Redis and gets a block with spare: an eighth of the room
    left. Requests within it are admitted and released with no call at all."""

    async def scenario() -> None:
        async with replicas(redis_proc, 1, timeout_s=2.0) as (ledger,):
            admin = client(redis_proc)
            first = await ledger.reserve("b0", 100, limit=10_000)
            assert first is not None
            _, tokens, _, _ = ledger.keys("b0")
            assert int(await admin.hget(tokens, ledger.replica_id)) == 100 + 9_900 // 8
            before = await script_calls(admin)
            for _ in range(3):
                held = await asyncio.gather(
                    *(ledger.reserve("b0", 100, limit=10_000) for _ in range(10))
                )
                assert all(r is not None for r in held)
                assert ledger.snapshot()["b0"] == (1100, 11)
                for reservation in held:
                    assert reservation is not None
                    await ledger.release(reservation)
            assert await script_calls(admin) == before
            await ledger.release(first)
            await ledger.refresh()  # no session left: the block goes
            assert await admin.exists(tokens) == 0
            await admin.aclose()

    asyncio.run(scenario())


def test_a_refusal_withholds_every_spare_until_the_room_is_found(
    redis_proc: RedisProcess,
) -> None:
    """B's 300 fit under the limit only without A's spare: Redis refuses it and withholds
    spare from every block, A's next call gives its spare back, and B's ask then fits."""

    async def scenario() -> None:
        async with replicas(redis_proc, 2, timeout_s=2.0) as (a, b):
            held = await a.reserve("b0", 600, limit=900)
            assert held is not None
            _, tokens, _, _ = a.keys("b0")
            admin = client(redis_proc)
            assert int(await admin.hget(tokens, a.replica_id)) == 600 + 300 // 8
            assert await b.reserve("b0", 300, limit=900) is None
            await a.refresh()
            assert int(await admin.hget(tokens, a.replica_id)) == 600
            fits = await b.reserve("b0", 300, limit=900)
            assert fits is not None
            assert int(await admin.hget(tokens, b.replica_id)) == 300  # no spare meanwhile
            await a.refresh()
            assert a.snapshot()["b0"] == (900, 2)
            await admin.aclose()

    asyncio.run(scenario())


def test_with_no_spare_every_admission_and_release_asks_redis(redis_proc: RedisProcess) -> None:
    """`ledger.spare: 0`: a block is exactly its requests, as exact at the margin as one
    process, at a call per admission and per release."""

    async def scenario() -> None:
        async with replicas(redis_proc, 2, timeout_s=2.0, spare=0.0) as (a, b):
            admin = client(redis_proc)
            await admin.script_load(ledger_script())  # no first call refused for want of it
            before = await script_calls(admin)
            held = [await a.reserve("b0", 100, limit=1000) for _ in range(6)]
            assert all(r is not None for r in held)
            assert await b.reserve("b0", 400, limit=1000) is not None  # the room left, all of it
            for reservation in held:
                assert reservation is not None
                await a.release(reservation)
            assert await script_calls(admin) - before == 6 + 1 + 6
            await admin.aclose()

    asyncio.run(scenario())
