"""Two gateway processes on one Redis share their prefix indexes: a prefix one replica
routed is known to the other before it routes it once (gateway/shared/prefix_feed.py)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

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

SYSTEM = {"role": "system", "content": "You answer questions about the fleet. " * 60}


@pytest.fixture
def replicas(tmp_path: Path) -> Iterator[tuple[list[GatewayProcess], RedisProcess]]:
    sims = [ServerThread(create_sim_app(SimConfig(model="m", kv_tokens=16_384, speed=50.0)))
            for _ in range(4)]  # fmt: skip
    for sim in sims:
        sim.start()
    config = {
        "tenants": [tenant("acme", KEY, requests_per_minute=10_000, tokens_per_minute=10**8)],
        "pools": [
            {"name": "chat", "backends": [{"url": s.url, "served_model": "m"} for s in sims]}
        ],
        "redis": {"timeout_ms": 250},
    }
    path = tmp_path / "gateway.yaml"
    path.write_text(yaml.safe_dump(config))
    try:
        with RedisProcess() as redis_proc:
            gateways = start_gateways(path, 2, redis_url=redis_proc.url)
            try:
                yield gateways, redis_proc
            finally:
                for gateway in gateways:
                    gateway.stop()
    finally:
        for sim in sims:
            sim.stop()


def ask(gateway: GatewayProcess, user: str) -> None:
    body = {"model": "chat", "messages": [SYSTEM, {"role": "user", "content": user}],
            "max_tokens": 4}  # fmt: skip
    response = httpx.post(f"{gateway.url}/v1/chat/completions", json=body, timeout=30,
                          headers={"authorization": f"Bearer {KEY}"})  # fmt: skip
    assert response.status_code == 200, response.text


def index_hit_rates(gateway: GatewayProcess) -> dict[str, Any]:
    (pool,) = gateway.status()["pools"]
    return {b["name"]: b["prefix_cache"]["index_hit_rate"] for b in pool["backends"]}


def test_a_prefix_routed_by_one_replica_is_known_to_the_other(
    replicas: tuple[list[GatewayProcess], RedisProcess],
) -> None:
    (a, b), redis_proc = replicas
    listener = redis.Redis.from_url(redis_proc.url).pubsub(ignore_subscribe_messages=True)
    listener.subscribe("spillgate:prefix:routed")
    ask(a, "one")
    deadline = time.monotonic() + 10
    while listener.get_message(timeout=0.1) is None:
        assert time.monotonic() < deadline, "replica A published nothing"
    listener.close()
    # B got the same message as this listener, and an idle B adds it at once; the margin is
    # for a machine busy with other test workers (only B's first request can tell)
    time.sleep(1.0)
    (home,) = [name for name, rate in index_hit_rates(a).items() if rate is not None]
    ask(b, "two")
    rates = index_hit_rates(b)
    # B's first request found the system prompt where A had sent it: all but the last block
    assert [name for name, rate in rates.items() if rate is not None] == [home]
    assert rates[home] > 0.8
