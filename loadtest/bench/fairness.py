"""`spillgate bench fairness`: a flood never locks a light tenant out, and a higher class
goes first on every replica (issue 42's cases), on the simulator.

- door: one gateway, a heavy tenant keeping more requests outstanding than the pool runs
  and its queue holds, past `max_depth` (`door-depth`) or past `max_tokens`
  (`door-tokens`); a light tenant of the same class sends a small request every
  `--light-every` seconds. Figures: the light tenant's refusals and TTFT, the heavy
  tenant's refusals and their codes, the waiters pushed out.
- classes: a `critical` tenant floods through two replicas of three on one Redis (or the
  one gateway) while a `standard` tenant sends small requests through the third. Figure:
  the standard requests served while critical ones wait.
- light: a heavy tenant floods through one replica (or the one gateway); the light tenant
  sends to that replica and to another. Figures: its TTFT p50/p90 on each, against its
  TTFT with no flood, and the streams the backend ran meanwhile.

Each case runs `--runs` times; the report gives each figure's median over the runs.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import statistics
import sys
import time
from collections.abc import Awaitable, Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import httpx

from gateway.admission.fleet.metrics_text import samples, values
from gateway.config import hash_key
from loadtest.bench.admission_fleet import SimOptions, gateway, simulator
from loadtest.bench.machine import logs_dir, print_targets, progress
from loadtest.percentile import percentile_or_nan
from loadtest.procs import RedisProcess

SLOTS = 12  # heavy requests the pool runs at once: each reserves two blocks of 16
BLOCK = 16
DEPTH = 16
TENANTS = {"heavy": "standard", "light": "standard", "vip": "critical", "std": "standard"}


def key(tenant: str) -> str:
    return f"sk-bench-fairness-{tenant}"


def config(backend: str, *, queue: dict[str, Any], replicas: int) -> dict[str, Any]:
    tenants = [
        {
            "name": name,
            "key_sha256": hash_key(key(name)),
            "priority": priority,
            "requests_per_minute": 1_000_000,
            "tokens_per_minute": 1_000_000_000,
        }
        for name, priority in TENANTS.items()
    ]
    pool = {
        "name": "m",
        "backends": [{"url": backend, "served_model": "sim", "capacity": SLOTS * 2 * BLOCK}],
        "target_fill": 1.0,
        "overflow": ["queue", "reject"],
        "queue": queue,
        # what each request holds is known exactly: its prompt and its whole max_tokens
        "reservation": {"mode": "max_tokens"},
    }
    shared: dict[str, Any] = {}
    if replicas > 1:
        shared = {
            "redis": {"timeout_ms": 250},
            "ratelimit": {"replicas": replicas},
            "ledger": {"refresh_s": 0.1},
        }
    return {"tenants": tenants, "pools": [pool], **shared}


@contextlib.contextmanager
def fleet(
    args: argparse.Namespace, workdir: Path, *, replicas: int, queue: dict[str, Any]
) -> Iterator[tuple[str, list[str]]]:
    """The simulator's URL and `replicas` gateways in front of it (on one Redis if several)."""
    options = SimOptions(kv_tokens=8192, block_size=BLOCK, speed=args.sim_speed)
    with contextlib.ExitStack() as stack:
        sim = stack.enter_context(simulator(options, workdir=workdir))
        redis = stack.enter_context(RedisProcess()).url if replicas > 1 else None
        cfg = config(sim.url, queue=queue, replicas=replicas)
        urls = [
            stack.enter_context(gateway(cfg, workdir=workdir, arm=f"r{i}", redis_url=redis))
            for i in range(replicas)
        ]
        yield sim.url, urls


def body(tenant: str, max_tokens: int) -> dict[str, Any]:
    return {
        "model": "m",
        "messages": [{"role": "user", "content": tenant}],
        "max_tokens": max_tokens,
        "stream": True,
    }


class Sender:
    """Streams requests as one tenant and records each answer's status, code and TTFT."""

    def __init__(self, client: httpx.AsyncClient, tenant: str) -> None:
        self.client, self.tenant = client, tenant
        self.headers = {"authorization": f"Bearer {key(tenant)}"}
        self.answers: list[tuple[int, str, float]] = []  # status, error code, TTFT (s)

    async def send(self, url: str, max_tokens: int) -> tuple[int, float]:
        started = time.monotonic()
        ttft, code = float("nan"), ""
        request = self.client.build_request(
            "POST", f"{url}/v1/chat/completions", json=body(self.tenant, max_tokens),
            headers=self.headers,
        )  # fmt: skip
        response = await self.client.send(request, stream=True)
        try:
            if response.status_code == 200:
                async for _ in response.aiter_bytes():
                    if ttft != ttft:
                        ttft = time.monotonic() - started
            else:
                await response.aread()
                code = response.json().get("error", {}).get("code", "")
        finally:
            await response.aclose()
        self.answers.append((response.status_code, code, ttft))
        retry = float(response.headers.get("retry-after", 0) or 0)
        return response.status_code, retry

    def served(self) -> int:
        return sum(status == 200 for status, _, _ in self.answers)

    def refused(self) -> int:
        return sum(status != 200 for status, _, _ in self.answers)

    def ttft_ms(self, q: float) -> float:
        return 1000 * percentile_or_nan([t for s, _, t in self.answers if s == 200], q)


@contextlib.asynccontextmanager
async def flood(sender: Sender, urls: Sequence[str], *, in_flight: int, max_tokens: int) -> Any:
    """`in_flight` requests outstanding, dealt over `urls`; a refused one waits its
    Retry-After (at most 1 s), as a well-behaved client does."""

    async def one(i: int) -> None:
        while True:
            status, retry = await sender.send(urls[i % len(urls)], max_tokens)
            if status != 200:
                await asyncio.sleep(min(1.0, retry))

    tasks = [asyncio.create_task(one(i)) for i in range(in_flight)]
    try:
        await asyncio.sleep(1.0)  # the pool fills and the queue with it
        yield
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def every(send: Callable[[], Awaitable[Any]], *, every_s: float, count: int) -> None:
    """`count` calls of `send`, one started every `every_s` seconds (never two at once)."""
    start = time.monotonic()
    for i in range(count):
        await send()
        await asyncio.sleep(max(0.0, start + (i + 1) * every_s - time.monotonic()))


async def running_streams(client: httpx.AsyncClient, sim: str, until: asyncio.Event) -> float:
    """The mean of the backend's running requests, sampled every 0.1 s until `until`."""
    seen = []
    while not until.is_set():
        text = (await client.get(f"{sim}/metrics")).text
        seen += values(samples(text), "vllm:num_requests_running")
        await asyncio.sleep(0.1)
    return statistics.fmean(seen) if seen else float("nan")


def metric(url: str, name: str, **labels: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    return sum(values(samples(text), name, **labels))


async def door(args: argparse.Namespace, urls: list[str], *, light_tokens: int) -> dict[str, Any]:
    """The heavy tenant floods past the queue's bound; the light one sends requests of
    `light_tokens` max_tokens."""
    limits = httpx.Limits(max_connections=400, max_keepalive_connections=400)
    async with httpx.AsyncClient(timeout=60, limits=limits) as client:
        heavy, light = Sender(client, "heavy"), Sender(client, "light")
        async with flood(heavy, urls, in_flight=SLOTS + DEPTH + args.surplus, max_tokens=26):
            await every(
                lambda: light.send(urls[0], light_tokens),
                every_s=args.light_every,
                count=args.light_count,
            )
    codes = [c for s, c, _ in heavy.answers if s != 200]
    return {
        "light_sent": len(light.answers),
        "light_refused": light.refused(),
        "light_ttft_p50_ms": light.ttft_ms(50),
        "heavy_refused": heavy.refused(),
        "heavy_refused_queue_full": codes.count("queue_full"),
        "displaced": metric(urls[0], "spillgate_queue_displaced_total", tenant="heavy"),
    }


async def classes(args: argparse.Namespace, urls: list[str]) -> dict[str, Any]:
    limits = httpx.Limits(max_connections=400, max_keepalive_connections=400)
    flooded = urls[:2] if len(urls) > 1 else urls
    async with httpx.AsyncClient(timeout=60, limits=limits) as client:
        vip, std = Sender(client, "vip"), Sender(client, "std")
        async with flood(vip, flooded, in_flight=SLOTS + DEPTH + args.surplus, max_tokens=26):
            await every(
                lambda: std.send(urls[-1], 2), every_s=args.light_every, count=args.light_count
            )
    return {
        "standard_sent": len(std.answers),
        "standard_served": std.served(),
        "critical_served": vip.served(),
    }


async def light(args: argparse.Namespace, sim: str, urls: list[str]) -> dict[str, Any]:
    limits = httpx.Limits(max_connections=400, max_keepalive_connections=400)
    figures: dict[str, Any] = {}
    async with httpx.AsyncClient(timeout=60, limits=limits) as client:
        idle = Sender(client, "light")
        await every(lambda: idle.send(urls[0], 2), every_s=0.1, count=10)
        figures["idle_ttft_p50_ms"] = idle.ttft_ms(50)
        heavy = Sender(client, "heavy")
        here, there = Sender(client, "light"), Sender(client, "light")
        done = asyncio.Event()
        async with flood(heavy, urls[:1], in_flight=2 * SLOTS + DEPTH, max_tokens=26):
            streams = asyncio.create_task(running_streams(client, sim, done))
            await asyncio.gather(
                every(
                    lambda: here.send(urls[0], 2), every_s=args.light_every, count=args.light_count
                ),
                every(
                    lambda: there.send(urls[-1], 2),
                    every_s=args.light_every,
                    count=args.light_count,
                ),
            )
            done.set()
            figures["streams_running"] = await streams
    for name, sender in (("flooded", here), ("other", there)):
        figures[f"{name}_refused"] = sender.refused()
        figures[f"{name}_ttft_p50_ms"] = sender.ttft_ms(50)
        figures[f"{name}_ttft_p90_ms"] = sender.ttft_ms(90)
    return figures


CASES = ("door-depth", "door-tokens", "classes", "light")


async def run_case(
    args: argparse.Namespace, workdir: Path, case: str, replicas: int
) -> dict[str, Any]:
    queue: dict[str, Any] = {"max_depth": DEPTH}
    if case == "door-tokens":
        queue = {"max_depth": 1000, "max_tokens": DEPTH * 2 * BLOCK}
    with fleet(args, workdir, replicas=replicas, queue=queue) as (sim, urls):
        if case == "door-depth":
            return await door(args, urls, light_tokens=2)
        if case == "door-tokens":
            # as large as a heavy request: what the token bound leaves past the heavy
            # waiters is less than one, so only a displacement lets it in
            return await door(args, urls, light_tokens=26)
        if case == "classes":
            return await classes(args, urls)
        return await light(args, sim, urls)


def medians(runs: list[dict[str, Any]]) -> dict[str, float]:
    return {k: statistics.median(r[k] for r in runs) for k in runs[0]}


async def run_bench(args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    figures: dict[str, Any] = {}
    for case in args.cases:
        shapes = [1] if case.startswith("door") else [1, 3]
        for replicas in shapes:
            runs = []
            for run in range(args.runs):
                progress(f"{case}, {replicas} replica(s), run {run + 1}/{args.runs}")
                runs.append(await run_case(args, workdir, case, replicas))
            figures[f"{case}/{replicas}"] = {"median": medians(runs), "runs": runs}
    return figures


def targets(figures: dict[str, Any]) -> list[tuple[bool, str]]:
    """Issue 42's acceptance, for the cases that ran."""
    checks: list[tuple[bool, str]] = []
    for case in ("door-depth/1", "door-tokens/1"):
        if case in figures:
            m = figures[case]["median"]
            checks.append(
                (m["light_refused"] == 0, f"{case}: light tenant refused {m['light_refused']:g}")
            )
    if "classes/3" in figures:
        one, three = figures["classes/1"]["median"], figures["classes/3"]["median"]
        ok = three["standard_served"] <= one["standard_served"]
        checks.append(
            (
                ok,
                f"classes: standard served {three['standard_served']:g} on 3 replicas, "
                f"{one['standard_served']:g} on 1",
            )
        )
    if "light/3" in figures:
        one, three = figures["light/1"]["median"], figures["light/3"]["median"]
        for side in ("flooded", "other"):
            p50, idle = three[f"{side}_ttft_p50_ms"], three["idle_ttft_p50_ms"]
            checks.append(
                (
                    p50 <= 2 * idle + 150,
                    f"light/3 {side}: TTFT p50 {p50:.0f} ms ≤ 2 × {idle:.0f} + 150",
                )
            )
            p90, base = three[f"{side}_ttft_p90_ms"], one["flooded_ttft_p90_ms"]
            checks.append(
                (
                    p90 <= 1.5 * base + 50,
                    f"light/3 {side}: TTFT p90 {p90:.0f} ms ≤ 1.5 × {base:.0f} + 50",
                )
            )
            refused = three[f"{side}_refused"]
            checks.append((refused == 0, f"light/3 {side}: refused {refused:g}"))
        ratio = three["streams_running"] / one["streams_running"]
        checks.append(
            (
                ratio >= 0.95,
                f"light: streams running {three['streams_running']:.1f} on 3 replicas, "
                f"{one['streams_running']:.1f} on 1 ({ratio:.2f})",
            )
        )
    return checks


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="spillgate bench fairness", description=__doc__.split("\n\n")[0]
    )
    p.add_argument("--cases", nargs="+", choices=CASES, default=list(CASES))
    p.add_argument("--runs", type=int, default=3, help="runs of each case (medians reported)")
    p.add_argument("--sim-speed", type=float, default=0.5, help="the simulator's speed-up")
    p.add_argument("--surplus", type=int, default=24, help="heavy requests past pool and queue")
    p.add_argument("--light-every", type=float, default=0.5, help="seconds between light requests")
    p.add_argument("--light-count", type=int, default=20, help="light requests a run")
    p.add_argument("--json", action="store_true", help="the figures as JSON")
    p.add_argument("--logs", type=Path, help="keep the processes' output here")
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    with logs_dir(args.logs, prefix="spillgate-bench-fairness-") as workdir:
        figures = asyncio.run(run_bench(args, workdir))
    checks = targets(figures)
    if args.json:
        print(
            json.dumps(
                {"figures": figures, "targets": [[ok, text] for ok, text in checks]}, indent=2
            )
        )
    else:
        for case, data in figures.items():
            print(case, json.dumps({k: round(v, 1) for k, v in data["median"].items()}))
        return print_targets(checks)
    return 0 if all(ok for ok, _ in checks) else 1


if __name__ == "__main__":
    sys.exit(main())
