"""The in-process limiter: the embedded default, and the fallback when Redis is down."""

from __future__ import annotations

from dataclasses import dataclass

from gateway.clock import Clock
from gateway.ratelimit import bucket
from gateway.ratelimit.base import Decision, TenantLimits


@dataclass(slots=True)
class _Levels:
    requests: float
    tokens: float
    at: float


class LocalRateLimiter:
    """Token buckets in this process's memory, timed by the injected clock.

    Safe under asyncio: each method reads, decides and writes without awaiting in between,
    so no other task can interleave a check with a debit.
    """

    def __init__(self, clock: Clock) -> None:
        self._clock = clock
        self._tenants: dict[str, _Levels] = {}

    def _levels(self, limits: TenantLimits) -> _Levels:
        now = self._clock.monotonic()
        levels = self._tenants.get(limits.tenant)
        if levels is None:
            levels = _Levels(float(limits.request_capacity), float(limits.token_capacity), now)
            self._tenants[limits.tenant] = levels
            return levels
        elapsed = now - levels.at
        if elapsed > 0:  # both buckets refill at their rate, capped at their size
            requests = levels.requests + elapsed * limits.requests_per_minute / 60
            tokens = levels.tokens + elapsed * limits.tokens_per_minute / 60
            capacity = limits.request_capacity
            levels.requests = requests if requests < capacity else float(capacity)
            capacity = limits.token_capacity
            levels.tokens = tokens if tokens < capacity else float(capacity)
            levels.at = now
        return levels

    async def acquire(self, limits: TenantLimits, tokens: int) -> Decision:
        if tokens < 0:
            bucket.check_tokens(tokens=tokens)
        levels = self._levels(limits)
        requests, level = levels.requests, levels.tokens
        if bucket.refusal_reason(limits, requests=requests, tokens=level, cost=tokens):
            return bucket.judged(limits, requests=requests, tokens=level, cost=tokens)
        levels.requests = requests = requests - 1
        levels.tokens = level = level - tokens
        return bucket.decision(limits, requests=requests, tokens=level, reason="", retry_after=0.0)

    async def reconcile(self, limits: TenantLimits, *, charged: int, used: int) -> None:
        charge = bucket.settlement(limits, charged=charged, used=used)
        if charge == 0:
            return
        levels = self._levels(limits)
        capacity = limits.token_capacity
        levels.tokens = bucket.settled_level(
            levels.tokens, charge, capacity=capacity, debt=capacity
        )

    def charge(self, limits: TenantLimits, *, tokens: int, debt: int) -> None:
        """Debit `tokens` beyond what an admission took, whether or not the bucket holds
        them, leaving at most `debt` owed: a share admitting a request its tenant's whole
        bucket holds though the share's does not (gateway/ratelimit/resilient.py)."""
        levels = self._levels(limits)
        levels.tokens = bucket.settled_level(
            levels.tokens, tokens, capacity=limits.token_capacity, debt=debt
        )

    def resume(self, limits: TenantLimits, *, requests: float, tokens: float, at: float) -> None:
        """Set a tenant's buckets to these levels as of `at` (this clock's monotonic time,
        in the past), from where they refill as usual: what the shared store last said was
        left of this replica's share, and when it said so."""
        self._tenants[limits.tenant] = _Levels(requests, tokens, at)

    async def peek(self, limits: TenantLimits) -> Decision:
        levels = self._levels(limits)
        return bucket.judged(limits, requests=levels.requests, tokens=levels.tokens, cost=0)

    async def close(self) -> None:
        self._tenants.clear()
