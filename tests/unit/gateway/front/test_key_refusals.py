"""Refused keys in the log: a line at most every few seconds, counting the ones it skipped,
and never more of a key than OpenAI's errors show."""

from __future__ import annotations

import logging

import pytest
from prometheus_client import CollectorRegistry, Counter

from gateway.clock import ManualClock
from gateway.front.auth import KeyRefusals, shown_key


def test_a_key_shows_its_first_characters_and_at_most_a_third() -> None:
    assert shown_key("sk-0123456789abcdefghijk") == "sk-01234" + "*" * 16
    assert shown_key("sk-abc") == "sk" + "****"
    assert shown_key("ab") == "**"


def test_lines_are_a_quiet_period_apart_and_tell_what_they_skipped(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="spillgate.auth")
    registry = CollectorRegistry()
    counter = Counter("refused", "", ["reason"], registry=registry)
    clock = ManualClock()
    refusals = KeyRefusals(counter, clock=clock, every_s=10)
    refusals.refused("sk-first-key-000000")
    clock.advance(5)
    refusals.refused(None)
    refusals.refused("sk-other-key-000000")
    clock.advance(5)
    refusals.refused(None)
    assert [r.getMessage() for r in caplog.records] == [
        "refused a request: incorrect API key sk-fir*************",
        "refused a request: no API key (2 more refused since the last line)",
    ]
    assert registry.get_sample_value("refused_total", {"reason": "incorrect"}) == 2
    assert registry.get_sample_value("refused_total", {"reason": "missing"}) == 2
