"""The shared limiter with a time budget, a circuit breaker and a configured failure mode.

Every call to the primary (Redis) store is bounded by `timeout_s`, so a slow or dead store
never makes a request wait longer than that. A call that fails or runs out of time is
answered by the failure mode instead:

- `local`: this process's own buckets at the tenant's limits divided by `replicas`, so
  the fleet as a whole stays near the tenant's limit instead of multiplying it;
- `allow`: admitted, unlimited, for deployments that prefer serving to throttling;
- `deny`: refused with reason "store_unavailable" (a 503, not a 429).

After `failure_threshold` consecutive failures the circuit opens: the store is left alone
for `cooldown_s`, then one call probes it. When the store answers again, shared limiting
resumes by itself. Every failed call is reported to `on_store_error`; every change of
mode ("shared", "local", "allow", "deny") to `on_mode_change`, starting with "shared".
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Literal, TypeVar

from gateway.clock import Clock
from gateway.deadline import Deadline
from gateway.ratelimit import bucket
from gateway.ratelimit.base import Decision, RateLimiter, StoreError, TenantLimits

FailureMode = Literal["local", "allow", "deny"]
Mode = Literal["shared", "local", "allow", "deny"]
FAILURE_MODES: tuple[FailureMode, ...] = ("local", "allow", "deny")

T = TypeVar("T")


class _StoreDown:
    """The primary was not asked, or did not answer in time."""


_STORE_DOWN = _StoreDown()


class ResilientRateLimiter:
    """A RateLimiter over a shared primary that answers within `timeout_s`, whatever Redis does.

    A reservation made in one mode and reconciled in another settles with whichever store
    answers at reconcile time; the drift is bounded by the requests in flight at the change.
    """

    def __init__(
        self,
        primary: RateLimiter,
        *,
        fallback: RateLimiter,
        failure_mode: FailureMode,
        replicas: int,
        timeout_s: float,
        failure_threshold: int,
        cooldown_s: float,
        clock: Clock,
        on_store_error: Callable[[], None],
        on_mode_change: Callable[[str], None],
    ) -> None:
        if failure_mode not in FAILURE_MODES:
            raise ValueError(f"failure_mode must be one of {FAILURE_MODES}, got {failure_mode!r}")
        if replicas < 1 or failure_threshold < 1 or timeout_s <= 0 or cooldown_s < 0:
            raise ValueError("replicas and failure_threshold must be >= 1, timeout_s > 0")
        self._primary = primary
        self._fallback = fallback
        self._failure_mode: FailureMode = failure_mode
        self._replicas = replicas
        self._timeout_s = timeout_s
        self._failure_threshold = failure_threshold
        self._cooldown_s = cooldown_s
        self._clock = clock
        self._on_store_error = on_store_error
        self._on_mode_change = on_mode_change
        self._failures = 0
        self._open_until: float | None = None
        self._probing = False
        self._mode: Mode = "shared"
        on_mode_change(self._mode)

    @property
    def mode(self) -> Mode:
        return self._mode

    @property
    def circuit_open(self) -> bool:
        return self._open_until is not None

    async def acquire(self, limits: TenantLimits, tokens: int) -> Decision:
        bucket.check_tokens(tokens=tokens)
        shared = await self._ask_primary(lambda: self._primary.acquire(limits, tokens))
        if not isinstance(shared, _StoreDown):
            return shared
        if tokens > limits.token_capacity:
            return bucket.judged(limits, requests=0, tokens=0, cost=tokens)
        if self._failure_mode == "local":
            return await self._acquire_share(limits.divided(self._replicas), tokens)
        if self._failure_mode == "allow":
            return bucket.full(limits)
        return self._unavailable(limits)

    async def _acquire_share(self, share: TenantLimits, tokens: int) -> Decision:
        """Debit this replica's share; a request the whole bucket holds but the share does
        not waits for a full share and leaves the rest as debt, rather than never fitting."""
        if tokens <= share.token_capacity:
            return await self._fallback.acquire(share, tokens)
        decision = await self._fallback.acquire(share, share.token_capacity)
        if decision.allowed:
            await self._fallback.reconcile(share, reserved=share.token_capacity, used=tokens)
        return decision

    async def reconcile(self, limits: TenantLimits, *, reserved: int, used: int) -> None:
        if reserved == used:
            return
        shared = await self._ask_primary(
            lambda: self._primary.reconcile(limits, reserved=reserved, used=used)
        )
        if isinstance(shared, _StoreDown) and self._failure_mode == "local":
            await self._fallback.reconcile(
                limits.divided(self._replicas), reserved=reserved, used=used
            )

    async def peek(self, limits: TenantLimits) -> Decision:
        shared = await self._ask_primary(lambda: self._primary.peek(limits))
        if not isinstance(shared, _StoreDown):
            return shared
        if self._failure_mode == "local":
            return await self._fallback.peek(limits.divided(self._replicas))
        if self._failure_mode == "allow":
            return bucket.full(limits)
        return self._unavailable(limits)

    async def close(self) -> None:
        try:
            await self._primary.close()
        finally:
            await self._fallback.close()

    async def _ask_primary(self, call: Callable[[], Awaitable[T]]) -> T | _StoreDown:
        open_until = self._open_until
        probe = open_until is not None
        if open_until is not None and (self._probing or self._clock.monotonic() < open_until):
            return _STORE_DOWN
        self._probing = probe
        try:
            with Deadline.after(self._timeout_s):
                result = await call()
        except (TimeoutError, StoreError):
            self._failed()
            return _STORE_DOWN
        finally:
            if probe:
                self._probing = False
        self._answered()
        return result

    def _failed(self) -> None:
        self._on_store_error()
        self._failures += 1
        if self._failures >= self._failure_threshold:
            self._open_until = self._clock.monotonic() + self._cooldown_s
        self._set_mode(self._failure_mode)

    def _answered(self) -> None:
        self._failures = 0
        self._open_until = None
        self._set_mode("shared")

    def _set_mode(self, mode: Mode) -> None:
        if mode != self._mode:
            self._mode = mode
            self._on_mode_change(mode)

    def _unavailable(self, limits: TenantLimits) -> Decision:
        wait = self._cooldown_s
        if self._open_until is not None:
            wait = max(0.0, self._open_until - self._clock.monotonic())
        return bucket.decision(
            limits, requests=0, tokens=0, reason="store_unavailable", retry_after=wait
        )
