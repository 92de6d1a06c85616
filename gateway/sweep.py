"""One timer per event loop for every deadline on it (gateway/upstream/deadline.py), each
request's watch for its client (gateway/front/watch.py) and each Redis call's time budget
(gateway/redis_io/batch.py): a set entry costs far less than a timer handle made and
cancelled, and most of them are let go long before they are due."""

from __future__ import annotations

import asyncio
import logging
import math
from typing import Protocol

log = logging.getLogger("spillgate.deadline")


class Timed(Protocol):
    """What a Sweep holds: called once `due` (event-loop time) has passed, and let go."""

    due: float

    def on_due(self, now: float) -> None:
        """Act on the time; hold itself again (with a later `due`) to be called again."""
        ...


class Sweep:
    """One timer per event loop for all the Timed things it tracks, set for the soonest due.

    A tracked thing whose `due` moves later needs nothing more; one whose `due` moves
    earlier calls `wake_by`. Letting go (`tracked.discard`) leaves the timer as it is: at
    worst it fires once for nothing, where cancelling it would make another on the next
    request.
    """

    __slots__ = ("_armed_for", "_handle", "_loop", "tracked")

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self.tracked: set[Timed] = set()
        self._handle: asyncio.TimerHandle | None = None
        self._armed_for = math.inf

    @staticmethod
    def of(loop: asyncio.AbstractEventLoop) -> Sweep:
        sweep = _SWEEPS.get(loop)
        if sweep is None:
            sweep = _SWEEPS[loop] = Sweep(loop)
        return sweep

    def track(self, timed: Timed) -> None:
        self.tracked.add(timed)
        if timed.due < self._armed_for:
            self.wake_by(timed.due)

    def wake_by(self, when: float) -> None:
        """Run no later than `when`."""
        if when < self._armed_for:
            if self._handle is not None:
                self._handle.cancel()
            self._armed_for = when
            self._handle = self._loop.call_at(when, self._run)

    def _run(self) -> None:
        self._handle = None
        self._armed_for = math.inf
        now = self._loop.time()
        due = [timed for timed in self.tracked if timed.due <= now]
        self.tracked.difference_update(due)
        for timed in due:
            try:
                timed.on_due(now)  # may hold itself again, and so set the timer
            except Exception:  # one failing must not keep the others' deadlines from firing
                log.exception("a timed callback failed")
        if self.tracked:
            self.wake_by(min(timed.due for timed in self.tracked))
        elif _SWEEPS.get(self._loop) is self:
            del _SWEEPS[self._loop]  # idle: a closed loop leaves nothing behind


_SWEEPS: dict[asyncio.AbstractEventLoop, Sweep] = {}
