"""What the hardening tests share: backends that misbehave on cue, a backend in its own
process to kill, the books that say where every tenant's buckets must stand, and small
request and metrics helpers."""

from __future__ import annotations

import asyncio
import contextlib
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import httpx
import orjson
from starlette.types import Receive, Scope, Send

from loadtest.procs import free_port, wait_for_port
from tests.support.fleet import Fleet
from tests.support.overflow import backend_requests, chat, holding, provider_stats

__all__ = ["backend_requests", "chat", "holding", "provider_stats"]  # shared with overflow tests

TRICKLE_GAP_S = 0.1
PATIENCE_S = 30.0  # no misbehaving handler outlives this, so servers always stop
EVENT = (
    b'data: {"object":"chat.completion.chunk","choices":[{"index":0,"delta":{"content":"."}}]}\n\n'
)


class FaultBackend:
    """One server, many backends: `/<name>/v1/...` is backend `name`. What each answers is
    chosen by the model name the gateway forwards (the backend's `served_model`):

    - `silent`: accepts the request and never answers;
    - `trickle`: one event at once, then another every TRICKLE_GAP_S, never ending;
    - `stall`: one event at once, then nothing;
    - anything else: a complete JSON answer with usage.

    `arrivals[name]` counts requests, `hangups[name]` the ones the gateway hung up on.
    """

    def __init__(self) -> None:
        self.arrivals: Counter[str] = Counter()
        self.hangups: Counter[str] = Counter()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await _lifespan(receive, send)
            return
        name = scope["path"].strip("/").split("/")[0]
        if scope["path"].endswith("/health"):
            await _send_all(send, 200, b"ok", b"text/plain")
            return
        if scope["method"] != "POST":  # a listing of nothing, no metrics: probes learn nothing
            await _send_all(send, 200, b"{}", b"application/json")
            return
        body = await _read(receive)
        self.arrivals[name] += 1
        gone = asyncio.Event()
        watch = asyncio.create_task(_wait_gone(receive, gone))
        try:
            await self._answer(orjson.loads(body).get("model"), send, gone)
        finally:
            watch.cancel()
        if gone.is_set():
            self.hangups[name] += 1

    async def _answer(self, model: str, send: Send, gone: asyncio.Event) -> None:
        if model == "silent":
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(gone.wait(), PATIENCE_S)
            return
        if model not in ("trickle", "stall"):
            answer = {
                "object": "chat.completion",
                "model": model,
                "choices": [{"index": 0, "message": {"role": "assistant", "content": "ok"}}],
                "usage": {"prompt_tokens": 5, "completion_tokens": 2, "total_tokens": 7},
            }
            await _send_all(send, 200, orjson.dumps(answer), b"application/json")
            return
        head = [(b"content-type", b"text/event-stream")]
        await send({"type": "http.response.start", "status": 200, "headers": head})
        await send({"type": "http.response.body", "body": EVENT, "more_body": True})
        gap = TRICKLE_GAP_S if model == "trickle" else PATIENCE_S
        for _ in range(int(PATIENCE_S / TRICKLE_GAP_S)):
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(gone.wait(), gap)
            if gone.is_set():
                return
            await send({"type": "http.response.body", "body": EVENT, "more_body": True})


async def _lifespan(receive: Receive, send: Send) -> None:
    while True:
        message = await receive()
        if message["type"] == "lifespan.startup":
            await send({"type": "lifespan.startup.complete"})
        elif message["type"] == "lifespan.shutdown":
            await send({"type": "lifespan.shutdown.complete"})
            return


async def _read(receive: Receive) -> bytes:
    chunks = []
    while True:
        message = await receive()
        chunks.append(message.get("body", b""))
        if not message.get("more_body"):
            return b"".join(chunks)


async def _wait_gone(receive: Receive, gone: asyncio.Event) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass
    gone.set()


async def _send_all(send: Send, status: int, body: bytes, content_type: bytes) -> None:
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", content_type)]})  # fmt: skip
    await send({"type": "http.response.body", "body": body})


@contextlib.contextmanager
def backend_process(*, model: str, speed: float) -> Iterator[tuple[subprocess.Popen[bytes], str]]:
    """A simulated vLLM replica in its own process (`spillgate sim`), to be killed."""
    port = free_port()
    args = [sys.executable, "-m", "gateway.cli", "sim", "--port", str(port), "--model", model,
            "--kv-tokens", "8192", "--speed", str(speed),
            "--answer-lengths", "max_tokens"]  # fmt: skip
    proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        yield proc, f"http://127.0.0.1:{port}"
    finally:
        proc.kill()
        proc.wait(timeout=10)


def wait_for_process(proc: subprocess.Popen[bytes], url: str) -> None:
    assert proc.poll() is None, "the backend process exited"
    wait_for_port(int(url.rsplit(":", 1)[1]), timeout=30)


def sse_events(text: str) -> list[str]:
    return [e.removeprefix("data: ") for e in text.split("\n\n") if e.startswith("data: ")]


@dataclass
class Book:
    """Where one tenant's buckets must stand, from what each of its requests was answered.

    The tenant's buckets refill one request and one token a minute, so within a minute the
    x-ratelimit headers report whole numbers exactly. A request that passed the limiter is
    charged one request and, once settled: its usage when the answer reported it; nothing
    when it ended before any byte reached the client; its whole reservation when the
    answer broke off or the client left mid-answer (what was generated is unknown).
    """

    tenant: str
    requests: int  # the request bucket's size
    tokens: int  # the token bucket's size
    spent_requests: int = 0
    spent_tokens: int = 0
    log: list[str] = field(default_factory=list)

    def reserved(self, headers: httpx.Headers) -> int:
        """What this request reserved, read from its x-ratelimit-remaining-tokens."""
        assert int(headers["x-ratelimit-remaining-requests"]) == self.requests - (
            self.spent_requests + 1
        ), f"{self.tenant}: request bucket off after {self.log}"
        return self.tokens - self.spent_tokens - int(headers["x-ratelimit-remaining-tokens"])

    def used(self, what: str, headers: httpx.Headers, tokens: int) -> None:
        self.reserved(headers)
        self._charge(what, tokens)

    def reservation(self, what: str, headers: httpx.Headers) -> None:
        self._charge(what, self.reserved(headers))

    def nothing(self, what: str, headers: httpx.Headers | None = None) -> None:
        if headers is not None:
            self.reserved(headers)
        self._charge(what, 0)

    def _charge(self, what: str, tokens: int) -> None:
        self.spent_requests += 1
        self.spent_tokens += tokens
        self.log.append(f"{what}:{tokens}")


def usage_total(response_text: str) -> int:
    """total_tokens of a JSON answer, or of the usage event of a streamed one."""
    if response_text.lstrip().startswith("{"):
        usage: dict[str, Any] = orjson.loads(response_text)["usage"]
        return int(usage["total_tokens"])
    for event in reversed(sse_events(response_text)):
        if '"usage"' in event and event != "[DONE]":
            found = orjson.loads(event).get("usage")
            if found:
                return int(found["total_tokens"])
    raise AssertionError("the answer reported no usage")


def async_client(fleet: Fleet, tenant: str) -> httpx.AsyncClient:
    headers = {"authorization": f"Bearer {fleet.keys[tenant]}"}
    return httpx.AsyncClient(base_url=fleet.url, headers=headers, timeout=15.0)


async def wait_for(check: Callable[[], bool], *, within_s: float = 5.0) -> None:
    deadline = time.monotonic() + within_s
    while not await asyncio.to_thread(check):
        assert time.monotonic() < deadline, "condition not met in time"
        await asyncio.sleep(0.02)
