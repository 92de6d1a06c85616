"""The request pipeline: one ASGI app per endpoint, which only says the order a request
travels in. Each stage is one module, entered once (gateway/README.md draws the way):

authenticate (auth.py) → prepare (prepare.py, which parses) → throttle (throttle.py) →
admit (admit.py) → the ladder (ladder.py: the pool, else the overflow chain) → serve
(exchange.py) → settle (settle.py).

The key is checked before the body is decoded, so a caller without a valid key learns
nothing about what the gateway would accept. What differs between endpoints is data, an
`EndpointRules`, not a subclass.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from starlette.types import Receive, Scope, Send

from gateway.admission.adapters import AdapterLoader
from gateway.admission.ledger.held import HeldReservation
from gateway.admission.routing.route import Route
from gateway.admission.routing.router import Router
from gateway.clock import Clock
from gateway.errors import Rejected, RequestTimeout, SpillgateError, error_response
from gateway.front.admit import Admission
from gateway.front.auth import Authenticator
from gateway.front.exchange import Exchange
from gateway.front.ladder import Ladder
from gateway.front.preemption import Preemptions
from gateway.front.prepare import Preparer
from gateway.front.request import header_text, request_headers
from gateway.front.response_homes import ResponseHomes, ResponseIdRecorder
from gateway.front.settle import Settlement
from gateway.front.throttle import Throttle
from gateway.front.watch import ClientGone, RequestWatch, read_body
from gateway.metrics import GatewayMetrics
from gateway.outcome import Outcome
from gateway.overflow import CountsService, LetsIn, OverflowPolicy, RecorderFor
from gateway.ratelimit import RateLimiter
from gateway.request import Endpoint, InferenceRequest
from gateway.slo import Latencies
from gateway.upstream.answer import AnswerRecorder
from gateway.upstream.forward import Forwarder
from gateway.upstream.served import Served

if TYPE_CHECKING:
    from gateway.front.trace import RequestTrace
    from gateway.front.tracing import Tracing

log = logging.getLogger("spillgate.pipeline")


@dataclass(frozen=True, kw_only=True)
class EndpointRules:
    """What one endpoint's requests may do on their way; the rest of the way is the same."""

    endpoint: Endpoint
    # may climb the pool's overflow chain (the steps that serve this endpoint's requests);
    # a batch item never waits or spills: with no room it runs on a later pass
    overflow: bool = True
    # the pool's answer recorder (the response cache) sees its answers
    record_answers: bool = True
    # a Responses continuation goes only to the backend that stores its previous response,
    # and the backend of each response is remembered
    pin_to_home: bool = False
    # counted and timed as a request someone waits for (a batch item is not)
    interactive: bool = True


@dataclass(frozen=True, kw_only=True)
class PipelineDeps:
    auth: Authenticator
    limiter: RateLimiter
    router: Router
    chains: Mapping[str, list[OverflowPolicy]]
    forwarder: Forwarder
    metrics: GatewayMetrics
    clock: Clock
    # what each step's answers took lately: measured on every answer, read by the ladder
    latencies: Latencies
    max_body_bytes: int
    request_read_timeout_s: float = 30.0
    recorders: Mapping[str, RecorderFor] = field(default_factory=dict)  # pool → its recorder
    arrival_checks: Mapping[str, LetsIn] = field(default_factory=dict)  # pool → may arrivals go
    tracing: Tracing | None = None  # None: tracing is off, and costs one check per request
    # state in Redis: the bucket's decision and the first reservation start at once, and so
    # do the bucket's refund and the release (gateway/front/throttle.py)
    shared: bool = False
    # pool → what counts its tenants' service, which its queue orders by
    services: Mapping[str, CountsService] = field(default_factory=dict)
    homes: ResponseHomes = field(default_factory=ResponseHomes)  # where responses are stored
    adapters: AdapterLoader | None = None  # loads a LoRA adapter no backend serves
    # the streams in flight that a waiter of a higher class may stop (None: no pool allows)
    preemptions: Preemptions | None = None


class Pipeline:
    """ASGI app for one endpoint: /v1/chat/completions, /v1/completions, /v1/embeddings,
    /v1/responses, and the batch runner's items."""

    def __init__(self, rules: EndpointRules, deps: PipelineDeps) -> None:
        self._rules = rules
        self._d = deps
        endpoint = rules.endpoint
        chains = {
            pool: [p for p in chain if rules.overflow and endpoint in p.endpoints]
            for pool, chain in deps.chains.items()
        }
        self._prepare = Preparer(endpoint, router=deps.router, clock=deps.clock)
        self._throttle = Throttle(deps.limiter, metrics=deps.metrics)
        self._admit = Admission(arrival_checks=deps.arrival_checks)
        self._ladder = Ladder(
            chains=chains,
            router=deps.router,
            latencies=deps.latencies,
            services=deps.services,
            metrics=deps.metrics,
            clock=deps.clock,
        )
        self._move = self._ladder.move
        self._settle = Settlement(
            limiter=deps.limiter,
            metrics=deps.metrics,
            latencies=deps.latencies,
            services=dict(deps.services),
            clock=deps.clock,
            shared=deps.shared,
            interactive=rules.interactive,
        )

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
        arrived = d.clock.monotonic()
        tenant = d.auth.tenant(header_text(fields, b"authorization"))
        request = self._prepare.request(tenant, fields, raw)
        if self._rules.pin_to_home:
            request = await self._prepare.pinned(request, d.homes)
        if d.router.pools[request.pool].tokenizes(request):
            request = await self._prepare.tokenized(request)
        if request.adapter is not None and d.adapters is not None:
            pool = d.router.pools[request.pool]
            if not pool.serves(request.adapter):
                deadline = arrived + pool.settings.timeouts.total
                await d.adapters.load(pool, pool.adapter(request.adapter), deadline=deadline)
        if trace is not None:
            trace.parsed(request)
        held = HeldReservation(d.router)
        if request.adapter is not None and d.adapters is not None:
            # where it is held, the adapter is in use: it is never unloaded from there
            held = d.adapters.uses.held(d.router, request.adapter)
        exchange = Exchange(
            send=watch.send,
            headers=headers,
            router=d.router,
            # traced, each upstream attempt is a span, its context sent on (front/tracing.py)
            forwarder=d.forwarder if trace is None else trace.forwarder(d.forwarder),
            metrics=d.metrics,
            clock=d.clock,
            held=held,
            recorder=self._recorder(request, held),
            preemptions=d.preemptions,
            mover=self._move,
        )
        admitted: bool | None = None  # not tried yet
        if d.shared:
            admitted = await self._throttle.decide_and_admit(
                tenant, request, headers, exchange=exchange, first_try=self._admit.first_try
            )
        else:
            await self._throttle.decide(tenant, request, headers)
        pool = d.router.pools[request.pool]
        served: Served | None = None
        outcome = Outcome.ERROR
        began = pool.demand.begin(request.charge_tokens)
        if request.adapter is not None and d.adapters is not None:
            d.adapters.uses.watch(request.adapter, held)
        try:
            if admitted is None:
                admitted = await self._admit.first_try(request, exchange)
            if not admitted and request.adapter is not None and d.adapters is not None:
                self._spread(request, request.adapter, d.adapters)
            served = await self._ladder.serve(
                request, exchange, admitted=admitted, arrived=arrived, trace=trace
            )
            outcome = served.outcome
            if isinstance(exchange.recorder, ResponseIdRecorder):
                await exchange.recorder.shared()
        except Rejected:
            outcome = Outcome.REJECTED
            raise
        finally:
            # the answer is over: from here a disconnect cancels nothing, so no part of the
            # settlement can be skipped
            watch.close()
            try:
                await self._settle.settle(
                    tenant,
                    request,
                    pool,
                    exchange,
                    served,
                    outcome,
                    cut=watch.started,
                    arrived=arrived,
                    began=began,
                )
            finally:
                if trace is not None:
                    trace.settled(served, outcome, prefill=exchange.prefill)
                if request.adapter is not None and d.adapters is not None:
                    d.adapters.uses.done(request.adapter, held)

    def _spread(self, request: InferenceRequest, name: str, loader: AdapterLoader) -> None:
        """No backend serving the adapter `name` had room for `request`: where one that does
        not serve it has room, the adapter is loaded there too (the queue is woken once it
        is); a cold adapter, with room where it is, is loaded nowhere else."""
        router = self._d.router
        pool = router.pools[request.pool]
        adapter = pool.adapter(name)
        if not loader.may_spread(pool, adapter):
            return
        route = Route.of(request)
        # the first try may have failed for the queue's waiters: then its backends have room
        if router.has_room(route._replace(adapter=None)) and not router.has_room(route):
            loader.spread(pool, adapter)

    def _recorder(self, request: InferenceRequest, held: HeldReservation) -> AnswerRecorder | None:
        if self._rules.pin_to_home:
            return ResponseIdRecorder(self._d.homes, held)
        if not self._rules.record_answers:
            return None
        recorder_for = self._d.recorders.get(request.pool)
        return None if recorder_for is None else recorder_for(request)


def endpoint_rules() -> list[EndpointRules]:
    """The rules of each public endpoint: embeddings and responses keep the steps that
    serve them; the response cache records chat and completion text only; a Responses
    continuation is pinned to the backend that stores its previous response."""
    return [
        EndpointRules(endpoint=Endpoint.CHAT),
        EndpointRules(endpoint=Endpoint.COMPLETIONS),
        EndpointRules(endpoint=Endpoint.EMBEDDINGS, record_answers=False),
        EndpointRules(endpoint=Endpoint.RESPONSES, record_answers=False, pin_to_home=True),
    ]
