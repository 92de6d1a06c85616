"""Where cached answers live: a bounded local LRU, or Redis shared by every replica.

Both hold opaque bytes under opaque keys (the cache policy derives keys that already
include the tenant or shared scope), expire entries after a TTL and keep at most
`max_entries` per namespace. A failing Redis reads as a miss and drops the write.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from typing import Protocol

import redis.asyncio as aioredis
from redis.asyncio.cluster import RedisCluster
from redis.exceptions import RedisError

from gateway.clock import Clock

log = logging.getLogger("spillgate.cache")


class ResponseCache(Protocol):
    async def get(self, key: str) -> bytes | None:
        """The value stored under `key`, or None (absent, expired, or the store failed)."""
        ...

    async def put(self, key: str, value: bytes) -> None:
        """Store `value` for the TTL, evicting the oldest entries beyond `max_entries`."""
        ...


class LocalResponseCache:
    def __init__(self, *, max_entries: int, ttl_s: float, clock: Clock) -> None:
        self._max = max_entries
        self._ttl_s = ttl_s
        self._clock = clock
        self._entries: OrderedDict[str, tuple[float, bytes]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    async def get(self, key: str) -> bytes | None:
        entry = self._entries.get(key)
        if entry is None:
            return None
        expires, value = entry
        if self._clock.monotonic() >= expires:
            del self._entries[key]
            return None
        self._entries.move_to_end(key)
        return value

    async def put(self, key: str, value: bytes) -> None:
        self._entries[key] = (self._clock.monotonic() + self._ttl_s, value)
        self._entries.move_to_end(key)
        while len(self._entries) > self._max:
            self._entries.popitem(last=False)


# KEYS[1] entry, KEYS[2] index (a sorted set of entry keys by write time, in ms);
# ARGV value, ttl_ms, max_entries. Expired and surplus entries leave the index and the store.
PUT_SCRIPT = """
local now = redis.call('TIME')
local now_ms = tonumber(now[1]) * 1000 + math.floor(tonumber(now[2]) / 1000)
local ttl_ms = tonumber(ARGV[2])
redis.call('SET', KEYS[1], ARGV[1], 'PX', ttl_ms)
redis.call('ZADD', KEYS[2], now_ms, KEYS[1])
redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', now_ms - ttl_ms)
local surplus = redis.call('ZCARD', KEYS[2]) - tonumber(ARGV[3])
if surplus > 0 then
  local oldest = redis.call('ZRANGE', KEYS[2], 0, surplus - 1)
  redis.call('DEL', unpack(oldest))
  redis.call('ZREMRANGEBYRANK', KEYS[2], 0, surplus - 1)
end
redis.call('PEXPIRE', KEYS[2], ttl_ms)
return surplus
"""


class RedisResponseCache:
    """Entries under `spillgate:cache:{namespace}:*`; the hash tag keeps one namespace in
    one cluster slot, so the eviction script may touch every key it names."""

    def __init__(
        self,
        redis: aioredis.Redis | RedisCluster,
        *,
        namespace: str,
        max_entries: int,
        ttl_s: float,
    ) -> None:
        self._redis = redis
        self._prefix = f"spillgate:cache:{{{namespace}}}:"
        self._max = max_entries
        self._ttl_ms = max(1, int(ttl_s * 1000))
        self._put = redis.register_script(PUT_SCRIPT)

    def _key(self, key: str) -> str:
        return self._prefix + key

    async def get(self, key: str) -> bytes | None:
        try:
            value = await self._redis.get(self._key(key))
        except (RedisError, OSError) as exc:
            log.warning("cache read failed, treated as a miss: %r", exc)
            return None
        return value if isinstance(value, bytes) else None

    async def put(self, key: str, value: bytes) -> None:
        try:
            await self._put(
                keys=[self._key(key), self._prefix + "index"],
                args=[value, self._ttl_ms, self._max],
            )
        except (RedisError, OSError) as exc:
            log.warning("cache write dropped: %r", exc)
