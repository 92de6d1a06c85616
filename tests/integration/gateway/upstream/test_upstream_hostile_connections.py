"""Connections the gateway's own HTTP/1.1 client (gateway/upstream/http.py) keeps, loses
and lets go, each against a real server on loopback: a kept-alive connection the server
closed, a request closed unanswered, a reset, an address that drops connections, a name
resolved to several, the keepalive's idle limit, closing the pool.

The tests run on asyncio's loop and on uvloop's (`run`)."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from gateway.upstream.http_head import ConnectFailed, ConnectionClosed, ProtocolError, Route
from gateway.upstream.pool import UpstreamPool
from tests.support.raw_server import (
    CHUNKED,
    OK,
    Handler,
    Server,
    answering,
    fetched,
    reset,
    route,
    run,
    serve,
)

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
