"""The time budget a Redis call gets: the waits seen lately, within a floor and a ceiling."""

from __future__ import annotations

import pytest

from gateway.redis_io.batch import Latency


def test_the_budget_is_the_floor_while_waits_are_short() -> None:
    latency = Latency(initial_s=0.001)
    for _ in range(20):
        latency.add(0.002)
    assert latency.budget_s(floor_s=0.25, ceiling_s=1.0) == 0.25


def test_the_budget_grows_with_the_waits_and_stops_at_the_ceiling() -> None:
    latency = Latency(initial_s=0.001)
    latency.add(0.2)  # the first wait seen sets the mean, half of it the spread
    assert latency.budget_s(floor_s=0.05, ceiling_s=1.0) == pytest.approx(0.2 + 4 * 0.1)
    latency.add(0.8)
    # mean 0.875 * 0.2 + 0.125 * 0.8 = 0.275; spread 0.75 * 0.1 + 0.25 * 0.6 = 0.225
    assert latency.budget_s(floor_s=0.05, ceiling_s=2.0) == pytest.approx(0.275 + 4 * 0.225)
    assert latency.budget_s(floor_s=0.05, ceiling_s=1.0) == 1.0
