"""Three gateway processes, one Redis: they fill the fleet as one gateway would, never past it.

The same spike through three processes with local ledgers over-fills every backend: each
process sees only its own reservations. The shared fleet is started once for the module
(process start-up dominates on a small machine); its tests run in order and each leaves
nothing reserved, the kill -9 last.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import redis

from loadtest.procs import RedisProcess
from tests.support.replica import (
    KEY,
    KV_TOKENS,
    LEASE_TTL_S,
    TARGET_FILL,
    Answer,
    GatewayProcess,
    ServerThread,
    backend_stats,
    fleet,
    spike,
    stream,
    until,
)

SLACK_S = 1.0  # a refresh, a loaded two-core machine


@dataclass
class Shared:
    redis: RedisProcess
    gateways: list[GatewayProcess]
    sims: list[ServerThread]


@pytest.fixture(scope="module")
def shared(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Shared]:
    with RedisProcess() as redis_proc:
        tmp = tmp_path_factory.mktemp("replicas")
        with fleet(tmp, redis_url=redis_proc.url) as (gateways, sims):
            yield Shared(redis=redis_proc, gateways=gateways, sims=sims)


def nothing_reserved(gateways: list[GatewayProcess]) -> bool:
    return all(v == (0, 0) for g in gateways for v in g.reserved().values())


def ledger_keys(redis_proc: RedisProcess) -> int:
    """Leases still stored in Redis, over every backend."""
    client = redis.Redis.from_url(redis_proc.url, socket_timeout=5)
    try:
        return sum(int(client.zcard(key)) for key in client.scan_iter("spillgate:ledger:*:leases"))
    finally:
        client.close()


def test_three_gateways_on_one_ledger_never_overfill_a_backend(shared: Shared) -> None:
    gateways, redis_proc = shared.gateways, shared.redis
    answers = asyncio.run(spike([g.url for g in gateways], 60, max_tokens=90))
    stats = [backend_stats(s) for s in shared.sims]
    until(lambda: nothing_reserved(gateways), within_s=SLACK_S, what="reservations freed")
    assert [a for a in answers if a.status != 200 or not a.complete] == []
    assert any(a.outcome == "queued" for a in answers)  # the spike was bigger than the fleet
    for s in stats:
        assert s["sim_kv_capacity_tokens"] == KV_TOKENS
        assert s["vllm:num_preemptions_total"] == 0
        assert KV_TOKENS * TARGET_FILL * 0.6 < s["sim_peak_reserved_tokens"] <= KV_TOKENS
    until(lambda: ledger_keys(redis_proc) == 0, within_s=SLACK_S, what="idle blocks gone")


def test_three_gateways_with_local_ledgers_overfill_the_same_backends(tmp_path: Path) -> None:
    with fleet(tmp_path, redis_url=None) as (gateways, sims):
        asyncio.run(spike([g.url for g in gateways], 60, max_tokens=90))
        stats = [backend_stats(s) for s in sims]
    assert max(s["sim_peak_reserved_tokens"] for s in stats) > KV_TOKENS
    assert sum(s["vllm:num_preemptions_total"] for s in stats) > 0


def test_gateways_keep_answering_through_a_redis_restart_and_recover(shared: Shared) -> None:
    redis_proc, gateways = shared.redis, shared.gateways
    answers: list[tuple[float, Answer]] = []
    load = threading.Thread(
        target=lambda: answers.extend(steady_load([g.url for g in gateways], seconds=3.5))
    )
    load.start()
    time.sleep(1.0)
    redis_proc.stop()
    went_down = time.monotonic()
    time.sleep(1.0)
    down = [g.metric("spillgate_ledger_mode", mode="local") for g in gateways]
    came_up = time.monotonic()
    redis_proc.start()
    load.join(timeout=30)
    until(
        lambda: all(g.metric("spillgate_ledger_mode", mode="shared") == 1 for g in gateways),
        within_s=5,
        what="every gateway back on the shared ledger",
    )
    until(lambda: nothing_reserved(gateways), within_s=SLACK_S, what="reservations freed")
    errors = [g.metric("spillgate_ledger_store_errors_total") for g in gateways]
    stats = [backend_stats(s) for s in shared.sims]
    # every request was answered whole, those sent while Redis was down among them (how many
    # fit in 3.5 s depends on the machine: 54-74 alone, 16 beside the rest of the suite)
    assert len(answers) >= 18
    assert [a for _, a in answers if a.status != 200 or not a.complete] == []
    assert any(went_down <= sent < came_up for sent, _ in answers)
    assert down == [1, 1, 1]
    assert all(e > 0 for e in errors)
    for s in stats:
        assert s["vllm:num_preemptions_total"] == 0
        assert s["sim_peak_reserved_tokens"] <= KV_TOKENS
    until(lambda: ledger_keys(redis_proc) == 0, within_s=SLACK_S, what="idle blocks gone")


def test_a_killed_replica_frees_its_reservations_within_the_lease_ttl(shared: Shared) -> None:
    redis_proc = shared.redis
    a, b, doomed = shared.gateways
    cut: list[BaseException] = []
    doomed_streams = threading.Thread(target=lambda: cut.extend(streams_cut([doomed.url])))
    doomed_streams.start()
    until(lambda: big_leases(redis_proc) == 2, within_s=5, what="both backends held")
    doomed.kill()
    killed_at = time.monotonic()
    served: list[Answer] = []
    others = threading.Thread(
        target=lambda: served.extend(asyncio.run(spike([a.url, b.url], 12, max_tokens=40)))
    )
    others.start()
    assert big_leases(redis_proc) == 2  # a dead holder's leases live on until their TTL
    until(
        lambda: big_leases(redis_proc) == 0,
        within_s=LEASE_TTL_S + SLACK_S,
        what="the dead replica's leases expired",
    )
    freed_after = time.monotonic() - killed_at
    others.join(timeout=20)
    doomed_streams.join(timeout=10)
    until(lambda: nothing_reserved([a, b]), within_s=SLACK_S, what="reservations freed")
    stats = [backend_stats(s) for s in shared.sims]
    assert freed_after > LEASE_TTL_S / 2  # renewed every third of the TTL until the kill
    assert len(cut) == 2 and all(isinstance(e, httpx.RemoteProtocolError) for e in cut)
    assert len(served) == 12
    assert [x for x in served if x.status != 200 or not x.complete] == []
    assert all(s["vllm:num_preemptions_total"] == 0 for s in stats)
    assert all(s["sim_reserved_tokens"] == 0 for s in stats)
    until(lambda: ledger_keys(redis_proc) == 0, within_s=SLACK_S, what="idle blocks gone")


def streams_cut(urls: list[str]) -> list[BaseException]:
    """Two long streams through the replica about to be killed: how each one ended."""

    async def one(client: httpx.AsyncClient) -> BaseException | None:
        try:
            await stream(client, urls[0], 700)
        except httpx.HTTPError as exc:
            return exc
        return None

    async def both() -> list[BaseException]:
        headers = {"authorization": f"Bearer {KEY}"}
        async with httpx.AsyncClient(headers=headers, timeout=30) as client:
            ended = await asyncio.gather(one(client), one(client))
        return [e for e in ended if e is not None]

    return asyncio.run(both())


def big_leases(redis_proc: RedisProcess) -> int:
    """Leases in Redis holding 700 tokens or more: the doomed replica's long streams."""
    client = redis.Redis.from_url(redis_proc.url, socket_timeout=5)
    try:
        return sum(
            int(v) >= 700
            for key in client.scan_iter("spillgate:ledger:*:tokens")
            for v in client.hvals(key)
        )
    finally:
        client.close()


def steady_load(urls: list[str], *, seconds: float) -> list[tuple[float, Answer]]:
    """18 clients streaming back to back, each through one gateway, for `seconds` and at
    least once each; every answer comes with the moment its request was sent."""

    async def client_loop(
        client: httpx.AsyncClient, url: str, until_t: float, out: list[tuple[float, Answer]]
    ) -> None:
        while True:
            sent = time.monotonic()
            out.append((sent, await stream(client, url, 60)))
            if time.monotonic() >= until_t:
                return

    async def run() -> list[tuple[float, Answer]]:
        out: list[tuple[float, Answer]] = []
        until_t = time.monotonic() + seconds
        headers = {"authorization": f"Bearer {KEY}"}
        async with httpx.AsyncClient(headers=headers, timeout=30) as client:
            await asyncio.gather(
                *(client_loop(client, urls[i % len(urls)], until_t, out) for i in range(18))
            )
        return out

    return asyncio.run(run())
