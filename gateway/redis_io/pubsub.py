"""A Redis pub/sub subscription that gives its connection back however it ends."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import redis.asyncio as aioredis
from redis.asyncio.client import PubSub
from redis.asyncio.cluster import RedisCluster
from redis.exceptions import RedisError


@contextlib.asynccontextmanager
async def subscription(
    redis: aioredis.Redis | RedisCluster, channel: str, *, timeout_s: float
) -> AsyncIterator[PubSub]:
    """Subscribed to `channel` within `timeout_s`; closed on the way out, a bounded time,
    whatever the exit (a cancelled read included)."""
    pubsub = redis.pubsub(ignore_subscribe_messages=True)
    try:
        async with asyncio.timeout(timeout_s):
            await pubsub.subscribe(channel)
        yield pubsub
    finally:
        with contextlib.suppress(RedisError, OSError, TimeoutError):
            async with asyncio.timeout(timeout_s):
                # redis-py types PubSub.aclose only from 8.x on.
                await pubsub.aclose()  # type: ignore[no-untyped-call, unused-ignore]
