"""Retry-After from what is known: the reservations' ages, the average hold, the queue."""

import asyncio

import pytest

from gateway.admission.routing.forecast import HoldTimes, expected_hold_s, seconds_until_fits
from gateway.admission.routing.route import Route
from gateway.admission.routing.router import Router
from gateway.clock import ManualClock
from tests.support.routers import local_router


def _router(clock: ManualClock, *, target_fill: float = 1.0) -> Router:
    return local_router([1000], target_fill=target_fill, block_size=1, clock=clock)


def test_the_queue_ahead_is_served_first_wave_by_wave() -> None:
    # four 250-token reservations half a 2 s hold in; eight waiters of 250 ahead: they take
    # the room freed at 1.5 s and 3.5 s, and the refused request fits at 5.5 s
    seconds = seconds_until_fits(
        tokens=250,
        room=0,
        held=[(0.5, 250)] * 4,
        unaged_tokens=0,
        waiting=[250] * 8,
        hold_s=2.0,
    )
    assert seconds == pytest.approx(5.5)


def test_an_empty_queue_waits_for_the_first_ends_that_make_room() -> None:
    held = [(1.5, 300), (0.5, 300), (0.0, 300)]  # ends in 0.5, 1.5 and 2 s
    kwargs = {"room": 100, "unaged_tokens": 0, "waiting": (), "hold_s": 2.0}
    assert seconds_until_fits(tokens=400, held=held, **kwargs) == pytest.approx(1.0)  # floor
    assert seconds_until_fits(tokens=700, held=held, **kwargs) == pytest.approx(1.5)
    assert seconds_until_fits(tokens=100, held=held, **kwargs) == pytest.approx(1.0)


def test_other_replicas_tokens_are_expected_half_a_hold_away() -> None:
    kwargs = {"room": 0, "held": (), "waiting": (), "hold_s": 6.0}
    assert seconds_until_fits(tokens=100, unaged_tokens=500, **kwargs) == pytest.approx(3.0)


def test_what_can_never_fit_gets_the_ceiling() -> None:
    seconds = seconds_until_fits(
        tokens=2000, room=0, held=[(0.0, 1000)], unaged_tokens=0, waiting=(), hold_s=1.0
    )
    assert seconds == 60.0


def test_a_cold_pool_expects_twice_the_reservations_ages() -> None:
    assert expected_hold_s(HoldTimes(), [0.5, 1.0, 1.5]) == pytest.approx(2.0)
    assert expected_hold_s(HoldTimes(), [0.1]) == pytest.approx(1.0)  # at least a second
    hold = HoldTimes()
    hold.observe(3.0)
    hold.observe(4.0)
    assert expected_hold_s(hold, [0.1]) == pytest.approx(3.2)


def test_a_cold_router_tells_when_its_reservations_should_end_not_a_minute() -> None:
    async def scenario() -> list[float]:
        clock = ManualClock()
        router = _router(clock)
        held = [await router.reserve(Route("p", 250)) for _ in range(4)]
        clock.advance(1.5)
        cold = router.retry_after("p", 250)  # no hold seen: ages 1.5, so 3 s each
        for r in held:
            assert r is not None
        clock.advance(0.5)
        for r in held:
            assert r is not None
            await router.release(r)  # held 2.0 s each
        again = [await router.reserve(Route("p", 250)) for _ in range(4)]
        clock.advance(0.5)
        router.on_waiting("p", lambda: [250] * 4)
        warm = router.retry_after("p", 250)  # ends in 1.5 s, the queue's in 3.5 s
        assert all(r is not None for r in again)
        return [cold, warm]

    assert asyncio.run(scenario()) == pytest.approx([1.5, 3.5])


def test_a_request_that_runs_alone_waits_for_an_idle_backend_not_the_ceiling() -> None:
    async def scenario() -> float:
        clock = ManualClock()
        router = _router(clock, target_fill=0.5)
        held = await router.reserve(Route("p", 400))
        assert held is not None
        clock.advance(2.0)
        return router.retry_after("p", 900)  # over 500, within 1,000: alone, in ~2 s

    assert asyncio.run(scenario()) == pytest.approx(2.0)


def test_refusals_within_a_tenth_of_a_second_share_one_forecast() -> None:
    async def scenario() -> list[float]:
        clock = ManualClock()
        router = _router(clock)
        held = [await router.reserve(Route("p", 500)) for _ in range(2)]
        assert all(r is not None for r in held)
        clock.advance(1.5)
        first = router.retry_after("p", 500)  # cold: ages 1.5, so 1.5 s to go
        clock.advance(0.05)
        shared = router.retry_after("p", 500)
        clock.advance(0.06)
        fresh = router.retry_after("p", 500)
        return [first, shared, fresh]

    assert asyncio.run(scenario()) == pytest.approx([1.5, 1.5, 1.61])
