"""Queue wake-ups across replicas: capacity given back anywhere wakes the waiters everywhere.

Every release and every expiry of a lease is published by ledger.lua on one channel. Each
replica subscribes; a message updates the ledger's snapshot of that backend (so a waiter
woken by it sees the room) and then tells the router, which wakes that pool's waiters. A
replica's own releases already woke its waiters, so only expiries are taken from its own
messages. A message that gives back nothing is a refusal elsewhere while this replica's
grant may hold spare: the ledger gives it back at once. While the subscription is down, or
the ledger is in its local mode, the waiters of every pool are woken every `poll_s`
instead: a release elsewhere may have gone unheard.
"""

from __future__ import annotations

import logging
from typing import Any, Protocol

import redis.asyncio as aioredis
from redis.asyncio.cluster import RedisCluster

from gateway.admission.ledger.grants import Seen
from gateway.admission.ledger.shared import RedisLedger
from gateway.shared.feed import Subscriber

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


class ReleaseFeed(Subscriber):
    """Hears every release in the fleet and wakes the waiters it concerns."""

    def __init__(
        self,
        redis: aioredis.Redis | RedisCluster,
        *,
        ledger: RedisLedger,
        waker: ReleaseWaker,
        timeout_s: float,
        poll_s: float = 0.25,
    ) -> None:
        self._ledger = ledger
        self._waker = waker
        super().__init__(
            redis,
            ledger.channel,
            deliver=self.deliver,
            timeout_s=timeout_s,
            name="ledger-release-feed",
            quiet_s=poll_s,
            on_subscribed=waker.wake_all,  # releases while it was not listening went unheard
            on_quiet=self._quiet,
        )

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

    def _quiet(self, subscribed: bool) -> None:
        """Nothing heard for `poll_s`: a release may have gone unheard where the ledger is
        local or the subscription down."""
        if not subscribed or self._ledger.mode != "shared":
            self._waker.wake_all()
