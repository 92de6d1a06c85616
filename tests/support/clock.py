"""An event loop on a ManualClock, so timing logic (deadlines, the queue's wait) is tested
without sleeping: when nothing is ready, the loop moves the clock on to its next timer
(the loop's, or one set on the clock itself, `Clock.call_later`) instead of waiting for it.
The Clock the code under test is given and the loop's own time are then one and the same."""

from __future__ import annotations

import asyncio
import selectors
from collections.abc import Awaitable, Callable
from typing import TypeVar

from gateway.clock import ManualClock

T = TypeVar("T")


class _SkippingSelector(selectors.DefaultSelector):
    def __init__(self, clock: ManualClock) -> None:
        super().__init__()
        self._clock = clock

    def select(self, timeout: float | None = None) -> list[tuple[selectors.SelectorKey, int]]:
        ready: list[tuple[selectors.SelectorKey, int]] = super().select(0)
        if ready or timeout == 0:
            return ready
        due = self._clock.next_timer_s()  # the clock's own timers (Clock.call_later)
        if due is not None and (timeout is None or due < timeout):
            timeout = due
        if timeout is None:  # no timer at all: only I/O can wake the loop
            ready = super().select(None)
            return ready
        self._clock.advance(timeout)
        return ready


class ManualClockLoop(asyncio.SelectorEventLoop):
    def __init__(self, clock: ManualClock) -> None:
        super().__init__(_SkippingSelector(clock))
        self.clock = clock

    def time(self) -> float:
        return self.clock.now


def run_on(clock: ManualClock, main: Callable[[], Awaitable[T]]) -> T:
    """Run `main()` on a loop whose time is `clock`."""

    async def wrapped() -> T:
        return await main()

    with asyncio.Runner(loop_factory=lambda: ManualClockLoop(clock)) as runner:
        return runner.run(wrapped())
