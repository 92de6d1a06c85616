"""The upstream client's connection pools: for each origin the connections open and the
idle ones, made with Happy Eyeballs, kept alive, pruned, and handed out one request at a
time, all of them bounded by one count of connections in use. Security-sensitive, as
gateway/upstream/http.py says (a connection handed out closed, or never let go, is what a
misbehaving upstream costs every request)."""

from __future__ import annotations

import asyncio
import socket
import ssl
from collections import deque
from collections.abc import Awaitable, Callable, Mapping, Sequence

import aiohappyeyeballs

from gateway.upstream.http import Connection, Response
from gateway.upstream.http_head import ConnectFailed, ConnectionClosed, Route, header_line

# uvicorn, which vLLM and SGLang serve with, closes a connection idle for 5 s: one taken
# from the pool as the server closes it fails before its first byte, and with one backend
# there is no other to try. The pool lets its idle connections go sooner.
KEEPALIVE_S = 4.0
# Envoy's bounds on a response head: 60 KiB of names and values, and 100 fields
MAX_HEADER_BYTES = 60 * 1024
MAX_HEADERS = 100
# RFC 8305's connection attempt delay: the next address is tried once the one before it
# has not connected for this long
HAPPY_EYEBALLS_DELAY_S = 0.25

Addresses = Sequence[aiohappyeyeballs.AddrInfoType]
Resolve = Callable[[str, int], Awaitable[Addresses]]


async def resolve_host(host: str, port: int) -> Addresses:
    """The host's addresses, of every family, as the system's resolver gives them."""
    try:
        # an address written as one needs no lookup, nor a trip to the resolver's thread
        return socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_NUMERICHOST)
    except socket.gaierror:
        pass
    return await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)


class _OriginPool:
    """The connections to one origin: every one open, and the idle ones, oldest first."""

    def __init__(
        self,
        origin: tuple[str, int, bool],
        slots: asyncio.Semaphore,
        *,
        keepalive_s: float,
        max_header_bytes: int,
        max_headers: int,
        resolve: Resolve,
    ) -> None:
        self.origin = origin
        self.slots = slots
        self.max_header_bytes = max_header_bytes
        self.max_headers = max_headers
        self._keepalive_s = keepalive_s
        self._resolve = resolve
        self._idle: deque[Connection] = deque()
        self._open: set[Connection] = set()
        self._closed = False
        self._tls = ssl.create_default_context() if origin[2] else None

    def take(self, now: float) -> Connection | None:
        self._prune(now)
        idle = self._idle
        while idle:
            connection = idle.pop()  # the most recently used: the likeliest to be open
            if not connection.closed and not connection.transport.is_closing():
                return connection
        return None

    def put_back(self, connection: Connection) -> None:
        if self._closed:  # made for a request still on its way as the pool closed
            connection.close()
            return
        now = _now()
        connection.idle_since = now
        self._idle.append(connection)
        self._prune(now)

    def _prune(self, now: float) -> None:
        """Close the connections idle for `keepalive_s`: the server may be closing them
        now, and one it never closes would stay open for nothing."""
        idle = self._idle
        kept_since = now - self._keepalive_s
        while idle and idle[0].idle_since <= kept_since:
            idle.popleft().close()

    def lost(self, connection: Connection) -> None:
        self._open.discard(connection)
        if connection in self._idle:
            self._idle.remove(connection)

    async def connect(self, connect_s: float) -> Connection:
        host, port, tls = self.origin
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(connect_s):
                addresses = await self._resolve(host, port)
                sock = await aiohappyeyeballs.start_connection(
                    addresses, happy_eyeballs_delay=HAPPY_EYEBALLS_DELAY_S, interleave=1
                )
                try:
                    _, connection = await loop.create_connection(
                        lambda: Connection(self),
                        sock=sock,
                        ssl=self._tls,
                        server_hostname=host if tls else None,
                    )
                except BaseException:
                    sock.close()
                    raise
        except (OSError, RuntimeError) as exc:
            # aiohappyeyeballs passes on uvloop's RuntimeError where asyncio raises OSError
            os_error = exc if isinstance(exc, OSError) else OSError(str(exc))
            raise ConnectFailed(f"cannot connect to {host}:{port}: {exc}", os_error) from exc
        self._open.add(connection)
        return connection

    def close_all(self) -> None:
        self._closed = True
        for connection in list(self._open):
            connection.close()
        self._open.clear()
        self._idle.clear()


def _now() -> float:
    return asyncio.get_running_loop().time()


class UpstreamPool:
    """Every upstream connection of the process, at most `max_connections` in use at once.

    `max_header_bytes` and `max_headers` bound each answer's head (trailers included);
    `resolve` gives a host's addresses (the system's resolver by default)."""

    def __init__(
        self,
        *,
        max_connections: int,
        keepalive_s: float = KEEPALIVE_S,
        max_header_bytes: int = MAX_HEADER_BYTES,
        max_headers: int = MAX_HEADERS,
        resolve: Resolve = resolve_host,
    ) -> None:
        self._keepalive_s = keepalive_s
        self._max_header_bytes = max_header_bytes
        self._max_headers = max_headers
        self._resolve = resolve
        self._origins: dict[tuple[str, int, bool], _OriginPool] = {}
        # bound to the event loop that first has to wait on it
        self._slots = asyncio.Semaphore(max_connections)

    async def post(
        self, route: Route, body: bytes, extra_headers: Mapping[str, str] | None = None
    ) -> Response:
        """Send `body` to `route` and return its answer once its head has arrived. A
        caller that gives up meanwhile (cancelled, timed out) leaves nothing open.
        ValueError for an `extra_headers` line `header_line` refuses."""
        pool = self._origins.get(route.origin)
        if pool is None:
            pool = self._origins[route.origin] = _OriginPool(
                route.origin,
                self._slots,
                keepalive_s=self._keepalive_s,
                max_header_bytes=self._max_header_bytes,
                max_headers=self._max_headers,
                resolve=self._resolve,
            )
        head = route.head
        if extra_headers:
            lines = [header_line(name, value) for name, value in extra_headers.items()]
            head += "".join(lines).encode("latin-1")
        data = b"%scontent-length: %d\r\n\r\n%s" % (head, len(body), body)
        # the slot is this call's until an answer's head is returned: from then on the
        # connection holds it, and gives it back when it is done
        await pool.slots.acquire()
        connection: Connection | None = None
        try:
            connection = pool.take(_now())
            if connection is not None:
                try:
                    return await connection.request(data)
                except ConnectionClosed:
                    if connection.answered:
                        raise
                # The server closed the kept-alive connection as the request went out (its
                # idle timer, a rolling restart) and not a byte of an answer came. The
                # request is a POST, which aiohttp sends again only for idempotent methods
                # (RFC 9112 §9.3.1); an inference request is idempotent in effect: it
                # changes nothing at the server, and a failure before the first byte is
                # sent to another backend anyway. Once, on a new connection: a new one
                # that closes unanswered is the server's answer.
                connection.close()
            connection = await pool.connect(route.connect_s)
            return await connection.request(data)
        except BaseException:
            if connection is not None:
                connection.close()
            pool.slots.release()
            raise

    async def aclose(self) -> None:
        """Close every connection, those whose answers are being read too."""
        for pool in self._origins.values():
            pool.close_all()
        self._origins.clear()
