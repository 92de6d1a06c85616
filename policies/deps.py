"""What a policy factory is given: everything a policy may draw on, built once by the app.

The gateway's parts come typed as the roles gateway/overflow.py declares; this lives with
the policies because the provider gates it carries are theirs (policies/provider/gate.py).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import redis.asyncio as aioredis
from redis.asyncio.cluster import RedisCluster

from gateway.clock import Clock
from gateway.config import PoolSettings, Settings
from gateway.overflow import (
    BatchIntake,
    Latencies,
    OverflowPolicy,
    PolicyMetrics,
    PoolRoom,
    Preempts,
    QueueFeed,
)
from policies.provider.gate import ProviderGate


@dataclass(frozen=True, kw_only=True)
class PolicyDeps:
    """Everything a policy factory may draw on; built once in the app's lifespan."""

    settings: Settings
    room: PoolRoom  # the router, as a policy waiting for room sees it
    metrics: PolicyMetrics
    clock: Clock
    # what each step's answers took lately, for the steps' predictions (gateway/slo.py)
    latencies: Latencies
    redis: aioredis.Redis | RedisCluster | None = None  # shared state when configured, else local
    providers: Mapping[str, ProviderGate] = field(default_factory=dict)  # one per provider
    batches: BatchIntake | None = None  # the batch tier, which the `batch` step hands work to
    # shared mode: where the queues share their tenants' service and waiters (None: local)
    service_feed: QueueFeed | None = None
    # the requests in flight that a waiter of a higher class may stop (None: never)
    preempts: Preempts | None = None


PolicyFactory = Callable[[PoolSettings, PolicyDeps], OverflowPolicy]
