"""Queue wake-ups across replicas: capacity given back anywhere wakes the waiters everywhere.

Every release and every expiry of a lease is published by ledger.lua on one channel. Each
replica subscribes; a message updates the ledger's snapshot of that backend (so a waiter
woken by it sees the room) and then tells the router, which wakes that pool's waiters. A
replica's own releases already woke its waiters, so only expiries are taken from its own
messages. A message that gives back nothing is a refusal elsewhere while this replica's
block may hold spare: the ledger gives it back at once. While the subscription is down, or
the ledger is in its local mode, the waiters of every pool are woken every `poll_s`
instead: a release elsewhere may have gone unheard.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, Protocol

import redis.asyncio as aioredis
from redis.asyncio.cluster import RedisCluster
from redis.exceptions import RedisError

from gateway.admission.ledger_block import Seen
from gateway.admission.ledger_redis import RedisLedger
from gateway.admission.pubsub import subscription
from gateway.tasks import stop_task

log = logging.getLogger("spillgate.ledger")


class ReleaseWaker(Protocol):
    def released_elsewhere(self, backend: str, tokens: int) -> None:
        """Capacity another replica gave back on `backend`: wake that pool's waiters."""
        ...

    def wake_all(self) -> None:
        """Wake every pool's waiters, to look again for room they may not have heard of."""
        ...


def parse_message(data: Any) -> tuple[str, int, int, str, Seen] | None:
    """(replica, released, expired, backend, totals) from a published release, else None."""
    text = data.decode() if isinstance(data, bytes) else str(data)
    parts = text.split(" ", 6)
    if len(parts) != 7:
        return None
    replica, released, expired, total, sessions, seq, backend = parts
    try:
        seen = Seen(int(total), int(sessions), int(seq))
        return replica, int(released), int(expired), backend, seen
    except ValueError:
        return None


class ReleaseFeed:
    def __init__(
        self,
        redis: aioredis.Redis | RedisCluster,
        *,
        ledger: RedisLedger,
        waker: ReleaseWaker,
        timeout_s: float,
        poll_s: float = 0.25,
        retry_s: float = 1.0,
    ) -> None:
        self._redis = redis
        self._ledger = ledger
        self._waker = waker
        self._timeout_s = timeout_s
        self._poll_s = poll_s
        self._retry_s = retry_s
        self.subscribed = False
        self._task: asyncio.Task[None] | None = None
        self._stopping = False

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="ledger-release-feed")

    async def stop(self) -> None:
        self._stopping = True
        if self._task is not None:
            await stop_task(self._task)
            self._task = None

    def deliver(self, data: Any) -> None:
        """Act on one published release."""
        parsed = parse_message(data)
        if parsed is None:
            log.debug("ignoring a malformed release message: %r", data)
            return
        replica, released, expired, backend, seen = parsed
        self._ledger.observe(backend, seen)
        mine = replica == self._ledger.replica_id
        freed = expired if mine else released + expired
        if freed > 0:
            self._waker.released_elsewhere(backend, freed)
        elif released == expired == 0 and not mine:  # refused elsewhere for want of room
            self._ledger.wanted(backend)

    async def _run(self) -> None:
        while not self._stopping:
            try:
                await self._listen()
            except (RedisError, OSError, TimeoutError) as exc:
                log.debug("release feed lost its subscription: %r", exc)
            except Exception:
                log.exception("release feed failed")
            self.subscribed = False
            await self._poll(self._retry_s)

    async def _listen(self) -> None:
        channel = self._ledger.channel
        try:
            async with subscription(self._redis, channel, timeout_s=self._timeout_s) as pubsub:
                self.subscribed = True
                self._waker.wake_all()  # releases while it was not listening went unheard
                while not self._stopping:
                    message = await pubsub.get_message(
                        ignore_subscribe_messages=True, timeout=self._poll_s
                    )
                    if message is not None:
                        self.deliver(message["data"])
                    elif self._ledger.mode != "shared":
                        self._waker.wake_all()
        finally:
            self.subscribed = False

    async def _poll(self, seconds: float) -> None:
        """Wake every pool's waiters every `poll_s` for `seconds`."""
        loop = asyncio.get_running_loop()
        until = loop.time() + seconds
        while loop.time() < until and not self._stopping:
            self._waker.wake_all()
            await asyncio.sleep(self._poll_s)
