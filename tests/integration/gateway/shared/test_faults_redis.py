"""Redis slow, down and restarted under a serving gateway: every request is answered, no
request waits on Redis past its time budget, shared state resumes by itself, and afterwards
Redis holds no lease and the tenant's shared bucket stands exactly where its answers say.

The gateway reaches Redis through a proxy that can delay every chunk; the tests share it
and run in file order.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Iterator
from dataclasses import dataclass

import httpx
import pytest
import redis

from gateway.app import create_app
from gateway.config import parse_settings
from loadtest.fault_proxy import DelayProxy
from loadtest.procs import RedisProcess, free_port
from loadtest.sim.app import create_sim_app
from loadtest.sim.config import SimConfig
from tests.support.fault import Book, chat, usage_total
from tests.support.fleet import ADMIN_TOKEN, Fleet, tenant
from tests.support.harness import ServerThread
from tests.support.metrics import metric_sum

TIME_BUDGET_S = 0.25
LIMITS = {"requests_per_minute": 1, "request_burst": 500,
          "tokens_per_minute": 1, "token_burst": 100_000}  # fmt: skip


@dataclass
class Setup:
    fleet: Fleet
    redis_proc: RedisProcess
    proxy: DelayProxy
    book: Book
    peek_tokens: int = 0
    asked: int = 0  # requests sent, whether or not the book can follow their charges

    def gauge(self, name: str, mode: str) -> float:
        return metric_sum(self.fleet.url, name, mode=mode)

    def errors(self) -> float:
        url = self.fleet.url
        return metric_sum(url, "spillgate_ratelimit_store_errors_total") + metric_sum(
            url, "spillgate_ledger_store_errors_total"
        )

    def shared_again(self) -> None:
        deadline = time.monotonic() + 15
        while not (
            self.gauge("spillgate_ratelimit_mode", "shared") == 1
            and self.gauge("spillgate_ledger_mode", "shared") == 1
        ):
            assert time.monotonic() < deadline, "shared mode never resumed"
            self.ask()  # the limiter probes Redis again on a request after its cooldown
            time.sleep(0.1)
        clean = 0  # three answers in a row without a store error
        while clean < 3:
            assert time.monotonic() < deadline, "Redis calls kept failing"
            errors = self.errors()
            self.ask()
            self.settled()
            clean = clean + 1 if self.errors() == errors else 0

    def ask(self, body: dict[str, object] | None = None) -> httpx.Response:
        self.asked += 1
        with self.fleet.client("acme", timeout=10) as client:
            return client.post("/v1/chat/completions", json=body or chat("hi", model="big"))

    def served(self, label: str) -> tuple[httpx.Response, float]:
        """One request answered by the backend, entered in the book; and how long it took."""
        started = time.monotonic()
        response = self.ask()
        elapsed = time.monotonic() - started
        assert response.status_code == 200, response.text
        assert response.headers["x-spillgate-outcome"] == "local"
        self.book.used(label, response.headers, usage_total(response.text))
        self.settled()
        return response, elapsed

    def peek(self) -> int:
        response = self.ask(chat("peek", model="dead"))
        assert response.status_code in (502, 503)
        reserved = self.book.reserved(response.headers)
        self.book.nothing("peek", response.headers)
        self.settled()
        return reserved

    def settled(self) -> None:
        deadline = time.monotonic() + 5
        while metric_sum(self.fleet.url, "spillgate_requests_total", tenant="acme") < self.asked:
            assert time.monotonic() < deadline, "requests never settled"
            time.sleep(0.02)

    def rebase(self) -> None:
        """Start a new book from the shared bucket as a peek shows it (Redis lost the old)."""
        response = self.ask(chat("peek", model="dead"))
        remaining_tokens = int(response.headers["x-ratelimit-remaining-tokens"])
        remaining_requests = int(response.headers["x-ratelimit-remaining-requests"])
        self.book = Book("acme", 500, 100_000, log=[*self.book.log, "rebased"])
        self.book.spent_requests = 500 - remaining_requests - 1
        self.book.spent_tokens = 100_000 - remaining_tokens - self.peek_tokens
        self.book.nothing("peek", response.headers)
        self.settled()


@pytest.fixture(scope="module")
def setup() -> Iterator[Setup]:
    key = "sk-" + secrets.token_hex(8)
    with RedisProcess() as redis_proc, DelayProxy(redis_proc.port) as proxy:
        sim = ServerThread(create_sim_app(SimConfig(model="m", kv_tokens=8192, no_delay=True)))
        sim.start()
        backend = {"url": sim.url, "served_model": "m", "capacity": 4096}
        try:
            settings = parse_settings(
                {
                    "tenants": [tenant("acme", key, **LIMITS)],
                    "pools": [
                        {"name": "big", "backends": [backend]},
                        {
                            "name": "dead",
                            "backends": [
                                {"url": f"http://127.0.0.1:{free_port()}", "capacity": 99}
                            ],
                        },
                    ],
                    "redis": {"timeout_ms": TIME_BUDGET_S * 1000},
                    "ratelimit": {
                        "failure_mode": "local",
                        "failure_threshold": 1,
                        "cooldown_s": 0.3,
                    },
                    "ledger": {"lease_ttl_s": 3, "refresh_s": 0.2},
                }
            )
            env = {"SPILLGATE_ADMIN_TOKEN": ADMIN_TOKEN}
            app = create_app(settings, environ=env, redis_url=proxy.url)
            with ServerThread(app) as gateway:
                fleet = Fleet(gateway=gateway, backends={}, settings=settings, keys={"acme": key})
                s = Setup(fleet, redis_proc, proxy, Book("acme", 500, 100_000))
                s.peek_tokens = s.peek()
                yield s
        finally:
            sim.stop()


def test_redis_slower_but_within_the_time_budget_changes_nothing(setup: Setup) -> None:
    errors = setup.errors()
    # 10 ms a chunk each way: well within the 250 ms budget even when the test machine is
    # busy, where 20 ms once took a call past it
    setup.proxy.delay_s = 0.01
    try:
        for i in range(3):
            setup.served(f"slow {i}")
    finally:
        setup.proxy.delay_s = 0.0
    assert setup.errors() == errors
    assert setup.gauge("spillgate_ratelimit_mode", "shared") == 1
    assert setup.gauge("spillgate_ledger_mode", "shared") == 1


def test_redis_slower_than_the_budget_is_not_waited_for(setup: Setup) -> None:
    errors = setup.errors()
    setup.proxy.delay_s = 1.0  # each Redis call would take 2 s: every one is given up on
    try:
        for _ in range(3):
            started = time.monotonic()
            response = setup.ask()
            assert response.status_code == 200
            assert response.headers["x-spillgate-outcome"] == "local"
            # waiting on Redis would take 2 s a call, and a request makes at least three
            assert time.monotonic() - started < 2.0
        setup.settled()
        assert setup.errors() > errors
        assert setup.gauge("spillgate_ratelimit_mode", "local") == 1
    finally:
        setup.proxy.delay_s = 0.0
    setup.shared_again()


def test_redis_down_then_restarted(setup: Setup) -> None:
    setup.redis_proc.stop()
    for _ in range(3):
        response = setup.ask()
        assert response.status_code == 200
    # a request that fits the gateway's block asks nothing of Redis: the refresh finds it away
    deadline = time.monotonic() + 2.0
    while setup.gauge("spillgate_ledger_mode", "local") != 1 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert setup.gauge("spillgate_ledger_mode", "local") == 1
    assert setup.gauge("spillgate_ratelimit_mode", "local") == 1
    setup.settled()
    setup.redis_proc.start()  # same port, empty: buckets and leases are gone
    setup.shared_again()
    setup.settled()
    setup.rebase()
    for i in range(3):
        setup.served(f"after restart {i}")
    client = redis.Redis(port=setup.redis_proc.port, socket_timeout=5)
    assert client.dbsize() > 0  # shared state is written again


def test_afterwards_redis_holds_no_lease_and_the_bucket_is_exact(setup: Setup) -> None:
    status = setup.fleet.status()
    held = [(b["tokens_in_flight"], b["active_sessions"])
            for p in status["pools"] for b in p["backends"]]  # fmt: skip
    assert set(held) == {(0, 0)}
    client = redis.Redis(port=setup.redis_proc.port, socket_timeout=5)
    stored = [
        f"spillgate:ledger:{{{backend}}}:{key}"
        for backend in ("big-0", "dead-0")
        for key in ("leases", "tokens", "usage")
    ]
    deadline = time.monotonic() + 2.0  # an idle gateway's block goes with its next refresh
    while client.exists(*stored) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert client.exists(*stored) == 0
    assert setup.peek() == setup.peek_tokens, setup.book.log
