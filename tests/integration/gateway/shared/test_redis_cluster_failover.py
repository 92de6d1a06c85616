"""Shared mode rides out a Redis Cluster failover: a master SIGKILLed, its replica promoted,
then the promoted master killed in turn. The batcher follows the slot map to the promoted
replica (it does not keep sending to a dead address), only the dead master's tenants are
answered locally meanwhile, starting from what each replica last heard, and both
replicas are back to shared soon after the promotion, their limits exact across it.

One cluster of three masters with a replica each serves the module; each test leaves it
healthy (a killed node restarted, rejoined as a replica)."""

from __future__ import annotations

import asyncio
import secrets
import shutil
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest
import yaml
from redis.asyncio.cluster import RedisCluster
from redis.crc import key_slot

from gateway.clock import SystemClock
from gateway.ratelimit import (
    LocalRateLimiter,
    RedisRateLimiter,
    ResilientRateLimiter,
    TenantLimits,
)
from gateway.redis_io.batch import RedisBatcher
from loadtest.cluster import ClusterProcesses
from loadtest.sim.app import create_sim_app
from loadtest.sim.config import SimConfig
from tests.support.fleet import admin_status, tenant
from tests.support.harness import ServerThread
from tests.support.metrics import metric_sum
from tests.support.replica import GatewayProcess, start_gateways

pytestmark = pytest.mark.skipif(shutil.which("redis-cli") is None, reason="no redis-cli")

NODE_TIMEOUT_MS = 1000
# what the gateway may add to the cluster's own failover: its probe (every second) and
# the slot map's pacing, with slack for a two-core machine running four test workers
# (`spillgate bench failover` measures the figure itself); before, never within 30 s
SHARED_AGAIN_S = 5.0
PROMOTED_WITHIN_S = 15.0


@pytest.fixture(scope="module")
def cluster() -> Iterator[ClusterProcesses]:
    with ClusterProcesses(masters=3, replicas=1, node_timeout_ms=NODE_TIMEOUT_MS) as c:
        yield c


class Promotion:
    """Watches, from the moment it is made, for a live master to hold `key`'s slot in place
    of `dead`."""

    def __init__(self, cluster: ClusterProcesses, key: str, dead: int) -> None:
        self._started = time.monotonic()
        self._at: float | None = None
        self._thread = threading.Thread(target=self._watch, args=(cluster, key, dead))
        self._thread.start()

    def _watch(self, cluster: ClusterProcesses, key: str, dead: int) -> None:
        while time.monotonic() - self._started < PROMOTED_WITHIN_S:
            if cluster.master_of(key) != dead:
                self._at = time.monotonic() - self._started
                return
            time.sleep(0.05)

    def after_s(self) -> float:
        """Seconds from the kill to the promotion."""
        self._thread.join()
        assert self._at is not None, "no replica was promoted"
        return self._at


def heal(cluster: ClusterProcesses, port: int) -> None:
    """Restart a killed node: it rejoins as the replica of the master that took its slots."""
    cluster.restart(port)
    cluster.wait_healthy()


def test_the_batcher_follows_a_promoted_replica_and_fails_only_the_dead_slots(
    cluster: ClusterProcesses,
) -> None:
    dead = cluster.master_of("{acme}")
    on_dead, on_alive = (
        TenantLimits(tenant=t, requests_per_minute=10**6, tokens_per_minute=10**9)
        for t in (
            cluster.tags_on(dead, 1, "d")[0],
            cluster.tags_on(dead, 1, "a", on=False)[0],
        )
    )

    async def scenario() -> tuple[list[float], list[tuple[float, str]], int, float, float]:
        client = RedisCluster.from_url(cluster.url, socket_timeout=1, socket_connect_timeout=1)
        batcher = RedisBatcher(client)
        limiter = RedisRateLimiter(batcher)
        assert (await limiter.acquire(on_dead, 1)).allowed
        # a replica that decides once, then only probes; `shared` set while its mode is
        shared = asyncio.Event()
        idle = await idle_replica(cluster.url, shared)
        assert (await idle.acquire(on_dead, 1)).allowed
        cluster.kill(dead)
        killed = time.monotonic()
        promotion = Promotion(cluster, "{acme}", dead)
        await idle.acquire(on_dead, 1)  # its master gone: answered by the replica's share
        assert [d.tenant for d in idle.degraded()] == [on_dead.tenant]
        assert idle.mode == "local"
        elsewhere: list[tuple[float, str]] = []  # the live masters' failures
        answered_at: list[float] = []
        while time.monotonic() - killed < PROMOTED_WITHIN_S:
            there, here = await asyncio.gather(
                limiter.acquire(on_dead, 1), limiter.acquire(on_alive, 1), return_exceptions=True
            )
            if isinstance(here, BaseException):
                elsewhere.append((time.monotonic() - killed, str(here)))
            if not isinstance(there, BaseException):
                answered_at.append(time.monotonic() - killed)
                if len(answered_at) == 20:
                    break
            await asyncio.sleep(0.02)
        reads = batcher.slot_map_reads
        await asyncio.wait_for(shared.wait(), timeout=PROMOTED_WITHIN_S)
        idle_shared = time.monotonic() - killed
        assert idle.degraded() == []
        await idle.close()
        await batcher.aclose()
        await client.aclose()
        promoted = await asyncio.to_thread(promotion.after_s)
        return answered_at, elsewhere, reads, promoted, idle_shared

    answered_at, elsewhere, reads, promoted, idle_shared = asyncio.run(scenario())
    try:
        # the live masters' slots failed only while the cluster said it was down (a master
        # marked failed, its replica not yet promoted: cluster-require-full-coverage)
        assert all("cluster is down" in error for _, error in elsewhere), elsewhere
        assert all(at < promoted + 0.5 for at, _ in elsewhere), (elsewhere, promoted)
        assert len(answered_at) == 20, "the dead master's slots never answered again"
        # answered from the promoted replica soon after the promotion, and then every time
        assert answered_at[0] < promoted + SHARED_AGAIN_S
        # the map is read again at most every SLOT_MAP_MIN_S while the master is away
        assert 1 <= reads <= promoted / 0.2 + 3, (reads, promoted)
        # the idle replica's probe found the promoted replica on its own
        assert idle_shared < promoted + SHARED_AGAIN_S, (idle_shared, promoted)
    finally:
        heal(cluster, dead)


async def idle_replica(url: str, shared: asyncio.Event) -> ResilientRateLimiter:
    """A replica's limiter on a client of its own, probing every PROBE_S while degraded;
    `shared` is set while its mode is "shared"."""
    client = RedisCluster.from_url(url, socket_timeout=1, socket_connect_timeout=1)
    clock = SystemClock()
    limiter = ResilientRateLimiter(
        RedisRateLimiter(RedisBatcher(client), timeout_s=0.25, timeout_max_s=1.0),
        fallback=LocalRateLimiter(clock),
        failure_mode="local",
        replicas=2,
        timeout_s=0.25,
        timeout_max_s=1.0,
        failure_threshold=3,
        cooldown_s=5.0,
        clock=clock,
        on_store_error=lambda: None,
        on_mode_change=lambda mode: shared.set() if mode == "shared" else shared.clear(),
    )
    await limiter.start()
    return limiter


@dataclass
class Load:
    """Steady requests for a tenant through both gateways, counting what clients saw."""

    gateways: list[GatewayProcess]
    key: str
    per_s: float = 20.0
    statuses: dict[int, int] = field(default_factory=dict)
    errors: list[str] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)

    def run(self) -> None:
        clients = [_client(g, self.key) for g in self.gateways]
        i = 0
        while not self._stop.is_set():
            try:
                status = clients[i % len(clients)].post("/v1/chat/completions", json=CHAT)
                self.statuses[status.status_code] = self.statuses.get(status.status_code, 0) + 1
            except httpx.HTTPError as exc:
                self.errors.append(repr(exc))
            i += 1
            time.sleep(1 / self.per_s)
        for c in clients:
            c.close()

    def __enter__(self) -> Load:
        self._thread = threading.Thread(target=self.run, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=30)


BATCHES = "{spillgate:batch}"  # the batch store's hash tag (gateway/batch/store.py)
RELEASES = "spillgate:ledger:released"  # the ledger's channel (gateway/admission/ledger/calls.py)
CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


def _client(gateway: GatewayProcess, key: str) -> httpx.Client:
    return httpx.Client(
        base_url=gateway.url, headers={"authorization": f"Bearer {key}"}, timeout=30
    )


def admitted(gateways: list[GatewayProcess], key: str, count: int) -> int:
    """A burst of `count` requests, alternating between the gateways: how many got a 200."""
    clients = [_client(g, key) for g in gateways]
    try:
        codes = [
            clients[i % len(clients)].post("/v1/chat/completions", json=CHAT).status_code
            for i in range(count)
        ]
    finally:
        for c in clients:
            c.close()
    assert set(codes) <= {200, 429}, codes
    return codes.count(200)


def ratelimit_shared(gateway: GatewayProcess) -> bool:
    status = admin_status(gateway.url, timeout=5)["ratelimit"]
    return status["mode"] == "shared" and status["degraded"] == []


def shared_again(gateways: list[GatewayProcess], since: float) -> list[float]:
    """Seconds from `since` until each gateway's limiter and ledger are shared again."""
    at: dict[int, float] = {}
    while len(at) < len(gateways) and time.monotonic() - since < 30:
        for i, g in enumerate(gateways):
            if i not in at and ratelimit_shared(g) and metric_sum(
                g.url, "spillgate_ledger_mode", mode="shared"
            ) == 1:  # fmt: skip
                at[i] = time.monotonic() - since
        time.sleep(0.05)
    assert len(at) == len(gateways), f"not shared again: {at}"
    return [at[i] for i in range(len(gateways))]


def test_two_replicas_ride_out_a_master_killed_and_then_its_promoted_replica(
    cluster: ClusterProcesses, tmp_path: Path
) -> None:
    # not the master the replicas subscribe to releases on: its failure reaches them only
    # through their script calls (a subscription's repair would read the slot map anyway)
    # the batch store's, when it can be
    releases, batches = cluster.master_of(RELEASES), cluster.master_of(BATCHES)
    dead = batches if batches != releases else next(p for p in cluster.masters() if p != releases)
    # 30/min, heard by each replica once; 120/min, drained: both on the master killed
    tight = dict(zip(cluster.tags_on(dead, 2, "t"), (30, 120), strict=True))
    steady = cluster.tags_on(dead, 1, "s")[0]  # the load, on it too
    keys = {name: "sk-" + secrets.token_hex(8) for name in (steady, *tight)}
    sim = ServerThread(create_sim_app(SimConfig(model="m", kv_tokens=65536, no_delay=True)))
    with sim:
        config = {
            "tenants": [
                tenant(steady, keys[steady], requests_per_minute=10**5, tokens_per_minute=10**8),
                *(
                    tenant(t, keys[t], requests_per_minute=rpm, tokens_per_minute=10**6)
                    for t, rpm in tight.items()
                ),
            ],
            "pools": [
                {
                    "name": "m",
                    "backends": [{"url": sim.url, "served_model": "m", "capacity": 60000}],
                }
            ],
            "redis": {"cluster": True, "timeout_ms": 250},
            "ratelimit": {"replicas": 2, "failure_mode": "local"},
        }
        path = tmp_path / "gateway.yaml"
        path.write_text(yaml.safe_dump(config))
        gateways = start_gateways(path, 2, redis_url=cluster.url)
        try:
            since = time.monotonic()
            heard, drained = tight
            before = {
                heard: [admitted([g], keys[heard], 1) for g in gateways].count(1),
                drained: admitted(gateways, keys[drained], tight[drained] * 5 // 4),
            }
            last_heard = time.monotonic()
            with Load(gateways, keys[steady]) as load:
                for name in tight:  # the master, then the replica promoted in its place
                    burst = Burst(name, keys[name], per_minute=tight[name], before=before[name])
                    ride_out(cluster, gateways, burst, since=since, heard=last_heard)
            assert load.errors == []
            assert set(load.statuses) == {200}, load.statuses
            assert sum(load.statuses.values()) > 100
        finally:
            for g in gateways:
                g.stop()


@dataclass(frozen=True)
class Burst:
    """A tenant burst at during a failover: its limit, and what it was admitted before."""

    name: str
    key: str
    per_minute: int
    before: int


def ride_out(
    cluster: ClusterProcesses,
    gateways: list[GatewayProcess],
    burst: Burst,
    *,
    since: float,
    heard: float,
) -> None:
    """Kill the master of the burst's tenant during a burst, then burst again once both
    replicas are shared: `before` were admitted since `since`, its level last heard at
    `heard`. Leaves the cluster healthy."""
    victim = cluster.master_of(f"{{{burst.name}}}")
    killed = time.monotonic()
    cluster.kill(victim)
    promotion = Promotion(cluster, f"{{{burst.name}}}", victim)
    rate = burst.per_minute / 60
    left = burst.per_minute - burst.before + (killed - heard) * rate
    # short enough to end before the promotion: all of it answered by the replicas' shares
    during = admitted(gateways, burst.key, int(min(burst.per_minute, left)) + 10)
    # each replica names the tenant it answers on its own, and the tenant's slot
    for g in gateways:
        status = admin_status(g.url, timeout=5)["ratelimit"]
        assert {"tenant": burst.name, "slot": key_slot(f"{{{burst.name}}}".encode())} in [
            {"tenant": d["tenant"], "slot": d["slot"]} for d in status["degraded"]
        ], status
        assert metric_sum(g.url, "spillgate_ratelimit_degraded_tenants") >= 1
    back = shared_again(gateways, killed)
    promoted = promotion.after_s()
    for g in gateways:  # the batch store follows the failover too
        with _client(g, burst.key) as client:
            assert client.get("/v1/batches").status_code == 200
    after = admitted(gateways, burst.key, burst.per_minute * 2)
    seen = (during, after, back, promoted)
    # the shares started from what each replica heard plus the refill since, not from 0
    assert during >= min(burst.per_minute, left) - 3, seen
    # and all told the bucket and its refill, not more: what the shares admitted was owed
    refill = (time.monotonic() - since) * rate
    total = burst.before + during + after
    assert burst.per_minute + refill - 3 <= total <= burst.per_minute + refill + 2, seen
    assert max(back) < promoted + SHARED_AGAIN_S, seen
    heal(cluster, victim)
