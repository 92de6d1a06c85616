"""The queue's order on a real router and ledger: class first, then the tenant served
least lately, and a full queue making room for a higher class."""

from __future__ import annotations

import asyncio

import pytest

from gateway.admission.routing.route import Route
from policies.queue.fair_queue import QueueResult
from tests.support.queue import CAPACITY, Setup, request, run, settle


def test_the_highest_class_gets_the_room_first() -> None:
    async def scenario(s: Setup) -> None:
        full = await s.router.reserve(Route("p", CAPACITY))
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


def test_a_full_queue_refuses_but_a_critical_request_displaces_a_sheddable_one() -> None:
    async def scenario(s: Setup) -> None:
        full = await s.router.reserve(Route("p", CAPACITY))
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


def test_sheddable_waiters_stay_off_the_reserved_headroom() -> None:
    async def scenario(s: Setup) -> None:
        first = await s.router.reserve(Route("p", 300))
        second = await s.router.reserve(Route("p", 300))
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


def test_a_queue_full_of_tokens_refuses_but_a_critical_request_displaces_sheddable_ones() -> None:
    async def scenario(s: Setup) -> None:
        full = await s.router.reserve(Route("p", CAPACITY))
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
        full = await s.router.reserve(Route("p", CAPACITY))
        assert full is not None
        heavy = asyncio.create_task(s.queue.wait(request(tenant="heavy"), s.exchange()))
        await settle()
        light = asyncio.create_task(s.queue.wait(request(tenant="light"), s.exchange()))
        await settle()
        assert s.queue.service.of("heavy") > s.queue.service.of("light")
        await s.router.release(full)
        room = await s.router.reserve(Route("p", CAPACITY - 100))  # room for one only
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
        holds = [await s.router.reserve(Route("p", 100)) for _ in range(10)]
        for hold in holds[:3]:  # releases 0.5 s apart, while the pool is busy
            assert hold is not None
            s.clock.advance(0.5)
            await s.router.release(hold)
        assert await s.router.reserve(Route("p", 300)) is not None  # full again
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
