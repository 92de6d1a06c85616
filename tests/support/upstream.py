"""A fake upstream on loopback for unit tests of the request path: a tiny OpenAI-shaped
server (run it under `ServerThread`) that answers chat completions with a fixed answer, as
JSON or as server-sent events, or fails with a chosen status, and keeps what it was sent."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from typing import Any, Protocol, TypeVar

import orjson
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route

from gateway.config import Priority
from gateway.request import Endpoint, InferenceRequest
from gateway.upstream.pool import UpstreamPool
from tests.support.harness import servers

ANSWER = "Hello there"
PROMPT_TOKENS = 5
COMPLETION_TOKENS = 2


async def _no_listing(request: Request) -> Response:
    return Response(b"{}", media_type="application/json")


# a backend's API at its root: the gateway's probe finds `/v1/models` there (a 404 would mean
# a URL past the server's root), though its `{}` lists nothing, so the probe learns nothing
MODELS_ROUTE = Route("/v1/models", _no_listing)


class FakeUpstream:
    """Answers `ANSWER` naming the model it was asked for, with usage of `PROMPT_TOKENS` and
    `COMPLETION_TOKENS` (or whatever `usage` holds at the time); with `status` other than
    200 it answers that status instead."""

    def __init__(self, *, status: int = 200, usage: dict[str, Any] | None = None) -> None:
        self.status = status
        self.usage = usage
        self.bodies: list[dict[str, Any]] = []  # what each request sent, in order
        self.app = Starlette(
            routes=[Route("/v1/chat/completions", self._chat, methods=["POST"]), MODELS_ROUTE]
        )

    async def _chat(self, request: Request) -> Response:
        body = orjson.loads(await request.body())
        self.bodies.append(body)
        if self.status != 200:
            error = {"error": {"message": "failing on purpose", "type": "server_error"}}
            return Response(orjson.dumps(error), status_code=self.status)
        usage = {
            "prompt_tokens": PROMPT_TOKENS,
            "completion_tokens": COMPLETION_TOKENS,
            "total_tokens": PROMPT_TOKENS + COMPLETION_TOKENS,
        }
        if self.usage is not None:
            usage = dict(self.usage)
        head = {"id": "chatcmpl-1", "model": body["model"], "created": 1}
        if not body.get("stream"):
            message = {"role": "assistant", "content": ANSWER}
            choice = {"index": 0, "message": message, "finish_reason": "stop"}
            answer = {**head, "object": "chat.completion", "choices": [choice], "usage": usage}
            return Response(orjson.dumps(answer), media_type="application/json")
        with_usage = (body.get("stream_options") or {}).get("include_usage") is True
        return StreamingResponse(
            _events(head, usage if with_usage else None), 200, None, "text/event-stream"
        )


async def _events(head: dict[str, Any], usage: dict[str, Any] | None) -> AsyncIterator[bytes]:
    chunk = {**head, "object": "chat.completion.chunk"}
    for word in ANSWER.split(" "):
        delta = {"index": 0, "delta": {"content": word}, "finish_reason": None}
        yield b"data: " + orjson.dumps({**chunk, "choices": [delta]}) + b"\n\n"
    end = {"index": 0, "delta": {}, "finish_reason": "stop"}
    yield b"data: " + orjson.dumps({**chunk, "choices": [end]}) + b"\n\n"
    if usage is not None:
        yield b"data: " + orjson.dumps({**chunk, "choices": [], "usage": usage}) + b"\n\n"
    yield b"data: [DONE]\n\n"


def chat_request(
    *,
    pool: str = "big",
    stream: bool = False,
    max_tokens: int = 8,
    priority: Priority = "standard",
    **fields: Any,
) -> InferenceRequest:
    """A parsed chat request of one short message, as the pipeline hands it on."""
    return InferenceRequest(
        endpoint=Endpoint.CHAT,
        tenant="acme",
        pool=pool,
        priority=priority,
        stream=stream,
        client_wants_usage=False,
        prompt_chars=2,
        prompt_tokens=4,
        max_output_tokens=max_tokens,
        body={"model": pool, "messages": [{"role": "user", "content": "hi"}], "stream": stream},
        **fields,
    )


class Client:
    """The ASGI `send` of a client: keeps every message, and reads the response back."""

    def __init__(self) -> None:
        self.messages: list[dict[str, Any]] = []

    async def send(self, message: Any) -> None:
        self.messages.append(message)

    @property
    def status(self) -> int:
        starts = [m for m in self.messages if m["type"] == "http.response.start"]
        assert len(starts) == 1, self.messages
        return int(starts[0]["status"])

    @property
    def headers(self) -> dict[str, str]:
        start = next(m for m in self.messages if m["type"] == "http.response.start")
        return {k.decode(): v.decode() for k, v in start["headers"]}

    @property
    def body(self) -> bytes:
        return b"".join(
            m.get("body", b"") for m in self.messages if m["type"] == "http.response.body"
        )


@contextlib.contextmanager
def serving(**fakes: FakeUpstream) -> Iterator[dict[str, str]]:
    """Each fake upstream on loopback while the block runs: their URLs by name."""
    names = list(fakes)
    with servers(*(fakes[name].app for name in names)) as threads:
        yield {name: thread.url for name, thread in zip(names, threads, strict=True)}


class HasUpstream(Protocol):
    upstream: UpstreamPool


S = TypeVar("S", bound=HasUpstream)


def run(make: Callable[[], S], scenario: Callable[[S], Awaitable[None]]) -> None:
    """`scenario` on what `make` builds, in an event loop of its own; the upstream
    connections are closed after, however it ends."""

    async def main() -> None:
        setup = make()
        try:
            await scenario(setup)
        finally:
            await setup.upstream.aclose()

    asyncio.run(main())
