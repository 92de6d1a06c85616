"""The status page: `GET /dashboard` (a page, no build step) and `GET /admin/history` (JSON).

A browser cannot put a Bearer token on a navigation, so the page accepts `?token=` once,
moves it into session storage and sends it as `Authorization: Bearer` on every fetch;
without one it shows a login prompt. The page itself carries no data: everything it
shows comes from the admin endpoints, which check the token on every call.

Outcomes over the last minutes come from `OutcomeHistory`, a bounded ring of per-step
deltas of `spillgate_requests_total`, sampled every `step_s` by a Repeat (gateway/tasks.py) that
lives in the app's lifespan.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from importlib import resources

from starlette.requests import Request
from starlette.responses import HTMLResponse, Response
from starlette.routing import BaseRoute, Route

from gateway.admission.routing.router import Router
from gateway.clock import Clock
from gateway.errors import SpillgateError, error_response
from gateway.front.auth import AdminAuth
from gateway.metrics import GatewayMetrics
from gateway.ops.admin import json_response

Counts = dict[str, dict[str, int]]  # pool → outcome → requests


@dataclass(frozen=True, kw_only=True)
class HistoryPoint:
    t: float  # wall-clock seconds at the end of the step
    step_s: float
    outcomes: Counts
    queue_depth: dict[str, float]
    tokens_in_flight: dict[str, int]
    batch_queued_tokens: dict[str, float]  # pool → tokens of batch items waiting for room

    def as_dict(self) -> dict[str, object]:
        return {
            "t": round(self.t, 3),
            "step_s": round(self.step_s, 3),
            "outcomes": self.outcomes,
            "queue_depth": self.queue_depth,
            "tokens_in_flight": self.tokens_in_flight,
            "batch_queued_tokens": self.batch_queued_tokens,
        }


class OutcomeHistory:
    """The last `window_s` of outcomes per pool in steps of `step_s`, oldest dropped first."""

    def __init__(
        self,
        *,
        metrics: GatewayMetrics,
        router: Router,
        clock: Clock,
        step_s: float = 5.0,
        window_s: float = 600.0,
    ) -> None:
        self._metrics = metrics
        self._router = router
        self._clock = clock
        self.step_s = step_s
        self.points: deque[HistoryPoint] = deque(maxlen=max(1, round(window_s / step_s)))
        self._last_totals: Counts = self._totals()
        self._last_t = clock.wall()

    def _totals(self) -> Counts:
        totals: Counts = {}
        self._metrics.flush()
        for family in self._metrics.requests.collect():
            for sample in family.samples:
                if not sample.name.endswith("_total"):
                    continue
                pool, outcome = sample.labels["pool"], sample.labels["outcome"]
                per_pool = totals.setdefault(pool, {})
                per_pool[outcome] = per_pool.get(outcome, 0) + int(sample.value)
        return totals

    def _queue_depth(self) -> dict[str, float]:
        return {
            sample.labels["pool"]: sample.value
            for family in self._metrics.queue_depth.collect()
            for sample in family.samples
        }

    def _batch_queued(self) -> dict[str, float]:
        return {
            sample.labels["pool"]: sample.value
            for family in self._metrics.batch_queued_tokens.collect()
            for sample in family.samples
        }

    def _point(self, totals: Counts, now: float) -> HistoryPoint:
        delta: Counts = {}
        for pool, outcomes in totals.items():
            before = self._last_totals.get(pool, {})
            changed = {o: n - before.get(o, 0) for o, n in outcomes.items() if n > before.get(o, 0)}
            if changed:
                delta[pool] = changed
        ledger = self._router.ledger
        backends = [b.name for p in self._router.pools.values() for b in p.members]
        return HistoryPoint(
            t=now,
            step_s=now - self._last_t,
            outcomes=delta,
            queue_depth=self._queue_depth(),
            tokens_in_flight={name: ledger.tokens_in_flight(name) for name in backends},
            batch_queued_tokens=self._batch_queued(),
        )

    def sample(self) -> HistoryPoint:
        """Close the current step and keep it."""
        now, totals = self._clock.wall(), self._totals()
        point = self._point(totals, now)
        self.points.append(point)
        self._last_totals, self._last_t = totals, now
        return point

    def snapshot(self) -> dict[str, object]:
        """The kept steps, then the step in progress (so far), oldest first."""
        current = self._point(self._totals(), self._clock.wall())
        return {
            "step_s": self.step_s,
            "window_s": self.step_s * (self.points.maxlen or 1),
            "points": [p.as_dict() for p in [*self.points, current]],
        }


def _page() -> str:
    return resources.files("gateway.ops").joinpath("dashboard.html").read_text("utf-8")


class Dashboard:
    """The page and its history endpoint; `/admin/status` (AdminEndpoints) serves the rest."""

    def __init__(self, *, admin: AdminAuth, history: OutcomeHistory) -> None:
        self._admin = admin
        self.history = history
        self._html = _page()

    def routes(self) -> list[BaseRoute]:
        return [
            Route("/dashboard", self.page, methods=["GET"]),
            Route("/admin/history", self.history_json, methods=["GET"]),
        ]

    async def page(self, request: Request) -> Response:
        headers = {"cache-control": "no-store", "referrer-policy": "no-referrer"}
        token = request.query_params.get("token")
        if token is not None:
            try:
                self._admin.check(f"Bearer {token}")
            except SpillgateError:
                return HTMLResponse(self._html, status_code=401, headers=headers)
        return HTMLResponse(self._html, headers=headers)

    async def history_json(self, request: Request) -> Response:
        try:
            self._admin.check(request.headers.get("authorization"))
        except SpillgateError as exc:
            return error_response(exc)
        return json_response(self.history.snapshot())
