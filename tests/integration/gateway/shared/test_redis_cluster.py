"""Shared mode on a three-master Redis Cluster: the same scripts, keys co-located by hash
tag, no MOVED counted as a store failure. The limiter, the ledger, the response cache and
the queue wake-ups (published releases) all work as on one server."""

from __future__ import annotations

import asyncio
import secrets
from collections.abc import Iterator

import httpx
import openai
import pytest
from redis.asyncio.cluster import RedisCluster

from gateway.admission.ledger.shared import RedisLedger
from gateway.app import create_app
from gateway.clock import SystemClock
from gateway.config import parse_settings
from gateway.ratelimit import RedisRateLimiter, TenantLimits
from gateway.redis_io.batch import RedisBatcher
from gateway.shared.ledger_feed import ReleaseFeed
from loadtest.sim.app import create_sim_app
from loadtest.sim.config import SimConfig
from policies.cache.store import RedisResponseCache
from tests.support.batch import POOL, chat_line, submit, wait_status
from tests.support.cluster import redis_cluster
from tests.support.fleet import ADMIN_TOKEN, tenant
from tests.support.harness import ServerThread
from tests.support.metrics import text_sum

pytestmark = pytest.mark.skipif(
    __import__("shutil").which("redis-cli") is None, reason="redis-cli is not installed"
)


@pytest.fixture(scope="module")
def cluster() -> Iterator[str]:
    with redis_cluster() as ports:
        yield f"redis://127.0.0.1:{ports[0]}"


class Woken:
    def __init__(self) -> None:
        self.released: list[tuple[str, int]] = []

    def released_elsewhere(self, backend: str, tokens: int) -> None:
        self.released.append((backend, tokens))

    def wake_all(self) -> None:
        return None


def test_limiter_ledger_cache_and_wakeups_run_on_a_cluster(cluster: str) -> None:
    async def scenario() -> None:
        clients = [RedisCluster.from_url(cluster, socket_timeout=2) for _ in range(2)]
        batchers = [RedisBatcher(c) for c in clients]
        limiter = RedisRateLimiter(batchers[0], timeout_s=1.0, timeout_max_s=2.0)
        # tenants whose keys land on different masters, decided in one batch
        for name in ("a", "b", "c", "d", "e", "f"):
            limits = TenantLimits(tenant=name, requests_per_minute=3, tokens_per_minute=1000)
            decisions = await asyncio.gather(*(limiter.acquire(limits, 10) for _ in range(5)))
            assert [d.allowed for d in decisions] == [True] * 3 + [False] * 2
        opts = {"clock": SystemClock(), "timeout_s": 1.0, "timeout_max_s": 2.0}
        here, there = (RedisLedger(b, backends=["x", "y", "z"], **opts) for b in batchers)
        woken = Woken()
        feed = ReleaseFeed(clients[1], ledger=there, waker=woken, timeout_s=1.0)
        await here.start()
        await there.start()
        await feed.start()
        for _ in range(50):
            if feed.subscribed:
                break
            await asyncio.sleep(0.05)
        held = [await here.reserve(b, 100, limit=150) for b in ("x", "y", "z")]
        assert all(r is not None for r in held)
        assert await there.reserve("x", 100, limit=150) is None  # one budget, seen by both
        for reservation in held:
            assert reservation is not None
            await here.release(reservation)
        for _ in range(50):
            if len(woken.released) == 3:
                break
            await asyncio.sleep(0.05)
        # each block gives back its reservation and its spare
        assert sorted(b for b, _ in woken.released) == ["x", "y", "z"]
        assert all(tokens >= 100 for _, tokens in woken.released)
        assert (here.mode, there.mode) == ("shared", "shared")
        cache = RedisResponseCache(clients[0], namespace="pool", max_entries=2, ttl_s=30)
        for key in ("k1", "k2", "k3"):
            await cache.put(key, key.encode())
        assert [await cache.get(k) for k in ("k1", "k2", "k3")] == [None, b"k2", b"k3"]
        await feed.stop()
        for ledger in (here, there):
            await ledger.close()
        for batcher, client in zip(batchers, clients, strict=True):
            await batcher.aclose()
            await client.aclose()

    asyncio.run(scenario())


def test_batches_run_on_a_cluster(cluster: str) -> None:
    """The batch store lives on the cluster too: a batch is created, listed and run."""
    key = "sk-" + secrets.token_hex(8)
    sim = ServerThread(create_sim_app(SimConfig(model=POOL, kv_tokens=8192, no_delay=True)))
    with sim:
        settings = parse_settings(
            {
                "tenants": [tenant("acme", key)],
                "pools": [
                    {
                        "name": POOL,
                        "backends": [{"url": sim.url, "served_model": POOL, "capacity": 4096}],
                    }
                ],
                "redis": {"cluster": True},
            }
        )
        app = create_app(settings, environ={"SPILLGATE_ADMIN_TOKEN": ADMIN_TOKEN},
                         redis_url=cluster)  # fmt: skip
        with ServerThread(app) as gateway:
            api = openai.OpenAI(base_url=f"{gateway.url}/v1", api_key=key, max_retries=0)
            batch_id = submit(api, [chat_line("a")])
            assert [b.id for b in api.batches.list()] == [batch_id]
            assert wait_status(api, batch_id, within_s=30).status == "completed"


def test_a_gateway_pointed_at_one_node_shares_its_limits_through_the_cluster(
    cluster: str,
) -> None:
    key = "sk-" + secrets.token_hex(8)
    sim = ServerThread(create_sim_app(SimConfig(model="m", kv_tokens=8192, no_delay=True)))
    with sim:
        settings = parse_settings(
            {
                "tenants": [tenant("acme", key, requests_per_minute=1, request_burst=5)],
                "pools": [
                    {
                        "name": "big",
                        "backends": [{"url": sim.url, "served_model": "m", "capacity": 4096}],
                    }
                ],
                "redis": {"cluster": True},
            }
        )
        app = create_app(settings, environ={"SPILLGATE_ADMIN_TOKEN": ADMIN_TOKEN},
                         redis_url=cluster)  # fmt: skip
        with ServerThread(app) as gateway:
            headers = {"authorization": f"Bearer {key}"}
            body = {"model": "big", "messages": [{"role": "user", "content": "hi"}]}
            with httpx.Client(base_url=gateway.url, headers=headers, timeout=10) as client:
                statuses = [client.post("/v1/chat/completions", json=body).status_code
                            for _ in range(7)]  # fmt: skip
                metrics = client.get("/metrics").text
    assert statuses == [200] * 5 + [429] * 2
    assert text_sum(metrics, "spillgate_ratelimit_mode", mode="shared") == 1
    assert text_sum(metrics, "spillgate_ledger_mode", mode="shared") == 1
    assert text_sum(metrics, "spillgate_ratelimit_store_errors_total") == 0
    assert text_sum(metrics, "spillgate_ledger_store_errors_total") == 0
