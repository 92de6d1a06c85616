"""Token-bucket arithmetic shared by the local limiter and the Redis one (bucket.lua).

Pure functions of levels and time, so both implementations report the same numbers.
The refill itself is written out in LocalRateLimiter._levels and in bucket.lua, and
bucket.lua repeats `refusal_reason` and the bounds of `settled_level` inside Redis; keep
them in step.

A settlement may leave a bucket in debt (an answer that used more than it was charged: a
stream that grew), but never more than one bucket's worth: the usage it settles with is
what a backend said, and no number a backend says may lock a tenant out for longer than
the bucket can mean. So a level stays within [-capacity, capacity], every wait it implies
is at most two refills of the bucket (from its floor to full), and a Redis key's expiry
stays finite.
"""

from __future__ import annotations

import logging
import math
from typing import TypeGuard

from gateway.ratelimit.base import Decision, Reason, TenantLimits

log = logging.getLogger("spillgate.ratelimit")


def wait_s(level: float, *, need: float, per_minute: int) -> float:
    """Seconds until a bucket at `level` holds `need`."""
    return (need - level) * 60.0 / per_minute if level < need else 0.0


def check_tokens(**counts: int) -> None:
    """A request's cost is the gateway's own count, never negative: one that is is a caller's
    bug, not a refusal (what an answer says it used is read by `settlement`)."""
    for name, value in counts.items():
        if value < 0:
            raise ValueError(f"{name} must not be negative, got {value}")


def is_count(value: object) -> TypeGuard[int]:
    """Whether `value` is a token count: an int, not negative (a bool is no count)."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def settlement(limits: TenantLimits, *, charged: object, used: object) -> int:
    """What settling a charge of `charged` tokens adds to it in the token bucket:
    `used - charged`, negative for a refund.

    Whatever `used` is, this does not raise: it comes from what an answer said, and the
    settling path must go on to release everything else. A `charged` or `used` that is not
    a count settles as charged (nothing back, nothing more), with a warning. The
    charge is held within two buckets: a level spans no more, so a larger one could change
    nothing, and Redis is never sent a number it cannot hold.
    """
    if is_count(charged) and is_count(used):
        span = 2 * limits.token_capacity
        return max(-span, min(span, used - charged))
    log.warning(
        "%s: a charge of %.40r tokens settled as it stood: used %.40r is not a token count",
        limits.tenant,
        charged,
        used,
    )
    return 0


def settled_level(level: float, charge: int, *, capacity: int, debt: int) -> float:
    """A bucket's level after a settlement's `charge`: never above the bucket's `capacity`,
    and a charge takes it no lower than `debt` below zero (a level already lower stays)."""
    after = level - charge
    if charge > 0:
        return max(after, min(level, -debt))
    return min(after, capacity)


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
