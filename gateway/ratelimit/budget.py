"""A token budget: one key's tokens-per-minute bucket in a RateLimiter, with no count of
requests. Each external provider's budget is one (policies/provider/gate.py spends it);
with Redis, every replica spends from the same bucket."""

from __future__ import annotations

from collections.abc import Iterable

from gateway.config import ProviderSettings
from gateway.ratelimit.base import RateLimiter, TenantLimits

UNLIMITED_REQUESTS = 1_000_000_000  # a budget counts tokens only


class BucketBudget:
    def __init__(self, limiter: RateLimiter, *, key: str, tokens_per_minute: int) -> None:
        self.limiter = limiter
        self.limits = TenantLimits(
            tenant=key,
            requests_per_minute=UNLIMITED_REQUESTS,
            tokens_per_minute=tokens_per_minute,
        )

    async def spend(self, tokens: int) -> bool:
        """Take `tokens` if the bucket holds them, in one atomic check-and-debit."""
        decision = await self.limiter.acquire(self.limits, tokens)
        return decision.allowed

    async def settle(self, *, spent: int, used: int) -> None:
        """Give back what a spend of `spent` did not use, or charge what it used beyond."""
        await self.limiter.reconcile(self.limits, charged=spent, used=used)


def provider_budgets(
    limiter: RateLimiter, providers: Iterable[ProviderSettings]
) -> dict[str, BucketBudget]:
    """Each provider's tokens-per-minute budget: a bucket of its own in `limiter`."""
    return {
        p.name: BucketBudget(limiter, key=p.name, tokens_per_minute=p.tokens_per_minute)
        for p in providers
    }
