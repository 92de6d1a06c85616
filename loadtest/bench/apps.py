"""The fixed parts of `spillgate bench`: a zero-delay backend and the smallest relays.

All are plain ASGI on uvicorn, as the gateway serves. `relay`, the raw relay every
figure is compared with, forwards with one aiohttp session, the most used asyncio client;
`lean_relay` with the gateway's own upstream client (gateway/upstream/http.py), so that
what the gateway's features cost shows apart from what its client saves.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Awaitable, Callable
from typing import Any

import aiohttp
import orjson
from starlette.types import Receive, Scope, Send

from gateway.upstream.http_head import Route
from gateway.upstream.pool import UpstreamPool

MODEL = "bench-model"
CHUNKS = int(os.environ.get("BENCH_STREAM_CHUNKS", "32"))
UPSTREAM = os.environ.get("BENCH_UPSTREAM", "http://127.0.0.1:9000")

_REPLY = orjson.dumps(
    {
        "id": "chatcmpl-bench",
        "object": "chat.completion",
        "created": 0,
        "model": MODEL,
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": "ok " * 16},
                "finish_reason": "length",
            }
        ],
        "usage": {"prompt_tokens": 12, "completion_tokens": 16, "total_tokens": 28},
    }
)
_CHUNK = (
    b'data: {"id":"chatcmpl-bench","object":"chat.completion.chunk","created":0,"model":"'
    + MODEL.encode()
    + b'","choices":[{"index":0,"delta":{"content":" ok"},"finish_reason":null}]}\n\n'
)
_USAGE = (
    b'data: {"id":"chatcmpl-bench","object":"chat.completion.chunk","created":0,"model":"'
    + MODEL.encode()
    + b'","choices":[],"usage":{"prompt_tokens":12,"completion_tokens":'
    + str(CHUNKS).encode()
    + b',"total_tokens":'
    + str(12 + CHUNKS).encode()
    + b"}}\n\n"
)
_METRICS = (
    b"# TYPE vllm:cache_config_info gauge\n"
    b'vllm:cache_config_info{block_size="16",num_gpu_blocks="1000000"} 1.0\n'
)


async def _read(receive: Receive) -> bytes:
    body = b""
    while True:
        message = await receive()
        body += message.get("body", b"")
        if not message.get("more_body", False):
            return body


async def backend(scope: Scope, receive: Receive, send: Send) -> None:
    """Answers every completion at once: JSON, or CHUNKS SSE events `bench_gap_ms` apart."""
    if scope["type"] != "http":
        return
    if scope["path"] in ("/metrics", "/health"):
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": _METRICS})
        return
    body = await _read(receive)
    if b'"stream":true' not in body.replace(b" ", b""):
        headers = [(b"content-type", b"application/json")]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        await send({"type": "http.response.body", "body": _REPLY})
        return
    gap_s = float(orjson.loads(body).get("bench_gap_ms") or 0) / 1000
    headers = [(b"content-type", b"text/event-stream")]
    await send({"type": "http.response.start", "status": 200, "headers": headers})
    for _ in range(CHUNKS):
        await send({"type": "http.response.body", "body": _CHUNK, "more_body": True})
        if gap_s:
            await asyncio.sleep(gap_s)
    await send({"type": "http.response.body", "body": _USAGE + b"data: [DONE]\n\n"})


class RawRelay:
    """The smallest pass-through: read the body, send it upstream, relay the bytes back.

    One aiohttp session, set as the gateway set its own before it had a client of its own:
    up to 1,024 connections kept alive 4 s, no decompression, no cookies, no user agent.
    """

    def __init__(self, upstream: str) -> None:
        self._session: aiohttp.ClientSession | None = None
        self._upstream = upstream

    @property
    def session(self) -> aiohttp.ClientSession:
        if self._session is None:  # made in the event loop
            connector = aiohttp.TCPConnector(limit=1024, keepalive_timeout=4.0)
            self._session = aiohttp.ClientSession(
                connector=connector,
                auto_decompress=False,
                cookie_jar=aiohttp.DummyCookieJar(),
                skip_auto_headers=("User-Agent",),
            )
        return self._session

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await _lifespan(receive, send, self.aclose)
            return
        body = await _read(receive)
        url = self._upstream + scope["path"]
        headers = {"content-type": "application/json"}
        async with self.session.post(url, data=body, headers=headers) as response:
            head = [(b"content-type", response.headers["content-type"].encode())]
            await send({"type": "http.response.start", "status": response.status,
                        "headers": head})  # fmt: skip
            async for chunk in response.content.iter_any():
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b""})

    async def aclose(self) -> None:
        if self._session is not None:
            await self._session.close()


class LeanRelay:
    """The same pass-through on the gateway's own upstream client."""

    def __init__(self, upstream: str) -> None:
        self._pool = UpstreamPool(max_connections=1024)
        self._upstream = upstream
        self._routes: dict[str, Route] = {}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await _lifespan(receive, send, self._pool.aclose)
            return
        body = await _read(receive)
        route = self._routes.get(scope["path"])
        if route is None:
            url = self._upstream + scope["path"]
            headers = {"content-type": "application/json"}
            route = self._routes[scope["path"]] = Route.post(url, headers, connect_s=2.0)
        response = await self._pool.post(route, body)
        try:
            head = [(b"content-type", response.headers[b"content-type"])]
            await send({"type": "http.response.start", "status": response.status,
                        "headers": head})  # fmt: skip
            async for chunk in response:
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b""})
        finally:
            response.release()


async def _lifespan(receive: Receive, send: Send, aclose: Callable[[], Awaitable[None]]) -> None:
    while True:
        message: dict[str, Any] = dict(await receive())
        if message["type"] == "lifespan.startup":
            await send({"type": "lifespan.startup.complete"})
        elif message["type"] == "lifespan.shutdown":
            await aclose()
            await send({"type": "lifespan.shutdown.complete"})
            return


relay = RawRelay(UPSTREAM)
lean_relay = LeanRelay(UPSTREAM)
