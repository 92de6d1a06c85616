"""A backend behind a compressing proxy (gzip when the client allows it, as nginx or
Starlette's GZipMiddleware do) still gives clients plain JSON: the gateway relays bytes
untouched and so asks upstreams for an uncompressed answer."""

from __future__ import annotations

from collections.abc import Iterator

import openai
import pytest
from starlette.middleware.gzip import GZipMiddleware
from starlette.types import ASGIApp, Receive, Scope, Send

from gateway.app import create_app
from gateway.config import parse_settings
from loadtest.sim.app import create_sim_app
from loadtest.sim.config import SimConfig
from tests.support.fleet import tenant
from tests.support.harness import ServerThread

KEY = "sk-encoding-test-key"


class SeenEncodings:
    """ASGI middleware that notes each completion request's accept-encoding."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app
        self.seen: list[str | None] = []

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"].endswith("/completions"):
            headers = dict(scope["headers"])
            encoding = headers.get(b"accept-encoding")
            self.seen.append(None if encoding is None else encoding.decode())
        await self.app(scope, receive, send)


@pytest.fixture(scope="module")
def gzipping() -> Iterator[tuple[str, SeenEncodings]]:
    sim = create_sim_app(SimConfig(model="m", kv_tokens=65_536, no_delay=True))
    backend = SeenEncodings(GZipMiddleware(sim, minimum_size=0))
    with ServerThread(backend) as upstream:
        settings = parse_settings({
            "tenants": [tenant("acme", KEY)],
            "pools": [{"name": "big", "backends": [{"url": upstream.url, "served_model": "m"}]}],
        })  # fmt: skip
        with ServerThread(create_app(settings, environ={})) as gateway:
            yield gateway.url, backend


def test_answers_from_a_compressing_backend_reach_the_client_as_json(
    gzipping: tuple[str, SeenEncodings],
) -> None:
    url, backend = gzipping
    client = openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0, timeout=10)
    messages: list[openai.types.chat.ChatCompletionMessageParam] = [
        {"role": "user", "content": "hello there"}
    ]
    whole = client.chat.completions.create(model="big", messages=messages, max_tokens=8)
    assert whole.model == "big" and whole.usage is not None and whole.usage.completion_tokens > 0
    stream = client.chat.completions.create(
        model="big", messages=messages, max_tokens=8, stream=True
    )
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert backend.seen == ["identity", "identity"]
