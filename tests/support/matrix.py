"""The fault matrix's gateway: pools on a fault backend that dies, stalls or trickles, a
steady simulator, a backend process to kill and a provider that fails, times out or
refuses; and the books of what each tenant has spent."""

from __future__ import annotations

import asyncio
import contextlib
import secrets
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx

from gateway.app import create_app
from gateway.config import parse_settings
from loadtest.procs import free_port
from loadtest.sim.app import create_sim_app
from loadtest.sim.config import SimConfig
from loadtest.sim.provider import ProviderConfig, create_provider_app
from tests.support.fault import (
    Book,
    FaultBackend,
    backend_process,
    chat,
    wait_for_process,
)
from tests.support.fleet import ADMIN_TOKEN, Fleet, tenant
from tests.support.harness import ServerThread
from tests.support.metrics import metric_sum

PROVIDER_KEY = "sk-hosted-" + secrets.token_hex(8)
BURST_REQUESTS = 1000
BURST_TOKENS = 1_000_000
LIMITS = {
    "requests_per_minute": 1,
    "request_burst": BURST_REQUESTS,
    "tokens_per_minute": 1,
    "token_burst": BURST_TOKENS,
}
SILENT = {"connect": 1, "first_token": 0.6, "idle": 5, "total": 1.0}


@dataclass
class Matrix:
    fleet: Fleet
    faults: FaultBackend
    steady: ServerThread
    hosted: ServerThread
    crash: Any  # the backend process to kill
    books: dict[str, Book]
    peek_tokens: int = 0
    started_at: float = 0.0

    def client(self, name: str, **kwargs: Any) -> httpx.AsyncClient:
        return httpx.AsyncClient(
            base_url=self.fleet.url,
            headers={"authorization": f"Bearer {self.fleet.keys[name]}"},
            timeout=kwargs.pop("timeout", 15.0),
            **kwargs,
        )

    def settled(self, name: str) -> None:
        """Wait until the gateway has recorded (so settled) every request of the tenant."""
        want = self.books[name].spent_requests
        url = self.fleet.url
        deadline = time.monotonic() + 5
        while metric_sum(url, "spillgate_requests_total", tenant=name) < want:
            assert time.monotonic() < deadline, f"{name}: requests never settled"
            time.sleep(0.02)


def pools(faults_url: str, steady: str, crash_url: str) -> list[dict[str, Any]]:
    def at(name: str, model: str, capacity: int = 4096) -> dict[str, Any]:
        return {"url": f"{faults_url}/{name}", "served_model": model, "capacity": capacity}

    return [
        {"name": "steady", "target_fill": 1.0, "overflow": ["queue", "reject"],
         "queue": {"max_wait_s": 10}, "reservation": {"mode": "max_tokens"},
         "backends": [{"url": steady, "served_model": "m", "capacity": 1000}]},
        {"name": "silent", "timeouts": SILENT,
         "backends": [at("s0", "silent"), at("s1", "silent"), at("s2", "silent")]},
        {"name": "trickle", "timeouts": {"first_token": 1, "idle": 0.5, "total": 1.5},
         "backends": [at("t0", "trickle")]},
        {"name": "stall", "timeouts": {"first_token": 1, "idle": 0.4, "total": 30},
         "backends": [at("st0", "stall")]},
        {"name": "mute", "timeouts": {"first_token": 30, "total": 60},
         "backends": [at("mu0", "silent")]},
        # streams cut here are not continued: the pool's error path is what is tested
        # (tests/integration/gateway/front/test_stream_continuation.py continues them)
        {"name": "crash", "continue_streams": 0,
         "backends": [{"url": crash_url, "served_model": "c", "capacity": 4096},
                      at("spare", "c")]},
        {"name": "spill", "overflow": ["provider", "reject"], "provider": "hosted",
         "backends": [at("tiny", "ok", capacity=10)]},
        {"name": "dead",
         "backends": [{"url": f"http://127.0.0.1:{free_port()}", "capacity": 4096}]},
    ]  # fmt: skip


@contextlib.contextmanager
def fault_matrix() -> Iterator[Matrix]:
    """The gateway in front of the fault backend's pools, a steady simulator, a backend
    process to kill and a provider allowed three requests a minute; tenants `acme` and
    `holder`, each with a burst that the tests' books follow."""
    faults = FaultBackend()
    keys = {name: "sk-" + secrets.token_hex(8) for name in ("acme", "holder")}
    started: list[ServerThread] = []
    with backend_process(model="c", speed=0.5) as (crash, crash_url):
        try:
            fault_server = ServerThread(faults).start()
            steady = ServerThread(create_sim_app(SimConfig(model="m", kv_tokens=4096, speed=2.0)))
            hosted = ServerThread(
                create_provider_app(ProviderConfig(api_key=PROVIDER_KEY, requests_per_minute=3))
            )
            started += [fault_server, steady.start(), hosted.start()]
            settings = parse_settings(
                {
                    "tenants": [tenant(name, key, **LIMITS) for name, key in keys.items()],
                    "pools": pools(fault_server.url, steady.url, crash_url),
                    "providers": [
                        {
                            "name": "hosted",
                            "base_url": hosted.url + "/v1",
                            "api_key_env": "HOSTED_KEY",
                            "timeouts": SILENT,
                            "breaker_failures": 100,
                        }
                    ],
                }
            )
            env = {"SPILLGATE_ADMIN_TOKEN": ADMIN_TOKEN, "HOSTED_KEY": PROVIDER_KEY}
            gateway = ServerThread(create_app(settings, environ=env)).start()
            started.append(gateway)
            wait_for_process(crash, crash_url)
            fleet = Fleet(gateway=gateway, backends={}, settings=settings, keys=keys)
            wait_until_up(fleet, "crash-0")  # it started after the gateway's first probe
            books = {name: Book(name, BURST_REQUESTS, BURST_TOKENS) for name in keys}
            m = Matrix(fleet, faults, steady, hosted, crash, books, started_at=time.monotonic())
            m.peek_tokens = asyncio.run(peek(m, "acme"))
            assert asyncio.run(peek(m, "holder")) == m.peek_tokens
            yield m
        finally:
            for server in reversed(started):
                server.stop()


def wait_until_up(fleet: Fleet, backend: str) -> None:
    deadline = time.monotonic() + 10
    while True:
        states = {b["name"]: b["state"] for p in fleet.status()["pools"] for b in p["backends"]}
        if states[backend] == "up":
            return
        assert time.monotonic() < deadline, f"{backend} never came up"
        time.sleep(0.05)


async def peek(m: Matrix, name: str) -> int:
    """A request to the pool whose backend is gone: refused before any byte, so it costs
    one request and no tokens; its headers show the buckets. Returns what it reserved."""
    async with m.client(name) as client:
        response = await client.post("/v1/chat/completions", json=chat("peek", model="dead"))
    assert response.status_code in (502, 503)
    reserved = m.books[name].reserved(response.headers)
    m.books[name].nothing("peek", response.headers)
    await asyncio.to_thread(m.settled, name)
    return reserved
