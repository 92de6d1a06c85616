"""What a client receives through the gateway is what it would receive from the backend
direct, field for field, only the model name swapped back to the pool's.

Two pools of simulated vLLM backends: `tiny` writes compact JSON as vLLM does; `spaced`
writes it as Python's json.dumps does (`"model": "x"`). The gateway always asks a backend
for usage, which moves vLLM's `system_fingerprint` onto the usage chunk; a client that did
not ask for usage still gets it where vLLM would have put it.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import openai
import orjson
import pytest
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from gateway.app import create_app
from gateway.config import parse_settings
from loadtest.sim.app import create_sim_app
from loadtest.sim.config import SimConfig
from tests.support.fleet import ADMIN_TOKEN, Fleet, tenant
from tests.support.harness import ServerThread
from tests.vllm_capture import sse

SERVED = {"tiny": "tiny-served", "spaced": "spaced-served"}
FINGERPRINT = "vllm-0.32.0-sim"
PER_REQUEST = ("id", "created")  # differ between any two requests, direct or not


class SpacedJson:
    """A backend that writes its JSON, whole bodies and SSE events, as json.dumps does."""

    def __init__(self, app: ASGIApp) -> None:
        self._app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not scope["path"].startswith("/v1/"):
            await self._app(scope, receive, send)
            return
        kind = b""

        async def respaced(message: Message) -> None:
            nonlocal kind
            if message["type"] == "http.response.start":
                headers = dict(message["headers"])
                kind = headers.get(b"content-type", b"")
                message = {
                    **message,
                    "headers": [(k, v) for k, v in message["headers"] if k != b"content-length"],
                }
            elif message["type"] == "http.response.body" and message.get("body"):
                message = {**message, "body": _respace(message["body"], sse=b"stream" in kind)}
            await send(message)

        await self._app(scope, receive, respaced)


def _respace(body: bytes, *, sse: bool) -> bytes:
    if not sse:
        return json.dumps(json.loads(body)).encode()
    events = body.split(b"\n\n")
    return b"\n\n".join(
        b"data: " + json.dumps(json.loads(e[6:])).encode() if e.startswith(b"data: {") else e
        for e in events
    )


@pytest.fixture(scope="module")
def fleet() -> Iterator[Fleet]:
    started: list[ServerThread] = []
    try:
        backends = {
            "tiny": ServerThread(create_sim_app(SimConfig(model=SERVED["tiny"], speed=50.0))),
            "spaced": ServerThread(
                SpacedJson(create_sim_app(SimConfig(model=SERVED["spaced"], speed=50.0)))
            ),
        }
        started += [server.start() for server in backends.values()]
        keys = {"acme": "sk-acme-faithful"}
        settings = parse_settings(
            {
                "tenants": [tenant("acme", keys["acme"])],
                "pools": [
                    {
                        "name": pool,
                        "backends": [
                            {"url": server.url, "served_model": SERVED[pool], "capacity": 8192}
                        ],
                    }
                    for pool, server in backends.items()
                ],
            }
        )
        app = create_app(settings, environ={"SPILLGATE_ADMIN_TOKEN": ADMIN_TOKEN})
        gateway = ServerThread(app).start()
        started.append(gateway)
        yield Fleet(
            gateway=gateway,
            backends={pool: [server] for pool, server in backends.items()},
            settings=settings,
            keys=keys,
        )
    finally:
        for server in reversed(started):
            server.stop()


def direct(fleet: Fleet, pool: str) -> openai.OpenAI:
    url = fleet.backends[pool][0].url
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=10)


def through(fleet: Fleet) -> openai.OpenAI:
    return openai.OpenAI(
        base_url=f"{fleet.url}/v1", api_key=fleet.keys["acme"], max_retries=0, timeout=10
    )


def streamed(client: openai.OpenAI, model: str, *, usage: bool) -> list[dict[str, Any]]:
    options: dict[str, Any] = {"stream_options": {"include_usage": True}} if usage else {}
    with client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "Hello!"}],
        max_tokens=4,
        stream=True,
        **options,
    ) as chunks:
        return [chunk.to_dict() for chunk in chunks]


def stable(chunk: dict[str, Any]) -> dict[str, Any]:
    """The chunk's fields, keys in order, with what differs per request blanked."""
    return {key: None if key in PER_REQUEST else value for key, value in chunk.items()}


def capture_keys(section: str) -> list[list[str]]:
    """The keys of each chunk a real vLLM 0.32 sent: role, tokens, finish (and usage)."""
    events = [json.loads(e[6:]) for e in sse(section).split(b"\n\n") if e.startswith(b"data: {")]
    return [sorted(e) for e in events]


@pytest.mark.parametrize("usage", [False, True], ids=["no-usage", "usage"])
@pytest.mark.parametrize("pool", ["tiny", "spaced"])
def test_a_stream_through_the_gateway_is_the_stream_sent_direct(
    fleet: Fleet, pool: str, usage: bool
) -> None:
    theirs = streamed(direct(fleet, pool), SERVED[pool], usage=usage)
    ours = streamed(through(fleet), pool, usage=usage)
    assert [stable(c) for c in ours] == [stable({**c, "model": pool}) for c in theirs]
    # the simulator puts the fingerprint where the real server does: only on the last chunk
    capture = capture_keys("2" if usage else "3")
    assert [sorted(c) for c in theirs] == [capture[0], *capture[-len(theirs) + 1 :]]
    assert [c.get("system_fingerprint") for c in ours] == [None] * (len(ours) - 1) + [FINGERPRINT]


@pytest.mark.parametrize("pool", ["tiny", "spaced"])
def test_a_json_answer_through_the_gateway_is_the_answer_sent_direct(
    fleet: Fleet, pool: str
) -> None:
    def ask(client: openai.OpenAI, model: str) -> tuple[str, dict[str, Any]]:
        raw = client.chat.completions.with_raw_response.create(
            model=model, messages=[{"role": "user", "content": "Hello!"}], max_tokens=4
        )
        return raw.text, raw.parse().to_dict()

    their_text, theirs = ask(direct(fleet, pool), SERVED[pool])
    our_text, ours = ask(through(fleet), pool)
    assert stable(ours) == stable({**theirs, "model": pool})
    assert SERVED[pool] not in our_text
    assert ('"model": "' in their_text) is (pool == "spaced")  # the backend's own spacing


@pytest.mark.parametrize("usage", [False, True], ids=["no-usage", "usage"])
def test_a_spaced_stream_never_shows_the_served_name(fleet: Fleet, usage: bool) -> None:
    options: dict[str, Any] = {"stream_options": {"include_usage": True}} if usage else {}
    raw = through(fleet).chat.completions.with_raw_response.create(
        model="spaced",
        messages=[{"role": "user", "content": "Hello!"}],
        max_tokens=6,
        stream=True,
        **options,
    )
    text = raw.http_response.read().decode()
    events = [e for e in text.split("\n\n") if e.startswith("data: {")]
    assert len(events) == 1 + 6 + usage  # the role, each token, the usage chunk if asked
    assert all(orjson.loads(e[6:])["model"] == "spaced" for e in events)
    assert SERVED["spaced"] not in text
