"""The request pipeline, in the order a request travels (gateway/README.md follows it
step by step, with the file that does each step):

read → authenticate → parse → throttle → admit → overflow → forward → release → record.

The key is checked before the body is decoded, so a caller without a valid key learns
nothing about what the gateway would accept.
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from starlette.types import Receive, Scope, Send

from gateway.admission.backends import Pool
from gateway.admission.prefix_index import block_keys, prompt_bytes
from gateway.admission.router import Router
from gateway.clock import Clock
from gateway.errors import (
    ModelNotFound,
    NoRoomToRetry,
    Rejected,
    RequestTimeout,
    SpillgateError,
    error_response,
)
from gateway.front.auth import Authenticator, Tenant
from gateway.front.exchange import Exchange, Holding, Served
from gateway.front.parse import decode_body, names_max_tokens, parse_request, requested_model
from gateway.front.refusals import limiter_refusal, never_fits
from gateway.front.request import (
    BATCHABLE_HEADER,
    PRIORITY_HEADER,
    SESSION_HEADER,
    TPOT_HEADER,
    TTFT_HEADER,
    check_pool_kind,
    effective_priority,
    header_text,
    request_headers,
    slo_seconds,
)
from gateway.front.watch import ClientGone, RequestWatch, read_body
from gateway.metrics import GatewayMetrics
from gateway.outcome import Outcome
from gateway.overflow import CountsService, LetsIn, OverflowPolicy, PredictsTtft, RecorderFor
from gateway.ratelimit import Decision, RateLimiter
from gateway.request import Endpoint, InferenceRequest
from gateway.slo import Latencies, Prediction, unattainable
from gateway.upstream.answer import AnswerRecorder
from gateway.upstream.forward import Forwarder

if TYPE_CHECKING:
    from gateway.front.trace import RequestTrace
    from gateway.tracing import Tracing

log = logging.getLogger("spillgate.pipeline")
PRIORITY_HEADER_BYTES = PRIORITY_HEADER.encode()
BATCHABLE_HEADER_BYTES = BATCHABLE_HEADER.encode()
SESSION_HEADER_BYTES = SESSION_HEADER.encode()
TTFT_HEADER_BYTES = TTFT_HEADER.encode()
TPOT_HEADER_BYTES = TPOT_HEADER.encode()
SPILL_POLICIES = frozenset({"degrade", "provider"})  # may serve what the pool cannot hold


@dataclass(frozen=True, kw_only=True)
class PipelineDeps:
    auth: Authenticator
    limiter: RateLimiter
    router: Router
    chains: Mapping[str, list[OverflowPolicy]]
    forwarder: Forwarder
    metrics: GatewayMetrics
    clock: Clock
    max_body_bytes: int
    request_read_timeout_s: float = 30.0
    recorders: Mapping[str, RecorderFor] = field(default_factory=dict)  # pool → its answer recorder
    arrival_checks: Mapping[str, LetsIn] = field(
        default_factory=dict
    )  # pool → may arrivals go first
    tracing: Tracing | None = None  # None: tracing is off, and costs one check per request
    # state in Redis: a request's limiter decision and its first reservation start at once,
    # and so do its bucket's settlement and its release, so that each pair leaves in one
    # batch, one round trip (gateway/redis_batch.py). In-process each call finishes at
    # once, and two tasks would only cost more.
    shared: bool = False
    # what each place's answers took lately: measured on every answer, read by the TTFT
    # ladder (gateway/slo.py)
    latencies: Latencies = field(default_factory=Latencies)
    # pool → what counts its tenants' service, which its queue orders by
    services: Mapping[str, CountsService] = field(default_factory=dict)


class CompletionsEndpoint:
    """ASGI app for /v1/chat/completions and /v1/completions."""

    # with shared state, try for room while the limiter decides (PipelineDeps.shared)
    admit_early = True

    def __init__(self, endpoint: Endpoint, deps: PipelineDeps) -> None:
        self._endpoint = endpoint
        self._d = deps

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        watch = RequestWatch(receive, send, read_s=self._d.request_read_timeout_s)
        headers: list[tuple[bytes, bytes]] = []  # the rate-limit headers, once decided
        tracing = self._d.tracing
        trace = None if tracing is None else tracing.begin(scope)
        try:
            fields = request_headers(scope)
            raw = await read_body(fields, receive, self._d.max_body_bytes)
            watch.body_read()
            await self._handle(fields, raw, headers, watch, trace)
        except ClientGone:
            return
        except SpillgateError as exc:
            watch.close()  # the answer is decided: a disconnect now cancels nothing
            if trace is not None:
                trace.failed(exc, status=exc.status, started=watch.started)
            if not watch.started:
                await error_response(exc, headers)(scope, receive, send)
        except Exception as exc:
            log.exception("request failed")
            watch.close()
            if trace is not None:
                trace.failed(exc, status=500, started=watch.started)
            if not watch.started:
                error = SpillgateError("The gateway failed to handle this request.")
                await error_response(error, headers)(scope, receive, send)
        except asyncio.CancelledError:
            if not (watch.disconnected or watch.read_timed_out):
                raise
            task = asyncio.current_task()
            if task is not None:
                task.uncancel()
            if watch.read_timed_out:
                timeout_s = self._d.request_read_timeout_s
                error = RequestTimeout(
                    f"The request body did not arrive within {timeout_s:g} seconds.",
                    headers={"connection": "close"},
                )
                await error_response(error)(scope, receive, send)
        finally:
            watch.close()
            if trace is not None:
                trace.end()
            if watch.last is not None:
                # only now does the client hold the whole response: its next request sees
                # this one's refund in x-ratelimit-remaining-tokens
                await send(watch.last)

    async def _handle(
        self,
        fields: Mapping[bytes, bytes],
        raw: bytes,
        headers: list[tuple[bytes, bytes]],
        watch: RequestWatch,
        trace: RequestTrace | None = None,
    ) -> None:
        d = self._d
        t0 = d.clock.monotonic()
        tenant = d.auth.tenant(header_text(fields, b"authorization"))
        body = decode_body(raw)
        pool = self._pool(tenant, requested_model(body))
        request = parse_request(
            body,
            endpoint=self._endpoint,
            tenant=tenant.name,
            pool=pool.name,
            priority=effective_priority(
                tenant.priority, header_text(fields, PRIORITY_HEADER_BYTES)
            ),
            default_max_tokens=pool.settings.default_max_tokens,
            max_model_len=pool.max_model_len,
            chars_per_token=pool.estimator.chars_per_token,
        )
        request = self._expect(request, pool)
        if len(pool.backends) > 1 and pool.settings.routing == "prefix":  # else no choice
            request = self._locate(request, pool, fields)
        if tenant.batchable or fields.get(BATCHABLE_HEADER_BYTES) == b"true":
            request = request._replace(batchable=True)
        request = self._objectives(request, tenant, fields)
        if trace is not None:
            trace.parsed(request)
        reserved = request.reserved_tokens
        holding = Holding(d.router)
        exchange = Exchange(
            send=watch.send,
            headers=headers,
            router=d.router,
            # traced, each upstream attempt is a span, its context sent on (gateway/tracing.py)
            forwarder=d.forwarder if trace is None else trace.forwarder(d.forwarder),
            metrics=d.metrics,
            clock=d.clock,
            holding=holding,
            recorder=self._recorder(request),
        )
        admitted: bool | None = None  # not tried yet
        if d.shared and self.admit_early:
            decision, admitted = await self._decide_and_admit(tenant, request, exchange, reserved)
        else:
            decision = await d.limiter.acquire(tenant.limits, reserved)
        self._throttle(tenant, request, decision, headers)
        served: Served | None = None
        outcome = Outcome.ERROR
        began = pool.demand.begin(reserved)
        try:
            served = await self._dispatch(
                request, exchange, admitted=admitted, trace=trace, arrived=t0
            )
            outcome = served.outcome
        except Rejected:
            outcome = Outcome.REJECTED
            raise
        finally:
            # the answer is over: from here a disconnect cancels nothing, so no part of the
            # cleanup can be skipped. Release, settle the tenant's bucket, and record,
            # whatever else fails.
            watch.close()
            used = reserved
            try:
                used = self._used(request, served, cut=watch.started)
                if used == reserved:
                    await holding.release()
                elif d.shared:
                    await asyncio.gather(
                        holding.release(),
                        d.limiter.reconcile(tenant.limits, reserved=reserved, used=used),
                    )
                else:  # settle the tenant's bucket with what was really used
                    await holding.release()
                    await d.limiter.reconcile(tenant.limits, reserved=reserved, used=used)
            finally:
                pool.demand.end(
                    reserved, started=began, used=used, refused=outcome is Outcome.REJECTED
                )
                self._record(request, served, outcome, t0, exchange.prediction)
                if trace is not None:
                    trace.settled(served, outcome)

    def _expect(self, request: InferenceRequest, pool: Pool) -> InferenceRequest:
        """`request` with the output it reserves: the smaller of its cap (max_tokens, or
        what the context leaves when it names none) and the pool's expected output; for a
        stream, what it is expected to hold at its peak, and the headroom it keeps as it
        grows (gateway/admission/output_lengths.py).

        A request that is not streamed cannot grow its reservation as it goes; it reserves
        its whole expected output, and the backends' reported KV use
        (gateway/admission/backend_load.py) covers an answer longer than that within a scrape.
        """
        if pool.settings.reservation.mode == "max_tokens" or not request.max_output_tokens:
            return request  # the whole of max_tokens (or the pool's default); embeddings: 0
        if names_max_tokens(request.body):
            cap = request.max_output_tokens
        else:
            cap = max(1, pool.max_model_len - request.prompt_tokens)
        reserve = pool.outputs.reserve_output(
            tenant=request.tenant,
            cap=cap,
            room=self._d.router.room(pool.name),
            prompt_tokens=request.prompt_tokens,
            streaming=request.stream,
        )
        return request._replace(output_reserve=reserve.output, headroom=reserve.headroom)

    @staticmethod
    def _objectives(
        request: InferenceRequest, tenant: Tenant, fields: Mapping[bytes, bytes]
    ) -> InferenceRequest:
        """`request` with its TTFT and TPOT objectives: its headers', else its tenant's."""
        ttft = header_text(fields, TTFT_HEADER_BYTES)
        tpot = header_text(fields, TPOT_HEADER_BYTES)
        if ttft is None and tpot is None and tenant.ttft_budget_s is tenant.tpot_budget_s is None:
            return request  # the common case: no objective at all
        return request._replace(
            ttft_slo_s=slo_seconds(ttft, TTFT_HEADER, tenant.ttft_budget_s),
            tpot_slo_s=slo_seconds(tpot, TPOT_HEADER, tenant.tpot_budget_s),
        )

    @staticmethod
    def _locate(
        request: InferenceRequest, pool: Pool, fields: Mapping[bytes, bytes]
    ) -> InferenceRequest:
        """`request` with what prefix routing places it by: the keys of its prompt's leading
        blocks, and its session (the header, else the body's `user`), within its tenant."""
        session = header_text(fields, SESSION_HEADER_BYTES)
        user = request.body.get("user")
        if session is None and isinstance(user, str) and user:
            session = user
        keys = block_keys(prompt_bytes(request.body), block_size=pool.backends[0].block_size)
        return request._replace(
            prefix=keys, session=None if session is None else f"{request.tenant}\0{session}"
        )

    def _recorder(self, request: InferenceRequest) -> AnswerRecorder | None:
        recorder_for = self._d.recorders.get(request.pool)
        return None if recorder_for is None else recorder_for(request)

    def _pool(self, tenant: Tenant, model: str) -> Pool:
        pool = self._d.router.pools.get(model)
        if pool is None or not tenant.may_use(model):
            raise ModelNotFound(f"The model {model!r} does not exist.", param="model")
        check_pool_kind(pool.settings.kind, self._endpoint, model)
        return pool

    def _throttle(
        self,
        tenant: Tenant,
        request: InferenceRequest,
        decision: Decision,
        headers: list[tuple[bytes, bytes]],
    ) -> None:
        """Tell the limiter's decision in the headers; raise the refusal if it is one."""
        headers += decision.headers()
        if decision.allowed:
            return
        error = limiter_refusal(decision, tenant=tenant.name, request=request)
        self._d.metrics.tally.request(request.pool, tenant.name, error.outcome)
        raise error

    async def _decide_and_admit(
        self, tenant: Tenant, request: InferenceRequest, exchange: Exchange, reserved: int
    ) -> tuple[Decision, bool]:
        """The limiter's decision and the request's first try for room, made at once; the
        room goes back when the limiter refuses, or when either call fails."""
        room = asyncio.ensure_future(self._first_try(request, exchange))
        try:
            decision = await self._d.limiter.acquire(tenant.limits, reserved)
            admitted = await room
        except BaseException:
            room.cancel()
            await asyncio.wait([room])  # ended, however: what it reserved is held, or none
            await exchange.release()
            raise
        if not decision.allowed:
            await exchange.release()
        return decision, admitted

    async def _first_try(self, request: InferenceRequest, exchange: Exchange) -> bool:
        """Room in the pool for an arrival, unless the queue's waiting requests go first."""
        check = self._d.arrival_checks.get(request.pool)
        return (check is None or check(request)) and await exchange.admit(request)

    async def _dispatch(
        self,
        request: InferenceRequest,
        exchange: Exchange,
        *,
        admitted: bool | None = None,
        trace: RequestTrace | None = None,
        arrived: float = 0.0,
    ) -> Served:
        """Serve `request` from its pool, else through its overflow chain. `admitted` tells
        the outcome of a first try made already (None: none was); `arrived`, when the
        request came, from which its TTFT objective counts."""
        if admitted is None:
            admitted = await self._first_try(request, exchange)
        chain = self._d.chains[request.pool]
        if admitted:
            if request.ttft_slo_s is None or not self._faster_elsewhere(request, chain, arrived):
                service = self._d.services.get(request.pool)
                if service is not None:
                    service.admitted(request)
                try:
                    return await exchange.serve_local(request, Outcome.LOCAL)
                except NoRoomToRetry:
                    # its backend failed it before a byte (going away) and the rest are full:
                    # nothing was sent, so it overflows as an arrival that found no room
                    pass
            await exchange.release()
        self._check_fits(request, chain)
        outage = self._d.router.pools[request.pool].outage
        passed_over: list[tuple[str, float]] = []  # the steps predicted to miss the objective
        try:
            for policy in chain:
                if request.ttft_slo_s is not None and self._misses(
                    policy, request, exchange, arrived, passed_over
                ):
                    continue
                if trace is None:
                    served = await policy.serve(request, exchange)
                else:  # each policy tried is a span
                    served = await trace.spill(policy, request, exchange)
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
        self, request: InferenceRequest, chain: list[OverflowPolicy], arrived: float
    ) -> bool:
        """Whether the pool's own backends, though they have room, are measured too slow for
        the request's TTFT objective while a step of its chain is measured in time. With
        nothing measured, or nowhere faster, the request stays: room at hand is not refused.
        """
        assert request.ttft_slo_s is not None
        left = request.ttft_slo_s - (self._d.clock.monotonic() - arrived)
        local = self._d.latencies.local.ttft_s(request.pool)
        if local is None or local <= left:
            return False
        for policy in chain:
            if isinstance(policy, PredictsTtft) and policy.name != "queue":
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
        metrics = self._d.metrics
        if predicted != math.inf:
            metrics.slo_predicted_ttft.labels(request.pool, policy.name).observe(predicted)
        now = self._d.clock.monotonic()
        if predicted > request.ttft_slo_s - (now - arrived):
            metrics.slo_passed_over.labels(request.pool, policy.name).inc()
            passed_over.append((policy.name, predicted))
            return True
        exchange.prediction = Prediction(tier=policy.name, ttft_s=predicted, at=now)
        return False

    def _unattainable(
        self, request: InferenceRequest, exchange: Exchange, passed_over: list[tuple[str, float]]
    ) -> Rejected | None:
        """The refusal of a request whose chain ended after passing over a step predicted to
        miss its objective: it is told so, with the pool's Retry-After (None: none was)."""
        if not passed_over:
            return None
        assert request.ttft_slo_s is not None
        self._d.metrics.slo_requests.labels(request.pool, "refused").inc()
        return unattainable(
            request.pool,
            request.ttft_slo_s,
            passed_over,
            retry_after=exchange.retry_after(request),
        )

    def _check_fits(self, request: InferenceRequest, chain: list[OverflowPolicy]) -> None:
        """Refuse for good (400, no Retry-After) a request no backend of its pool could ever
        hold, unless the chain has somewhere else to send it."""
        router = self._d.router
        if not router.never_fits(request.pool, request.sequence_tokens, sequences=request.n):
            return
        if any(policy.name in SPILL_POLICIES for policy in chain):
            return
        need = router.pool_kv_tokens(request.pool, request.sequence_tokens, sequences=request.n)
        largest = max(router.capacity(b) for b in router.pools[request.pool].backends)
        raise never_fits(request, need=need, largest=largest)

    @staticmethod
    def _used(request: InferenceRequest, served: Served | None, *, cut: bool) -> int:
        """The tokens the request really used, to settle the tenant's bucket with.

        `cut`: the answer had begun when the request ended without one (the client left
        mid-stream); what the upstream generated is unknown, so the reservation stands.
        """
        if served is None:
            return request.reserved_tokens if cut else 0  # nothing sent: all of it back
        if served.relayed.usage.known:
            return served.relayed.usage.total
        return request.reserved_tokens

    def _measure(
        self,
        request: InferenceRequest,
        served: Served,
        t0: float,
        prediction: Prediction | None,
    ) -> None:
        """Time the place that served: to its first byte from forwarding, and per output
        token after it; and, for a request with an objective, whether it was met."""
        relayed = served.relayed
        assert relayed.first_byte_at is not None
        tpot = None
        usage = relayed.usage
        if request.stream and relayed.completed and usage.completion_tokens > 1:
            now = self._d.clock.monotonic()
            tpot = (now - relayed.first_byte_at) / (usage.completion_tokens - 1)
        ttft = relayed.first_byte_at - served.started_at
        outcome = served.outcome
        latencies = self._d.latencies
        if outcome is Outcome.LOCAL or outcome is Outcome.QUEUED or outcome is Outcome.DEGRADED:
            latencies.local.observe(served.pool, ttft, tpot)
        elif outcome is Outcome.PROVIDER:
            latencies.provider.observe(served.target, ttft, tpot)
        slo = request.ttft_slo_s
        if slo is None and request.tpot_slo_s is None:
            return
        metrics = self._d.metrics
        if prediction is not None:
            error = relayed.first_byte_at - prediction.at - prediction.ttft_s
            metrics.slo_prediction_error.labels(request.pool, prediction.tier).observe(error)
        met = (slo is None or relayed.first_byte_at - t0 <= slo) and (
            request.tpot_slo_s is None or tpot is None or tpot <= request.tpot_slo_s
        )
        metrics.slo_requests.labels(request.pool, "met" if met else "missed").inc()

    def _record(
        self,
        request: InferenceRequest,
        served: Served | None,
        outcome: Outcome,
        t0: float,
        prediction: Prediction | None = None,
    ) -> None:
        tally = self._d.metrics.tally
        tally.request(request.pool, request.tenant, outcome)
        if served is None:
            return
        relayed = served.relayed
        usage = relayed.usage
        if relayed.first_byte_at is not None:
            tally.ttft(request.pool, outcome, relayed.first_byte_at - t0)
            self._measure(request, served, t0, prediction)

        if usage.known:
            tally.tokens(served.target, usage.prompt_tokens, usage.completion_tokens)
            pool = self._d.router.pools.get(served.pool)
            # only this pool's own backends count its prompts with its tokenizer
            if pool is not None and served.outcome in (Outcome.LOCAL, Outcome.QUEUED):
                service = self._d.services.get(served.pool)
                if service is not None:
                    service.settled(request, usage.prompt_tokens, usage.completion_tokens)
                pool.estimator.observe(
                    prompt_chars=request.prompt_chars, prompt_tokens=usage.prompt_tokens
                )
                if relayed.completed:
                    pool.outputs.observe(
                        tenant=request.tenant,
                        completion_tokens=usage.completion_tokens,
                        choices=request.n,
                    )
