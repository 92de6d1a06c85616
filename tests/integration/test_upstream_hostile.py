"""Upstreams that answer the way they should not, each a real server on loopback, against
the gateway's own HTTP/1.1 client (gateway/upstream/http.py) and, where a client would
see it, the gateway in front of it. Every hostile answer anyone finds gets a test here.

The client-level tests run on asyncio's loop and on uvloop's (`run`); the gateway-level
ones run the gateway on each of the two loops (the `loop` fixture)."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import time
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import openai
import orjson
import pytest
import uvloop

from gateway.app import create_app
from gateway.clock import SystemClock
from gateway.config import Timeouts, parse_settings
from gateway.errors import UpstreamUnavailable
from gateway.upstream.forward import Forwarder
from gateway.upstream.http_head import ConnectFailed, ConnectionClosed, ProtocolError, Route
from gateway.upstream.pool import UpstreamPool
from gateway.upstream.target import Target
from tests.support.fleet import ADMIN_TOKEN, admin_status, tenant
from tests.support.harness import ServerThread
from tests.support.metrics import text_sum
from tests.support.raw_server import (
    OK,
    Backend,
    Handler,
    Post,
    Server,
    answering,
    chat_answer,
    fetched,
    reset,
    route,
    run,
    serve,
)
from tests.support.upstream import Client, chat_request

CHUNKED = b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n"


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


# connections the server closed or reset


def test_a_kept_alive_connection_the_server_closed_is_replaced_not_failed() -> None:
    """A server that closes each connection once it has answered (with no `connection:
    close`), and one that takes the next request's bytes and closes unanswered: each
    request is answered, each on a new connection once the last one went."""

    def closes_after_first(server: Server) -> Handler:
        async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await server.request(reader)
            writer.write(OK)
            await writer.drain()

        return handler

    def takes_the_second_and_closes(server: Server) -> Handler:
        async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await server.request(reader)
            writer.write(OK)
            await writer.drain()
            await server.request(reader)

        return handler

    async def test() -> list[int]:
        counts = []
        for handler_for in (closes_after_first, takes_the_second_and_closes):
            async with serve(handler_for) as server:
                pool = UpstreamPool(max_connections=8)
                for _ in range(3):
                    response = await pool.post(route(server.url), b"{}")
                    assert (response.status, await response.read()) == (200, b"{}")
                    response.release()
                await pool.aclose()
                counts.append(server.connections)
        return counts

    assert run(test) == [3, 3]


def test_a_request_closed_unanswered_goes_once_more_on_a_new_connection_and_no_more() -> None:
    """The first connection answers, then closes on the second request; the new one the
    client makes for it closes unanswered too: that is the server's answer, no third."""

    def handler_for(server: Server) -> Handler:
        async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            first = server.connections == 1
            await server.request(reader)
            if first:
                writer.write(OK)
                await writer.drain()
                await server.request(reader)

        return handler

    async def test() -> int:
        async with serve(handler_for) as server:
            pool = UpstreamPool(max_connections=8)
            response = await pool.post(route(server.url), b"{}")
            assert await response.read() == b"{}"
            response.release()
            with pytest.raises(ConnectionClosed):
                await pool.post(route(server.url), b"{}")
            await pool.aclose()
            return server.connections

    assert run(test) == 2


def test_a_reset_cuts_a_body_of_no_stated_length_short() -> None:
    """A body read to the close ends at an orderly close (FIN); a reset (RST) after part
    of it is a failure, not a shorter answer."""

    def handler_for(server: Server) -> Handler:
        async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await server.request(reader)
            writer.write(b"HTTP/1.1 200 OK\r\nconnection: close\r\n\r\npartial")
            await writer.drain()
            await asyncio.sleep(0.1)  # the client has the part by now
            reset(writer)

        return handler

    async def test() -> str:
        with pytest.raises(ConnectionClosed) as cut:
            await fetched(handler_for)
        return str(cut.value).split(" (")[0]

    assert run(test) == "the upstream reset the connection before the answer ended"


def test_the_first_failure_is_the_one_the_caller_sees() -> None:
    """Bad chunk framing is a ProtocolError; the connection's close that follows it must
    not turn it into a ConnectionClosed."""

    def handler_for(server: Server) -> Handler:
        async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await server.request(reader)
            writer.write(CHUNKED + b"2\r\nhi\r\n")
            await writer.drain()
            await asyncio.sleep(0.05)
            writer.write(b"zz\r\n")
            await writer.drain()
            await reader.read()

        return handler

    async def test() -> list[Any]:
        async with serve(handler_for) as server:
            pool = UpstreamPool(max_connections=8)
            response = await pool.post(route(server.url), b"{}")
            first = await anext(response)
            with pytest.raises(ProtocolError):
                await anext(response)
            response.close()
            await pool.aclose()
            return [first]

    assert run(test) == [b"hi"]


# connecting


@contextlib.contextmanager
def dropping_connections() -> Iterator[int]:
    """A port on loopback whose listener's backlog is full and never accepted from: Linux
    drops each new SYN (net.ipv4.tcp_abort_on_overflow is 0 by default), and the client's
    connect waits, as on an address that is down."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(0)
    port = listener.getsockname()[1]
    fillers = []
    try:
        for _ in range(3):
            filler = socket.socket()
            filler.setblocking(False)
            filler.connect_ex(("127.0.0.1", port))
            fillers.append(filler)
        yield port
    finally:
        for filler in fillers:
            filler.close()
        listener.close()


def on(*ports: int) -> Callable[[str, int], Any]:
    """A resolver that gives these loopback ports, in order, for any name."""

    async def resolve(host: str, port: int) -> list[Any]:
        return [
            (socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP, "", ("127.0.0.1", p))
            for p in ports
        ]

    return resolve


def test_an_address_that_drops_connections_costs_a_quarter_second_not_the_budget() -> None:
    """A name's first address drops SYNs, its second answers: the connection is made on
    the second 0.25 s on (Happy Eyeballs), well within a 5 s connect budget. Alone, the
    dropping address would take the whole budget."""

    async def test() -> tuple[str, bool, int]:
        async with serve(answering(OK)) as server:
            with dropping_connections() as dropping:
                alone = UpstreamPool(max_connections=8, resolve=on(dropping))
                short = Route.post("http://backend.test/v1/x", {}, connect_s=0.5)
                with pytest.raises(ConnectFailed) as waited:
                    await alone.post(short, b"{}")
                pool = UpstreamPool(max_connections=8, resolve=on(dropping, server.port))
                started = time.monotonic()
                patient = Route.post("http://backend.test/v1/x", {}, connect_s=5.0)
                response = await pool.post(patient, b"{}")
                took = time.monotonic() - started
                assert await response.read() == b"{}"
                response.release()
                await pool.aclose()
            return type(waited.value.os_error).__name__, 0.2 < took < 1.0, response.status

    assert run(test) == ("TimeoutError", True, 200)


def test_a_name_is_resolved_and_reached_on_the_address_that_answers() -> None:
    """`localhost` through the system's resolver (::1 and 127.0.0.1 on many hosts) to a
    server on 127.0.0.1 only: reached at once."""

    async def test() -> int:
        async with serve(answering(OK)) as server:
            pool = UpstreamPool(max_connections=8)
            started = time.monotonic()
            response = await pool.post(route(f"http://localhost:{server.port}/v1/x"), b"{}")
            assert time.monotonic() - started < 0.5
            assert await response.read() == b"{}"
            response.release()
            await pool.aclose()
            return response.status

    assert run(test) == 200


# connections kept and let go


def test_idle_connections_past_the_keepalive_are_closed_oldest_first() -> None:
    """A burst of 20 at once, then one request at a time for longer than the keepalive
    (0.3 s), against a server with no idle timer of its own: the 19 the client no longer
    needs are closed, and the one in use is kept."""

    async def test() -> tuple[int, int, int]:
        async with serve(answering(OK, times=1000)) as server:
            pool = UpstreamPool(max_connections=32, keepalive_s=0.3)

            async def one() -> None:
                response = await pool.post(route(server.url), b"{}")
                assert await response.read() == b"{}"
                response.release()

            await asyncio.gather(*(one() for _ in range(20)))
            burst = server.open
            until = time.monotonic() + 0.6
            while time.monotonic() < until:
                await one()
                await asyncio.sleep(0.02)
            await asyncio.sleep(0.1)  # the server sees the closes
            still_open = server.open
            await pool.aclose()
            return burst, still_open, server.connections

    assert run(test) == (20, 1, 20)


def test_closing_the_pool_closes_the_connections_in_use_too() -> None:
    """A stream still being read when the pool closes: its connection closes, and the
    reader learns it."""

    def handler_for(server: Server) -> Handler:
        async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await server.request(reader)
            writer.write(CHUNKED + b"2\r\nhi\r\n")
            await writer.drain()
            if await reader.read() == b"":
                server.closed_by_client.set()

        return handler

    async def test() -> bytes:
        async with serve(handler_for) as server:
            pool = UpstreamPool(max_connections=8)
            response = await pool.post(route(server.url), b"{}")
            first = await anext(response)
            await pool.aclose()
            await asyncio.wait_for(server.closed_by_client.wait(), 2)
            with pytest.raises(ConnectionClosed):
                await anext(response)
            response.close()
            return first

    assert run(test) == b"hi"


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


def refusal(status: int, *headers: bytes) -> Callable[[Post], bytes]:
    body = b'{"error":{"message":"busy","type":"server_error"}}'
    extra = b"".join(h + b"\r\n" for h in headers)
    head = b"HTTP/1.1 %d Busy\r\ncontent-type: application/json\r\n%scontent-length: %d\r\n\r\n"
    return lambda post: head % (status, extra, len(body)) + body


async def forwarded(
    forwarder: Forwarder, server: Server, *, stream: bool
) -> int | UpstreamUnavailable:
    """The client's status, or the failure the forwarder reported before any byte."""
    client = Client()
    try:
        await forwarder.forward(
            target(server),
            chat_request(stream=stream),
            public_model="big",
            send=client.send,
            headers=[],
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


# the gateway in front of a hostile backend


KEY = "sk-hostile-test-key"


@pytest.fixture(params=["asyncio", "uvloop"])
def loop(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@contextlib.contextmanager
def gateway_before(backend: Backend, loop: str) -> Iterator[str]:
    """The gateway under uvicorn, on `loop`'s event loop, with one backend; its URL.
    ServerThread runs `asyncio.run`, which makes its loop by the policy in force as the
    thread starts."""
    settings = parse_settings({
        "tenants": [tenant("acme", KEY)],
        "pools": [{
            "name": "big",
            # a fixed capacity: the gateway probes /health, and needs no /metrics
            "backends": [{"url": backend.url, "served_model": "m", "capacity": 65_536}],
        }],
    })  # fmt: skip
    app = create_app(settings, environ={"SPILLGATE_ADMIN_TOKEN": ADMIN_TOKEN})
    policy = asyncio.get_event_loop_policy()
    if loop == "uvloop":
        asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())
    try:
        server = ServerThread(app).start()
    finally:
        asyncio.set_event_loop_policy(policy)
    try:
        yield server.url
    finally:
        server.stop()


def chat(url: str, *, stream: bool) -> str:
    """A chat completion through the official client: the answer's text."""
    client = openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0, timeout=10)
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
