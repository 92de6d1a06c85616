"""A Redis that stalls again and again under a serving `spillgate serve`, default settings.

Each stall is a SIGSTOP of the real redis-server for 0.45 s, then SIGCONT, while requests
keep arriving. Calls cut by their time budget must not keep their pooled connection (the
pool of 64 ran dry after about 64 stalls and the limiter stayed in `local` for good while
Redis answered PONG). After 60 stalls both the limiter and the ledger are back on `shared`
within the cooldown, Redis sees no more connections than the gateway's steady ones, and
the gateway's log has no `Unclosed` warning.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import redis
import yaml

from loadtest.procs import RedisProcess
from loadtest.sim.app import create_sim_app
from loadtest.sim.config import SimConfig
from tests.support.fleet import tenant
from tests.support.harness import ServerThread
from tests.support.replica import KEY, GatewayProcess, start_gateways

STALLS = 60
STALL_S = 0.45
LOAD_THREADS = 4  # each sends its next request once the last is answered
COOLDOWN_S = 5.0  # ratelimit.cooldown_s's default
# the gateway's steady connections: two pipelines on the wire at most, three subscriptions
# (ledger releases, prefix blocks, the queues' waiters), and the batch store's own client
# (its calls move whole files, on a budget of their own)
STEADY_CONNECTIONS = 6


@pytest.fixture
def served(tmp_path: Path) -> Iterator[tuple[GatewayProcess, RedisProcess]]:
    sim = ServerThread(create_sim_app(SimConfig(model="m", kv_tokens=8192, no_delay=True)))
    sim.start()
    config = tmp_path / "gateway.yaml"
    backend = {"url": sim.url, "served_model": "m", "capacity": 4096}
    limits = {"requests_per_minute": 10**6, "tokens_per_minute": 10**9}
    config.write_text(
        yaml.safe_dump(
            {
                "tenants": [tenant("acme", KEY, **limits)],
                "pools": [{"name": "big", "backends": [backend]}],
            }
        )
    )
    try:
        with RedisProcess() as redis_proc:
            env = {"PYTHONWARNINGS": "always::ResourceWarning"}
            (gateway,) = start_gateways(config, 1, redis_url=redis_proc.url, **env)
            try:
                yield gateway, redis_proc
            finally:
                gateway.stop()
    finally:
        sim.stop()


def load(url: str, stop: threading.Event, statuses: list[int]) -> None:
    """Light load: one request after another, each waiting for its answer."""
    headers = {"authorization": f"Bearer {KEY}"}
    body = {"model": "big", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}
    with httpx.Client(base_url=url, headers=headers, timeout=10) as client:
        while not stop.is_set():
            statuses.append(client.post("/v1/chat/completions", json=body).status_code)


def gateway_connections(admin: redis.Redis) -> int:
    """Connections other than `admin`'s own (older servers name its command `client`)."""
    own = admin.client_id()
    return sum(1 for c in admin.client_list() if int(c["id"]) != own)


def test_sixty_stalls_leak_nothing_and_shared_mode_resumes(
    served: tuple[GatewayProcess, RedisProcess],
) -> None:
    gateway, redis_proc = served
    admin = redis.Redis.from_url(redis_proc.url, socket_timeout=5)
    stop = threading.Event()
    statuses: list[int] = []
    workers = [threading.Thread(target=load, args=(gateway.url, stop, statuses)) for _ in range(2)]
    for worker in workers:
        worker.start()
    try:
        time.sleep(1.0)
        for _ in range(STALLS):
            redis_proc.pause()
            time.sleep(STALL_S)
            redis_proc.resume()
            time.sleep(0.1)
        resumed_at = time.monotonic()
        while not (
            gateway.metric("spillgate_ratelimit_mode", mode="shared") == 1
            and gateway.metric("spillgate_ledger_mode", mode="shared") == 1
        ):
            assert time.monotonic() - resumed_at < COOLDOWN_S + 1.0, (
                f"shared never resumed; {gateway_connections(admin)} connections, "
                f"{gateway.log.read_text().count('Unclosed')} unclosed"
            )
            time.sleep(0.1)
        errors = gateway.metric("spillgate_ratelimit_store_errors_total")
        time.sleep(1.0)
        assert gateway.metric("spillgate_ratelimit_store_errors_total") == errors
    finally:
        stop.set()
        for worker in workers:
            worker.join(timeout=30)
    connections = gateway_connections(admin)
    admin.close()
    unclosed = gateway.log.read_text().count("Unclosed")
    assert (connections <= STEADY_CONNECTIONS, unclosed, set(statuses)) == (True, 0, {200}), (
        f"{connections} connections"
    )
