"""Token-bucket arithmetic shared by the local limiter and the Redis one (bucket.lua).

Pure functions of levels and time, so both implementations report the same numbers.
The refill itself is written out in LocalRateLimiter._levels and in bucket.lua, and
bucket.lua repeats `refusal_reason` inside Redis; keep them in step.
"""

from __future__ import annotations

import math

from gateway.ratelimit.base import Decision, Reason, TenantLimits


def wait_s(level: float, *, need: float, per_minute: int) -> float:
    """Seconds until a bucket at `level` holds `need`."""
    return (need - level) * 60.0 / per_minute if level < need else 0.0


def check_tokens(**counts: int) -> None:
    """Token counts are never negative; one that is is a caller's bug, not a refusal."""
    for name, value in counts.items():
        if value < 0:
            raise ValueError(f"{name} must not be negative, got {value}")


def refusal_reason(limits: TenantLimits, *, requests: float, tokens: float, cost: int) -> Reason:
    """Why a request of `cost` tokens cannot be admitted now, or "" when it can."""
    if cost > limits.token_capacity:
        return "too_large"
    if requests < 1:
        return "requests"
    if tokens < cost:
        return "tokens"
    return ""


def retry_after_s(limits: TenantLimits, *, requests: float, tokens: float, cost: int) -> float:
    """Seconds until both buckets hold enough for a request of `cost` tokens."""
    return max(
        wait_s(requests, need=1, per_minute=limits.requests_per_minute),
        wait_s(tokens, need=cost, per_minute=limits.tokens_per_minute),
    )


def decision(
    limits: TenantLimits, *, requests: float, tokens: float, reason: Reason, retry_after: float
) -> Decision:
    """A Decision reporting the levels left after it (debited or not)."""
    return Decision(
        allowed=not reason,
        reason=reason,
        retry_after_s=retry_after,
        limit_requests=limits.request_capacity,
        limit_tokens=limits.token_capacity,
        remaining_requests=math.floor(requests) if requests > 0 else 0,
        remaining_tokens=math.floor(tokens) if tokens > 0 else 0,
        reset_requests_s=wait_s(
            requests, need=limits.request_capacity, per_minute=limits.requests_per_minute
        ),
        reset_tokens_s=wait_s(
            tokens, need=limits.token_capacity, per_minute=limits.tokens_per_minute
        ),
    )


def judged(limits: TenantLimits, *, requests: float, tokens: float, cost: int) -> Decision:
    """The decision for levels as they stand (no debit): refused with its wait, or allowed."""
    reason = refusal_reason(limits, requests=requests, tokens=tokens, cost=cost)
    retry = 0.0
    if reason in ("requests", "tokens"):
        retry = retry_after_s(limits, requests=requests, tokens=tokens, cost=cost)
    return decision(limits, requests=requests, tokens=tokens, reason=reason, retry_after=retry)


def full(limits: TenantLimits) -> Decision:
    """Both buckets full: what an idle tenant, or one not being limited, looks like."""
    return decision(
        limits,
        requests=limits.request_capacity,
        tokens=limits.token_capacity,
        reason="",
        retry_after=0.0,
    )
