"""Deadline against asyncio.timeout_at's contract, on a real event loop (uvloop, as served)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import pytest
import uvloop

from gateway.deadline import Deadline


def run(main: Callable[[], Awaitable[Any]]) -> Any:
    return uvloop.run(main())  # type: ignore[arg-type]


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
    assert 0.045 <= took < 1.0
    assert cancelling == 0


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

    assert moved_s - 0.005 <= run(main) < moved_s + 0.5


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
