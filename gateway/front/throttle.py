"""Throttle: the tenant's token bucket decides, in one atomic call, and its decision is told
in the `x-ratelimit-*` headers; over the limit, the request is refused with a 429 and an
honest `Retry-After` (gateway/front/refusals.py).

With state in Redis, the decision and the request's first try for room start at once, so
that they leave in one batch, one round trip (gateway/redis_io/batch.py); the room goes back
when the bucket refuses. In one process each call finishes at once, and two tasks would
only cost more.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

from gateway.front.auth import Tenant
from gateway.front.exchange import Exchange
from gateway.front.refusals import limiter_refusal
from gateway.metrics import GatewayMetrics
from gateway.ratelimit import Decision, RateLimiter
from gateway.request import InferenceRequest

# a request's first try for room (gateway/front/admit.py): whether it now holds a reservation
FirstTry = Callable[[InferenceRequest, Exchange], Awaitable[bool]]


class Throttle:
    def __init__(self, limiter: RateLimiter, *, metrics: GatewayMetrics) -> None:
        self._limiter = limiter
        self._metrics = metrics

    async def decide(
        self,
        tenant: Tenant,
        request: InferenceRequest,
        headers: list[tuple[bytes, bytes]],
    ) -> None:
        """Charge the tenant's bucket for `request`; refuse it if the bucket says so."""
        decision = await self._limiter.acquire(tenant.limits, request.charge_tokens)
        self._tell(tenant, request, decision, headers)

    async def decide_and_admit(
        self,
        tenant: Tenant,
        request: InferenceRequest,
        headers: list[tuple[bytes, bytes]],
        *,
        exchange: Exchange,
        first_try: FirstTry,
    ) -> bool:
        """`decide`, and the request's first try for room made at the same time: whether it
        holds room now. The room goes back when the bucket refuses, or when either call
        fails."""
        room = asyncio.ensure_future(first_try(request, exchange))
        try:
            decision = await self._limiter.acquire(tenant.limits, request.charge_tokens)
            admitted = await room
        except BaseException:
            room.cancel()
            await asyncio.wait([room])  # ended, however: what it reserved is held, or none
            await exchange.release()
            raise
        if not decision.allowed:
            await exchange.release()
        self._tell(tenant, request, decision, headers)
        return admitted

    def _tell(
        self,
        tenant: Tenant,
        request: InferenceRequest,
        decision: Decision,
        headers: list[tuple[bytes, bytes]],
    ) -> None:
        """Tell the bucket's decision in the headers; raise the refusal if it is one."""
        headers += decision.headers()
        if decision.allowed:
            return
        error = limiter_refusal(decision, tenant=tenant.name, request=request)
        self._metrics.tally.request(request.pool, tenant.name, error.outcome)
        raise error
