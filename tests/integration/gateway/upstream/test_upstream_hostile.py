"""Upstreams that answer the way they should not, each a real server on loopback, against
the gateway's own HTTP/1.1 client (gateway/upstream/http.py): informational answers, heads
and trailers past the bounds, refusals through the forwarder. Every hostile answer anyone
finds gets a test here; the connections such servers close, reset or never accept are
test_upstream_hostile_connections.py's, the gateway in front of them
test_upstream_hostile_gateway.py's.

The tests run on asyncio's loop and on uvloop's (`run`)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from typing import Any

import orjson
import pytest

from gateway.clock import SystemClock
from gateway.config import Timeouts
from gateway.errors import UpstreamUnavailable
from gateway.upstream.forward import AnswerBounds, Forwarder, Leg
from gateway.upstream.http_head import ProtocolError
from gateway.upstream.pool import UpstreamPool
from gateway.upstream.target import Target
from tests.support.raw_server import (
    CHUNKED,
    OK,
    Handler,
    Post,
    Server,
    answering,
    chat_answer,
    fetched,
    refusal,
    route,
    run,
    serve,
)
from tests.support.upstream import Client, chat_request


def endless(head: bytes) -> Callable[[Server], Handler]:
    """Answers the first request with `head`, then with 64 KiB pieces of `a` for as long
    as the client reads them, up to 100 MB: a header or a trailer that never ends."""

    def handler_for(server: Server) -> Handler:
        async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await server.request(reader)
            writer.write(head)
            piece = b"a" * 65536
            with contextlib.suppress(ConnectionError):
                for _ in range(100 * 16):
                    writer.write(piece)
                    await writer.drain()

        return handler

    return handler_for


# informational answers


def test_informational_answers_before_the_answer_are_skipped() -> None:
    """100 Continue and 103 Early Hints (its own headers with it) come before the answer:
    the answer is the 200 after them, with only its own headers, and the connection
    serves the next request."""
    early = (
        b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 103 Early Hints\r\nlink: </x>; rel=preload\r\n\r\n"
    )

    async def test() -> tuple[list[Any], int]:
        async with serve(answering(early + OK)) as server:
            pool = UpstreamPool(max_connections=8)
            seen = []
            for _ in range(2):
                response = await pool.post(route(server.url), b"{}")
                seen.append((response.status, await response.read(), sorted(response.headers)))
                response.release()
            await pool.aclose()
            return seen, server.connections

    answer = (200, b"{}", [b"content-length", b"content-type"])
    assert run(test) == ([answer, answer], 1)


def test_a_101_switching_protocols_nobody_asked_for_is_a_protocol_error() -> None:
    switch = (
        b"HTTP/1.1 101 Switching Protocols\r\nupgrade: websocket\r\nconnection: upgrade\r\n\r\n"
    )

    async def test() -> str:
        with pytest.raises(ProtocolError) as refused:
            await fetched(answering(switch))
        return str(refused.value)

    assert run(test) == "the upstream switched protocols, which nothing asked for"


# bounds on the head and the trailers


def test_a_header_value_that_never_ends_is_refused_at_the_bound() -> None:
    """A value of up to 100 MB, sent for as long as the client reads: the client stops
    once what it holds of the head passes the 60 KiB bound, and closes the connection."""

    async def test() -> str:
        with pytest.raises(ProtocolError) as refused:
            await fetched(endless(b"HTTP/1.1 200 OK\r\nx-big: "))
        return str(refused.value)

    assert run(test) == "the upstream's response head exceeded 61440 bytes"


def test_too_many_header_fields_or_bytes_are_refused_and_the_bounds_are_settings() -> None:
    """20 MB of small headers passes the 100 fields first; 40 headers of 2000 bytes pass
    the 61440 bytes first. A head of exactly 100 fields and 61440 bytes of names and
    values is read; a pool with tighter bounds refuses a head the default one reads."""

    def head_of(fields: list[tuple[bytes, bytes]]) -> bytes:
        lines = b"".join(b"%s: %s\r\n" % field for field in fields)
        return b"HTTP/1.1 200 OK\r\n" + lines + b"content-length: 2\r\n\r\n{}"

    many = head_of([(b"x-h-%06d" % i, b"v" * 190) for i in range(100_000)])
    wide = head_of([(b"x-w-%02d" % i, b"v" * 2000) for i in range(40)])
    # content-length and its value take 15 of the 61440; 99 names of 4 bytes, 396
    at_bound = [(b"x-%02d" % i, b"v" * 616) for i in range(98)]
    at_bound.append((b"x-98", b"v" * (61440 - 15 - 396 - 98 * 616)))
    one_more = [*at_bound[:-1], (b"x-98", at_bound[-1][1] + b"v")]

    async def refusal(answer: bytes, **bounds: int) -> str:
        with pytest.raises(ProtocolError) as refused:
            await fetched(answering(answer), **bounds)
        return str(refused.value)

    async def test() -> list[Any]:
        return [
            await refusal(many),
            await refusal(wide),
            await fetched(answering(head_of(at_bound))),
            await refusal(head_of(one_more)),
            await fetched(answering(head_of(at_bound[:3]))),
            await refusal(head_of(at_bound[:3]), max_header_bytes=1024),
            await refusal(head_of(at_bound[:3]), max_headers=3),
        ]

    assert run(test) == [
        "the upstream's response head had more than 100 fields",
        "the upstream's response head exceeded 61440 bytes",
        b"{}",
        "the upstream's response head exceeded 61440 bytes",
        b"{}",
        "the upstream's response head exceeded 1024 bytes",
        "the upstream's response head had more than 3 fields",
    ]


def test_trailers_count_against_the_bounds_and_never_overwrite_the_head() -> None:
    """A trailer named as a header of the head leaves the head's value; trailers of 70 KB,
    101 trailers, or one that never ends fail the read."""
    body = b"2\r\nhi\r\n0\r\n"
    named = CHUNKED.replace(b"\r\n\r\n", b"\r\nx-request-id: head\r\n\r\n")
    huge = b"x-t: " + b"v" * 70_000 + b"\r\n"
    many = b"".join(b"x-t-%03d: v\r\n" % i for i in range(101))

    async def test() -> list[Any]:
        kept = []

        def handler_for(server: Server) -> Handler:
            async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
                await server.request(reader)
                writer.write(named + body + b"x-request-id: trailer\r\n\r\n")
                await writer.drain()

            return handler

        async with serve(handler_for) as server:
            pool = UpstreamPool(max_connections=8)
            response = await pool.post(route(server.url), b"{}")
            kept.append(await response.read())
            kept.append(response.headers[b"x-request-id"])
            response.release()
            await pool.aclose()
        for trailers in (huge, many):
            with pytest.raises(ProtocolError) as refused:
                await fetched(answering(CHUNKED + body + trailers + b"\r\n"))
            kept.append(str(refused.value))
        with pytest.raises(ProtocolError) as refused:
            await fetched(endless(CHUNKED + body + b"x-t: "))
        kept.append(str(refused.value))
        return kept

    assert run(test) == [
        b"hi",
        b"head",
        "the upstream's response head exceeded 61440 bytes",
        "the upstream's response head had more than 100 fields",
        "the upstream's response head exceeded 61440 bytes",
    ]


# refusals, through the forwarder


def target(server: Server) -> Target:
    return Target(
        name="b-0",
        api_base=f"http://127.0.0.1:{server.port}/v1",
        model="m",
        timeouts=Timeouts(connect=1, first_token=2, idle=2, total=5),
    )


def answers(*replies: Callable[[Post], bytes]) -> Callable[[Server], Handler]:
    """Each request, on whichever connection, gets the next reply (the last one again
    once they run out)."""

    def handler_for(server: Server) -> Handler:
        async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            async for raw in server.each_request(reader):
                index = len(server.requests) - 1
                post = Post(0, 0, index, orjson.loads(raw.partition(b"\r\n\r\n")[2]))
                writer.write(replies[min(index, len(replies) - 1)](post))
                await writer.drain()

        return handler

    return handler_for


async def forwarded(
    forwarder: Forwarder, server: Server, *, stream: bool
) -> int | UpstreamUnavailable:
    """The client's status, or the failure the forwarder reported before any byte."""
    client = Client()
    try:
        await forwarder.forward(
            Leg(
                target(server),
                chat_request(stream=stream),
                public_model="big",
                send=client.send,
                headers=[],
            )
        )
    except UpstreamUnavailable as exc:
        return exc
    return client.status


def test_a_refusal_is_read_and_its_connection_serves_the_next_request() -> None:
    """A 503 and a 429 with a short JSON body, streamed or not, then an answer: all on one
    connection."""

    async def test() -> tuple[list[int | str], int]:
        replies = [refusal(503), refusal(429)] * 2 + [chat_answer]
        async with serve(answers(*replies)) as server:
            pool = UpstreamPool(max_connections=8)
            forwarder = Forwarder(pool, clock=SystemClock())
            seen = []
            for stream in (True, True, False, False, True):
                outcome = await forwarded(forwarder, server, stream=stream)
                seen.append(outcome if isinstance(outcome, int) else outcome.reason)
            await pool.aclose()
            return seen, server.connections

    assert run(test) == (["status 503", "status 429"] * 2 + [200], 1)


def test_retry_after_is_delta_seconds_and_bounded() -> None:
    """What a provider's 429 says in Retry-After, and the pause the gateway takes from it:
    seconds in digits only, at most an hour; anything else asks for none."""
    said = [b"7", b" 12 ", b"0", b"99999999", b"inf", b"nan", b"1e400", b"-5", b"1.5e3",
            b"Wed, 21 Oct 2037 07:28:00 GMT", b""]  # fmt: skip

    async def test() -> list[float | None]:
        replies = [refusal(429, b"retry-after: " + value) for value in said]
        async with serve(answers(*replies)) as server:
            pool = UpstreamPool(max_connections=8)
            forwarder = Forwarder(pool, clock=SystemClock())
            taken = []
            for _ in said:
                refused = await forwarded(forwarder, server, stream=False)
                assert isinstance(refused, UpstreamUnavailable)
                taken.append(refused.retry_after)
            await pool.aclose()
            return taken

    assert run(test) == [7.0, 12.0, 0.0, 3600.0, None, None, None, None, None, None, None]


def test_a_tokenize_count_is_a_positive_whole_number_within_the_body_bound() -> None:
    """What `/tokenize` says a prompt counts is evidence too: a count that is not a positive
    whole number, and an answer past the body bound, count as no answer."""
    said: list[Any] = [12, -5, 0, 1.5, "lots", [5], True, None]

    def count(value: Any) -> Callable[[Post], bytes]:
        body = orjson.dumps({"count": value, "max_model_len": 4096, "tokens": []})
        head = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n"
        return lambda post: head % len(body) + body

    huge = orjson.dumps({"count": 7, "tokens": [1] * 40_000})
    too_long = b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n" % len(huge) + huge

    async def test() -> list[int | None]:
        async with serve(answers(*map(count, said), lambda post: too_long)) as server:
            pool = UpstreamPool(max_connections=8)
            forwarder = Forwarder(pool, clock=SystemClock(), bounds=AnswerBounds(body_bytes=64_000))
            counted = [
                await forwarder.prompt_tokens(target(server), chat_request())
                for _ in range(len(said) + 1)
            ]
            await pool.aclose()
            return counted

    assert run(test) == [12, None, None, None, None, None, None, None, None]
