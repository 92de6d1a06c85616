"""Deadline against asyncio.timeout_at's contract: on uvloop, as served, and for the timing on
a loop whose time is a ManualClock (tests/support/clock.py), without sleeping."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import pytest
import uvloop

from gateway import sweep as sweep_module
from gateway.clock import ManualClock
from gateway.sweep import Sweep
from gateway.upstream.deadline import Deadline
from tests.support.clock import run_on


def run(main: Callable[[], Awaitable[Any]]) -> Any:
    return run_on(ManualClock(), main)


def test_the_block_raises_timeout_error_at_the_deadline_and_leaves_the_task_uncancelled() -> None:
    async def main() -> tuple[float, int]:
        loop = asyncio.get_running_loop()
        start = loop.time()
        with pytest.raises(TimeoutError), Deadline(start + 0.05) as deadline:
            await asyncio.sleep(5)
        assert deadline.expired
        task = asyncio.current_task()
        assert task is not None
        await asyncio.sleep(0)  # no cancellation is left pending on the task
        return loop.time() - start, task.cancelling()

    took, cancelling = run(main)
    assert took == pytest.approx(0.05)
    assert cancelling == 0


def test_on_uvloop_the_block_raises_timeout_error_at_the_deadline() -> None:
    async def main() -> float:
        loop = asyncio.get_running_loop()
        start = loop.time()
        with pytest.raises(TimeoutError), Deadline(start + 0.05):
            await asyncio.sleep(5)
        return loop.time() - start

    assert 0.045 <= uvloop.run(main()) < 1.0


def test_a_block_done_in_time_leaves_no_timer_behind() -> None:
    async def main() -> bool:
        loop = asyncio.get_running_loop()
        with Deadline(loop.time() + 0.05) as deadline:
            await asyncio.sleep(0.001)
        await asyncio.sleep(0.1)  # past the deadline: nothing may cancel the task now
        return deadline.expired

    assert run(main) is False


def test_a_cancellation_from_elsewhere_passes_through_as_cancellation() -> None:
    async def inner() -> None:
        loop = asyncio.get_running_loop()
        with Deadline(loop.time() + 5):
            await asyncio.sleep(5)

    async def main() -> None:
        task = asyncio.create_task(inner())
        await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    run(main)


@pytest.mark.parametrize(
    ("first_s", "moved_s"), [(0.05, 0.15), (5.0, 0.05)], ids=["later", "earlier"]
)
def test_extend_moves_the_deadline_either_way(first_s: float, moved_s: float) -> None:
    async def main() -> float:
        loop = asyncio.get_running_loop()
        start = loop.time()
        with pytest.raises(TimeoutError), Deadline(start + first_s) as deadline:
            deadline.extend(start + moved_s)
            await asyncio.sleep(5)
        return loop.time() - start

    assert run(main) == pytest.approx(moved_s)


def test_pushed_on_every_step_it_fires_only_once_the_steps_stop() -> None:
    async def main() -> int:
        loop = asyncio.get_running_loop()
        steps = 0
        with pytest.raises(TimeoutError), Deadline(loop.time() + 0.05) as idle:
            while True:
                await asyncio.sleep(0.01 if steps < 20 else 5)  # 0.2 s busy, then silent
                steps += 1
                idle.extend(loop.time() + 0.05)
        return steps

    assert run(main) == 20  # every step within the idle budget went through


def test_a_sooner_deadline_entered_under_a_later_one_fires_on_its_own_time() -> None:
    async def main() -> tuple[float, bool]:
        loop = asyncio.get_running_loop()
        start = loop.time()
        # the outer deadline sets the sweep's timer for 5 s from now
        with Deadline(start + 5) as outer, pytest.raises(TimeoutError), Deadline(start + 0.05):
            await asyncio.sleep(5)
        return loop.time() - start, outer.expired

    took, outer_expired = run(main)
    assert took == pytest.approx(0.05)
    assert outer_expired is False


def test_the_sweep_lets_go_of_every_deadline_and_of_its_loop_once_idle() -> None:
    async def main() -> tuple[int, int, bool]:
        loop = asyncio.get_running_loop()
        for _ in range(100):  # done long before they are due, as most requests are
            with Deadline(loop.time() + 0.05):
                await asyncio.sleep(0)
        sweep = Sweep.of(loop)
        held_after_exits = len(sweep.tracked)
        with Deadline(loop.time() + 0.02):
            held_inside = len(sweep.tracked)
        await asyncio.sleep(0.1)  # past every due: the sweep's timer has fired and found none
        return held_after_exits, held_inside, loop in sweep_module._SWEEPS

    held_after_exits, held_inside, still_listed = run(main)
    assert (held_after_exits, held_inside) == (0, 1)
    assert still_listed is False


def test_many_deadlines_on_one_loop_each_fire_once_at_their_own_time() -> None:
    async def one(delay_s: float) -> float:
        loop = asyncio.get_running_loop()
        start = loop.time()
        with pytest.raises(TimeoutError), Deadline(start + delay_s):
            await asyncio.sleep(5)
        return loop.time() - start

    async def main() -> list[float]:
        return await asyncio.gather(*(one(0.02 * (i % 5 + 1)) for i in range(50)))

    took = run(main)
    assert took == pytest.approx([0.02 * (i % 5 + 1) for i in range(50)])


def test_a_tracked_callback_that_fails_does_not_keep_a_deadline_due_with_it_from_firing() -> None:
    class Failing:
        def __init__(self, due: float) -> None:
            self.due = due

        def on_due(self, now: float) -> None:
            raise RuntimeError("a broken callback")

    async def main() -> float:
        loop = asyncio.get_running_loop()
        start = loop.time()
        sweep = Sweep.of(loop)
        for _ in range(3):  # due together with the deadline, whatever the set's order
            sweep.track(Failing(start + 0.05))
        with pytest.raises(TimeoutError), Deadline(start + 0.05):
            await asyncio.sleep(5)
        return loop.time() - start

    assert run(main) == pytest.approx(0.05)
