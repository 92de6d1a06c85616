"""What the load generator reads off the gateway and the backends while a run goes on.

From the gateway: `/admin/status` (tokens in flight, capacity and limit per backend) and
`/metrics` (queue depth per pool). From a vLLM backend: `/metrics` (KV-cache use, queue,
preemptions). Every call has a short timeout; a failed scrape is skipped, not fatal.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import httpx

from gateway.admission.fleet.metrics_text import samples, total

PREEMPTIONS = "vllm:num_preemptions_total"
QUEUE_DEPTH = ("spillgate_queue_depth",)


def backend_state(text: str) -> dict[str, float]:
    """A vLLM backend's load: KV tokens in use and held, requests running and waiting.

    vLLM's usage counts the blocks sequences may hold, all but the null block, so tokens in
    use are usage x (blocks - 1) x block size; capacity is all blocks, as vLLM reports it."""
    found = samples(text)
    info = [s.labels for s in found if s.name == "vllm:cache_config_info"]
    capacity = usable = 0.0
    if info and info[0].get("num_gpu_blocks", "").isdigit():
        blocks, block_size = (
            float(info[0]["num_gpu_blocks"]),
            float(info[0].get("block_size", "16")),
        )
        capacity, usable = blocks * block_size, max(0.0, blocks - 1) * block_size
    usage = total(found, "vllm:kv_cache_usage_perc") or 0.0
    return {
        "capacity": capacity,
        "in_flight": usage * usable,
        "kv_usage": usage,
        "running": total(found, "vllm:num_requests_running") or 0.0,
        "waiting": total(found, "vllm:num_requests_waiting") or 0.0,
        "preemptions": total(found, PREEMPTIONS) or 0.0,
        # prompt tokens looked up in the prefix cache, and found there (counters)
        "prefix_queries": total(found, "vllm:prefix_cache_queries_total") or 0.0,
        "prefix_hits": total(found, "vllm:prefix_cache_hits_total") or 0.0,
        # the engine's own time to first token, summed over its requests (counters)
        "ttft_sum": total(found, "vllm:time_to_first_token_seconds_sum") or 0.0,
        "ttft_count": total(found, "vllm:time_to_first_token_seconds_count") or 0.0,
    }


@dataclass(frozen=True, kw_only=True)
class Scraper:
    """Reads one gateway (when an admin token is given) or bare backends."""

    client: httpx.AsyncClient
    gateway_url: str | None = None
    admin_token: str | None = None
    backend_urls: Sequence[str] = ()
    with_queue_depth: bool = True  # one more call per sample: the gateway's /metrics

    async def status(self) -> dict[str, Any]:
        assert self.gateway_url is not None
        headers = {"authorization": f"Bearer {self.admin_token}"}
        response = await self.client.get(f"{self.gateway_url}/admin/status", headers=headers)
        response.raise_for_status()
        data: dict[str, Any] = response.json()
        return data

    async def queue_depth(self) -> dict[str, float]:
        assert self.gateway_url is not None
        response = await self.client.get(f"{self.gateway_url}/metrics")
        response.raise_for_status()
        return {s.labels.get("pool", ""): s.value for s in samples(response.text, QUEUE_DEPTH)}

    async def backend(self, url: str) -> dict[str, float]:
        response = await self.client.get(f"{url.rstrip('/')}/metrics")
        response.raise_for_status()
        return backend_state(response.text)

    async def backends(self) -> dict[str, dict[str, float]]:
        states = await asyncio.gather(
            *(self.backend(u) for u in self.backend_urls), return_exceptions=True
        )
        return {
            url: state
            for url, state in zip(self.backend_urls, states, strict=True)
            if isinstance(state, dict)
        }

    async def sample(self) -> dict[str, Any]:
        """One point in time: per backend tokens in flight and capacity, per pool queue."""
        point: dict[str, Any] = {"backends": {}, "queue_depth": {}}
        if self.gateway_url is not None and self.admin_token:
            if self.with_queue_depth:
                status, point["queue_depth"] = await asyncio.gather(
                    self.status(), self.queue_depth()
                )
            else:
                status = await self.status()
            for pool in status["pools"]:
                for b in pool["backends"]:
                    point["backends"][b["name"]] = {
                        "pool": pool["name"],
                        "in_flight": b["tokens_in_flight"],
                        "limit": b["limit_tokens"],
                        "capacity": b["capacity_tokens"],
                        "sessions": b["active_sessions"],
                    }
        elif self.backend_urls:
            point["backends"] = await self.backends()
            point["queue_depth"] = {
                url: state["waiting"] for url, state in point["backends"].items()
            }
        return point


@dataclass(kw_only=True)
class Sampler:
    """Samples a Scraper every `interval_s` for as long as it runs."""

    scraper: Scraper
    interval_s: float = 0.5
    points: list[dict[str, Any]] = field(default_factory=list)
    failures: int = 0

    async def run(self, t0: float) -> None:
        while True:
            started = time.perf_counter()
            try:
                point = await self.scraper.sample()
            except (httpx.HTTPError, KeyError, ValueError):
                self.failures += 1
            else:
                point["t"] = round(max(0.0, started - t0), 3)
                self.points.append(point)
            await asyncio.sleep(max(0.0, self.interval_s - (time.perf_counter() - started)))
