"""Across replicas on a real Redis: a queue's waiting tenants reach the other replicas at
once when they change (gateway/shared/service_feed.py's announcements), and a higher class
waiting at one replica holds the room against a lower class at another."""

from __future__ import annotations

import asyncio
import time

import redis.asyncio as aioredis

from gateway.clock import SystemClock
from gateway.config import Priority
from gateway.overflow import Rival
from gateway.shared.batch import RedisBatcher
from gateway.shared.service_feed import ServiceFeed
from loadtest.procs import RedisProcess
from policies.queue.service import Service

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
