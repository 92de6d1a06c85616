"""Spill to the pool's external provider while its breaker, budget and concurrency allow.

A provider failure before the first byte (5xx, 429, timeout, connection error) counts
against its breaker and passes the request to the next policy; a 429's `Retry-After`
keeps the breaker open that long. Spend is counted per provider from the real usage.
"""

from __future__ import annotations

import logging
from typing import ClassVar

from gateway.config import PoolSettings
from gateway.exchange import Exchange, Served
from gateway.forward import UpstreamUnavailable
from gateway.metrics import GatewayMetrics
from gateway.outcome import Outcome
from gateway.providers import ProviderGate, Refusal
from gateway.request import InferenceRequest
from policies.base import PolicyDeps

log = logging.getLogger("spillgate.provider")


class ProviderPolicy:
    name: ClassVar[str] = "provider"

    def __init__(self, *, gate: ProviderGate, metrics: GatewayMetrics) -> None:
        self._gate = gate
        self._metrics = metrics

    @classmethod
    def build(cls, pool: PoolSettings, deps: PolicyDeps) -> ProviderPolicy:
        if pool.provider is None or pool.provider not in deps.providers:
            raise ValueError(f"pool {pool.name!r}: the provider policy needs a configured provider")
        return cls(gate=deps.providers[pool.provider], metrics=deps.metrics)

    async def serve(self, request: InferenceRequest, exchange: Exchange) -> Served | None:
        gate = self._gate
        ticket = await gate.acquire(request.reserved_tokens)
        if isinstance(ticket, Refusal):
            log.debug("provider %s passes %s: %s", gate.name, request.pool, ticket)
            return None
        try:
            served = await exchange.serve_target(
                gate.target(request.pool),
                request,
                outcome=Outcome.PROVIDER,
                public_model=request.pool,
            )
        except UpstreamUnavailable as exc:
            # the breaker first: nothing awaited below may leave a half-open trial claimed
            gate.breaker.record_failure(retry_after=exc.retry_after)
            self._metrics.upstream_errors.labels(gate.name, exc.reason.split(":")[0]).inc()
            await gate.release(ticket, used=0)  # refused before generating: budget comes back
            return None
        except BaseException:  # cancelled mid-answer: keep the budget spent, free the slot
            gate.breaker.release_trial()
            await gate.release(ticket, used=None)
            raise
        self._settle(served)
        usage = served.relayed.usage
        await gate.release(ticket, used=usage.total if usage.known else None)
        return served

    def _settle(self, served: Served) -> None:
        gate, usage = self._gate, served.relayed.usage
        if served.relayed.completed:
            gate.breaker.record_success()
        else:
            gate.breaker.record_failure()
        if usage.known:
            cost = gate.cost(
                prompt_tokens=usage.prompt_tokens, completion_tokens=usage.completion_tokens
            )
            self._metrics.provider_cost.labels(gate.name).inc(cost)
