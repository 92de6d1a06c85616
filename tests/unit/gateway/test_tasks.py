"""Background loops stop when asked, even when a pass absorbs the cancellation."""

from __future__ import annotations

import asyncio
import contextlib

import pytest

from gateway.tasks import Periodic, Repeat, start_all


def test_a_loop_stops_though_its_pass_turned_the_cancellation_into_an_error() -> None:
    asyncio.run(_absorbed())


async def _absorbed() -> None:
    # what a Redis client's read can do on Python 3.11 when the cancellation and its own
    # timeout land together: the cancellation comes out as a connection error
    started = asyncio.Event()

    async def run_pass() -> None:
        started.set()
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            asyncio.current_task().uncancel()  # type: ignore[union-attr]
            raise ConnectionError("connection lost while reading") from None

    passes = Periodic(run_pass, every_s=0.01, name="absorbing")
    passes.start()
    await started.wait()
    await asyncio.wait_for(passes.stop(within_s=5), timeout=2)
    assert passes.done()


def test_a_failing_pass_is_logged_and_the_next_one_runs() -> None:
    asyncio.run(_failing())


async def _failing() -> None:
    runs = 0
    third = asyncio.Event()

    async def run_pass() -> None:
        nonlocal runs
        runs += 1
        if runs == 1:
            raise RuntimeError("the first pass fails")
        if runs == 3:
            third.set()

    passes = Periodic(run_pass, every_s=0.001, name="flaky")
    passes.start()
    await asyncio.wait_for(third.wait(), timeout=2)
    await passes.stop()
    assert passes.done()


def test_a_pass_that_keeps_failing_is_logged_once_until_it_succeeds(
    caplog: pytest.LogCaptureFixture,
) -> None:
    asyncio.run(_keeps_failing())
    messages = [r.getMessage() for r in caplog.records]
    assert messages == [
        "down: a pass failed; retrying every 0.001s",
        "down: passes succeed again",
    ]


async def _keeps_failing() -> None:
    runs = 0
    recovered = asyncio.Event()

    async def run_pass() -> None:
        nonlocal runs
        runs += 1
        if runs <= 5:
            raise ConnectionError("Redis is down")
        recovered.set()

    passes = Periodic(run_pass, every_s=0.001, name="down")
    passes.start()
    await asyncio.wait_for(recovered.wait(), timeout=2)
    await passes.stop()


def test_parts_start_in_order_and_stop_in_reverse() -> None:
    asyncio.run(_in_order())


async def _in_order() -> None:
    seen: list[str] = []

    class Part:
        def __init__(self, name: str) -> None:
            self.name = name

        async def start(self) -> None:
            seen.append(f"start {self.name}")

        async def stop(self) -> None:
            seen.append(f"stop {self.name}")

    async with contextlib.AsyncExitStack() as stack:
        await start_all(stack, Part("a"), None, Part("b"))
    assert seen == ["start a", "start b", "stop b", "stop a"]


def test_a_repeat_that_waits_first_runs_no_step_before_its_interval() -> None:
    asyncio.run(_waits_first())


async def _waits_first() -> None:
    steps: list[float] = []
    second = asyncio.Event()
    loop = asyncio.get_running_loop()

    def step() -> None:
        steps.append(loop.time())
        if len(steps) == 2:
            second.set()

    started = loop.time()
    repeat = Repeat(step, every_s=0.05, name="w", wait_first=True)
    await repeat.start()
    await asyncio.sleep(0.02)
    assert steps == []
    await asyncio.wait_for(second.wait(), timeout=2)
    await repeat.stop()
    assert steps[0] - started >= 0.05
