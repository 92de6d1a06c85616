"""A queued request whose client disconnects leaves the queue at once, holds no capacity,
and never reaches a backend."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import orjson
import pytest

from loadtest.sim.config import SimConfig
from tests.support.fleet import Fleet, run_fleet
from tests.support.overflow import (
    STATIC_RESERVATION,
    async_client,
    backend_requests,
    chat,
    eventually,
    holding,
    sample,
    wait_for,
)


@pytest.fixture
def fleet() -> Iterator[Fleet]:
    with run_fleet(
        pools={"big": [SimConfig(model="m", kv_tokens=4096, speed=2.0)]},
        pool_options={
            "big": {
                "target_fill": 1.0,
                "overflow": ["queue", "reject"],
                "queue": {"max_wait_s": 10},
                "reservation": STATIC_RESERVATION,
            }
        },
        capacity={"big": 1000},
    ) as f:
        yield f


def in_flight(fleet: Fleet) -> int:
    return sum(b["tokens_in_flight"] for b in fleet.status()["pools"][0]["backends"])


async def abandon_a_queued_request(fleet: Fleet) -> tuple[int, int]:
    """Queue one request over a raw socket, hang up; return the tokens held before/after."""
    host, port = fleet.gateway.host, fleet.gateway.port
    body = orjson.dumps(chat("queued then abandoned", model="big", max_tokens=50))
    head = (
        f"POST /v1/chat/completions HTTP/1.1\r\nhost: {host}\r\n"
        f"authorization: Bearer {fleet.keys['acme']}\r\ncontent-type: application/json\r\n"
        f"content-length: {len(body)}\r\n\r\n"
    ).encode()
    async with async_client(fleet, "acme") as client, holding(client, "big"):
        held = await asyncio.to_thread(in_flight, fleet)
        _, writer = await asyncio.open_connection(host, port)
        writer.write(head + body)
        await writer.drain()
        await wait_for(lambda: sample(fleet, "spillgate_queue_depth", pool="big") == 1)
        writer.close()
        await writer.wait_closed()
        # gone at once, long before its 10 s deadline
        await wait_for(lambda: sample(fleet, "spillgate_queue_depth", pool="big") == 0, within_s=2)
        still = await asyncio.to_thread(in_flight, fleet)
    return held, still


def test_a_disconnected_waiter_holds_nothing_and_is_never_forwarded(fleet: Fleet) -> None:
    backend = fleet.backends["big"][0]
    held, still = asyncio.run(abandon_a_queued_request(fleet))
    assert held > 0 and still == held  # only the holder's reservation, nothing for the waiter
    # the holder's release was not handed to the departed waiter
    eventually(lambda: in_flight(fleet) == 0)
    assert backend_requests(backend) == 1  # the holder only
    with fleet.client("acme") as client:
        response = client.post("/v1/chat/completions", json=chat("after", model="big"))
    assert response.headers["x-spillgate-outcome"] == "local"
    assert backend_requests(backend) == 2
