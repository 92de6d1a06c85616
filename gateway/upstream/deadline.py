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
  (watch.RequestWatch), is tracked in a set by the loop's one `Sweep`, whose timer is set
  for the soonest of them: a set entry costs far less than a timer handle made and
  cancelled, and most requests end long before any of their deadlines is due;
- `extend` only records a later time, which the sweep reads when it runs, so a stream
  that pushes its idle deadline on every chunk costs an attribute store per chunk.
"""

from __future__ import annotations

import asyncio
from types import TracebackType

from gateway.sweep import Sweep

__all__ = ["Deadline", "Sweep"]  # the request path finds the loop's Sweep beside Deadline


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
        sweep.track(self)
        return self

    def extend(self, when: float) -> None:
        """Move the deadline to `when`: a later one costs nothing until the sweep runs (the
        sweep is never set later than a tracked due); only an earlier one may wake it."""
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
            self._sweep.tracked.discard(self)
        # once expired, our cancellation is spent either way (uncancel is called first);
        # a cancellation from elsewhere still stands
        if (
            self.expired
            and self._task.uncancel() <= self._cancelling
            and exc_type is asyncio.CancelledError
        ):
            raise TimeoutError from exc
