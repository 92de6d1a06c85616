"""Spill to the pool's external provider while its breaker, budget and concurrency allow.

A provider failure before the first byte (any error status, timeout, connection error,
an answer that is not one) is a failed spill: it is counted in
`spillgate_upstream_errors_total{target=<provider>}`, logged with what the provider said,
and the request passes to the next policy. The client never sees the provider's error:
it names the provider's model and account. A 429's `Retry-After` keeps the breaker open
that long; a refusal of this one request (400, 413, 422) leaves the breaker as it was, so
no client can open it for everyone. Spend is counted per provider from the real usage: a
count the provider gives is believed up to a minute of its budget (ProviderGate.counted),
and a usage that is no count keeps the claim spent and adds no dollars.

Its prediction for a request with a TTFT objective (gateway/slo.py): the provider's recent
time to first token, or never while its breaker is open or its concurrency is spent.
"""

from __future__ import annotations

import logging
import math
from typing import ClassVar

from gateway.config import PoolSettings
from gateway.errors import UpstreamUnavailable
from gateway.outcome import Outcome
from gateway.overflow import (
    Latencies,
    OverflowContext,
    ProviderMetrics,
    Served,
    ServeTarget,
    predict,
)
from gateway.request import Endpoint, InferenceRequest
from policies.deps import PolicyDeps
from policies.provider.gate import Claim, ProviderGate, Refusal

log = logging.getLogger("spillgate.provider")

# statuses that refuse this one request, not the provider's service: no breaker failure
REQUEST_REFUSALS = frozenset({400, 413, 422})
LOGGED_DETAIL_CHARS = 500
MID_STREAM = "mid-stream"  # the reason label of a failure after the first byte


class ProviderPolicy:
    name: ClassVar[str] = "provider"
    # a chat pool's provider may not serve the Responses API (its 404 would count against
    # the provider's breaker, and so against the pool's chat spills)
    endpoints: ClassVar[frozenset[Endpoint]] = frozenset(
        {Endpoint.CHAT, Endpoint.COMPLETIONS, Endpoint.EMBEDDINGS}
    )
    serves_elsewhere: ClassVar[bool] = True
    moves_streams: ClassVar[bool] = False

    def __init__(
        self,
        *,
        gate: ProviderGate,
        metrics: ProviderMetrics,
        latencies: Latencies,
    ) -> None:
        self.gate = gate
        self.metrics = metrics
        self._latencies = latencies

    @classmethod
    def build(cls, pool: PoolSettings, deps: PolicyDeps) -> ProviderPolicy:
        if pool.provider is None or pool.provider not in deps.providers:
            raise ValueError(f"pool {pool.name!r}: the provider policy needs a configured provider")
        return cls(
            gate=deps.providers[pool.provider], metrics=deps.metrics, latencies=deps.latencies
        )

    def predict_ttft_s(self, request: InferenceRequest) -> float | None:
        gate = self.gate
        if not gate.serves(request):
            return math.inf
        if gate.in_flight >= gate.settings.max_concurrency or gate.breaker.open_for() > 0:
            return math.inf
        return predict(self._latencies.provider, gate.name, request)

    async def decide(
        self, request: InferenceRequest, exchange: OverflowContext
    ) -> ServeTarget | None:
        gate = self.gate
        if not gate.serves(request):
            return None
        claim = await gate.acquire(request.charge_tokens)
        if isinstance(claim, Refusal):
            log.debug("provider %s passes %s: %s", gate.name, request.pool, claim)
            return None
        asked = request.adapter or request.pool
        return ServeTarget(
            target=gate.target(asked),
            request=request,
            outcome=Outcome.PROVIDER,
            public_model=asked,
            spill=_Spill(self, request, claim),
        )

    def used(self, served: Served) -> tuple[int, int] | None:
        """The prompt and completion tokens the answer used, as the gate counts them; None
        when unknown, or when the provider said something that is no count."""
        usage = served.relayed.usage
        if not usage.known:
            return None
        gate = self.gate
        prompt, completion = (
            gate.counted(usage.prompt_tokens),
            gate.counted(usage.completion_tokens),
        )
        if prompt is None or completion is None:
            log.warning(
                "provider %s answered pool %s with a usage that is no count (prompt %.40r, "
                "completion %.40r): its claim stays spent",
                gate.name,
                served.pool,
                usage.prompt_tokens,
                usage.completion_tokens,
            )
            return None
        return prompt, completion

    def settle(self, served: Served, used: tuple[int, int] | None) -> None:
        gate, relayed = self.gate, served.relayed
        if relayed.completed:
            gate.breaker.record_success()
        else:
            # past the first byte: the client got the gateway's own error event
            gate.breaker.record_failure()
            self.metrics.upstream_errors.labels(gate.name, MID_STREAM).inc()
            said = relayed.upstream_error.decode("utf-8", "replace")
            log.warning(
                "provider %s failed mid-stream for pool %s: %s",
                gate.name,
                served.pool,
                gate.redact(said)[:LOGGED_DETAIL_CHARS],
            )
        if used is not None:
            prompt, completion = used
            cost = gate.cost(prompt_tokens=prompt, completion_tokens=completion)
            if math.isfinite(cost):  # counts are bounded; a price of `inf` is not
                self.metrics.provider_cost.labels(gate.name).inc(cost)


class _Spill:
    """One request's claim on the provider's slots and budget, settled as its sending went
    (gateway/overflow.py Spill)."""

    __slots__ = ("_claim", "_policy", "_request")

    def __init__(self, policy: ProviderPolicy, request: InferenceRequest, claim: Claim) -> None:
        self._policy = policy
        self._request = request
        self._claim = claim

    async def refused(self, error: UpstreamUnavailable) -> None:
        gate = self._policy.gate
        # the breaker first: nothing awaited below may leave a half-open trial claimed
        if error.status in REQUEST_REFUSALS:
            gate.breaker.release_trial()
        else:
            gate.breaker.record_failure(retry_after=error.retry_after)
        self._policy.metrics.upstream_errors.labels(gate.name, error.reason.split(":")[0]).inc()
        log.warning(
            "provider %s failed for pool %s (%s), passing the request on: %s",
            gate.name,
            self._request.pool,
            error.reason,
            gate.redact(error.detail.decode("utf-8", "replace"))[:LOGGED_DETAIL_CHARS],
        )
        await gate.release(self._claim, used=0)  # refused before generating: budget comes back

    async def abandoned(self) -> None:
        # cancelled mid-answer: the budget stays spent, the slot is freed
        gate = self._policy.gate
        gate.breaker.release_trial()
        await gate.release(self._claim, used=None)

    async def answered(self, served: Served) -> None:
        used: tuple[int, int] | None = None
        try:
            used = self._policy.used(served)
            self._policy.settle(served, used)
        finally:  # whatever recording the answer does, the slot and the budget settle
            await self._policy.gate.release(self._claim, used=None if used is None else sum(used))
