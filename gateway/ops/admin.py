"""The gateway's own endpoints: models, health, readiness, metrics and fleet status."""

from __future__ import annotations

import math
import time
from collections.abc import Mapping
from typing import Any

import orjson
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import BaseRoute, Route

from gateway.admission.fleet.backends import Backend, FleetWatcher, Pool
from gateway.admission.routing.router import Router
from gateway.config import Settings
from gateway.errors import SpillgateError, error_response
from gateway.front.auth import AdminAuth, Authenticator
from gateway.metrics import GatewayMetrics
from gateway.overflow import CountsService
from gateway.ratelimit import ResilientRateLimiter
from gateway.slo import Latencies

STARTED = int(time.time())


def json_response(data: Any, status: int = 200) -> Response:
    return Response(orjson.dumps(data), status_code=status, media_type="application/json")


class AdminEndpoints:
    def __init__(
        self,
        *,
        settings: Settings,
        router: Router,
        metrics: GatewayMetrics,
        auth: Authenticator,
        admin: AdminAuth,
        watcher: FleetWatcher,
        latencies: Latencies,
        services: Mapping[str, CountsService] | None = None,
        limiter: ResilientRateLimiter | None = None,  # shared mode's tenant buckets
    ) -> None:
        self._limiter = limiter
        self._latencies = latencies
        self._services = services or {}
        self._settings = settings
        self._router = router
        self._metrics = metrics
        self._auth = auth
        self._admin = admin
        self._watcher = watcher

    def routes(self) -> list[BaseRoute]:
        return [
            Route("/v1/models", self.models, methods=["GET"]),
            Route("/healthz", self.healthz, methods=["GET"]),
            Route("/readyz", self.readyz, methods=["GET"]),
            Route("/metrics", self.prometheus, methods=["GET"]),
            Route("/admin/status", self.status, methods=["GET"]),
        ]

    async def models(self, request: Request) -> Response:
        try:
            tenant = self._auth.tenant(request.headers.get("authorization"))
        except SpillgateError as exc:
            return error_response(exc)
        data = []
        for pool in self._router.pools.values():
            if tenant.may_use(pool.name):
                data.append(self._model(pool))
                data += [
                    self._adapter(pool, a.name)
                    for a in pool.settings.adapters
                    if pool.may_serve(a.name, tenant.name)
                ]
        return json_response({"object": "list", "data": data})

    @staticmethod
    def _model(pool: Pool) -> dict[str, Any]:
        """The pool as vLLM lists a model: its context limit and the weights behind it."""
        return {
            "id": pool.name,
            "object": "model",
            "created": STARTED,
            "owned_by": "spillgate",
            "root": pool.root or pool.name,
            "parent": None,
            "max_model_len": pool.max_model_len,
        }

    @classmethod
    def _adapter(cls, pool: Pool, name: str) -> dict[str, Any]:
        """A LoRA adapter of the pool as vLLM lists one: its `parent` is the pool's model."""
        return {**cls._model(pool), "id": name, "root": name, "parent": pool.name}

    async def healthz(self, request: Request) -> Response:
        return json_response({"status": "ok"})

    async def readyz(self, request: Request) -> Response:
        """Ready once every pool has at least one backend in rotation with known capacity;
        otherwise the pools without one, and why each backend that is down is down."""
        missing = [name for name in self._router.pools if not self._router.in_rotation(name)]
        if missing:
            down = {
                b.name: b.down_reason
                for pool in self._router.pools.values()
                for b in pool.members
                if b.down_reason is not None
            }
            body = {"status": "not ready", "pools_without_capacity": missing, "backends_down": down}
            return json_response(body, 503)
        return json_response({"status": "ready"})

    def publish(self) -> None:
        """This worker's metrics as of now, for whichever worker answers the next scrape."""
        self.refresh_gauges()
        self._metrics.flush()

    def _in_rotation(self, pool: Pool) -> set[Backend]:
        """The pool's backends in rotation whose capacity is known, its prefillers too."""
        serving = self._router.in_rotation(pool.name)
        return {*serving, *self._router.in_rotation(pool.name, prefill=True)}

    def refresh_gauges(self) -> None:
        m = self._metrics
        if self._limiter is not None:
            m.ratelimit_degraded_tenants.set(len(self._limiter.degraded()))
        for name, pool in self._router.pools.items():
            capacity = 0
            in_rotation = self._in_rotation(pool)
            for backend in pool.members:
                cap = self._router.capacity(backend)
                capacity += cap if backend.role != "prefill" else 0
                m.capacity_tokens.labels(backend.name).set(cap)
                m.inflight_tokens.labels(backend.name).set(
                    self._router.ledger.tokens_in_flight(backend.name)
                )
                m.active_sessions.labels(backend.name).set(
                    self._router.ledger.sessions(backend.name)
                )
                m.backend_healthy.labels(backend.name).set(1.0 if backend in in_rotation else 0.0)
                load = backend.reported_load(self._router.clock.monotonic())
                m.backend_kv_usage.labels(backend.name).set(
                    math.nan if load is None else load.kv_usage
                )
                m.backend_waiting.labels(backend.name).set(0 if load is None else load.waiting)
                m.effective_fill.labels(backend.name).set(self._router.effective_fill(backend))
                predicted = pool.prefixes.hit_rate(backend.name)
                m.prefix_index_hit.labels(backend.name).set(
                    math.nan if predicted is None else predicted
                )
                own = None if load is None else load.prefix_hit_rate
                m.backend_prefix_hit.labels(backend.name).set(math.nan if own is None else own)
            self._adapter_gauges(pool)
            fill = self._router.pool_fill(name)
            m.pool_fill.labels(name).set(fill if math.isfinite(fill) else 1.0)
            m.pool_demand.labels(name).set(pool.demand.tokens_per_s())
            per_backend = capacity / len(pool.backends) if pool.backends else 0.0
            m.pool_desired_backends.labels(name).set(
                pool.demand.desired_backends(
                    backend_capacity=per_backend, target_fill=pool.settings.target_fill
                )
            )

    def _adapter_gauges(self, pool: Pool) -> None:
        """Where each of the pool's adapters is served, and where it runs now."""
        now = self._router.clock.monotonic()
        loads = [b.reported_load(now) for b in pool.backends]
        for adapter in pool.settings.adapters:
            name = adapter.name
            serving = sum(name in b.adapters for b in pool.backends)
            active = sum(load is not None and name in load.active_adapters for load in loads)
            gauge = self._metrics.adapter_backends
            gauge.labels(pool.name, name, "serving").set(serving)
            gauge.labels(pool.name, name, "active").set(active)

    async def prometheus(self, request: Request) -> Response:
        self.refresh_gauges()
        return Response(self._metrics.render(), media_type=CONTENT_TYPE_LATEST)

    def _load(self, backend: Backend) -> dict[str, Any]:
        """What the backend reports holding, and the fill admission aims at there."""
        load = backend.reported_load(self._router.clock.monotonic())
        return {
            "reserved_tokens": self._router.ledger.tokens_in_flight(backend.name),
            "reported_kv_usage": None if load is None else load.kv_usage,
            "reported_kv_tokens": self._router.reported_tokens(backend),
            "requests_waiting": None if load is None else load.waiting,
            "preemptions": None if load is None else load.preemptions,
            # the LoRA adapters its steps run now (vllm:lora_requests_info)
            "active_adapters": [] if load is None else sorted(load.active_adapters),
            "effective_fill": self._router.effective_fill(backend),
            "fill_reason": backend.fill.reason.value,
            # what the backend held per reserved token at the highest recent peak: the
            # calibration behind an effective fill above the target
            "held_per_reserved": backend.fill.held_per_reserved,
            "fill_backoffs": {r.value: n for r, n in backend.fill.backoffs.items()},
            "prefix_cache": {
                # what the prefix index expected of the prompts routed here, and what the
                # backend's own counters say it found
                "index_hit_rate": self._router.pools[backend.pool].prefixes.hit_rate(backend.name),
                "backend_hit_rate": None if load is None else load.prefix_hit_rate,
                **self._index(backend),
            },
        }

    def _index(self, backend: Backend) -> dict[str, Any]:
        """Which index scores the backend: `events` (what its KV events report, with how far
        behind that view is) while its subscriber is connected, else `routed`."""
        view = self._router.pools[backend.pool].events.get(backend.name)
        if view is None:
            return {"index": "routed", "events": None}
        status = view.status(self._router.clock.monotonic())
        return {"index": "events" if view.connected else "routed", "events": status}

    async def status(self, request: Request) -> Response:
        try:
            self._admin.check(request.headers.get("authorization"))
        except SpillgateError as exc:
            return error_response(exc)
        pools = []
        now = self._router.clock.monotonic()
        for name, pool in self._router.pools.items():
            in_rotation = self._in_rotation(pool)
            backends = [
                {
                    "name": b.name,
                    "url": b.url,
                    "served_model": b.served_model,
                    "role": b.role,
                    "capacity_tokens": self._router.capacity(b),
                    "capacity_source": "config" if b.configured_capacity else "metrics",
                    "limit_tokens": self._router.limit(b),
                    "tokens_in_flight": self._router.ledger.tokens_in_flight(b.name),
                    **self._load(b),
                    "active_sessions": self._router.ledger.sessions(b.name),
                    "healthy": b in in_rotation,
                    "state": "down" if b.down_reason is not None else "up",
                    # the health machine's word (gateway/admission/fleet/health.py)
                    "health": b.health.state(now).value,
                    "down_reason": b.down_reason,
                    "max_model_len": b.max_model_len,
                    "adapters": sorted(b.adapters),
                }
                for b in pool.members
            ]
            down = pool.outage() is not None
            service = self._services.get(name)
            pools.append(
                {
                    "name": name,
                    "target_fill": pool.settings.target_fill,
                    # no backend up: the pool is not full, it has nothing to fill
                    "fill_ratio": None if down else self._router.pool_fill(name),
                    "state": "down" if down else "up",
                    "max_model_len": pool.max_model_len,
                    "overflow": pool.settings.overflow,
                    "routing": pool.settings.routing,
                    "reservation": {
                        "mode": pool.settings.reservation.mode,
                        "quantile_of": pool.settings.reservation.quantile_of,
                        "hold": pool.settings.reservation.hold,
                        # what a request with an empty prompt reserves now
                        "expected_output_tokens": pool.outputs.expected(
                            room=self._router.room(name)
                        ),
                        "samples": pool.outputs.samples(),
                        # where the lengths reserved by come from: answers, replicas,
                        # backends or prior
                        "source": pool.outputs.source(),
                    },
                    # the queue's order: what each tenant was served lately (None: the
                    # pool has no queue), the fleet's figures in shared mode
                    "attained_service": None if service is None else service.attained(),
                    "backends": backends,
                }
            )
        status = {"pools": pools, "latencies": self._latencies.snapshot()}
        if self._limiter is not None:
            status["ratelimit"] = self._ratelimit(now)
        return json_response(status)

    def _ratelimit(self, now: float) -> dict[str, Any]:
        """Shared mode's tenant buckets: the mode, and each tenant this replica answers
        without the store (its Redis Cluster slot did not answer), for how long."""
        assert self._limiter is not None
        return {
            "mode": self._limiter.mode,
            "degraded": [
                {"tenant": d.tenant, "slot": d.slot, "for_s": round(now - d.since, 3)}
                for d in self._limiter.degraded()
            ],
        }
