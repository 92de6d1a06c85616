"""Settle: whatever ended the request, its reservation is released, the tenant's bucket is
refunded what the answer did not use, and one outcome is recorded: the request's tally,
its time to first token, the tokens it used, what the step that served it took (the
ladder's measurements, gateway/slo.py), what its tenant was served (the queue's order), and
what the pool learns of its prompts and answers.
"""

from __future__ import annotations

import asyncio
import dataclasses

from gateway.admission.fleet.backends import Pool
from gateway.clock import Clock
from gateway.front.auth import Tenant
from gateway.front.exchange import Exchange
from gateway.metrics import GatewayMetrics
from gateway.outcome import Outcome
from gateway.overflow import CountsService
from gateway.ratelimit import RateLimiter
from gateway.request import InferenceRequest
from gateway.slo import Latencies, Prediction
from gateway.upstream.served import Served


@dataclasses.dataclass(frozen=True, kw_only=True)
class Settlement:
    limiter: RateLimiter
    metrics: GatewayMetrics
    latencies: Latencies
    services: dict[str, CountsService]  # pool → what counts its tenants' service
    clock: Clock
    # with state in Redis, the release and the bucket's refund leave at once, in one
    # batch (gateway/front/throttle.py says why)
    shared: bool = False
    # False for a batch item: a refusal nobody sees (it runs on a later pass) is not a
    # `rejected` request, and nobody waits for its first token, so it stays out of the
    # TTFT that interactive latency and the autoscalers read
    interactive: bool = True

    async def settle(
        self,
        tenant: Tenant,
        request: InferenceRequest,
        pool: Pool,
        exchange: Exchange,
        served: Served | None,
        outcome: Outcome,
        *,
        cut: bool,
        arrived: float,
        began: float,
    ) -> None:
        """Settle `request`, which ended as `outcome`: release, refund and record, whatever
        else fails. `cut`: the answer had begun when the request ended without one (the
        client left mid-stream); `arrived`, when it came; `began`, when its pool's demand
        counted it (gateway/admission/fleet/demand.py)."""
        charged = request.charge_tokens
        # the tokens really used (a checked usage: gateway/upstream/usage.py); unknown
        # when `cut`, so the charge stands
        used = _used(request, served, cut=cut)
        held = exchange.held
        try:
            # the reservation and the tenant's bucket each settle to the end, whatever the
            # other does: an error in one must not keep the other
            if used == charged:
                await held.release()
            elif self.shared:
                refund = self.limiter.reconcile(tenant.limits, charged=charged, used=used)
                results = await asyncio.gather(held.release(), refund, return_exceptions=True)
                for result in results:
                    if isinstance(result, BaseException):
                        raise result
            else:
                try:
                    await held.release()
                finally:
                    await self.limiter.reconcile(tenant.limits, charged=charged, used=used)
        finally:
            refused = outcome is Outcome.REJECTED
            pool.demand.end(charged, started=began, used=used, refused=refused)
            self._record(
                request, pool, served, outcome, arrived=arrived, prediction=exchange.prediction
            )

    def _record(
        self,
        request: InferenceRequest,
        pool: Pool,
        served: Served | None,
        outcome: Outcome,
        *,
        arrived: float,
        prediction: Prediction | None = None,
    ) -> None:
        """Record the request's one outcome, and what its answer teaches the pool."""
        if not self.interactive:
            if outcome is Outcome.REJECTED:
                return
            if served is not None:
                relayed = dataclasses.replace(served.relayed, first_byte_at=None)
                served = dataclasses.replace(served, relayed=relayed)
        tally = self.metrics.tally
        tally.request(request.pool, request.tenant, outcome)
        if request.adapter is not None:
            self.metrics.adapter_requests.labels(request.pool, request.adapter, outcome).inc()
        if served is None:
            return
        relayed = served.relayed
        usage = relayed.usage
        if relayed.first_byte_at is not None:
            tally.ttft(request.pool, outcome, relayed.first_byte_at - arrived)
            self._measure(request, served, arrived, prediction)
        if not usage.known:
            return
        tally.tokens(served.target, usage.prompt_tokens, usage.completion_tokens)
        # only this pool's own backends count its prompts with its tokenizer
        if served.pool != pool.name or served.outcome not in (Outcome.LOCAL, Outcome.QUEUED):
            return
        service = self.services.get(served.pool)
        if service is not None:
            service.settled(request, usage.prompt_tokens, usage.completion_tokens)
        if relayed.corrected is not None:
            return  # a usage the gateway corrected teaches nothing (gateway/upstream/usage.py)
        pool.estimator.observe(prompt_chars=request.prompt_chars, prompt_tokens=usage.prompt_tokens)
        if relayed.completed:
            pool.outputs.observe(
                tenant=request.tenant,
                completion_tokens=usage.completion_tokens,
                choices=request.n,
            )

    def _measure(
        self,
        request: InferenceRequest,
        served: Served,
        arrived: float,
        prediction: Prediction | None,
    ) -> None:
        """Time the step that served: to its first byte from forwarding, and per output
        token after it; and, for a request with an objective, whether it was met."""
        relayed = served.relayed
        assert relayed.first_byte_at is not None
        tpot = None
        usage = relayed.usage
        if request.stream and relayed.completed and usage.completion_tokens > 1:
            now = self.clock.monotonic()
            tpot = (now - relayed.first_byte_at) / (usage.completion_tokens - 1)
        ttft = relayed.first_byte_at - served.started_at
        outcome = served.outcome
        if outcome is Outcome.LOCAL or outcome is Outcome.QUEUED or outcome is Outcome.DEGRADED:
            self.latencies.local.observe(served.pool, ttft, tpot)
        elif outcome is Outcome.PROVIDER:
            self.latencies.provider.observe(served.target, ttft, tpot)
        slo = request.ttft_slo_s
        if slo is None and request.tpot_slo_s is None:
            return
        metrics = self.metrics
        if prediction is not None:
            error = relayed.first_byte_at - prediction.at - prediction.ttft_s
            metrics.slo_prediction_error.labels(request.pool, prediction.step).observe(error)
        met = (slo is None or relayed.first_byte_at - arrived <= slo) and (
            request.tpot_slo_s is None or tpot is None or tpot <= request.tpot_slo_s
        )
        metrics.slo_requests.labels(request.pool, "met" if met else "missed").inc()


def _used(request: InferenceRequest, served: Served | None, *, cut: bool) -> int:
    """The tokens the request really used, to settle the tenant's bucket with."""
    if served is None:
        return request.charge_tokens if cut else 0  # nothing sent: all of it back
    if served.relayed.usage.known:
        return served.relayed.usage.total
    return request.charge_tokens
