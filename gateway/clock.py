"""Time as an injectable role, so window and lease logic is tested without sleeping."""

import time
from typing import Protocol


class Clock(Protocol):
    def monotonic(self) -> float: ...

    def wall(self) -> float: ...


class SystemClock:
    # the C functions themselves: the request path reads the clock several times
    monotonic = staticmethod(time.monotonic)
    wall = staticmethod(time.time)


class ManualClock:
    """A clock that moves only when told to; for tests of pure logic."""

    def __init__(self, start: float = 1000.0) -> None:
        self.now = start

    def monotonic(self) -> float:
        return self.now

    def wall(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds
