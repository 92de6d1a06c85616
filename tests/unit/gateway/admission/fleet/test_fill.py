"""The effective fill backs off quickly on preemption or waiting, recovers slowly while the
backend is busy and at once once it is idle, and overbooks as far as the evidence shows."""

import pytest

from gateway.admission.fleet.fill import (
    DECAY_PER_S,
    MAX_FILL,
    OVERBOOK_PER_S,
    FillController,
    FillReason,
)
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


def test_waiting_under_a_cache_below_the_target_fill_is_no_reason_to_back_off() -> None:
    """A burst's arrivals wait for the engine's next step: caught on two scrapes in a row
    while the cache is half full, they say nothing about memory."""
    clock = ManualClock()
    fill = FillController(0.9)
    for _ in range(4):
        clock.advance(0.5)
        assert fill.observe(now=clock.monotonic(), preempted=False, waiting=True, held=0.6) is None
    assert fill.fill == 0.9
    clock.advance(0.5)
    assert fill.observe(now=clock.monotonic(), preempted=False, waiting=True, held=0.92) is (
        FillReason.WAITING
    )
    assert fill.fill == pytest.approx(0.72)


def test_the_fill_never_drops_below_a_tenth_of_the_target() -> None:
    clock = ManualClock()
    fill = FillController(0.5)
    for _ in range(50):
        clock.advance(0.5)
        fill.observe(now=clock.monotonic(), preempted=True, waiting=False)
    assert fill.fill == pytest.approx(0.05)


def scrape(
    fill: FillController, clock: ManualClock, seconds: float, *, held: float, reserved: float
) -> None:
    clock.advance(seconds)
    fill.observe(
        now=clock.monotonic(), preempted=False, waiting=False, held=held, reserved=reserved
    )


def busy(fill: FillController, clock: ManualClock, seconds: float, *, ratio: float) -> None:
    """Scrapes every 0.5 s for `seconds` of a ledger at the target, holding `ratio` of it."""
    for _ in range(round(seconds / 0.5)):
        scrape(fill, clock, 0.5, held=fill.target * ratio, reserved=fill.target)


def test_a_full_ledger_over_a_backend_holding_less_raises_the_fill_to_reach_the_target() -> None:
    clock = ManualClock()
    fill = FillController(0.9)
    scrape(fill, clock, 0.0, held=0.0, reserved=0.0)
    busy(fill, clock, 1.0, ratio=0.9)  # the ratio starts at 1 and comes down on evidence
    assert fill.held_per_reserved == pytest.approx(1 - DECAY_PER_S)
    assert fill.fill == pytest.approx(0.9 / (1 - DECAY_PER_S))
    assert fill.reason is FillReason.CALIBRATED
    busy(fill, clock, 60.0, ratio=0.95)  # no lower than what the backend is seen to hold
    assert fill.held_per_reserved == pytest.approx(0.95)
    assert fill.fill == pytest.approx(0.9 / 0.95)
    busy(fill, clock, 0.5, ratio=0.97)  # a higher ratio counts at once
    assert fill.held_per_reserved == pytest.approx(0.97)
    assert fill.fill == pytest.approx(0.9 / 0.97)


def test_strong_evidence_overbooks_gradually_up_to_the_whole_cache() -> None:
    """The ledger reserves ~2.9x what the backend holds: the fill climbs from 0.5 towards
    0.5 ÷ 0.35, as fast as the ratio comes down and at most 0.05 a second, and stops at the
    whole cache."""
    clock = ManualClock()
    fill = FillController(0.5)
    scrape(fill, clock, 0.0, held=0.0, reserved=0.0)
    busy(fill, clock, 0.5, ratio=0.35)  # one scrape moves the ratio by half a second's decay
    assert fill.held_per_reserved == pytest.approx(1 - DECAY_PER_S / 2)
    assert fill.fill == pytest.approx(0.5 / (1 - DECAY_PER_S / 2))
    busy(fill, clock, 9.5, ratio=0.35)  # 10 s: the ratio bounds the rise
    assert fill.held_per_reserved == pytest.approx(0.7)
    assert fill.fill == pytest.approx(0.5 / 0.7)
    busy(fill, clock, 5.0, ratio=0.35)  # 15 s: the ratio at 0.55, its last bound
    assert fill.fill == pytest.approx(0.5 / 0.55)
    busy(fill, clock, 0.5, ratio=0.35)  # then the rate: 0.05 a second
    assert fill.held_per_reserved == pytest.approx(0.535)
    assert fill.fill == pytest.approx(0.5 / 0.55 + 0.5 * OVERBOOK_PER_S * 0.5)
    busy(fill, clock, 1.5, ratio=0.35)  # 17 s: the ratio at the target, the fill at the cache
    assert fill.held_per_reserved == pytest.approx(0.5)
    assert fill.fill == MAX_FILL
    assert fill.reason is FillReason.CALIBRATED
    busy(fill, clock, 60.0, ratio=0.35)  # no further than the whole cache
    assert fill.fill == MAX_FILL
    busy(fill, clock, 0.5, ratio=0.8)  # a higher ratio brings it down at once
    assert fill.fill == pytest.approx(0.5 / 0.8)


def test_the_fill_never_passes_the_whole_cache() -> None:
    """A backend reporting nothing held under a full ledger: the ratio stops where target ÷
    ratio is the whole cache, and with it the fill."""
    clock = ManualClock()
    fill = FillController(0.8)
    busy(fill, clock, 200.0, ratio=0.0)
    assert fill.held_per_reserved == pytest.approx(0.8)
    assert fill.fill == pytest.approx(MAX_FILL)


def test_a_thinly_filled_ledger_never_raises_the_fill() -> None:
    clock = ManualClock()
    fill = FillController(0.9)
    for _ in range(200):  # 100 s of a ledger at 0.44, just under half the target
        scrape(fill, clock, 0.5, held=0.44 * 0.35, reserved=0.44)
    assert fill.held_per_reserved == 1.0
    assert fill.fill == 0.9
    assert fill.reason is FillReason.TARGET


def test_the_ratio_moves_only_on_a_well_filled_ledger_a_second_a_scrape_at_most() -> None:
    clock = ManualClock()
    fill = FillController(0.9)
    scrape(fill, clock, 0.0, held=0.0, reserved=0.0)
    busy(fill, clock, 2.0, ratio=0.5)
    assert fill.held_per_reserved == pytest.approx(1 - 2 * DECAY_PER_S)
    scrape(fill, clock, 600.0, held=0.05, reserved=0.1)  # nearly idle: says nothing of a peak
    assert fill.held_per_reserved == pytest.approx(1 - 2 * DECAY_PER_S)
    scrape(fill, clock, 600.0, held=0.45, reserved=0.9)  # after a gap: one second's worth
    assert fill.held_per_reserved == pytest.approx(1 - 3 * DECAY_PER_S)


def test_a_backend_holding_more_than_reserved_keeps_the_target() -> None:
    clock = ManualClock()
    fill = FillController(0.9)
    busy(fill, clock, 5.0, ratio=0.8)
    scrape(fill, clock, 0.5, held=0.95, reserved=0.7)  # traffic that bypasses the gateway
    assert fill.held_per_reserved == 1.0
    assert fill.fill == 0.9
    assert fill.reason is FillReason.TARGET


def test_a_back_off_forgets_the_calibration_and_recovers_only_to_the_target() -> None:
    clock = ManualClock()
    fill = FillController(0.9)
    busy(fill, clock, 100.0, ratio=0.8)
    assert fill.fill == pytest.approx(MAX_FILL)  # 0.9 ÷ 0.8 is past the whole cache
    clock.advance(0.5)
    assert fill.observe(now=clock.monotonic(), preempted=True, waiting=False) is (
        FillReason.PREEMPTION
    )
    assert fill.fill == pytest.approx(0.72)  # from the target, not from the overbooked fill
    assert fill.held_per_reserved == 1.0
    busy(fill, clock, 18.0, ratio=0.8)  # recovering: no calibration until at the target
    assert fill.fill == pytest.approx(0.9)
    assert fill.held_per_reserved == 1.0
    busy(fill, clock, 2.0, ratio=0.8)
    assert fill.held_per_reserved == pytest.approx(1 - 2 * DECAY_PER_S)


def test_a_preemption_while_overbooked_drops_the_fill_at_once_and_starts_again_from_1() -> None:
    clock = ManualClock()
    fill = FillController(0.9)
    busy(fill, clock, 100.0, ratio=0.35)
    assert fill.fill == pytest.approx(MAX_FILL)  # overbooked up to the whole cache
    clock.advance(0.5)
    assert fill.observe(now=clock.monotonic(), preempted=True, waiting=False) is (
        FillReason.PREEMPTION
    )
    assert fill.fill == pytest.approx(0.72)
    assert fill.held_per_reserved == 1.0
    busy(fill, clock, 18.0, ratio=0.35)  # back at the target, busy: 0.01 a second
    assert fill.fill == pytest.approx(0.9)
    busy(fill, clock, 1.0, ratio=0.35)  # the calibration from 1 again
    assert fill.held_per_reserved == pytest.approx(1 - DECAY_PER_S)
    assert fill.fill == pytest.approx(0.9 / (1 - DECAY_PER_S))


def test_requests_waiting_in_a_full_backend_while_overbooked_drop_the_fill_at_once() -> None:
    clock = ManualClock()
    fill = FillController(0.9)
    busy(fill, clock, 100.0, ratio=0.35)
    for reason in (None, FillReason.WAITING):
        clock.advance(0.5)
        assert (
            fill.observe(
                now=clock.monotonic(), preempted=False, waiting=True, held=0.95, reserved=2.5
            )
            is reason
        )
    assert fill.fill == pytest.approx(0.72)
    assert fill.held_per_reserved == 1.0


def idle(fill: FillController, clock: ManualClock) -> None:
    clock.advance(0.5)
    assert fill.observe(now=clock.monotonic(), preempted=False, waiting=False, idle=True) is None


def test_an_idle_backend_is_back_at_the_target_on_the_second_idle_scrape() -> None:
    clock = ManualClock()
    fill = FillController(0.9)
    for _ in range(10):
        clock.advance(0.5)
        fill.observe(now=clock.monotonic(), preempted=True, waiting=False, idle=True)
    assert fill.fill == pytest.approx(0.9 * 0.8**10)
    idle(fill, clock)  # the first may fall between two requests: the slow climb
    assert fill.fill == pytest.approx(0.9 * 0.8**10 + 0.005)
    assert fill.reason is FillReason.RECOVERING
    idle(fill, clock)
    assert fill.fill == 0.9
    assert fill.reason is FillReason.TARGET
    assert fill.held_per_reserved == 1.0  # idle says nothing of what reservations hold


def test_the_scrape_that_backs_off_does_not_count_as_idle() -> None:
    clock = ManualClock()
    fill = FillController(0.9)
    idle(fill, clock)
    idle(fill, clock)
    clock.advance(0.5)
    assert fill.observe(now=clock.monotonic(), preempted=True, waiting=False, idle=True) is (
        FillReason.PREEMPTION
    )
    idle(fill, clock)
    assert fill.fill == pytest.approx(0.725)
    idle(fill, clock)
    assert fill.fill == 0.9


def test_a_busy_scrape_between_idle_ones_starts_the_count_again() -> None:
    clock = ManualClock()
    fill = FillController(0.9)
    clock.advance(0.5)
    fill.observe(now=clock.monotonic(), preempted=True, waiting=False)
    idle(fill, clock)
    calm(fill, clock, 0.5)  # running again: the evidence may still be there
    idle(fill, clock)
    assert fill.fill == pytest.approx(0.735)
    assert fill.reason is FillReason.RECOVERING
    idle(fill, clock)
    assert fill.fill == 0.9


def test_a_busy_backend_still_climbs_back_slowly() -> None:
    clock = ManualClock()
    fill = FillController(0.9)
    clock.advance(0.5)
    fill.observe(now=clock.monotonic(), preempted=True, waiting=False)
    for _ in range(20):
        calm(fill, clock, 0.5)
    assert fill.fill == pytest.approx(0.82)
    assert fill.reason is FillReason.RECOVERING
