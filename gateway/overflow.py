"""The overflow policy role: what runs when no backend of a pool has room, and the hooks a
policy may offer the request path (recording answers, holding new arrivals back).

The gateway sees the policies only through these; `gateway/app.py` builds the chains.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import ClassVar, Protocol, runtime_checkable

from gateway.front.exchange import Exchange, Served
from gateway.front.request import InferenceRequest
from gateway.upstream.relay import AnswerRecorder


class OverflowPolicy(Protocol):
    """Tries to serve a request the pool had no room for.

    Returns what it served, or None to pass the request to the next policy.
    Raises a SpillgateError to refuse the request outright.
    Must release anything it reserved, on every path.
    """

    name: ClassVar[str]

    async def serve(self, request: InferenceRequest, exchange: Exchange) -> Served | None: ...


@runtime_checkable
class RecordsAnswers(Protocol):
    """A policy that also records its pool's successful answers (the cache fills this way)."""

    def recorder_for(self, request: InferenceRequest) -> AnswerRecorder | None: ...


RecorderFor = Callable[[InferenceRequest], AnswerRecorder | None]


@runtime_checkable
class ArrivalCheck(Protocol):
    """A policy that decides whether new arrivals may take free room directly (the queue:
    not while others wait ahead of them)."""

    def lets_in(self, request: InferenceRequest) -> bool: ...


LetsIn = Callable[[InferenceRequest], bool]
