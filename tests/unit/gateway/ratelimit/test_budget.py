"""A token budget: one key's bucket of tokens per minute, with no count of requests."""

from __future__ import annotations

import asyncio

from gateway.clock import ManualClock
from gateway.ratelimit import LocalRateLimiter
from gateway.ratelimit.budget import BucketBudget


def test_a_budget_counts_tokens_only_and_settles_with_what_was_used() -> None:
    clock = ManualClock()
    budget = BucketBudget(LocalRateLimiter(clock), key="hosted", tokens_per_minute=100)

    async def scenario() -> None:
        assert await budget.spend(60)
        assert not await budget.spend(60)  # 40 left, and a refusal takes nothing
        await budget.settle(spent=60, used=20)
        assert (await budget.limiter.peek(budget.limits)).remaining_tokens == 80
        assert [await budget.spend(1) for _ in range(80)] == [True] * 80  # requests uncounted
        assert not await budget.spend(1)
        await budget.settle(spent=1, used=11)  # used more than it spent: charged
        clock.advance(6)  # a tenth of a minute: 10 tokens back
        assert (await budget.limiter.peek(budget.limits)).remaining_tokens == 0

    asyncio.run(scenario())
