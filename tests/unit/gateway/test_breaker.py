"""The one circuit breaker (gateway/breaker.py): thresholds, a named Retry-After, the
half-open trial."""

from __future__ import annotations

from gateway.breaker import BreakerState, CircuitBreaker
from gateway.clock import ManualClock


def test_breaker_opens_after_consecutive_failures_then_lets_one_trial_through() -> None:
    clock = ManualClock()
    states: list[BreakerState] = []
    breaker = CircuitBreaker(failures=2, cooldown_s=10, clock=clock, on_change=states.append)
    breaker.record_failure()
    assert breaker.allow()
    breaker.record_failure()
    assert not breaker.allow() and breaker.open_for() == 10
    clock.advance(10)
    assert breaker.allow()  # the trial
    assert not breaker.allow()  # only one at a time
    breaker.record_failure()  # the trial failed: open again at once
    assert breaker.state is BreakerState.OPEN
    clock.advance(10)
    assert breaker.allow()
    breaker.record_success()
    assert breaker.allow() and breaker.allow()
    assert states == [
        BreakerState.OPEN,
        BreakerState.HALF_OPEN,
        BreakerState.OPEN,
        BreakerState.HALF_OPEN,
        BreakerState.CLOSED,
    ]


def test_a_retry_after_opens_the_breaker_at_once_for_that_long() -> None:
    clock = ManualClock()
    breaker = CircuitBreaker(failures=5, cooldown_s=10, clock=clock)
    breaker.record_failure(retry_after=3.0)
    assert not breaker.allow() and breaker.open_for() == 3.0
    clock.advance(3.0)
    assert breaker.allow()
