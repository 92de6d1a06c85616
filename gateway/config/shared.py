"""What the replicas share through Redis: the store itself, the tenants' rate limits and
the in-flight ledger, each with what it does when Redis fails."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from gateway.config.base import _Model


class RedisSettings(_Model):
    """The shared store. With Redis configured the rate limits, the in-flight ledger, the
    response cache, the provider budgets, queue wake-ups and the queues' attained service and
    waiting tenants are shared by every replica and worker."""

    url_env: str = Field(
        "SPILLGATE_REDIS_URL",
        description=(
            "env variable holding the Redis URL (`serve --redis URL` wins); unset: in-process "
            "state, one process"
        ),
    )
    timeout_ms: float = Field(
        250.0,
        gt=0,
        description=(
            "floor of a Redis call's time budget, which follows the round trips the process sees "
            "up to `timeout_max_ms`; a call over it counts as a failure "
            "([how](architecture.md#redis-call-budgets))"
        ),
    )
    timeout_max_ms: float = Field(
        1000.0,
        gt=0,
        description=(
            "ceiling of a Redis call's time budget: what a stalled store costs a request "
            "before the breaker opens"
        ),
    )
    cluster: bool = Field(
        False,
        description=(
            "the Redis URL names one node of a Redis Cluster (deploy/README.md says when to "
            "use one, and what a master's failover costs)"
        ),
    )


class RateLimitSettings(_Model):
    """The tenants' token buckets, and what they do when Redis fails."""

    failure_mode: Literal["local", "allow", "deny"] = Field(
        "local",
        description=(
            "when a Redis call fails (on a Redis Cluster, for a dead master's tenants only): "
            "`local` (this process's own buckets at limit ÷ (`replicas` × "
            "`--workers`)), `allow` (unlimited), or `deny` (503, code "
            "`ratelimit_store_unavailable`, outcome `rejected`, `Retry-After` the breaker's "
            "remaining cooldown; only once the breaker is open, before that the local share)"
        ),
    )
    replicas: int = Field(
        1,
        gt=0,
        description=(
            "gateway replicas sharing the limits; sizes the `local` share only, Redis mode is "
            "exact whatever the count"
        ),
    )
    failure_threshold: int = Field(
        3,
        gt=0,
        description=(
            "consecutive failed calls before the limiter stops calling Redis, for `cooldown_s`"
        ),
    )
    cooldown_s: float = Field(
        5.0,
        gt=0,
        description=(
            "how long the limiter stays off Redis after `failure_threshold` failures before one "
            "call probes it; shared limiting resumes by itself "
            "([how](architecture.md#the-rate-limiter-off-redis))"
        ),
    )
    slice_s: float = Field(
        0.5,
        ge=0,
        le=5,
        description=(
            "with Redis, seconds of a tenant's refill one process may spend without a round trip; "
            "other replicas see an unspent grant as used for at most this long. `0`: every request "
            "asks Redis ([how](architecture.md#rate-limit-grants))"
        ),
    )


class LedgerSettings(_Model):
    """The in-flight ledger shared through Redis (when a Redis URL is configured): each
    replica holds one lease per backend, a grant of the backend's room that Redis made it
    (what its requests hold plus a spare, `spare` of the room left), and admits within it
    without a call, asking Redis only when a request does not fit. When Redis refuses a
    request for room other grants hold spare, the refusal is published: no grant gets a spare
    for 5 × `refresh_s`, each gives its spare back at once, and releases are given back (and
    published) as they happen."""

    lease_ttl_s: float = Field(
        10.0,
        gt=0,
        description="a lease's time to live: a dead replica's reservations are freed within it",
    )
    refresh_s: float = Field(
        0.2,
        gt=0,
        description=(
            "how often each grant is renewed and sized again to its requests and totals are "
            "read, so other replicas see this one's releases within it; at most a third of "
            "`lease_ttl_s`"
        ),
    )
    spare: float = Field(
        0.125,
        ge=0,
        le=0.5,
        description=(
            "the share of the room left beyond its requests that a replica's grant holds, "
            "admitted without a call; `0`: every "
            "admission and release asks Redis, as exact at the margin as one process"
        ),
    )

    @model_validator(mode="after")
    def _check(self) -> LedgerSettings:
        if self.refresh_s * 3 > self.lease_ttl_s:
            raise ValueError("refresh_s must be at most a third of lease_ttl_s")
        return self
