"""Nothing a backend says can poison the gateway: the content of its answers (usage, event
framing, sizes, pings, junk successes), as the official client sees it through the
gateway, on asyncio's loop and on uvloop's. Each backend is a real server on loopback that
answers that way (tests/support/raw_server.py)."""

from __future__ import annotations

import asyncio
import gzip
import os
import threading
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import httpx
import openai
import orjson
import pytest

from tests.support.fleet import admin_status
from tests.support.hostile import KEY, OTHER_KEY, client, gateway_before
from tests.support.metrics import metric_sum, settled_sum
from tests.support.raw_server import SSE_HEAD, Backend, Post, chat_answer

MESSAGES: list[openai.types.chat.ChatCompletionMessageParam] = [{"role": "user", "content": "hi"}]


@pytest.fixture(params=["asyncio", "uvloop"])
def loop(request: pytest.FixtureRequest) -> str:
    return str(request.param)


def _chunk(model: str, **fields: Any) -> dict[str, Any]:
    return {
        "id": "chatcmpl-p",
        "object": "chat.completion.chunk",
        "created": 1,
        "model": model,
        **fields,
    }


def json_answer(post: Post, *, usage: Any, content: str = "Hello there") -> bytes:
    body = orjson.dumps({
        "id": "chatcmpl-p", "object": "chat.completion", "created": 1, "model": post.body["model"],
        "choices": [{"index": 0, "message": {"role": "assistant", "content": content},
                     "finish_reason": "stop"}],
        "usage": usage,
    })  # fmt: skip
    head = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n"
    return head % len(body) + body


def sse_events(post: Post, *, tokens: list[str], usage: Any) -> list[dict[str, Any]]:
    model = post.body["model"]
    events = [_chunk(model, choices=[{"index": 0, "delta": {"role": "assistant", "content": ""}}])]
    events += [_chunk(model, choices=[{"index": 0, "delta": {"content": t}}]) for t in tokens]
    events.append(_chunk(model, choices=[{"index": 0, "delta": {}, "finish_reason": "stop"}]))
    events.append(_chunk(model, choices=[], usage=usage))
    return events


def token_event(text: str) -> bytes:
    """One event of a chat stream that carries `text`."""
    delta = {"index": 0, "delta": {"content": text}}
    return b"data: " + orjson.dumps(_chunk("m", choices=[delta])) + b"\n\n"


def frame(piece: bytes) -> bytes:
    """`piece` as one chunk of a chunked body."""
    return b"%x\r\n%s\r\n" % (len(piece), piece)


def chunked(pieces: list[bytes], *, head: bytes | None = None) -> bytes:
    head = head or (
        b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
    )
    return head + b"".join(frame(p) for p in pieces if p) + b"0\r\n\r\n"


def sse_answer(post: Post, *, tokens: list[str], usage: Any) -> bytes:
    events = sse_events(post, tokens=tokens, usage=usage)
    return chunked([b"data: " + orjson.dumps(e) + b"\n\n" for e in events] + [b"data: [DONE]\n\n"])


def chat(url: str, *, stream: bool, key: str = KEY, **extra: Any) -> str:
    ask = client(url, key=key)
    if not stream:
        answer = ask.chat.completions.create(model="big", messages=MESSAGES, **extra)
        return answer.choices[0].message.content or ""
    events = ask.chat.completions.create(model="big", messages=MESSAGES, stream=True, **extra)
    return "".join(e.choices[0].delta.content or "" for e in events if e.choices)


def raw_stream(url: str, **body: Any) -> bytes:
    """A streamed chat's bytes as the client gets them, whatever they are."""
    payload = {"model": "big", "messages": MESSAGES, "stream": True, **body}
    with httpx.stream(
        "POST", f"{url}/v1/chat/completions", json=payload, timeout=30,
        headers={"authorization": f"Bearer {KEY}"},
    ) as response:  # fmt: skip
        return b"".join(response.iter_bytes())


def rss() -> int:
    """This process's resident memory, in bytes (the gateway runs in one of its threads)."""
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def corrections(url: str, reason: str, *, requests: int) -> float:
    """Corrections counted once `requests` requests have been settled."""
    name = "spillgate_usage_corrections_total"
    return settled_sum(url, name, requests=requests, target="big-0", reason=reason)


def errors(url: str, target: str = "big-0") -> float:
    return metric_sum(url, "spillgate_upstream_errors_total", target=target)


def in_flight(url: str) -> int:
    return sum(b["tokens_in_flight"] for p in admin_status(url)["pools"] for b in p["backends"])


# -- usage is evidence, not truth


# what a backend tells as each count of its usage, by the name the request's `user` gives
HUGE = {"1e18": 10**18, "1e300": 1e300}
NO_COUNTS = {"negative": -5, "text": "lots", "list": [5], "object": {"n": 1}, "null": None}
HONEST = {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}


def telling(post: Post) -> bytes:
    """An answer whose usage says what the request's `user` names: a huge output, no count
    at all in any field, or (`honest`) the truth."""
    name = post.body["user"]
    if name == "honest":
        usage = HONEST
    elif name in HUGE:
        usage = {"prompt_tokens": 3, "completion_tokens": HUGE[name], "total_tokens": HUGE[name]}
    else:
        told = NO_COUNTS[name]
        usage = {"prompt_tokens": told, "completion_tokens": told, "total_tokens": told}
    if post.body.get("stream"):
        return sse_answer(post, tokens=["Hello", " there"], usage=usage)
    return json_answer(post, usage=usage)


def test_a_huge_usage_leaves_the_tenant_admitted(loop: str) -> None:
    """The backend says it generated 10**18 (or 1e300) tokens for an 8-token request: the
    tenant's next requests are admitted (the count is bounded by max_tokens), and each
    correction is counted against the backend; streamed and not. (Each lie is followed by
    an honest answer: a backend that lies three times in a row leaves rotation, below.)"""
    with (
        Backend(telling) as backend,
        gateway_before(backend, loop=loop, limits={"tokens_per_minute": 100_000}) as url,
    ):
        asked = 0
        for told in HUGE:
            for stream in (False, True):
                before = corrections(url, "completion_too_large", requests=asked)
                texts = []
                for _ in range(3):
                    texts.append(chat(url, stream=stream, max_tokens=8, user=told))
                    texts.append(chat(url, stream=stream, max_tokens=8, user="honest"))
                asked += 6
                corrected = corrections(url, "completion_too_large", requests=asked) - before
                completion = settled_sum(
                    url, "spillgate_tokens_total", requests=asked, kind="completion"
                )
                assert (told, stream, texts) == (told, stream, ["Hello there"] * 6)
                assert (told, stream, corrected) == (told, stream, 3)
        assert completion == len(HUGE) * 2 * 3 * (8 + 2)


def test_a_usage_that_is_no_count_is_answered_and_metrics_stay_readable(loop: str) -> None:
    """Negative or non-numeric counts: each answer reaches the client whole (a stream ends
    with [DONE]), /metrics still answers, and nothing is left reserved."""
    with Backend(telling) as backend, gateway_before(backend, loop=loop) as url:
        for told in NO_COUNTS:
            raw = raw_stream(url, user=told)
            assert raw.rstrip().endswith(b"data: [DONE]") and b"Hello" in raw, told
            assert chat(url, stream=False, user=told) == "Hello there", told
            # a lie counts against the backend: an honest answer keeps it under three in a row
            assert chat(url, stream=False, user="honest") == "Hello there", told
            scraped = httpx.get(f"{url}/metrics", timeout=10)
            assert (told, scraped.status_code, in_flight(url)) == (told, 200, 0)


@pytest.mark.parametrize(
    "usage", [{}, {"prompt_tokens": 0, "completion_tokens": 0}], ids=["empty", "zeros"]
)
def test_a_usage_of_nothing_is_no_refund(loop: str, usage: dict[str, Any]) -> None:
    """A backend that says its answers cost nothing: the tenant is charged its reservation,
    so a tokens_per_minute of 2,000 admits about four requests of max_tokens 500, not all."""

    def answer(post: Post) -> bytes:
        return json_answer(post, usage=usage)

    with (
        Backend(answer) as backend,
        gateway_before(backend, loop=loop, limits={"tokens_per_minute": 2_000}) as url,
    ):
        statuses = []
        for _ in range(12):
            try:
                chat(url, stream=False, max_tokens=500)
                statuses.append(200)
            except openai.RateLimitError:
                statuses.append(429)
    assert statuses.count(200) <= 4
    assert statuses.count(429) >= 8


def test_a_stream_told_to_cost_nothing_is_charged_its_events(loop: str) -> None:
    """300 tokens streamed, usage says 0: the gateway counts the events it relayed."""

    def answer(post: Post) -> bytes:
        usage = {"prompt_tokens": 3, "completion_tokens": 0, "total_tokens": 3}
        return sse_answer(post, tokens=["x"] * 300, usage=usage)

    with Backend(answer) as backend, gateway_before(backend, loop=loop) as url:
        assert chat(url, stream=True) == "x" * 300
        completion = settled_sum(
            url, "spillgate_tokens_total", requests=1, target="big-0", kind="completion"
        )
        corrected = corrections(url, "completion_zero", requests=1)
    assert completion >= 300 - 14
    assert corrected == 1


def test_a_backend_that_keeps_lying_about_usage_leaves_rotation(loop: str) -> None:
    """A backend whose every answer says 10**18 tokens, streamed and not: each answer
    reaches the client, but each is a failure of the backend, as a junk answer is; three
    in a row eject it, and the next request finds no backend in rotation."""
    with Backend(telling) as backend, gateway_before(backend, loop=loop) as url:
        texts = [chat(url, stream=i % 2 == 1, max_tokens=8, user="1e18") for i in range(3)]
        failed = settled_sum(url, "spillgate_upstream_errors_total", requests=3, target="big-0")
        (status,) = [b for p in admin_status(url)["pools"] for b in p["backends"]]
        with pytest.raises(openai.APIStatusError) as refused:
            chat(url, stream=False, max_tokens=8, user="1e18")
    assert texts == ["Hello there"] * 3
    assert failed == 3
    assert status["health"] == "ejected"
    assert "completion_too_large" in str(status)
    assert refused.value.status_code == 503
    assert len(backend.posts) == 3


@pytest.mark.parametrize(
    "usage",
    [None, {}, {"prompt_tokens": 0, "completion_tokens": 0}],
    ids=["none", "empty", "zeros"],
)
def test_a_backend_that_leaves_usage_out_stays_in_rotation(loop: str, usage: Any) -> None:
    """No usage, or one of nothing (vLLM leaves a stream's usage out unless asked; other
    servers tell zeros where they do not count): corrected, never held against the backend."""

    def answer(post: Post) -> bytes:
        if post.body.get("stream"):
            return sse_answer(post, tokens=["Hello", " there"], usage=usage)
        return json_answer(post, usage=usage)

    with Backend(answer) as backend, gateway_before(backend, loop=loop) as url:
        texts = [chat(url, stream=i % 2 == 1, max_tokens=8) for i in range(6)]
        failed = settled_sum(url, "spillgate_upstream_errors_total", requests=6, target="big-0")
        (status,) = [b for p in admin_status(url)["pools"] for b in p["backends"]]
    assert texts == ["Hello there"] * 6
    assert failed == 0
    assert status["health"] == "up"


def test_an_unnamed_limit_is_bounded_by_the_context_the_backend_reports(loop: str) -> None:
    """No max_tokens named, and a backend whose /v1/models says its model holds 4,096
    tokens: a usage of 60,000 output tokens cannot be true, and is charged 4,096 (before,
    anything up to a 128k context was believed)."""
    listing = orjson.dumps({"object": "list", "data": [{"id": "m", "max_model_len": 4096}]})

    def answer(post: Post) -> bytes:
        usage = {"prompt_tokens": 3, "completion_tokens": 60_000, "total_tokens": 60_003}
        return json_answer(post, usage=usage)

    with (
        Backend(answer, listing=listing) as backend,
        gateway_before(backend, loop=loop) as url,
    ):
        deadline = time.monotonic() + 10
        while [b["max_model_len"] for p in admin_status(url)["pools"] for b in p["backends"]] != [
            4096
        ]:
            assert time.monotonic() < deadline, "the backend's listing was never read"
            time.sleep(0.05)
        assert chat(url, stream=False) == "Hello there"
        completion = settled_sum(
            url, "spillgate_tokens_total", requests=1, target="big-0", kind="completion"
        )
        corrected = corrections(url, "completion_too_large", requests=1)
    assert (completion, corrected) == (4096, 1)


# -- every SSE dialect


def _dialect(kind: str) -> Callable[[bytes], bytes]:
    """How one event (its data line and blank line, LF-ended) goes out in `kind`."""
    return {
        "crlf": lambda e: e.replace(b"\n", b"\r\n"),
        "cr": lambda e: e.replace(b"\n", b"\r"),
        "no-space": lambda e: e.replace(b"data: ", b"data:"),
        "id-first": lambda e: b"id: 7\nevent: message\n" + e,
        "comments": lambda e: b": ping\n\n" + e,
    }[kind]


@pytest.mark.parametrize("kind", ["crlf", "cr", "no-space", "id-first", "comments"])
def test_every_sse_dialect_streams_as_it_comes_and_its_usage_is_read(loop: str, kind: str) -> None:
    """The backend holds the rest of its stream until the client has the first token: a
    gateway that waited for the end would never deliver it. Its usage (7) is what is
    counted, and the usage chunk does not reach a client that did not ask for it."""
    first_seen = threading.Event()
    in_time: list[bool] = []
    shape = _dialect(kind)
    usage = {"prompt_tokens": 3, "completion_tokens": 7, "total_tokens": 10}

    async def answer(post: Post) -> AsyncIterator[bytes]:
        events = sse_events(post, tokens=["Hello", " there"], usage=usage)
        lines = [shape(b"data: " + orjson.dumps(e) + b"\n\n") for e in events]
        lines.append(shape(b"data: [DONE]\n\n"))
        yield SSE_HEAD
        for i, line in enumerate(lines):
            if i == 2:  # the client has the first token before the rest is sent
                in_time.append(await asyncio.to_thread(first_seen.wait, 10))
            yield frame(line)
        yield b"0\r\n\r\n"

    with Backend(answer) as backend, gateway_before(backend, loop=loop) as url:
        ask = client(url)
        events = ask.chat.completions.create(model="big", messages=MESSAGES, stream=True)
        text, usages = [], []
        for event in events:
            if event.choices and event.choices[0].delta.content:
                text.append(event.choices[0].delta.content)
                first_seen.set()
            if event.usage is not None:
                usages.append(event.usage)
        completion = settled_sum(
            url, "spillgate_tokens_total", requests=1, target="big-0", kind="completion"
        )
    assert in_time == [True]
    assert "".join(text) == "Hello there"
    assert usages == []
    assert completion == 7


def test_an_event_that_never_ends_is_cut_at_the_bound(loop: str) -> None:
    """48 MB with no blank line: the client gets an error event naming the bound, the
    gateway holds no more than about the bound, and the backend's failure is counted."""
    rise: list[int] = []

    async def answer(post: Post) -> AsyncIterator[bytes]:
        yield SSE_HEAD
        yield frame(token_event("a"))
        before = rss()
        piece = b"data: " + b"x" * (1 << 20)
        try:
            for _ in range(48):
                yield frame(piece)
        finally:
            rise.append(rss() - before)

    with Backend(answer) as backend, gateway_before(
        backend, loop=loop, server={"upstream_max_event_bytes": 4 << 20},
        pool={"continue_streams": 0},
    ) as url:  # fmt: skip
        raw = raw_stream(url)
        failed = errors(url)
        (health,) = [b["health"] for p in admin_status(url)["pools"] for b in p["backends"]]
    assert b"longer than 4194304 bytes" in raw
    assert raw.rstrip().endswith(b"data: [DONE]")
    assert failed == 1
    assert health == "draining"  # out until a probe finds it serving again
    assert rise and rise[0] < 32 << 20


def test_a_resumable_stream_past_its_kept_bound_is_relayed_whole_and_not_kept(loop: str) -> None:
    """A backend that ignores max_tokens and streams 16 MB: the client gets all of it, the
    gateway keeps no more of it than the bound, and says it stopped keeping it."""
    rise: list[int] = []
    piece = "y" * 4096

    async def answer(post: Post) -> AsyncIterator[bytes]:
        yield SSE_HEAD
        before = rss()
        for _ in range(4096):
            yield frame(token_event(piece))
        rise.append(rss() - before)
        yield frame(b"data: [DONE]\n\n") + b"0\r\n\r\n"

    with (
        Backend(answer) as backend,
        gateway_before(backend, loop=loop, server={"upstream_max_kept_bytes": 256 * 1024}) as url,
    ):
        got = 0
        with httpx.stream(
            "POST", f"{url}/v1/chat/completions", timeout=60,
            json={"model": "big", "messages": MESSAGES, "stream": True},
            headers={"authorization": f"Bearer {KEY}"},
        ) as response:  # fmt: skip
            for data in response.iter_bytes():
                got += data.count(b"y")  # no other y in the events
        dropped = settled_sum(url, "spillgate_streams_not_kept_total", requests=1, target="big-0")
    assert got == 4096 * len(piece)
    assert dropped == 1
    assert rise and rise[0] < 8 << 20


# -- every body read has a bound


def test_a_body_past_its_bound_is_a_502_naming_it(loop: str) -> None:
    """A 128 MB answer to a request not streamed: a 502 that names the bound, and the
    gateway read no more than the bound of it."""
    rise: list[int] = []
    with (
        Backend(huge_body(b"200 OK", rise)) as backend,
        gateway_before(backend, loop=loop, server={"upstream_max_body_bytes": 8 << 20}) as url,
        pytest.raises(openai.APIStatusError) as refused,
    ):
        chat(url, stream=False)
    assert refused.value.status_code == 502
    assert "BodyTooLarge: a body past 8388608 bytes" in refused.value.message
    assert rise and rise[0] < 32 << 20


def test_a_refusal_body_of_128_mb_to_a_stream_is_a_502_naming_its_bound(loop: str) -> None:
    """A 400 to a stream request whose body runs to 128 MB: the gateway reads 64 KiB of it,
    closes the connection, and answers 502 naming the bound; its memory barely moves."""
    rise: list[int] = []
    with (
        Backend(huge_body(b"400 Bad Request", rise)) as backend,
        gateway_before(backend, loop=loop) as url,
        pytest.raises(openai.APIStatusError) as refused,
    ):
        chat(url, stream=True)
    assert refused.value.status_code == 502
    assert "a body past 65536 bytes" in refused.value.message
    assert rise and rise[0] < 32 << 20


# -- idle means no progress


def test_a_backend_that_only_pings_is_idle(loop: str) -> None:
    """A hung engine that sends `: ping` every 0.1 s after its first token: the stream
    ends at the idle timeout (1 s), not the total (60 s), and its reservation is freed."""

    async def answer(post: Post) -> AsyncIterator[bytes]:
        yield SSE_HEAD
        yield frame(token_event("a"))
        for _ in range(600):
            await asyncio.sleep(0.1)
            yield b"8\r\n: ping\n\n\r\n"

    timeouts = {"idle": 1.0, "total": 60.0}
    with (
        Backend(answer) as backend,
        gateway_before(
            backend, loop=loop, pool={"timeouts": timeouts, "continue_streams": 0}
        ) as url,
    ):
        began = time.monotonic()
        raw = raw_stream(url)
        took = time.monotonic() - began
        left = in_flight(url)
    assert b"stopped responding" in raw
    assert took < 30
    assert left == 0


def test_a_stalled_refusal_body_is_read_under_the_idle_timer(loop: str) -> None:
    """A 400 to a stream whose body stops after 10 of its 100 bytes: the client is
    answered at the idle timeout (1 s), not the total (60 s)."""

    async def answer(post: Post) -> AsyncIterator[bytes]:
        yield b"HTTP/1.1 400 Bad\r\ncontent-type: application/json\r\ncontent-length: 100\r\n\r\n"
        yield b'{"error":{'
        await asyncio.sleep(60)

    timeouts = {"idle": 1.0, "total": 60.0}
    with (
        Backend(answer) as backend,
        gateway_before(backend, loop=loop, pool={"timeouts": timeouts}) as url,
    ):
        began = time.monotonic()
        with pytest.raises(openai.APIStatusError) as refused:
            chat(url, stream=True)
        took = time.monotonic() - began
    assert refused.value.status_code in (502, 504)
    assert took < 30


# -- a junk 200 is a failure


def _html(post: Post) -> bytes:
    body = b"<html><body>Welcome to nginx!</body></html>"
    return (
        b"HTTP/1.1 200 OK\r\ncontent-type: text/html\r\ncontent-length: %d\r\n\r\n" % len(body)
        + body
    )


def _gzipped(post: Post) -> bytes:
    answer = chat_answer(post)
    head, _, body = answer.partition(b"\r\n\r\n")
    if post.body.get("stream"):
        return head + b"\r\ncontent-encoding: gzip\r\n\r\n" + body
    packed = gzip.compress(body)
    head = head.replace(b"content-length: %d" % len(body), b"content-length: %d" % len(packed))
    return head + b"\r\ncontent-encoding: gzip\r\n\r\n" + packed


def _gzip_chunked(post: Post) -> bytes:
    packed = gzip.compress(b'{"choices":[]}')
    return (
        b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
        b"transfer-encoding: gzip, chunked\r\n\r\n"
        + b"%x\r\n%s\r\n0\r\n\r\n"
        % (len(packed), packed)
    )


def _not_an_answer(body: bytes) -> Callable[[Post], bytes]:
    head = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n"
    return lambda post: head % len(body) + body


def _status(code: bytes) -> Callable[[Post], bytes]:
    """A status outside 100-599, with a body, then (where a client might read on) a true
    answer."""
    return lambda post: (
        b"HTTP/1.1 %s Odd\r\ncontent-length: 5\r\n\r\nJUNK!" % code + chat_answer(post)
    )


JUNK = {
    "html": _html,
    "gzip": _gzipped,
    "gzip-chunked": _gzip_chunked,
    "result-ok": _not_an_answer(b'{"result":"ok"}'),
    "list": _not_an_answer(b"[1,2,3]"),
    "status-099": _status(b"099"),
    "status-042": _status(b"042"),
    "status-600": _status(b"600"),
    "status-999": _status(b"999"),
}


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
@pytest.mark.parametrize("kind", list(JUNK))
def test_a_junk_success_is_the_backends_failure(loop: str, kind: str, stream: bool) -> None:
    """The first backend answers junk with a 200; the request goes to the second, the
    client gets its answer, and the junk is counted against the first."""
    with (
        Backend(JUNK[kind]) as junk,
        Backend(chat_answer) as good,
        gateway_before(junk, good, loop=loop) as url,
    ):
        texts = [chat(url, stream=stream, key=key) for key in (KEY, OTHER_KEY, KEY, OTHER_KEY)]
        failed = errors(url, "big-0")
    assert texts == ["Hello there"] * 4
    assert failed >= 1
    assert len(junk.posts) == failed


def huge_body(status: bytes, rise: list[int]) -> Callable[[Post], AsyncIterator[bytes]]:
    """An answer of `status` with a 128 MB JSON body, sent a megabyte at a time; how much
    the gateway's memory rose while it was sent goes into `rise`."""

    async def answer(post: Post) -> AsyncIterator[bytes]:
        yield b"HTTP/1.1 %s\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n" % (
            status,
            128 << 20,
        )
        before = rss()
        piece = b" " * (1 << 20)
        try:
            for _ in range(128):
                yield piece
        finally:
            rise.append(rss() - before)

    return answer
