"""The fixed parts of `spillgate bench`: a zero-delay backend and the smallest raw relay.

Both are plain ASGI on the same server and client libraries as the gateway (uvicorn,
httpx), so the arms differ only in what the gateway does per request.
"""

from __future__ import annotations

import asyncio
import os
from typing import Any

import orjson
from starlette.types import Receive, Scope, Send

from gateway.upstream.session import UpstreamPool

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

    Same server (uvicorn) and client (one aiohttp session) as the gateway, no features.
    """

    def __init__(self, upstream: str) -> None:
        self._pool = UpstreamPool(max_connections=1024)
        self._upstream = upstream

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await self._lifespan(receive, send)
            return
        body = await _read(receive)
        url = self._upstream + scope["path"]
        headers = {"content-type": "application/json"}
        async with self._pool.session.post(url, data=body, headers=headers) as response:
            head = [(b"content-type", response.headers["content-type"].encode())]
            await send({"type": "http.response.start", "status": response.status,
                        "headers": head})  # fmt: skip
            async for chunk in response.content.iter_any():
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b""})

    async def _lifespan(self, receive: Receive, send: Send) -> None:
        while True:
            message: dict[str, Any] = dict(await receive())
            if message["type"] == "lifespan.startup":
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                await self._pool.aclose()
                await send({"type": "lifespan.shutdown.complete"})
                return


relay = RawRelay(UPSTREAM)
