"""Shared prompt blocks across replicas: each replica counts a prompt its requests hold on a
backend once, Redis sums the replicas, and a replica killed mid-stream lets go of its holds
when its lease expires.

Two `spillgate serve` processes on one Redis, one simulated vLLM (prefix caching on) whose
capacity they discover; the figures are worked out in tests/support/shared_prompt.py. With
two replicas each holding two siblings, the fleet's ledger holds the prompt twice: one copy
too many, against two too many if every request counted it.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterator
from contextlib import AsyncExitStack
from pathlib import Path

import pytest
import yaml

from gateway.config import hash_key
from loadtest.procs import RedisProcess
from loadtest.sim.app import create_sim_app
from loadtest.sim.config import SimConfig
from tests.support.harness import ServerThread
from tests.support.replica import KEY, LEASE_TTL_S, GatewayProcess, start_gateways
from tests.support.shared_prompt import NEED, SHARED, SLOW_STEPS, streaming

SLACK_S = 1.5  # a refresh, a loaded two-core machine
SIBLINGS = 2 * NEED - SHARED  # two requests of one prompt on one backend


@pytest.fixture
def replicas(tmp_path: Path) -> Iterator[list[GatewayProcess]]:
    sim = SimConfig(model="m", kv_tokens=32_768, block_size=16, step_cost=SLOW_STEPS)
    backend = ServerThread(create_sim_app(sim)).start()
    config = {
        "tenants": [{"name": "acme", "key_sha256": hash_key(KEY)}],
        "pools": [
            {
                "name": "m",
                "backends": [{"url": backend.url, "served_model": "m", "capacity": "auto"}],
                "target_fill": 0.9,
                "reservation": {"mode": "max_tokens"},
                "feedback": False,
                "overflow": ["reject"],
            }
        ],
        "redis": {"timeout_ms": 250},
        "ratelimit": {"replicas": 2},
        "ledger": {"lease_ttl_s": LEASE_TTL_S, "refresh_s": 0.1},
    }
    path = tmp_path / "gateway.yaml"
    path.write_text(yaml.safe_dump(config))
    try:
        with RedisProcess() as redis_proc:
            gateways = start_gateways(path, 2, redis_url=redis_proc.url)
            try:
                yield gateways
            finally:
                for gateway in gateways:
                    gateway.stop()
    finally:
        backend.stop()


def in_flight(gateway: GatewayProcess) -> tuple[int, int]:
    ((tokens, sessions),) = gateway.reserved().values()
    return tokens, sessions


async def until(seen: Callable[[], tuple[int, int]], expected: tuple[int, int]) -> float:
    """Seconds until `seen()` is `expected`."""
    started = time.monotonic()
    while (now := seen()) != expected:
        waited = time.monotonic() - started
        assert waited < LEASE_TTL_S + SLACK_S, f"in flight {now}, expected {expected}"
        await asyncio.sleep(0.05)
    return time.monotonic() - started


def test_each_replica_counts_a_shared_prompt_once_and_a_killed_one_lets_go(
    replicas: list[GatewayProcess],
) -> None:
    a, doomed = replicas

    async def run() -> None:
        async with AsyncExitStack() as on_a, AsyncExitStack() as on_doomed:
            for question in ("q1", "q2"):
                await on_a.enter_async_context(streaming(a.url, KEY, question))
                await on_doomed.enter_async_context(streaming(doomed.url, KEY, question + "'"))
            # each replica's two siblings hold the prompt once: twice in the fleet's ledger
            await until(lambda: in_flight(a), (2 * SIBLINGS, 4))
            await until(lambda: in_flight(doomed), (2 * SIBLINGS, 4))
            doomed.kill()
            # its holds live on until its lease expires, then go with it
            freed_after = await until(lambda: in_flight(a), (SIBLINGS, 2))
            assert freed_after > LEASE_TTL_S / 3  # renewed until the kill
        await until(lambda: in_flight(a), (0, 0))

    asyncio.run(run())
