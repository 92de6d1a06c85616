"""The two ways a feed carries one replica's state to the others, each feed configuring one:

- `PoolPasses`, the feed pass: every `every_s`, one script call per pool, all at once,
  travelling with the process's other Redis calls (gateway/redis_io/batch.py); the first
  before the first request. A pass lost to a slow or absent Redis leaves each pool on what it had.
- `Subscriber`: every message published on a channel, handed over as it comes; a lost
  subscription is taken up again `retry_s` later. Whoever needs word while nothing comes
  (or while it is not subscribed) hears `on_quiet` every `quiet_s`.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, Generic, TypeVar

import redis.asyncio as aioredis
from redis.asyncio.cluster import RedisCluster
from redis.exceptions import RedisError

from gateway.redis_io.pubsub import subscription
from gateway.tasks import Periodic

log = logging.getLogger("spillgate.feed")

P = TypeVar("P")


class PoolPasses(Generic[P]):
    """`pass_pool(name, pool)` for every pool of `pools` at once, every `every_s`.

    `pools` is read on every pass, so pools added to it later take part."""

    def __init__(
        self,
        pass_pool: Callable[[str, P], Awaitable[None]],
        pools: Mapping[str, P],
        *,
        every_s: float,
        name: str,
    ) -> None:
        self._pass_pool = pass_pool
        self._pools = pools
        self._name = name
        self._periodic = Periodic(self.feed_pass, every_s=every_s, name=name, wait_first=True)

    async def feed_pass(self) -> None:
        """One feed pass over every pool; raises the first pool's failure once all are done."""
        results = await asyncio.gather(
            *(self._pass_pool(name, pool) for name, pool in self._pools.items()),
            return_exceptions=True,
        )
        for result in results:
            if isinstance(result, BaseException):
                raise result

    async def start(self) -> None:
        """A first pass before the first request (a failed one only logged), then on."""
        try:
            await self.feed_pass()
        except (RedisError, TimeoutError, OSError) as exc:
            log.warning("%s: the first pass failed: %r", self._name, exc)
        self._periodic.start()

    async def stop(self) -> None:
        await self._periodic.stop()


class Subscriber:
    """Hands every message published on `channel` to `deliver`."""

    def __init__(
        self,
        redis: aioredis.Redis | RedisCluster,
        channel: str,
        *,
        deliver: Callable[[Any], None],
        timeout_s: float,
        name: str,
        quiet_s: float = 1.0,
        retry_s: float = 1.0,
        on_subscribed: Callable[[], None] | None = None,
        on_quiet: Callable[[bool], None] | None = None,
    ) -> None:
        """`on_subscribed()` once each subscription is up; `on_quiet(subscribed)` each
        `quiet_s` without a message, and each `quiet_s` while waiting to subscribe again."""
        self._redis = redis
        self.channel = channel
        self._deliver = deliver
        self._timeout_s = timeout_s
        self._name = name
        self._quiet_s = quiet_s
        self._retry_s = retry_s
        self._on_subscribed = on_subscribed
        self._on_quiet = on_quiet
        self.subscribed = False
        self._periodic = Periodic(self._listen_and_retry, every_s=0, name=name)

    async def start(self) -> None:
        self._periodic.start()

    async def stop(self) -> None:
        await self._periodic.stop()

    async def _listen_and_retry(self) -> None:
        try:
            await self._listen()
        except (RedisError, OSError, TimeoutError) as exc:
            log.debug("%s lost its subscription: %r", self._name, exc)
        finally:
            self.subscribed = False
            if not self._periodic.stopping:
                await self._quiet_for(self._retry_s)

    async def _listen(self) -> None:
        async with subscription(self._redis, self.channel, timeout_s=self._timeout_s) as pubsub:
            self.subscribed = True
            if self._on_subscribed is not None:
                self._on_subscribed()
            while not self._periodic.stopping:
                message = await pubsub.get_message(
                    ignore_subscribe_messages=True, timeout=self._quiet_s
                )
                if message is not None:
                    self._deliver(message["data"])
                elif self._on_quiet is not None:
                    self._on_quiet(True)

    async def _quiet_for(self, seconds: float) -> None:
        loop = asyncio.get_running_loop()
        until = loop.time() + seconds
        while loop.time() < until and not self._periodic.stopping:
            if self._on_quiet is not None:
                self._on_quiet(False)
            await asyncio.sleep(self._quiet_s)
