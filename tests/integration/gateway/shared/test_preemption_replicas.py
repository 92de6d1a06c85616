"""Preemption across replicas: a critical request waiting at one replica stops a sheddable
stream another replica runs, through the channel the replicas share; that stream goes on
whole. Real processes: two `spillgate serve` replicas on one redis-server, a simulated vLLM,
clients over loopback."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from loadtest.procs import RedisProcess
from loadtest.sim.app import create_sim_app
from loadtest.sim.config import SimConfig
from tests.support.fleet import tenant
from tests.support.harness import ServerThread
from tests.support.preemption import (
    CAPACITY,
    SLOTS,
    STREAM_TOKENS,
    Stream,
    one_by_one,
    stream,
    whole,
)
from tests.support.replica import GatewayProcess, gateways_running

KEYS = {"bulk": "sk-bulk-tenant-key", "vip": "sk-vip-tenant-key"}


def write_config(path: Path, backend: str) -> Path:
    config: dict[str, Any] = {
        "tenants": [
            tenant("bulk", KEYS["bulk"], priority="sheddable", requests_per_minute=100_000),
            tenant("vip", KEYS["vip"], priority="critical", requests_per_minute=100_000),
        ],
        "pools": [
            {
                "name": "big",
                "backends": [{"url": backend, "served_model": "m", "capacity": CAPACITY}],
                "target_fill": 1.0,
                "overflow": ["queue", "reject"],
                "queue": {"max_wait_s": 30},
                "reservation": {"mode": "max_tokens"},
            }
        ],
        "redis": {"timeout_ms": 250},
        "ledger": {"lease_ttl_s": 2.0, "refresh_s": 0.1},
    }
    path.write_text(yaml.safe_dump(config))
    return path


@pytest.fixture
def replicas(tmp_path: Path) -> Iterator[list[GatewayProcess]]:
    sim = ServerThread(create_sim_app(SimConfig(model="m", kv_tokens=8192))).start()
    try:
        with RedisProcess() as redis_proc:
            config = write_config(tmp_path / "gateway.yaml", sim.url)
            with gateways_running(config, 2, redis_url=redis_proc.url) as gateways:
                yield gateways
    finally:
        sim.stop()


def client(gateway: GatewayProcess, tenant_name: str) -> httpx.AsyncClient:
    headers = {"authorization": f"Bearer {KEYS[tenant_name]}"}
    return httpx.AsyncClient(base_url=gateway.url, headers=headers, timeout=60)


def test_a_critical_waiter_at_one_replica_stops_a_stream_another_runs(
    replicas: list[GatewayProcess],
) -> None:
    flooded, waiting = replicas

    async def scenario() -> tuple[list[Stream], Stream]:
        async with client(flooded, "bulk") as bulk, client(waiting, "vip") as vip:
            _, tasks = await one_by_one(bulk, SLOTS, max_tokens=STREAM_TOKENS)
            urgent = await stream(vip, Stream(), max_tokens=5)
            return list(await asyncio.gather(*tasks)), urgent

    flood, urgent = asyncio.run(scenario())
    assert urgent.done and urgent.error is None
    assert urgent.headers["x-spillgate-outcome"] == "queued"
    assert all(whole(s) for s in flood)
    assert [len(s.comments) for s in flood] == [0, 1]  # the newest, and only it
    assert flooded.metric("spillgate_preemptions_total", result="continued") == 1
    assert waiting.metric("spillgate_preemptions_total") == 0
