"""Trying an upstream call again when it failed before its first byte.

Nothing of such an answer reached the client (UpstreamUnavailable), so another try, on
another backend, is safe. The request's context (gateway/front/exchange.py) makes each
try, the first one bare; this module decides how many more there are and when they stop.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import TypeVar

from tenacity import AsyncRetrying, RetryCallState, retry_if_exception_type

from gateway.clock import Clock
from gateway.errors import UpstreamUnavailable

T = TypeVar("T")
ATTEMPTS = 3  # the first try included


async def tried_again(attempt: Callable[[], Awaitable[T]], *, deadline: float, clock: Clock) -> T:
    """`attempt()` after a first try failed before its first byte, again while it fails so:
    ATTEMPTS tries in all, and no new one once `deadline` (Clock time, as every deadline
    on the request's path) has passed. Raises the last try's UpstreamUnavailable."""

    def spent(state: RetryCallState) -> bool:
        # state counts the tries made here, after the first
        return state.attempt_number >= ATTEMPTS - 1 or clock.monotonic() >= deadline

    retrying = AsyncRetrying(
        stop=spent, retry=retry_if_exception_type(UpstreamUnavailable), reraise=True
    )
    async for each in retrying:
        with each:
            return await attempt()
    raise AssertionError("unreachable: the last try returns or raises")
