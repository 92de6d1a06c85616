"""The upstream HTTP/1.1 client: keep-alive connections to each backend and provider.

This is security-sensitive code, and so are gateway/upstream/http_head.py (what it
sends) and gateway/upstream/pool.py (its connections). It reads bytes from servers the
gateway does not control (a provider across the internet, a backend behind someone else's
proxy, a process that is dying), and every request of the process passes through it. Every
hostile answer anyone finds becomes a test in
tests/integration/gateway/upstream/test_upstream_hostile.py, against a real server that
answers that way, and what the client does then is what h11, aiohttp and Envoy do.

The gateway sends one kind of request upstream, a POST of a JSON body, and relays the
answer as it arrives. It does so on asyncio protocols with httptools, the parser uvicorn
serves with, instead of a general client: a general client's request and response
machinery cost more CPU per request than all of the gateway's own features
(BENCHMARKS.md, "A client of its own"). What a general client does and this one does not:
redirects, cookies, proxies, compression, request bodies that stream. None of them
belongs between a gateway and its backends.

A connection serves one request at a time and goes back to the pool when its answer has
been read to the end and the server keeps it open. An answer not read to its end closes
its connection (`Response.close`), which is also how a request the client abandoned is
cancelled upstream: the server sees the connection go.

What it does with an upstream that answers in ways it should not:

- informational answers (1xx) before the answer are skipped (RFC 9110 §15.2); a 101 is a
  ProtocolError, as nothing asked to switch protocols, and so is a status outside 100 to
  599 (`099` is no informational answer) or a transfer coding other than `chunked`;
- an answer's heads (informational ones included) and its trailers hold at most
  `max_header_bytes` of names and values and `max_headers` fields between them (Envoy's
  60 KiB and 100); past either, ProtocolError, and the connection closes. Trailers are
  counted, never read;
- a body of no stated length ends at an orderly close only: a reset is ConnectionClosed;
- a request on a kept-alive connection that closed before any byte of its answer goes
  once more on a new connection (`UpstreamPool.post` in gateway/upstream/pool.py says why
  that is safe);
- a host's addresses are tried as RFC 8305's Happy Eyeballs does, so an address that
  drops connections costs a quarter of a second, not the whole connect budget;
- idle connections are let go after `keepalive_s`, the oldest first;
- a request header whose name is not a token, or whose value holds a line break or
  another control character, is refused before anything is sent;
- the first failure of a connection is the one its caller sees, not what followed it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Protocol

import httptools

from gateway.upstream.http_head import (
    BodyTooLarge,
    ConnectionClosed,
    ProtocolError,
    TransportError,
)

# past this many bytes read and not yet taken by the relay, the connection stops reading
# until the relay catches up (a slow client slows its upstream, as TCP would)
HIGH_WATER = 1 << 18
# httptools hands a header over only once its line has ended, and keeps it till then: a
# value that never ends is bounded by the bytes received that carried no body. Beyond the
# names and values they hold the status line, each field's ": " and CRLF, chunk framing.
_HEAD_FRAMING = 8192


class Home(Protocol):
    """What a connection needs of the pool that made it (gateway/upstream/pool.py)."""

    max_header_bytes: int
    max_headers: int
    slots: asyncio.Semaphore

    def put_back(self, connection: Connection) -> None: ...

    def lost(self, connection: Connection) -> None: ...


class Response:
    """An answer's status and headers, and its body as it arrives: iterate for what has
    arrived since the last read, or `read()` it whole. `release()` once it has been read to
    its end; `close()` otherwise."""

    __slots__ = (
        "_buffered",
        "_chunks",
        "_connection",
        "_failure",
        "_waiter",
        "complete",
        "headers",
        "status",
    )

    def __init__(self, connection: Connection) -> None:
        self.status = 0  # until the answer's head, informational answers aside, has arrived
        self.headers: dict[bytes, bytes] = {}  # names lower-cased
        self.complete = False  # the body has arrived to its end
        self._connection: Connection | None = connection
        self._chunks: list[bytes] = []
        self._buffered = 0
        self._failure: TransportError | None = None
        self._waiter: asyncio.Future[None] | None = None

    def __aiter__(self) -> Response:
        return self

    async def __anext__(self) -> bytes:
        while not self._chunks:
            if self.complete:
                raise StopAsyncIteration
            await self._arrival()
        return self._take()

    async def read(
        self, *, limit: int | None = None, progress: Callable[[], None] | None = None
    ) -> bytes:
        """The whole body; BodyTooLarge once more than `limit` bytes of it have arrived.
        `progress` is called each time more arrives after a wait (to push an idle deadline
        on); a body already here when it is read costs no call."""
        parts: list[bytes] = []
        size = 0
        while True:
            if self._chunks:
                size += self._buffered
                if limit is not None and size > limit:
                    raise BodyTooLarge(f"a body past {limit} bytes")
                parts.append(self._take())
            if self.complete:
                return parts[0] if len(parts) == 1 else b"".join(parts)
            await self._arrival()
            if progress is not None:
                progress()

    def _take(self) -> bytes:
        """What has arrived since the last take, reading resumed if it had paused."""
        data = self._chunks[0] if len(self._chunks) == 1 else b"".join(self._chunks)
        self._chunks.clear()
        if self._buffered > HIGH_WATER and self._connection is not None:
            self._connection.transport.resume_reading()
        self._buffered = 0
        return data

    def release(self) -> None:
        """Give the connection back for the next request, if the answer ended and the
        server keeps it open; else close it."""
        connection, self._connection = self._connection, None
        if connection is not None:
            if self._buffered > HIGH_WATER:  # paused on a body no one read: not for the next
                connection.transport.resume_reading()
            connection.done(reuse=self.complete)

    def close(self) -> None:
        connection, self._connection = self._connection, None
        if connection is not None:
            connection.done(reuse=False)

    def abort(self, failure: TransportError) -> None:
        """Stop the answer from outside, as the gateway preempts a request: its connection
        closes (an engine aborts a request whose connection closed, and frees its KV
        blocks) and a read waiting on it raises `failure`."""
        self.close()
        if not self.complete and self._failure is None:
            self._failed(failure)

    async def _arrival(self) -> None:
        if self._failure is not None:
            raise self._failure
        waiter = self._waiter = asyncio.get_running_loop().create_future()
        try:
            await waiter
        finally:
            self._waiter = None
        if self._failure is not None:
            raise self._failure

    # what the connection tells it

    def _body(self, data: bytes) -> None:
        self._chunks.append(data)
        self._buffered += len(data)
        if self._buffered > HIGH_WATER >= self._buffered - len(data) and self._connection:
            self._connection.transport.pause_reading()
        self._wake()

    def _ended(self) -> None:
        self.complete = True
        self._wake()

    def _failed(self, failure: TransportError) -> None:
        self._failure = failure
        self._wake()

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)


class Connection(asyncio.Protocol):
    """One connection to an origin, with its parser; serves one request at a time."""

    def __init__(self, pool: Home) -> None:
        self.transport: asyncio.Transport = None  # type: ignore[assignment]  # until made
        self.closed = False
        self.idle_since = 0.0
        self.answered = False  # a byte of the current request's answer has arrived
        self._pool = pool
        self._parser = httptools.HttpResponseParser(self)
        self._response: Response | None = None
        self._head: asyncio.Future[Response] | None = None
        self._keep_alive = False  # the last answer let the connection stay open
        self._failure: TransportError | None = None  # the first; the connection is over
        self._max_header_bytes = pool.max_header_bytes
        self._max_headers = pool.max_headers
        self._max_unbodied = pool.max_header_bytes + 4 * pool.max_headers + _HEAD_FRAMING
        # of the current answer: names and values of its heads and trailers, and fields
        self._header_bytes = 0
        self._headers = 0
        self._unbodied = 0  # bytes received since the last that carried body

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports are not asyncio.Transport subclasses, though they are one
        self.transport = transport  # type: ignore[assignment]

    def request(self, data: bytes) -> asyncio.Future[Response]:
        """Send a request; the future is its answer's head."""
        self._response = Response(self)
        self._head = head = asyncio.get_running_loop().create_future()
        self.answered = False
        self._header_bytes = self._headers = self._unbodied = 0
        self.transport.write(data)
        return head

    def done(self, *, reuse: bool) -> None:
        """The request is over: keep the connection for the next, or close it."""
        self._response = self._head = None
        if reuse and self._keep_alive and not self.closed:
            self._pool.put_back(self)
        else:
            self.close()
        self._pool.slots.release()

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self.transport.close()

    def data_received(self, data: bytes) -> None:
        response = self._response
        if response is None:  # nothing was asked: a server closing an idle connection
            self.close()
            return
        buffered = response._buffered
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            self._fail(ProtocolError("the upstream upgraded the connection"))
            return
        except httptools.HttpParserError as exc:
            # a callback's own refusal (a bound, a 101) travels as the parser's context
            refusal = exc.__context__
            if not isinstance(refusal, ProtocolError):
                refusal = ProtocolError(f"bad HTTP from the upstream: {exc}")
            self._fail(refusal)
            return
        if response._buffered != buffered:
            self._unbodied = 0
        else:  # a head, trailers, framing: what httptools may be holding of a header
            self._unbodied += len(data)
            if self._unbodied > self._max_unbodied:
                self._fail(self._too_large())

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self._pool.lost(self)
        response = self._response
        if (
            exc is None
            and self._failure is None
            and response is not None
            and response.status
            and _ends_with_connection(response)
        ):
            # a body of no stated length ends where the connection does, when it ends in
            # order: a reset cuts it short, whatever arrived before it
            response._ended()
            return
        if exc is None:
            why = "the upstream closed the connection before the answer ended"
        else:
            why = f"the upstream reset the connection before the answer ended ({exc})"
        self._fail(ConnectionClosed(why))

    def _fail(self, failure: TransportError) -> None:
        self.close()
        if self._failure is not None:
            return  # the first failure is the cause; what follows it (the close) is not
        self._failure = failure
        head, response = self._head, self._response
        if head is not None and not head.done():
            head.set_exception(failure)
        elif response is not None and not response.complete:
            response._failed(failure)

    def _too_large(self) -> ProtocolError:
        if self._headers > self._max_headers:
            return ProtocolError(
                f"the upstream's response head had more than {self._max_headers} fields"
            )
        return ProtocolError(
            f"the upstream's response head exceeded {self._max_header_bytes} bytes"
        )

    # httptools' callbacks; one that raises stops the parser, and data_received reports it

    def on_message_begin(self) -> None:
        response = self._response
        if response is None or response.complete:
            # an answer after the one asked for: the connection's bytes cannot be trusted
            raise ProtocolError("the upstream sent an answer that was not asked for")
        self.answered = True

    def on_header(self, name: bytes, value: bytes) -> None:
        self._header_bytes += len(name) + len(value)
        self._headers += 1
        if self._header_bytes > self._max_header_bytes or self._headers > self._max_headers:
            raise self._too_large()
        response = self._response
        if response is not None and not response.status:  # after the head: a trailer
            response.headers[name.lower()] = value

    def on_headers_complete(self) -> None:
        response, head = self._response, self._head
        if response is None or head is None:
            return
        status = self._parser.get_status_code()
        if not 100 <= status <= 599:  # RFC 9110 §15: three digits, 1 to 5 first
            raise ProtocolError(f"the upstream answered with status {status}, which is none")
        if status < 200:
            if status == 101:
                raise ProtocolError("the upstream switched protocols, which nothing asked for")
            response.headers.clear()  # an informational answer's: the answer follows
            return
        coding = response.headers.get(b"transfer-encoding")
        if coding is not None and coding != b"chunked" and coding.strip().lower() != b"chunked":
            # h11's rule: a body is chunked or of a stated length; a coding the gateway did
            # not ask for (`gzip, chunked`) would reach the client as bytes it cannot read
            raise ProtocolError("the upstream's transfer-encoding is not just chunked")
        response.status = status
        if not head.done():
            head.set_result(response)

    def on_body(self, body: bytes) -> None:
        if self._response is not None:
            self._response._body(body)

    def on_message_complete(self) -> None:
        response = self._response
        if response is None or not response.status:
            return  # an informational answer ended; the answer follows it
        # asked here: the parser forgets once it is ready for the next message
        self._keep_alive = self._parser.should_keep_alive()
        response._ended()


def _ends_with_connection(response: Response) -> bool:
    headers = response.headers
    return b"content-length" not in headers and b"transfer-encoding" not in headers
