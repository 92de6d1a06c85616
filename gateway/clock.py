"""Time as an injectable role, so window, lease and wait logic is tested without sleeping:
what reads the time and what waits for it go by the same clock."""

import asyncio
import heapq
import itertools
import time
from collections.abc import Callable
from typing import Protocol


class Timer(Protocol):
    def cancel(self) -> None: ...


class Clock(Protocol):
    def monotonic(self) -> float: ...

    def wall(self) -> float: ...

    def call_later(self, delay: float, callback: Callable[[], object]) -> Timer:
        """Call `callback()` in `delay` seconds of `monotonic`, unless cancelled first."""
        ...


class SystemClock:
    # the C functions themselves: the request path reads the clock several times
    monotonic = staticmethod(time.monotonic)
    wall = staticmethod(time.time)

    @staticmethod
    def call_later(delay: float, callback: Callable[[], object]) -> Timer:
        # the event loop's time is time.monotonic
        return asyncio.get_running_loop().call_later(delay, callback)


class ManualTimer:
    def __init__(self, when: float, callback: Callable[[], object]) -> None:
        self.when = when
        self.callback = callback
        self.cancelled = False

    def cancel(self) -> None:
        self.cancelled = True


class ManualClock:
    """A clock that moves only when told to; for tests of pure logic. Its timers fire as
    `advance` passes them (tests/support/clock.py runs an event loop on it)."""

    def __init__(self, start: float = 1000.0) -> None:
        self.now = start
        self._timers: list[tuple[float, int, ManualTimer]] = []
        self._order = itertools.count()

    def monotonic(self) -> float:
        return self.now

    def wall(self) -> float:
        return self.now

    def call_later(self, delay: float, callback: Callable[[], object]) -> ManualTimer:
        timer = ManualTimer(self.now + max(0.0, delay), callback)
        heapq.heappush(self._timers, (timer.when, next(self._order), timer))
        return timer

    def next_timer_s(self) -> float | None:
        """Seconds until the earliest timer that is still set; None when none is."""
        while self._timers and self._timers[0][2].cancelled:
            heapq.heappop(self._timers)
        return max(0.0, self._timers[0][0] - self.now) if self._timers else None

    def advance(self, seconds: float) -> None:
        self.now += seconds
        while self._timers and self._timers[0][0] <= self.now:
            timer = heapq.heappop(self._timers)[2]
            if not timer.cancelled:
                timer.callback()
