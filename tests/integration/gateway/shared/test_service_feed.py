"""Replicas share their queues' attained service and waiting tenants through a real Redis
(gateway/shared/service_feed.py); without Redis each keeps its own figures."""

from __future__ import annotations

import asyncio

import pytest
import redis.asyncio as aioredis
from redis.exceptions import RedisError

from gateway.clock import SystemClock
from gateway.config import Priority
from gateway.overflow import Rival
from gateway.redis_io.batch import RedisBatcher
from gateway.request import InferenceRequest
from gateway.shared.service_feed import ServiceFeed, service_key
from loadtest.procs import RedisProcess
from policies.queue.service import Service
from tests.support.upstream import chat_request

TIMEOUT_S = 0.5


class Queue:
    """What the feed reads from and tells a pool's queue (SharedQueue)."""

    def __init__(self) -> None:
        self.service = Service(clock=SystemClock(), output_weight=4.0, half_life_s=60.0)
        self.heads: list[tuple[Priority, str, int, int]] = []
        self.rivals: list[Rival] | None = None

    def waiting_heads(self) -> list[tuple[Priority, str, int, int]]:
        return self.heads

    def rivals_seen(self, rivals: list[Rival]) -> None:
        self.rivals = rivals


def request(tenant: str, prompt: int, output: int) -> InferenceRequest:
    return chat_request(max_tokens=output)._replace(tenant=tenant, prompt_tokens=prompt)


def replica(redis: aioredis.Redis, name: str) -> tuple[ServiceFeed, Queue]:
    feed = ServiceFeed(batcher=RedisBatcher(redis), timeout_s=TIMEOUT_S, replica_id=name)
    queue = Queue()
    feed.register("p", queue)
    return feed, queue


def test_replicas_order_by_the_fleets_service(redis_proc: RedisProcess) -> None:
    async def main() -> None:
        redis = aioredis.Redis.from_url(redis_proc.url)
        (one, q1), (two, q2) = replica(redis, "one"), replica(redis, "two")
        q1.service.attain(request("heavy", 1000, 500))  # 3000 weighted tokens
        q2.service.attain(request("light", 10, 10))  # 50
        await one.feed_pass()
        await two.feed_pass()
        await one.feed_pass()
        for queue in (q1, q2):
            assert queue.service.of("heavy") == pytest.approx(3000, rel=0.01)
            assert queue.service.of("light") == pytest.approx(50, rel=0.01)
        # corrections travel too: the heavy answer ended early
        q2.service.settle(request("heavy", 1000, 500), 1000, 0)
        await two.feed_pass()
        await one.feed_pass()
        assert q1.service.of("heavy") == pytest.approx(1000, rel=0.01)
        stored = await redis.hgetall(service_key("p"))  # type: ignore[misc]
        assert set(stored) == {b"", b"heavy", b"light"}
        await redis.aclose()

    asyncio.run(main())


def test_a_replica_sees_the_tenants_waiting_elsewhere_while_they_are_fresh(
    redis_proc: RedisProcess,
) -> None:
    async def main() -> None:
        redis = aioredis.Redis.from_url(redis_proc.url)
        (one, q1), (two, q2) = replica(redis, "one"), replica(redis, "two")
        q1.heads = [("standard", "light", 120, 1), ("critical", 'we"ird\n', 5, 2)]
        q2.heads = [("standard", "heavy", 40, 1)]
        await one.feed_pass()
        await two.feed_pass()
        assert q2.rivals == [
            Rival("standard", "light", 120, 1),
            Rival("critical", 'we"ird\n', 5, 2),
        ]
        await one.feed_pass()
        assert q1.rivals == [Rival("standard", "heavy", 40, 1)]  # never its own
        q1.heads = []  # served: it says so at its next pass
        await one.feed_pass()
        await two.feed_pass()
        assert q2.rivals == []
        # a replica that stops passing (dead, or cut off from Redis) stops counting
        q1.heads = [("standard", "light", 120, 1)]
        await one.feed_pass()
        await two.feed_pass()
        assert q2.rivals
        await asyncio.sleep(one.fresh_s + 0.1)
        await two.feed_pass()
        assert q2.rivals == []
        await redis.aclose()

    asyncio.run(main())


def test_without_redis_a_replica_keeps_its_own_figures_and_its_own_order() -> None:
    async def main() -> None:
        with RedisProcess() as proc:
            redis = aioredis.Redis.from_url(proc.url, socket_timeout=TIMEOUT_S)
            (one, q1), (two, q2) = replica(redis, "one"), replica(redis, "two")
            q2.heads = [("standard", "light", 1, 1)]
            await two.feed_pass()
            await one.feed_pass()
            assert q1.rivals
            q1.service.attain(request("heavy", 100, 0))
            proc.stop()
            with pytest.raises((RedisError, OSError, TimeoutError)):
                await one.feed_pass()
            assert q1.rivals == []  # unknown now: the local order
            assert q1.service.of("heavy") == pytest.approx(100, rel=0.01)
            q1.service.attain(request("heavy", 100, 0))
            with pytest.raises((RedisError, OSError, TimeoutError)):
                await one.feed_pass()
            assert q1.service.of("heavy") == pytest.approx(200, rel=0.01)
            await redis.aclose()

    asyncio.run(main())
