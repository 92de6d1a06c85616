"""The shared limiter: every gateway process debits the same buckets in Redis.

One Lua script (bucket.lua) per decision checks and debits both buckets atomically, timed
by Redis `TIME` so gateways with disagreeing clocks still agree. It is loaded once and
called by EVALSHA; redis-py's Script reloads it when Redis answers NOSCRIPT (after a
restart or SCRIPT FLUSH). Both keys of a tenant share the hash tag `{tenant}`, so the
script also runs on Redis Cluster.
"""

from __future__ import annotations

from importlib import resources
from typing import Any

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from gateway.ratelimit import bucket
from gateway.ratelimit.base import Decision, Reason, StoreError, TenantLimits

_REASONS: dict[int, Reason] = {0: "", 1: "requests", 2: "tokens", 3: "too_large"}


def bucket_script() -> str:
    return resources.files("gateway.ratelimit").joinpath("bucket.lua").read_text("utf-8")


class RedisRateLimiter:
    """Token buckets in Redis. Raises StoreError when Redis cannot answer.

    The client belongs to whoever created it (it may be shared with other components);
    `close` leaves it open.
    """

    def __init__(self, redis: aioredis.Redis, *, key_prefix: str = "spillgate") -> None:
        self._script = redis.register_script(bucket_script())
        self._prefix = key_prefix

    def keys(self, tenant: str) -> tuple[str, str]:
        """The request and token bucket keys of a tenant; one hash slot for both."""
        base = f"{self._prefix}:ratelimit:{{{tenant}}}"
        return f"{base}:requests", f"{base}:tokens"

    async def _run(self, op: str, limits: TenantLimits, cost: int) -> tuple[Reason, float, float]:
        args = (
            op,
            limits.requests_per_minute,
            limits.request_capacity,
            limits.tokens_per_minute,
            limits.token_capacity,
            cost,
        )
        try:
            reply: Any = await self._script(keys=self.keys(limits.tenant), args=args)
        except (RedisError, OSError) as exc:
            raise StoreError(f"rate-limit store failed: {exc}") from exc
        try:
            return _REASONS[int(reply[0])], float(reply[1]), float(reply[2])
        except (TypeError, ValueError, IndexError, KeyError) as exc:
            raise StoreError(f"rate-limit store sent an unexpected reply: {reply!r}") from exc

    async def acquire(self, limits: TenantLimits, tokens: int) -> Decision:
        bucket.check_tokens(tokens=tokens)
        reason, requests, left = await self._run("acquire", limits, tokens)
        retry = 0.0
        if reason in ("requests", "tokens"):
            retry = bucket.retry_after_s(limits, requests=requests, tokens=left, cost=tokens)
        return bucket.decision(
            limits, requests=requests, tokens=left, reason=reason, retry_after=retry
        )

    async def reconcile(self, limits: TenantLimits, *, reserved: int, used: int) -> None:
        bucket.check_tokens(reserved=reserved, used=used)
        if reserved != used:
            await self._run("adjust", limits, used - reserved)

    async def peek(self, limits: TenantLimits) -> Decision:
        _, requests, tokens = await self._run("peek", limits, 0)
        return bucket.judged(limits, requests=requests, tokens=tokens, cost=0)

    async def close(self) -> None:
        return None
