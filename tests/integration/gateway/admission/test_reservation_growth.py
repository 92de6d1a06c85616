"""A stream's reservation grows with its answer and is released, grown, on every ending.

The backend is scripted: it streams TOKENS events, then waits for the test's word, then
finishes or crashes, so the grown reservation is seen, exactly, while the stream is held.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import AsyncIterator, Iterator

import httpx
import orjson
import pytest
from starlette.types import Receive, Scope, Send

from loadtest.procs import RedisProcess
from tests.support.fleet import Fleet, run_fleet
from tests.support.harness import ServerThread

TOKENS = 100  # events the backend streams before it waits
PRIOR = 16  # the expected output before any answer was seen
# "story NN": 8 characters + 16 for the chat template = 24, at 4 per token: the gateway
# estimates 7 prompt tokens (admitted: 7 + 16 in blocks of 16, 32 tokens); the backend
# reports 6, which keeps the estimate at 4 characters a token
USAGE_PROMPT_TOKENS = 6
GROWN = 112  # 7 + 100 tokens in blocks of 16


class Scripted:
    """A backend whose streams wait for `go[content]` after TOKENS events."""

    def __init__(self) -> None:
        self.go: dict[str, threading.Event] = {}

    def gate(self, content: str) -> threading.Event:
        return self.go.setdefault(content, threading.Event())

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return
        if scope["method"] != "POST":  # a listing of nothing, no metrics: unknown, not down
            await send({"type": "http.response.start", "status": 200, "headers": []})
            await send({"type": "http.response.body", "body": b"{}"})
            return
        body = orjson.loads((await receive())["body"])
        content = body["messages"][0]["content"]
        head = [(b"content-type", b"text/event-stream")]
        await send({"type": "http.response.start", "status": 200, "headers": head})
        for _ in range(TOKENS):
            chunk = {"model": body["model"], "choices": [{"index": 0, "delta": {"content": "a"}}]}
            event = b"data: " + orjson.dumps(chunk) + b"\n\n"
            await send({"type": "http.response.body", "body": event, "more_body": True})
        await asyncio.to_thread(self.gate(content).wait, 20)
        if body["model"] == "crash":
            raise RuntimeError("backend crashed")
        usage = {"prompt_tokens": USAGE_PROMPT_TOKENS, "completion_tokens": TOKENS}
        finish = {"model": body["model"], "choices": [{"index": 0, "finish_reason": "stop"}]}
        tail = {"model": body["model"], "choices": [], "usage": usage}
        end = b"".join(b"data: " + orjson.dumps(e) + b"\n\n" for e in (finish, tail))
        await send({"type": "http.response.body", "body": end + b"data: [DONE]\n\n"})


@pytest.fixture(scope="module", params=["local", "shared"])
def scripted(request: pytest.FixtureRequest) -> Iterator[tuple[Fleet, Scripted]]:
    """The gateway with its own ledger, and with the shared one in Redis."""
    app = Scripted()
    redis = RedisProcess().start() if request.param == "shared" else None
    server = ServerThread(app).start()
    reservation = {"prior_tokens": PRIOR}

    def backend(model: str) -> dict[str, object]:
        return {"url": server.url, "served_model": model, "capacity": 4096}

    pools = {
        "ok": {"backends": [backend("ok")], "reservation": reservation},
        "crash": {"backends": [backend("crash")], "reservation": reservation},
    }
    try:
        url = None if redis is None else redis.url
        with run_fleet(pools={"ok": [], "crash": []}, pool_options=pools, redis_url=url) as fleet:
            yield fleet, app
    finally:
        server.stop()
        if redis is not None:
            redis.stop()


def in_flight(fleet: Fleet, pool: str) -> int:
    status = fleet.status()
    (found,) = (p for p in status["pools"] if p["name"] == pool)
    return int(found["backends"][0]["tokens_in_flight"])


class Stream:
    """An open stream whose first TOKENS events have reached the client."""

    def __init__(self, chunks: AsyncIterator[bytes]) -> None:
        self._chunks = chunks

    async def rest(self) -> bytes:
        return b"".join([chunk async for chunk in self._chunks])


@contextlib.asynccontextmanager
async def streaming(fleet: Fleet, pool: str, content: str) -> AsyncIterator[Stream]:
    headers = {"authorization": f"Bearer {fleet.keys['acme']}"}
    body = {"model": pool, "messages": [{"role": "user", "content": content}], "stream": True}
    async with (
        httpx.AsyncClient(base_url=fleet.url, headers=headers, timeout=20) as client,
        client.stream("POST", "/v1/chat/completions", json=body) as response,
    ):
        assert response.status_code == 200
        chunks = response.aiter_raw()
        seen = b""
        while seen.count(b"data:") < TOKENS:
            seen += await anext(chunks)
        yield Stream(chunks)


async def until_released(fleet: Fleet, pool: str) -> int:
    """Tokens in flight in `pool` once they reach 0, or after 5 s."""
    held = await asyncio.to_thread(in_flight, fleet, pool)
    for _ in range(250):
        if not held:
            break
        await asyncio.sleep(0.02)
        held = await asyncio.to_thread(in_flight, fleet, pool)
    return held


def test_a_completed_stream_grew_block_by_block_and_gives_it_all_back(
    scripted: tuple[Fleet, Scripted],
) -> None:
    fleet, app = scripted

    async def scenario() -> tuple[int, int, bytes]:
        async with streaming(fleet, "ok", "story 01") as stream:
            grown = await asyncio.to_thread(in_flight, fleet, "ok")
            app.gate("story 01").set()
            rest = await stream.rest()
        return grown, await until_released(fleet, "ok"), rest

    grown, after, rest = asyncio.run(scenario())
    assert grown == GROWN
    assert rest.endswith(b"data: [DONE]\n\n")
    assert after == 0


def test_a_stream_the_backend_breaks_gives_back_what_it_grew_to(
    scripted: tuple[Fleet, Scripted],
) -> None:
    fleet, app = scripted

    async def scenario() -> tuple[int, int, bytes]:
        async with streaming(fleet, "crash", "story 02") as stream:
            grown = await asyncio.to_thread(in_flight, fleet, "crash")
            app.gate("story 02").set()
            rest = await stream.rest()
        return grown, await until_released(fleet, "crash"), rest

    grown, after, rest = asyncio.run(scenario())
    assert grown == GROWN
    assert b'"error"' in rest
    assert after == 0


def test_a_client_that_hangs_up_mid_stream_gives_back_what_it_grew_to(
    scripted: tuple[Fleet, Scripted],
) -> None:
    fleet, app = scripted

    async def scenario() -> tuple[int, int]:
        async with streaming(fleet, "ok", "story 03"):
            grown = await asyncio.to_thread(in_flight, fleet, "ok")
        return grown, await until_released(fleet, "ok")  # the backend still waits

    try:
        assert asyncio.run(scenario()) == (GROWN, 0)
    finally:
        app.gate("story 03").set()


def test_a_cancelled_request_gives_back_what_it_grew_to(
    scripted: tuple[Fleet, Scripted],
) -> None:
    fleet, app = scripted
    grown: list[int] = []

    async def reader(measured: asyncio.Event) -> None:
        async with streaming(fleet, "ok", "story 04"):
            grown.append(await asyncio.to_thread(in_flight, fleet, "ok"))
            measured.set()
            await asyncio.sleep(30)  # cancelled here, mid-stream

    async def scenario() -> int:
        measured = asyncio.Event()
        task = asyncio.create_task(reader(measured))
        await measured.wait()
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        return await until_released(fleet, "ok")

    try:
        assert asyncio.run(scenario()) == 0
    finally:
        app.gate("story 04").set()
    assert grown == [GROWN]


def test_admission_sees_the_grown_reservation(scripted: tuple[Fleet, Scripted]) -> None:
    fleet, app = scripted

    async def scenario() -> tuple[int, int]:
        async with streaming(fleet, "ok", "story 05") as stream:
            status = await asyncio.to_thread(fleet.status)
            (pool,) = (p for p in status["pools"] if p["name"] == "ok")
            backend = pool["backends"][0]
            app.gate("story 05").set()
            await stream.rest()
        return backend["reserved_tokens"], backend["limit_tokens"]

    reserved, limit = asyncio.run(scenario())
    assert (reserved, limit) == (GROWN, int(4096 * 0.9))
