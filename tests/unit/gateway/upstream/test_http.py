"""The upstream client against servers on loopback that answer byte by byte as each test
needs: keep-alive, streaming, closing, refusing, breaking the protocol."""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import ssl
import subprocess
from pathlib import Path

import pytest

from gateway.upstream.http import HIGH_WATER
from gateway.upstream.http_head import ConnectFailed, ConnectionClosed, ProtocolError
from gateway.upstream.pool import UpstreamPool
from loadtest.procs import free_port
from tests.support.raw_server import OK, Handler, Server, answering, fetched, route, run, serve


def test_requests_one_after_another_share_one_connection() -> None:
    async def test() -> None:
        async with serve(answering(OK)) as server:
            pool = UpstreamPool(max_connections=8)
            for body in (b'{"a":1}', b'{"b":22}'):
                response = await pool.post(route(server.url), body, {"traceparent": "00-x"})
                assert (response.status, await response.read()) == (200, b"{}")
                assert response.headers[b"content-type"] == b"application/json"
                response.release()
            await pool.aclose()
            port = server.url.split(":")[2].split("/")[0]
        assert server.connections == 1
        assert server.requests[1] == (
            b"POST /v1/chat/completions HTTP/1.1\r\n"
            b"host: 127.0.0.1:" + port.encode() + b"\r\n"
            b"content-type: application/json\r\n"
            b"traceparent: 00-x\r\n"
            b'content-length: 8\r\n\r\n{"b":22}'
        )

    run(test)


def test_a_connection_idle_past_the_keepalive_or_closed_by_the_server_is_not_reused() -> None:
    closing = OK.replace(b"content-length", b"connection: close\r\ncontent-length")

    async def test() -> tuple[int, int]:
        async with serve(answering(OK)) as kept, serve(answering(closing)) as closed:
            pool = UpstreamPool(max_connections=8, keepalive_s=0.05)
            for server in (kept, kept, closed, closed):
                response = await pool.post(route(server.url), b"{}")
                assert await response.read() == b"{}"
                response.release()
                await asyncio.sleep(0.1)
            await pool.aclose()
            return kept.connections, closed.connections

    assert run(test) == (2, 2)


def test_a_stream_arrives_as_sent_and_closing_it_early_closes_the_connection() -> None:
    async def test() -> list[bytes]:
        def handler_for(server: Server) -> Handler:
            async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
                await server.request(reader)
                writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n")
                for i in range(50):
                    event = b"data: %d\n\n" % i
                    writer.write(b"%x\r\n%s\r\n" % (len(event), event))
                    await writer.drain()
                    await asyncio.sleep(0.02)
                    if reader.at_eof():
                        break
                if await reader.read() == b"":
                    server.closed_by_client.set()

            return handler

        async with serve(handler_for) as server:
            pool = UpstreamPool(max_connections=8)
            response = await pool.post(route(server.url), b"{}")
            seen = [await anext(response), await anext(response)]
            response.close()
            await asyncio.wait_for(server.closed_by_client.wait(), 2)
            return seen

    assert run(test) == [b"data: 0\n\n", b"data: 1\n\n"]


def test_a_refused_connection_and_a_server_that_speaks_no_http_say_what_failed() -> None:
    async def test() -> None:
        pool = UpstreamPool(max_connections=8)
        with pytest.raises(ConnectFailed) as refused:
            await pool.post(route(f"http://127.0.0.1:{free_port()}/v1/x"), b"{}")
        assert isinstance(refused.value.os_error, ConnectionRefusedError)
        async with serve(answering(b"not HTTP at all\r\n\r\n")) as garbage:
            with pytest.raises(ProtocolError):
                await pool.post(route(garbage.url), b"{}")
        await pool.aclose()

    run(test)


def test_a_body_cut_short_fails_the_read() -> None:
    def handler_for(server: Server) -> Handler:
        async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await server.request(reader)
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 100\r\n\r\n0123456789")
            await writer.drain()

        return handler

    async def test() -> None:
        with pytest.raises(ConnectionClosed):
            await fetched(handler_for)

    run(test)


def test_a_body_larger_than_the_high_water_mark_is_read_whole() -> None:
    size = 4 * HIGH_WATER
    big = b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n%s" % (size, b"x" * size)

    async def test() -> int:
        return len(await fetched(answering(big)))

    assert run(test) == size


def test_no_more_connections_in_use_than_allowed_and_a_caller_that_gives_up_frees_its_own() -> None:
    def handler_for(server: Server) -> Handler:
        async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            async for raw in server.each_request(reader):
                if b"silent" not in raw:
                    writer.write(OK)
                    await writer.drain()

        return handler

    async def test() -> None:
        async with serve(handler_for) as server:
            pool = UpstreamPool(max_connections=1)
            first = await pool.post(route(server.url), b"{}")
            second = asyncio.ensure_future(pool.post(route(server.url), b"{}"))
            await asyncio.sleep(0.1)
            assert not second.done()  # the only connection is the first's
            await first.read()
            first.release()
            assert await (await second).read() == b"{}"
            (await second).release()
            with pytest.raises(TimeoutError):
                async with asyncio.timeout(0.1):
                    await pool.post(route(server.url), b'"silent"')
            third = await pool.post(route(server.url), b"{}")  # the slot came back
            assert await third.read() == b"{}"
            third.release()
            await pool.aclose()

    run(test)


def test_a_header_with_a_line_break_is_refused_rather_than_split_into_two() -> None:
    with pytest.raises(ValueError, match="line break"):
        route("http://127.0.0.1:1/v1/x", authorization="Bearer sk-1\r\nx-evil: 1")
    assert route("https://[::1]/v1/x").head.startswith(b"POST /v1/x HTTP/1.1\r\nhost: [::1]\r\n")


BAD_HEADERS = [
    {"traceparent": "00-x\r\nx-evil: 1"},  # a second header
    {"traceparent": "00-x\n\r\nPOST /admin HTTP/1.1"},  # a second request
    {"traceparent": "00-x\x00"},
    {"traceparent": "00-x\x1b[2J"},
    {"x evil": "1"},
    {"x-evil:": "1"},
    {"": "1"},
]


def test_a_per_request_header_is_checked_as_the_fixed_ones_are_and_nothing_is_sent() -> None:
    """A name that is not a token, or a value with a line break or any control character
    but HTAB, is refused by `post` (and by `Route.post`) before a byte leaves; HTAB passes."""

    async def test() -> list[bytes]:
        async with serve(answering(OK)) as server:
            pool = UpstreamPool(max_connections=8)
            for headers in BAD_HEADERS:
                with pytest.raises(ValueError):
                    await pool.post(route(server.url), b"{}", headers)
                with pytest.raises(ValueError):
                    route(server.url, **headers)
            response = await pool.post(route(server.url), b"{}", {"x-tab": "a\tb"})
            assert await response.read() == b"{}"
            response.release()
            await pool.aclose()
        return [line for raw in server.requests for line in raw.split(b"\r\n")[2:-2]]

    assert run(test) == [b"content-type: application/json", b"x-tab: a\tb", b"content-length: 2"]


def test_a_body_of_no_stated_length_ends_where_the_connection_does() -> None:
    def handler_for(server: Server) -> Handler:
        async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await server.request(reader)
            writer.write(b"HTTP/1.1 200 OK\r\nconnection: close\r\n\r\nhello, ")
            await writer.drain()
            writer.write(b"world")

        return handler

    async def test() -> bytes:
        return await fetched(handler_for)

    assert run(test) == b"hello, world"


def test_an_answer_nobody_asked_for_closes_the_connection_and_touches_no_other() -> None:
    async def test() -> tuple[bytes, bytes, int]:
        async with serve(answering(OK + OK.replace(b"{}", b"[]"))) as server:
            pool = UpstreamPool(max_connections=8)
            bodies = []
            for _ in range(2):
                response = await pool.post(route(server.url), b"{}")
                bodies.append(await response.read())
                response.release()
                await asyncio.sleep(0.05)
            await pool.aclose()
            return bodies[0], bodies[1], server.connections

    assert run(test) == (b"{}", b"{}", 2)


@pytest.mark.skipif(
    shutil.which("openssl") is None, reason="needs openssl (apt-get install openssl)"
)
def test_tls_verifies_the_server_against_the_system_store(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An https provider: trusted (its CA in the store OpenSSL reads, `SSL_CERT_FILE`), the
    request goes through; not trusted, no connection is made."""
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
         "-subj", "/CN=localhost", "-addext", "subjectAltName=DNS:localhost",
         "-keyout", str(key), "-out", str(cert)],
        check=True, capture_output=True, timeout=60,
    )  # fmt: skip
    server_side = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    server_side.load_cert_chain(cert, key)

    async def test() -> int | str:
        async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            with contextlib.suppress(ConnectionError, asyncio.IncompleteReadError, ssl.SSLError):
                await reader.readuntil(b"\r\n\r\n")
                await reader.readexactly(2)
                writer.write(OK)
                await writer.drain()
            writer.close()

        server = await asyncio.start_server(handler, "127.0.0.1", 0, ssl=server_side)
        port = server.sockets[0].getsockname()[1]
        pool = UpstreamPool(max_connections=8)  # reads the store at its first https request
        try:
            response = await pool.post(route(f"https://localhost:{port}/v1/x"), b"{}")
            assert await response.read() == b"{}"
            response.release()
            return response.status
        except ConnectFailed as exc:
            return type(exc.os_error).__name__
        finally:
            await pool.aclose()
            server.close()

    monkeypatch.setenv("SSL_CERT_FILE", str(cert))
    assert asyncio.run(test()) == 200
    monkeypatch.delenv("SSL_CERT_FILE")
    assert asyncio.run(test()) == "SSLCertVerificationError"
