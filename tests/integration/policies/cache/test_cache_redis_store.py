"""The Redis response cache against a real redis-server: bounded, expiring, and a miss
(never an error) when Redis is gone."""

from __future__ import annotations

import asyncio

import redis.asyncio as aioredis

from loadtest.procs import RedisProcess
from policies.cache.store import RedisResponseCache


def test_entries_beyond_max_entries_are_evicted_oldest_first(redis_proc: RedisProcess) -> None:
    async def scenario() -> None:
        client = aioredis.Redis.from_url(redis_proc.url, socket_timeout=2)
        try:
            cache = RedisResponseCache(client, namespace="big", max_entries=2, ttl_s=30)
            other = RedisResponseCache(client, namespace="small", max_entries=2, ttl_s=30)
            for key in ("a", "b", "c"):
                await cache.put(key, key.encode())
                await asyncio.sleep(0.002)  # distinct write times in ms
            await other.put("a", b"small-a")
            assert await cache.get("a") is None
            assert await cache.get("b") == b"b" and await cache.get("c") == b"c"
            assert await other.get("a") == b"small-a"  # namespaces do not mix
            ttl = await client.pttl("spillgate:cache:{big}:c")
            assert 0 < ttl <= 30_000
        finally:
            await client.aclose()

    asyncio.run(scenario())


def test_a_stopped_redis_reads_as_a_miss_and_drops_writes(redis_proc: RedisProcess) -> None:
    async def scenario() -> None:
        client = aioredis.Redis.from_url(
            redis_proc.url, socket_timeout=0.2, socket_connect_timeout=0.2
        )
        try:
            cache = RedisResponseCache(client, namespace="big", max_entries=10, ttl_s=30)
            await cache.put("k", b"v")
            assert await cache.get("k") == b"v"
            redis_proc.stop()
            assert await cache.get("k") is None
            await cache.put("k2", b"v2")  # no exception
        finally:
            await client.aclose()

    asyncio.run(scenario())
