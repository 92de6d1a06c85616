"""One client exchange: what the pipeline and the overflow policies use to answer a request."""

from __future__ import annotations

import functools
from collections.abc import Awaitable, Callable, Collection, Iterable, Sequence

from starlette.types import Send

from gateway.admission.fleet.backends import Backend
from gateway.admission.ledger.growth import Growth
from gateway.admission.ledger.held import HeldReservation
from gateway.admission.ledger.reservations import Reservation
from gateway.admission.routing.route import Route
from gateway.admission.routing.router import Router
from gateway.clock import Clock
from gateway.errors import NoRoomToRetry, UpstreamError, UpstreamTimeout, UpstreamUnavailable
from gateway.front.legs import Legs
from gateway.front.preemption import Preemptions, Running
from gateway.front.prefill import DecodeLeg, PrefillLeg, Split
from gateway.metrics import GatewayMetrics
from gateway.outcome import OUTCOME_HEADERS, Outcome
from gateway.request import InferenceRequest
from gateway.slo import Prediction
from gateway.upstream.answer import DONE, JSON_HEADERS, SSE_HEADERS, AnswerRecorder, Usage
from gateway.upstream.forward import Forwards, Leg
from gateway.upstream.relay import Relayed, StreamRelay, send_json_body
from gateway.upstream.resume import refusal
from gateway.upstream.retry import tried_again
from gateway.upstream.served import Served
from gateway.upstream.stop import Stop
from gateway.upstream.target import Target
from gateway.upstream.usage import Corrected

# what finds a request the gateway stopped room in its pool again (Ladder.move)
Mover = Callable[[InferenceRequest, "Exchange"], Awaitable[bool]]


class _NoRoom(UpstreamUnavailable):
    """No backend of the pool not yet tried has room for a retry."""


async def _no_room() -> None:
    """No room to reserve (a sheddable request past its pool's fill)."""


class Exchange:
    # one per request
    __slots__ = (
        "base_headers",
        "clock",
        "forwarder",
        "held",
        "metrics",
        "mover",
        "moving",
        "prediction",
        "preemptions",
        "prefill",
        "recorder",
        "router",
        "send",
        "stopped",
        "timings",
    )  # fmt: skip

    def __init__(
        self,
        *,
        send: Send,
        headers: Sequence[tuple[bytes, bytes]],
        router: Router,
        forwarder: Forwards,
        metrics: GatewayMetrics,
        clock: Clock,
        held: HeldReservation,
        recorder: AnswerRecorder | None = None,
        preemptions: Preemptions | None = None,
        mover: Mover | None = None,
    ) -> None:
        """`preemptions`: the requests in flight that more urgent work may stop; `mover`:
        what finds a stopped request room in its pool again (the ladder's `move`)."""
        self.send = send
        self.base_headers = headers
        self.router = router
        self.forwarder = forwarder
        self.metrics = metrics
        self.clock = clock
        self.held = held
        self.recorder = recorder
        self.timings: dict[str, float] = {}  # phase → seconds, told as `server-timing`
        # what the TTFT ladder predicted for the step now serving, if it weighed one
        self.prediction: Prediction | None = None
        # in a pool with prefill backends, whether a prefill backend computed its prompt
        self.prefill: Split | None = None
        self.preemptions = preemptions
        self.mover = mover
        # whether the request is one the gateway stopped and now finds room for again: its
        # service was counted when it was first admitted
        self.moving = False
        self.stopped: str | None = None  # what became of it, if the gateway stopped it

    def headers(self, outcome: Outcome) -> list[tuple[bytes, bytes]]:
        """The gateway's own response headers, as ASGI wants them."""
        headers = [*self.base_headers, OUTCOME_HEADERS[outcome]]
        if self.stopped is not None:  # stopped before its first byte: what became of it
            headers.append((b"x-spillgate-preempted", self.stopped.encode()))
        if self.timings:
            phases = (f"{name};dur={sec * 1000:.1f}" for name, sec in self.timings.items())
            headers.append((b"server-timing", ", ".join(phases).encode()))
        return headers

    def take(self, reservation: Reservation) -> None:
        """Hold `reservation`, made for this request by someone else (the queue's drain),
        as the one the request holds and releases."""
        self.held.take(reservation)

    def release(self) -> Awaitable[None]:
        """Give back the reservation the request holds, if any (no-op otherwise)."""
        return self.held.release()

    def stop_recording(self) -> None:
        """Leave this request's answer unrecorded (an answer the cache must not keep)."""
        self.recorder = None

    def note_time(self, phase: str, seconds: float) -> None:
        """Tell the client how long `phase` took, in the `server-timing` header."""
        self.timings[phase] = seconds

    def send_json(self, body: bytes, *, status: int, outcome: Outcome) -> Awaitable[Relayed]:
        """Answer the client with the JSON document `body`, told as `outcome`; what was
        relayed carries the usage the document tells (a cached answer's)."""
        return send_json_body(
            body,
            send=self.send,
            status=status,
            headers=[*JSON_HEADERS, *self.headers(outcome)],
            swap=None,
            recorder=None,
            clock=self.clock,
        )

    async def send_events(
        self, events: Iterable[bytes], *, outcome: Outcome, usage: Usage
    ) -> Relayed:
        """Answer a streaming client with the server-sent `events` (a kept answer replayed),
        told as `outcome`, and end the stream; `usage` is what the events carried."""
        send = self.send
        headers = [*SSE_HEADERS, *self.headers(outcome)]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        first_byte_at = self.clock.monotonic()
        for event in events:
            await send({"type": "http.response.body", "body": event, "more_body": True})
        await send({"type": "http.response.body", "body": DONE, "more_body": False})
        return Relayed(usage, first_byte_at, True)

    async def admit(self, request: InferenceRequest) -> bool:
        """Reserve room for `request` in its pool; True if it now holds a reservation."""
        return self.held.take(await self.reserve(request))

    def reserve(
        self, request: InferenceRequest, *, exclude: Collection[str] = (), running: bool = False
    ) -> Awaitable[Reservation | None]:
        """Room for `request` in its pool, not yet held, to await; None if there is none.
        Never on a backend the request avoids (a Responses continuation goes only where its
        previous response is stored).

        A sheddable request gets none once the pool's fill reaches `sheddable_max_fill`:
        the rest is headroom kept for critical and standard requests. (Not a coroutine
        itself: it hands back the router's, one frame fewer on every admission.)
        """
        pool = self.router.pools[request.pool].settings
        if (
            request.priority == "sheddable"
            and not running
            and (self.router.pool_fill(request.pool) >= pool.sheddable_max_fill)
        ):
            return _no_room()
        return self.router.reserve(Route.of(request, exclude=exclude, running=running))

    def retry_after(self, request: InferenceRequest) -> float:
        """Seconds until `request`'s pool is likely to have room for it: a refusal's
        `Retry-After`."""
        return self.router.retry_after(request.pool, request.sequence_tokens, sequences=request.n)

    async def serve_local(self, request: InferenceRequest, outcome: Outcome) -> Served:
        """Forward to the backend the request holds a reservation on.

        A failure before the first byte moves the reservation to another backend of the pool,
        within the pool's total deadline: the tries together never outlast it
        (gateway/upstream/retry.py).
        """
        tried: set[str] = set()
        total_s = self.router.pools[request.pool].settings.timeouts.total
        deadline = self.clock.monotonic() + total_s
        try:
            # the first try runs bare: the retries are only set up once one is needed
            return await self._attempt(request, outcome, tried, deadline=deadline)
        except UpstreamUnavailable as exc:
            first = exc
        try:
            return await tried_again(
                functools.partial(self._attempt, request, outcome, tried, deadline=deadline),
                deadline=deadline,
                clock=self.clock,
            )
        except UpstreamUnavailable as last:
            # the tries found every backend of the pool unreachable: that is an outage,
            # told as later requests are told it, not a failed answer
            outage = self.router.pools[request.pool].outage()
            if outage is not None:
                raise outage from None
            error = UpstreamTimeout if last.timed_out else UpstreamError
            if isinstance(last, _NoRoom):
                error = NoRoomToRetry
            raise error(
                f"The backends of pool {request.pool!r} failed before answering "
                f"({first.reason}; then {last.reason}).",
                retry_after=1.0,
            ) from None

    async def _attempt(
        self, request: InferenceRequest, outcome: Outcome, tried: set[str], *, deadline: float
    ) -> Served:
        if self.held.reservation is None and tried:
            # a retry: room on a backend not yet tried, under the same rules as admission
            self.held.take(await self.reserve(request, exclude=tried))
        reservation = self.held.reservation
        if reservation is None:
            if self.router.candidates(Route.of(request, exclude=tried)):
                raise _NoRoom("no backend of the pool has room to retry")
            raise UpstreamUnavailable("no other backend of the pool to retry on")
        return await Legs(self, request, outcome, tried=tried, deadline=deadline).serve(reservation)

    async def decode_leg(
        self, request: InferenceRequest, reservation: Reservation, *, deadline: float
    ) -> DecodeLeg:
        """What the decode leg of `request` sends, its prefill leg run first where the
        pool's rule says so (gateway/front/prefill.py)."""
        prefill = PrefillLeg(
            router=self.router, forwarder=self.forwarder, metrics=self.metrics, clock=self.clock
        )
        leg = await prefill.run(request, reservation, deadline=deadline)
        self.prefill = leg.split
        if leg.prefill_s is not None:
            self.note_time("prefill", leg.prefill_s)
        return leg

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
    ) -> Awaitable[Relayed]:
        """Forward `request` to the backend it holds its reservation on, its answer relayed
        to the client as `outcome` (on `relay`: as the next leg of a stream cut before), with
        `upstream_headers` besides the gateway's own (a decode leg's request id); `stop` may
        stop it (preemption)."""
        held = self.held.backend
        assert held is not None
        leg = Leg(
            target=self.router.target(held, request.adapter),
            request=request,
            public_model=request.adapter or request.pool,
            send=self.send,
            headers=self.headers(outcome),
            recorder=self.recorder,
            deadline=deadline,
            upstream_headers=upstream_headers,
            growth=growth,
            resumable=resumable,
            relay=relay,
            stop=stop,
        )
        return self.forwarder.forward(leg)

    def preemptible(self, request: InferenceRequest) -> Running | None:
        """`request`, entered with the requests more urgent work may stop, if it may be."""
        if self.preemptions is None or self.stopped is not None:
            return None
        return self.preemptions.enter(request, self.held)

    def left(self, running: Running) -> None:
        """`running` no longer runs as it was entered: stopped, or ended."""
        assert self.preemptions is not None
        self.preemptions.leave(running)

    async def move(self, request: InferenceRequest) -> bool:
        """Find room again in its pool for `request`, stopped for more urgent work: whether
        it now holds a reservation."""
        if self.mover is None:
            return False
        self.moving = True
        try:
            return await self.mover(request, self)
        finally:
            self.moving = False

    def preempted(self, request: InferenceRequest, result: str) -> None:
        """`request` was stopped for more urgent work, and `result` became of it."""
        self.stopped = result
        self.metrics.preemptions.labels(request.pool, request.priority, result).inc()

    def not_resumable(self, request: InferenceRequest) -> str | None:
        """Why `request`'s stream, cut mid-answer, could not go on on another backend (`off`:
        its pool never continues streams); None when it can."""
        if self.router.pools[request.pool].settings.continue_streams == 0:
            return "off"
        return refusal(request)

    async def failed(
        self, name: str, reason: str, tried: set[str], *, unreachable: str | None = None
    ) -> None:
        """Backend `name` failed this request before its first byte: counted against it,
        not tried again, and the request's reservation on it given back."""
        self.router.backend(name).record_failure(
            self.clock.monotonic(), reason=reason, unreachable=unreachable
        )
        await self._leave(name, reason, tried)

    async def _leave(self, name: str, reason: str, tried: set[str]) -> None:
        self.metrics.upstream_errors.labels(name, reason.split(":")[0]).inc()
        tried.add(name)
        await self.held.release()

    async def broke_off(self, name: str, tried: set[str]) -> None:
        """Backend `name` broke off a stream mid-answer: most likely it is going away (a
        restart, a drain, a crash), so it drains: no new request until a probe finds it
        serving again (gateway/admission/fleet/health.py)."""
        self.router.backend(name).broke_off()
        await self._leave(name, "mid-stream", tried)

    def answered(self, backend: Backend, corrected: Corrected | None = None) -> None:
        """`backend` answered this request in full: its failures in a row start again.
        Unless its usage told what cannot be true (`corrected.lies`): a backend that lies
        there is broken or hostile, and fails as one that answers junk does."""
        now = self.clock.monotonic()
        if corrected is None or not corrected.lies:
            backend.record_success(now)
            return
        backend.record_failure(now, reason=f"usage: {', '.join(corrected.flaws)}")
        self.metrics.upstream_errors.labels(backend.name, "usage").inc()

    def growth(self, request: InferenceRequest, block_size: int) -> Growth | None:
        """What grows a streaming request's reservation with its answer (in `learned`
        mode; `max_tokens` mode reserves the whole answer up front)."""
        settings = self.router.pools[request.pool].settings.reservation
        if not request.stream or settings.mode != "learned":
            return None
        return Growth(
            held=self.held,
            prompt_tokens=request.prompt_tokens,
            sequences=request.n,
            block_size=block_size,
            headroom=request.headroom,
        )

    async def serve_target(
        self, target: Target, request: InferenceRequest, *, outcome: Outcome, public_model: str
    ) -> Served:
        """Forward once to a target outside the pools (an external provider)."""
        started = self.clock.monotonic()
        leg = Leg(
            target=target,
            request=request,
            public_model=public_model,
            send=self.send,
            headers=self.headers(outcome),
            recorder=self.recorder,
        )
        relayed = await self.forwarder.forward(leg)
        return Served(
            outcome=outcome,
            target=target.name,
            pool=request.pool,
            relayed=relayed,
            started_at=started,
        )

    def degraded(
        self, request: InferenceRequest, pool: str, *, adapter: str | None = None
    ) -> InferenceRequest | None:
        """`request` sent to `pool` instead, asking there for its `adapter` in place of the
        one it asks for here; None if that pool's model cannot hold it, or the request asks
        for an adapter and no `adapter` stands in for it."""
        if request.adapter is not None and adapter is None:
            return None
        if request.context_tokens > self.router.pools[pool].max_model_len:
            return None
        # its answer's usage is bounded by the context of the model that gives it
        return request._replace(
            pool=pool, adapter=adapter, model_context=self.router.pools[pool].model_context
        )
