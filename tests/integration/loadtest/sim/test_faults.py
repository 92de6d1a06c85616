"""The fault matrix: backends that die, stall or trickle, a provider that fails, times out
or refuses, clients that leave at every stage. Every request gets an honest answer, every
upstream left behind is hung up on, and afterwards nothing is reserved and each tenant's
buckets stand exactly where its answers say they must.

The tests share one gateway and run in file order, on one worker (`make test`
distributes by file); the last one checks the books.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import time
from collections.abc import AsyncIterator, Iterator
from typing import Any

import httpx
import orjson
import pytest

from tests.support.fault import (
    chat,
    provider_stats,
    sse_events,
    usage_total,
    wait_for,
)
from tests.support.matrix import Matrix, fault_matrix, peek
from tests.support.metrics import metric_sum


@pytest.fixture(scope="module")
def matrix() -> Iterator[Matrix]:
    with fault_matrix() as m:
        yield m


async def stream_text(client: httpx.AsyncClient, body: dict[str, Any]) -> httpx.Response:
    response = await client.post("/v1/chat/completions", json={**body, "stream": True})
    return response


def test_a_backend_killed_mid_stream_ends_in_an_error_event_and_is_not_retried(
    matrix: Matrix,
) -> None:
    async def scenario() -> tuple[httpx.Response, str]:
        body = chat("a long story", model="crash", max_tokens=400, stream=True)
        async with (
            matrix.client("acme") as client,
            client.stream("POST", "/v1/chat/completions", json=body) as response,
        ):
            chunks = response.aiter_text()
            text = await anext(chunks)
            matrix.crash.send_signal(signal.SIGKILL)
            async for chunk in chunks:
                text += chunk
        return response, text

    response, text = asyncio.run(scenario())
    assert response.status_code == 200
    events = sse_events(text)
    assert events[-1] == "[DONE]"
    error = orjson.loads(events[-2])["error"]
    assert error["code"] == "upstream_error" and "mid-stream" in error["message"]
    assert matrix.faults.arrivals["spare"] == 0  # nothing retried after the first byte
    matrix.books["acme"].reservation("killed mid-stream", response.headers)
    matrix.settled("acme")


def test_a_backend_that_never_answers_gets_the_first_token_timeout_within_the_deadline(
    matrix: Matrix,
) -> None:
    """first_token 0.6 s, total 1.0 s: the first backend times out at 0.6 s, the retry on
    the second is cut at the deadline, and no third attempt is made."""

    async def scenario() -> httpx.Response:
        async with matrix.client("acme") as client:
            return await stream_text(client, chat("hello?", model="silent"))

    response = asyncio.run(scenario())
    assert response.status_code == 504
    assert response.json()["error"]["code"] == "upstream_timeout"
    assert response.headers["retry-after"] == "1"
    faults = matrix.faults
    assert [faults.arrivals[b] for b in ("s0", "s1", "s2")] == [1, 1, 0]
    eventually_hung_up(matrix, {"s0": 1, "s1": 1})
    matrix.books["acme"].nothing("never answered, streamed", response.headers)
    matrix.settled("acme")


def test_a_whole_answer_gets_the_first_token_timeout_and_a_retry_within_the_deadline(
    matrix: Matrix,
) -> None:
    """Not streamed, the answer's head is its first byte: it too must come within
    first_token (0.6 s), so the request is tried on a second backend, cut at the 1.0 s
    deadline, as a stream is."""

    async def scenario() -> httpx.Response:
        async with matrix.client("acme") as client:
            return await client.post("/v1/chat/completions", json=chat("hi", model="silent"))

    before = [matrix.faults.arrivals[b] for b in ("s0", "s1", "s2")]
    response = asyncio.run(scenario())
    assert response.status_code == 504
    assert response.json()["error"]["code"] == "upstream_timeout"
    after = [matrix.faults.arrivals[b] for b in ("s0", "s1", "s2")]
    assert [a - b for a, b in zip(after, before, strict=True)] == [1, 1, 0]
    matrix.books["acme"].nothing("never answered, whole", response.headers)
    matrix.settled("acme")


def eventually_hung_up(matrix: Matrix, expected: dict[str, int]) -> None:
    deadline = time.monotonic() + 5
    while {name: matrix.faults.hangups[name] for name in expected} != expected:
        assert time.monotonic() < deadline, f"upstream not hung up on: {matrix.faults.hangups}"
        time.sleep(0.02)


def test_a_backend_trickling_under_the_idle_timeout_is_cut_at_the_total_deadline(
    matrix: Matrix,
) -> None:
    """An event every 0.1 s never trips the 0.5 s idle timeout; the 1.5 s deadline ends it."""

    async def scenario() -> httpx.Response:
        async with matrix.client("acme") as client:
            return await stream_text(client, chat("drip", model="trickle"))

    response = asyncio.run(scenario())
    events = sse_events(response.text)
    assert response.status_code == 200
    assert events[-1] == "[DONE]"
    assert "stopped responding" in orjson.loads(events[-2])["error"]["message"]
    assert len(events) - 2 > 1.5 / 0.5  # it ran well past one idle window
    eventually_hung_up(matrix, {"t0": 1})
    matrix.books["acme"].reservation("trickled", response.headers)
    matrix.settled("acme")


def test_a_stalled_stream_is_cut_by_the_idle_timeout(matrix: Matrix) -> None:
    async def scenario() -> tuple[httpx.Response, float]:
        started = time.monotonic()
        async with matrix.client("acme") as client:
            response = await stream_text(client, chat("stall", model="stall"))
        return response, time.monotonic() - started

    response, elapsed = asyncio.run(scenario())
    events = sse_events(response.text)
    assert events[-1] == "[DONE]" and len(events) == 3
    assert "stopped responding" in orjson.loads(events[-2])["error"]["message"]
    assert elapsed < 10  # the pool's idle timeout (0.4 s), not its 30 s deadline
    eventually_hung_up(matrix, {"st0": 1})
    matrix.books["acme"].reservation("stalled", response.headers)
    matrix.settled("acme")


def spill(matrix: Matrix, *, stream: bool = False) -> httpx.Response:
    async def scenario() -> httpx.Response:
        async with matrix.client("acme") as client:
            body = chat("overflow", model="spill", max_tokens=30, stream=stream)
            return await client.post("/v1/chat/completions", json=body)

    return asyncio.run(scenario())


def test_a_provider_5xx_is_asked_once_and_passed_on(matrix: Matrix) -> None:
    book = matrix.books["acme"]
    served = spill(matrix)
    assert served.headers["x-spillgate-outcome"] == "provider"
    book.used("provider answered", served.headers, usage_total(served.text))
    matrix.settled("acme")
    httpx.post(f"{matrix.hosted.url}/sim/fail", json={"status": 503}, timeout=5)
    before = provider_stats(matrix.hosted)["requests"]
    refused = spill(matrix)
    assert refused.status_code == 503 and refused.headers["x-spillgate-outcome"] == "rejected"
    assert int(refused.headers["retry-after"]) >= 1
    assert provider_stats(matrix.hosted)["requests"] == before + 1  # no retry
    book.nothing("provider 503", refused.headers)
    matrix.settled("acme")


def aborted(matrix: Matrix) -> int:
    return int(provider_stats(matrix.hosted)["aborted"])


def test_a_provider_that_times_out_is_asked_once_and_hung_up_on(matrix: Matrix) -> None:
    book = matrix.books["acme"]
    for stream in (True, False):
        httpx.post(f"{matrix.hosted.url}/sim/delay", json={"seconds": 5}, timeout=5)
        before = provider_stats(matrix.hosted)
        refused = spill(matrix, stream=stream)
        assert refused.status_code == 503
        after = provider_stats(matrix.hosted)
        assert after["requests"] == before["requests"] + 1
        left = before["aborted"]
        asyncio.run(wait_for(lambda left=left: aborted(matrix) > left))
        book.nothing(f"provider timeout stream={stream}", refused.headers)
        matrix.settled("acme")


def test_a_provider_429_keeps_it_unasked_for_its_retry_after(matrix: Matrix) -> None:
    """The provider allows three requests a minute; the next is refused with 429 and
    Retry-After, which opens its breaker: the one after is passed on without asking."""
    book = matrix.books["acme"]
    for _ in range(4):  # whatever is left of the provider's minute is spent first
        before = provider_stats(matrix.hosted)
        refused = spill(matrix)
        if refused.status_code != 200:
            break
        book.used("provider answered", refused.headers, usage_total(refused.text))
        matrix.settled("acme")
    assert refused.status_code == 503
    after = provider_stats(matrix.hosted)
    assert after["by_status"].get("429", 0) == before["by_status"].get("429", 0) + 1
    book.nothing("provider 429", refused.headers)
    matrix.settled("acme")
    again = spill(matrix)
    assert again.status_code == 503
    assert provider_stats(matrix.hosted)["requests"] == after["requests"]
    book.nothing("provider breaker open", again.headers)
    matrix.settled("acme")


@contextlib.asynccontextmanager
async def holding_steady(matrix: Matrix) -> AsyncIterator[None]:
    """The holder tenant fills the steady pool with one long stream, then hangs up."""
    async with matrix.client("holder") as client:
        body = chat("hold", model="steady", max_tokens=980, stream=True)  # 992 in blocks
        async with client.stream("POST", "/v1/chat/completions", json=body) as response:
            assert response.headers["x-spillgate-outcome"] == "local"
            matrix.books["holder"].reservation("held, then cut", response.headers)
            yield
    await asyncio.to_thread(matrix.settled, "holder")


def in_flight(matrix: Matrix, pool: str) -> int:
    pools = {p["name"]: p for p in matrix.fleet.status()["pools"]}
    return sum(b["tokens_in_flight"] for b in pools[pool]["backends"])


def test_a_client_gone_while_queued_leaves_nothing_behind(matrix: Matrix) -> None:
    gw = matrix.fleet.gateway
    body = orjson.dumps(chat("queued, then gone", model="steady", max_tokens=50))
    head = (
        f"POST /v1/chat/completions HTTP/1.1\r\nhost: {gw.host}\r\n"
        f"authorization: Bearer {matrix.fleet.keys['acme']}\r\n"
        f"content-type: application/json\r\ncontent-length: {len(body)}\r\n\r\n"
    ).encode()

    def depth() -> float:
        return metric_sum(gw.url, "spillgate_queue_depth", pool="steady")

    async def scenario() -> tuple[int, int]:
        async with holding_steady(matrix):
            held = await asyncio.to_thread(in_flight, matrix, "steady")
            _, writer = await asyncio.open_connection(gw.host, gw.port)
            writer.write(head + body)
            await writer.drain()
            await wait_for(lambda: depth() == 1)
            writer.close()
            await writer.wait_closed()
            await wait_for(lambda: depth() == 0)
            return held, await asyncio.to_thread(in_flight, matrix, "steady")

    before = metric_sum(matrix.steady.url, "sim_requests_finished_total")
    held, still = asyncio.run(scenario())
    assert held == still  # the waiter held nothing
    matrix.books["acme"].nothing("gone while queued")
    matrix.settled("acme")
    assert metric_sum(matrix.steady.url, "sim_requests_finished_total") == before
    assert in_flight(matrix, "steady") == 0


def test_a_client_gone_before_the_first_token_cancels_the_upstream(matrix: Matrix) -> None:
    async def scenario() -> None:
        async with matrix.client("acme") as client:
            body = chat("wait for it", model="mute", stream=True)
            pending = asyncio.create_task(client.post("/v1/chat/completions", json=body))
            await wait_for(lambda: matrix.faults.arrivals["mu0"] == 1)
            pending.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await pending

    asyncio.run(scenario())
    eventually_hung_up(matrix, {"mu0": 1})
    matrix.books["acme"].nothing("gone before the first token")
    matrix.settled("acme")
    assert in_flight(matrix, "mute") == 0


def test_a_client_gone_mid_stream_aborts_the_upstream(matrix: Matrix) -> None:
    aborted = metric_sum(matrix.steady.url, "sim_requests_aborted_total")

    async def scenario() -> httpx.Headers:
        body = chat("a long answer", model="steady", max_tokens=900, stream=True)
        async with (
            matrix.client("acme") as client,
            client.stream("POST", "/v1/chat/completions", json=body) as response,
        ):
            await anext(response.aiter_raw())
            return response.headers

    headers = asyncio.run(scenario())
    matrix.books["acme"].reservation("gone mid-stream", headers)
    matrix.settled("acme")
    asyncio.run(
        wait_for(lambda: metric_sum(matrix.steady.url, "sim_requests_aborted_total") > aborted)
    )
    assert metric_sum(matrix.steady.url, "vllm:num_requests_running") == 0


def test_after_the_matrix_nothing_is_reserved_and_every_bucket_is_exact(matrix: Matrix) -> None:
    status = matrix.fleet.status()
    held = {b["name"]: (b["tokens_in_flight"], b["active_sessions"])
            for p in status["pools"] for b in p["backends"]}  # fmt: skip
    assert set(held.values()) == {(0, 0)}, held
    url = matrix.fleet.url
    assert metric_sum(url, "spillgate_inflight_tokens") == 0
    assert metric_sum(url, "spillgate_active_sessions") == 0
    assert metric_sum(url, "spillgate_queue_depth") == 0
    assert time.monotonic() - matrix.started_at < 60, "buckets refilled a token: not exact"
    for name, book in matrix.books.items():
        assert len(book.log) > 1
        assert asyncio.run(peek(matrix, name)) == matrix.peek_tokens, book.log
