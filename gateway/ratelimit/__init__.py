"""Per-tenant request and token buckets: shared in Redis, local in-process, or both."""

from gateway.ratelimit.base import Decision, RateLimiter, StoreError, TenantLimits, format_duration
from gateway.ratelimit.local import LocalRateLimiter
from gateway.ratelimit.redis_limiter import RedisRateLimiter
from gateway.ratelimit.resilient import FailureMode, Mode, ResilientRateLimiter

__all__ = [
    "Decision",
    "FailureMode",
    "LocalRateLimiter",
    "Mode",
    "RateLimiter",
    "RedisRateLimiter",
    "ResilientRateLimiter",
    "StoreError",
    "TenantLimits",
    "format_duration",
]
