"""The forwarder against a fake upstream on loopback: what reaches the upstream, what the
client gets, and which failures it reports as safe to try elsewhere."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import orjson
import pytest

from gateway.clock import SystemClock
from gateway.config import Timeouts
from gateway.errors import UpstreamUnavailable
from gateway.upstream.answer import Usage
from gateway.upstream.forward import Forwarder, Leg
from gateway.upstream.pool import UpstreamPool
from gateway.upstream.relay import Relayed
from gateway.upstream.target import Target
from loadtest.procs import free_port
from tests.support.upstream import (
    ANSWER,
    COMPLETION_TOKENS,
    PROMPT_TOKENS,
    Client,
    FakeUpstream,
    chat_request,
    serving,
)

USAGE = Usage(prompt_tokens=PROMPT_TOKENS, completion_tokens=COMPLETION_TOKENS, known=True)


@pytest.fixture(scope="module")
def good() -> Iterator[tuple[FakeUpstream, str]]:
    fake = FakeUpstream()
    with serving(good=fake) as urls:
        yield fake, urls["good"]


@pytest.fixture(scope="module")
def failing() -> Iterator[tuple[FakeUpstream, str]]:
    fake = FakeUpstream(status=503)
    with serving(failing=fake) as urls:
        yield fake, urls["failing"]


class Recorder:
    def __init__(self) -> None:
        self.fed: list[bytes] = []
        self.usage: Usage | None = None

    def feed(self, data: bytes) -> None:
        self.fed.append(data)

    def finish(self, usage: Usage) -> None:
        self.usage = usage


def target(url: str) -> Target:
    return Target(name="b-0", api_base=url + "/v1", model="served-m", timeouts=Timeouts())


def forward(url: str, *, stream: bool, recorder: Recorder | None = None) -> tuple[Relayed, Client]:
    client = Client()

    async def main() -> Relayed:
        pool = UpstreamPool(max_connections=2)
        try:
            leg = Leg(
                target(url),
                chat_request(stream=stream),
                public_model="big",
                send=client.send,
                headers=[(b"x-spillgate-outcome", b"local")],
                recorder=recorder,
            )
            return await Forwarder(pool, clock=SystemClock()).forward(leg)
        finally:
            await pool.aclose()

    return asyncio.run(main()), client


def test_a_whole_answer_is_relayed_under_the_public_model_name(good) -> None:
    fake, url = good
    recorder = Recorder()
    relayed, client = forward(url, stream=False, recorder=recorder)
    assert fake.bodies[-1]["model"] == "served-m"  # the upstream is asked for its own name
    assert client.status == 200
    answer = orjson.loads(client.body)
    assert answer["model"] == "big"
    assert answer["choices"][0]["message"]["content"] == ANSWER
    assert client.headers["x-spillgate-outcome"] == "local"
    assert client.headers["content-type"] == "application/json"
    assert client.headers["content-length"] == str(len(client.body))
    assert relayed.usage == USAGE and relayed.completed
    assert b"".join(recorder.fed) == client.body and recorder.usage == USAGE


def test_a_stream_asks_for_usage_and_hides_it_from_a_client_that_did_not(good) -> None:
    fake, url = good
    relayed, client = forward(url, stream=True)
    assert fake.bodies[-1]["stream_options"] == {"include_usage": True}
    assert client.status == 200
    assert client.headers["content-type"].startswith("text/event-stream")
    events = [e for e in client.body.split(b"\n\n") if e]
    assert events[-1] == b"data: [DONE]"
    chunks = [orjson.loads(e.removeprefix(b"data: ")) for e in events[:-1]]
    assert {c["model"] for c in chunks} == {"big"}
    assert all("usage" not in c for c in chunks)
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])
    assert text == ANSWER.replace(" ", "")
    assert relayed.usage == USAGE and relayed.completed


@pytest.mark.parametrize("stream", [False, True])
def test_a_5xx_is_a_failure_before_the_first_byte(failing, stream: bool) -> None:
    _, url = failing
    with pytest.raises(UpstreamUnavailable) as caught:
        forward(url, stream=stream)
    assert caught.value.status == 503
    assert caught.value.reason == "status 503"


def test_nothing_listening_is_unreachable_and_nothing_is_sent() -> None:
    url = f"http://127.0.0.1:{free_port()}"
    client = Client()

    async def main() -> None:
        pool = UpstreamPool(max_connections=1)
        try:
            leg = Leg(
                target(url), chat_request(stream=True), public_model="big", send=client.send,
                headers=[],
            )  # fmt: skip
            await Forwarder(pool, clock=SystemClock()).forward(leg)
        finally:
            await pool.aclose()

    with pytest.raises(UpstreamUnavailable) as caught:
        asyncio.run(main())
    assert caught.value.unreachable == f"connection refused at {url}"
    assert caught.value.status is None
    assert client.messages == []
