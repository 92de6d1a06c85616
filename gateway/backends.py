"""Backends and pools as the router sees them: capacity, health, and the loop refreshing both."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import dataclass, field

import httpx

from gateway.clock import Clock
from gateway.config import BackendSettings, PoolSettings
from gateway.demand import PoolDemand
from gateway.discovery import capacity_from_metrics
from gateway.request import PromptEstimator

log = logging.getLogger("spillgate.backends")

FAILURES_BEFORE_EJECT = 3
EJECT_S = 5.0


@dataclass(eq=False, kw_only=True)
class Backend:
    name: str
    pool: str
    url: str
    served_model: str
    configured_capacity: int | None  # None: discovered from the backend's metrics
    block_size: int = 16  # tokens per KV block: configured, or discovered with the capacity
    discovered_capacity: int | None = None
    last_scrape: float = float("-inf")
    consecutive_failures: int = 0
    ejected_until: float = float("-inf")

    def capacity(self, *, now: float, stale_after: float) -> int:
        """Tokens the backend can hold; 0 (full) when unknown or its metrics went stale."""
        if self.configured_capacity is not None:
            return self.configured_capacity
        if self.discovered_capacity is None or now - self.last_scrape > stale_after:
            return 0
        return self.discovered_capacity

    def healthy(self, now: float) -> bool:
        return now >= self.ejected_until

    def record_failure(self, now: float) -> None:
        self.consecutive_failures += 1
        if self.consecutive_failures >= FAILURES_BEFORE_EJECT:
            if self.healthy(now):
                log.warning(
                    "backend %s ejected after %d failures", self.name, self.consecutive_failures
                )
            self.ejected_until = now + EJECT_S

    def record_success(self) -> None:
        self.consecutive_failures = 0
        self.ejected_until = float("-inf")


@dataclass(eq=False, kw_only=True)
class Pool:
    settings: PoolSettings
    backends: list[Backend]
    demand: PoolDemand
    estimator: PromptEstimator = field(default_factory=PromptEstimator)

    @property
    def name(self) -> str:
        return self.settings.name


def build_pools(pools: list[PoolSettings], *, clock: Clock) -> dict[str, Pool]:
    built: dict[str, Pool] = {}
    for pool in pools:
        backends = [_backend(pool, i, b) for i, b in enumerate(pool.backends)]
        built[pool.name] = Pool(settings=pool, backends=backends, demand=PoolDemand(clock))
    return built


def _backend(pool: PoolSettings, index: int, b: BackendSettings) -> Backend:
    return Backend(
        name=b.name or f"{pool.name}-{index}",
        pool=pool.name,
        url=b.url.rstrip("/"),
        served_model=b.served_model or pool.name,
        configured_capacity=None if b.capacity == "auto" else b.capacity,
        block_size=b.block_size,
    )


class FleetWatcher:
    """Refreshes discovered capacity and probes ejected backends back into rotation."""

    def __init__(self, pools: dict[str, Pool], *, client: httpx.AsyncClient, clock: Clock) -> None:
        self._pools = pools
        self._client = client
        self._clock = clock
        self._task: asyncio.Task[None] | None = None

    async def refresh_once(self) -> None:
        now = self._clock.monotonic()
        jobs = [
            self._refresh(backend, pool.settings.capacity_refresh_s)
            for pool in self._pools.values()
            for backend in pool.backends
            if not backend.healthy(now)
            or (
                backend.configured_capacity is None
                and now - backend.last_scrape >= pool.settings.capacity_refresh_s
            )
        ]
        await asyncio.gather(*jobs)

    async def _refresh(self, backend: Backend, budget_s: float) -> None:
        now = self._clock.monotonic()
        try:
            if backend.configured_capacity is None:
                response = await self._client.get(f"{backend.url}/metrics", timeout=budget_s)
                response.raise_for_status()
                cache = capacity_from_metrics(response.text)
                if cache is not None:
                    backend.discovered_capacity = cache.tokens
                    backend.block_size = cache.block_size
                    backend.last_scrape = now
            else:
                response = await self._client.get(f"{backend.url}/health", timeout=budget_s)
                response.raise_for_status()
        except (httpx.HTTPError, ValueError) as exc:
            log.debug("refresh of %s failed: %r", backend.name, exc)
            return
        if not backend.healthy(now):
            log.info("backend %s answered its probe; back in rotation", backend.name)
            backend.record_success()

    async def _loop(self) -> None:
        while True:
            await self.refresh_once()
            await asyncio.sleep(1.0)

    def start(self) -> None:
        """Start refreshing in the background (the first refresh runs at once)."""
        self._task = asyncio.create_task(self._loop(), name="fleet-watcher")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
