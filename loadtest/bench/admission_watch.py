"""What the admission benchmark watches while a run goes: the backend's running, waiting and
KV use and the gateway's tokens in flight, sampled every 0.25 s, and each run's summary."""

from __future__ import annotations

import asyncio
import statistics
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import httpx

from loadtest.loadgen.client import Result
from loadtest.loadgen.scrape import Scraper

INTERVAL_S = 0.25
ON_BACKEND = ("served", "local", "queued")  # outcomes the backend answered, not the provider


@dataclass(frozen=True, kw_only=True)
class BackendPoint:
    t: float
    running: float
    waiting: float
    kv_usage: float  # vllm:kv_cache_usage_perc
    kv_used_tokens: float  # the same, in tokens of the whole cache


@dataclass(frozen=True, kw_only=True)
class GatewayPoint:
    t: float
    reserved: float  # the gateway's tokens in flight on the backend, all pools


@dataclass(kw_only=True)
class Watch:
    """Samples the backend's /metrics and the gateway's /admin/status every 0.25 s, each
    on its own: a slow answer from one never delays the other's samples."""

    scraper: Scraper
    backend_url: str
    backend: list[BackendPoint] = field(default_factory=list)
    gateway: list[GatewayPoint] = field(default_factory=list)
    failures: int = 0

    async def read_backend(self, t: float) -> None:
        state = await self.scraper.backend(self.backend_url)
        usage = state["in_flight"] / state["capacity"] if state["capacity"] else 0.0
        self.backend.append(
            BackendPoint(
                t=t, running=state["running"], waiting=state["waiting"], kv_usage=usage,
                kv_used_tokens=state["in_flight"],
            )
        )  # fmt: skip

    async def read_gateway(self, t: float) -> None:
        status = await self.scraper.status()
        reserved = sum(b["tokens_in_flight"] for p in status["pools"] for b in p["backends"])
        self.gateway.append(GatewayPoint(t=t, reserved=reserved))

    async def every(self, read: Callable[[float], Awaitable[None]], t0: float) -> None:
        while True:
            started = time.perf_counter()
            try:
                await read(started - t0)
            except (httpx.HTTPError, KeyError, ValueError):
                self.failures += 1
            await asyncio.sleep(max(0.0, INTERVAL_S - (time.perf_counter() - started)))

    async def run(self) -> None:
        t0 = time.perf_counter()
        loops = [self.every(self.read_backend, t0)]
        if self.scraper.gateway_url is not None:
            loops.append(self.every(self.read_gateway, t0))
        await asyncio.gather(*loops)

    def used_per_reserved(self) -> float | None:
        """KV really used ÷ tokens reserved, summed over the gateway's samples while it held
        any, each against the backend sample nearest in time."""
        used = reserved = 0.0
        for point in self.gateway:
            if point.reserved > 0 and self.backend:
                nearest = min(self.backend, key=lambda b: abs(b.t - point.t))
                used += nearest.kv_used_tokens
                reserved += point.reserved
        return used / reserved if reserved else None


def streaming_at_once(results: Sequence[Result]) -> int:
    """The most answers the backend streamed at once, as the client saw them (first token to
    end): a cross-check of the scraped figure that a starved sampler cannot miss."""
    edges = sorted(
        edge
        for r in results
        if r.ok and r.ttft_s is not None and r.e2e_s is not None and r.outcome in ON_BACKEND
        for edge in ((r.sent_s + r.ttft_s, 1), (r.sent_s + r.e2e_s, -1))
    )  # at equal times an end (-1) sorts before a start
    most = now = 0
    for _, step in edges:
        now += step
        most = max(most, now)
    return most


def summarize(
    arm: str,
    results: Sequence[Result],
    watch: Watch,
    *,
    elapsed_s: float | None = None,
    **extra: Any,
) -> dict[str, Any]:
    """One run's figures; with `elapsed_s` (from the first send to the last byte), the
    backend's answer tokens per second over it."""
    ok = [r for r in results if r.ok]
    ttft = [r.ttft_s for r in ok if r.ttft_s is not None]
    spilled = [r for r in ok if r.outcome == "provider"]
    answered = sum(r.completion_tokens for r in ok if r.outcome in ON_BACKEND)
    points = watch.backend
    return {
        "arm": arm,
        "requests": len(results),
        "ok": len(ok),
        "refused": sum(r.status == 503 for r in results),
        "queued": sum(r.outcome == "queued" for r in results),
        "errors": sum(not r.ok and r.status != 503 for r in results),
        "outcomes": dict(Counter(r.outcome for r in results)),
        "running_max": max((p.running for p in points), default=None),
        "streaming_max": streaming_at_once(results),
        "waiting_max": max((p.waiting for p in points), default=None),
        "kv_peak": max((p.kv_usage for p in points), default=None),
        "reserved_peak": max((p.reserved for p in watch.gateway), default=None),
        "used_per_reserved": watch.used_per_reserved(),
        "ttft_p50_s": statistics.median(ttft) if ttft else None,
        "prompt_tokens_mean": statistics.fmean(r.prompt_tokens for r in ok) if ok else None,
        "completion_tokens_mean": statistics.fmean(r.completion_tokens for r in ok) if ok else None,
        "output_tokens_per_s": answered / elapsed_s if elapsed_s else None,
        "spill_requests": len(spilled),
        "spill_tokens": sum(r.prompt_tokens + r.completion_tokens for r in spilled),
        "samples": len(points) + len(watch.gateway),
        "sample_failures": watch.failures,
        "first_error": next((r.error for r in results if r.error), None),
        "elapsed_s": elapsed_s,
        **extra,
    }
