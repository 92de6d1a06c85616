"""The per-request context on a real router and ledger, forwarding to fake upstreams on
loopback: where its reservation goes, what the client gets, and what a policy may do."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterator
from typing import Any

import orjson
import pytest

from gateway.admission.fleet.backends import build_pools
from gateway.admission.ledger.held import HeldReservation
from gateway.admission.ledger.reservations import LocalLedger
from gateway.admission.routing.route import Route
from gateway.admission.routing.router import Router
from gateway.clock import ManualClock
from gateway.config import BackendSettings, PoolSettings
from gateway.errors import UpstreamError
from gateway.front.exchange import Exchange
from gateway.metrics import GatewayMetrics
from gateway.outcome import Outcome
from gateway.upstream.answer import Usage
from gateway.upstream.forward import Forwarder
from gateway.upstream.pool import UpstreamPool
from tests.support.upstream import ANSWER, Client, FakeUpstream, chat_request, serving
from tests.support.upstream import run as serve

CAPACITY = 1000


@pytest.fixture(scope="module")
def urls() -> Iterator[dict[str, str]]:
    """A fake upstream that answers and two that fail with 503."""
    bad, worse = FakeUpstream(status=503), FakeUpstream(status=503)
    with serving(good=FakeUpstream(), bad=bad, worse=worse) as found:
        yield found


class Setup:
    def __init__(self, backend_urls: list[str], **pool: object) -> None:
        self.clock = ManualClock()
        backends = [BackendSettings(url=u, capacity=CAPACITY, block_size=1) for u in backend_urls]
        settings = [
            PoolSettings(name="big", backends=backends, target_fill=1.0, **pool),  # type: ignore[arg-type]
            PoolSettings(name="small", backends=backends[:1], max_model_len=64, target_fill=1.0),
        ]
        self.router = Router(
            build_pools(settings, clock=self.clock), ledger=LocalLedger(), clock=self.clock
        )
        self.metrics = GatewayMetrics()
        self.upstream = UpstreamPool(max_connections=4)
        self.client = Client()
        self.held = HeldReservation(self.router)
        self.exchange = Exchange(
            send=self.client.send,
            headers=[(b"x-ratelimit-limit-tokens", b"100")],
            router=self.router,
            forwarder=Forwarder(self.upstream, clock=self.clock),
            metrics=self.metrics,
            clock=self.clock,
            held=self.held,
        )

    def in_flight(self, backend: str) -> int:
        return self.router.ledger.tokens_in_flight(backend)

    def upstream_errors(self, backend: str, reason: str) -> float | None:
        return self.metrics.registry.get_sample_value(
            "spillgate_upstream_errors_total", {"target": backend, "reason": reason}
        )


def run(
    backend_urls: list[str], scenario: Callable[[Setup], Awaitable[None]], **pool: object
) -> None:
    serve(lambda: Setup(backend_urls, **pool), scenario)


def test_a_failure_before_the_first_byte_moves_the_reservation_to_another_backend(urls) -> None:
    async def scenario(s: Setup) -> None:
        request = chat_request()
        assert await s.exchange.admit(request)
        assert s.held.reservation is not None and s.held.reservation.backend == "big-0"
        served = await s.exchange.serve_local(request, Outcome.LOCAL)
        assert (served.outcome, served.target, served.pool) == (Outcome.LOCAL, "big-1", "big")
        assert served.relayed.usage == Usage(prompt_tokens=5, completion_tokens=2, known=True)
        assert s.held.reservation is not None and s.held.reservation.backend == "big-1"
        assert (s.in_flight("big-0"), s.in_flight("big-1")) == (0, request.sequence_tokens)
        assert s.upstream_errors("big-0", "status 503") == 1.0
        assert s.client.status == 200
        assert s.client.headers["x-spillgate-outcome"] == "local"
        assert s.client.headers["x-ratelimit-limit-tokens"] == "100"
        assert orjson.loads(s.client.body)["choices"][0]["message"]["content"] == ANSWER
        await s.exchange.release()
        assert s.held.reservation is None and s.in_flight("big-1") == 0

    run([urls["bad"], urls["good"]], scenario)


def test_when_every_backend_fails_the_client_gets_nothing_and_nothing_is_held(urls) -> None:
    async def scenario(s: Setup) -> None:
        request = chat_request()
        assert await s.exchange.admit(request)
        with pytest.raises(UpstreamError) as caught:
            await s.exchange.serve_local(request, Outcome.LOCAL)
        assert caught.value.retry_after == 1.0
        assert str(caught.value) == (
            "The backends of pool 'big' failed before answering "
            "(status 503; then no other backend of the pool to retry on)."
        )
        assert s.client.messages == []
        assert s.held.reservation is None
        assert (s.in_flight("big-0"), s.in_flight("big-1")) == (0, 0)
        assert s.upstream_errors("big-0", "status 503") == 1.0
        assert s.upstream_errors("big-1", "status 503") == 1.0

    run([urls["bad"], urls["worse"]], scenario)


def test_retries_end_at_the_pools_total_deadline_by_the_requests_clock(urls) -> None:
    """Three backends, the first two failing: the third would answer, but the second
    attempt ran to the end of `timeouts.total` on the request's Clock, so no third one
    is made."""

    async def scenario(s: Setup) -> None:
        total = s.router.pools["big"].settings.timeouts.total
        forward = s.exchange.forwarder.forward
        calls = 0

        async def second_runs_long(*args: Any, **kwargs: Any) -> Any:
            nonlocal calls
            calls += 1
            try:
                return await forward(*args, **kwargs)
            finally:
                if calls == 2:
                    s.clock.advance(total)

        s.exchange.forwarder.forward = second_runs_long  # type: ignore[method-assign]
        request = chat_request()
        assert await s.exchange.admit(request)
        with pytest.raises(UpstreamError):
            await s.exchange.serve_local(request, Outcome.LOCAL)
        assert calls == 2
        assert s.client.messages == []
        assert [s.in_flight(b) for b in ("big-0", "big-1", "big-2")] == [0, 0, 0]

    run([urls["bad"], urls["worse"], urls["good"]], scenario)


def test_a_sheddable_request_gets_no_room_past_the_pools_sheddable_fill(urls) -> None:
    async def scenario(s: Setup) -> None:
        held = await s.router.reserve(Route("big", 600))
        assert held is not None
        assert not await s.exchange.admit(chat_request(priority="sheddable"))
        assert s.held.reservation is None
        assert await s.exchange.admit(chat_request())  # the headroom is kept for it
        await s.exchange.release()
        await s.router.release(held)
        assert s.in_flight("big-0") == 0

    run([urls["good"]], scenario, sheddable_max_fill=0.5)


def test_held_room_from_elsewhere_is_released_with_the_request(urls) -> None:
    async def scenario(s: Setup) -> None:
        reservation = await s.exchange.reserve(chat_request())
        assert reservation is not None and s.held.reservation is None  # not held yet
        s.exchange.take(reservation)
        assert s.held.reservation == reservation
        await s.exchange.release()
        await s.exchange.release()  # once only: the second finds nothing to give back
        assert s.in_flight("big-0") == 0

    run([urls["good"]], scenario)


def test_the_headers_name_the_outcome_and_the_phases_timed(urls) -> None:
    async def scenario(s: Setup) -> None:
        s.exchange.note_time("queue", 0.25)
        assert s.exchange.headers(Outcome.QUEUED) == [
            (b"x-ratelimit-limit-tokens", b"100"),
            (b"x-spillgate-outcome", b"queued"),
            (b"server-timing", b"queue;dur=250.0"),
        ]

    run([urls["good"]], scenario)


def test_a_degraded_request_must_fit_the_smaller_models_context(urls) -> None:
    async def scenario(s: Setup) -> None:
        fits = s.exchange.degraded(chat_request(max_tokens=60), "small")
        assert fits is not None and fits.pool == "small"
        assert s.exchange.degraded(chat_request(max_tokens=61), "small") is None  # 4 + 61 > 64
        # what its answer's usage may say is bounded by the smaller model's context, not the
        # pool's it was asked of
        assert fits.model_context == 64
        from_big = s.exchange.degraded(chat_request(max_tokens=60, model_context=4096), "small")
        assert from_big is not None and from_big.model_context == 64

    run([urls["good"]], scenario)


def test_a_stopped_recording_sees_none_of_the_answer(urls) -> None:
    class Recorder:
        fed = 0

        def feed(self, data: bytes) -> None:
            self.fed += 1

        def finish(self, usage: Usage) -> None:
            self.fed += 1

    async def scenario(s: Setup) -> None:
        recorder = Recorder()
        s.exchange.recorder = recorder
        s.exchange.stop_recording()
        request = chat_request()
        assert await s.exchange.admit(request)
        await s.exchange.serve_local(request, Outcome.DEGRADED)
        await s.exchange.release()
        assert recorder.fed == 0
        assert s.client.headers["x-spillgate-outcome"] == "degraded"

    run([urls["good"]], scenario)
