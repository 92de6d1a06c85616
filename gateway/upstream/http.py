"""The upstream HTTP/1.1 client: keep-alive connections to each backend and provider.

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
"""

from __future__ import annotations

import asyncio
import ssl
from collections.abc import Mapping
from typing import NamedTuple
from urllib.parse import urlsplit

import httptools

# uvicorn, which vLLM and SGLang serve with, closes a connection idle for 5 s: one taken
# from the pool as the server closes it fails before its first byte, and with one backend
# there is no other to try. The pool lets its idle connections go sooner.
KEEPALIVE_S = 4.0
# past this many bytes read and not yet taken by the relay, the connection stops reading
# until the relay catches up (a slow client slows its upstream, as TCP would)
HIGH_WATER = 1 << 18


class TransportError(Exception):
    """The upstream could not be reached, or its connection failed before the answer ended."""


class ConnectFailed(TransportError):
    """No connection could be made; `os_error` says why."""

    def __init__(self, message: str, os_error: OSError) -> None:
        super().__init__(message)
        self.os_error = os_error


class ConnectionClosed(TransportError):
    """The connection closed before the answer ended."""


class ProtocolError(TransportError):
    """The upstream's bytes were not HTTP/1.1."""


class Route(NamedTuple):
    """Where requests to one URL go, and the head each of them starts with."""

    origin: tuple[str, int, bool]  # host, port, TLS
    head: bytes  # request line, host, and the fixed headers, each line ending in CRLF
    connect_s: float

    @classmethod
    def post(cls, url: str, headers: Mapping[str, str], *, connect_s: float) -> Route:
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"not an http(s) URL: {url!r}")
        tls = parts.scheme == "https"
        port = parts.port or (443 if tls else 80)
        host = f"[{parts.hostname}]" if ":" in parts.hostname else parts.hostname  # IPv6
        if parts.port is not None:
            host = f"{host}:{port}"
        target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
        lines = [f"POST {target} HTTP/1.1", f"host: {host}"]
        lines += [f"{name}: {value}" for name, value in headers.items()]
        if any("\r" in line or "\n" in line for line in lines):
            # a key read from the environment with a line break in it would add headers
            raise ValueError(f"a header for {url} has a line break in it")
        head = ("\r\n".join(lines) + "\r\n").encode("latin-1")
        return cls(origin=(parts.hostname, port, tls), head=head, connect_s=connect_s)


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

    def __init__(self, connection: _Connection) -> None:
        self.status = 0
        self.headers: dict[bytes, bytes] = {}  # names lower-cased
        self.complete = False  # the body has arrived to its end
        self._connection: _Connection | None = connection
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
        data = self._chunks[0] if len(self._chunks) == 1 else b"".join(self._chunks)
        self._chunks.clear()
        if self._buffered > HIGH_WATER and self._connection is not None:
            self._connection.transport.resume_reading()
        self._buffered = 0
        return data

    async def read(self) -> bytes:
        """The whole body."""
        return b"".join([data async for data in self])

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


class _Connection(asyncio.Protocol):
    """One connection to an origin, with its parser; serves one request at a time."""

    def __init__(self, pool: _OriginPool) -> None:
        self.transport: asyncio.Transport = None  # type: ignore[assignment]  # until made
        self.closed = False
        self.idle_since = 0.0
        self._pool = pool
        self._parser = httptools.HttpResponseParser(self)
        self._response: Response | None = None
        self._head: asyncio.Future[Response] | None = None
        self._keep_alive = False  # the last answer let the connection stay open

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports are not asyncio.Transport subclasses, though they are one
        self.transport = transport  # type: ignore[assignment]

    def request(self, data: bytes) -> asyncio.Future[Response]:
        """Send a request; the future is its answer's head."""
        self._response = Response(self)
        self._head = head = asyncio.get_running_loop().create_future()
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
        if self._response is None:  # nothing was asked: a server closing an idle connection
            self.close()
            return
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            self._fail(ProtocolError("the upstream upgraded the connection"))
        except httptools.HttpParserError as exc:
            self._fail(ProtocolError(f"bad HTTP from the upstream: {exc}"))

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self._pool.lost(self)
        response = self._response
        if response is not None and response.status and _ends_with_connection(response):
            response._ended()  # a body of no stated length ends where the connection does
            return
        self._fail(ConnectionClosed("the upstream closed the connection before the answer ended"))

    def _fail(self, failure: TransportError) -> None:
        self.close()
        head, response = self._head, self._response
        if head is not None and not head.done():
            head.set_exception(failure)
        elif response is not None and not response.complete:
            response._failed(failure)

    # httptools' callbacks

    def on_message_begin(self) -> None:
        if self._response is None or self._response.complete:
            # an answer after the one asked for: the connection's bytes cannot be trusted
            raise ProtocolError("the upstream sent an answer that was not asked for")

    def on_header(self, name: bytes, value: bytes) -> None:
        if self._response is not None:
            self._response.headers[name.lower()] = value

    def on_headers_complete(self) -> None:
        response, head = self._response, self._head
        if response is None or head is None or head.done():
            return
        response.status = self._parser.get_status_code()
        head.set_result(response)

    def on_body(self, body: bytes) -> None:
        if self._response is not None:
            self._response._body(body)

    def on_message_complete(self) -> None:
        # asked here: the parser forgets once it is ready for the next message
        self._keep_alive = self._parser.should_keep_alive()
        if self._response is not None:
            self._response._ended()


def _ends_with_connection(response: Response) -> bool:
    headers = response.headers
    return b"content-length" not in headers and b"transfer-encoding" not in headers


class _OriginPool:
    """The idle connections to one origin, most recently used last."""

    def __init__(self, origin: tuple[str, int, bool], slots: asyncio.Semaphore, keepalive_s: float):
        self.origin = origin
        self.slots = slots
        self._keepalive_s = keepalive_s
        self._idle: list[_Connection] = []
        self._tls = ssl.create_default_context() if origin[2] else None

    def take(self, now: float) -> _Connection | None:
        idle = self._idle
        while idle:
            connection = idle.pop()
            if now - connection.idle_since < self._keepalive_s:
                return connection
            connection.close()  # kept too long: the server may be closing it now
        return None

    def put_back(self, connection: _Connection) -> None:
        connection.idle_since = _now()
        self._idle.append(connection)

    def lost(self, connection: _Connection) -> None:
        if connection in self._idle:
            self._idle.remove(connection)

    async def connect(self, connect_s: float) -> _Connection:
        host, port, _ = self.origin
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(connect_s):
                _, connection = await loop.create_connection(
                    lambda: _Connection(self), host, port, ssl=self._tls
                )
        except OSError as exc:
            raise ConnectFailed(f"cannot connect to {host}:{port}: {exc}", exc) from exc
        return connection

    def close_idle(self) -> None:
        for connection in self._idle:
            connection.close()
        self._idle.clear()


def _now() -> float:
    return asyncio.get_running_loop().time()


class UpstreamPool:
    """Every upstream connection of the process, at most `max_connections` in use at once."""

    def __init__(self, *, max_connections: int, keepalive_s: float = KEEPALIVE_S) -> None:
        self._keepalive_s = keepalive_s
        self._origins: dict[tuple[str, int, bool], _OriginPool] = {}
        # bound to the event loop that first has to wait on it
        self._slots = asyncio.Semaphore(max_connections)

    async def post(
        self, route: Route, body: bytes, extra_headers: Mapping[str, str] | None = None
    ) -> Response:
        """Send `body` to `route` and return its answer once its head has arrived. A
        caller that gives up meanwhile (cancelled, timed out) leaves nothing open."""
        pool = self._origins.get(route.origin)
        if pool is None:
            pool = self._origins[route.origin] = _OriginPool(
                route.origin, self._slots, self._keepalive_s
            )
        head = route.head
        if extra_headers:
            head += "".join(f"{k}: {v}\r\n" for k, v in extra_headers.items()).encode("latin-1")
        await pool.slots.acquire()
        try:
            connection = pool.take(_now())
            if connection is None:
                connection = await pool.connect(route.connect_s)
        except BaseException:
            pool.slots.release()
            raise
        # from here the connection holds the slot, and gives it back when it is done
        try:
            return await connection.request(
                b"%scontent-length: %d\r\n\r\n%s" % (head, len(body), body)
            )
        except BaseException:
            connection.done(reuse=False)
            raise

    async def aclose(self) -> None:
        for pool in self._origins.values():
            pool.close_idle()
        self._origins.clear()
