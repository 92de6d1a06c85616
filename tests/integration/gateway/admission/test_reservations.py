"""Every reservation is released: completion, upstream failure, disconnect and cancellation."""

import asyncio
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from starlette.types import Receive, Scope, Send

from gateway.admission.fleet.metrics_text import samples, values
from loadtest.procs import free_port
from loadtest.sim.config import SimConfig
from tests.support.fleet import Fleet, run_fleet
from tests.support.harness import ServerThread
from tests.support.metrics import metrics_text

CHAT = {"messages": [{"role": "user", "content": "Tell me a story"}]}


async def dies_mid_stream(scope: Scope, receive: Receive, send: Send) -> None:
    """A backend that streams two events, then drops the connection."""
    if scope["type"] != "http":
        return
    if scope["path"] == "/health":
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})
        return
    if scope["method"] != "POST":  # a listing of nothing: the gateway's probe learns nothing
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"{}"})
        return
    await receive()
    head = [(b"content-type", b"text/event-stream")]
    await send({"type": "http.response.start", "status": 200, "headers": head})
    event = b'data: {"model":"x","choices":[{"index":0,"delta":{"content":"a"}}]}\n\n'
    await send({"type": "http.response.body", "body": event * 2, "more_body": True})
    raise RuntimeError("backend crashed")


def gauges(fleet: Fleet, name: str) -> dict[str, float]:
    return {s.labels["backend"]: s.value for s in samples(fleet.metrics_text(), (name,))}


@pytest.fixture(scope="module")
def fleet() -> Iterator[Fleet]:
    dying = ServerThread(dies_mid_stream).start()
    sims = [SimConfig(model="m", kv_tokens=16384, speed=20.0)]
    dead_port = free_port()
    pool_opts: dict[str, dict[str, Any]] = {
        "broken": {
            "backends": [
                {"url": dying.url, "capacity": 4096},
            ]
        },
        "dead": {"backends": [{"url": f"http://127.0.0.1:{dead_port}", "capacity": 4096}]},
    }
    try:
        with run_fleet(pools={"big": sims, "broken": [], "dead": []}, pool_options=pool_opts) as f:
            yield f
    finally:
        dying.stop()


def test_reservations_return_to_zero_after_every_kind_of_ending(fleet: Fleet) -> None:
    async def scenario() -> None:
        headers = {"authorization": f"Bearer {fleet.keys['acme']}"}
        async with httpx.AsyncClient(base_url=fleet.url, headers=headers, timeout=20) as client:
            completed = [
                client.post("/v1/chat/completions", json={"model": "big", **CHAT, "max_tokens": 20})
                for _ in range(5)
            ]
            done = await asyncio.gather(*completed)
            assert all(r.status_code == 200 for r in done)

            failed = await client.post("/v1/chat/completions", json={"model": "dead", **CHAT})
            assert failed.status_code == 503  # its probe found nothing listening
            assert failed.json()["error"]["code"] == "backend_unavailable"

            body = {"model": "broken", **CHAT, "stream": True}
            async with client.stream("POST", "/v1/chat/completions", json=body) as broken:
                text = (await broken.aread()).decode()
            assert '"error"' in text and text.endswith("data: [DONE]\n\n")

            body = {"model": "big", **CHAT, "stream": True, "max_tokens": 2000}
            async with client.stream("POST", "/v1/chat/completions", json=body) as stream:
                async for _ in stream.aiter_raw():
                    break  # disconnect mid-stream
            pending = asyncio.create_task(
                client.post(
                    "/v1/chat/completions", json={"model": "big", **CHAT, "max_tokens": 3000}
                )
            )
            await asyncio.sleep(0.3)
            assert gauges(fleet, "spillgate_inflight_tokens")["big-0"] > 0
            pending.cancel()  # cancelled before any byte came back
            with pytest.raises(asyncio.CancelledError):
                await pending

    asyncio.run(scenario())
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        inflight = gauges(fleet, "spillgate_inflight_tokens")
        sessions = gauges(fleet, "spillgate_active_sessions")
        if not any(inflight.values()) and not any(sessions.values()):
            break
        time.sleep(0.05)
    assert inflight == {"big-0": 0.0, "broken-0": 0.0, "dead-0": 0.0}
    assert sessions == {"big-0": 0.0, "broken-0": 0.0, "dead-0": 0.0}
    # the disconnected and cancelled requests were aborted upstream
    assert running_upstream(fleet) == [0.0]


def running_upstream(fleet: Fleet) -> list[float]:
    """The big pool's backend's `vllm:num_requests_running` samples."""
    text = metrics_text(fleet.backends["big"][0].url)
    return values(samples(text), "vllm:num_requests_running")


def test_a_client_gone_before_the_disconnect_watch_begins_is_still_seen(fleet: Fleet) -> None:
    """The watch starts 100 ms into a request; a client that left sooner is seen then."""

    async def leave_at_once() -> None:
        headers = {"authorization": f"Bearer {fleet.keys['acme']}"}
        async with httpx.AsyncClient(base_url=fleet.url, headers=headers, timeout=20) as client:
            body = {"model": "big", **CHAT, "max_tokens": 4000}  # seconds of decoding
            pending = asyncio.create_task(client.post("/v1/chat/completions", json=body))
            await asyncio.sleep(0.02)
            pending.cancel()
            with pytest.raises(asyncio.CancelledError):
                await pending

    asyncio.run(leave_at_once())
    deadline = time.monotonic() + 1.5  # the answer itself would take several seconds
    while time.monotonic() < deadline:
        if not gauges(fleet, "spillgate_inflight_tokens")["big-0"] and not any(
            running_upstream(fleet)
        ):
            break
        time.sleep(0.02)
    assert gauges(fleet, "spillgate_inflight_tokens")["big-0"] == 0.0
    assert running_upstream(fleet) == [0.0]
