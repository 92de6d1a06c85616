"""A Redis Cluster failover under load: what the clients of two gateway replicas see.

    spillgate bench failover [--node-timeout-ms 2000] [--rate 20] [--json FILE]

A private Redis Cluster of three masters with a replica each (loadtest/cluster.py,
`cluster-node-timeout` `--node-timeout-ms`), one simulated vLLM, and two `spillgate serve`
replicas sharing the cluster (`redis: {cluster: true}`, one node's URL, `failure_mode:
local`). Steady mixed load (streamed and unstreamed chats, `--rate` a second, alternating
between the replicas) runs throughout, for a tenant whose buckets live on the master that
is killed. Then, twice: that master is SIGKILLed (the first time the original master, the
second time the replica promoted in its place, the first one having been restarted and
rejoined as its replica); each replica's seconds from the kill until its limiter and
ledger are both shared again; and bursts of twice the limit for fresh 30/min tenants on the
same master: one before the kill, one right after it (each replica having heard that
tenant's level once before), one once both replicas are shared again.

Client-visible failures are every answer of the steady load or a burst that was neither
a 200 (whole: a stream ends with [DONE]) nor a 429. Figures go in BENCHMARKS.md ("Redis
Cluster failover").
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx

from gateway.config import hash_key
from loadtest.bench.admission_fleet import ADMIN_TOKEN, SimOptions, gateway, simulator
from loadtest.bench.machine import logs_dir, progress
from loadtest.cluster import NODE_TIMEOUT_MS, ClusterProcesses

PER_MINUTE = 30  # the bursting tenants' limit
RELEASES = "spillgate:ledger:released"  # the ledger's channel (gateway/admission/ledger/calls.py)
PHASES = ("before", "during", "after")


@dataclass
class Seen:
    """What the clients saw: answers by status, and every failure, described."""

    ok: int = 0
    throttled: int = 0
    failures: list[str] = field(default_factory=list)

    def add(self, status: int, *, whole: bool = True) -> bool:
        if status == 200 and whole:
            self.ok += 1
        elif status == 429:
            self.throttled += 1
        else:
            self.failures.append(f"{status}{'' if whole else ' cut'}")
        return status == 200 and whole


@dataclass
class Failover:
    promoted_s: float
    shared_s: list[float]
    admitted: dict[str, int]  # phase: admitted of a burst of 2 × PER_MINUTE


def key_of(name: str) -> str:
    return f"sk-bench-{name}"


def config(backend_url: str, model: str, steady: str, bursting: list[str]) -> dict[str, Any]:
    limits = {steady: 10**6, **dict.fromkeys(bursting, PER_MINUTE)}
    return {
        "tenants": [
            {
                "name": name,
                "key_sha256": hash_key(key_of(name)),
                "requests_per_minute": rpm,
                "tokens_per_minute": 10**9,
            }
            for name, rpm in limits.items()
        ],
        "pools": [
            {
                "name": model,
                "backends": [{"url": backend_url, "served_model": model, "capacity": "auto"}],
            }
        ],
        "redis": {"cluster": True, "timeout_ms": 250},
        "ratelimit": {"replicas": 2, "failure_mode": "local"},
    }


async def ask(
    client: httpx.AsyncClient, url: str, name: str, model: str, stream: bool, seen: Seen
) -> bool:
    body = {
        "model": model,
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 8,
        "stream": stream,
    }
    headers = {"authorization": f"Bearer {key_of(name)}"}
    try:
        async with client.stream(
            "POST", f"{url}/v1/chat/completions", json=body, headers=headers
        ) as answer:
            text = (await answer.aread()).decode(errors="replace")
            whole = not stream or answer.status_code != 200 or "data: [DONE]" in text
            return seen.add(answer.status_code, whole=whole)
    except httpx.HTTPError as exc:
        seen.failures.append(repr(exc))
        return False


async def burst(
    client: httpx.AsyncClient,
    urls: list[str],
    name: str,
    model: str,
    seen: Seen,
    count: int = 2 * PER_MINUTE,
) -> int:
    """`count` requests one after another, alternating between the replicas: admitted."""
    answers = [
        await ask(client, urls[i % len(urls)], name, model, stream=False, seen=seen)
        for i in range(count)
    ]
    return sum(answers)


async def steady_load(
    client: httpx.AsyncClient, urls: list[str], name: str, model: str, rate: float, seen: Seen
) -> None:
    """`rate` requests a second, streamed and not in turn, until cancelled."""
    pending: set[asyncio.Task[bool]] = set()
    try:
        for i in itertools.count():
            task = asyncio.create_task(
                ask(client, urls[i % len(urls)], name, model, stream=i % 2 == 0, seen=seen)
            )
            pending.add(task)
            task.add_done_callback(pending.discard)
            await asyncio.sleep(1 / rate)
    finally:
        if pending:
            await asyncio.wait(pending, timeout=30)


async def shared(client: httpx.AsyncClient, url: str) -> bool:
    headers = {"authorization": f"Bearer {ADMIN_TOKEN}"}
    status = (await client.get(f"{url}/admin/status", headers=headers)).json()["ratelimit"]
    metrics = (await client.get(f"{url}/metrics")).text
    ledger = 'spillgate_ledger_mode{mode="shared"} 1.0' in metrics
    return ledger and status["mode"] == "shared" and not status["degraded"]


async def seconds_to_shared(client: httpx.AsyncClient, url: str, since: float) -> float:
    while not await shared(client, url):
        if time.monotonic() - since > 120:
            return float("inf")
        await asyncio.sleep(0.05)
    return time.monotonic() - since


def promotion(cluster: ClusterProcesses, key: str, dead: int, since: float) -> float:
    """Seconds from `since` until a live master holds `key`'s slot (run in a thread)."""
    while cluster.master_of(key) == dead:
        time.sleep(0.05)
    return time.monotonic() - since


async def failover(
    cluster: ClusterProcesses,
    client: httpx.AsyncClient,
    urls: list[str],
    model: str,
    names: list[str],
    seen: Seen,
) -> Failover:
    """Kill the master of `names` (a tenant per phase) and measure the three bursts."""
    before, during, after = names
    victim = cluster.master_of(f"{{{before}}}")
    admitted = {"before": await burst(client, urls, before, model, seen)}
    heard = [await ask(client, url, during, model, False, seen) for url in urls]
    killed = time.monotonic()
    await asyncio.to_thread(cluster.kill, victim)
    promoted = asyncio.create_task(
        asyncio.to_thread(promotion, cluster, f"{{{during}}}", victim, killed)
    )
    admitted["during"] = sum(heard) + await burst(client, urls, during, model, seen)
    shared_s = list(await asyncio.gather(*(seconds_to_shared(client, u, killed) for u in urls)))
    admitted["after"] = await burst(client, urls, after, model, seen)
    promoted_s = await promoted
    progress(f"  promoted after {promoted_s:.1f} s; shared after {shared_s}; {admitted}")
    await asyncio.to_thread(cluster.restart, victim)
    await asyncio.to_thread(cluster.wait_healthy)
    return Failover(promoted_s=promoted_s, shared_s=shared_s, admitted=admitted)


async def drill(
    cluster: ClusterProcesses,
    urls: list[str],
    model: str,
    steady: str,
    bursting: list[str],
    rate: float,
) -> dict[str, Any]:
    seen, bursts = Seen(), Seen()
    limits = httpx.Limits(max_connections=256)
    async with httpx.AsyncClient(timeout=30, limits=limits) as client:
        load = asyncio.create_task(steady_load(client, urls, steady, model, rate, seen))
        await asyncio.sleep(2)
        results = []
        for round_ in range(2):
            progress(f"failover {round_ + 1}: the master killed" + (" (promoted)" * round_))
            names = bursting[3 * round_ : 3 * round_ + 3]
            results.append(await failover(cluster, client, urls, model, names, bursts))
        await asyncio.sleep(2)
        load.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await load
    return {
        "steady": {"ok": seen.ok, "throttled": seen.throttled, "failures": seen.failures},
        "bursts": {"failures": bursts.failures},
        "failovers": [asdict(r) for r in results],
    }


def report(result: dict[str, Any], args: argparse.Namespace) -> str:
    steady = result["steady"]
    failures = len(steady["failures"]) + len(result["bursts"]["failures"])
    lines = [
        f"Redis Cluster 3+3, cluster-node-timeout {args.node_timeout_ms} ms; 2 replicas; "
        f"steady load {args.rate:g}/s: {steady['ok']} served, {steady['throttled']} throttled",
        f"client-visible failures: {failures}",
        "",
        "| failover | promoted after (s) | shared again, replica 1 / 2 (s) | "
        + " | ".join(f"{p} (of {2 * PER_MINUTE})" for p in PHASES)
        + " |",
        "|---|---|---|" + "---|" * len(PHASES),
    ]
    for i, f in enumerate(result["failovers"]):
        which = "the master" if i == 0 else "the promoted replica"
        shared_s = " / ".join(f"{s:.1f}" for s in f["shared_s"])
        counts = " | ".join(str(f["admitted"][p]) for p in PHASES)
        lines.append(f"| {which} | {f['promoted_s']:.1f} | {shared_s} | {counts} |")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="spillgate bench failover",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--node-timeout-ms",
        type=int,
        default=NODE_TIMEOUT_MS,
        help="the cluster's cluster-node-timeout (default %(default)s)",
    )
    p.add_argument(
        "--rate", type=float, default=20.0, help="steady requests a second (default %(default)s)"
    )
    p.add_argument("--json", type=Path, help="write the figures here as JSON")
    p.add_argument("--logs", type=Path, help="keep the processes' output in this folder")
    args = p.parse_args(argv)
    with (
        logs_dir(args.logs, prefix="spillgate-failover-") as workdir,
        ClusterProcesses(masters=3, replicas=1, node_timeout_ms=args.node_timeout_ms) as cluster,
    ):
        # not the master the replicas subscribe to releases on: its failure reaches them
        # only through their script calls
        dead = next(m for m in cluster.masters() if m != cluster.master_of(RELEASES))
        steady, *bursting = cluster.tags_on(dead, 7, "t")
        with (
            simulator(SimOptions(speed=20.0), workdir=workdir) as backend,
            contextlib.ExitStack() as stack,
        ):
            settings = config(backend.url, backend.model, steady, bursting)
            urls = [
                stack.enter_context(
                    gateway(settings, workdir=workdir, arm=f"replica-{i}", redis_url=cluster.url)
                )
                for i in range(2)
            ]
            progress(f"cluster {cluster.url}, replicas {urls}")
            result = asyncio.run(drill(cluster, urls, backend.model, steady, bursting, args.rate))
    text = report(result, args)
    print(text)
    if args.json is not None:
        args.json.write_text(json.dumps(result, indent=2))
    failures = len(result["steady"]["failures"]) + len(result["bursts"]["failures"])
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
