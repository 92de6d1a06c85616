"""`create_app(settings)`: every component built once, here, and handed only what it uses."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import os
from collections.abc import AsyncIterator, Mapping

import httpx
import redis.asyncio as aioredis
import redis.exceptions
from opentelemetry.sdk.trace.export import SpanExporter
from redis.asyncio.cluster import RedisCluster
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import BaseRoute, Route
from starlette.types import ASGIApp, Receive, Scope, Send

from gateway.admission.backend_load import LoadWatcher, MetricsScrape
from gateway.admission.backends import FleetWatcher, Pool, build_pools
from gateway.admission.ledger import LocalLedger
from gateway.admission.ledger_redis import RedisLedger
from gateway.admission.router import Router
from gateway.batch.api import BatchEndpoints
from gateway.batch.runner import BatchRunner
from gateway.batch.service import Batches
from gateway.batch.store import BatchStore, DirStore, RedisStore
from gateway.clock import Clock, SystemClock
from gateway.config import Settings
from gateway.errors import InvalidRequest, SpillgateError, error_response
from gateway.front.auth import AdminAuth, Authenticator
from gateway.front.guard import head_bytes, head_too_large
from gateway.front.pipeline import Pipeline, PipelineDeps, endpoint_rules
from gateway.front.response_homes import ResponseHomes
from gateway.front.tracing import build_tracing
from gateway.metrics import MULTIPROC_ENV, PUBLISH_S, GatewayMetrics
from gateway.ops.admin import AdminEndpoints
from gateway.ops.dashboard import Dashboard, OutcomeHistory
from gateway.ops.openapi import openapi_route
from gateway.ratelimit import LocalRateLimiter, RateLimiter, RedisRateLimiter, ResilientRateLimiter
from gateway.ratelimit.budget import provider_budgets
from gateway.shared.batch import RedisBatcher
from gateway.shared.ledger_feed import ReleaseFeed
from gateway.shared.length_feed import LengthFeed
from gateway.shared.prefix_feed import PrefixFeed
from gateway.shared.service_feed import ServiceFeed
from gateway.slo import Latencies
from gateway.tasks import Repeat, start_all
from gateway.upstream.forward import Forwarder
from gateway.upstream.pool import UpstreamPool
from policies.deps import PolicyDeps
from policies.provider.gate import build_gates
from policies.registry import answer_recorders, arrival_checks, build_chain, service_counters

REDIS_POOL_SIZE = 64  # connections per process


def redis_client(settings: Settings, url: str) -> aioredis.Redis | RedisCluster:
    """One client per process, shared by the limiter, the ledger and the cache.

    Script calls reach it through one RedisBatcher (gateway/shared/batch.py), which never
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


def _timeout_max_s(settings: Settings) -> float:
    return max(settings.redis.timeout_ms, settings.redis.timeout_max_ms) / 1000


def _shared_limiter(
    settings: Settings,
    redis: RedisBatcher,
    metrics: GatewayMetrics,
    clock: Clock,
    *,
    workers: int,
    for_providers: bool = False,
) -> ResilientRateLimiter:
    """Token buckets shared through Redis.

    Tenants' buckets follow the configured failure mode; providers' budgets always fall
    back to this process's share, so a Redis outage neither stops spilling nor multiplies
    a provider's budget by the replica count.
    """
    rl = settings.ratelimit
    return ResilientRateLimiter(
        RedisRateLimiter(
            redis,
            key_prefix="spillgate:provider" if for_providers else "spillgate",
            timeout_s=settings.redis.timeout_ms / 1000,
            timeout_max_s=_timeout_max_s(settings),
            slice_s=settings.ratelimit.slice_s,
        ),
        fallback=LocalRateLimiter(clock),
        failure_mode="local" if for_providers else rl.failure_mode,
        replicas=rl.replicas * workers,
        timeout_s=settings.redis.timeout_ms / 1000,
        timeout_max_s=_timeout_max_s(settings),
        failure_threshold=rl.failure_threshold,
        cooldown_s=rl.cooldown_s,
        clock=clock,
        on_store_error=metrics.ratelimit_store_errors.inc,
        on_mode_change=(lambda mode: None) if for_providers else metrics.set_ratelimit_mode,
    )


def _shared_ledger(
    settings: Settings,
    redis: RedisBatcher,
    pools: dict[str, Pool],
    metrics: GatewayMetrics,
    clock: Clock,
    *,
    workers: int,
) -> RedisLedger:
    """In-flight tokens in Redis; while Redis is away, each process admits on its share."""
    return RedisLedger(
        redis,
        backends=[b.name for pool in pools.values() for b in pool.backends],
        clock=clock,
        lease_ttl_s=settings.ledger.lease_ttl_s,
        refresh_s=settings.ledger.refresh_s,
        timeout_s=settings.redis.timeout_ms / 1000,
        timeout_max_s=_timeout_max_s(settings),
        fallback_share=settings.ratelimit.replicas * workers,
        spare=settings.ledger.spare,
        on_store_error=metrics.ledger_store_errors.inc,
        on_mode_change=metrics.set_ledger_mode,
    )


def _provider_slots(
    settings: Settings,
    redis: RedisBatcher,
    metrics: GatewayMetrics,
    clock: Clock,
    *,
    workers: int,
) -> RedisLedger:
    """Providers' concurrency slots, one cap for the fleet: a lease of one per request."""
    return RedisLedger(
        redis,
        backends=[p.name for p in settings.providers],
        clock=clock,
        key_prefix="spillgate:provider",
        lease_ttl_s=settings.ledger.lease_ttl_s,
        refresh_s=settings.ledger.refresh_s,
        timeout_s=settings.redis.timeout_ms / 1000,
        timeout_max_s=_timeout_max_s(settings),
        fallback_share=settings.ratelimit.replicas * workers,
        spare=settings.ledger.spare,
        on_store_error=metrics.ledger_store_errors.inc,
    )


def create_app(
    settings: Settings,
    *,
    environ: Mapping[str, str] | None = None,
    clock: Clock | None = None,
    redis_url: str | None = None,
    workers: int = 1,
    span_exporter: SpanExporter | None = None,
) -> FrontDoor:
    """The gateway; `workers` is how many processes of this replica share its Redis.

    `span_exporter` takes the place of the OTLP exporter when tracing is on (tests use an
    in-memory one)."""
    env = dict(os.environ if environ is None else environ)
    clock = clock or SystemClock()
    metrics = GatewayMetrics(multiprocess_dir=env.get(MULTIPROC_ENV))
    url = redis_url or env.get(settings.redis.url_env)
    redis = redis_client(settings, url) if url else None
    batcher = RedisBatcher(redis) if redis is not None else None
    shared_limiter = None
    if batcher is not None:
        shared_limiter = _shared_limiter(settings, batcher, metrics, clock, workers=workers)
    limiter: RateLimiter = shared_limiter or LocalRateLimiter(clock)
    pools = build_pools(settings.pools, clock=clock)
    shared = None
    feed = None
    if batcher is not None:
        shared = _shared_ledger(settings, batcher, pools, metrics, clock, workers=workers)
    router = Router(pools, ledger=shared or LocalLedger(), clock=clock)
    if redis is not None and shared is not None:
        feed = ReleaseFeed(
            redis, ledger=shared, waker=router, timeout_s=settings.redis.timeout_ms / 1000
        )
    lengths = None
    if batcher is not None and any(pool.outputs.learns() for pool in pools.values()):
        lengths = LengthFeed(
            batcher=batcher, pools=pools, timeout_s=settings.redis.timeout_ms / 1000
        )
    prefix_feed = None
    by_prefix = any(pool.settings.routing == "prefix" for pool in pools.values())
    if redis is not None and shared is not None and by_prefix:
        prefix_feed = PrefixFeed(
            redis,
            learner=router,
            replica_id=shared.replica_id,
            timeout_s=settings.redis.timeout_ms / 1000,
        )
        router.on_prefix_routed = prefix_feed.routed
    provider_slots = None
    if batcher is not None and settings.providers:
        provider_slots = _provider_slots(settings, batcher, metrics, clock, workers=workers)
    provider_limiter: RateLimiter = LocalRateLimiter(clock)
    if batcher is not None:
        provider_limiter = _shared_limiter(
            settings, batcher, metrics, clock, workers=workers, for_providers=True
        )
    upstream = UpstreamPool(
        max_connections=settings.server.upstream_max_connections,
        max_header_bytes=settings.server.upstream_max_header_bytes,
        max_headers=settings.server.upstream_max_headers,
    )
    client = httpx.AsyncClient(timeout=httpx.Timeout(10.0))  # capacity discovery and probes
    store: BatchStore = DirStore(settings.batch.dir, clock=clock)
    if url:
        store = RedisStore.connect(url, timeout_s=settings.batch.redis_timeout_s)
    batches = Batches(store, settings=settings.batch, pools=pools, clock=clock)
    latencies = Latencies(clock)  # measured on the request path, read by the TTFT ladder
    service_feed = (
        None  # the queues' tenants' service and waiters, shared (gateway/shared/service_feed.py)
    )
    if batcher is not None:
        service_feed = ServiceFeed(
            batcher=batcher, redis=redis, timeout_s=settings.redis.timeout_ms / 1000
        )
    policy_deps = PolicyDeps(
        settings=settings,
        latencies=latencies,
        room=router,
        metrics=metrics,
        clock=clock,
        redis=redis,
        batches=batches,
        service_feed=service_feed,
        providers=build_gates(
            settings.providers,
            environ=env,
            clock=clock,
            metrics=metrics,
            budgets=provider_budgets(provider_limiter, settings.providers),
            slots=provider_slots or LocalLedger(),
        ),
    )
    chains = {name: build_chain(pool.settings, policy_deps) for name, pool in pools.items()}
    auth = Authenticator(settings, env)
    tracing = build_tracing(settings.tracing, environ=env, exporter=span_exporter)
    services = service_counters(chains)
    deps = PipelineDeps(
        auth=auth,
        limiter=limiter,
        router=router,
        chains=chains,
        recorders=answer_recorders(chains),
        arrival_checks=arrival_checks(chains),
        services=services,
        forwarder=Forwarder(upstream, clock=clock),
        metrics=metrics,
        clock=clock,
        max_body_bytes=settings.server.max_body_bytes,
        request_read_timeout_s=settings.server.request_read_timeout_s,
        tracing=tracing,
        shared=redis is not None,
        latencies=latencies,
        homes=ResponseHomes(redis=redis),
    )
    runner = BatchRunner(batches, deps=deps, tenants=auth.by_name)
    batch_api = BatchEndpoints(batches, auth=auth, max_upload_bytes=settings.batch.max_file_bytes)
    scrape = MetricsScrape(client, clock=clock)  # each backend's /metrics, for all readers
    watcher = FleetWatcher(pools, client=client, scrape=scrape, clock=clock)
    loads = LoadWatcher(
        [b for pool in pools.values() if pool.settings.feedback for b in pool.backends],
        scrape=scrape,
        clock=clock,
        reserved=router.ledger.tokens_in_flight,
        on_backoff=lambda backend, reason: metrics.fill_backoffs.labels(backend, reason).inc(),
    )
    admin_auth = AdminAuth(env.get(settings.server.admin_token_env), auth)
    admin = AdminEndpoints(
        settings=settings,
        router=router,
        metrics=metrics,
        auth=auth,
        admin=admin_auth,
        watcher=watcher,
        latencies=latencies,
        services=services,
    )
    history = OutcomeHistory(metrics=metrics, router=router, clock=clock)
    dashboard = Dashboard(admin=admin_auth, history=history)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        # each part is closed even when one before it fails (Redis gone at shutdown, say),
        # in reverse order of start; the metrics files go last, once nothing writes them
        async with contextlib.AsyncExitStack() as stack:
            stack.callback(metrics.close)
            if tracing is not None:
                # the spans still batched go out off the loop (an export may wait on the
                # collector for its timeout)
                stack.push_async_callback(asyncio.to_thread, tracing.shutdown)
            if redis is not None:
                stack.push_async_callback(redis.aclose)
            if batcher is not None:
                stack.push_async_callback(batcher.aclose)
            if provider_slots is not None:
                stack.push_async_callback(provider_slots.close)
            stack.push_async_callback(router.ledger.close)
            stack.push_async_callback(limiter.close)
            stack.push_async_callback(upstream.aclose)
            stack.push_async_callback(client.aclose)
            steps = Repeat(history.sample, every_s=history.step_s, name="history", wait_first=True)
            await start_all(stack, watcher, loads, steps, shared, shared_limiter, provider_slots)
            await start_all(stack, lengths, feed, prefix_feed, service_feed)
            stack.push_async_callback(store.close)
            runner.start()
            stack.push_async_callback(runner.stop)
            if metrics.multiprocess_dir is not None:
                await start_all(stack, Repeat(admin.publish, every_s=PUBLISH_S, name="publish"))
            # everything built at start-up lives as long as the process: keep it out of
            # the collector's full passes, which otherwise stall the event loop for tens of ms
            gc.collect()
            gc.freeze()
            yield

    pipelines: dict[str, ASGIApp] = {str(r.endpoint): Pipeline(r, deps) for r in endpoint_rules()}
    routes = [
        *(Route(path, pipeline, methods=["POST"]) for path, pipeline in pipelines.items()),
        *admin.routes(),
        *batch_api.routes(),
        *dashboard.routes(),
        openapi_route(),
    ]
    app = Starlette(
        routes=routes,
        lifespan=lifespan,
        exception_handlers={HTTPException: _http_error, Exception: _server_error},
    )
    # Starlette would answer `/dashboard/` with a redirect to an absolute URL built from the
    # request's Host header, query string (and admin token) included: a 404 instead
    app.router.redirect_slashes = False
    return FrontDoor(pipelines, app, max_header_bytes=settings.server.max_header_bytes)


class FrontDoor:
    """Pure ASGI, and the app uvicorn serves. An HTTP request whose target and headers
    exceed `max_header_bytes` gets a 431 before any handler runs (gateway/front/guard.py);
    completion POSTs go straight to their endpoint, past Starlette's routing and
    middleware (they render their own errors); everything else goes to the app. One
    layer for both, as every layer is a frame each request passes through on every wait.
    """

    def __init__(
        self, fast: Mapping[str, ASGIApp], app: Starlette, *, max_header_bytes: int
    ) -> None:
        self._fast = dict(fast)
        self.app = app
        self._max_header_bytes = max_header_bytes

    @property
    def routes(self) -> list[BaseRoute]:
        return self.app.routes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            if head_bytes(scope) > self._max_header_bytes:
                await head_too_large(self._max_header_bytes)(scope, receive, send)
                return
            if scope["method"] == "POST":
                endpoint = self._fast.get(scope["path"])
                if endpoint is not None:
                    await endpoint(scope, receive, send)
                    return
        await self.app(scope, receive, send)


async def _http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    error = InvalidRequest(f"{request.method} {request.url.path}: {exc.detail}")
    error.status = exc.status_code
    error.code = "not_found" if exc.status_code == 404 else "method_not_allowed"
    error.headers.update(exc.headers or {})  # Allow, on a 405
    return error_response(error)


async def _server_error(request: Request, exc: Exception) -> Response:
    return error_response(SpillgateError("The gateway failed to handle this request."))
