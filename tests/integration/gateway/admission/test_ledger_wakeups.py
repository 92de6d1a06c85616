"""Queue wake-ups across replicas: a release on one wakes the waiters of the others."""

from __future__ import annotations

import asyncio
import random
import secrets
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import httpx
import redis
import redis.asyncio as aioredis

from gateway.admission.fleet.backends import build_pools
from gateway.admission.ledger.shared import RedisLedger
from gateway.admission.routing.route import Route
from gateway.admission.routing.router import Router
from gateway.app import create_app
from gateway.clock import SystemClock
from gateway.config import parse_settings
from gateway.shared.ledger_feed import ReleaseFeed
from loadtest.procs import RedisProcess
from loadtest.sim.app import create_sim_app
from loadtest.sim.config import SimConfig
from tests.support.fleet import tenant
from tests.support.harness import ServerThread
from tests.support.metrics import metric_sum

TIMEOUT_S = 0.5
POLL_S = 0.05
SETTINGS = parse_settings(
    {
        "tenants": [{"name": "t", "key_env": "K"}],
        "pools": [
            {
                "name": "p",
                "backends": [{"url": "http://127.0.0.1:9", "capacity": 1000, "block_size": 1}],
            }
        ],
    }
)


@dataclass
class Replica:
    ledger: RedisLedger
    router: Router
    feed: ReleaseFeed
    woken: list[tuple[str, int]] = field(default_factory=list)  # (pool, tokens in flight then)

    async def reserve(self, tokens: int) -> Any:
        return await self.router.reserve(Route("p", tokens))


@asynccontextmanager
async def replicas(redis_proc: RedisProcess, count: int) -> AsyncIterator[list[Replica]]:
    made: list[Replica] = []
    clients: list[aioredis.Redis] = []
    for _ in range(count):
        redis = aioredis.Redis.from_url(
            redis_proc.url, socket_timeout=TIMEOUT_S, socket_connect_timeout=TIMEOUT_S
        )
        clock = SystemClock()
        ledger = RedisLedger(
            redis, backends=["p-0"], clock=clock, lease_ttl_s=0.6, refresh_s=0.05, timeout_s=0.5
        )
        router = Router(build_pools(SETTINGS.pools, clock=clock), ledger=ledger, clock=clock)
        feed = ReleaseFeed(redis, ledger=ledger, waker=router, timeout_s=TIMEOUT_S, poll_s=POLL_S)
        replica = Replica(ledger=ledger, router=router, feed=feed)
        router.on_release(_recorder(replica))
        await ledger.start()
        await feed.start()
        made.append(replica)
        clients.append(redis)
    try:
        for replica in made:
            await until(lambda r=replica: r.feed.subscribed)  # type: ignore[misc]
        for replica in made:
            replica.woken.clear()
        yield made
    finally:
        for replica in made:
            await replica.feed.stop()
            await replica.ledger.close()
        for redis in clients:
            await redis.aclose()


def _recorder(replica: Replica) -> Callable[[str], None]:
    def record(pool: str) -> None:
        replica.woken.append((pool, replica.ledger.tokens_in_flight("p-0")))

    return record


async def until(check: Callable[[], bool], *, within: float = 3.0) -> None:
    deadline = time.monotonic() + within
    while not check():
        assert time.monotonic() < deadline, "condition never held"
        await asyncio.sleep(0.01)


def test_a_release_wakes_the_other_replicas_with_the_room_already_seen(
    redis_proc: RedisProcess,
) -> None:
    async def scenario() -> None:
        async with replicas(redis_proc, 3) as (a, b, c):
            big = await a.reserve(600)
            small = await b.reserve(200)
            assert big is not None and small is not None
            await a.router.release(big)
            await until(lambda: bool(b.woken) and bool(c.woken))
            # the snapshot already held the room when the waiters were woken
            assert b.woken[0] == ("p", 200)
            assert c.woken[0] == ("p", 200)
            assert a.woken == [("p", 200)]  # its own release, once: not again from the channel
            await b.router.release(small)
            await until(lambda: len(a.woken) == 2 and len(c.woken) == 2)
            assert len(b.woken) == 2
            assert a.woken[1] == c.woken[1] == ("p", 0)

    asyncio.run(scenario())


def test_room_held_spare_elsewhere_comes_back_when_a_replica_is_refused(
    redis_proc: RedisProcess,
) -> None:
    """A's block holds a spare beyond its 600 tokens; B's 300 fit the limit of 900 only
    without it. B's refusal is published, A gives its spare back, and that wakes B."""

    async def scenario() -> None:
        async with replicas(redis_proc, 2) as (a, b):
            held = await a.reserve(600)
            assert held is not None
            assert await b.reserve(300) is None
            await until(lambda: bool(b.woken))
            assert await b.reserve(300) is not None
            # a's requests kept their room: a sees its own 600, plus b's 300 once a refresh
            # has told it (on a loaded machine one may come first); had the spare taken
            # its requests' room, a would see b's 300 alone
            assert a.ledger.tokens_in_flight("p-0") in (600, 900)

    asyncio.run(scenario())


def test_an_expired_lease_wakes_every_replica(redis_proc: RedisProcess) -> None:
    async def scenario() -> None:
        async with replicas(redis_proc, 2) as (a, b):
            holder = RedisLedger(
                aioredis.Redis.from_url(redis_proc.url, socket_timeout=TIMEOUT_S),
                backends=["p-0"],
                clock=SystemClock(),
                lease_ttl_s=0.3,
            )
            assert await holder.reserve("p-0", 800, limit=1000) is not None  # never renewed
            await until(lambda: a.ledger.tokens_in_flight("p-0") == 800)
            await until(lambda: ("p", 0) in a.woken and ("p", 0) in b.woken, within=2.0)

    asyncio.run(scenario())


def test_waiters_are_polled_while_the_channel_is_down_and_it_resubscribes(
    redis_proc: RedisProcess,
) -> None:
    async def scenario() -> None:
        async with replicas(redis_proc, 2) as (a, b):
            redis_proc.stop()
            await until(lambda: not b.feed.subscribed)
            b.woken.clear()
            await asyncio.sleep(6 * POLL_S)
            assert len(b.woken) >= 3  # polled every POLL_S, although nothing was published
            redis_proc.start()
            await until(lambda: a.feed.subscribed and b.feed.subscribed, within=4.0)
            await until(lambda: a.ledger.mode == "shared" and b.ledger.mode == "shared")
            held = await a.reserve(500)
            assert held is not None
            b.woken.clear()
            await a.router.release(held)
            await until(lambda: ("p", 0) in b.woken)

    asyncio.run(scenario())


def test_a_waiter_on_one_gateway_is_admitted_when_another_gateway_releases(
    redis_proc: RedisProcess,
) -> None:
    """Gateway B has no traffic of its own: only A's release can let its queued request in."""
    key = "sk-" + secrets.token_hex(8)
    with ServerThread(create_sim_app(SimConfig(model="m", kv_tokens=1024, speed=8.0))) as sim:
        settings = parse_settings(
            {
                "redis": {"timeout_ms": 500},
                "tenants": [tenant("acme", key)],
                "pools": [
                    {
                        "name": "big",
                        "backends": [{"url": sim.url, "served_model": "m", "capacity": 1000}],
                        "overflow": ["queue", "reject"],
                        "queue": {"max_wait_s": 8.0},
                        # the holder holds all of its max_tokens: nothing else fits beside it
                        "reservation": {"mode": "max_tokens"},
                    }
                ],
            }
        )
        gateways = [
            ServerThread(create_app(settings, environ={}, redis_url=redis_proc.url))
            for _ in range(2)
        ]
        with gateways[0] as a, gateways[1] as b:
            headers = {"authorization": f"Bearer {key}"}

            async def scenario() -> tuple[httpx.Response, httpx.Response]:
                async with httpx.AsyncClient(headers=headers, timeout=20) as client:
                    holding = asyncio.create_task(
                        client.post(f"{a.url}/v1/chat/completions", json=chat(880))
                    )
                    await until(lambda: _sim_running(sim.url) == 1, within=5.0)
                    waiting = await client.post(f"{b.url}/v1/chat/completions", json=chat(100))
                    return await holding, waiting

            held, waited = asyncio.run(scenario())
    assert held.status_code == 200
    assert held.headers["x-spillgate-outcome"] == "local"
    assert waited.status_code == 200, waited.text
    assert waited.headers["x-spillgate-outcome"] == "queued"


def chat(max_tokens: int) -> dict[str, Any]:
    return {
        "model": "big",
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": max_tokens,
    }


def _sim_running(url: str) -> float:
    return metric_sum(url, "vllm:num_requests_running")


def test_replicas_churning_reservations_never_hold_more_than_the_limit_together(
    redis_proc: RedisProcess,
) -> None:
    """Three replicas, each with its refresh and its feed running, reserve and release
    random sizes as fast as they can on one backend: blocks grow, spares are withheld and
    given back, asks go together. What their requests hold together never passes the
    limit, the backend is used near full, and when it is over every block goes."""
    limit = 900
    rng = random.Random(21)

    async def scenario() -> None:
        async with replicas(redis_proc, 3) as made:
            holding = {"now": 0, "peak": 0, "admitted": 0}

            async def client(ledger: RedisLedger) -> None:
                for _ in range(40):
                    tokens = rng.randint(10, 200)
                    held = await ledger.reserve("p-0", tokens, limit=limit)
                    if held is None:
                        await asyncio.sleep(0.002)
                        continue
                    holding["now"] += tokens
                    holding["peak"] = max(holding["peak"], holding["now"])
                    holding["admitted"] += 1
                    assert holding["now"] <= limit
                    await asyncio.sleep(rng.uniform(0, 0.01))
                    holding["now"] -= tokens
                    await ledger.release(held)

            await asyncio.gather(*(client(r.ledger) for r in made for _ in range(8)))
            assert holding["now"] == 0
            assert holding["peak"] > limit * 0.8
            assert holding["admitted"] > 200  # of 960 tries: room comes back as it is freed
            await until(lambda: all(r.ledger.snapshot()["p-0"] == (0, 0) for r in made))
            leases, *_ = made[0].ledger.keys("p-0")
            with redis.Redis.from_url(redis_proc.url, socket_timeout=5) as admin:
                await until(lambda: admin.exists(leases) == 0)  # each block at its refresh

    asyncio.run(scenario())
