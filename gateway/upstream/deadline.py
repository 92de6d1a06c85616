"""Deadlines on the running task, for the request path (forwarding, the relay, Redis calls).

`with Deadline(when):` behaves as `async with asyncio.timeout_at(when):`: at `when`
(event-loop time) the task is cancelled and the block raises TimeoutError, while a
cancellation from elsewhere passes through untouched. The request path keeps its time by
its Clock and gives deadlines as durations (`after`, `push`); the loop's own time, which
its timers run on, is read only here. The request path uses it, not
asyncio's, because asyncio's costs more than issue 8's CPU target leaves room for
(BENCHMARKS.md, "asyncio.timeout against Deadline and Sweep"):

- it is a plain context manager, so entering and leaving it runs no coroutine;
- it makes no timer of its own. Every deadline on a loop, and every request's watch
  (watch.RequestWatch), is held in a set by the loop's one `Sweep`, whose timer is set
  for the soonest of them: a set entry costs far less than a timer handle made and
  cancelled, and most requests end long before any of their deadlines is due;
- `extend` only records a later time, which the sweep reads when it runs, so a stream
  that pushes its idle deadline on every chunk costs an attribute store per chunk.
"""

from __future__ import annotations

import asyncio
import logging
import math
from types import TracebackType
from typing import Protocol

log = logging.getLogger("spillgate.deadline")


class Timed(Protocol):
    """What a Sweep holds: called once `due` (event-loop time) has passed, and let go."""

    due: float

    def on_due(self, now: float) -> None:
        """Act on the time; hold itself again (with a later `due`) to be called again."""
        ...


class Sweep:
    """One timer per event loop for all its held Timed things, set for the soonest due.

    A held thing whose `due` moves later needs nothing more; one whose `due` moves
    earlier calls `wake_by`. Letting go (`held.discard`) leaves the timer as it is: at
    worst it fires once for nothing, where cancelling it would make another on the next
    request.
    """

    __slots__ = ("_armed_for", "_handle", "_loop", "held")

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self.held: set[Timed] = set()
        self._handle: asyncio.TimerHandle | None = None
        self._armed_for = math.inf

    @staticmethod
    def of(loop: asyncio.AbstractEventLoop) -> Sweep:
        sweep = _SWEEPS.get(loop)
        if sweep is None:
            sweep = _SWEEPS[loop] = Sweep(loop)
        return sweep

    def hold(self, timed: Timed) -> None:
        self.held.add(timed)
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
        due = [timed for timed in self.held if timed.due <= now]
        self.held.difference_update(due)
        for timed in due:
            try:
                timed.on_due(now)  # may hold itself again, and so set the timer
            except Exception:  # one failing must not keep the others' deadlines from firing
                log.exception("a timed callback failed")
        if self.held:
            self.wake_by(min(timed.due for timed in self.held))
        elif _SWEEPS.get(self._loop) is self:
            del _SWEEPS[self._loop]  # idle: a closed loop leaves nothing behind


_SWEEPS: dict[asyncio.AbstractEventLoop, Sweep] = {}


class Deadline:
    # one or two per request
    __slots__ = ("_cancelling", "_sweep", "_task", "due", "expired")

    def __init__(self, when: float) -> None:
        self.due = when
        self.expired = False
        self._sweep: Sweep | None = None

    @classmethod
    def after(cls, seconds: float) -> Deadline:
        """A deadline `seconds` from now, as asyncio.timeout(seconds)."""
        return cls(asyncio.get_running_loop().time() + seconds)

    def push(self, seconds: float) -> None:
        """Move the deadline to `seconds` from now (`extend`)."""
        self.extend(asyncio.get_running_loop().time() + seconds)

    def __enter__(self) -> Deadline:
        loop = asyncio.get_running_loop()
        task = asyncio.current_task(loop)
        if task is None:
            raise RuntimeError("a Deadline is entered inside a task")
        self._task = task
        self._cancelling = task.cancelling()
        self._sweep = sweep = Sweep.of(loop)
        sweep.hold(self)
        return self

    def extend(self, when: float) -> None:
        """Move the deadline to `when`: a later one costs nothing until the sweep runs (the
        sweep is never set later than a held due); only an earlier one may wake it."""
        earlier = when < self.due
        self.due = when
        if earlier and self._sweep is not None and not self.expired:
            self._sweep.wake_by(when)

    def on_due(self, now: float) -> None:
        self.expired = True
        self._task.cancel()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self._sweep is not None:
            self._sweep.held.discard(self)
        # once expired, our cancellation is spent either way (uncancel is called first);
        # a cancellation from elsewhere still stands
        if (
            self.expired
            and self._task.uncancel() <= self._cancelling
            and exc_type is asyncio.CancelledError
        ):
            raise TimeoutError from exc
