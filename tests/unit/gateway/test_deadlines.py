import asyncio
from collections.abc import Callable
from typing import Any

import pytest

from gateway.deadlines import Alarm, Deadlines


class RecordingLoop:
    """A loop clock that moves only when told to, recording what would be scheduled."""

    def __init__(self) -> None:
        self.now = 1000.0
        self.timers: list[tuple[float, Callable[..., object], tuple[Any, ...]]] = []

    def time(self) -> float:
        return self.now

    def call_at(self, when: float, callback: Callable[..., object], *args: Any) -> None:
        self.timers.append((when, callback, args))

    def run_until(self, t: float) -> None:
        self.now = t
        due = sorted((x for x in self.timers if x[0] <= t), key=lambda x: x[0])
        self.timers = [x for x in self.timers if x[0] > t]
        for _, callback, args in due:
            callback(*args)


def deadlines_on(loop: RecordingLoop) -> Deadlines:
    return Deadlines(loop)  # type: ignore[arg-type]


@pytest.mark.parametrize("distance", [0.0005, 0.05, 0.1, 1.0, 2.5, 30.0, 600.0, 86400.0])
def test_an_alarm_rings_never_early_and_at_most_a_64th_of_its_distance_late(
    distance: float,
) -> None:
    loop = RecordingLoop()
    deadlines = deadlines_on(loop)
    rang: list[float] = []
    deadlines.call_at(loop.now + distance, lambda: rang.append(loop.now))
    (fires_at, _, _), *_ = loop.timers
    assert fires_at >= loop.now + distance
    assert fires_at - (loop.now + distance) <= max(0.01, distance / 64) + 1e-9
    loop.run_until(fires_at)
    assert rang == [fires_at]


def test_deadlines_due_close_together_share_one_loop_timer() -> None:
    loop = RecordingLoop()
    deadlines = deadlines_on(loop)
    for i in range(1000):  # a thousand requests over 100 ms, each with a 10-minute deadline
        loop.now = 1000.0 + i / 10_000
        deadlines.call_at(loop.now + 600.0, lambda: None)
    assert len(loop.timers) <= 2  # two only if the hundred milliseconds straddle a slot edge


def test_a_cancelled_alarm_never_rings_even_when_another_in_its_slot_cancels_it() -> None:
    loop = RecordingLoop()
    deadlines = deadlines_on(loop)
    rang: list[str] = []
    alarms: dict[str, Alarm] = {}

    def ring(name: str, other: str) -> Callable[[], None]:
        def callback() -> None:
            rang.append(name)
            alarms[other].cancel()
            alarms[name].cancel()  # cancelling one that has rung is harmless

        return callback

    alarms["a"] = deadlines.call_at(loop.now + 0.05, ring("a", "b"))
    alarms["b"] = deadlines.call_at(loop.now + 0.05, ring("b", "a"))
    alarms["c"] = deadlines.call_at(loop.now + 0.05, lambda: rang.append("c"))
    alarms["c"].cancel()
    loop.run_until(loop.now + 1)
    assert rang in (["a"], ["b"])  # whichever rings first silences the other


def test_a_block_past_its_deadline_raises_timeout_error_no_sooner() -> None:
    async def go() -> tuple[float, float]:
        deadlines = Deadlines()
        loop = asyncio.get_running_loop()
        when = loop.time() + 0.05
        with pytest.raises(TimeoutError):
            async with deadlines.timeout_at(when):
                await asyncio.sleep(5)
        return when, loop.time()

    when, ended = asyncio.run(go())
    assert ended >= when


def test_a_block_done_in_time_is_never_cancelled_afterwards() -> None:
    async def go() -> str:
        deadlines = Deadlines()
        loop = asyncio.get_running_loop()
        async with deadlines.timeout_at(loop.time() + 0.02):
            await asyncio.sleep(0)
        await asyncio.sleep(0.1)  # past the deadline, outside the block
        return "finished"

    assert asyncio.run(go()) == "finished"


def test_rescheduled_later_the_block_outlives_its_first_deadline() -> None:
    async def go() -> float:
        deadlines = Deadlines()
        loop = asyncio.get_running_loop()
        start = loop.time()
        with pytest.raises(TimeoutError):
            async with deadlines.timeout_at(start + 0.03) as budget:
                budget.reschedule(start + 0.15)
                await asyncio.sleep(0.06)  # past the first deadline: still running
                budget.reschedule(start + 0.08)  # earlier again: takes effect
                await asyncio.sleep(5)
        return loop.time() - start

    took = asyncio.run(go())
    assert 0.08 <= took < 0.15


def test_a_cancellation_from_elsewhere_stays_a_cancellation() -> None:
    async def go() -> None:
        deadlines = Deadlines()
        loop = asyncio.get_running_loop()

        async def guarded() -> None:
            async with deadlines.timeout_at(loop.time() + 5):
                await asyncio.sleep(5)

        task = asyncio.create_task(guarded())
        await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(go())


def test_a_deadline_inside_a_deadline_each_raises_for_its_own_block() -> None:
    async def go() -> list[str]:
        deadlines = Deadlines()
        loop = asyncio.get_running_loop()
        seen = []
        with pytest.raises(TimeoutError):
            async with deadlines.timeout_at(loop.time() + 0.1):
                try:
                    async with deadlines.timeout_at(loop.time() + 0.02):
                        await asyncio.sleep(5)
                except TimeoutError:
                    seen.append("inner")
                await asyncio.sleep(5)
        seen.append("outer")
        return seen

    assert asyncio.run(go()) == ["inner", "outer"]
