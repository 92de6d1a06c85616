"""A handle on one request's upstream answer, by which the gateway stops it to give its room
to more urgent work (gateway/front/preemption.py): the answer's connection is closed, which
is how an engine learns to abort a request and free its KV blocks, and the request's leg
ends as if its backend had broken off, so the stream goes on from where it was."""

from __future__ import annotations

from typing import TYPE_CHECKING

from gateway.upstream.http_head import Preempted

if TYPE_CHECKING:
    from gateway.upstream.http import Response
    from gateway.upstream.relay import StreamRelay


class Stop:
    """One request's answer as its upstream sends it, stopped on `fire`; once only."""

    __slots__ = ("_response", "fired", "relay", "retry_after")  # one per preemptible request

    def __init__(self) -> None:
        self.fired = False
        self.retry_after = 1.0  # what the client is told if its stream cannot go on
        self.relay: StreamRelay | None = None  # the client's stream, once it started
        self._response: Response | None = None

    @property
    def streaming(self) -> bool:
        """Whether the client got its first byte."""
        return self.relay is not None and self.relay.first_byte_at is not None

    @property
    def events(self) -> int:
        """The answer's events the client got (its tokens, near enough)."""
        return 0 if self.relay is None else self.relay.events

    @property
    def stoppable(self) -> bool:
        """Whether `fire` stops it at once: its answer's head has come (before that, the
        stop waits for the head, as long as the engine takes to send it)."""
        return self._response is not None

    def watch(self, response: Response) -> None:
        """The upstream answers with `response`: `fire` stops it from now on (the caller
        checks `fired` first: nothing of an answer stopped before its head is relayed)."""
        self._response = response

    def unwatch(self) -> None:
        self._response = None

    def fire(self, *, retry_after: float) -> None:
        self.fired = True
        self.retry_after = retry_after
        if self._response is not None:
            self._response.abort(Preempted(retry_after))
