"""Across replicas on a real Redis: a queue's waiting tenants reach the other replicas at
once when they change (gateway/shared/service_feed.py's announcements), and a higher class
waiting at one replica holds the room against a lower class at another."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import secrets
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import redis.asyncio as aioredis
import yaml

from gateway.clock import SystemClock
from gateway.config import Priority
from gateway.overflow import Rival
from gateway.shared.batch import RedisBatcher
from gateway.shared.service_feed import ServiceFeed
from loadtest.procs import RedisProcess
from loadtest.sim.app import create_sim_app
from loadtest.sim.config import SimConfig
from policies.queue.service import Service
from tests.support.fleet import tenant
from tests.support.harness import ServerThread
from tests.support.overflow import chat, flooding
from tests.support.replica import gateways_running

TIMEOUT_S = 0.5


class Queue:
    """What the feed reads from and tells a pool's queue (SharedQueue)."""

    def __init__(self) -> None:
        self.service = Service(clock=SystemClock(), output_weight=4.0, half_life_s=60.0)
        self.heard: list[tuple[str, list[Rival], float]] = []

    def waiting_heads(self) -> list[tuple[Priority, str, int, int]]:
        return []

    def rivals_seen(self, rivals: list[Rival]) -> None:
        pass

    def rivals_heard(self, replica: str, rivals: list[Rival]) -> None:
        self.heard.append((replica, rivals, time.monotonic()))


def test_a_replica_hears_who_waits_at_another_at_once(redis_proc: RedisProcess) -> None:
    async def main() -> None:
        redis = aioredis.Redis.from_url(redis_proc.url)
        feeds, queues = [], []
        for name in ("one", "two"):
            # passes far apart: whatever arrives comes from the announcement
            feed = ServiceFeed(
                batcher=RedisBatcher(redis), redis=redis, timeout_s=TIMEOUT_S, every_s=60,
                replica_id=name,
            )  # fmt: skip
            queue = Queue()
            feed.register("p", queue)
            await feed.start()
            feeds.append(feed)
            queues.append(queue)
        try:
            await asyncio.sleep(0.2)  # both subscribed
            sent = time.monotonic()
            feeds[0].announce("p", [("critical", "vip", 300, 1)])
            feeds[0].announce("other-pool", [("critical", "vip", 300, 1)])
            for _ in range(50):
                if queues[1].heard:
                    break
                await asyncio.sleep(0.01)
            ((replica, rivals, at),) = queues[1].heard
            assert replica == "one" and rivals == [Rival("critical", "vip", 300, 1)]
            assert rivals[0].replica == "one"
            assert at - sent < 0.2  # not the next pass, a minute away
            assert queues[0].heard == []  # never its own
        finally:
            for feed in feeds:
                await feed.stop()
            await redis.aclose()

    asyncio.run(main())


SLOTS = 8  # critical requests the pool runs at once: two blocks of 16 each
TENANTS = {"vip": "critical", "std": "standard"}


@contextlib.contextmanager
def three_replicas(tmp_path: Path) -> Iterator[tuple[list[str], dict[str, str]]]:
    """Three `spillgate serve` processes on one redis-server, in front of one simulator."""
    sim = ServerThread(create_sim_app(SimConfig(model="m", kv_tokens=8192, speed=0.5))).start()
    keys = {name: "sk-" + secrets.token_hex(8) for name in TENANTS}
    config = {
        "tenants": [
            tenant(name, keys[name], priority=p, requests_per_minute=100_000)
            for name, p in TENANTS.items()
        ],
        "pools": [
            {
                "name": "big",
                "backends": [{"url": sim.url, "served_model": "m", "capacity": SLOTS * 32}],
                "target_fill": 1.0,
                "overflow": ["queue", "reject"],
                "queue": {"max_wait_s": 3, "max_depth": 1000},
                "reservation": {"mode": "max_tokens"},
            }
        ],
        "redis": {"timeout_ms": 250},
        "ratelimit": {"replicas": 3},
        "ledger": {"refresh_s": 0.1},
    }
    path = tmp_path / "gateway.yaml"
    path.write_text(yaml.safe_dump(config))
    try:
        with RedisProcess() as redis, gateways_running(path, 3, redis_url=redis.url) as gateways:
            yield [g.url for g in gateways], keys
    finally:
        sim.stop()


async def standard_beside_a_critical_flood(urls: list[str], keys: dict[str, str]) -> list[int]:
    """The statuses of small standard requests sent to the third replica while the critical
    tenant keeps three pools' worth waiting at the first two."""
    turns = itertools.cycle(urls[:2])
    limits = httpx.Limits(max_connections=100, max_keepalive_connections=100)
    vip_seen: list[httpx.Response] = []
    async with (
        httpx.AsyncClient(
            headers={"authorization": f"Bearer {keys['vip']}"}, timeout=30, limits=limits
        ) as vip,
        httpx.AsyncClient(headers={"authorization": f"Bearer {keys['std']}"}, timeout=30) as std,
    ):

        async def vip_sends() -> httpx.Response:
            return await vip.post(
                f"{next(turns)}/v1/chat/completions", json=chat("vip", max_tokens=16)
            )

        async def std_sends(delay_s: float) -> int:
            await asyncio.sleep(delay_s)
            body = chat("std", max_tokens=1)
            return (await std.post(f"{urls[2]}/v1/chat/completions", json=body)).status_code

        async with flooding(vip_sends, in_flight=3 * SLOTS, into=vip_seen):
            await asyncio.sleep(1.0)  # the critical queues build at the first two replicas
            statuses = await asyncio.gather(*(std_sends(0.25 * i) for i in range(8)))
        assert sum(r.status_code == 200 for r in vip_seen) > 2 * SLOTS
        # the flood over, the standard tenant is served at once
        statuses.append(await std_sends(0.0))
    return statuses


def test_a_lower_class_waits_while_a_higher_one_waits_at_another_replica(tmp_path: Path) -> None:
    with three_replicas(tmp_path) as (urls, keys):
        statuses = asyncio.run(standard_beside_a_critical_flood(urls, keys))
    assert statuses == [503] * 8 + [200], statuses
