"""A small HTTP/1.1 client on asyncio streams, made for one job: many concurrent SSE streams.

A general client spends most of its time in per-chunk machinery that a load generator
does not need; this one reads the status line and headers, then hands the body over as
raw chunks (content-length or chunked), and keeps idle connections for reuse.
"""

from __future__ import annotations

import asyncio
import contextlib
import ssl
from collections.abc import AsyncIterator
from dataclasses import dataclass
from urllib.parse import urlsplit


class HttpError(Exception):
    """The connection failed or the server broke the protocol."""


@dataclass(frozen=True, kw_only=True)
class Origin:
    scheme: str
    host: str
    port: int
    prefix: str  # path before the API route, without a trailing slash

    @classmethod
    def parse(cls, url: str) -> Origin:
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"not an http(s) URL: {url!r}")
        port = parts.port or (443 if parts.scheme == "https" else 80)
        return cls(
            scheme=parts.scheme, host=parts.hostname, port=port, prefix=parts.path.rstrip("/")
        )

    @property
    def host_header(self) -> str:
        default = 443 if self.scheme == "https" else 80
        return self.host if self.port == default else f"{self.host}:{self.port}"

    def url(self, path: str) -> str:
        return f"{self.scheme}://{self.host_header}{self.prefix}{path}"


@dataclass(slots=True)
class Response:
    status: int
    headers: dict[str, str]
    reader: asyncio.StreamReader
    keep_alive: bool
    finished: bool = False  # the body was read to its end

    async def chunks(self) -> AsyncIterator[bytes]:
        """The body as it arrives."""
        length = self.headers.get("content-length")
        if self.headers.get("transfer-encoding", "").lower() == "chunked":
            async for chunk in _chunked(self.reader):
                yield chunk
        elif length is not None:
            yield await self.reader.readexactly(int(length))
        else:
            self.keep_alive = False
            while data := await self.reader.read(65536):
                yield data
        self.finished = True

    async def body(self) -> bytes:
        return b"".join([chunk async for chunk in self.chunks()])

    async def reads(self) -> AsyncIterator[bytes]:
        """The body a network read at a time: bytes that arrived together come out together,
        where `chunks` hands over each chunk of a read as if it had arrived on its own."""
        chunked = self.headers.get("transfer-encoding", "").lower() == "chunked"
        length = self.headers.get("content-length")
        left = None if chunked or length is None else int(length)
        decoder = Dechunker() if chunked else None
        while left is None or left > 0:
            data = await self.reader.read(READ_SIZE if left is None else min(left, READ_SIZE))
            if not data:
                if decoder is None and left is None:  # the body ends with the connection
                    self.keep_alive = False
                    break
                raise HttpError("the connection closed in the middle of the body")
            if left is not None:
                left -= len(data)
            payload = decoder.feed(data) if decoder is not None else data
            if payload:
                yield payload
            if decoder is not None and decoder.done:
                self.keep_alive = self.keep_alive and not decoder.leftover
                break
        self.finished = True


READ_SIZE = 65536


class Dechunker:
    """Takes the chunked transfer coding off a body fed in pieces of any size."""

    def __init__(self) -> None:
        self._pending = b""  # an unfinished size line, chunk ending or trailer
        self._left = 0  # bytes of the current chunk still to come
        self._state = "size"  # size, data, crlf, trailer, done
        self.leftover = False  # bytes came after the last chunk

    @property
    def done(self) -> bool:
        return self._state == "done"

    def feed(self, data: bytes) -> bytes:
        buf, pos, out = self._pending + data, 0, []
        while pos < len(buf) and self._state != "done":
            if self._state == "data":
                take = min(self._left, len(buf) - pos)
                out.append(buf[pos : pos + take])
                pos += take
                self._left -= take
                if self._left == 0:
                    self._state = "crlf"
            elif self._state == "crlf":
                if len(buf) - pos < 2:
                    break
                if buf[pos : pos + 2] != b"\r\n":
                    raise HttpError("a chunk did not end with CRLF")
                pos += 2
                self._state = "size"
            else:
                end = buf.find(b"\r\n", pos)
                if end < 0:
                    break
                line, pos = buf[pos:end], end + 2
                self._line(line)
        self.leftover = self.leftover or (self._state == "done" and pos < len(buf))
        self._pending = buf[pos:] if self._state != "done" else b""
        return b"".join(out)

    def _line(self, line: bytes) -> None:
        if self._state == "trailer":
            if not line:
                self._state = "done"
            return
        try:
            size = int(line.split(b";", 1)[0], 16)
        except ValueError:
            raise HttpError(f"bad chunk size line {line[:40]!r}") from None
        self._left = size
        self._state = "data" if size else "trailer"


async def _chunked(reader: asyncio.StreamReader) -> AsyncIterator[bytes]:
    while True:
        line = await reader.readuntil(b"\r\n")
        size = int(line.split(b";", 1)[0], 16)
        if size == 0:
            while await reader.readuntil(b"\r\n") != b"\r\n":
                pass  # trailers
            return
        data = await reader.readexactly(size + 2)
        yield data[:-2]


def _parse_head(head: bytes) -> tuple[int, dict[str, str]]:
    lines = head.decode("latin-1").split("\r\n")
    try:
        status = int(lines[0].split(" ", 2)[1])
    except (IndexError, ValueError):
        raise HttpError(f"bad status line {lines[0]!r}") from None
    headers: dict[str, str] = {}
    for line in lines[1:]:
        name, sep, value = line.partition(":")
        if sep:
            headers[name.strip().lower()] = value.strip()
    return status, headers


_Conn = tuple[asyncio.StreamReader, asyncio.StreamWriter]


class ConnectionPool:
    """Keep-alive connections to one origin; as many at once as the load asks for."""

    def __init__(self, origin: Origin, *, connect_timeout_s: float = 5.0) -> None:
        self.origin = origin
        self._connect_timeout = connect_timeout_s
        self._idle: list[_Conn] = []
        self._ssl = ssl.create_default_context() if origin.scheme == "https" else None
        self.opened = 0

    async def _connect(self) -> _Conn:
        try:
            async with asyncio.timeout(self._connect_timeout):
                conn = await asyncio.open_connection(
                    self.origin.host, self.origin.port, ssl=self._ssl, limit=1 << 20
                )
        except (OSError, TimeoutError) as exc:
            raise HttpError(f"connect to {self.origin.host_header}: {exc or 'timed out'}") from exc
        self.opened += 1
        return conn

    @contextlib.asynccontextmanager
    async def request(
        self, method: str, path: str, *, headers: dict[str, str], body: bytes = b""
    ) -> AsyncIterator[Response]:
        """Send one request; yield the response with its body unread. The connection goes
        back to the pool only when the body was read to its end."""
        fresh = not self._idle
        conn = self._idle.pop() if self._idle else await self._connect()
        head = self._head(method, path, headers, len(body))
        response: Response | None = None
        try:
            try:
                response = await self._exchange(conn, head + body)
            except (OSError, asyncio.IncompleteReadError, HttpError):
                if fresh:
                    raise
                conn[1].close()  # a reused connection the server had closed: one retry
                conn = await self._connect()
                response = await self._exchange(conn, head + body)
            yield response
        except (OSError, asyncio.IncompleteReadError, asyncio.LimitOverrunError) as exc:
            response = None
            raise HttpError(f"{type(exc).__name__}: {exc}") from exc
        finally:
            self._done(conn, response)

    def _head(self, method: str, path: str, headers: dict[str, str], length: int) -> bytes:
        lines = [
            f"{method} {self.origin.prefix}{path} HTTP/1.1",
            f"host: {self.origin.host_header}",
            f"content-length: {length}",
            *(f"{k}: {v}" for k, v in headers.items()),
        ]
        return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")

    async def _exchange(self, conn: _Conn, data: bytes) -> Response:
        reader, writer = conn
        writer.write(data)
        await writer.drain()
        head = await reader.readuntil(b"\r\n\r\n")
        status, headers = _parse_head(head[:-4])
        keep = headers.get("connection", "").lower() != "close"
        return Response(status=status, headers=headers, reader=reader, keep_alive=keep)

    def _done(self, conn: _Conn, response: Response | None) -> None:
        if response is not None and response.keep_alive and response.finished:
            self._idle.append(conn)
        else:
            conn[1].close()

    async def close(self) -> None:
        for _, writer in self._idle:
            writer.close()
        self._idle.clear()
