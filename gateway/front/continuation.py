"""A stream whose backend broke off mid-answer goes on on another backend of its pool, as
often as the pool allows within the request's deadline (gateway/upstream/resume.py says
how a continuation is built and what the client sees); else it ends with an error event.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Collection
from typing import Protocol

from gateway.admission.fleet.backends import Backend
from gateway.admission.ledger.growth import Growth
from gateway.admission.ledger.held import HeldReservation
from gateway.admission.ledger.reservations import Reservation
from gateway.admission.routing.router import Router
from gateway.clock import Clock
from gateway.errors import UpstreamUnavailable
from gateway.metrics import GatewayMetrics
from gateway.outcome import Outcome
from gateway.request import InferenceRequest
from gateway.upstream.forward import Forwards
from gateway.upstream.relay import Relayed, StreamCut, StreamRelay
from gateway.upstream.resume import ContinuationLeg, Partial, continued
from gateway.upstream.served import Served
from gateway.upstream.target import Target
from gateway.upstream.usage import Corrected


class Serving(Protocol):
    """What a continuation uses of the request's exchange (gateway/front/exchange.py)."""

    held: HeldReservation
    router: Router
    forwarder: Forwards
    metrics: GatewayMetrics
    clock: Clock

    def reserve(
        self, request: InferenceRequest, *, exclude: Collection[str] = (), running: bool = False
    ) -> Awaitable[Reservation | None]: ...

    def growth(self, request: InferenceRequest, block_size: int) -> Growth | None: ...

    def forward_held(
        self,
        request: InferenceRequest,
        outcome: Outcome,
        *,
        deadline: float,
        growth: Growth | None,
        resumable: bool = False,
        relay: StreamRelay | None = None,
    ) -> Awaitable[Relayed]: ...

    async def failed(
        self, name: str, reason: str, tried: set[str], *, unreachable: str | None = None
    ) -> None: ...

    async def broke_off(self, name: str, tried: set[str]) -> None: ...

    def answered(self, backend: Backend, corrected: Corrected | None = None) -> None: ...


class Continuation:
    """The continuation of one request's stream, cut on the backend in `tried` last."""

    def __init__(
        self, exchange: Serving, request: InferenceRequest, *, tried: set[str], deadline: float
    ) -> None:
        self._exchange = exchange
        self._request = request
        self._tried = tried  # the backends that failed the request, or broke it off
        self._deadline = deadline

    async def go_on(self, served: Served, cut: StreamCut) -> Served:
        """Continue the stream `served` broke off with `cut`; the stream as it ends."""
        exchange, request, tried = self._exchange, self._request, self._tried
        tries = exchange.router.pools[request.pool].settings.continue_streams
        await exchange.broke_off(served.target, tried)
        count: asyncio.Task[int | None] | None = None  # the original prompt's tokens
        try:
            while True:
                partial = cut.relay.partial()
                if partial.finished or cut.relay.finished:  # broke off after its last token
                    await cut.finish()
                    return served.ended(completed=True)
                follow, why = await self._follow(partial, tries)
                if follow is None:
                    exchange.metrics.stream_continuations_refused.labels(request.pool, why).inc()
                    await cut.fail()
                    return served.ended(completed=False)
                tries -= 1
                if count is None:
                    target = self._held_target()
                    count = asyncio.create_task(exchange.forwarder.prompt_tokens(target, request))
                served, next_cut = await self._continue(follow, served, cut, partial, count=count)
                if next_cut is None:
                    return served
                cut = next_cut
        finally:
            if count is not None:
                count.cancel()

    async def _follow(self, partial: Partial, tries: int) -> tuple[InferenceRequest | None, str]:
        """The continuation of the request from `partial`, holding room on a backend not
        yet tried; else None and why not."""
        if partial.refusal is not None:
            return None, partial.refusal
        follow = continued(self._request, partial)
        if follow is None:
            return None, "output_limit"
        if tries == 0:
            return None, "tries"
        exchange = self._exchange
        if exchange.clock.monotonic() >= self._deadline:
            return None, "deadline"
        room = await exchange.reserve(follow, exclude=self._tried, running=True)
        if not exchange.held.take(room):
            return None, "no_room"
        return follow, ""

    def _held_target(self) -> Target:
        router = self._exchange.router
        backend = self._exchange.held.backend
        assert backend is not None
        return router.target(backend, self._request.adapter)

    async def _continue(
        self,
        follow: InferenceRequest,
        served: Served,
        cut: StreamCut,
        partial: Partial,
        *,
        count: asyncio.Future[int | None],
    ) -> tuple[Served, StreamCut | None]:
        """One continuation on the backend `follow` holds a reservation on: the stream as
        it then is, and its cut if it broke off again (or never began there)."""
        exchange = self._exchange
        held = exchange.held.backend
        assert held is not None
        backend = exchange.router.backend(held)
        growth = exchange.growth(follow, backend.block_size)
        leg = ContinuationLeg(partial)
        cut.relay.next_leg(leg, carried=partial.tokens, growth=growth, prompt=count)
        try:
            relayed = await exchange.forward_held(
                follow, served.outcome, deadline=self._deadline, growth=growth, relay=cut.relay
            )
        except UpstreamUnavailable as exc:
            exchange.metrics.stream_continuations.labels(follow.pool, "failed").inc()
            await exchange.failed(
                backend.name, exc.reason, self._tried, unreachable=exc.unreachable
            )
            return served, cut
        exchange.metrics.stream_continuations.labels(follow.pool, "succeeded").inc()
        went_on = Served(served.outcome, backend.name, served.pool, relayed, served.started_at)
        if relayed.cut is None:
            exchange.answered(backend, relayed.corrected)
        else:
            await exchange.broke_off(backend.name, self._tried)
        return went_on, relayed.cut
