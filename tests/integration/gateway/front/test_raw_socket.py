"""Bad bytes straight on the gateway's port get a 4xx or a closed connection, never a 5xx,
and the gateway answers a good request sent at the same time."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import httpx
import orjson
import pytest

from loadtest.sim.config import SimConfig
from tests.support.fleet import Fleet, run_fleet

BODY_LIMIT = 8192
READ_DEADLINE_S = 0.5
GOOD = orjson.dumps(
    {"model": "big", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5}
)


@pytest.fixture(scope="module")
def fleet() -> Iterator[Fleet]:
    server = {"max_body_bytes": BODY_LIMIT, "request_read_timeout_s": READ_DEADLINE_S}
    with run_fleet(
        pools={"big": [SimConfig(model="m", kv_tokens=8192, no_delay=True)]},
        extra={"server": server},
    ) as f:
        yield f


def head(fleet: Fleet, *lines: str) -> bytes:
    """A request head for the chat endpoint with a valid key, plus `lines`."""
    fixed = [
        "POST /v1/chat/completions HTTP/1.1",
        f"host: {fleet.gateway.host}",
        f"authorization: Bearer {fleet.keys['acme']}",
        "content-type: application/json",
    ]
    return ("\r\n".join([*fixed, *lines]) + "\r\n\r\n").encode()


def chunked(*chunks: bytes) -> bytes:
    return b"".join(b"%x\r\n%s\r\n" % (len(c), c) for c in chunks) + b"0\r\n\r\n"


async def exchange(fleet: Fleet, parts: list[bytes], *, gap_s: float = 0.0) -> int | None:
    """Send `parts`, pausing `gap_s` between them, until the gateway answers or hangs up;
    the status it answered, None if it only closed the connection."""
    reader, writer = await asyncio.open_connection(fleet.gateway.host, fleet.gateway.port)

    async def answer() -> bytes:
        try:
            response_head = await reader.readuntil(b"\r\n\r\n")
        except asyncio.IncompleteReadError:
            return b""  # closed without an answer
        for line in response_head.lower().split(b"\r\n"):
            if line.startswith(b"content-length:"):
                await reader.readexactly(int(line.partition(b":")[2]))
        return response_head.partition(b"\r\n")[0]

    answered = asyncio.ensure_future(answer())
    try:
        for part in parts:
            if answered.done():
                break
            writer.write(part)
            await writer.drain()
            if gap_s:
                await asyncio.sleep(gap_s)
        async with asyncio.timeout(5):
            status_line = await answered
    except ConnectionError:
        return None
    finally:
        answered.cancel()
        writer.close()
    return int(status_line.split()[1]) if status_line else None


async def good_request(fleet: Fleet) -> int:
    headers = {"authorization": f"Bearer {fleet.keys['acme']}"}
    async with httpx.AsyncClient(base_url=fleet.url, headers=headers, timeout=10) as client:
        response = await client.post("/v1/chat/completions", content=GOOD)
        return response.status_code


async def with_good_request(fleet: Fleet, bad: asyncio.Future[int | None]) -> int | None:
    """Run the bad client, and a good request once the bad one is under way."""
    bad_task = asyncio.ensure_future(bad)
    await asyncio.sleep(0.05)
    status = await good_request(fleet)
    assert status == 200, "a bad client kept the gateway from serving a good one"
    return await bad_task


def nested(depth: int) -> bytes:
    return (
        b'{"model":"big","messages":[{"role":"user","content":"hi"}],"metadata":'
        + b"[" * depth
        + b"]" * depth
        + b"}"
    )


DEEP_PARSEABLE = nested(300)  # parses, but deeper than the gateway accepts
DEEPER_THAN_PARSER = nested(2000)
CASES: dict[str, tuple[list[str], bytes, set[int | None]]] = {
    "content-length and transfer-encoding": (
        [f"content-length: {len(GOOD)}", "transfer-encoding: chunked"],
        chunked(GOOD),
        {400},
    ),
    "chunk size not hex": (["transfer-encoding: chunked"], b"zz\r\nabc\r\n0\r\n\r\n", {400}),
    "chunk without its CRLF": (["transfer-encoding: chunked"], b"3\r\nabcXX0\r\n\r\n", {400}),
    "chunk shorter than declared": (["transfer-encoding: chunked"], b"ff\r\nabc\r\n", {408}),
    "one header over 16 KB": (
        [f"x-pad: {'a' * 17_000}", f"content-length: {len(GOOD)}"],
        GOOD,
        {431},
    ),
    "many headers over 16 KB": (
        [f"x-pad-{i}: {'b' * 100}" for i in range(200)] + [f"content-length: {len(GOOD)}"],
        GOOD,
        {431},
    ),
    "declared body over the limit": ([f"content-length: {BODY_LIMIT + 1}"], b"x" * 100, {413}),
    "chunked body over the limit": (
        ["transfer-encoding: chunked"],
        chunked(*[b"y" * 4000] * 3),
        {413},
    ),
    "JSON nested 300 deep": ([f"content-length: {len(DEEP_PARSEABLE)}"], DEEP_PARSEABLE, {400}),
    "JSON nested 2000 deep": (
        [f"content-length: {len(DEEPER_THAN_PARSER)}"],
        DEEPER_THAN_PARSER,
        {400},
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_bad_bytes_get_a_4xx_and_others_are_still_served(fleet: Fleet, case: str) -> None:
    lines, body, expected = CASES[case]
    status = asyncio.run(with_good_request(fleet, exchange(fleet, [head(fleet, *lines), body])))
    assert status in expected


def test_a_request_trickled_slower_than_the_read_deadline_is_closed_with_408(
    fleet: Fleet,
) -> None:
    """One byte every 0.1 s: the body would take 3 s to arrive; the deadline is 0.5 s."""
    slow = [head(fleet, f"content-length: {len(GOOD[:30])}"), *[bytes([b]) for b in GOOD[:30]]]

    async def scenario() -> tuple[int | None, float]:
        loop = asyncio.get_running_loop()
        started = loop.time()
        status = await with_good_request(fleet, exchange(fleet, slow, gap_s=0.1))
        return status, loop.time() - started

    status, elapsed = asyncio.run(scenario())
    assert status == 408
    assert elapsed < 2.5  # cut off long before the whole body could have arrived


def test_a_body_slower_than_the_first_watch_tick_but_inside_the_deadline_is_served(
    fleet: Fleet,
) -> None:
    """Head and three parts 0.1 s apart: the watch's first tick (0.1 s) comes mid-body and
    the body is whole at about 0.3 s, inside the 0.5 s deadline."""
    third = len(GOOD) // 3
    parts = [GOOD[:third], GOOD[third : 2 * third], GOOD[2 * third :]]
    status = asyncio.run(
        exchange(fleet, [head(fleet, f"content-length: {len(GOOD)}"), *parts], gap_s=0.1)
    )
    assert status == 200


def test_the_408_is_openai_shaped_and_closes_the_connection(fleet: Fleet) -> None:
    async def scenario() -> bytes:
        reader, writer = await asyncio.open_connection(fleet.gateway.host, fleet.gateway.port)
        try:
            writer.write(head(fleet, "content-length: 100") + b'{"model":')
            await writer.drain()
            async with asyncio.timeout(5):
                return await reader.read()  # returns only once the gateway closes
        finally:
            writer.close()

    answer = asyncio.run(scenario())
    head_part, _, body = answer.partition(b"\r\n\r\n")
    assert head_part.startswith(b"HTTP/1.1 408")
    assert b"connection: close" in head_part.lower()
    error = orjson.loads(body)["error"]
    assert error["code"] == "request_timeout" and error["type"] == "invalid_request_error"


def test_nothing_is_left_reserved_after_the_bad_clients(fleet: Fleet) -> None:
    backends = fleet.status()["pools"][0]["backends"]
    assert [(b["tokens_in_flight"], b["active_sessions"]) for b in backends] == [(0, 0)]
