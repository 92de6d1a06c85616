"""Coarse deadlines: one event-loop timer per time slot, shared by every deadline due in it.

Every request carries deadlines (its body's arrival, the upstream's answer) that almost
never expire. A loop timer each (`loop.call_at`, `asyncio.timeout_at`) costs a handle,
a heap push and a cancellation per request; here a deadline costs a set insertion and
a removal, and the loop holds one timer per slot however many deadlines share it.

A slot is 10 ms wide for a deadline under 1.28 s away and widens in powers of two with
the distance, so a deadline fires never early and at most 1/64 of its distance late, or
10 ms for a near one; a 10-minute deadline shares its timer with five seconds' worth.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from types import TracebackType

FINEST_S = 0.01  # the narrowest slot
SPREAD = 64  # a slot is at most 1/SPREAD of its deadlines' distance wide, or FINEST_S
NEAR_S = 2 * FINEST_S * SPREAD  # nearer than this, every slot is FINEST_S wide


class Alarm:
    """One callback due at a slot's end; `cancel` before then and it never runs."""

    __slots__ = ("_callback", "_slot")

    def __init__(self, callback: Callable[[], object], slot: set[Alarm]) -> None:
        self._callback = callback
        self._slot = slot

    def cancel(self) -> None:
        self._slot.discard(self)

    def _ring(self) -> None:
        self._callback()


class Deadlines:
    """The shared timers of one event loop (the running one at first use, by default)."""

    def __init__(self, loop: asyncio.AbstractEventLoop | None = None) -> None:
        self._loop = loop
        self._slots: dict[tuple[int, int], set[Alarm]] = {}

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        if self._loop is None:
            self._loop = asyncio.get_running_loop()
        return self._loop

    def call_at(self, when: float, callback: Callable[[], object]) -> Alarm:
        """Run `callback` from the loop at `when` (loop time) or up to one slot later."""
        loop = self._loop or self.loop
        distance = when - loop.time()
        if distance < NEAR_S:  # most deadlines, and the finest slots: the short way
            width, size = 0, FINEST_S
        else:
            width = int(distance / NEAR_S).bit_length()
            size = FINEST_S * (1 << width)
        key = (width, int(when / size) + 1)
        alarms = self._slots.get(key)
        if alarms is None:
            alarms = self._slots[key] = set()
            loop.call_at(key[1] * size, self._ring, key)
        alarm = Alarm(callback, alarms)
        alarms.add(alarm)
        return alarm

    def timeout_at(self, when: float) -> Deadline:
        """`async with deadlines.timeout_at(when)`: asyncio.timeout_at on a shared timer."""
        return Deadline(self, when)

    def _ring(self, key: tuple[int, int]) -> None:
        alarms = self._slots.pop(key)
        while alarms:  # popped one by one, so an alarm cancelled by another never rings
            alarms.pop()._ring()


class Deadline:
    """Cancels the task that entered it once `when` passes; the block then raises
    TimeoutError, as asyncio.timeout_at does. `reschedule` later is cheap: the alarm
    that rings early finds the new deadline and sets itself again."""

    __slots__ = ("_alarm", "_cancelling", "_deadlines", "_expired", "_task", "_when")

    def __init__(self, deadlines: Deadlines, when: float) -> None:
        self._deadlines = deadlines
        self._when = when
        self._task: asyncio.Task[object] | None = None
        self._alarm: Alarm | None = None
        self._cancelling = 0
        self._expired = False

    def reschedule(self, when: float) -> None:
        previous, self._when = self._when, when
        if when < previous and self._alarm is not None:
            self._alarm.cancel()
            self._arm()

    def _arm(self) -> None:
        self._alarm = self._deadlines.call_at(self._when, self._check)

    def _check(self) -> None:
        if self._deadlines.loop.time() < self._when:
            self._arm()  # rescheduled later since this alarm was set
        elif self._task is not None:
            self._alarm = None
            self._expired = True
            self._task.cancel()

    async def __aenter__(self) -> Deadline:
        self._task = asyncio.current_task()
        if self._task is None:
            raise RuntimeError("Deadline must be used inside a task")
        self._cancelling = self._task.cancelling()
        self._arm()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self._alarm is not None:
            self._alarm.cancel()
            self._alarm = None
        task, self._task = self._task, None
        # uncancel() first: the cancellation was this deadline's, whatever the block raised
        if (
            self._expired
            and task is not None
            and task.uncancel() <= self._cancelling
            and exc_type is asyncio.CancelledError
        ):
            raise TimeoutError from exc
