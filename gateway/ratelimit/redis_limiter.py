"""The shared limiter: every gateway process debits the same buckets in Redis.

One Lua script (bucket.lua) per decision checks and debits both buckets atomically, timed
by Redis `TIME` so gateways with disagreeing clocks still agree. Calls go through the
process's RedisBatcher (gateway/redis_batch.py): decisions made in the same moment travel
in one pipeline, and the script is reloaded when Redis answers NOSCRIPT (after a restart
or SCRIPT FLUSH). Both keys of a tenant share the hash tag `{tenant}`, so the script also
runs on Redis Cluster.

A decision Redis made after its caller stopped waiting (the caller answered from its
failure mode instead) is undone: an admission nobody used is refunded, so a late call
never leaves the tenant charged for a request twice.
"""

from __future__ import annotations

import itertools
import secrets
from importlib import resources
from typing import Any

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from gateway.ratelimit import bucket
from gateway.ratelimit.base import Decision, Reason, StoreError, TenantLimits
from gateway.redis_batch import BatchScript, RedisBatcher, batcher_of, forget

_REASONS: dict[int, Reason] = {0: "", 1: "requests", 2: "tokens", 3: "too_large"}


def bucket_script() -> str:
    return resources.files("gateway.ratelimit").joinpath("bucket.lua").read_text("utf-8")


class RedisRateLimiter:
    """Token buckets in Redis. Raises StoreError when Redis cannot answer, or (given
    `timeout_s`) does not within the time budget: the waits seen lately (Latency), at least
    `timeout_s`, at most `timeout_max_s`, counted from when the call went out; a loop too
    busy to send or read it does not use it up (RedisBatcher).

    The client belongs to whoever created it (it may be shared with other components);
    `close` leaves it open.
    """

    def __init__(
        self,
        redis: RedisBatcher | aioredis.Redis,
        *,
        key_prefix: str = "spillgate",
        timeout_s: float | None = None,
        timeout_max_s: float | None = None,
    ) -> None:
        self._batch = batcher_of(redis)
        self._timeout_s = timeout_s
        self._timeout_max_s = max(timeout_s or 0.0, timeout_max_s or 0.0)
        self._script = BatchScript(bucket_script())
        self._prefix = key_prefix
        self.late_refunds = 0  # admissions made after their caller stopped waiting
        self._ids = itertools.count()
        self._id_prefix = secrets.token_hex(6)

    def keys(self, tenant: str) -> tuple[str, str]:
        """The request and token bucket keys of a tenant; one hash slot for both."""
        base = f"{self._prefix}:ratelimit:{{{tenant}}}"
        return f"{base}:requests", f"{base}:tokens"

    def _args(self, op: str, limits: TenantLimits, cost: int, *extra: int) -> tuple[str | int, ...]:
        return (
            op,
            limits.requests_per_minute,
            limits.request_capacity,
            limits.tokens_per_minute,
            limits.token_capacity,
            cost,
            *extra,
        )

    def _decision_keys(self, tenant: str) -> tuple[str, str, str]:
        """The bucket keys and a new decision's id key, in the tenant's hash slot."""
        requests, tokens = self.keys(tenant)
        decided = f"{self._prefix}:ratelimit:{{{tenant}}}:decided:{self._id_prefix}"
        return requests, tokens, f"{decided}:{next(self._ids)}"

    async def _run(
        self, op: str, limits: TenantLimits, cost: int, *extra: int
    ) -> tuple[Reason, float, float]:
        keys: tuple[str, ...] = self.keys(limits.tenant)
        on_late = None
        if op == "acquire":
            keys = self._decision_keys(limits.tenant)

            def on_late(reply: Any) -> None:
                if reply and reply[0] == 0:  # admitted, but nobody used it: give it back
                    self.late_refunds += 1
                    refund = self._args("refund", limits, cost)
                    forget(self._batch.submit(self._script, keys, refund))

        budget = None
        if self._timeout_s is not None:
            budget = self._batch.latency.budget_s(
                floor_s=self._timeout_s, ceiling_s=self._timeout_max_s
            )
        future = self._batch.submit(
            self._script,
            keys,
            self._args(op, limits, cost, *extra),
            on_late=on_late,
            budget_s=budget,
            ceiling_s=self._timeout_max_s,
        )
        try:
            reply: Any = await future
        except (RedisError, OSError, TimeoutError) as exc:
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

    async def charge(self, limits: TenantLimits, *, requests: int, tokens: int) -> None:
        """Debit what was admitted elsewhere (a replica's own admissions while Redis was
        away), whether or not the buckets hold it: what they lack becomes debt."""
        if requests or tokens:
            await self._run("adjust", limits, tokens, requests)

    async def peek(self, limits: TenantLimits) -> Decision:
        _, requests, tokens = await self._run("peek", limits, 0)
        return bucket.judged(limits, requests=requests, tokens=tokens, cost=0)

    async def close(self) -> None:
        return None
