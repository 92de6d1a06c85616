"""Shared mode: what a replica builds when it is given a Redis URL. One Redis client per
process; on it the tenants' token buckets and the providers' budgets (the limiter), the
in-flight ledger and the providers' concurrency slots, and the feeds through which the
replicas share what each one sees (gateway/shared/). `create_app` builds this once, or
nothing: one process on its own keeps all of it in memory.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass, field

import redis.asyncio as aioredis
import redis.exceptions
from redis.asyncio.cluster import RedisCluster

from gateway.admission.fleet.backends import Pool
from gateway.admission.ledger.shared import RedisLedger
from gateway.admission.routing.router import Router
from gateway.clock import Clock
from gateway.config import Settings
from gateway.metrics import GatewayMetrics
from gateway.ratelimit import LocalRateLimiter, RedisRateLimiter, ResilientRateLimiter
from gateway.redis_io.batch import RedisBatcher
from gateway.shared.ledger_feed import ReleaseFeed
from gateway.shared.length_feed import LengthFeed
from gateway.shared.prefix_feed import PrefixFeed
from gateway.shared.service_feed import ServiceFeed
from gateway.tasks import Background, start_all

REDIS_POOL_SIZE = 64  # connections per process


def redis_client(settings: Settings, url: str) -> aioredis.Redis | RedisCluster:
    """One client per process, shared by the limiter, the ledger and the cache.

    Script calls reach it through one RedisBatcher (gateway/redis_io/batch.py), which never
    cancels a call in flight, so each call is bounded by the socket timeout: the ceiling of
    the callers' time budgets. The pool blocks when every connection is busy rather than
    failing the call at once, which would push the limiter into its failure mode exactly
    when a spike arrives.

    A call that finds its connection closed (after a Redis restart or failover every idle
    pooled connection is) is sent once more on a new connection, rather than failing once
    per pooled connection. The limiter's scripts are safe to send twice: a decision nobody
    received is refunded (gateway/ratelimit/redis_limiter.py).
    """
    ceiling = _timeout_max_s(settings)
    if settings.redis.cluster:  # one client for the cluster; a connection pool per node
        return RedisCluster.from_url(
            url,
            socket_timeout=ceiling,
            socket_connect_timeout=ceiling,
            max_connections=REDIS_POOL_SIZE,
        )
    pool = aioredis.BlockingConnectionPool.from_url(
        url,
        max_connections=REDIS_POOL_SIZE,
        timeout=ceiling,
        socket_timeout=ceiling,
        socket_connect_timeout=ceiling,
        health_check_interval=30,
        retry_on_error=[redis.exceptions.ConnectionError],
    )
    return aioredis.Redis.from_pool(pool)


def _ignore(mode: str) -> None:
    """The providers' limiter and slots say nothing of their mode: only the tenants' do."""


def _timeout_max_s(settings: Settings) -> float:
    return max(settings.redis.timeout_ms, settings.redis.timeout_max_ms) / 1000


@dataclass(kw_only=True)
class SharedMode:
    redis: aioredis.Redis | RedisCluster
    batcher: RedisBatcher
    limiter: ResilientRateLimiter  # the tenants' buckets
    provider_limiter: ResilientRateLimiter  # the providers' token budgets
    ledger: RedisLedger  # tokens in flight on the backends
    provider_slots: RedisLedger | None  # the providers' concurrency slots, if any provider
    service_feed: ServiceFeed  # the queues' tenants' service and waiters
    # the feeds that need the router (`feed`): releases, learned lengths, routed prefixes
    feeds: list[Background | None] = field(default_factory=list)

    @classmethod
    def connect(
        cls,
        settings: Settings,
        url: str,
        *,
        pools: dict[str, Pool],
        metrics: GatewayMetrics,
        clock: Clock,
        workers: int,
    ) -> SharedMode:
        """Shared mode on the Redis at `url`; `workers`: how many processes of this replica
        share it (each admits on its share while Redis is away)."""
        redis = redis_client(settings, url)
        batcher = RedisBatcher(redis)
        timeouts = {
            "timeout_s": settings.redis.timeout_ms / 1000,
            "timeout_max_s": _timeout_max_s(settings),
        }
        share = settings.ratelimit.replicas * workers

        def ledger(
            backends: list[str], *, key_prefix: str, on_mode_change: Callable[[str], None]
        ) -> RedisLedger:
            """Leases in Redis; while Redis is away, each process admits on its share."""
            return RedisLedger(
                batcher,
                backends=backends,
                clock=clock,
                key_prefix=key_prefix,
                lease_ttl_s=settings.ledger.lease_ttl_s,
                refresh_s=settings.ledger.refresh_s,
                timeout_s=timeouts["timeout_s"],
                timeout_max_s=timeouts["timeout_max_s"],
                fallback_share=share,
                spare=settings.ledger.spare,
                on_store_error=metrics.ledger_store_errors.inc,
                on_mode_change=on_mode_change,
            )

        def limiter(*, for_providers: bool) -> ResilientRateLimiter:
            """Token buckets in Redis. Tenants' buckets follow the configured failure mode;
            providers' budgets always fall back to this process's share, so a Redis outage
            neither stops spilling nor multiplies a provider's budget by the replicas."""
            rl = settings.ratelimit
            return ResilientRateLimiter(
                RedisRateLimiter(
                    batcher,
                    key_prefix="spillgate:provider" if for_providers else "spillgate",
                    timeout_s=timeouts["timeout_s"],
                    timeout_max_s=timeouts["timeout_max_s"],
                    slice_s=rl.slice_s,
                ),
                fallback=LocalRateLimiter(clock),
                failure_mode="local" if for_providers else rl.failure_mode,
                replicas=share,
                failure_threshold=rl.failure_threshold,
                cooldown_s=rl.cooldown_s,
                clock=clock,
                on_store_error=metrics.ratelimit_store_errors.inc,
                on_mode_change=_ignore if for_providers else metrics.set_ratelimit_mode,
                timeout_s=timeouts["timeout_s"],
                timeout_max_s=timeouts["timeout_max_s"],
            )

        providers = [p.name for p in settings.providers]
        return cls(
            redis=redis,
            batcher=batcher,
            limiter=limiter(for_providers=False),
            provider_limiter=limiter(for_providers=True),
            ledger=ledger(
                [b.name for pool in pools.values() for b in pool.members],
                key_prefix="spillgate",
                on_mode_change=metrics.set_ledger_mode,
            ),
            provider_slots=None
            if not providers
            else ledger(providers, key_prefix="spillgate:provider", on_mode_change=_ignore),
            service_feed=ServiceFeed(batcher=batcher, redis=redis, timeout_s=timeouts["timeout_s"]),
        )

    def feed(self, router: Router, settings: Settings) -> None:
        """Build the feeds that share what `router` sees: its releases, each pool's learned
        output lengths, and (where a pool routes by prefix) where prefixes were routed."""
        timeout_s = settings.redis.timeout_ms / 1000
        pools = router.pools
        self.feeds.append(
            ReleaseFeed(self.redis, ledger=self.ledger, waker=router, timeout_s=timeout_s)
        )
        if any(pool.outputs.learns() for pool in pools.values()):
            self.feeds.append(LengthFeed(batcher=self.batcher, pools=pools, timeout_s=timeout_s))
        if any(pool.by_prefix for pool in pools.values()):
            prefixes = PrefixFeed(
                self.redis, learner=router, replica_id=self.ledger.replica_id, timeout_s=timeout_s
            )
            router.on_prefix_routed = prefixes.routed
            self.feeds.append(prefixes)

    async def start(self, stack: contextlib.AsyncExitStack) -> None:
        """Start the shared parts, each stopped and closed on `stack` (the last started
        first): the ledger's refreshes, the limiter's probes, then the feeds; the ledger
        gives its grants back before the client closes."""
        stack.push_async_callback(self.redis.aclose)
        stack.push_async_callback(self.batcher.aclose)
        if self.provider_slots is not None:
            stack.push_async_callback(self.provider_slots.close)
        stack.push_async_callback(self.ledger.close)
        stack.push_async_callback(self.limiter.close)
        stack.push_async_callback(self.provider_limiter.close)
        await start_all(stack, self.ledger, self.limiter, self.provider_slots)
        await start_all(stack, *self.feeds, self.service_feed)
