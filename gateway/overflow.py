"""The overflow policy role: what runs when no backend of a pool has room, and the hooks a
policy may offer the request path (recording answers, holding new arrivals back).

The gateway sees the policies only through these; `gateway/app.py` builds the chains.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Collection
from typing import TYPE_CHECKING, ClassVar, Protocol, runtime_checkable

from gateway.front.exchange import Served
from gateway.front.request import InferenceRequest
from gateway.outcome import Outcome
from gateway.upstream.relay import AnswerRecorder

# not only for the checker: a policy that forwards elsewhere builds the Target it hands
# `serve_target`, and a policy may import what this module does
from gateway.upstream.target import Target

if TYPE_CHECKING:
    from starlette.types import Send

    from gateway.admission.ledger import Reservation


class OverflowContext(Protocol):
    """What a policy may do with the request it was handed: the exchange's methods a
    policy uses (gateway/front/exchange.py), and nothing it could overwrite."""

    @property
    def send(self) -> Send:
        """The client's ASGI `send`, for a policy that answers by itself."""
        ...

    def headers(self, outcome: Outcome) -> list[tuple[bytes, bytes]]: ...

    def reserve(
        self, request: InferenceRequest, *, exclude: Collection[str] = ()
    ) -> Awaitable[Reservation | None]: ...

    async def admit(self, request: InferenceRequest) -> bool: ...

    def hold(self, reservation: Reservation) -> None: ...

    def release(self) -> Awaitable[None]: ...

    def stop_recording(self) -> None: ...

    def note_time(self, phase: str, seconds: float) -> None: ...

    def retry_after(self, request: InferenceRequest) -> float: ...

    def degraded(self, request: InferenceRequest, pool: str) -> InferenceRequest | None: ...

    async def send_json(self, body: bytes, *, status: int, outcome: Outcome) -> None: ...

    async def serve_local(self, request: InferenceRequest, outcome: Outcome) -> Served: ...

    async def serve_target(
        self, target: Target, request: InferenceRequest, *, outcome: Outcome, public_model: str
    ) -> Served: ...


class OverflowPolicy(Protocol):
    """Tries to serve a request the pool had no room for.

    Returns what it served, or None to pass the request to the next policy.
    Raises a SpillgateError to refuse the request outright.
    Must release anything it reserved, on every path.
    """

    name: ClassVar[str]

    async def serve(
        self, request: InferenceRequest, exchange: OverflowContext
    ) -> Served | None: ...


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
