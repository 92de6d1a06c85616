"""The KV-events subscriber against a simulated vLLM that publishes its events on real ZMQ
sockets: what it holds after a late start (replay), after missed batches (a gap, caught up),
after a prefix-cache reset (`AllBlocksCleared`), and after the engine restarts."""

from __future__ import annotations

import asyncio
import secrets
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest
import zmq.asyncio

from gateway.admission.fleet.kv_events import EventsView, Subscriber
from gateway.admission.prompt_tokens import PromptTokenizer
from gateway.admission.routing.kv_index import block_keys
from gateway.app import create_app
from gateway.clock import SystemClock
from gateway.config import KvEventsSettings, parse_settings
from loadtest.bench.kv_events import two_free_ports
from loadtest.loadgen.scrape import backend_state
from loadtest.procs import free_port
from loadtest.sim.app import create_sim_app
from loadtest.sim.config import SimConfig
from loadtest.sim.tokenizer_files import write
from tests.support.fleet import ADMIN_TOKEN, admin_status
from tests.support.fleet import tenant as tenant_entry
from tests.support.harness import ServerThread

BLOCK = 16


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write(tmp_path_factory.mktemp("tokenizer"))


def sim(tokenizer_dir: Path, port: int, *, drop_every: int = 0, http_port: int | None = None):
    config = SimConfig(model="m", kv_tokens=64 * BLOCK, block_size=BLOCK, speed=100.0,
                       kv_events_port=port, kv_events_drop_every=drop_every,
                       tokenizer=str(tokenizer_dir))  # fmt: skip
    return ServerThread(create_sim_app(config), port=http_port).start()


@pytest.fixture
def events_port() -> int:
    return two_free_ports()


@pytest.fixture
def backend(tokenizer_dir: Path, events_port: int) -> Iterator[ServerThread]:
    server = sim(tokenizer_dir, events_port)
    yield server
    server.stop()


def chat(tenant: int, question: str = "hi") -> dict[str, object]:
    system = f"{tenant} is the tenant you assist. " * 12
    return {"model": "m", "max_tokens": 2, "messages": [
        {"role": "system", "content": system}, {"role": "user", "content": question}]}  # fmt: skip


def send(server: ServerThread, body: dict[str, object]) -> None:
    response = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=10)
    assert response.status_code == 200, response.text


class Watch:
    """A subscriber running on the test's loop while inside `async with`, and its view."""

    def __init__(self, port: int) -> None:
        self.settings = KvEventsSettings(
            endpoint=f"tcp://127.0.0.1:{port}", replay=f"tcp://127.0.0.1:{port + 1}"
        )
        self.view = EventsView()

    async def __aenter__(self) -> Watch:
        self._context = zmq.asyncio.Context()
        sub = Subscriber("b", self.settings, self.view, context=self._context, clock=SystemClock())
        self._task = asyncio.create_task(sub.run())
        return self

    async def __aexit__(self, *exc: object) -> None:
        self._task.cancel()
        await asyncio.gather(self._task, return_exceptions=True)
        self._context.term()

    async def until(self, done: Callable[[], bool], *, within_s: float = 10.0) -> None:
        async with asyncio.timeout(within_s):
            while not done():  # noqa: ASYNC110 (the view has no event to wait on)
                await asyncio.sleep(0.02)


def held(view: EventsView, tokenizer: PromptTokenizer, body: dict[str, object]) -> int:
    ids = tokenizer.chat(body)
    assert ids is not None
    return view.blocks.matched(block_keys(ids, BLOCK))


def whole_blocks(tokenizer: PromptTokenizer, body: dict[str, object]) -> int:
    ids = tokenizer.chat(body)
    assert ids is not None
    return len(ids) // BLOCK


def test_a_late_subscriber_learns_what_the_engine_cached_from_the_replay(
    backend: ServerThread, events_port: int, tokenizer_dir: Path
) -> None:
    tokenizer = PromptTokenizer(tokenizer_dir)
    for tenant in range(3):
        send(backend, chat(tenant))
    want = whole_blocks(tokenizer, chat(0))

    async def scenario() -> EventsView:
        async with Watch(events_port) as watch:
            await watch.until(lambda: held(watch.view, tokenizer, chat(2)) == want)
            return watch.view

    view = asyncio.run(scenario())
    for tenant in range(3):
        assert held(view, tokenizer, chat(tenant)) == want
    assert held(view, tokenizer, chat(9)) == 0
    assert view.rebuilds == 1 and view.gaps == 0


def test_evictions_reach_the_view_and_a_reset_clears_it(
    backend: ServerThread, events_port: int, tokenizer_dir: Path
) -> None:
    tokenizer = PromptTokenizer(tokenizer_dir)
    per_chat = whole_blocks(tokenizer, chat(0))
    tenants = 63 // per_chat + 2  # more prompts than the cache's 63 usable blocks hold
    last = chat(tenants - 1)

    async def scenario() -> None:
        async with Watch(events_port) as watch:
            await watch.until(lambda: watch.view.connected)
            for tenant in range(tenants):
                await asyncio.to_thread(send, backend, chat(tenant))
            await watch.until(lambda: held(watch.view, tokenizer, last) == per_chat)
            assert held(watch.view, tokenizer, chat(0)) < per_chat  # the oldest evicted
            assert len(watch.view.blocks) <= 63
            reset = await asyncio.to_thread(httpx.post, f"{backend.url}/reset_prefix_cache")
            assert reset.status_code == 200
            await watch.until(lambda: len(watch.view.blocks) == 0)
            assert held(watch.view, tokenizer, last) == 0

    asyncio.run(scenario())


def test_missed_batches_are_caught_up_through_the_replay(
    tokenizer_dir: Path, events_port: int
) -> None:
    server = sim(tokenizer_dir, events_port, drop_every=3)
    tokenizer = PromptTokenizer(tokenizer_dir)

    async def scenario() -> None:
        async with Watch(events_port) as watch:
            await watch.until(lambda: watch.view.connected)
            for tenant in range(8):
                await asyncio.to_thread(send, server, chat(tenant))
                await asyncio.sleep(0.02)  # a batch each
            want = whole_blocks(tokenizer, chat(7))
            await watch.until(lambda: held(watch.view, tokenizer, chat(7)) == want)
            assert watch.view.gaps >= 1
            async with Watch(events_port) as fresh:  # the engine's whole story, replayed
                await fresh.until(lambda: fresh.view.seq == watch.view.seq)
            assert len(watch.view.blocks) == len(fresh.view.blocks) > 0
            for tenant in range(8):
                body = chat(tenant)
                assert held(watch.view, tokenizer, body) == held(fresh.view, tokenizer, body)

    try:
        asyncio.run(scenario())
    finally:
        server.stop()


def test_a_restarted_engine_starts_the_view_again(tokenizer_dir: Path, events_port: int) -> None:
    server = sim(tokenizer_dir, events_port)
    tokenizer = PromptTokenizer(tokenizer_dir)
    want = whole_blocks(tokenizer, chat(1))
    servers = [server]

    async def scenario() -> None:
        async with Watch(events_port) as watch:
            await watch.until(lambda: watch.view.connected)
            await asyncio.to_thread(send, server, chat(1))
            await watch.until(lambda: held(watch.view, tokenizer, chat(1)) == want)
            await asyncio.to_thread(server.stop)
            await watch.until(lambda: not watch.view.connected)
            again = await asyncio.to_thread(sim, tokenizer_dir, events_port, http_port=server.port)
            servers.append(again)
            await asyncio.to_thread(send, again, chat(2))
            await watch.until(lambda: held(watch.view, tokenizer, chat(2)) == want)
            assert held(watch.view, tokenizer, chat(1)) == 0  # the old engine's cache is gone
            assert watch.view.rebuilds >= 2

    try:
        asyncio.run(scenario())
    finally:
        servers[-1].stop()


def test_the_gateway_routes_by_the_events_of_one_backend_and_guesses_for_the_other(
    tokenizer_dir: Path, events_port: int
) -> None:
    """Prompts sent straight to the backend that publishes events (bypassing the gateway)
    draw the gateway's requests for them there: its events said it holds them. The other
    backend has no events: /admin/status says it is scored by the routed index."""
    with_events = sim(tokenizer_dir, events_port)
    without = sim(tokenizer_dir, two_free_ports())
    started = [with_events, without]
    try:
        key = "sk-" + secrets.token_hex(8)
        settings = parse_settings({
            "tenants": [tenant_entry("acme", key)],
            "pools": [{"name": "m", "routing": "prefix", "tokenizer": str(tokenizer_dir),
                       "backends": [
                {"url": with_events.url, "kv_events": {
                    "endpoint": f"tcp://127.0.0.1:{events_port}",
                    "replay": f"tcp://127.0.0.1:{events_port + 1}"}},
                {"url": without.url}]}],
            "batch": {"dir": tempfile.mkdtemp(prefix="spillgate-batch-")},
        })  # fmt: skip
        app = create_app(settings, environ={"SPILLGATE_ADMIN_TOKEN": ADMIN_TOKEN})
        gateway = ServerThread(app).start()
        started.append(gateway)
        tenants = range(20, 26)
        for t in tenants:  # traffic that bypasses the gateway
            send(with_events, chat(t))
        deadline = time.monotonic() + 10
        while True:
            (pool,) = admin_status(gateway.url)["pools"]
            first, second = (b["prefix_cache"] for b in pool["backends"])
            if first["events"]["blocks"] > 0 or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        assert first["index"] == "events"
        assert first["events"]["connected"] is True
        assert first["events"]["last_seq"] >= 0
        assert second == {**second, "index": "routed", "events": None}
        before = backend_state(httpx.get(f"{with_events.url}/metrics").text)
        headers = {"authorization": f"Bearer {key}"}
        for t in tenants:
            r = httpx.post(f"{gateway.url}/v1/chat/completions", json=chat(t, "again"),
                           headers=headers, timeout=10)  # fmt: skip
            assert r.status_code == 200, r.text
        after = backend_state(httpx.get(f"{with_events.url}/metrics").text)
        other = backend_state(httpx.get(f"{without.url}/metrics").text)
        assert other["prefix_queries"] == 0  # every request went where its prompt was cached
        assert after["prefix_hits"] - before["prefix_hits"] >= len(tenants) * 16
    finally:
        for server in reversed(started):
            server.stop()


def test_an_engine_that_stops_answering_heartbeats_is_dropped_and_rebuilt_on_return(
    tokenizer_dir: Path, events_port: int
) -> None:
    """A stopped engine keeps its connection open but answers no heartbeat: the view goes
    out of use (not connected) in seconds, and is rebuilt when the engine answers again."""
    import os
    import signal
    import subprocess
    import sys

    from loadtest.procs import wait_for_port

    port = free_port()
    cmd = [sys.executable, "-m", "gateway.cli", "sim", "--port", str(port), "--model", "m",
           "--kv-tokens", str(64 * BLOCK), "--block-size", str(BLOCK),
           "--kv-events-port", str(events_port), "--tokenizer", str(tokenizer_dir)]  # fmt: skip
    engine = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_for_port(port, timeout=30)
        httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions", json=chat(1), timeout=10)

        async def scenario() -> EventsView:
            async with Watch(events_port) as watch:
                await watch.until(lambda: watch.view.connected and len(watch.view.blocks) > 0)
                os.kill(engine.pid, signal.SIGSTOP)
                try:
                    await watch.until(lambda: not watch.view.connected, within_s=15)
                finally:
                    os.kill(engine.pid, signal.SIGCONT)
                await watch.until(lambda: watch.view.connected and watch.view.rebuilds == 2,
                                  within_s=15)  # fmt: skip
                await watch.until(lambda: len(watch.view.blocks) > 0)
                return watch.view

        view = asyncio.run(scenario())
        assert view.rebuilds == 2 and view.connected
    finally:
        engine.terminate()
        engine.wait(timeout=10)
