"""One circuit breaker for whatever the gateway calls that can fail as a whole: an external
provider (policies/provider/gate.py), the shared rate limiter's store
(gateway/ratelimit/resilient.py). A backend's health is a machine of its own
(gateway/admission/fleet/health.py): it drains, is probed and comes back, which a breaker's
trial does not say.

Closed, it lets everything through and counts consecutive failures; at `failures` of them
(or at once, for a `Retry-After` the callee named) it opens for `cooldown_s` (or that
long); then it is half-open and lets one trial through: a success closes it, a failure
opens it again.
"""

from __future__ import annotations

from collections.abc import Callable
from enum import StrEnum

from gateway.clock import Clock


class BreakerState(StrEnum):
    CLOSED = "closed"
    OPEN = "open"
    HALF_OPEN = "half_open"


class CircuitBreaker:
    """Opens after `failures` consecutive failures, or at once when the callee names a
    `Retry-After`; stays open for that long (else `cooldown_s`), then lets one trial through.
    """

    def __init__(
        self,
        *,
        failures: int,
        cooldown_s: float,
        clock: Clock,
        on_change: Callable[[BreakerState], None] | None = None,
    ) -> None:
        self._threshold = failures
        self._cooldown_s = cooldown_s
        self._clock = clock
        self._on_change = on_change
        self._failures = 0
        self._open_until = float("-inf")
        self._trial_out = False
        self.state = BreakerState.CLOSED

    @property
    def is_open(self) -> bool:
        """Open or half-open: failing, until a trial succeeds."""
        return self.state is not BreakerState.CLOSED

    def _set(self, state: BreakerState) -> None:
        if state is not self.state:
            self.state = state
            if self._on_change is not None:
                self._on_change(state)

    def allow(self) -> bool:
        """Whether a request may go now; in half-open state only one trial at a time."""
        if self.state is BreakerState.OPEN and self._clock.monotonic() >= self._open_until:
            self._set(BreakerState.HALF_OPEN)
        if self.state is BreakerState.CLOSED:
            return True
        if self.state is BreakerState.HALF_OPEN and not self._trial_out:
            self._trial_out = True
            return True
        return False

    def record_success(self) -> None:
        self._failures = 0
        self._trial_out = False
        self._set(BreakerState.CLOSED)

    def record_failure(self, *, retry_after: float | None = None) -> bool:
        """Count a failure; whether it opened the breaker (again)."""
        self._failures += 1
        trial_failed = self.state is BreakerState.HALF_OPEN
        self._trial_out = False
        if retry_after is None and not trial_failed and self._failures < self._threshold:
            return False
        open_s = retry_after if retry_after is not None else self._cooldown_s
        self._open_until = self._clock.monotonic() + max(0.0, open_s)
        self._set(BreakerState.OPEN)
        return True

    def release_trial(self) -> None:
        """A trial that ended with neither success nor failure (e.g. the client left)."""
        self._trial_out = False

    def open_for(self) -> float:
        """Seconds the breaker stays open from now (0 when not open)."""
        if self.state is not BreakerState.OPEN:
            return 0.0
        return max(0.0, self._open_until - self._clock.monotonic())
