"""The local response cache: a bounded LRU whose entries expire."""

from __future__ import annotations

import asyncio

from gateway.clock import ManualClock
from policies.cache.store import LocalResponseCache


def test_entries_expire_and_the_least_recently_used_is_evicted_first() -> None:
    async def scenario() -> None:
        clock = ManualClock()
        cache = LocalResponseCache(max_entries=2, ttl_s=10, clock=clock)
        await cache.put("a", b"1")
        await cache.put("b", b"2")
        assert await cache.get("a") == b"1"  # a is now the most recently used
        await cache.put("c", b"3")
        assert await cache.get("b") is None and len(cache) == 2
        clock.advance(9.9)
        assert await cache.get("c") == b"3"
        clock.advance(0.1)
        assert await cache.get("a") is None and await cache.get("c") is None
        assert len(cache) == 0

    asyncio.run(scenario())
