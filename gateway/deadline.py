"""A deadline on the running task, for the request path (forwarding, Redis calls, the queue).

`with Deadline(when):` behaves as `async with asyncio.timeout_at(when):`: at `when`
(event-loop time) the task is cancelled and the block raises TimeoutError, while a
cancellation from elsewhere passes through untouched. The request path uses it because:

- it is a plain context manager, so entering and leaving it runs no coroutine: a
  non-streaming request costs about 6.8k fewer instructions than under asyncio.timeout_at
  (BENCHMARKS.md, fifth round);
- `extend` only records a later time, and the timer, when it fires, arms itself again
  for it. A stream that pushes its idle deadline on every chunk so makes no timer handle
  per chunk, where asyncio's Timeout.reschedule cancels one and makes another.
"""

from __future__ import annotations

import asyncio
from types import TracebackType


class Deadline:
    # one or two per request
    __slots__ = ("_armed_for", "_cancelling", "_handle", "_loop", "_task", "_when", "expired")

    def __init__(self, when: float) -> None:
        self._when = self._armed_for = when
        self.expired = False
        self._handle: asyncio.TimerHandle | None = None

    @classmethod
    def after(cls, seconds: float) -> Deadline:
        """A deadline `seconds` from now, as asyncio.timeout(seconds)."""
        return cls(asyncio.get_running_loop().time() + seconds)

    def __enter__(self) -> Deadline:
        self._loop = loop = asyncio.get_running_loop()
        task = asyncio.current_task(loop)
        if task is None:
            raise RuntimeError("a Deadline is entered inside a task")
        self._task = task
        self._cancelling = task.cancelling()
        self._handle = loop.call_at(self._when, self._fire)
        return self

    def extend(self, when: float) -> None:
        """Move the deadline to `when`: a later one costs nothing until the timer fires."""
        self._when = when
        if when < self._armed_for and self._handle is not None:
            self._handle.cancel()
            self._armed_for = when
            self._handle = self._loop.call_at(when, self._fire)

    def _fire(self) -> None:
        if self._when > self._armed_for:  # extended since the timer was set
            self._armed_for = self._when
            self._handle = self._loop.call_at(self._when, self._fire)
            return
        self._handle = None
        self.expired = True
        self._task.cancel()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None
        # once expired, our cancellation is spent either way (uncancel is called first);
        # a cancellation from elsewhere still stands
        if (
            self.expired
            and self._task.uncancel() <= self._cancelling
            and exc_type is asyncio.CancelledError
        ):
            raise TimeoutError from exc
