"""What answers operators, built once by `create_app`: `/admin/status`, `/metrics`, the
health checks and the models list (gateway/ops/admin.py), the dashboard and the outcome
history it draws (gateway/ops/dashboard.py), and, with several workers, each worker's
gauges written where the metrics endpoint reads them."""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from dataclasses import dataclass

from starlette.routing import BaseRoute

from gateway.admission.fleet.backends import FleetWatcher
from gateway.config import Settings
from gateway.front.auth import AdminAuth
from gateway.front.pipeline import PipelineDeps
from gateway.metrics import PUBLISH_S
from gateway.ops.admin import AdminEndpoints
from gateway.ops.dashboard import Dashboard, OutcomeHistory
from gateway.ratelimit import ResilientRateLimiter
from gateway.tasks import Repeat, start_all


@dataclass(frozen=True, kw_only=True)
class Operators:
    admin: AdminEndpoints
    dashboard: Dashboard
    history: OutcomeHistory
    publish: bool  # several workers: each writes its gauges for the metrics endpoint

    @classmethod
    def build(
        cls,
        settings: Settings,
        deps: PipelineDeps,
        *,
        watcher: FleetWatcher,
        env: Mapping[str, str],
        limiter: ResilientRateLimiter | None = None,
    ) -> Operators:
        admin_auth = AdminAuth(env.get(settings.server.admin_token_env), deps.auth)
        history = OutcomeHistory(metrics=deps.metrics, router=deps.router, clock=deps.clock)
        return cls(
            admin=AdminEndpoints(
                settings=settings,
                router=deps.router,
                metrics=deps.metrics,
                auth=deps.auth,
                admin=admin_auth,
                watcher=watcher,
                latencies=deps.latencies,
                services=deps.services,
                limiter=limiter,
            ),
            dashboard=Dashboard(admin=admin_auth, history=history),
            history=history,
            publish=deps.metrics.multiprocess_dir is not None,
        )

    def routes(self) -> list[BaseRoute]:
        return [*self.admin.routes(), *self.dashboard.routes()]

    async def start(self, stack: contextlib.AsyncExitStack) -> None:
        """Sample the outcome history, and publish this worker's gauges, until `stack`
        closes."""
        history = self.history
        steps = Repeat(history.sample, every_s=history.step_s, name="history", wait_first=True)
        publish = Repeat(self.admin.publish, every_s=PUBLISH_S, name="publish")
        await start_all(stack, steps, publish if self.publish else None)
