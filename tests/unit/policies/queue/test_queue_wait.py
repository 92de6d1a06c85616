"""The queue on a real router and ledger: releases hand capacity over, nothing leaks."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any, Literal

import pytest

from gateway.admission.backends import build_pools
from gateway.admission.held import HeldReservation
from gateway.admission.ledger import LocalLedger
from gateway.admission.router import Router
from gateway.clock import ManualClock
from gateway.config import BackendSettings, PoolSettings, Priority, QueueSettings
from gateway.front.exchange import Exchange
from gateway.metrics import GatewayMetrics
from gateway.request import Endpoint, InferenceRequest
from gateway.upstream.forward import Forwarder
from gateway.upstream.pool import UpstreamPool
from policies.queue.fair_queue import QueueResult
from policies.queue.policy import AUTO_CEILING_S, AUTO_FLOOR_S, QueuePolicy
from tests.support.clock import run_on

CAPACITY = 1000
BACKEND = "p-0"


class Setup:
    def __init__(
        self,
        *,
        clock: ManualClock,
        max_depth: int = 8,
        max_wait_s: float | Literal["auto"] = 5.0,
        sheddable_max_fill: float = 1.0,
        max_tokens: int | None = None,
    ) -> None:
        self.clock = clock
        self.settings = PoolSettings(
            name="p",
            backends=[BackendSettings(url="http://127.0.0.1:9", capacity=CAPACITY, block_size=1)],
            target_fill=1.0,
            sheddable_max_fill=sheddable_max_fill,
            queue=QueueSettings(max_depth=max_depth, max_wait_s=max_wait_s, max_tokens=max_tokens),
        )
        pools = build_pools([self.settings], clock=self.clock)
        self.router = Router(pools, ledger=LocalLedger(), clock=self.clock)
        self.metrics = GatewayMetrics()
        self.upstream = UpstreamPool(max_connections=4)
        self.budgets: dict[str, float] = {}
        self.queue = QueuePolicy(
            self.settings,
            room=self.router,
            metrics=self.metrics,
            clock=self.clock,
            ttft_budgets_s=self.budgets,
        )

    def exchange(self) -> Exchange:
        async def no_send(message: Any) -> None:
            raise AssertionError("the queue never answers by itself")

        return Exchange(
            send=no_send,
            headers={},
            router=self.router,
            forwarder=Forwarder(self.upstream, clock=self.clock),
            metrics=self.metrics,
            clock=self.clock,
            held=HeldReservation(self.router),
        )

    def in_flight(self) -> int:
        return self.router.ledger.tokens_in_flight(BACKEND)


def request(
    tenant: str = "t",
    priority: Priority = "standard",
    tokens: int = 100,
    ttft_slo_s: float | None = None,
) -> Any:
    return InferenceRequest(
        endpoint=Endpoint.CHAT,
        tenant=tenant,
        pool="p",
        priority=priority,
        stream=False,
        client_wants_usage=False,
        prompt_chars=4,
        prompt_tokens=1,
        max_output_tokens=tokens - 1,
        body={},
        ttft_slo_s=ttft_slo_s,
    )


def run(scenario: Callable[[Setup], Awaitable[None]], **options: Any) -> None:
    clock = ManualClock()

    async def main() -> None:
        setup = Setup(clock=clock, **options)
        try:
            await scenario(setup)
        finally:
            await setup.upstream.aclose()

    run_on(clock, main)  # the loop's time is the queue's clock: no real waiting


async def settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


def test_a_release_hands_the_room_to_the_waiter() -> None:
    async def scenario(s: Setup) -> None:
        full = await s.router.reserve("p", CAPACITY)
        assert full is not None
        ex = s.exchange()
        waiting = asyncio.create_task(s.queue.wait(request(tokens=300), ex))
        await settle()
        assert len(s.queue) == 1 and not waiting.done()
        await s.router.release(full)
        assert await waiting is QueueResult.ADMITTED
        assert ex.held.reservation is not None
        assert s.in_flight() == 300 and len(s.queue) == 0
        await ex.held.release()
        assert s.in_flight() == 0

    run(scenario)


def test_the_highest_class_gets_the_room_first() -> None:
    async def scenario(s: Setup) -> None:
        full = await s.router.reserve("p", CAPACITY)
        assert full is not None
        tasks = {
            p: asyncio.create_task(s.queue.wait(request(priority=p, tokens=600), s.exchange()))
            for p in ("sheddable", "standard", "critical")
        }
        await settle()
        await s.router.release(full)
        await settle()
        assert tasks["critical"].done() and tasks["critical"].result() is QueueResult.ADMITTED
        assert not tasks["standard"].done() and not tasks["sheddable"].done()
        for task in tasks.values():
            task.cancel()
        await asyncio.gather(*tasks.values(), return_exceptions=True)

    run(scenario)


def test_a_cancelled_waiter_leaves_at_once_and_gets_nothing() -> None:
    async def scenario(s: Setup) -> None:
        full = await s.router.reserve("p", CAPACITY)
        assert full is not None
        ex = s.exchange()
        waiting = asyncio.create_task(s.queue.wait(request(), ex))
        await settle()
        waiting.cancel()
        await asyncio.gather(waiting, return_exceptions=True)
        assert waiting.cancelled() and len(s.queue) == 0
        await s.router.release(full)
        await settle()
        assert s.in_flight() == 0 and ex.held.reservation is None

    run(scenario)


def test_a_waiter_moves_on_at_its_tenants_ttft_budget() -> None:
    async def scenario(s: Setup) -> None:
        s.budgets["hurried"] = 0.05
        assert s.queue.max_wait_s(request(tenant="hurried")) == 0.05
        assert s.queue.max_wait_s(request(tenant="patient")) == 5.0
        full = await s.router.reserve("p", CAPACITY)
        assert full is not None
        started = s.clock.monotonic()
        result = await s.queue.wait(request(tenant="hurried"), s.exchange())
        assert result is QueueResult.EVICTED_DEADLINE
        assert s.clock.monotonic() - started == pytest.approx(0.05)  # not the pool's 5 s
        assert len(s.queue) == 0

    run(scenario)


def test_a_full_queue_refuses_but_a_critical_request_displaces_a_sheddable_one() -> None:
    async def scenario(s: Setup) -> None:
        full = await s.router.reserve("p", CAPACITY)
        assert full is not None
        shed = asyncio.create_task(s.queue.wait(request(priority="sheddable"), s.exchange()))
        std = asyncio.create_task(s.queue.wait(request(priority="standard"), s.exchange()))
        await settle()
        late = request(tenant="late", priority="sheddable")
        assert await s.queue.wait(late, s.exchange()) is QueueResult.REJECTED_FULL
        critical = asyncio.create_task(s.queue.wait(request(priority="critical"), s.exchange()))
        assert await shed is QueueResult.EVICTED_PREEMPTED
        await s.router.release(full)
        assert await critical is QueueResult.ADMITTED
        assert await std is QueueResult.ADMITTED

    run(scenario, max_depth=2)


def test_a_request_larger_than_any_backend_is_not_queued() -> None:
    async def scenario(s: Setup) -> None:
        result = await s.queue.wait(request(tokens=CAPACITY + 1), s.exchange())
        assert result is QueueResult.REJECTED_NEVER_FITS
        assert len(s.queue) == 0

    run(scenario)


def test_sheddable_waiters_stay_off_the_reserved_headroom() -> None:
    async def scenario(s: Setup) -> None:
        first = await s.router.reserve("p", 300)
        second = await s.router.reserve("p", 300)
        assert first is not None and second is not None
        ex = s.exchange()
        shed = asyncio.create_task(s.queue.wait(request(priority="sheddable"), ex))
        await settle()
        assert not shed.done()  # 400 tokens free, but the pool is past 50 %
        other = s.exchange()
        assert await other.admit(request(priority="standard"))  # headroom kept for others
        await other.held.release()
        await settle()
        assert not shed.done()  # 600 of 1000 held: still past 50 %
        await s.router.release(first)
        assert await shed is QueueResult.ADMITTED
        assert s.in_flight() == 400

    run(scenario, sheddable_max_fill=0.5)


def test_a_waiter_cancelled_just_as_room_frees_gets_nothing() -> None:
    async def scenario(s: Setup) -> None:
        full = await s.router.reserve("p", CAPACITY)
        assert full is not None
        ex = s.exchange()
        waiting = asyncio.create_task(s.queue.wait(request(), ex))
        await settle()
        await s.router.release(full)  # the drain is scheduled ...
        waiting.cancel()  # ... and the client leaves before it runs
        await asyncio.gather(waiting, return_exceptions=True)
        await settle()
        assert waiting.cancelled() and len(s.queue) == 0
        assert s.in_flight() == 0 and ex.held.reservation is None

    run(scenario)


def test_the_head_of_the_queue_is_not_overtaken_by_a_smaller_request() -> None:
    async def scenario(s: Setup) -> None:
        first = await s.router.reserve("p", 500)
        second = await s.router.reserve("p", 500)
        assert first is not None and second is not None
        big = asyncio.create_task(s.queue.wait(request(tenant="a", tokens=800), s.exchange()))
        await settle()
        small = asyncio.create_task(s.queue.wait(request(tenant="b", tokens=100), s.exchange()))
        await s.router.release(first)
        await settle()
        assert not big.done() and not small.done()  # 500 free: the head needs 800
        await s.router.release(second)
        assert await big is QueueResult.ADMITTED
        assert await small is QueueResult.ADMITTED
        assert s.in_flight() == 900

    run(scenario)


def test_an_auto_wait_is_twice_the_pools_average_answer_within_its_bounds() -> None:
    async def scenario(s: Setup) -> None:
        assert s.queue.max_wait_s(request()) == AUTO_FLOOR_S  # no answer has ended yet
        # the average hold moves a fifth of the way to each new one: 0.5, 1.2, 8.96, 15.168
        for hold_s, wait_s in ((0.5, AUTO_FLOOR_S), (4.0, 2.4), (40.0, 17.92), (40.0, 30.0)):
            held = await s.router.reserve("p", 10)
            assert held is not None
            s.clock.advance(hold_s)
            await s.router.release(held)
            assert s.queue.max_wait_s(request()) == pytest.approx(wait_s)
        assert AUTO_CEILING_S == 30.0
        s.budgets["hurried"] = 0.05
        assert s.queue.max_wait_s(request(tenant="hurried")) == 0.05

    run(scenario, max_wait_s="auto")


def test_an_auto_wait_lets_a_waiter_outwait_a_slow_pools_answers() -> None:
    async def scenario(s: Setup) -> None:
        first = await s.router.reserve("p", 10)
        assert first is not None
        s.clock.advance(6.0)  # the pool's answers take 6 s
        await s.router.release(first)
        full = await s.router.reserve("p", CAPACITY)
        assert full is not None
        ex = s.exchange()
        waiting = asyncio.create_task(s.queue.wait(request(), ex))
        await asyncio.sleep(5.0)  # past a fixed 2 s wait; the loop's time is the clock
        assert not waiting.done()
        await s.router.release(full)
        assert await waiting is QueueResult.ADMITTED
        await ex.held.release()

    run(scenario, max_wait_s="auto")


def test_a_queue_full_of_tokens_refuses_but_a_critical_request_displaces_sheddable_ones() -> None:
    async def scenario(s: Setup) -> None:
        full = await s.router.reserve("p", CAPACITY)
        assert full is not None
        shed = [
            asyncio.create_task(s.queue.wait(request(priority="sheddable"), s.exchange()))
            for _ in range(3)
        ]
        await settle()
        assert len(s.queue) == 3  # 300 of the 350 tokens the queue holds
        late = request(tenant="late", priority="sheddable")
        assert await s.queue.wait(late, s.exchange()) is QueueResult.REJECTED_FULL
        # 250 tokens: the two newest sheddable waiters make room, the oldest stays
        critical = asyncio.create_task(
            s.queue.wait(request(priority="critical", tokens=250), s.exchange())
        )
        assert await shed[2] is QueueResult.EVICTED_PREEMPTED
        assert await shed[1] is QueueResult.EVICTED_PREEMPTED
        await settle()
        assert not shed[0].done() and len(s.queue) == 2
        await s.router.release(full)
        assert await critical is QueueResult.ADMITTED
        assert await shed[0] is QueueResult.ADMITTED

    run(scenario, max_tokens=350)


def test_the_tenant_served_least_lately_gets_the_room_first() -> None:
    async def scenario(s: Setup) -> None:
        for _ in range(3):  # the heavy tenant's answers held the pool lately
            s.queue.admitted(request(tenant="heavy"))
        s.queue.admitted(request(tenant="light"))
        full = await s.router.reserve("p", CAPACITY)
        assert full is not None
        heavy = asyncio.create_task(s.queue.wait(request(tenant="heavy"), s.exchange()))
        await settle()
        light = asyncio.create_task(s.queue.wait(request(tenant="light"), s.exchange()))
        await settle()
        assert s.queue.service.of("heavy") > s.queue.service.of("light")
        await s.router.release(full)
        room = await s.router.reserve("p", CAPACITY - 100)  # room for one only
        assert room is not None
        await settle()
        assert light.done() and not heavy.done()
        await s.router.release(room)
        assert await heavy is QueueResult.ADMITTED

    run(scenario)


def test_settled_answers_correct_the_service_the_admissions_counted() -> None:
    async def scenario(s: Setup) -> None:
        r = request(tenant="a", tokens=100)  # 1 prompt token, 99 output
        s.queue.admitted(r)
        assert s.queue.service.of("a") == pytest.approx(1 + 4 * 99)
        s.queue.settled(r, 1, 9)
        assert s.queue.service.of("a") == pytest.approx(1 + 4 * 9)

    run(scenario)


def test_predicted_wait_counts_the_waiters_ahead_times_the_admission_interval() -> None:
    async def scenario(s: Setup) -> None:
        assert s.queue.predicted_wait_s(request()) is None  # nothing measured yet
        holds = [await s.router.reserve("p", 100) for _ in range(10)]
        for hold in holds[:3]:  # releases 0.5 s apart, while the pool is busy
            assert hold is not None
            s.clock.advance(0.5)
            await s.router.release(hold)
        assert await s.router.reserve("p", 300) is not None  # full again
        assert s.queue.predicted_wait_s(request()) == pytest.approx(0.5)  # none ahead
        waiting = [
            asyncio.create_task(s.queue.wait(request(tenant=t), s.exchange()))
            for t in ("a", "a", "b", "b")
        ]
        await settle()
        assert len(s.queue) == 4
        # before any admission from the queue: the release interval, per waiter ahead (a
        # newcomer goes after tenants of the same service)
        assert s.queue.predicted_wait_s(request(tenant="c")) == pytest.approx(0.5 * 4)
        assert s.queue.predicted_wait_s(request(tenant="a")) == pytest.approx(0.5 * 4)
        for hold in holds[3:5]:  # each release admits one waiter (a's, then b's), 2 s apart
            assert hold is not None
            s.clock.advance(2.0)
            await s.router.release(hold)
            await settle()
        assert len(s.queue) == 2
        released = s.queue.predicted_wait_s(request(tenant="c"))
        # c was never served: nobody is ahead of it, and it waits for the next release
        assert released is not None and 0.5 < released < 2.0
        # one admission interval measured, 2 s: a's own waiter is ahead of a patient one
        assert s.queue.predicted_wait_s(request(tenant="a")) == pytest.approx(2.0)
        # ... but not of one that must go sooner
        assert s.queue.predicted_wait_s(request(tenant="a", ttft_slo_s=0.1)) == released
        # a lower class waits behind both standard waiters
        sheddable = request(tenant="c", priority="sheddable")
        assert s.queue.predicted_wait_s(sheddable) == pytest.approx(2 * 2.0)
        # the ladder's prediction waits for the request's turn, not only for room
        room = s.router.wait_s("p", sheddable.sequence_tokens, sequences=sheddable.n)
        assert room < 2 * 2.0
        assert s.queue.predict_ttft_s(sheddable) == pytest.approx(2 * 2.0)
        for task in waiting:
            task.cancel()
        await asyncio.gather(*waiting, return_exceptions=True)

    run(scenario)
