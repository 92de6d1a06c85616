"""Relay one upstream response to the client: SSE bytes pass through as they arrive.

Only events that carry `"usage"` are parsed (to learn real usage and to drop the usage
chunk a client did not ask for); every other byte is relayed untouched, apart from the
model name, which is swapped back to the name the client asked for.
"""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any, Protocol

import aiohttp
import orjson
from starlette.types import Send

from gateway.deadline import Deadline

SSE_HEADERS = [
    (b"content-type", b"text/event-stream; charset=utf-8"),
    (b"cache-control", b"no-cache"),
    (b"x-accel-buffering", b"no"),
]
JSON_HEADERS = [(b"content-type", b"application/json")]
DONE = b"data: [DONE]\n\n"


@dataclass(slots=True)
class Usage:
    prompt_tokens: int = 0
    completion_tokens: int = 0
    known: bool = False

    @classmethod
    def from_json(cls, usage: Any) -> Usage:
        if not isinstance(usage, dict):
            return cls()
        # positional (prompt, completion, known): built once per answer
        return cls(
            int(usage.get("prompt_tokens") or 0), int(usage.get("completion_tokens") or 0), True
        )

    @property
    def total(self) -> int:
        return self.prompt_tokens + self.completion_tokens


class ResponseTap(Protocol):
    """Sees the bytes of one successful response (e.g. to fill the response cache)."""

    def feed(self, data: bytes) -> None: ...

    def finish(self, usage: Usage) -> None: ...


@dataclass(slots=True)
class Relayed:
    usage: Usage
    first_byte_at: float | None  # perf_counter when the first byte reached the client
    completed: bool  # False when the upstream broke mid-stream


@functools.lru_cache(maxsize=256)
def model_swap(served: str, public: str) -> tuple[bytes, bytes] | None:
    if served == public:
        return None
    return (
        b'"model":' + orjson.dumps(served),
        b'"model":' + orjson.dumps(public),
    )


def sse_error_event(message: str, *, code: str = "upstream_error") -> bytes:
    error = {"error": {"message": message, "type": "server_error", "param": None, "code": code}}
    return b"data: " + orjson.dumps(error) + b"\n\n" + DONE


class StreamRelay:
    """Cuts upstream chunks at event boundaries and relays them; reads the usage event."""

    def __init__(
        self,
        *,
        send: Send,
        swap: tuple[bytes, bytes] | None,
        keep_usage: bool,
        tap: ResponseTap | None,
    ) -> None:
        self._send = send
        self._swap = swap
        self._keep_usage = keep_usage
        self._tap = tap
        self._pending = b""
        self.usage = Usage()

    async def feed(self, chunk: bytes) -> None:
        data = self._pending + chunk if self._pending else chunk
        cut = data.rfind(b"\n\n")
        if cut < 0:
            self._pending = data
            return
        out, self._pending = data[: cut + 2], data[cut + 2 :]
        await self._emit(out)

    async def flush(self) -> None:
        """Relay what is left after the upstream's last blank line, treated like the rest."""
        if self._pending:
            rest, self._pending = self._pending, b""
            await self._emit(rest)

    async def _emit(self, out: bytes) -> None:
        # providers send `"usage":null` on every chunk once usage is asked for: only a
        # usage object is worth parsing
        if b'"usage":{' in out or b'"usage": {' in out:
            out = self._read_usage(out)
        if self._swap is not None:
            out = out.replace(*self._swap)
        if self._tap is not None:
            self._tap.feed(out)
        if out:
            await self._send({"type": "http.response.body", "body": out, "more_body": True})

    def _read_usage(self, out: bytes) -> bytes:
        kept: list[bytes] = []
        for event in out.split(b"\n\n"):
            if b'"usage"' in event and event.startswith(b"data: "):
                try:
                    payload = orjson.loads(event[6:])
                except orjson.JSONDecodeError:
                    payload = None
                if isinstance(payload, dict) and payload.get("usage"):
                    self.usage = Usage.from_json(payload["usage"])
                    if not self._keep_usage and not payload.get("choices"):
                        continue
                    if not self._keep_usage:
                        payload["usage"] = None
                        event = b"data: " + orjson.dumps(payload)
            kept.append(event)
        return b"\n\n".join(kept)


async def relay_stream(
    chunks: AsyncIterator[bytes],
    *,
    send: Send,
    status: int,
    headers: list[tuple[bytes, bytes]],
    first_chunk: bytes,
    swap: tuple[bytes, bytes] | None,
    keep_usage: bool,
    idle_s: float,
    deadline: float,
    tap: ResponseTap | None,
) -> Relayed:
    relay = StreamRelay(send=send, swap=swap, keep_usage=keep_usage, tap=tap)
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await relay.feed(first_chunk)
    first_byte_at = time.perf_counter()
    loop = asyncio.get_running_loop()
    try:
        with Deadline(min(loop.time() + idle_s, deadline)) as budget:
            async for chunk in chunks:
                await relay.feed(chunk)
                budget.extend(min(loop.time() + idle_s, deadline))
    except (TimeoutError, aiohttp.ClientError, OSError) as exc:
        await relay.flush()
        message = "The upstream stopped responding mid-stream; the response is incomplete."
        if not isinstance(exc, TimeoutError):
            message = f"The upstream connection failed mid-stream: {type(exc).__name__}."
        body = sse_error_event(message)
        await send({"type": "http.response.body", "body": body, "more_body": False})
        return Relayed(relay.usage, first_byte_at, False)  # not completed
    await relay.flush()
    if tap is not None:
        tap.finish(relay.usage)
    await send({"type": "http.response.body", "body": b"", "more_body": False})
    return Relayed(relay.usage, first_byte_at, True)


async def send_json_body(
    body: bytes,
    *,
    send: Send,
    status: int,
    headers: list[tuple[bytes, bytes]],
    swap: tuple[bytes, bytes] | None,
    tap: ResponseTap | None,
) -> Relayed:
    try:
        parsed = orjson.loads(body)
    except orjson.JSONDecodeError:
        parsed = None
    usage = Usage.from_json(parsed.get("usage")) if isinstance(parsed, dict) else Usage()
    if swap is not None:
        body = body.replace(*swap)
    all_headers = [*headers, (b"content-length", b"%d" % len(body))]
    await send({"type": "http.response.start", "status": status, "headers": all_headers})
    if tap is not None:
        tap.feed(body)
        tap.finish(usage)
    await send({"type": "http.response.body", "body": body, "more_body": False})
    return Relayed(usage, time.perf_counter(), True)
