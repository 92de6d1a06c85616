"""Servers on loopback that answer byte by byte as a test needs, for the upstream client
and the gateway in front of it: keep-alive, streaming, closing, resetting, refusing,
breaking the protocol.

`Server` runs on the test's own event loop (the client-level tests, each run by `run` on
asyncio's loop and on uvloop's); `Backend` runs in a thread of its own, as a backend the
gateway forwards to."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import struct
import threading
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import orjson
import uvloop

from gateway.upstream.http_head import Route
from gateway.upstream.pool import UpstreamPool

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]
OK = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 2\r\n\r\n{}"
SSE_HEAD = (
    b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
)
CHUNKED = b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n"


class Server:
    """A TCP server whose every connection runs `handler`; counts the connections, and
    those still open."""

    def __init__(self, handler: Handler) -> None:
        self.handler = handler
        self.connections = 0
        self.open = 0
        self.closed_by_client = asyncio.Event()
        self.requests: list[bytes] = []
        self._server: asyncio.Server | None = None

    async def __aenter__(self) -> Server:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._server is not None
        self._server.close()

    @property
    def port(self) -> int:
        assert self._server is not None
        return int(self._server.sockets[0].getsockname()[1])

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1/chat/completions"

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        self.open += 1
        try:
            await self.handler(reader, writer)
        finally:
            self.open -= 1
            writer.close()

    async def each_request(self, reader: asyncio.StreamReader) -> AsyncIterator[bytes]:
        """Each request the client sends on one connection, until it goes."""
        while True:
            try:
                yield await self.request(reader)
            except asyncio.IncompleteReadError:
                return

    async def request(self, reader: asyncio.StreamReader) -> bytes:
        """One request's head and body, as the client sent them; IncompleteReadError once
        the client has gone."""
        head = await reader.readuntil(b"\r\n\r\n")
        length = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
        raw = head + await reader.readexactly(length)
        self.requests.append(raw)
        return raw


def route(url: str, **headers: str) -> Route:
    return Route.post(url, {"content-type": "application/json", **headers}, connect_s=1.0)


def run(test: Callable[[], Awaitable[Any]]) -> Any:
    """The test on asyncio's own loop, then on uvloop's, which the gateway serves with and
    whose transports are not asyncio's classes; both must give the same answer."""
    mine = asyncio.run(asyncio.wait_for(test(), 10))
    assert uvloop.run(asyncio.wait_for(test(), 10)) == mine
    return mine


def answering(server_answer: bytes, *, times: int = 100) -> Callable[[Server], Handler]:
    def handler_for(server: Server) -> Handler:
        async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            for _ in range(times):
                try:
                    await server.request(reader)
                    writer.write(server_answer)
                    await writer.drain()
                except (asyncio.IncompleteReadError, ConnectionError):
                    return  # the client has gone, or refused the answer and closed

        return handler

    return handler_for


def serve(handler_for: Callable[[Server], Handler]) -> Server:
    server = Server(lambda r, w: asyncio.sleep(0))
    server.handler = handler_for(server)
    return server


async def fetched(handler_for: Callable[[Server], Handler], **pool_options: Any) -> bytes:
    """One request to a fresh server that runs `handler_for`: its answer's body, read to
    the end (released either way: closed when not read to its end)."""
    async with serve(handler_for) as server:
        pool = UpstreamPool(max_connections=8, **pool_options)
        try:
            response = await pool.post(route(server.url), b"{}")
            try:
                return await response.read()
            finally:
                response.release()
        finally:
            await pool.aclose()


def reset(writer: asyncio.StreamWriter) -> None:
    """Close the connection with a TCP reset rather than in order (SO_LINGER 0)."""
    writer.get_extra_info("socket").setsockopt(
        socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0)
    )
    writer.transport.abort()


@dataclass(frozen=True)
class Post:
    """A POST as `Backend` hands it to its answer."""

    connection: int  # which connection, counted from 0 in the order they were made (probes too)
    on_connection: int  # which request on that connection, from 0
    index: int  # which POST of all, from 0
    body: dict[str, Any]


# what to write back to a POST: its bytes, or pieces to write one by one as they come
# (an answer that takes its time); None: close the connection without a word
Answer = Callable[[Post], bytes | AsyncIterator[bytes] | None]


class Backend:
    """A backend for the gateway, on a thread of its own: a GET (the gateway's probes)
    gets `listing` (by default `{}`, which tells the gateway nothing and is not held against
    it); a POST gets what `answer` returns (written as it comes, where it is an async
    iterator). Keeps every POST, and counts the connections POSTs came on."""

    def __init__(self, answer: Answer, *, listing: bytes = b"{}") -> None:
        self.answer = answer
        self._got = b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n%s" % (len(listing), listing)
        self.posts: list[Post] = []
        self._connections = 0
        self._port = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._started = threading.Event()
        self._thread = threading.Thread(target=asyncio.run, args=(self._main(),), daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._port}"

    @property
    def post_connections(self) -> int:
        return len({post.connection for post in self.posts})

    def __enter__(self) -> Backend:
        self._thread.start()
        if not self._started.wait(10):
            raise RuntimeError("the raw backend did not start")
        return self

    def __exit__(self, *exc: object) -> None:
        assert self._loop is not None and self._stop is not None
        self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(10)

    async def _main(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self._port = server.sockets[0].getsockname()[1]
        self._started.set()
        async with server:
            await self._stop.wait()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        connection = self._connections
        self._connections += 1
        on_connection = 0
        with contextlib.suppress(ConnectionError, asyncio.IncompleteReadError):
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = 0
                for line in head.lower().split(b"\r\n"):
                    if line.startswith(b"content-length:"):
                        length = int(line.partition(b":")[2])
                body = await reader.readexactly(length)
                if not head.startswith(b"POST "):
                    writer.write(self._got)
                    continue
                post = Post(connection, on_connection, len(self.posts), orjson.loads(body))
                self.posts.append(post)
                on_connection += 1
                answer = self.answer(post)
                if answer is None:
                    break
                if isinstance(answer, bytes):
                    writer.write(answer)
                    await writer.drain()
                    continue
                async for piece in answer:
                    writer.write(piece)
                    await writer.drain()
        writer.close()


def chat_answer(post: Post, *, before: bytes = b"") -> bytes:
    """An OpenAI-shaped chat answer to `post` in full (its head after `before`): a JSON
    body, or a stream of events in chunks when it asked for one."""
    model = post.body["model"]
    usage = {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}
    if not post.body.get("stream"):
        message = {"role": "assistant", "content": "Hello there"}
        body = orjson.dumps({
            "id": "chatcmpl-raw", "object": "chat.completion", "created": 1, "model": model,
            "choices": [{"index": 0, "message": message, "finish_reason": "stop"}],
            "usage": usage,
        })  # fmt: skip
        head = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n"
        return before + head % len(body) + body
    chunk = {"id": "chatcmpl-raw", "object": "chat.completion.chunk", "created": 1, "model": model}
    events = [
        {**chunk, "choices": [{"index": 0, "delta": {"content": text}}]}
        for text in ("Hello", " there")
    ]
    events.append({**chunk, "choices": [], "usage": usage})
    lines = [b"data: " + orjson.dumps(event) + b"\n\n" for event in events] + [b"data: [DONE]\n\n"]
    framed = b"".join(b"%x\r\n%s\r\n" % (len(line), line) for line in lines)
    return before + SSE_HEAD + framed + b"0\r\n\r\n"


def refusal(status: int, *headers: bytes) -> Callable[[Post], bytes]:
    """A refusal with `status`, `headers` and an OpenAI-shaped JSON error body."""
    body = b'{"error":{"message":"busy","type":"server_error"}}'
    extra = b"".join(h + b"\r\n" for h in headers)
    head = b"HTTP/1.1 %d Busy\r\ncontent-type: application/json\r\n%scontent-length: %d\r\n\r\n"
    return lambda post: head % (status, extra, len(body)) + body
