"""The effective fill backs off quickly on preemption or waiting, and recovers slowly."""

import pytest

from gateway.admission.fill import FillController, FillReason
from gateway.clock import ManualClock


def calm(fill: FillController, clock: ManualClock, seconds: float) -> None:
    clock.advance(seconds)
    assert fill.observe(now=clock.monotonic(), preempted=False, waiting=False) is None


def test_a_preemption_multiplies_the_fill_by_0_8_then_it_recovers_0_01_per_second() -> None:
    clock = ManualClock()
    fill = FillController(0.9)
    calm(fill, clock, 0)
    assert fill.observe(now=clock.monotonic(), preempted=True, waiting=False) is (
        FillReason.PREEMPTION
    )
    assert fill.fill == pytest.approx(0.72)
    assert fill.reason is FillReason.PREEMPTION
    calm(fill, clock, 5.0)
    assert fill.fill == pytest.approx(0.77)
    assert fill.reason is FillReason.RECOVERING
    calm(fill, clock, 100.0)
    assert fill.fill == 0.9  # never above the target
    assert fill.reason is FillReason.TARGET
    assert fill.backoffs == {FillReason.PREEMPTION: 1}


def test_waiting_backs_off_only_when_seen_on_two_scrapes_in_a_row() -> None:
    clock = ManualClock()
    fill = FillController(1.0)
    assert fill.observe(now=clock.monotonic(), preempted=False, waiting=True) is None
    assert fill.fill == 1.0  # one scrape may fall between two engine steps
    clock.advance(0.5)
    assert fill.observe(now=clock.monotonic(), preempted=False, waiting=True) is FillReason.WAITING
    assert fill.fill == pytest.approx(0.8)
    clock.advance(0.5)
    assert fill.observe(now=clock.monotonic(), preempted=False, waiting=True) is FillReason.WAITING
    assert fill.fill == pytest.approx(0.64)
    clock.advance(0.5)
    # a calm scrape recovers, 0.01 per second since the last
    assert fill.observe(now=clock.monotonic(), preempted=False, waiting=False) is None
    assert fill.fill == pytest.approx(0.645)
    assert fill.backoffs == {FillReason.WAITING: 2}


def test_the_fill_never_drops_below_a_tenth_of_the_target() -> None:
    clock = ManualClock()
    fill = FillController(0.5)
    for _ in range(50):
        clock.advance(0.5)
        fill.observe(now=clock.monotonic(), preempted=True, waiting=False)
    assert fill.fill == pytest.approx(0.05)
