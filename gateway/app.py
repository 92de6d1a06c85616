"""`create_app(settings)`: every component built once, here, and handed only what it uses."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import os
from collections.abc import AsyncIterator, Mapping

import httpx
from opentelemetry.sdk.trace.export import SpanExporter
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import BaseRoute, Route
from starlette.types import ASGIApp, Receive, Scope, Send

from gateway.admission.adapters import AdapterLoader
from gateway.admission.fleet.backend_load import LoadWatcher, MetricsScrape
from gateway.admission.fleet.backends import FleetWatcher, build_pools
from gateway.admission.ledger.reservations import LocalLedger
from gateway.admission.routing.router import Router
from gateway.batch.api import BatchEndpoints
from gateway.batch.runner import BatchRunner
from gateway.batch.service import Batches
from gateway.batch.store import BatchStore, DirStore, RedisStore
from gateway.clock import Clock, SystemClock
from gateway.config import Settings
from gateway.errors import InvalidRequest, SpillgateError, error_response
from gateway.front.auth import Authenticator, KeyRefusals
from gateway.front.guard import head_bytes, head_too_large
from gateway.front.pipeline import Pipeline, PipelineDeps, endpoint_rules
from gateway.front.preemption import Preemptions
from gateway.front.response_homes import ResponseHomes
from gateway.front.tracing import build_tracing
from gateway.metrics import MULTIPROC_ENV, GatewayMetrics
from gateway.ops.openapi import openapi_route
from gateway.ops.operators import Operators
from gateway.ratelimit import LocalRateLimiter
from gateway.ratelimit.budget import provider_budgets
from gateway.shared_mode import SharedMode
from gateway.slo import Latencies
from gateway.tasks import start_all
from gateway.upstream.forward import AnswerBounds, Forwarder
from gateway.upstream.pool import UpstreamPool
from gateway.upstream.usage import AnswerFlaws
from policies.deps import PolicyDeps
from policies.provider.gate import build_gates
from policies.registry import answer_recorders, arrival_checks, build_chain, service_counters


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
    pools = build_pools(settings.pools, clock=clock, profiles=settings.routing_profiles)
    url = redis_url or env.get(settings.redis.url_env)
    shared = None
    if url:
        shared = SharedMode.connect(
            settings, url, pools=pools, metrics=metrics, clock=clock, workers=workers
        )
    router = Router(pools, ledger=shared.ledger if shared else LocalLedger(), clock=clock)
    if shared is not None:
        shared.feed(router, settings)
    store: BatchStore = DirStore(settings.batch.dir, clock=clock)
    if url:
        store = RedisStore.connect(
            url, timeout_s=settings.batch.redis_timeout_s, cluster=settings.redis.cluster
        )
    batches = Batches(store, settings=settings.batch, pools=pools, clock=clock)
    latencies = Latencies(clock)  # measured on the request path, read by the TTFT ladder
    # the streams in flight that a waiter of a higher class may stop, in pools that allow it
    preempt = {name: pool.settings.preempt for name, pool in pools.items() if pool.settings.preempt}
    preemptions = Preemptions(router, preempt=preempt, clock=clock) if preempt else None
    if shared is not None:  # a waiter at another replica may call on this one's requests
        shared.service_feed.preempts = preemptions
    policy_deps = PolicyDeps(
        settings=settings,
        latencies=latencies,
        room=router,
        metrics=metrics,
        clock=clock,
        redis=shared.redis if shared else None,
        batches=batches,
        service_feed=shared.service_feed if shared else None,
        preempts=preemptions,
        providers=build_gates(
            settings.providers,
            environ=env,
            clock=clock,
            metrics=metrics,
            budgets=provider_budgets(
                shared.provider_limiter if shared else LocalRateLimiter(clock),
                settings.providers,
            ),
            slots=(shared.provider_slots if shared else None) or LocalLedger(),
        ),
    )
    chains = {name: build_chain(pool.settings, policy_deps) for name, pool in pools.items()}
    auth = Authenticator(settings, env, refusals=KeyRefusals(metrics.refused_keys, clock=clock))
    upstream = UpstreamPool(
        max_connections=settings.server.upstream_max_connections,
        max_header_bytes=settings.server.upstream_max_header_bytes,
        max_headers=settings.server.upstream_max_headers,
    )
    # the backends watched: their health and capacity (probes), their own KV use (metrics);
    # and asked to load an adapter none of them serves
    client = httpx.AsyncClient(timeout=httpx.Timeout(10.0))
    loads_told, unloads_told = metrics.adapter_loads, metrics.adapter_unloads
    deps = PipelineDeps(
        adapters=AdapterLoader(
            client=client,
            clock=clock,
            candidates=router.in_rotation,
            on_load=lambda pool, adapter, backend, loaded: loads_told.labels(
                pool, adapter, backend, "loaded" if loaded else "failed"
            ).inc(),
            on_unload=lambda pool, adapter, backend, unloaded: unloads_told.labels(
                pool, adapter, backend, "unloaded" if unloaded else "failed"
            ).inc(),
            on_room=router.room_opened,
        ),
        auth=auth,
        limiter=shared.limiter if shared else LocalRateLimiter(clock),
        router=router,
        chains=chains,
        preemptions=preemptions,
        recorders=answer_recorders(chains),
        arrival_checks=arrival_checks(chains),
        services=service_counters(chains),
        forwarder=Forwarder(
            upstream,
            clock=clock,
            bounds=AnswerBounds(
                body_bytes=settings.server.upstream_max_body_bytes,
                event_bytes=settings.server.upstream_max_event_bytes,
                kept_bytes=settings.server.upstream_max_kept_bytes,
            ),
            flaws=AnswerFlaws(
                corrections=metrics.usage_corrections,
                not_kept=metrics.streams_not_kept,
                clock=clock,
            ),
        ),
        metrics=metrics,
        clock=clock,
        max_body_bytes=settings.server.max_body_bytes,
        request_read_timeout_s=settings.server.request_read_timeout_s,
        tracing=build_tracing(settings.tracing, environ=env, exporter=span_exporter),
        shared=shared is not None,
        latencies=latencies,
        homes=ResponseHomes(redis=shared.redis if shared else None),
    )
    runner = BatchRunner(batches, deps=deps, tenants=auth.by_name)
    scrape = MetricsScrape(client, clock=clock)  # each backend's /metrics, for all readers
    watcher = FleetWatcher(
        pools,
        client=client,
        scrape=scrape,
        clock=clock,
        on_room=router.room_opened,
    )
    loads = LoadWatcher(
        [b for pool in pools.values() if pool.settings.feedback for b in pool.members],
        scrape=scrape,
        clock=clock,
        reserved=router.ledger.tokens_in_flight,
        on_backoff=lambda backend, reason: metrics.fill_backoffs.labels(backend, reason).inc(),
    )
    operators = Operators.build(
        settings, deps, watcher=watcher, env=env, limiter=shared.limiter if shared else None
    )
    pipelines: dict[str, ASGIApp] = {str(r.endpoint): Pipeline(r, deps) for r in endpoint_rules()}
    routes = [
        *(Route(path, pipeline, methods=["POST"]) for path, pipeline in pipelines.items()),
        *operators.routes(),
        *BatchEndpoints(
            batches, auth=auth, max_upload_bytes=settings.batch.max_file_bytes
        ).routes(),
        openapi_route(),
    ]

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        # each part is closed even when one before it fails (Redis gone at shutdown, say),
        # in reverse order of start; the metrics files go last, once nothing writes them
        async with contextlib.AsyncExitStack() as stack:
            stack.callback(metrics.close)
            if deps.tracing is not None:
                # the spans still batched go out off the loop (an export may wait on the
                # collector for its timeout)
                stack.push_async_callback(asyncio.to_thread, deps.tracing.shutdown)
            if shared is None:
                stack.push_async_callback(router.ledger.close)
                stack.push_async_callback(deps.limiter.close)
            stack.push_async_callback(upstream.aclose)
            stack.push_async_callback(client.aclose)
            if deps.adapters is not None:
                stack.push_async_callback(deps.adapters.aclose)
            await start_all(stack, watcher, loads)
            await operators.start(stack)
            if shared is not None:
                await shared.start(stack)
            stack.push_async_callback(store.close)
            await start_all(stack, runner)
            # everything built at start-up lives as long as the process: keep it out of
            # the collector's full passes, which otherwise stall the event loop for tens of ms
            gc.collect()
            gc.freeze()
            yield

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
