"""Serving a request on its pool: one loop over its legs, each an upstream request that
serves part of it. The first leg goes to the backend the request holds its reservation on,
after a prefill leg where its pool splits it (gateway/front/prefill.py); while its stream
breaks off mid-answer, each further leg continues it on another backend of the pool, as
often as the pool allows within the request's deadline (gateway/upstream/resume.py says how
a continuation is built and what the client sees); else the stream ends with an error event.

A first leg that fails before its first byte raises: nothing reached the client, and the
request's exchange tries again elsewhere (gateway/upstream/retry.py). After each leg, what
its answer says of its backend is recorded with the exchange: it answered in full, it broke
off mid-answer (it drains), or it failed before its first byte.

A stream the gateway stopped for more urgent work (gateway/front/preemption.py) is no
failure of its backend: its room is given back at once, it waits for room again in its
pool's queue at its own place (the exchange's `move`), and then goes on: from the start when
it was stopped before its first byte, else as a further leg of its stream, after an SSE
comment that tells the client why it paused. Where no room comes back within its wait, a
stream ends with an error event that says when to retry, and a request with no byte sent
yet passes to the rest of its pool's chain (past the queue it waited in), as an arrival
that found no room does.
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
from gateway.errors import NoRoomToRetry, UpstreamUnavailable
from gateway.front.preemption import Running
from gateway.front.prefill import DecodeLeg
from gateway.metrics import GatewayMetrics
from gateway.outcome import Outcome
from gateway.request import InferenceRequest
from gateway.upstream.answer import preempted_event
from gateway.upstream.forward import Forwards
from gateway.upstream.relay import Relayed, StreamCut, StreamRelay
from gateway.upstream.resume import ContinuationLeg, Partial, continued
from gateway.upstream.served import Served
from gateway.upstream.stop import Stop
from gateway.upstream.usage import Corrected


class Serving(Protocol):
    """What the legs use of the request's exchange (gateway/front/exchange.py)."""

    held: HeldReservation
    router: Router
    forwarder: Forwards
    metrics: GatewayMetrics
    clock: Clock

    def reserve(
        self, request: InferenceRequest, *, exclude: Collection[str] = (), running: bool = False
    ) -> Awaitable[Reservation | None]: ...

    def growth(self, request: InferenceRequest, block_size: int) -> Growth | None: ...

    def not_resumable(self, request: InferenceRequest) -> str | None: ...

    def preemptible(self, request: InferenceRequest) -> Running | None: ...

    def left(self, running: Running) -> None: ...

    async def move(self, request: InferenceRequest) -> bool: ...

    def preempted(self, request: InferenceRequest, result: str) -> None: ...

    async def decode_leg(
        self, request: InferenceRequest, reservation: Reservation, *, deadline: float
    ) -> DecodeLeg: ...

    def forward_held(
        self,
        request: InferenceRequest,
        outcome: Outcome,
        *,
        deadline: float,
        growth: Growth | None,
        resumable: bool = False,
        relay: StreamRelay | None = None,
        upstream_headers: dict[str, str] | None = None,
        stop: Stop | None = None,
    ) -> Awaitable[Relayed]: ...

    async def failed(
        self, name: str, reason: str, tried: set[str], *, unreachable: str | None = None
    ) -> None: ...

    async def broke_off(self, name: str, tried: set[str]) -> None: ...

    def answered(self, backend: Backend, corrected: Corrected | None = None) -> None: ...


class Legs:
    """The legs of one request on its pool, within `deadline`; `tried`: the backends that
    failed it or broke it off, which no further leg goes to."""

    __slots__ = ("_deadline", "_exchange", "_outcome", "_request", "_tried")  # one per request

    def __init__(
        self,
        exchange: Serving,
        request: InferenceRequest,
        outcome: Outcome,
        *,
        tried: set[str],
        deadline: float,
    ) -> None:
        self._exchange = exchange
        self._request = request
        self._outcome = outcome
        self._tried = tried
        self._deadline = deadline

    async def serve(self, reservation: Reservation, *, preemptible: bool = True) -> Served:
        """Serve the request from the backend of `reservation`, which it holds, and while
        its stream breaks off, from others; the answer as the client got it. Unless it was
        preempted before (`preemptible` False), more urgent work may stop it once."""
        exchange, request = self._exchange, self._request
        # only a stream may be stopped: an answer sent whole cannot go on
        running = exchange.preemptible(request) if preemptible and request.stream else None
        if running is None:
            return await self._serve(reservation, None)
        try:
            return await self._serve(reservation, running)
        finally:
            exchange.left(running)

    async def _serve(self, reservation: Reservation, running: Running | None) -> Served:
        exchange, request = self._exchange, self._request
        stop = None if running is None else running.stop
        # why a stream cut mid-answer could not go on elsewhere; None: it can
        why_not = exchange.not_resumable(request) if request.stream else "not a stream"
        sent, headers = request, None
        if exchange.router.pools[request.pool].prefillers and not self._tried:
            # a retry prefills where it goes: the failure may have been the KV's transfer
            leg = await exchange.decode_leg(request, reservation, deadline=self._deadline)
            sent, headers = leg.request, leg.headers
        backend = exchange.router.backend(reservation.backend)
        started = exchange.clock.monotonic()
        try:
            relayed = await exchange.forward_held(
                sent,
                self._outcome,
                deadline=self._deadline,
                growth=exchange.growth(request, backend.block_size),
                resumable=why_not is None,
                upstream_headers=headers,
                stop=stop,
            )
        except UpstreamUnavailable as exc:
            if running is not None and running.stop.fired:
                return await self._requeued(running)
            # nothing reached the client: the exchange tries again elsewhere
            await exchange.failed(
                backend.name, exc.reason, self._tried, unreachable=exc.unreachable
            )
            raise
        served = Served(self._outcome, backend.name, request.pool, relayed, started)
        if relayed.cut is not None:
            if running is not None and running.stop.fired:
                return await self._go_on(served, relayed.cut, preempted=running)
            if running is not None:
                # its further legs carry no stop: entered still, a preemption would count
                # on room the stream never gives back
                exchange.left(running)
            return await self._go_on(served, relayed.cut)
        if running is not None and running.stop.fired and not relayed.completed:
            # a stream that could not go on ended with the preempted error event; its room
            # goes at once to the work that stopped it
            exchange.preempted(request, "ended")
            await exchange.held.release()
            return served
        if why_not is not None and request.stream and not relayed.completed:
            # cut, and ended with an error event: it could not go on
            exchange.metrics.stream_continuations_refused.labels(request.pool, why_not).inc()
            await exchange.broke_off(backend.name, self._tried)
        else:
            exchange.answered(backend, relayed.corrected)
        return served

    async def _requeued(self, running: Running) -> Served:
        """Serve the request again from the start, once room comes back in its pool: it was
        stopped before its first byte (nothing reached the client)."""
        exchange, request = self._exchange, self._request
        exchange.left(running)
        await exchange.held.release()
        if not await exchange.move(request) or exchange.held.reservation is None:
            # nothing reached the client: the rest of its pool's chain may serve it
            exchange.preempted(request, "passed_on")
            raise NoRoomToRetry(
                f"Pool {request.pool!r} gave this request's room to more urgent work and none "
                "came back in time; retry after the indicated delay.",
                retry_after=running.stop.retry_after,
            )
        exchange.preempted(request, "requeued")
        legs = Legs(exchange, request, self._outcome, tried=self._tried, deadline=self._deadline)
        return await legs.serve(exchange.held.reservation, preemptible=False)

    async def _resumed(
        self, partial: Partial, running: Running, cut: StreamCut
    ) -> InferenceRequest | None:
        """The continuation of the stream stopped at `partial`, holding room in the pool
        again after its wait, its client told why it paused. None (the stream ended with an
        error event that says when to retry) when none came back within the wait, or the
        request cannot go on."""
        exchange = self._exchange
        follow = continued(self._request, partial)
        paused = exchange.clock.monotonic()
        if follow is None or not await exchange.move(follow):
            exchange.preempted(self._request, "ended")
            await cut.relay.end(preempted_event(running.stop.retry_after))
            return None
        exchange.preempted(self._request, "continued")
        waited = exchange.clock.monotonic() - paused
        await cut.relay.comment(b"spillgate preempted; resumed after %.2f s" % waited)
        return follow

    async def _go_on(
        self, served: Served, cut: StreamCut, *, preempted: Running | None = None
    ) -> Served:
        """The legs after the first, each continuing the stream `served` broke off with
        `cut` on another backend (on its pool again, where the gateway `preempted` it);
        the stream as it ends."""
        exchange, request, tried = self._exchange, self._request, self._tried
        tries = exchange.router.pools[request.pool].settings.continue_streams
        if preempted is None:
            await exchange.broke_off(served.target, tried)
        else:  # its backend did nothing wrong: its room goes to the work that stopped it
            exchange.left(preempted)
            await exchange.held.release()
        count: asyncio.Task[int | None] | None = None  # the original prompt's tokens
        try:
            while True:
                partial = cut.relay.partial()
                if partial.finished or cut.relay.finished:  # broke off after its last token
                    await cut.finish()
                    return served.ended(completed=True)
                moved = preempted is not None  # counted as a preemption, not a continuation
                if preempted is not None:
                    follow = await self._resumed(partial, preempted, cut)
                    preempted = None
                    if follow is None:
                        return served.ended(completed=False)
                else:
                    follow, why = await self._follow(partial, tries)
                    if follow is None:
                        exchange.metrics.stream_continuations_refused.labels(
                            request.pool, why
                        ).inc()
                        await cut.fail()
                        return served.ended(completed=False)
                    tries -= 1
                held = exchange.held.backend
                assert held is not None
                backend = exchange.router.backend(held)
                if count is None:  # as the backend of the first continuation counts it
                    target = exchange.router.target(held, request.adapter)
                    count = asyncio.create_task(exchange.forwarder.prompt_tokens(target, request))
                growth = exchange.growth(follow, backend.block_size)
                leg = ContinuationLeg(partial)
                cut.relay.next_leg(leg, carried=partial.tokens, growth=growth, prompt=count)
                try:
                    relayed = await exchange.forward_held(
                        follow,
                        served.outcome,
                        deadline=self._deadline,
                        growth=growth,
                        relay=cut.relay,
                    )
                except UpstreamUnavailable as exc:
                    if not moved:
                        self._continued(result="failed")
                    await exchange.failed(
                        backend.name, exc.reason, tried, unreachable=exc.unreachable
                    )
                    continue  # from the same cut, on yet another backend
                if not moved:
                    self._continued(result="succeeded")
                served = Served(
                    served.outcome, backend.name, served.pool, relayed, served.started_at
                )
                if relayed.cut is None:
                    exchange.answered(backend, relayed.corrected)
                    return served
                cut = relayed.cut
                await exchange.broke_off(backend.name, tried)
        finally:
            if count is not None:
                count.cancel()

    def _continued(self, *, result: str) -> None:
        self._exchange.metrics.stream_continuations.labels(self._request.pool, result).inc()

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
