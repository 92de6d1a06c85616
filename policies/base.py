"""The overflow policy role: what runs when no backend of a pool has room."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import ClassVar, Protocol, runtime_checkable

import redis.asyncio as aioredis
from redis.asyncio.cluster import RedisCluster

from gateway.batch.service import Batches
from gateway.clock import Clock
from gateway.config import PoolSettings, Settings
from gateway.exchange import Exchange, Served
from gateway.metrics import GatewayMetrics
from gateway.providers import ProviderGate
from gateway.relay import ResponseTap
from gateway.request import InferenceRequest
from gateway.router import Router


class OverflowPolicy(Protocol):
    """Tries to serve a request the pool had no room for.

    Returns what it served, or None to pass the request to the next policy.
    Raises a SpillgateError to refuse the request outright.
    Must release anything it reserved, on every path.
    """

    name: ClassVar[str]

    async def serve(self, request: InferenceRequest, exchange: Exchange) -> Served | None: ...


@runtime_checkable
class AnswerObserver(Protocol):
    """A policy that also watches its pool's successful answers (the cache fills this way)."""

    def tap_for(self, request: InferenceRequest) -> ResponseTap | None: ...


TapFactory = Callable[[InferenceRequest], ResponseTap | None]


@runtime_checkable
class AdmissionGate(Protocol):
    """A policy that decides whether new arrivals may take free room directly (the queue:
    not while others wait ahead of them)."""

    def lets_in(self, request: InferenceRequest) -> bool: ...


Gate = Callable[[InferenceRequest], bool]


@dataclass(frozen=True, kw_only=True)
class PolicyDeps:
    """Everything a policy factory may draw on; built once in the app's lifespan."""

    settings: Settings
    router: Router
    metrics: GatewayMetrics
    clock: Clock
    redis: aioredis.Redis | RedisCluster | None = None  # shared state when configured, else local
    providers: Mapping[str, ProviderGate] = field(default_factory=dict)  # one per provider
    batches: Batches | None = None  # the batch tier, which the `batch` step hands work to


PolicyFactory = Callable[[PoolSettings, PolicyDeps], OverflowPolicy]
