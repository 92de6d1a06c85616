"""The gateway in front of a backend that answers the way it should not (a real server on
loopback, tests/support/raw_server.py's `Backend`), as the official client sees it: the
gateway runs on asyncio's loop and on uvloop's (the `loop` fixture)."""

from __future__ import annotations

import contextlib

import httpx
import openai
import pytest

from tests.support import hostile
from tests.support.fleet import admin_status
from tests.support.metrics import text_sum
from tests.support.raw_server import Backend, Post, chat_answer, refusal


@pytest.fixture(params=["asyncio", "uvloop"])
def loop(request: pytest.FixtureRequest) -> str:
    return str(request.param)


def gateway_before(backend: Backend, loop: str) -> contextlib.AbstractContextManager[str]:
    return hostile.gateway_before(backend, loop=loop)


def chat(url: str, *, stream: bool) -> str:
    """A chat completion through the official client: the answer's text."""
    client = hostile.client(url)
    messages: list[openai.types.chat.ChatCompletionMessageParam] = [
        {"role": "user", "content": "hi"}
    ]
    if not stream:
        answer = client.chat.completions.create(model="big", messages=messages, max_tokens=8)
        assert answer.model == "big"
        return answer.choices[0].message.content or ""
    events = client.chat.completions.create(
        model="big", messages=messages, max_tokens=8, stream=True
    )
    return "".join(e.choices[0].delta.content or "" for e in events if e.choices)


def backend_health(url: str) -> tuple[list[tuple[str, str | None]], float]:
    """The backend's state in /admin/status, and the upstream errors counted against it."""
    states = [
        (b["state"], b["down_reason"])
        for pool in admin_status(url)["pools"]
        for b in pool["backends"]
    ]
    metrics = httpx.get(f"{url}/metrics", timeout=10).text
    return states, text_sum(metrics, "spillgate_upstream_errors_total", target="big-0")


def test_gateway_answers_with_the_answer_that_follows_informational_ones(loop: str) -> None:
    early = b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 103 Early Hints\r\nlink: </x>\r\n\r\n"
    backend = Backend(lambda post: chat_answer(post, before=early))
    with backend, gateway_before(backend, loop) as url:
        texts = [chat(url, stream=False), chat(url, stream=True)]
        health = backend_health(url)
    assert texts == ["Hello there", "Hello there"]
    assert health == ([("up", None)], 0.0)
    assert backend.post_connections == 1


def test_gateway_a_streamed_refusal_leaves_the_backend_connection_for_the_next(
    loop: str,
) -> None:
    """The backend refuses a stream with a 503 and a JSON body: the client is refused,
    and the next stream goes on the same backend connection."""

    def answer(post: Post) -> bytes:
        return refusal(503)(post) if post.index == 0 else chat_answer(post)

    with Backend(answer) as backend, gateway_before(backend, loop) as url:
        with pytest.raises(openai.APIStatusError):
            chat(url, stream=True)
        text = chat(url, stream=True)
    assert text == "Hello there"
    assert [post.on_connection for post in backend.posts] == [0, 1]
    assert backend.post_connections == 1


def test_gateway_a_kept_alive_connection_closed_by_the_backend_costs_nothing(loop: str) -> None:
    """The backend closes its kept-alive connection as each second request on it arrives
    (its idle timer, a restart): every client request is answered, and the backend is
    neither ejected nor charged an upstream error."""

    def answer(post: Post) -> bytes | None:
        return None if post.on_connection == 1 else chat_answer(post)

    with Backend(answer) as backend, gateway_before(backend, loop) as url:
        texts = [chat(url, stream=stream) for stream in (False, False, True, True)]
        health = backend_health(url)
    assert texts == ["Hello there"] * 4
    assert health == ([("up", None)], 0.0)
    assert backend.post_connections == 4


def test_gateway_an_answer_past_the_head_bounds_is_a_502_that_says_why(loop: str) -> None:
    """A backend whose answer's head holds 200 header fields: the client is told, in the
    502's message, which bound the upstream broke."""
    fields = b"".join(b"x-filler-%d: y\r\n" % i for i in range(200))

    def answer(post: Post) -> bytes:
        return b"HTTP/1.1 200 OK\r\n" + fields + b"content-length: 2\r\n\r\n{}"

    with (
        Backend(answer) as backend,
        gateway_before(backend, loop) as url,
        pytest.raises(openai.APIStatusError) as refused,
    ):
        chat(url, stream=False)
    assert refused.value.status_code == 502
    assert "the upstream's response head had more than 100 fields" in refused.value.message
