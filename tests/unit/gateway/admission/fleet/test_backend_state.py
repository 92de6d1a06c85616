"""A backend's state: out of rotation with a reason, back on a good probe, each change
logged once; and a pool's context limit, set or discovered."""

from __future__ import annotations

import logging

import pytest

from gateway.admission.fleet.backends import FALLBACK_MAX_MODEL_LEN, Backend, build_pools
from gateway.admission.fleet.discovery import ServedModel
from gateway.admission.fleet.health import EJECT_S, HealthState
from gateway.clock import ManualClock
from gateway.config import PoolSettings


def backend(served_model: str = "m") -> Backend:
    return Backend(
        name="b", pool="p", url="http://x", served_model=served_model, configured_capacity=100
    )


def lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "spillgate.backends"]


def test_an_unreachable_backend_is_out_at_once_and_each_change_is_logged_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO)
    b = backend()
    b.record_failure(0.0, reason="ClientConnectorError: ...", unreachable="connection refused")
    b.probe_failed("connection refused")  # the probes find the same, again and again
    b.probe_failed("connection refused")
    assert not b.healthy(2.0) and b.down_reason == "connection refused"
    b.probe_passed(3.0)
    b.probe_passed(4.0)
    assert b.healthy(4.0) and b.down_reason is None
    assert lines(caplog) == [
        "backend b is down: connection refused",
        "backend b is up again (was: connection refused)",
    ]


def test_failed_requests_eject_on_the_third_and_hold_it_out_for_the_ejection_time() -> None:
    b = backend()
    b.record_failure(10.0, reason="timeout before the first byte")
    b.record_failure(10.0, reason="timeout before the first byte")
    assert b.healthy(10.0)
    b.record_failure(10.0, reason="timeout before the first byte")
    assert b.down_reason == "3 requests in a row failed (last: timeout before the first byte)"
    assert b.health.state(10.0 + EJECT_S - 0.001) is HealthState.EJECTED
    assert b.health.state(10.0 + EJECT_S) is HealthState.PROBING


def test_a_listing_without_the_served_model_names_what_the_backend_serves() -> None:
    b = backend("llama3")
    assert b.learn([ServedModel(id="llama-3"), ServedModel(id="lora-x")]) == (
        "it serves 'llama-3', 'lora-x', not 'llama3' (check served_model)"
    )
    assert b.learn([ServedModel(id="llama3", root="/w/llama3", max_model_len=4096)]) is None
    assert (b.max_model_len, b.root) == (4096, "/w/llama3")


def test_a_pools_context_limit_is_its_own_else_its_backends_smallest_else_the_fallback() -> None:
    def pool(**extra: object) -> PoolSettings:
        backends = [{"url": "http://a"}, {"url": "http://b"}]
        return PoolSettings.model_validate({"name": "p", "backends": backends, **extra})

    found = build_pools([pool()], clock=ManualClock())["p"]
    assert found.max_model_len == FALLBACK_MAX_MODEL_LEN
    found.learn(found.backends[1], [ServedModel(id="p", max_model_len=8192)])
    assert found.max_model_len == 8192
    found.learn(found.backends[0], [ServedModel(id="p", max_model_len=4096)])
    assert found.max_model_len == 4096
    assert build_pools([pool(max_model_len=1000)], clock=ManualClock())["p"].max_model_len == 1000


def test_a_pools_known_context_is_the_longest_known_and_never_the_fallback() -> None:
    """What bounds an answer's usage: a guess too short would call true counts lies, so
    it is only what is known, and the longest of it (any backend may serve a request)."""

    def pool(**extra: object) -> PoolSettings:
        backends = [{"url": "http://a"}, {"url": "http://b"}]
        return PoolSettings.model_validate({"name": "p", "backends": backends, **extra})

    found = build_pools([pool()], clock=ManualClock())["p"]
    assert found.model_context is None
    found.learn(found.backends[0], [ServedModel(id="p", max_model_len=4096)])
    found.learn(found.backends[1], [ServedModel(id="p", max_model_len=8192)])
    assert found.model_context == 8192
    limited = build_pools([pool(max_model_len=1000)], clock=ManualClock())["p"]
    assert limited.model_context == 1000
    # the engine's own: a request naming no limit may be answered up to it
    limited.learn(limited.backends[0], [ServedModel(id="p", max_model_len=4096)])
    assert limited.model_context == 4096
