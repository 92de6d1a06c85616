"""A settlement's usage is what a backend said: whatever it says, a tenant's bucket owes at
most one bucket, every wait it implies is at most two refills, and nothing raises."""

from __future__ import annotations

import asyncio
import logging

import pytest

from gateway.clock import ManualClock
from gateway.ratelimit import LocalRateLimiter, TenantLimits, bucket

# a bucket of 1,000 tokens refilled in a minute: a wait from its floor to full is 120 s
LIMITS = TenantLimits(tenant="acme", requests_per_minute=600, tokens_per_minute=1_000)
NOT_COUNTS = [-5, 1e300, float("inf"), float("nan"), 10.0, "lots", [5], {}, None, True]


def levels_after(used: object, *, charged: int = 400) -> tuple[LocalRateLimiter, float]:
    """A limiter whose tenant was charged `charged` and settled with `used`; the tokens left."""
    limiter = LocalRateLimiter(ManualClock())

    async def scenario() -> float:
        assert (await limiter.acquire(LIMITS, charged)).allowed
        await limiter.reconcile(LIMITS, charged=charged, used=used)  # type: ignore[arg-type]
        return limiter._tenants["acme"].tokens

    return limiter, asyncio.run(scenario())


@pytest.mark.parametrize("used", [2_000, 10**18, 10**400], ids=["2x", "1e18", "1e400"])
def test_usage_far_beyond_the_charge_owes_one_bucket_at_most(used: int) -> None:
    limiter, level = levels_after(used)
    assert level == -1_000.0
    refused = asyncio.run(limiter.acquire(LIMITS, 500))
    assert (refused.allowed, refused.reason, refused.remaining_tokens) == (False, "tokens", 0)
    assert refused.retry_after_s == pytest.approx(90.0)  # 1,500 tokens at 1,000 a minute
    assert refused.reset_tokens_s == pytest.approx(120.0)
    # the largest request there is waits two refills, no longer
    assert asyncio.run(limiter.acquire(LIMITS, 1_000)).retry_after_s == pytest.approx(120.0)


def test_a_legitimate_overrun_is_charged_in_full_up_to_the_bound() -> None:
    assert levels_after(1_300)[1] == 600 - 900  # 900 tokens beyond the charge: debt
    assert levels_after(400)[1] == 600.0
    assert levels_after(0)[1] == 1_000.0  # all of it back


@pytest.mark.parametrize("used", NOT_COUNTS, ids=repr)
def test_a_usage_that_is_no_count_settles_as_charged(
    used: object, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="spillgate.ratelimit")
    assert levels_after(used)[1] == 600.0  # nothing back, nothing more
    assert [r.name for r in caplog.records] == ["spillgate.ratelimit"]
    assert "acme" in caplog.records[0].getMessage()


def test_a_charge_that_is_no_count_settles_as_it_stood() -> None:
    limiter = LocalRateLimiter(ManualClock())

    async def scenario() -> float:
        await limiter.acquire(LIMITS, 400)
        await limiter.reconcile(LIMITS, charged=-400, used=0)
        return limiter._tenants["acme"].tokens

    assert asyncio.run(scenario()) == 600.0


def test_settlement_is_the_charge_held_within_two_buckets() -> None:
    assert bucket.settlement(LIMITS, charged=400, used=50) == -350
    assert bucket.settlement(LIMITS, charged=400, used=900) == 500
    assert bucket.settlement(LIMITS, charged=400, used=10**30) == 2_000
    assert bucket.settlement(LIMITS, charged=10**30, used=0) == -2_000
    assert bucket.settlement(LIMITS, charged=400, used="7") == 0
    assert bucket.settlement(LIMITS, charged=400, used=False) == 0


def test_a_settled_level_stays_between_its_debt_and_its_size() -> None:
    assert bucket.settled_level(100.0, 300, capacity=1_000, debt=1_000) == -200.0
    assert bucket.settled_level(100.0, 5_000, capacity=1_000, debt=1_000) == -1_000.0
    assert bucket.settled_level(100.0, -5_000, capacity=1_000, debt=1_000) == 1_000.0
    # a level already deeper in debt than the bound is not lifted by a charge, only by refunds
    assert bucket.settled_level(-3_000.0, 10, capacity=1_000, debt=1_000) == -3_000.0
    assert bucket.settled_level(-3_000.0, -500, capacity=1_000, debt=1_000) == -2_500.0


def test_a_share_admitting_a_request_larger_than_itself_owes_up_to_the_whole_bucket() -> None:
    """The resilient limiter's share of 1/4 (250 tokens) admits a request of the tenant's
    whole bucket: the 750 beyond the share are owed, and a settlement after cannot lift the
    debt to the share's own bound."""
    limiter = LocalRateLimiter(ManualClock())
    share = LIMITS.divided(4)

    async def scenario() -> list[float]:
        seen = []
        assert (await limiter.acquire(share, share.token_capacity)).allowed
        limiter.charge(share, tokens=750, debt=LIMITS.token_capacity)
        seen.append(limiter._tenants["acme"].tokens)
        await limiter.reconcile(share, charged=1_000, used=1_100)
        seen.append(limiter._tenants["acme"].tokens)
        limiter.charge(share, tokens=10**18, debt=LIMITS.token_capacity)
        seen.append(limiter._tenants["acme"].tokens)
        return seen

    assert asyncio.run(scenario()) == [-750.0, -750.0, -1_000.0]
