"""What a rate limiter promises: a tenant's limits, one decision, and the role interface.

Each tenant has two token buckets: requests (1 per request) and tokens (prompt estimate plus
the most output it may ask for). A bucket holds at most its burst and refills at its
per-minute rate. A decision checks and debits both at once; reconcile later settles the
charge with the real usage, and may leave the token bucket below zero (debt the tenant
repays by waiting, at most one bucket: gateway/ratelimit/bucket.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal, Protocol

Reason = Literal["", "requests", "tokens", "too_large", "store_unavailable"]


class StoreError(Exception):
    """The shared store behind a limiter could not answer (connection, protocol, script)."""


@dataclass(frozen=True, kw_only=True)
class TenantLimits:
    tenant: str
    requests_per_minute: int
    tokens_per_minute: int
    request_burst: int | None = None  # bucket size; None = requests_per_minute
    token_burst: int | None = None  # bucket size; None = tokens_per_minute
    request_capacity: int = field(init=False)  # the request bucket's size
    token_capacity: int = field(init=False)  # the token bucket's size

    def __post_init__(self) -> None:
        for name in ("requests_per_minute", "tokens_per_minute", "request_burst", "token_burst"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name} must be at least 1, got {value}")
        # read on every decision: worked out once
        object.__setattr__(self, "request_capacity", self.request_burst or self.requests_per_minute)
        object.__setattr__(self, "token_capacity", self.token_burst or self.tokens_per_minute)

    def divided(self, replicas: int) -> TenantLimits:
        """This tenant's share on one of `replicas` gateways that cannot see each other."""
        if replicas <= 1:
            return self
        return TenantLimits(
            tenant=self.tenant,
            requests_per_minute=max(1, self.requests_per_minute // replicas),
            tokens_per_minute=max(1, self.tokens_per_minute // replicas),
            request_burst=max(1, self.request_capacity // replicas),
            token_burst=max(1, self.token_capacity // replicas),
        )


@dataclass(slots=True)
class Decision:
    """The answer for one request, and the bucket state the response headers report.

    `limit_*` are the bucket sizes, `remaining_*` what is left after this decision (never
    below zero), `reset_*_s` the seconds until that bucket is full again.
    """

    allowed: bool
    reason: Reason  # "" when allowed
    retry_after_s: float  # 0.0 when allowed; seconds until both buckets hold enough
    limit_requests: int
    limit_tokens: int
    remaining_requests: int
    remaining_tokens: int
    reset_requests_s: float
    reset_tokens_s: float

    def headers(self) -> list[tuple[bytes, bytes]]:
        """The `x-ratelimit-*` headers, formatted as OpenAI sends them, as ASGI wants them
        (made once per request, they go out as they are made)."""
        return [
            (b"x-ratelimit-limit-requests", b"%d" % self.limit_requests),
            (b"x-ratelimit-limit-tokens", b"%d" % self.limit_tokens),
            (b"x-ratelimit-remaining-requests", b"%d" % self.remaining_requests),
            (b"x-ratelimit-remaining-tokens", b"%d" % self.remaining_tokens),
            (b"x-ratelimit-reset-requests", format_duration(self.reset_requests_s).encode()),
            (b"x-ratelimit-reset-tokens", format_duration(self.reset_tokens_s).encode()),
        ]


def format_duration(seconds: float) -> str:
    """A duration as OpenAI writes it: "0s", "20ms", "1s", "8.64s", "6m0s", "1h2m3s".

    Rounded up to the millisecond, so a client that waits this long finds the bucket ready;
    a nanosecond's float noise (8.64 s is 8640.000000000001 ms) is not rounded up. This
    runs twice per request, so the noise is taken off by a subtraction rather than by
    `round`, which goes through the float-to-string code.
    """
    ms = math.ceil(seconds * 1000 - 1e-6)
    if ms <= 0:
        return "0s"
    if ms < 1000:
        return f"{ms}ms"
    hours, ms = divmod(ms, 3_600_000)
    minutes, ms = divmod(ms, 60_000)
    secs, frac = divmod(ms, 1000)
    text = f"{secs}.{frac:03d}".rstrip("0").rstrip(".") + "s"
    if hours:
        return f"{hours}h{minutes}m{text}"
    if minutes:
        return f"{minutes}m{text}"
    return text


class RateLimiter(Protocol):
    """Per-tenant request and token buckets.

    `acquire` is one atomic check-and-debit of 1 request plus `tokens` tokens: concurrent
    callers never both spend the same capacity. A request larger than a whole bucket is
    refused at once with reason "too_large". `reconcile` settles the charge an admission
    took: it refunds `charged - used` when positive and charges the excess when negative,
    unconditionally, down to one bucket of debt; it never raises for what `used` is (a
    backend's word: one that is no count settles as charged).
    """

    async def acquire(self, limits: TenantLimits, tokens: int) -> Decision: ...

    async def reconcile(self, limits: TenantLimits, *, charged: int, used: int) -> None: ...

    async def peek(self, limits: TenantLimits) -> Decision: ...

    async def close(self) -> None: ...
