"""Run a schedule open-loop: each request leaves at its planned time, whatever came back.

The dispatcher only sleeps until the next arrival and starts a task; responses are read by
those tasks. How late each request left (its lag) is recorded, so a report can say when
the generator itself, not the system under test, fell behind.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import resource
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import httpx

from loadtest.loadgen.client import RequestShape, Result, send
from loadtest.loadgen.http import ConnectionPool, Origin
from loadtest.loadgen.progress import Progress
from loadtest.loadgen.scrape import Sampler, Scraper
from loadtest.loadgen.workload import PlannedRequest

SCRAPE_TIMEOUT_S = 2.0
ENGINE_SAMPLE_MAX_S = 1.0  # backends' engine state is read at least this often


@dataclass(frozen=True, kw_only=True)
class RunTarget:
    """Where a run goes: the gateway, or (for `--compare-direct`) backends with no gateway."""

    label: str
    urls: Sequence[str]  # requests go round-robin over these
    keys: Mapping[str, str]  # tenant → API key; empty for a bare backend
    shape: RequestShape
    admin_token: str | None = None  # lets the sampler read the gateway's /admin/status
    backend_urls: Sequence[str] = ()  # whose /metrics count preemptions
    sample_queue_depth: bool = True


@dataclass(kw_only=True)
class RunData:
    label: str
    urls: Sequence[str]
    model: str
    duration_s: float  # the schedule's length
    elapsed_s: float = 0.0  # until the last response ended
    results: list[Result] = field(default_factory=list)
    samples: list[dict[str, Any]] = field(default_factory=list)
    sample_failures: int = 0
    sampled: str = "none"  # where the samples came from: gateway | backends | none
    preemptions: dict[str, dict[str, float | None]] = field(default_factory=dict)
    # per backend, its prefix-cache counters (tokens) before and after: {"before": {"queries",
    # "hits"} or None when unread, "after": ...}
    prefix_counters: dict[str, dict[str, dict[str, float] | None]] = field(default_factory=dict)
    # the backends' own /metrics during the run: {"t", "backends": {url: backend_state}}
    engine_samples: list[dict[str, Any]] = field(default_factory=list)
    engine_interval_s: float = 0.0


def raise_open_file_limit() -> int:
    """Open loop needs a socket per request in flight; lift the soft limit to the hard one."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            return hard
    return soft


async def _counters(
    client: httpx.AsyncClient, urls: Sequence[str]
) -> dict[str, dict[str, float] | None]:
    """Each backend's state, for the counters read across a run; None where unread."""
    states = await Scraper(client=client, backend_urls=urls).backends()
    return {url: states.get(url) for url in urls}


def _prefix_part(state: dict[str, float] | None) -> dict[str, float] | None:
    if state is None:
        return None
    return {"queries": state["prefix_queries"], "hits": state["prefix_hits"]}


async def _dispatch(
    plans: Sequence[PlannedRequest],
    target: RunTarget,
    pools: Sequence[ConnectionPool],
    *,
    t0: float,
    progress: Progress | None,
) -> list[Result]:
    tasks: list[asyncio.Task[Result]] = []

    async def one(plan: PlannedRequest, pool: ConnectionPool) -> Result:
        if progress is not None:
            progress.on_sent(time.perf_counter() - t0 - plan.at_s)
        key = target.keys.get(plan.tenant)
        result = await send(pool, plan, shape=target.shape, key=key, t0=t0)
        if progress is not None:
            progress.on_result(result)
        return result

    for plan in plans:
        delay = t0 + plan.at_s - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        pool = pools[plan.index % len(pools)]
        tasks.append(asyncio.create_task(one(plan, pool)))
    return list(await asyncio.gather(*tasks))


async def run_schedule(
    plans: Sequence[PlannedRequest],
    *,
    target: RunTarget,
    duration_s: float,
    progress: Progress | None = None,
    sample_interval_s: float = 0.5,
    lead_s: float = 0.05,
) -> RunData:
    """Send every planned request at its time; sample the fleet meanwhile."""
    raise_open_file_limit()
    data = RunData(
        label=target.label, urls=target.urls, model=target.shape.model, duration_s=duration_s
    )
    pools = [ConnectionPool(Origin.parse(url)) for url in target.urls]
    async with httpx.AsyncClient(timeout=SCRAPE_TIMEOUT_S) as client:
        before = await _counters(client, target.backend_urls)
        scraper = Scraper(
            client=client,
            gateway_url=target.urls[0] if target.admin_token else None,
            admin_token=target.admin_token,
            backend_urls=() if target.admin_token else target.backend_urls,
            with_queue_depth=target.sample_queue_depth,
        )
        sampler = Sampler(scraper=scraper, interval_s=sample_interval_s)
        engines = sampler  # when it reads the backends often enough, one sampler does both
        if target.admin_token or sample_interval_s > ENGINE_SAMPLE_MAX_S:
            engines = Sampler(
                scraper=Scraper(client=client, backend_urls=target.backend_urls),
                interval_s=min(sample_interval_s, ENGINE_SAMPLE_MAX_S),
            )
        # a full collection over everything built so far stalls the dispatcher for tens of
        # milliseconds mid-run; collect once now and leave those objects out of later passes
        gc.collect()
        gc.freeze()
        t0 = time.perf_counter() + lead_s
        background = [asyncio.create_task(sampler.run(t0))]
        if target.backend_urls and engines is not sampler:
            background.append(asyncio.create_task(engines.run(t0)))
        if progress is not None:
            background.append(asyncio.create_task(progress.run()))
        try:
            data.results = await _dispatch(plans, target, pools, t0=t0, progress=progress)
            data.elapsed_s = time.perf_counter() - t0
        finally:
            for task in background:
                task.cancel()
            await asyncio.gather(*background, return_exceptions=True)
            for pool in pools:
                await pool.close()
            gc.unfreeze()
        after = await _counters(client, target.backend_urls)
    data.samples, data.sample_failures = sampler.points, sampler.failures
    data.engine_samples, data.engine_interval_s = engines.points, engines.interval_s
    if target.admin_token or target.backend_urls:
        data.sampled = "gateway" if target.admin_token else "backends"
    for url in target.backend_urls:
        was, now = before[url], after[url]
        data.preemptions[url] = {
            "before": None if was is None else was["preemptions"],
            "after": None if now is None else now["preemptions"],
        }
        data.prefix_counters[url] = {"before": _prefix_part(was), "after": _prefix_part(now)}
    return data
