"""Rate-limiter decisions per second and the latency each adds, Redis beside local.

Not a test: a script whose figures go in BENCHMARKS.md. It starts a private redis-server
(never the user's), then runs a fixed number of `acquire` calls from N concurrent tasks for
each limiter: `local` (in-process), `ping` (a bare Redis round trip, the floor), `redis`
(one Lua call per decision, the decisions of one moment in one pipeline) and `resilient`
(redis behind the time budget, 50-500 ms from the latency seen, and the circuit breaker)
and `sliced` (resilient with the gateway's default `ratelimit.slice_s`, as the gateway runs
it: Redis grants a decision part of the tenant's refill besides, and the tenant's next
decisions in this process spend that grant without a round trip). At the end it prints
the time Redis itself spent per decision (INFO commandstats), which bounds what one Redis
core serves. Each limiter first decides once for every tenant (warm-up: connections,
script load). Limits are high enough that every decision is an admission, so the figures
are the decision cost.

    spillgate bench limiter --decisions 20000 --concurrency 1,16,64,256
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

import redis.asyncio as aioredis

from gateway.clock import SystemClock
from gateway.config import RateLimitSettings
from gateway.ratelimit import (
    Decision,
    LocalRateLimiter,
    RateLimiter,
    RedisRateLimiter,
    ResilientRateLimiter,
    TenantLimits,
)
from gateway.redis_io.batch import RedisBatcher
from loadtest.percentile import percentile_or_nan
from loadtest.procs import RedisProcess

SLICE_S = RateLimitSettings().slice_s


@dataclass(frozen=True, kw_only=True)
class Row:
    limiter: str
    concurrency: int
    decisions: int
    decisions_per_s: float
    p50_ms: float
    p99_ms: float
    store_errors: int = 0


def tenant_limits(count: int) -> list[TenantLimits]:
    return [
        TenantLimits(tenant=f"tenant-{i}", requests_per_minute=10**9, tokens_per_minute=10**12)
        for i in range(count)
    ]


async def measure(
    name: str, limiter: RateLimiter, *, tenants: list[TenantLimits], decisions: int, tasks: int
) -> list[float]:
    """Per-decision latencies (seconds) of `decisions` acquires from `tasks` tasks."""
    latencies: list[float] = []
    per_task = decisions // tasks

    async def worker(offset: int) -> None:
        for i in range(per_task):
            started = time.perf_counter()
            decision = await limiter.acquire(tenants[(offset + i) % len(tenants)], 500)
            latencies.append(time.perf_counter() - started)
            if not decision.allowed:
                raise RuntimeError(f"{name} refused a decision: {decision.reason}")

    await asyncio.gather(*(worker(t) for t in range(tasks)))
    return latencies


async def row(
    name: str, limiter: RateLimiter, *, tenants: list[TenantLimits], decisions: int, tasks: int
) -> Row:
    for limits in tenants:
        await limiter.acquire(limits, 500)
    started = time.perf_counter()
    latencies = await measure(name, limiter, tenants=tenants, decisions=decisions, tasks=tasks)
    wall = time.perf_counter() - started
    return Row(
        limiter=name,
        concurrency=tasks,
        decisions=len(latencies),
        decisions_per_s=len(latencies) / wall,
        p50_ms=percentile_or_nan(latencies, 50) * 1000,
        p99_ms=percentile_or_nan(latencies, 99) * 1000,
        store_errors=getattr(limiter, "store_errors", 0),
    )


class Ping:
    """A bare Redis round trip in the limiter's shape: the floor under any shared decision."""

    def __init__(self, client: aioredis.Redis) -> None:
        self._client = client
        self._local = LocalRateLimiter(SystemClock())

    async def acquire(self, limits: TenantLimits, tokens: int) -> Decision:
        await self._client.ping()
        return await self._local.peek(limits)

    async def reconcile(self, limits: TenantLimits, *, charged: int, used: int) -> None:
        return None

    async def peek(self, limits: TenantLimits) -> Decision:
        return await self._local.peek(limits)

    async def close(self) -> None:
        return None


class CountingResilient(ResilientRateLimiter):
    """The gateway's stack, counting the calls that missed the time budget."""

    def __init__(self, batcher: RedisBatcher, *, slice_s: float = 0.0) -> None:
        clock = SystemClock()
        self.store_errors = 0
        super().__init__(
            RedisRateLimiter(batcher, timeout_s=0.05, timeout_max_s=0.5, slice_s=slice_s),
            fallback=LocalRateLimiter(clock),
            failure_mode="local",
            replicas=1,
            timeout_s=0.05,
            timeout_max_s=0.5,
            failure_threshold=5,
            cooldown_s=1.0,
            clock=clock,
            on_store_error=self._count,
            on_mode_change=lambda mode: None,
        )

    def _count(self) -> None:
        self.store_errors += 1


async def run_all(args: argparse.Namespace, url: str) -> list[Row]:
    client = aioredis.Redis.from_url(url, socket_timeout=2, max_connections=1024)
    tenants = tenant_limits(args.tenants)
    limiters: dict[str, Callable[[], RateLimiter]] = {
        "local": lambda: LocalRateLimiter(SystemClock()),
        "ping": lambda: Ping(client),
        "redis": lambda: RedisRateLimiter(RedisBatcher(client)),
        "resilient": lambda: CountingResilient(RedisBatcher(client)),
        # as the gateway runs it by default: each tenant's decisions spend a grant
        "sliced": lambda: CountingResilient(RedisBatcher(client), slice_s=SLICE_S),
    }
    rows: list[Row] = []
    try:
        await RedisRateLimiter(client).peek(tenants[0])
        for concurrency in args.concurrency:
            for name, build in limiters.items():
                limiter = build()
                result = await row(
                    name, limiter, tenants=tenants, decisions=args.decisions, tasks=concurrency
                )
                await limiter.close()
                rows.append(result)
                if not args.json:
                    print(format_row(result), flush=True)
        if not args.json:
            print(f"redis-server time per decision: {await script_usec(client):.1f} us")
    finally:
        await client.aclose()
    return rows


async def script_usec(client: aioredis.Redis) -> float:
    """Microseconds Redis itself spent per EVALSHA, from INFO commandstats."""
    stats = await client.info("commandstats")
    return float(stats.get("cmdstat_evalsha", {}).get("usec_per_call", 0.0))


def format_row(result: Row) -> str:
    text = (
        f"{result.limiter:<10} c={result.concurrency:<4}"
        f" {result.decisions_per_s:>10,.0f} decisions/s"
        f"  p50 {result.p50_ms:7.3f} ms  p99 {result.p99_ms:7.3f} ms"
    )
    if result.store_errors:
        text += f"  ({result.store_errors} over the time budget, answered locally)"
    return text


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="spillgate bench limiter", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--decisions", type=int, default=20_000, help="per limiter and level")
    parser.add_argument(
        "--concurrency",
        type=lambda text: [int(part) for part in text.split(",")],
        default=[1, 16, 64, 256],
        help="comma-separated numbers of concurrent tasks",
    )
    parser.add_argument("--tenants", type=int, default=100, help="tenants decided round-robin")
    parser.add_argument("--uvloop", action="store_true", help="run on uvloop, as uvicorn does")
    parser.add_argument("--json", action="store_true", help="print the rows as JSON")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    loop_factory: Callable[[], asyncio.AbstractEventLoop] | None = None
    if args.uvloop:
        import uvloop

        loop_factory = uvloop.new_event_loop
    with RedisProcess() as redis_proc, asyncio.Runner(loop_factory=loop_factory) as runner:
        rows = runner.run(run_all(args, redis_proc.url))
    if args.json:
        json.dump([asdict(row) for row in rows], sys.stdout, indent=2)
        print()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
