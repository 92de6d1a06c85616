"""Which backend answered which Responses API response: a continuation (`previous_response_id`)
must go where the response is stored, as a vLLM server keeps its responses to itself.

Bounded in memory (the most recent ids, oldest forgotten first) and, with a shared Redis,
written there too with an expiry, so a replica finds the responses another one relayed. A
Redis that fails or is slow costs the sharing only: the lookup falls back to this process.
"""

from __future__ import annotations

import asyncio
import logging
import re
from collections import OrderedDict

import redis.asyncio as aioredis
import redis.exceptions
from redis.asyncio.cluster import RedisCluster

from gateway.admission.ledger.held import HeldReservation

log = logging.getLogger("spillgate.responses")
KEY_PREFIX = "spillgate:response:"
# a response's id, as vLLM and OpenAI write it: the first `resp_` id of the answer is its own
# (the items inside it have ids of their own kinds: msg_, fc_, rs_)
_RESPONSE_ID = re.compile(rb'"id"\s*:\s*"(resp_[A-Za-z0-9_-]{1,200})"')
SCAN_BYTES = 4096  # the id comes in the first event (or near the start of a whole answer)


class ResponseHomes:
    def __init__(
        self,
        *,
        redis: aioredis.Redis | RedisCluster | None = None,
        max_entries: int = 100_000,
        ttl_s: int = 24 * 3600,
        timeout_s: float = 0.25,
    ) -> None:
        self._local: OrderedDict[str, str] = OrderedDict()
        self._redis = redis
        self._max = max_entries
        self._ttl_s = ttl_s
        self._timeout_s = timeout_s
        self._writes: set[asyncio.Task[None]] = set()

    def remember(self, response_id: str, backend: str) -> asyncio.Task[None] | None:
        """Note where `response_id` lives; the write to Redis, if any, to await before the
        answer ends (written meanwhile: relaying the answer never waits on Redis)."""
        self._local[response_id] = backend
        self._local.move_to_end(response_id)
        while len(self._local) > self._max:
            self._local.popitem(last=False)
        if self._redis is None:
            return None
        task = asyncio.create_task(self._share(response_id, backend))
        self._writes.add(task)
        task.add_done_callback(self._writes.discard)
        return task

    async def _share(self, response_id: str, backend: str) -> None:
        assert self._redis is not None
        try:
            async with asyncio.timeout(self._timeout_s):
                await self._redis.set(KEY_PREFIX + response_id, backend, ex=self._ttl_s)
        except (TimeoutError, redis.exceptions.RedisError) as exc:
            log.warning("could not share response %s's backend: %s", response_id, exc)

    async def backend_of(self, response_id: str) -> str | None:
        """The backend that answered `response_id`, or None when no replica knows it."""
        found = self._local.get(response_id)
        if found is not None or self._redis is None:
            return found
        try:
            async with asyncio.timeout(self._timeout_s):
                value = await self._redis.get(KEY_PREFIX + response_id)
        except (TimeoutError, redis.exceptions.RedisError) as exc:
            log.warning("could not look up response %s's backend: %s", response_id, exc)
            return None
        if value is None:
            return None
        return value.decode() if isinstance(value, bytes) else str(value)


class ResponseIdRecorder:
    """Watches one answer for its response id and remembers the backend it came from: the
    backend the request holds its reservation on when the answer's first bytes arrive (a
    retry elsewhere happens only before them). An answer from outside the pool (a
    provider) has no reservation and is not remembered."""

    __slots__ = ("_held", "_homes", "_seen", "_write")  # one per request

    def __init__(self, homes: ResponseHomes, held: HeldReservation) -> None:
        self._homes = homes
        self._held = held
        self._seen = 0
        self._write: asyncio.Task[None] | None = None

    def feed(self, data: bytes) -> None:
        if self._seen >= SCAN_BYTES:
            return
        self._seen += len(data)
        found = _RESPONSE_ID.search(data, 0, SCAN_BYTES)
        backend = self._held.backend
        if found is not None:
            self._seen = SCAN_BYTES  # one id per answer
            if backend is not None:
                self._write = self._homes.remember(found.group(1).decode(), backend)

    def finish(self, usage: object) -> None:
        return None

    async def shared(self) -> None:
        """Returns once the id is shared with the other replicas (or sharing has failed):
        awaited before the client holds the whole answer, so a continuation it sends to
        another replica finds the id there."""
        if self._write is not None:
            await asyncio.shield(self._write)
