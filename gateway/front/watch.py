"""The client's side of one request: its body read within a limit, a deadline on the body's
arrival, a watch for the client leaving, and the response's last message held back until
the request is settled."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping

from starlette.types import Message, Receive, Send

from gateway.front.guard import body_too_large
from gateway.upstream.deadline import Sweep


class ClientGone(Exception):
    """The client hung up before its request body had arrived: nobody to answer."""


async def read_body(headers: Mapping[bytes, bytes], receive: Receive, limit: int) -> bytes:
    """The whole request body, at most `limit` bytes (its deadline is the RequestWatch's)."""
    declared = headers.get(b"content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise body_too_large(limit)
    chunks: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise ClientGone
        body = message.get("body", b"")
        size += len(body)
        if size > limit:
            raise body_too_large(limit)
        if not message.get("more_body", False):
            # most bodies come in one message: nothing to join
            return b"".join((*chunks, body)) if chunks else body
        chunks.append(body)


class RequestWatch:
    """One per request: it bounds the body's arrival, then watches for a disconnect, and
    sees the response go out (`send`).

    It is first due `after_s` in, on the loop's Sweep (gateway/upstream/deadline.py), which holds
    it without a timer of its own. A body still arriving then has until `read_s` after
    the start, or the handling task is cancelled (`read_timed_out`, answered 408). Once
    the body has arrived (and no sooner, since the handler itself reads it), a task waits
    for the client to leave and cancels the handling task if it does before the response
    ends (`disconnected`). An answer ready within `after_s` (a cached one, a refusal, an
    error) costs a set entry on the sweep, and a client that left meanwhile is still
    seen, since the server keeps its disconnect for the next `receive()`.

    `send` passes the response on to the client, except its last message, which it holds
    (`last`) until the request is settled: only then may the client hold the whole answer.
    """

    # one per request
    __slots__ = (
        "_read_by",
        "_reading",
        "_receive",
        "_send",
        "_sweep",
        "_task",
        "_ticked",
        "_watch",
        "disconnected",
        "due",
        "finished",
        "last",
        "read_timed_out",
        "started",
    )  # fmt: skip

    def __init__(
        self, receive: Receive, send: Send, *, read_s: float, after_s: float = 0.1
    ) -> None:
        self.finished = self.disconnected = self.read_timed_out = False
        self.started = False  # the response's head has gone out
        self.last: Message | None = None
        self._receive = receive
        self._send = send
        self._reading = True
        self._ticked = False  # the first tick came while the body was still arriving
        self._watch: asyncio.Task[None] | None = None
        loop = asyncio.get_running_loop()
        self._task = asyncio.current_task(loop)
        now = loop.time()
        self._read_by = now + read_s
        self.due = now + (after_s if after_s < read_s else read_s)
        self._sweep = sweep = Sweep.of(loop)
        sweep.track(self)

    async def send(self, message: Message) -> None:
        if message["type"] == "http.response.start":
            self.started = True
        elif not message.get("more_body", False):
            self.finished = True
            self.last = message
            return
        await self._send(message)

    def body_read(self) -> None:
        self._reading = False
        if self._ticked:  # the body took longer than the first tick: watch from now
            self._sweep.tracked.discard(self)
            self._begin()

    def on_due(self, now: float) -> None:
        if self.finished:
            return
        if not self._reading:
            self._begin()
        elif now >= self._read_by:
            self.read_timed_out = True
            self._cancel()
        else:
            self._ticked = True
            self.due = self._read_by
            self._sweep.track(self)

    def _begin(self) -> None:
        if not self.finished and self._watch is None:
            self._watch = asyncio.create_task(self._wait())

    async def _wait(self) -> None:
        while (await self._receive())["type"] != "http.disconnect":
            pass
        if not self.finished:
            self.disconnected = True
            self._cancel()

    def _cancel(self) -> None:
        if self._task is not None:
            self._task.cancel()

    def close(self) -> None:
        self.finished = True
        self._sweep.tracked.discard(self)
        if self._watch is not None:
            self._watch.cancel()
