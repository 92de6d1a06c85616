"""The client's side of one request: its body read within a limit, a deadline on the body's
arrival, a watch for the client leaving, and the response's last message held back until
the request is settled."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping

from starlette.types import Message, Receive, Send

from gateway.front.guard import body_too_large


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

    Its timer first fires `after_s` in. A body still arriving then has until `read_s`
    after the start, or the handling task is cancelled (`read_timed_out`, answered 408).
    Once the body has arrived (and no sooner, since the handler itself reads it), a task
    waits for the client to leave and cancels the handling task if it does before the
    response ends (`disconnected`). An answer ready within `after_s` (a cached one, a
    refusal, an error) costs the timer and no task, and a client that left meanwhile is
    still seen, since the server keeps its disconnect for the next `receive()`.

    `send` passes the response on to the client, except its last message, which it holds
    (`last`) until the request is settled: only then may the client hold the whole answer.
    """

    # one per request
    __slots__ = (
        "_reading",
        "_reading_left_s",
        "_receive",
        "_send",
        "_task",
        "_ticked",
        "_timer",
        "_watch",
        "disconnected",
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
        first_s = after_s if after_s < read_s else read_s
        self._reading_left_s = read_s - first_s  # after the first tick
        self._timer = loop.call_later(first_s, self._tick)

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
            self._timer.cancel()
            self._begin()

    def _tick(self) -> None:
        if self.finished:
            return
        if not self._reading:
            self._begin()
        elif self._ticked or self._reading_left_s <= 0:
            self.read_timed_out = True
            self._cancel()
        else:
            self._ticked = True
            self._timer = asyncio.get_running_loop().call_later(self._reading_left_s, self._tick)

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
        self._timer.cancel()
        if self._watch is not None:
            self._watch.cancel()
