"""The ladder: where a request is served. Its own pool when it was admitted there (unless
the pool's backends are measured too slow for its TTFT objective while a step of its chain
is not), else the steps of its pool's overflow chain in order (queue, degrade, provider,
cache, batch, reject), each a policy in policies/; the first that serves it ends the climb.
A step decides (gateway/overflow.py: serve on the room it took, serve at a target, or the
answer it gave from what it keeps) and the ladder carries the decision out.

With a TTFT objective, a step predicted to give the first token too late is passed over
(gateway/slo.py), and a chain that ends after passing one over refuses the request saying
so. Each policy declares what the ladder needs of it (gateway/overflow.py): which endpoints
it serves, whether it serves from outside the pool, whether it predicts its TTFT; nothing
here names a policy.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

from gateway.admission.routing.router import Router
from gateway.clock import Clock
from gateway.errors import NoRoomToRetry, Rejected, SpillgateError, UpstreamUnavailable
from gateway.front.exchange import Exchange
from gateway.front.refusals import never_fits
from gateway.metrics import GatewayMetrics
from gateway.outcome import Outcome
from gateway.overflow import (
    CountsService,
    Decision,
    OverflowPolicy,
    PredictsTtft,
    ServeHeld,
    ServeTarget,
)
from gateway.request import InferenceRequest
from gateway.slo import Latencies, Prediction, unattainable
from gateway.upstream.served import Served

if TYPE_CHECKING:
    from gateway.front.trace import RequestTrace


class Ladder:
    def __init__(
        self,
        *,
        chains: Mapping[str, Sequence[OverflowPolicy]],
        router: Router,
        latencies: Latencies,
        services: Mapping[str, CountsService],
        metrics: GatewayMetrics,
        clock: Clock,
    ) -> None:
        self._chains = chains  # pool → its steps, for this endpoint
        self._router = router
        self._latencies = latencies
        self._services = services  # pool → what counts its tenants' service
        self._metrics = metrics
        self._clock = clock

    async def serve(
        self,
        request: InferenceRequest,
        exchange: Exchange,
        *,
        admitted: bool,
        arrived: float,
        trace: RequestTrace | None = None,
    ) -> Served:
        """Serve `request`: from its pool if `admitted` there, else through its chain.
        `arrived`: when the request came, from which its TTFT objective counts."""
        chain = self._chains[request.pool]
        if admitted:
            if request.ttft_slo_s is None or not self._faster_elsewhere(request, chain, arrived):
                service = self._services.get(request.pool)
                if service is not None:
                    service.admitted(request)
                try:  # the pool's own room: served as a ServeHeld is, with no value made
                    return await exchange.serve_local(request, Outcome.LOCAL)
                except NoRoomToRetry:
                    # its backend failed it before a byte (going away) and the rest are full:
                    # nothing was sent, so it overflows as an arrival that found no room
                    pass
            await exchange.release()
        return await self._climb(request, exchange, chain, arrived=arrived, trace=trace)

    async def move(self, request: InferenceRequest, exchange: Exchange) -> bool:
        """Find room again on its pool for `request`, which the gateway stopped for more
        urgent work (gateway/front/preemption.py): the steps of its chain that `moves_streams`
        decide, in order; whether it now holds a reservation there."""
        for policy in self._chains[request.pool]:
            if not policy.moves_streams:
                continue
            try:
                decision = await policy.decide(request, exchange)
            except SpillgateError:  # refused (a full queue): the next step may take it
                continue
            if isinstance(decision, ServeHeld) and decision.request.pool == request.pool:
                return exchange.held.reservation is not None
            exchange.prediction = None
        return False

    @staticmethod
    async def carry_out(decision: Decision, exchange: Exchange) -> Served | None:
        """Serve the request as a step decided; None when the decision failed before the
        first byte in a way that passes the request to the next step (what it held given
        back)."""
        if isinstance(decision, Served):  # answered by the step itself
            return decision
        if isinstance(decision, ServeHeld):
            if not decision.recorded:
                exchange.stop_recording()
            try:
                return await exchange.serve_local(decision.request, decision.outcome)
            except decision.passes_on:
                await exchange.release()
                return None
        return await Ladder._send(decision, exchange)

    @staticmethod
    async def _send(decision: ServeTarget, exchange: Exchange) -> Served | None:
        spill = decision.spill
        try:
            served = await exchange.serve_target(
                decision.target,
                decision.request,
                outcome=decision.outcome,
                public_model=decision.public_model,
            )
        except UpstreamUnavailable as exc:
            await spill.refused(exc)
            return None
        except BaseException:
            await spill.abandoned()
            raise
        await spill.answered(served)
        return served

    async def _step(
        self, policy: OverflowPolicy, request: InferenceRequest, exchange: Exchange
    ) -> Served | None:
        decision = await policy.decide(request, exchange)
        return None if decision is None else await self.carry_out(decision, exchange)

    async def _climb(
        self,
        request: InferenceRequest,
        exchange: Exchange,
        chain: Sequence[OverflowPolicy],
        *,
        arrived: float,
        trace: RequestTrace | None,
    ) -> Served:
        self._check_fits(request, chain)
        outage = self._router.pools[request.pool].outage
        passed_over: list[tuple[str, float]] = []  # the steps predicted to miss the objective
        try:
            for policy in chain:
                if exchange.stopped is not None and policy.moves_streams:
                    continue  # stopped for more urgent work, it waited there already
                if request.ttft_slo_s is not None and self._misses(
                    policy, request, exchange, arrived, passed_over
                ):
                    continue
                if trace is None:
                    served = await self._step(policy, request, exchange)
                else:  # each step tried is a span
                    step = functools.partial(self._step, policy, request, exchange)
                    served = await trace.spill(policy, step, exchange)
                if served is not None:
                    return served
                exchange.prediction = None
        except Rejected as refused:
            # a pool with no backend up is not full
            raise (
                outage() or self._unattainable(request, exchange, passed_over) or refused
            ) from None
        raise (
            outage()
            or self._unattainable(request, exchange, passed_over)
            or Rejected(
                f"Pool {request.pool!r} is at capacity.", retry_after=exchange.retry_after(request)
            )
        )

    def _faster_elsewhere(
        self, request: InferenceRequest, chain: Sequence[OverflowPolicy], arrived: float
    ) -> bool:
        """Whether the pool's own backends, though they have room, are measured too slow for
        the request's TTFT objective while a step of its chain that serves from elsewhere is
        measured in time. With nothing measured, or nowhere faster, the request stays: room
        at hand is not refused."""
        assert request.ttft_slo_s is not None
        left = request.ttft_slo_s - (self._clock.monotonic() - arrived)
        local = self._latencies.local.ttft_s(request.pool)
        if local is None or local <= left:
            return False
        for policy in chain:
            if policy.serves_elsewhere and isinstance(policy, PredictsTtft):
                predicted = policy.predict_ttft_s(request)
                if predicted is not None and predicted <= left:
                    return True
        return False

    def _misses(
        self,
        policy: OverflowPolicy,
        request: InferenceRequest,
        exchange: Exchange,
        arrived: float,
        passed_over: list[tuple[str, float]],
    ) -> bool:
        """Whether `policy` is predicted to give the first token after the objective; if
        so it is noted in `passed_over`, else its prediction is kept to measure its error."""
        if not isinstance(policy, PredictsTtft):
            return False
        predicted = policy.predict_ttft_s(request)
        if predicted is None:  # nothing measured yet: tried, as without an objective
            return False
        assert request.ttft_slo_s is not None
        metrics = self._metrics
        if predicted != math.inf:
            metrics.slo_predicted_ttft.labels(request.pool, policy.name).observe(predicted)
        now = self._clock.monotonic()
        if predicted > request.ttft_slo_s - (now - arrived):
            metrics.slo_passed_over.labels(request.pool, policy.name).inc()
            passed_over.append((policy.name, predicted))
            return True
        exchange.prediction = Prediction(step=policy.name, ttft_s=predicted, at=now)
        return False

    def _unattainable(
        self, request: InferenceRequest, exchange: Exchange, passed_over: list[tuple[str, float]]
    ) -> Rejected | None:
        """The refusal of a request whose chain ended after passing over a step predicted to
        miss its objective: it is told so, with the pool's Retry-After (None: none was)."""
        if not passed_over:
            return None
        assert request.ttft_slo_s is not None
        self._metrics.slo_requests.labels(request.pool, "refused").inc()
        return unattainable(
            request.pool,
            request.ttft_slo_s,
            passed_over,
            retry_after=exchange.retry_after(request),
        )

    def _check_fits(self, request: InferenceRequest, chain: Sequence[OverflowPolicy]) -> None:
        """Refuse for good (400, no Retry-After) a request no backend of its pool could ever
        hold, unless a step of the chain serves from outside the pool."""
        router = self._router
        if not router.never_fits(request.pool, request.sequence_tokens, sequences=request.n):
            return
        if any(policy.serves_elsewhere for policy in chain):
            return
        need = router.pool_kv_tokens(request.pool, request.sequence_tokens, sequences=request.n)
        largest = max(router.capacity(b) for b in router.pools[request.pool].backends)
        raise never_fits(request, need=need, largest=largest)
