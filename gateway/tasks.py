"""The gateway's background loops: one way to run them, one way to start and stop them.

Every part with work in the background (a feed, a watcher, a refresh) is a `Background`:
`await start()` does whatever must be done before the first request (a first read of
Redis, a first probe of the backends) and starts its loops; `await stop()` stops them,
a bounded time. The app's lifespan starts them in order and stops them in reverse
(`start_all`). Their loops are `Periodic`; a part whose work is one plain call now and
then has the composition root run it on a `Repeat`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable
from typing import Protocol

log = logging.getLogger("spillgate")


class Background(Protocol):
    async def start(self) -> None: ...

    async def stop(self) -> None: ...


async def start_all(stack: contextlib.AsyncExitStack, *parts: Background | None) -> None:
    """Start each part in turn, its `stop` pushed on `stack`: the last started stops first."""
    for part in parts:
        if part is not None:
            await part.start()
            stack.push_async_callback(part.stop)


async def stop_task(task: asyncio.Task[None], *, within_s: float = 2.0) -> None:
    """Cancel a background loop and wait for it, a bounded time.

    The loops also stop on their own flag, checked after every pass: a cancellation that
    lands inside the Redis client can be absorbed there (it surfaces as a connection error
    the loop logs and survives), and would never reach the loop.
    """
    task.cancel()
    await asyncio.wait([task], timeout=within_s)
    if not task.done():
        log.warning("background task %s did not stop within %.1fs", task.get_name(), within_s)
    elif not task.cancelled() and task.exception() is not None:
        log.warning("background task %s failed: %r", task.get_name(), task.exception())


class Periodic:
    """`run_pass` every `every_s` seconds in the background, until `stop`: at once on
    `start`, or one `every_s` later with `wait_first`. A pass that fails is logged (once
    while it keeps failing) and the next one runs on time."""

    def __init__(
        self,
        run_pass: Callable[[], Awaitable[None]],
        *,
        every_s: float,
        name: str,
        wait_first: bool = False,
    ) -> None:
        self._run_pass = run_pass
        self._every_s = every_s
        self._name = name
        self._wait_first = wait_first
        self._stopping = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    @property
    def stopping(self) -> bool:
        """Whether `stop` was called: a long pass checks it to end early."""
        return self._stopping.is_set()

    def start(self) -> None:
        self._task = asyncio.create_task(self._loop(), name=self._name)

    async def stop(self, *, within_s: float = 2.0) -> None:
        self._stopping.set()
        if self._task is not None:
            await stop_task(self._task, within_s=within_s)
            self._task = None

    def done(self) -> bool:
        return self._task is None or self._task.done()

    async def _loop(self) -> None:
        failing = False  # a pass that keeps failing (Redis down) is logged once, not per pass
        if self._wait_first:
            await asyncio.sleep(self._every_s)
        while not self._stopping.is_set():
            try:
                await self._run_pass()
            except Exception:
                if self._stopping.is_set():
                    return
                if not failing:
                    every = self._every_s
                    log.exception("%s: a pass failed; retrying every %gs", self._name, every)
                failing = True
            else:
                if failing:
                    log.warning("%s: passes succeed again", self._name)
                failing = False
            await asyncio.sleep(self._every_s)


class Repeat:
    """A plain function (`step`) every `every_s` seconds, as a Background part: the
    composition root makes one for each part that only needs calling now and then."""

    def __init__(
        self, step: Callable[[], object], *, every_s: float, name: str, wait_first: bool = False
    ) -> None:
        self._step = step
        self._periodic = Periodic(self._pass, every_s=every_s, name=name, wait_first=wait_first)

    async def _pass(self) -> None:
        self._step()

    async def start(self) -> None:
        self._periodic.start()

    async def stop(self) -> None:
        await self._periodic.stop()
