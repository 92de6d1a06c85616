"""The in-process token buckets, driven by a manual clock."""

import asyncio

import pytest

from gateway.clock import ManualClock
from gateway.ratelimit import Decision, LocalRateLimiter, TenantLimits


def limits(*, tenant: str = "acme", **overrides: int) -> TenantLimits:
    values = {"requests_per_minute": 60, "tokens_per_minute": 10_000, **overrides}
    return TenantLimits(tenant=tenant, **values)


def acquire(limiter: LocalRateLimiter, tenant: TenantLimits, tokens: int) -> Decision:
    return asyncio.run(limiter.acquire(tenant, tokens))


def test_fresh_tenant_starts_full_and_is_debited() -> None:
    limiter = LocalRateLimiter(ManualClock())
    decision = acquire(limiter, limits(), 400)
    assert decision.allowed
    assert decision.reason == ""
    assert decision.retry_after_s == 0.0
    assert (decision.limit_requests, decision.limit_tokens) == (60, 10_000)
    assert (decision.remaining_requests, decision.remaining_tokens) == (59, 9_600)
    assert decision.reset_requests_s == pytest.approx(1.0)
    assert decision.reset_tokens_s == pytest.approx(2.4)


def test_request_bucket_refuses_with_time_until_next_request() -> None:
    clock = ManualClock()
    limiter = LocalRateLimiter(clock)
    tenant = limits(requests_per_minute=3)
    assert [acquire(limiter, tenant, 1).allowed for _ in range(4)] == [True, True, True, False]
    refused = acquire(limiter, tenant, 1)
    assert refused.reason == "requests"
    assert refused.retry_after_s == pytest.approx(20.0)
    clock.advance(19.9)
    assert not acquire(limiter, tenant, 1).allowed
    clock.advance(0.1)
    assert acquire(limiter, tenant, 1).allowed


def test_token_bucket_refuses_until_it_holds_the_request() -> None:
    clock = ManualClock()
    limiter = LocalRateLimiter(clock)
    tenant = limits(tokens_per_minute=1_000)
    assert acquire(limiter, tenant, 600).allowed
    refused = acquire(limiter, tenant, 600)
    assert (refused.allowed, refused.reason) == (False, "tokens")
    assert refused.remaining_tokens == 400
    assert refused.retry_after_s == pytest.approx(12.0)
    clock.advance(12.0)
    assert acquire(limiter, tenant, 600).allowed


def test_refusal_waits_for_both_buckets() -> None:
    limiter = LocalRateLimiter(ManualClock())
    tenant = limits(requests_per_minute=1, tokens_per_minute=600)
    assert acquire(limiter, tenant, 600).allowed
    refused = acquire(limiter, tenant, 300)
    assert refused.reason == "requests"
    assert refused.retry_after_s == pytest.approx(60.0)


def test_request_larger_than_the_bucket_is_refused_at_once_without_debit() -> None:
    limiter = LocalRateLimiter(ManualClock())
    tenant = limits(tokens_per_minute=10_000, token_burst=2_000)
    refused = acquire(limiter, tenant, 2_001)
    assert (refused.allowed, refused.reason, refused.retry_after_s) == (False, "too_large", 0.0)
    assert (refused.remaining_requests, refused.remaining_tokens) == (60, 2_000)
    assert acquire(limiter, tenant, 2_000).allowed


def test_burst_caps_the_bucket_and_refill() -> None:
    clock = ManualClock()
    limiter = LocalRateLimiter(clock)
    tenant = limits(requests_per_minute=60, request_burst=2)
    assert [acquire(limiter, tenant, 0).allowed for _ in range(3)] == [True, True, False]
    clock.advance(3600)
    assert acquire(limiter, tenant, 0).remaining_requests == 1


def test_reconcile_refunds_the_unused_charge() -> None:
    limiter = LocalRateLimiter(ManualClock())
    tenant = limits(tokens_per_minute=10_000)
    assert acquire(limiter, tenant, 4_000).remaining_tokens == 6_000
    asyncio.run(limiter.reconcile(tenant, charged=4_000, used=50))
    assert asyncio.run(limiter.peek(tenant)).remaining_tokens == 9_950


def test_refund_never_fills_past_the_bucket() -> None:
    clock = ManualClock()
    limiter = LocalRateLimiter(clock)
    tenant = limits(tokens_per_minute=1_000)
    acquire(limiter, tenant, 500)
    clock.advance(60)
    asyncio.run(limiter.reconcile(tenant, charged=500, used=0))
    peeked = asyncio.run(limiter.peek(tenant))
    assert (peeked.remaining_tokens, peeked.reset_tokens_s) == (1_000, 0.0)


def test_usage_beyond_the_charge_becomes_debt() -> None:
    clock = ManualClock()
    limiter = LocalRateLimiter(clock)
    tenant = limits(tokens_per_minute=1_000)
    acquire(limiter, tenant, 1_000)
    asyncio.run(limiter.reconcile(tenant, charged=1_000, used=1_500))
    refused = acquire(limiter, tenant, 0)
    assert (refused.allowed, refused.reason, refused.remaining_tokens) == (False, "tokens", 0)
    assert refused.retry_after_s == pytest.approx(30.0)
    assert refused.reset_tokens_s == pytest.approx(90.0)
    clock.advance(30.0)
    assert acquire(limiter, tenant, 0).allowed


def test_peek_does_not_debit() -> None:
    limiter = LocalRateLimiter(ManualClock())
    tenant = limits(requests_per_minute=1)
    for _ in range(3):
        peeked = asyncio.run(limiter.peek(tenant))
        assert (peeked.allowed, peeked.remaining_requests) == (True, 1)
    assert acquire(limiter, tenant, 0).allowed
    assert asyncio.run(limiter.peek(tenant)).reason == "requests"


def test_tenants_have_separate_buckets() -> None:
    limiter = LocalRateLimiter(ManualClock())
    assert acquire(limiter, limits(tenant="a", requests_per_minute=1), 0).allowed
    assert not acquire(limiter, limits(tenant="a", requests_per_minute=1), 0).allowed
    assert acquire(limiter, limits(tenant="b", requests_per_minute=1), 0).allowed


def test_concurrent_tasks_never_overspend() -> None:
    limiter = LocalRateLimiter(ManualClock())
    tenant = limits(requests_per_minute=10)

    async def burst() -> list[Decision]:
        return await asyncio.gather(*(limiter.acquire(tenant, 5) for _ in range(200)))

    assert sum(d.allowed for d in asyncio.run(burst())) == 10


def test_limits_are_validated_and_divided_per_replica() -> None:
    with pytest.raises(ValueError, match="tokens_per_minute"):
        TenantLimits(tenant="x", requests_per_minute=1, tokens_per_minute=0)
    share = limits(requests_per_minute=10, tokens_per_minute=9_000, token_burst=3_000).divided(3)
    assert (share.requests_per_minute, share.request_capacity) == (3, 3)
    assert (share.tokens_per_minute, share.token_capacity) == (3_000, 1_000)
    assert limits(requests_per_minute=2).divided(5).requests_per_minute == 1


def test_a_negative_cost_is_a_caller_bug() -> None:
    """The cost is the gateway's own count; a usage is a backend's, read without raising
    (test_bounded_debt.py)."""
    limiter = LocalRateLimiter(ManualClock())
    with pytest.raises(ValueError, match="tokens"):
        acquire(limiter, limits(), -1)
