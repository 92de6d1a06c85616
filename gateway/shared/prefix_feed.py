"""The prefix index shared by the replicas of a shared-mode gateway, through Redis pub/sub.

Each replica routes by its own index (gateway/admission/routing/prefix_index.py); a prefix another
replica sent to a backend would look cold to it and could go elsewhere. So every replica
publishes the blocks its routing taught its index that it did not know yet (a prompt's new
tail, not the system prompt it has sent there a thousand times), a batch every `flush_s`,
and adds what the others publish to its own index. Nothing waits on Redis on the request
path, and a batch lost to a slow or absent Redis only makes the guess rougher: the
rendezvous homes of a new prefix (the prefix scorer, admission/routing/prefix_route.py)
still keep the replicas' choices together.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from typing import Any, Protocol

import orjson
import redis.asyncio as aioredis
from redis.asyncio.cluster import RedisCluster
from redis.exceptions import RedisError

from gateway.shared.feed import Subscriber
from gateway.tasks import Periodic

log = logging.getLogger("spillgate.prefix")

KEY_BYTES = 8  # gateway/admission/routing/prefix_index.py's digest size
MAX_PENDING = 65_536  # keys held for the next batch; more are dropped while Redis lags


class Learner(Protocol):
    def prefix_routed_elsewhere(self, pool: str, backend: str, keys: Sequence[bytes]) -> None:
        """Another replica routed the prompt blocks `keys` of `pool` to `backend`."""
        ...


def encode(replica: str, batch: dict[tuple[str, str], list[bytes]]) -> bytes:
    groups = [[pool, backend, b"".join(keys).hex()] for (pool, backend), keys in batch.items()]
    return orjson.dumps({"replica": replica, "groups": groups})


def decode(data: Any) -> tuple[str, list[tuple[str, str, list[bytes]]]] | None:
    """(replica, [(pool, backend, keys)]) from a published batch, else None."""
    try:
        message = orjson.loads(data)
        groups = []
        for pool, backend, hexed in message["groups"]:
            raw = bytes.fromhex(hexed)
            if len(raw) % KEY_BYTES:
                return None
            keys = [raw[i : i + KEY_BYTES] for i in range(0, len(raw), KEY_BYTES)]
            groups.append((str(pool), str(backend), keys))
        return str(message["replica"]), groups
    except (orjson.JSONDecodeError, KeyError, TypeError, ValueError):
        return None


class PrefixFeed(Subscriber):
    """Publishes what routing taught this replica's index, a batch every `flush_s`, and
    teaches it what the other replicas publish."""

    def __init__(
        self,
        redis: aioredis.Redis | RedisCluster,
        *,
        learner: Learner,
        replica_id: str,
        channel: str = "spillgate:prefix:routed",
        timeout_s: float,
        flush_s: float = 0.05,
    ) -> None:
        super().__init__(
            redis,
            channel,
            deliver=self.deliver,
            timeout_s=timeout_s,
            name="prefix-feed",
        )
        self._redis = redis
        self._learner = learner
        self.replica_id = replica_id
        self._timeout_s = timeout_s
        self._pending: dict[tuple[str, str], list[bytes]] = {}
        self._pending_keys = 0
        self._flusher = Periodic(self.flush, every_s=flush_s, name="prefix-feed-flush")

    async def start(self) -> None:
        self._flusher.start()
        await super().start()

    async def stop(self) -> None:
        await self._flusher.stop()
        await super().stop()

    def routed(self, pool: str, backend: str, keys: Sequence[bytes]) -> None:
        """This replica sent prompt blocks `keys`, new to its index, to `backend`."""
        if not keys or self._pending_keys + len(keys) > MAX_PENDING:
            return
        self._pending.setdefault((pool, backend), []).extend(keys)
        self._pending_keys += len(keys)

    async def flush(self) -> None:
        """Publish what was routed since the last batch (dropped if Redis does not take it)."""
        if not self._pending:
            return
        batch, self._pending, self._pending_keys = self._pending, {}, 0
        try:
            async with asyncio.timeout(self._timeout_s):
                await self._redis.publish(self.channel, encode(self.replica_id, batch))
        except (RedisError, OSError, TimeoutError) as exc:
            log.debug("prefix feed dropped a batch: %r", exc)

    def deliver(self, data: Any) -> None:
        """Add one published batch of another replica to this one's index."""
        decoded = decode(data)
        if decoded is None:
            log.debug("ignoring a malformed prefix message: %r", data)
            return
        replica, groups = decoded
        if replica == self.replica_id:
            return
        for pool, backend, keys in groups:
            self._learner.prefix_routed_elsewhere(pool, backend, keys)
