"""`create_app(settings)`: every component built once, here, and handed only what it uses."""

from __future__ import annotations

import contextlib
import os
from collections.abc import AsyncIterator, Mapping

import httpx
import redis.asyncio as aioredis
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from gateway.admin import AdminEndpoints
from gateway.auth import AdminAuth, Authenticator
from gateway.backends import FleetWatcher, build_pools
from gateway.clock import Clock, SystemClock
from gateway.config import Settings
from gateway.errors import InvalidRequest, SpillgateError, error_response
from gateway.forward import Forwarder
from gateway.ledger import LocalLedger
from gateway.metrics import GatewayMetrics
from gateway.pipeline import CompletionsEndpoint, PipelineDeps
from gateway.providers import build_gates
from gateway.ratelimit import LocalRateLimiter, RateLimiter, RedisRateLimiter, ResilientRateLimiter
from gateway.request import Endpoint
from gateway.router import Router
from policies.base import PolicyDeps
from policies.registry import answer_taps, build_chain, unknown_policies


def _redis_client(settings: Settings, url: str) -> aioredis.Redis:
    timeout = settings.redis.timeout_ms / 1000
    return aioredis.Redis.from_url(
        url, socket_timeout=timeout, socket_connect_timeout=timeout, health_check_interval=30
    )


def _limiter(
    settings: Settings, redis: aioredis.Redis | None, metrics: GatewayMetrics, clock: Clock
) -> RateLimiter:
    local = LocalRateLimiter(clock)
    if redis is None:
        return local
    rl = settings.ratelimit
    return ResilientRateLimiter(
        RedisRateLimiter(redis),
        fallback=local,
        failure_mode=rl.failure_mode,
        replicas=rl.replicas,
        timeout_s=settings.redis.timeout_ms / 1000,
        failure_threshold=rl.failure_threshold,
        cooldown_s=rl.cooldown_s,
        clock=clock,
        on_store_error=metrics.ratelimit_store_errors.inc,
        on_mode_change=metrics.set_ratelimit_mode,
    )


def create_app(
    settings: Settings,
    *,
    environ: Mapping[str, str] | None = None,
    clock: Clock | None = None,
    redis_url: str | None = None,
) -> Starlette:
    env = dict(os.environ if environ is None else environ)
    clock = clock or SystemClock()
    problems = unknown_policies(settings.pools)
    if problems:
        raise SpillgateError("invalid overflow chain: " + "; ".join(problems))
    metrics = GatewayMetrics()
    url = redis_url or env.get(settings.redis.url_env)
    redis = _redis_client(settings, url) if url else None
    limiter = _limiter(settings, redis, metrics, clock)
    pools = build_pools(settings.pools, clock=clock)
    router = Router(pools, ledger=LocalLedger(), clock=clock)
    client = httpx.AsyncClient(
        limits=httpx.Limits(
            max_connections=settings.server.upstream_max_connections,
            max_keepalive_connections=settings.server.upstream_max_connections,
            keepalive_expiry=30,
        ),
        timeout=httpx.Timeout(10.0),
    )
    policy_deps = PolicyDeps(
        settings=settings,
        router=router,
        metrics=metrics,
        clock=clock,
        redis=redis,
        providers=build_gates(settings.providers, environ=env, clock=clock, metrics=metrics),
    )
    chains = {name: build_chain(pool.settings, policy_deps) for name, pool in pools.items()}
    auth = Authenticator(settings, env)
    deps = PipelineDeps(
        auth=auth,
        limiter=limiter,
        router=router,
        chains=chains,
        taps=answer_taps(chains),
        forwarder=Forwarder(client),
        metrics=metrics,
        clock=clock,
        max_body_bytes=settings.server.max_body_bytes,
    )
    watcher = FleetWatcher(pools, client=client, clock=clock)
    admin = AdminEndpoints(
        settings=settings,
        router=router,
        metrics=metrics,
        auth=auth,
        admin=AdminAuth(env.get(settings.server.admin_token_env), auth),
        watcher=watcher,
    )

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        await watcher.refresh_once()
        watcher.start()
        try:
            yield
        finally:
            await watcher.stop()
            await client.aclose()
            await limiter.close()
            await router.ledger.close()
            if redis is not None:
                await redis.aclose()

    routes = [
        Route(Endpoint.CHAT, CompletionsEndpoint(Endpoint.CHAT, deps), methods=["POST"]),
        Route(
            Endpoint.COMPLETIONS, CompletionsEndpoint(Endpoint.COMPLETIONS, deps), methods=["POST"]
        ),
        *admin.routes(),
    ]
    return Starlette(
        routes=routes,
        lifespan=lifespan,
        exception_handlers={HTTPException: _http_error, Exception: _server_error},
    )


async def _http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    error = InvalidRequest(f"{request.method} {request.url.path}: {exc.detail}")
    error.status = exc.status_code
    error.code = "not_found" if exc.status_code == 404 else "method_not_allowed"
    return error_response(error, exc.headers)


async def _server_error(request: Request, exc: Exception) -> Response:
    return error_response(SpillgateError("The gateway failed to handle this request."))
