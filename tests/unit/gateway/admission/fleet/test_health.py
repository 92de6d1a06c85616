"""A backend's health, one event at a time: which state each failure kind, probe and
served request leaves it in, the reason it tells, and the changes of rotation it returns."""

from __future__ import annotations

from gateway.admission.fleet.health import (
    BROKE_OFF,
    EJECT_MAX_S,
    EJECT_S,
    FAILURES_BEFORE_EJECT,
    BackendHealth,
    Change,
    HealthState,
)

UP, DRAINING, EJECTED, PROBING = (
    HealthState.UP,
    HealthState.DRAINING,
    HealthState.EJECTED,
    HealthState.PROBING,
)
TIMEOUT = "timeout before the first byte"
EJECTED_REASON = f"3 requests in a row failed (last: {TIMEOUT})"


def ejected_at(now: float) -> BackendHealth:
    health = BackendHealth()
    for _ in range(FAILURES_BEFORE_EJECT):
        health.failed(now, TIMEOUT)
    return health


def test_consecutive_failures_eject_on_the_threshold_with_the_last_reason() -> None:
    health = BackendHealth()
    assert FAILURES_BEFORE_EJECT == 3
    assert health.failed(10.0, TIMEOUT) is None
    assert health.failed(10.5, "upstream 503") is None
    assert health.state(10.5) is UP and health.in_rotation(10.5)
    assert health.failed(11.0, TIMEOUT) == Change(up=False, reason=EJECTED_REASON)
    assert health.state(11.0) is EJECTED and health.reason == EJECTED_REASON
    assert not health.in_rotation(11.0)


def test_a_failure_without_words_is_ejected_without_a_last_reason() -> None:
    health = BackendHealth(failures=1)
    assert health.failed(0.0) == Change(up=False, reason="1 requests in a row failed")


def test_a_served_request_resets_the_count() -> None:
    health = BackendHealth()
    health.failed(0.0, TIMEOUT)
    health.failed(0.0, TIMEOUT)
    assert health.served(0.0) is None
    health.failed(0.0, TIMEOUT)
    health.failed(0.0, TIMEOUT)
    assert health.state(0.0) is UP
    health.failed(0.0, TIMEOUT)
    assert health.state(0.0) is EJECTED


def test_a_passing_probe_does_not_reset_the_count_of_a_backend_in_rotation() -> None:
    """A probe reads /v1/models or /health: it shows the server lives, not that its
    requests succeed (a backend hung on completions answers it)."""
    health = BackendHealth()
    health.failed(0.0, TIMEOUT)
    health.failed(0.0, TIMEOUT)
    assert health.probe_passed(0.5) is None
    assert health.failed(1.0, TIMEOUT) == Change(up=False, reason=EJECTED_REASON)


def test_an_ejection_lasts_its_cool_down_then_the_backend_is_probed() -> None:
    health = ejected_at(10.0)
    assert not health.probe_due(10.0 + EJECT_S - 0.001)
    assert health.probe_passed(10.0 + EJECT_S - 0.001) is None  # a regular probe, too soon
    assert health.state(10.0 + EJECT_S - 0.001) is EJECTED
    assert health.state(10.0 + EJECT_S) is PROBING and health.probe_due(10.0 + EJECT_S)
    assert not health.in_rotation(10.0 + EJECT_S)  # time alone brings nothing back
    assert health.reason == EJECTED_REASON


def test_a_probe_that_passes_while_probing_brings_it_up() -> None:
    health = ejected_at(10.0)
    assert health.probe_passed(15.0) == Change(up=True, reason=EJECTED_REASON)
    assert health.state(15.0) is UP and health.reason is None
    assert health.probe_passed(16.0) is None
    # and its count started again: three more failures to eject it
    health.failed(16.0, TIMEOUT)
    health.failed(16.0, TIMEOUT)
    assert health.state(16.0) is UP


def test_a_request_served_while_probing_brings_it_up() -> None:
    health = ejected_at(10.0)
    assert health.served(12.0) is None  # one sent before the ejection: the cool-down stands
    assert health.state(12.0) is EJECTED
    assert health.served(15.0) == Change(up=True, reason=EJECTED_REASON)
    assert health.state(15.0) is UP


def test_a_failure_while_probing_ejects_again_for_twice_the_cool_down() -> None:
    health = ejected_at(0.0)
    now = EJECT_S
    cool_downs = []
    for _ in range(6):
        assert health.state(now) is PROBING
        assert health.failed(now, TIMEOUT) is None  # out already: no change of rotation
        assert health.reason == f"a request failed after its cool-down (last: {TIMEOUT})"
        until = now
        while health.state(until) is EJECTED:
            until += 0.25
        cool_downs.append(until - now)
        now = until
    assert cool_downs == [2 * EJECT_S, 4 * EJECT_S, 8 * EJECT_S] + [EJECT_MAX_S] * 3
    # back up, its next ejection is the first cool-down again
    assert health.probe_passed(now) == Change(
        up=True, reason=f"a request failed after its cool-down (last: {TIMEOUT})"
    )
    for _ in range(FAILURES_BEFORE_EJECT):
        health.failed(now, TIMEOUT)
    assert health.state(now + EJECT_S - 0.001) is EJECTED
    assert health.state(now + EJECT_S) is PROBING


def test_a_failure_while_ejected_holds_it_out_a_full_cool_down_from_then() -> None:
    """Requests in flight when it was ejected fail one after another: each holds it out
    from its own time, without growing the cool-down."""
    health = ejected_at(0.0)
    assert health.failed(3.0, "upstream 502") is None
    assert health.reason == "3 requests in a row failed (last: upstream 502)"
    assert health.state(3.0 + EJECT_S - 0.001) is EJECTED
    assert health.state(3.0 + EJECT_S) is PROBING


def test_a_request_served_while_ejected_restarts_the_count_and_the_cool_down_stands() -> None:
    health = ejected_at(0.0)
    health.served(1.0)
    assert health.failed(2.0, TIMEOUT) is None  # one in a row: the cool-down is not lengthened
    assert health.state(EJECT_S) is PROBING


def test_a_stream_broken_off_drains_it_at_once_until_a_probe_passes() -> None:
    health = BackendHealth()
    assert health.broke_off() == Change(up=False, reason=BROKE_OFF)
    assert health.state(0.0) is DRAINING and health.probe_due(0.0)
    assert health.reason == "it broke off a stream mid-answer"
    # what it still had in flight may finish: a draining server takes nothing new
    assert health.served(0.1) is None and health.state(0.1) is DRAINING
    assert health.broke_off() is None
    assert health.probe_passed(1.0) == Change(up=True, reason=BROKE_OFF)
    assert health.state(1.0) is UP


def test_a_broken_off_stream_is_not_counted_as_a_failed_request() -> None:
    health = BackendHealth()
    health.failed(0.0, TIMEOUT)
    health.broke_off()
    health.probe_passed(1.0)  # back, and its count started again
    health.failed(2.0, TIMEOUT)
    health.failed(2.0, TIMEOUT)
    assert health.state(2.0) is UP


def test_an_unreachable_backend_is_out_at_once_and_counted_as_a_failure() -> None:
    health = BackendHealth()
    health.failed(0.0, TIMEOUT)
    assert health.unreachable("connection refused at http://x") == Change(
        up=False, reason="connection refused at http://x"
    )
    assert health.state(0.0) is DRAINING and health.probe_due(0.0)
    # still counted while it drains: the third failure in a row ejects it, told by no change
    assert health.failed(0.5, TIMEOUT) is None
    assert health.state(0.5) is EJECTED and health.reason == EJECTED_REASON
    assert not health.probe_due(0.5)
    assert health.state(0.5 + EJECT_S) is PROBING


def test_a_probe_that_fails_drains_and_repeated_probes_change_only_the_reason() -> None:
    health = BackendHealth()
    assert health.probe_failed("GET /health answered 503") == Change(
        up=False, reason="GET /health answered 503"
    )
    assert health.probe_failed("GET /health answered 503") is None
    assert health.probe_failed("no answer from http://x within 5 s") is None
    assert health.state(0.0) is DRAINING
    assert health.reason == "no answer from http://x within 5 s"
    assert health.probe_passed(1.0) == Change(up=True, reason="no answer from http://x within 5 s")


def test_out_of_rotation_a_running_cool_down_stands_whatever_else_happens() -> None:
    health = ejected_at(0.0)
    assert health.probe_failed("it serves 'x', not 'm' (check served_model)") is None
    assert health.broke_off() is None
    assert health.unreachable("connection refused at http://x") is None
    assert health.state(EJECT_S - 0.001) is EJECTED
    assert health.reason == "connection refused at http://x"
    assert health.state(EJECT_S) is PROBING
    assert health.probe_passed(EJECT_S) == Change(up=True, reason="connection refused at http://x")


def test_a_probe_failing_while_probing_keeps_it_probed_without_a_new_cool_down() -> None:
    health = ejected_at(0.0)
    assert health.probe_failed("GET /v1/models answered 500") is None
    assert health.state(EJECT_S) is PROBING and health.probe_due(EJECT_S)
    assert health.probe_passed(EJECT_S + 1.0) == Change(
        up=True, reason="GET /v1/models answered 500"
    )


def test_the_threshold_and_cool_downs_are_the_machines_own() -> None:
    health = BackendHealth(failures=2, cooldown_s=1.0, max_cooldown_s=1.5)
    health.failed(0.0)
    assert health.failed(0.0) == Change(up=False, reason="2 requests in a row failed")
    assert health.state(0.999) is EJECTED and health.state(1.0) is PROBING
    health.failed(1.0)
    assert health.state(2.499) is EJECTED and health.state(2.5) is PROBING
