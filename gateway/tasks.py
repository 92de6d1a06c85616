"""Stopping the gateway's background loops."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

log = logging.getLogger("spillgate")


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
    """`run_pass` every `every_s` seconds in the background, until `stop`."""

    def __init__(
        self, run_pass: Callable[[], Awaitable[None]], *, every_s: float, name: str
    ) -> None:
        self._run_pass = run_pass
        self._every_s = every_s
        self._name = name
        self._stopping = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._loop(), name=self._name)

    async def stop(self, *, within_s: float = 2.0) -> None:
        self._stopping.set()
        if self._task is not None:
            await stop_task(self._task, within_s=within_s)

    def done(self) -> bool:
        return self._task is not None and self._task.done()

    async def _loop(self) -> None:
        failing = False  # a pass that keeps failing (Redis down) is logged once, not per pass
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
